"""1 GPU vs K GPUs side by side: the same model compiled unsharded and with --tensor-parallel-shards K.

  # on a machine with 2 GPUs (docs/TP.md); NCCL_NVLS_ENABLE=0 is set by mlc_lora.runner itself
  python scripts/bench_tp.py --model /path/to/Llama-3-8B-hf --shards 2 --num-prompts 256 \
      --max-output-len 128 --out docs/results/tp_llama3_8b.json

Compiles (once, into --work) `--target cuda` libraries for 1 and K shards, then for each: batch-1
decode latency (ms per token over --decode-tokens greedy tokens of one request) and offline
throughput on ShareGPT requests sampled as scripts/bench_throughput.py does (scripts/harness:
workload.sample_requests, offline.run_mlc), optionally with --adapters PEFT folders spread
round-robin over the requests.
Prints one table and writes the figures as JSON. Not run by CI (it needs K GPUs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness import cli, offline
from harness.workload import sample_requests


def compile_variants(model: str, work: Path, shards: int, a) -> dict[int, Path]:
    from mlc_lora.compile import CompileOptions, compile_model  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel

    out = {}
    for k in (1, shards):
        folder = work / f"tp{k}"
        if not (folder / CONFIG_FILE).is_file():
            cpu = a.device == "cpu"
            compile_model(model, folder, CompileOptions(
                target="llvm" if cpu else "cuda", dtype="float32" if cpu else a.dtype,
                max_batch_size=a.max_num_seqs, tensor_parallel_shards=k,
                max_lora_rank=a.max_lora_rank, lora_pool_pages=a.lora_pool_pages if a.max_lora_rank else 0,
                lora_kernel=a.lora_kernel))
        out[k] = folder
    return out


def decode_latency(folder: Path, device: str, prompt: list[int], n: int, adapter: str | None) -> float:
    """ms per generated token of one greedy request (batch 1), after a warm-up request."""
    from mlc_lora import MLCEngine  # pylint: disable=import-outside-toplevel

    with MLCEngine(folder, device) as eng:
        name = None
        if adapter:
            eng.load_adapter("a0", adapter)
            name = "a0"
        eng.completions.create(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, adapter_id=name)
        t = time.perf_counter()
        eng.completions.create(prompt=prompt, max_tokens=1, temperature=0, ignore_eos=True, adapter_id=name)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        eng.completions.create(prompt=prompt, max_tokens=n + 1, temperature=0, ignore_eos=True, adapter_id=name)
        total = time.perf_counter() - t
    return (total - prefill) / n * 1e3


def throughput(folder: Path, device: str, requests, max_num_seqs: int, adapters: list[str]) -> dict:
    elapsed, stats = offline.run_mlc(folder, device, requests, max_num_seqs, adapters)
    return dict(seconds=elapsed, **offline.rates(elapsed, requests), steps=stats.get("num_steps"),
                peak_batch=stats.get("max_running"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder, .gguf or embedded name")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--work", default="build/bench_tp", help="where the compiled libraries go")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke run of this script (llvm, float32, numpy collectives); no timing value")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--max-lora-rank", type=int, default=0)
    ap.add_argument("--lora-pool-pages", type=int, default=4096)
    ap.add_argument("--lora-kernel", default="sgmv")
    ap.add_argument("--adapters", nargs="*", default=[], help="PEFT folders (needs --max-lora-rank)")
    ap.add_argument("--out", default=None, help="write the figures here (JSON)")
    a = ap.parse_args(argv)
    if a.shards < 2:
        sys.exit("--shards must be >= 2 (it is compared with 1)")
    from mlc_lora.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

    folders = compile_variants(a.model, Path(a.work), a.shards, a)
    requests = sample_requests(Tokenizer(folders[1]), a.num_prompts, 0, a.max_output_len,
                               max_prompt_len=a.max_prompt_len)
    prompt = requests[0][0]
    rows = {}
    for k, folder in folders.items():
        rows[k] = dict(decode_ms_per_token=decode_latency(folder, a.device, prompt, a.decode_tokens,
                                                          a.adapters[0] if a.adapters else None),
                       **throughput(folder, a.device, requests, a.max_num_seqs, a.adapters))
    print(f"{'':28s}" + "".join(f"{f'{k} shard' + ('s' if k > 1 else '') + (' (GPUs)' if a.device == 'cuda' else ' (cpu)'):>20s}" for k in rows))
    for key in ("decode_ms_per_token", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "peak_batch"):
        print(f"{key:28s}" + "".join(f"{rows[k][key]:20.2f}" for k in rows))
    if a.out:
        cli.write_results(Path(a.out), dict(model=a.model, shards=a.shards, device=a.device, requests=len(requests),
                                            adapters=a.adapters, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
