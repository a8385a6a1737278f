"""SmolLM2-135M on CPU: one 64-token prefill and batch-1 decode steps, base linears on the runtime's
CPU GEMM (--gemm cublas, the default) vs TVM's own CPU matmul (--gemm tvm).

  python scripts/bench_cpu_e2e.py [--gemm cublas tvm] [--prompt-len 64] [--steps 8] [--workdir DIR]

Compiles into --workdir/<gemm> (kept: a second run reuses it) and prints seconds per prefill and
per decode step (median), and whether both backends produce the same greedy tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from harness.timing import wall_time


def run(model_dir: Path, prompt_len: int, steps: int):
    """(seconds per prefill of `prompt_len` tokens, median seconds per batch-1 decode step, the greedy
    tokens): prefill into a fresh cache, one warm-up sample of each; decode continues the last prefill."""
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    runner = ModelRunner(model_dir)
    prompt = (np.arange(prompt_len) * 37 % 5000 + 100).tolist()
    state = {}

    def fresh_cache():
        kv = runner.create_pool(max_batch_size=1, max_total_seq_len=prompt_len + steps + 8,
                                    prefill_chunk_size=prompt_len)
        kv.add_sequence(0)
        return kv

    def prefill(kv):
        state["kv"], state["tokens"] = kv, [int(runner.prefill(kv, [0], [prompt]).numpy()[0].argmax())]

    def decode():
        state["tokens"].append(int(runner.decode(state["kv"], [0], [state["tokens"][-1]]).numpy()[0].argmax()))

    prefill_s = wall_time(prefill, setup=fresh_cache, repeat=1, warmup=1)
    decode_s = wall_time(decode, repeat=steps, warmup=1)
    return prefill_s, decode_s, state["tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm", nargs="+", default=["cublas", "tvm"], choices=["cublas", "tvm"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "mlc_lora_bench_cpu_e2e"))
    args = p.parse_args()

    from mlc_lora.compile import CompileOptions, compile_model  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel

    results = {}
    for gemm in args.gemm:
        out = Path(args.workdir) / gemm
        if not (out / CONFIG_FILE).exists():
            compile_model("smollm2-135m", out, CompileOptions(target="llvm", gemm=gemm, max_batch_size=4,
                                                              prefill_chunk_size=args.prompt_len))
        results[gemm] = run(out, args.prompt_len, args.steps)
        pre, dec, _ = results[gemm]
        print(f"gemm={gemm:6s}  prefill {args.prompt_len} tokens: {pre:7.3f} s   decode step (batch 1): "
              f"{dec * 1e3:8.1f} ms", flush=True)
    if len(results) == 2:
        (pa, da, ta), (pb, db, tb) = results.values()
        print(f"speed-up {args.gemm[0]} over {args.gemm[1]}: prefill {pb / pa:.1f}x, decode {db / da:.1f}x; "
              f"same greedy tokens: {ta == tb}")


if __name__ == "__main__":
    main()
