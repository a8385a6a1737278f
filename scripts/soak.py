"""Memory under long varied traffic, and the VM allocator choice behind it.

  python scripts/soak.py alloc MODEL_DIR [--lengths 26] [--device cpu]
      One fresh process per memory plan runs the same prompts of distinct lengths through
      ModelRunner (prefill, then 4 decode steps): "pooled" (TVM's pooled allocator), "naive" (each
      buffer freed when released) and "bucketed" (pooled, with every prefill cut into power-of-two
      pieces so that the allocator sees at most log2(chunk) + 1 prefill sizes). Prints the seconds
      per prefill token, per decode step and the resident memory each plan added after warm-up.

  python scripts/soak.py engine MODEL_DIR [--minutes 60] [--device cpu] [--adapters 4] [--json OUT]
      LLMEngine under steady varied traffic for --minutes: prompts of random lengths, requests on
      random adapters (seeded random PEFT adapters of rank 4..16) and on the base model, some
      aborted mid-stream (a client that went away), an adapter unloaded and loaded again and one
      pinned and unpinned while requests run. Every round ends idle: the pool must hold only its
      pinned adapters and no KV page. Prints per round the requests served, tokens per second,
      resident memory (and on CUDA the device memory in use) against the first round after
      warm-up; exits 1 if memory grew past --rss-margin-mb or a round did not end idle.

MODEL_DIR: a compiled folder (the engine mode needs one compiled with LoRA, e.g.
`mlc_lora compile smollm2-135m -o DIR --target llvm --max-lora-rank 16 --lora-pool-pages 256`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PLANS = ("pooled", "naive", "bucketed")
DECODE_STEPS = 4


def rss_mb() -> float:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    import resource  # pylint: disable=import-outside-toplevel

    return pages * resource.getpagesize() / 2**20


def device_mb(device: str) -> float | None:
    """Device memory in use on `device` (CUDA: total - free, as nvidia-smi counts it), else None."""
    if not device.startswith("cuda"):
        return None
    import ctypes  # pylint: disable=import-outside-toplevel

    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cudart = ctypes.CDLL("libcudart.so")
    cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    return (total.value - free.value) / 2**20


def pieces(n: int) -> list[int]:
    """`n` as descending powers of two (the bucketed plan's prefill calls)."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def run_plan(model_dir: str, plan: str, num_lengths: int, device: str, seed: int) -> dict:
    """One plan in this process: warm-up lengths, then `num_lengths` new distinct lengths."""
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    # "default": what a runner on `device` uses unless told (mlc_lora.runner.device.default_allocator)
    allocator = {"default": None, "naive": "naive"}.get(plan, "pooled")
    runner = ModelRunner(model_dir, device, allocator=allocator)
    chunk = runner.compiled.prefill_chunk_size
    pool = runner.create_pool(1, 2 * chunk + 64, chunk)
    rng = np.random.default_rng(seed)
    vocab = runner.vocab_size
    warm = [chunk // 8, chunk // 4]
    lengths = [int(x) for x in rng.choice(np.arange(17, chunk), num_lengths, replace=False) if x not in warm]

    def one(n: int) -> tuple[float, float]:
        prompt = rng.integers(0, vocab, n).tolist()
        pool.add_sequence(0)
        t0 = time.perf_counter()
        if plan == "bucketed":
            done = 0
            for p in pieces(n):
                logits = runner.prefill(pool, [0], [prompt[done:done + p]])
                done += p
        else:
            logits = runner.prefill(pool, [0], [prompt])
        tok = int(logits.numpy()[0].argmax())
        t1 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            tok = int(runner.decode(pool, [0], [tok]).numpy()[0].argmax())
        t2 = time.perf_counter()
        pool.remove_sequence(0)
        return t1 - t0, (t2 - t1) / DECODE_STEPS

    for n in warm:
        one(n)
    rss0, dev0 = rss_mb(), device_mb(device)
    prefill_s, decode_s, tokens = 0.0, [], 0
    for n in lengths:
        p, d = one(n)
        prefill_s += p
        decode_s.append(d)
        tokens += n
    rss1, dev1 = rss_mb(), device_mb(device)
    again = sum(one(n)[0] for n in lengths)  # the same lengths a second time: every size seen
    out = dict(plan=plan, allocator=runner.allocator, lengths=len(lengths), prefill_ms_per_token=1e3 * prefill_s / tokens,
               prefill_ms_per_token_again=1e3 * again / tokens,
               decode_ms_per_step=1e3 * statistics.median(decode_s), rss_warm_mb=rss0,
               rss_growth_mb=rss1 - rss0, rss_after_repeat_mb=rss_mb() - rss0)
    if dev0 is not None:
        out["device_growth_mb"] = dev1 - dev0
    return out


def plan_in_subprocess(model_dir, plan: str, lengths: int, device: str = "cpu", seed: int = 0) -> dict:
    """`run_plan` in a fresh process: every plan starts from the same resident memory."""
    cmd = [sys.executable, __file__, "_plan", str(model_dir), plan, str(lengths), device, str(seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def alloc_main(args) -> int:
    rows = [plan_in_subprocess(args.model_dir, plan, args.lengths, args.device, args.seed) for plan in args.plans]
    print(f"{'plan':10} {'ms/token prefill':>17} {'(repeat)':>9} {'ms/decode step':>15} "
          f"{'RSS +MB':>8} {'(repeat)':>9}" + ("  device +MB" if args.device != "cpu" else ""))
    for r in rows:
        print(f"{r['plan']:10} {r['prefill_ms_per_token']:17.3f} {r['prefill_ms_per_token_again']:9.3f} "
              f"{r['decode_ms_per_step']:15.2f} {r['rss_growth_mb']:8.0f} {r['rss_after_repeat_mb']:9.0f}"
              + (f"  {r['device_growth_mb']:11.0f}" if "device_growth_mb" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_plan":
        model_dir, plan, n, device, seed = sys.argv[2:7]
        print(json.dumps(run_plan(model_dir, plan, int(n), device, int(seed))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("alloc", help="the VM memory plans on prompts of distinct lengths")
    a.add_argument("model_dir")
    a.add_argument("--lengths", type=int, default=26, help="distinct prompt lengths after warm-up")
    a.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    a.add_argument("--device", default="cpu")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if args.mode == "alloc":
        return alloc_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
