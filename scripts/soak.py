"""Memory under long varied traffic, and the VM allocator choice behind it.

  python scripts/soak.py alloc MODEL_DIR [--lengths 26] [--repeat 1] [--device cpu]
      One fresh process per memory plan runs the same prompts of distinct lengths through
      ModelRunner (prefill, then 4 decode steps): "pooled" (TVM's pooled allocator, every size
      kept), "naive" (each buffer freed when released), "bucketed" (pooled, with every prefill cut
      into power-of-two pieces so that the allocator sees at most log2(chunk) + 1 prefill sizes)
      and "released" (pooled, its cached buffers released after POOLED_PREFILL_SIZES new prefill
      sizes: ModelRunner's default on CUDA). Prints the seconds per prefill token, per decode step
      and the resident (CUDA: also device) memory each plan added after warm-up.

  python scripts/soak.py engine MODEL_DIR [--minutes 60] [--device cpu] [--adapters 4] [--json OUT]
                                          [--random-weights]
      LLMEngine under steady varied traffic for --minutes: prompts of random lengths, requests on
      random adapters (seeded random PEFT adapters of rank 4..16) and on the base model, some
      aborted mid-stream (a client that went away), an adapter unloaded and loaded again and one
      pinned and unpinned while requests run. Every round ends idle: the pool must hold only its
      pinned adapters and no KV page. Prints per round the requests served, tokens per second,
      resident memory (and on CUDA the device memory in use) against the first round after
      warm-up; exits 1 if memory grew past --rss-margin-mb or a round did not end idle.
      Diagnostics for memory growth (glibc hosts):
        --malloc-trim   call glibc's malloc_trim(0) before each reading, so the C heap hands its
                        free pages back: RSS then counts what is in use, not the heap's high-water
                        mark (a leak still grows; retained free heap no longer does). Each round
                        also prints the RSS before the trim and the trim's time.
        --heap-stats    each round prints glibc's mallinfo2(): C heap bytes in use (all arenas,
                        mmap'd blocks included) and bytes free inside the heap. In use growing
                        round after round is a leak; free growing while in use stays is retention.
        --trace-python N  tracemalloc from the start (and gc's objects by type): after warm-up and
                        at the end prints the N source lines whose Python allocations grew most and
                        the N object types whose counts grew most.

MODEL_DIR: a compiled folder (the engine mode needs one compiled with LoRA, e.g.
`mlc_lora compile smollm2-135m -o DIR --target llvm --max-lora-rank 16 --lora-pool-pages 256`).
With --random-weights (engine mode; needs torch) MODEL_DIR is a library without weights, such as
DIR/lora of `python scripts/bench_lora_throughput.py compile --out DIR` (a Llama-2-7B-shaped model
for a GPU): seeded random weights are made on --device, e.g.
`python scripts/soak.py engine DIR/lora --random-weights --device cuda`.
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

PLANS = ("pooled", "naive", "bucketed", "released")
DECODE_STEPS = 4


def rss_mb() -> float:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    import resource  # pylint: disable=import-outside-toplevel

    return pages * resource.getpagesize() / 2**20


def _libc():
    import ctypes  # pylint: disable=import-outside-toplevel

    return ctypes.CDLL("libc.so.6")


def malloc_trim() -> float:
    """glibc's malloc_trim(0): every arena's free pages back to the system. Returns its seconds."""
    t0 = time.perf_counter()
    _libc().malloc_trim(0)
    return time.perf_counter() - t0


def heap_mb() -> dict:
    """glibc's mallinfo2() over all arenas: MB in use (small chunks + mmap'd blocks) and MB free
    inside the heap (kept by the allocator, not returned to the system)."""
    import ctypes  # pylint: disable=import-outside-toplevel

    class Mallinfo2(ctypes.Structure):  # pylint: disable=too-few-public-methods
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    f = _libc().mallinfo2
    f.restype = Mallinfo2
    m = f()
    return dict(heap_used_mb=(m.uordblks + m.hblkhd) / 2**20, heap_free_mb=m.fordblks / 2**20,
                heap_mmap_mb=m.hblkhd / 2**20)


def object_counts() -> dict:
    """Objects the garbage collector tracks, by type name."""
    import collections  # pylint: disable=import-outside-toplevel
    import gc  # pylint: disable=import-outside-toplevel

    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def device_mb(device: str) -> float | None:
    """Device memory in use on `device` (CUDA: total - available, as nvidia-smi counts it), else None."""
    if not device.startswith("cuda"):
        return None
    from mlc_lora.runner import device_of  # pylint: disable=import-outside-toplevel

    dev = device_of(device)
    return (dev.total_global_memory - dev.available_global_memory) / 2**20


def pieces(n: int) -> list[int]:
    """`n` as descending powers of two (the bucketed plan's prefill calls)."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def run_plan(model_dir: str, plan: str, num_lengths: int, device: str, seed: int) -> dict:
    """One plan in this process: warm-up lengths, then `num_lengths` new distinct lengths."""
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    # "default": what a runner on `device` uses unless told (mlc_lora.runner.device.default_allocator)
    allocator = {"default": None, "naive": "naive"}.get(plan, "pooled")
    runner = ModelRunner(model_dir, device, allocator=allocator)
    if plan in ("pooled", "bucketed"):
        runner.pooled_prefill_sizes = 0  # TVM's pooled allocator as it is: every size kept
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
    # the plans in turn, --repeat times: each figure is the best of its runs (the least disturbed
    # on a shared host); memory is the same every time
    runs: dict[str, list[dict]] = {plan: [] for plan in args.plans}
    for _ in range(args.repeat):
        for plan in args.plans:
            runs[plan].append(plan_in_subprocess(args.model_dir, plan, args.lengths, args.device, args.seed))
    rows = []
    for plan, rs in runs.items():
        best = dict(rs[0])
        for k in ("prefill_ms_per_token", "prefill_ms_per_token_again", "decode_ms_per_step"):
            best[k] = min(r[k] for r in rs)
        for k in ("rss_growth_mb", "rss_after_repeat_mb", "device_growth_mb"):
            if k in best:
                best[k] = max(r[k] for r in rs)
        rows.append(best)
    print(f"{'plan':10} {'ms/token prefill':>17} {'(repeat)':>9} {'ms/decode step':>15} "
          f"{'RSS +MB':>8} {'(repeat)':>9}" + ("  device +MB" if args.device != "cpu" else ""))
    for r in rows:
        print(f"{r['plan']:10} {r['prefill_ms_per_token']:17.3f} {r['prefill_ms_per_token_again']:9.3f} "
              f"{r['decode_ms_per_step']:15.2f} {r['rss_growth_mb']:8.0f} {r['rss_after_repeat_mb']:9.0f}"
              + (f"  {r['device_growth_mb']:11.0f}" if "device_growth_mb" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


# --- the engine under traffic ---------------------------------------------------------------------


def random_adapters(runner, count: int, seed: int) -> dict:
    """name -> a seeded random PEFT adapter (in memory) of rank 4..16 on the compiled modules."""
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.models.random_model import random_adapter  # pylint: disable=import-outside-toplevel

    spec = runner.lora
    ranks = [r for r in (4, 8, 16) if r <= spec.max_rank] or [spec.max_rank]
    mods = list(spec.module_names)
    out = {}
    for i in range(count):  # every compiled module, or every other one
        name = f"soak{i}"
        out[name] = random_adapter(name, runner.model_config, mods if i % 2 == 0 else mods[::2],
                                   ranks[i % len(ranks)], torch, device="cpu", seed=seed + i)
    return out


async def traffic_round(eng, adapters: dict, rng, requests: int, max_prompt: int, max_tokens: int) -> dict:
    """`requests` streamed completions arriving over the round: random prompt lengths, adapters
    (or the base model), greedy or seeded sampling; every fifth stops reading after a few chunks (a
    client gone: the engine aborts it). Meanwhile the first adapter is unloaded and loaded again
    and the second pinned and unpinned (a load or pin the full pool refuses is tried again). Returns the
    counts of each outcome."""
    import asyncio  # pylint: disable=import-outside-toplevel

    from mlc_lora.errors import PoolExhaustedError, UnknownAdapterError  # pylint: disable=import-outside-toplevel

    vocab = eng.engine.runner.vocab_size
    names = list(adapters)
    counts = dict(served=0, aborted=0, refused=0, retries=0)

    async def one(i: int) -> None:
        name = None if i % (len(names) + 1) == len(names) else names[int(rng.integers(len(names)))]
        prompt = rng.integers(0, vocab, int(rng.integers(1, max_prompt + 1))).tolist()
        sampling = dict(temperature=0) if i % 2 else dict(temperature=0.8, top_p=0.9, seed=i)
        stop_after = int(rng.integers(1, 4)) if i % 5 == 0 else None
        await asyncio.sleep(float(rng.random()) * 0.05 * requests / 8)  # arrivals spread over the round
        try:
            stream = await eng.completions.create(prompt=prompt, max_tokens=int(rng.integers(1, max_tokens + 1)),
                                                  ignore_eos=True, logprobs=True, stream=True, adapter_id=name,
                                                  **sampling)
        except UnknownAdapterError:  # asked for the adapter while it was unloaded
            counts["refused"] += 1
            return
        n = 0
        try:
            async for _ in stream:  # a chunk per token (logprobs), with or without a tokenizer
                n += 1
                if stop_after is not None and n >= stop_after:
                    counts["aborted"] += 1
                    return
        except UnknownAdapterError:  # accepted, then its adapter was unloaded before it ran
            counts["refused"] += 1
            return
        finally:
            await stream.aclose()
        counts["served"] += 1

    async def retried(call, *args) -> None:
        """An adapter call the pool refuses while running requests hold its pages, until it is not."""
        while True:
            try:
                await call(*args)
                return
            except PoolExhaustedError:
                counts["retries"] += 1
                await asyncio.sleep(0.02)

    async def churn() -> None:
        await asyncio.sleep(0.02 * requests / 8)
        if names:
            await eng.unload_adapter(names[0])
            await asyncio.sleep(0.01)
            await retried(eng.load_adapter, names[0], adapters[names[0]])
        if len(names) > 1:
            await retried(eng.pin_adapter, names[1], True)
            await asyncio.sleep(0.02)
            await eng.pin_adapter(names[1], False)

    await asyncio.gather(churn(), *[one(i) for i in range(requests)])
    return counts


async def wait_idle(eng, timeout_s: float = 30.0) -> dict:
    """The engine's stats once nothing runs or waits (aborts land a step after the client leaves)."""
    import asyncio  # pylint: disable=import-outside-toplevel

    deadline = time.monotonic() + timeout_s
    while True:
        st = await eng.stats()
        if (st["running"] == st["waiting"] == 0) or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.01)


def idle_problems(stats: dict, listed: list[dict]) -> list[str]:
    """What keeps the pool from idle: every page free or held by an idle adapter, except the pages of
    pinned adapters; no KV page, no request."""
    out = []
    if stats["running"] or stats["waiting"]:
        out.append(f"{stats['running']} running, {stats['waiting']} waiting")
    if stats["pool_pages_kv"]:
        out.append(f"{stats['pool_pages_kv']} KV pages held")
    pinned = sum(a["pages"] for a in listed if a["pinned"])
    resident = sum(a["pages"] for a in listed if a["resident"])
    if stats["pool_pages_adapter"] != resident:
        out.append(f"{stats['pool_pages_adapter']} adapter pages, the loaded adapters hold {resident}")
    if stats["pool_pages_free"] + stats["pool_pages_evictable"] != stats["pool_pages_total"] - pinned:
        out.append(f"{stats['pool_pages_free']} free + {stats['pool_pages_evictable']} evictable pages of "
                   f"{stats['pool_pages_total']}, {pinned} pinned")
    return out


def random_params(model_dir, device: str, seed: int) -> list:
    """Seeded random weights for the library in `model_dir` (compiled without a params file, as
    scripts/bench_lora_throughput.py compiles), made with torch on `device`: the engine's `params`."""
    import torch  # pylint: disable=import-outside-toplevel

    from harness import cli  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    if device != "cpu":
        cli.gpu_runtime()
    cfg = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    weights = random_model.make_params(cfg, torch, device, seed=seed)
    if device != "cpu":
        torch.cuda.synchronize()  # written before the engine reads them
    return random_model.lib_params(weights, cfg)  # views that keep the tensors alive (DLPack)


def longest_prompt(chunk: int, max_seq_len: int, max_tokens: int, asked: int = 0) -> int:
    """The longest prompt of the traffic: `asked` (0: one prefill chunk), no more than the context
    leaves beside `max_tokens` of output (a library whose chunk is its whole context, as the 7B
    benchmark's 4096, would otherwise send prompts the engine must refuse)."""
    room = max_seq_len - max_tokens
    if room < 1:
        raise ValueError(f"--max-tokens {max_tokens} leaves no room for a prompt in the context of {max_seq_len} tokens")
    return min(asked or chunk, room)


def soak(model_dir, device: str = "cpu", *, minutes: float = 0.0, rounds: int = 0, warmup_rounds: int = 2,
         adapters: int = 4, requests: int = 24, max_prompt: int = 0, max_tokens: int = 24, seed: int = 0,
         log=print, trim: bool = False, heap_stats: bool = False, random_weights: bool = False,
         at_end=None, max_total_tokens: int = 0) -> list[dict]:
    """Rounds of `traffic_round` on an AsyncMLCEngine until `rounds` (or `minutes`) have passed; each
    round's outcome counts, tokens per second, resident (and device) memory, idle problems. `trim`:
    malloc_trim(0) before reading memory (the row also keeps the RSS before it, `rss_untrimmed_mb`);
    `heap_stats`: the C heap's bytes in use and free (mallinfo2); `random_weights`: `model_dir` has
    no weights, `random_params` makes them. `at_end()` runs after the last round while the engine
    is still up."""
    import asyncio  # pylint: disable=import-outside-toplevel
    import gc  # pylint: disable=import-outside-toplevel

    params = random_params(model_dir, device, seed) if random_weights else None  # (torch before TVM)
    from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    with AsyncMLCEngine(str(model_dir), device, params=params, max_total_tokens=max_total_tokens or None) as eng:
        made = random_adapters(eng.engine.runner, adapters, seed)
        max_prompt = longest_prompt(eng.engine.runner.compiled.prefill_chunk_size, eng.engine.max_seq_len,
                                    max_tokens, max_prompt)

        async def run() -> None:
            for i, (name, a) in enumerate(made.items()):
                await eng.load_adapter(name, a, pin=i == len(made) - 1)  # the last one stays pinned
            t_end = time.monotonic() + 60 * minutes
            r = 0
            tokens = 0
            while r < warmup_rounds + rounds or (minutes and time.monotonic() < t_end):
                t0 = time.perf_counter()
                counts = await traffic_round(eng, made, rng, requests, max_prompt, max_tokens)
                st = await wait_idle(eng)
                dt = time.perf_counter() - t0
                counts["tokens"], tokens = st["num_generated_tokens"] - tokens, st["num_generated_tokens"]
                gc.collect()
                extra = {}
                if trim:
                    extra["rss_untrimmed_mb"] = rss_mb()
                    extra["trim_ms"] = 1e3 * malloc_trim()
                if heap_stats:
                    extra.update(heap_mb())
                row = dict(round=r, warmup=r < warmup_rounds, seconds=dt, tokens_per_s=counts["tokens"] / dt,
                           rss_mb=rss_mb(), problems=idle_problems(st, await eng.list_adapters()),
                           preemptions=st["num_preemptions"], evictions=st["adapter_evictions"], **counts, **extra)
                dev = device_mb(device)
                if dev is not None:
                    row["device_mb"] = dev
                rows.append(row)
                log(row)
                r += 1
            if at_end is not None:
                at_end()

        asyncio.run(run())
    return rows


def print_growth(base, end, top: int) -> None:
    """The `top` source lines whose traced Python allocations grew most from snapshot `base` to `end`,
    and the object types whose counts grew most (`base`, `end`: (tracemalloc snapshot, counts))."""
    import tracemalloc  # pylint: disable=import-outside-toplevel

    filt = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    stats = end[0].filter_traces(filt).compare_to(base[0].filter_traces(filt), "lineno")
    total = sum(s.size_diff for s in stats)
    print(f"python allocations (tracemalloc) since warm-up: {total / 2**20:+.2f} MB in all; top {top} lines:")
    for s in stats[:top]:
        fr = s.traceback[0]
        print(f"  {s.size_diff / 2**10:+9.1f} KiB {s.count_diff:+7d} blocks  {fr.filename}:{fr.lineno}")
    grown = sorted(((end[1][k] - base[1].get(k, 0), k) for k in end[1]), reverse=True)[:top]
    print(f"objects tracked by gc since warm-up: {sum(end[1].values()) - sum(base[1].values()):+d}; top {top} types:")
    for d, k in grown:
        print(f"  {d:+8d} {k} ({end[1][k]})")


def engine_main(args) -> int:
    base = None
    traced = {}
    if args.trace_python:
        import tracemalloc  # pylint: disable=import-outside-toplevel

        tracemalloc.start()

    def snapshot(first: bool):
        # the counts must see the warm-up snapshot's own objects (tuples) both times: after it is
        # taken at warm-up, before the last one is taken at the end
        import tracemalloc  # pylint: disable=import-outside-toplevel

        if first:
            snap = tracemalloc.take_snapshot()
            return snap, object_counts()
        counts = object_counts()
        return tracemalloc.take_snapshot(), counts

    def log(row):
        nonlocal base
        if base is None and not row["warmup"]:
            base = row
            if args.trace_python:
                traced["base"] = snapshot(True)
        grow = "" if base is None else f" (+{row['rss_mb'] - base['rss_mb']:.0f} MB since warm-up)"
        dev = f" device {row['device_mb']:.0f} MB" if "device_mb" in row else ""
        diag = ""
        if "rss_untrimmed_mb" in row:
            diag += f" untrimmed {row['rss_untrimmed_mb']:.0f} MB trim {row['trim_ms']:.1f} ms"
        if "heap_used_mb" in row:
            diag += f" heap used {row['heap_used_mb']:.1f} free {row['heap_free_mb']:.1f} MB"
        print(f"round {row['round']:4d} {row['seconds']:6.1f}s served {row['served']:3d} aborted {row['aborted']:3d} "
              f"refused {row['refused']:2d} {row['tokens_per_s']:7.1f} tok/s preempt {row['preemptions']:5d} "
              f"evict {row['evictions']:4d} RSS {row['rss_mb']:7.0f} MB{grow}{dev}{diag}"
              + (f" NOT IDLE: {'; '.join(row['problems'])}" if row["problems"] else ""), flush=True)

    def at_end():
        if args.trace_python and "base" in traced:
            print_growth(traced["base"], snapshot(False), args.trace_python)

    rows = soak(args.model_dir, args.device, minutes=args.minutes, rounds=args.rounds, adapters=args.adapters,
                requests=args.requests, max_prompt=args.max_prompt, max_tokens=args.max_tokens, seed=args.seed,
                log=log, trim=args.malloc_trim, heap_stats=args.heap_stats, random_weights=args.random_weights,
                at_end=at_end, max_total_tokens=args.max_total_tokens)
    after = [r for r in rows if not r["warmup"]]
    growth = max(r["rss_mb"] for r in after) - after[0]["rss_mb"] if after else 0.0
    bad = [r for r in rows if r["problems"]]
    summary = dict(rounds=len(rows), minutes=sum(r["seconds"] for r in rows) / 60,
                   served=sum(r["served"] for r in rows), aborted=sum(r["aborted"] for r in rows),
                   refused=sum(r["refused"] for r in rows), rss_growth_after_warmup_mb=growth,
                   rss_first_mb=after[0]["rss_mb"] if after else None, rounds_not_idle=len(bad))
    for k in ("rss_untrimmed_mb", "heap_used_mb", "heap_free_mb"):
        if after and k in after[0]:
            summary[k.removesuffix("_mb") + "_growth_after_warmup_mb"] = max(r[k] for r in after) - after[0][k]
    if after and "trim_ms" in after[0]:
        summary["trim_ms_max"] = max(r["trim_ms"] for r in rows)
    if after and "device_mb" in after[0]:
        summary["device_growth_after_warmup_mb"] = max(r["device_mb"] for r in after) - after[0]["device_mb"]
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summary=summary, rounds=rows), indent=1))
    return 1 if bad or growth > args.rss_margin_mb else 0


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
    a.add_argument("--repeat", type=int, default=1, help="runs of every plan, in turn (best time, most memory)")
    a.add_argument("--json", help="also write the rows here")
    e = sub.add_parser("engine", help="LLMEngine under varied traffic with adapter churn")
    e.add_argument("model_dir", help="a folder compiled with LoRA")
    e.add_argument("--minutes", type=float, default=60.0)
    e.add_argument("--rounds", type=int, default=0, help="at least this many rounds after warm-up")
    e.add_argument("--device", default="cpu")
    e.add_argument("--adapters", type=int, default=4)
    e.add_argument("--requests", type=int, default=24, help="requests per round")
    e.add_argument("--max-prompt", type=int, default=0, help="longest prompt (default: the prefill chunk; at most the context less --max-tokens)")
    e.add_argument("--max-tokens", type=int, default=24)
    e.add_argument("--max-total-tokens", type=int, default=0, help="tokens of the unified pool, KV and adapter "
                   "pages (default: the compiled --lora-pool-pages); a small pool forces preemption and eviction")
    e.add_argument("--rss-margin-mb", type=float, default=64.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", help="also write every round here")
    e.add_argument("--malloc-trim", action="store_true",
                   help="glibc malloc_trim(0) before each memory reading (free heap back to the system)")
    e.add_argument("--heap-stats", action="store_true", help="print the C heap's MB in use and free (mallinfo2)")
    e.add_argument("--random-weights", action="store_true",
                   help="MODEL_DIR has no weights (bench_lora_throughput.py compile): make seeded random ones "
                        "on --device with torch")
    e.add_argument("--trace-python", type=int, default=0, metavar="N",
                   help="tracemalloc: the N lines (and object types) that grew most from warm-up to the end")
    args = p.parse_args()
    if args.mode == "alloc":
        return alloc_main(args)
    return engine_main(args)


if __name__ == "__main__":
    sys.exit(main())
