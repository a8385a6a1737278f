"""Offline throughput on ShareGPT prompts, sampled as vLLM's benchmark_throughput.py does.

  python scripts/bench_throughput.py --num-prompts 32 --max-output-len 64 --backend both

Requests: the first human->gpt turn of each conversation (dataset shuffled with seed 0); prompts
and completions under 4 tokens are dropped, as are prompts over 1024 tokens or prompt + completion
over 2048; each request generates exactly the reference completion's length (EOS ignored),
optionally capped with --max-output-len (and prompts cut with --max-prompt-len). `--backend hf` runs
the same requests through HF transformers (batched generate, like vLLM's `--backend hf`); `both`
runs both and prints the ratio. Multi-LoRA on a GPU: scripts/bench_lora_throughput.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness import offline
from harness.cli import tqdm
from harness.workload import sample_requests


def run_hf(hf_model, requests, max_batch_size):
    """vLLM's run_hf: batches in arrival order while prompt + output fit 2048 tokens, left padding."""
    import torch  # pylint: disable=import-outside-toplevel

    torch.manual_seed(0)
    bar = tqdm(total=len(requests), desc="hf", unit="req")
    start = time.perf_counter()
    i = 0
    while i < len(requests):
        batch = [requests[i]]
        max_p, max_o = len(requests[i][0]), requests[i][1]
        while i + len(batch) < len(requests) and len(batch) < max_batch_size:
            p, o = requests[i + len(batch)]
            if max(max_p, len(p)) + max(max_o, o) > 2048:
                break
            batch.append((p, o))
            max_p, max_o = max(max_p, len(p)), max(max_o, o)
        ids = torch.zeros(len(batch), max_p, dtype=torch.long)
        mask = torch.zeros(len(batch), max_p, dtype=torch.long)
        for r, (p, _) in enumerate(batch):
            ids[r, max_p - len(p):] = torch.tensor(p)
            mask[r, max_p - len(p):] = 1
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                    top_p=1.0, top_k=0, max_new_tokens=max_o, min_new_tokens=max_o,
                                    pad_token_id=0, use_cache=True)
        assert out.shape[1] == max_p + max_o
        i += len(batch)
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    return elapsed


def load_hf(model: str):
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    from mlc_lora.loader.source import EMBEDDED  # pylint: disable=import-outside-toplevel

    path = EMBEDDED[model]() if model in EMBEDDED else Path(model)
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="for mlc_lora: compiled folder, embedded name, HF folder or .gguf")
    ap.add_argument("--hf-model", default=None, help="for --backend hf: HF folder or .gguf (default: --model)")
    ap.add_argument("--backend", choices=["mlc", "hf", "both"], default="mlc")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-output-len", type=int, default=None, help="cap each request's output length")
    ap.add_argument("--max-prompt-len", type=int, default=None,
                    help="truncate each sampled prompt (after vLLM's filtering) to keep CPU runs short")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="mlc_lora's batch limit")
    ap.add_argument("--hf-max-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from mlc_lora.compile import resolve_compiled  # pylint: disable=import-outside-toplevel
    from mlc_lora.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

    compiled = resolve_compiled(a.model, a.device)
    requests = sample_requests(Tokenizer(compiled), a.num_prompts, a.seed, a.max_output_len,
                               max_prompt_len=a.max_prompt_len)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens")
    rates = {}
    if a.backend in ("mlc", "both"):
        elapsed, stats = offline.run_mlc(compiled, a.device, requests, a.max_num_seqs)
        rates["mlc"] = offline.report("mlc_lora", elapsed, requests)
        print(f"  engine: {stats['num_steps']} steps, peak batch {stats['max_running']}, "
              f"{stats['num_preemptions']} preemptions")
    if a.backend in ("hf", "both"):
        elapsed = run_hf(load_hf(a.hf_model or a.model), requests, a.hf_max_batch_size)
        rates["hf"] = offline.report("hf transformers", elapsed, requests)
    if len(rates) == 2:
        print(f"mlc_lora / hf throughput ratio: {rates['mlc'] / rates['hf']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
