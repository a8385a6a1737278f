"""Offline runs through AsyncMLCEngine, as vLLM's benchmark_throughput runs them: every request
submitted at once, each generating exactly its requested length (EOS ignored, temperature 1, top_p
1, seeded by its prompt length), timed by the host clock from the first submission to the last
completion.
"""

from __future__ import annotations

import asyncio
import gc
import time

from .cli import tqdm


def release() -> None:
    """Hand what a finished run freed (its pool, activations, the VM's cached buffers, torch's
    cached blocks) back to the device, so that each config of a process starts from the same
    allocator state, not from the buffers and cached memory of the configs before it."""
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.runner import _tvm  # pylint: disable=import-outside-toplevel

    gc.collect()
    _tvm().get_global_func("vm.builtin.memory_manager.clear")()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stats_delta(after, before):
    """What an engine's stats() gained over a run: after - before over nested dicts of numbers
    (keys missing before count as 0)."""
    if isinstance(after, dict):
        return {k: stats_delta(v, (before or {}).get(k)) for k, v in after.items()}
    return after - (before or 0)


def drive(engine, requests, adapters=None, desc: str = "mlc_lora") -> float:
    """Seconds to run [(prompt_ids, output_len)] on an open AsyncMLCEngine; request i uses adapter
    adapters[i] (None or absent: the base model)."""
    adapters = adapters or [None] * len(requests)
    bar = tqdm(total=len(requests), desc=desc, unit="req")

    async def one(p, n, adapter):
        r = await engine.completions.create(prompt=p, max_tokens=n, temperature=1.0, top_p=1.0,
                                            ignore_eos=True, seed=len(p), adapter_id=adapter)
        bar.update()
        return r.usage.completion_tokens

    async def run():
        return await asyncio.gather(*[one(p, n, ad) for (p, n), ad in zip(requests, adapters)])

    start = time.perf_counter()
    produced = asyncio.run(run())
    elapsed = time.perf_counter() - start
    bar.close()
    if produced != [n for _, n in requests]:
        raise RuntimeError("a request did not produce its requested length")
    return elapsed


def run_mlc(model, device, requests, max_num_seqs=None, adapters=None):
    """(seconds, engine stats) of `requests` on a fresh AsyncMLCEngine of `model`; `adapters`:
    PEFT folders loaded as a0, a1, ... and given to the requests round-robin."""
    from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

    with AsyncMLCEngine(model, device, max_num_seqs=max_num_seqs) as engine:
        names = []
        for i, path in enumerate(adapters or []):
            asyncio.run(engine.load_adapter(f"a{i}", path))
            names.append(f"a{i}")
        assign = [names[j % len(names)] for j in range(len(requests))] if names else None
        elapsed = drive(engine, requests, assign)
        stats = asyncio.run(engine.stats())
    return elapsed, stats


def rates(elapsed: float, requests) -> dict:
    """requests/s, total and output tokens/s of `requests` done in `elapsed` seconds."""
    n_out = sum(n for _, n in requests)
    n_in = sum(len(p) for p, _ in requests)
    return dict(requests_per_s=len(requests) / elapsed, total_tokens_per_s=(n_in + n_out) / elapsed,
                output_tokens_per_s=n_out / elapsed)


def report(name: str, elapsed: float, requests) -> float:
    """Print vLLM's throughput line; returns requests/s."""
    r = rates(elapsed, requests)
    print(f"{name}: {elapsed:.2f} s, {r['requests_per_s']:.2f} requests/s, "
          f"{r['total_tokens_per_s']:.1f} total tokens/s, {r['output_tokens_per_s']:.1f} output tokens/s")
    return r["requests_per_s"]
