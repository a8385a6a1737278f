"""Thousands of adapters on one GPU: ShareGPT requests with Poisson arrivals over 5, 100 and 1000 LoRA
adapters of ranks 8-64 on a Llama-2-7B-shaped model, seeded random weights made on the device and
adapters made on the device and written to its disk as PEFT folders, which the engine reads as it
reads trained adapters. One process; each run gets a fresh engine on the same weights.

  prepare (here):   python scripts/bench_adapters.py prepare --out requests.npz
  compile (here):   python scripts/bench_adapters.py compile --out DIR            # [--smoke --target llvm]
  run (the GPU):    python scripts/bench_adapters.py run --lib-dir DIR --requests requests.npz
  charts (here):    python scripts/bench_adapters.py plot RESULT.json

Sections of `run` (`--sections`, all by default; `--append` merges sections run in separate
processes into one JSON):
  scale     5, 100 and 1000 adapters (`--adapter-counts`), uniform and Zipf popularity, Poisson
            arrivals at `--request-rate`: throughput, TTFT p50/p99, end-to-end latency; the ratio of
            each count's throughput to the smallest count's. The two popularities of one count share
            an engine (the adapters are loaded once).
  prefetch  the largest count, uniform popularity, at `--latency-rate`: TTFT p50/p99 with the engine's
            adapter prefetch on vs off.
  prefix    `--prefix-adapters` adapters, each request's prompt behind its adapter's own
            `--system-prompt`-token system prompt (seeded random ids): throughput and TTFT with the
            prefix cache on vs off.
  fairness  two tenants (two adapters), a heavy one at `--heavy-rate` overloading the engine and a
            light one at `--light-rate`: the light tenant's p50/p99 latency with fair share on vs off,
            and what fair share costs in throughput.
Every run also records where its time went (`time`: time_split) and prints it after its metrics.
Engine options another part of the engine may lack (prefetch_adapters, enable_prefix_caching,
adapter_host_bytes, fair_share) are passed only where MLCEngine accepts them; a section that needs a
missing one is recorded as skipped, with why, and so is an adapter count whose host copies would not
fit this machine's memory without the engine's host tier (adapter_host_bytes).

Adapters: ranks 8, 16, 32 and 64 in turn (shuffled, seeded), on every LoRA module of the library.
To fit the 1000 folders on the GPU machine's disk, `--distinct-per-rank` weight sets per rank are
written (made with torch on the device, float16) and each adapter's folder holds hard links to one of
them: the engine still reads, packs and pages every folder as an adapter of its own. Timing: each
request's tokens are timed when the engine emits them (`engine/frontend.py`'s Request, the callback
both front ends use: the random model has no tokenizer, so streamed text would carry no tokens to
time); vLLM's metrics from scripts/bench_serving.py. `--smoke` runs every section at a small scale on
the 2-layer model (`compile --smoke --target llvm`, `run --smoke --device cpu`): the CI smoke test.
Prompts are tokenized with the embedded SmolLM2 tokenizer, ids mapped into Llama-2's vocabulary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from bench_serving import Result, adapter_ids, arrival_gaps, summarize
from harness import cli, offline, plot as charts
from harness.cli import tqdm
from harness.workload import add_prepare, adapter_set, load_requests, prepare_requests, requests_note
from mlc_lora.contract import ROW_FORMATS

SECTIONS = ("scale", "prefetch", "prefix", "fairness")
LOAD_CONCURRENCY = 8  # adapter loads in flight while an engine is set up (before the clock)
RANKS = (8, 16, 32, 64)
# Engine options this script turns on or off, by section (pass only those MLCEngine accepts)
OPTIONS = ("prefetch_adapters", "enable_prefix_caching", "adapter_host_bytes", "fair_share")
SIZES = {
    # pool: 11,264 pages of 8 MiB (88 GiB: KV and adapters); 600 requests a run
    "7b": dict(prefill_chunk_size=4096, max_batch_size=256, pool_pages=11264, num_prompts=600,
               adapter_counts="5,100,1000", distinct_per_rank=8, request_rate=20.0, latency_rate=8.0,
               system_prompt=1000, prefix_adapters=10, heavy_rate=24.0, light_rate=1.0, host_gib=32.0,
               max_prompt_len=None, max_output_len=None, warmup=8),
    # 2 layers, hidden 256: a pool of 128 pages, less than the 8 adapters (130 pages) alone: they take turns
    "smoke": dict(prefill_chunk_size=128, max_batch_size=8, pool_pages=128, num_prompts=12,
                  adapter_counts="2,4,8", distinct_per_rank=2, request_rate=400.0, latency_rate=200.0,
                  system_prompt=48, prefix_adapters=2, heavy_rate=float("inf"), light_rate=100.0, host_gib=0.05,
                  max_prompt_len=40, max_output_len=6, warmup=2),
}


def compile_lib(a) -> int:
    """The LoRA library (sgmv, max rank 64, every module; --lora-rows int8: its adapter rows as int8)
    at DIR/lora; the `lora` (`lora-int8`) library of scripts/bench_lora_throughput.py compile is the
    same and serves too."""
    from mlc_lora.compile import CompileOptions  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    size = SIZES["smoke" if a.smoke else "7b"]
    opts = CompileOptions(target=a.target, dtype="float32" if a.target == "llvm" else "float16",
                          prefill_chunk_size=size["prefill_chunk_size"], max_batch_size=size["max_batch_size"],
                          gemm="cublas", cuda_graph=True, lora_pool_pages=size["pool_pages"], max_lora_rank=max(RANKS),
                          lora_kernel="sgmv", lora_rows=a.lora_rows)
    model_cfg = random_model.TINY if a.smoke else random_model.LLAMA2_7B
    secs = random_model.build(a.out / "lora", model_cfg, opts, name=f"llama-{'tiny' if a.smoke else '2-7b'}-random")
    print(f"{a.out / 'lora'}: built in {secs:.0f} s")
    return 0


# --- the engine, its adapters, its runs ----------------------------------------------------------


def engine_options() -> set[str]:
    """The options of OPTIONS that this MLCEngine accepts."""
    from mlc_lora import MLCEngine  # pylint: disable=import-outside-toplevel

    return set(inspect.signature(MLCEngine.__init__).parameters) & set(OPTIONS)


def host_bytes_available() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Bench:  # pylint: disable=too-many-instance-attributes
    """What every run shares: the library, the weights on the device, the requests, the adapter
    folders on disk, the settings."""

    def __init__(self, a, size: dict):
        import torch  # pylint: disable=import-outside-toplevel  (before TVM: loads libcublas first)
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel
        from mlc_lora.lora.layout import LoraSpec  # pylint: disable=import-outside-toplevel
        from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

        self.a, self.size, self.torch = a, size, torch
        self.folder = Path(a.lib_dir) / "lora"
        self.cfg = json.loads((self.folder / CONFIG_FILE).read_text())
        self.spec = LoraSpec.from_json(self.cfg["lora"])
        self.tdev = "cpu" if a.device == "cpu" else a.device
        if self.tdev != "cpu":
            cli.gpu_runtime()
        t0 = time.time()
        weights = random_model.make_params(self.cfg, torch, self.tdev, seed=a.seed)
        if self.tdev != "cpu":
            torch.cuda.synchronize()
        print(f"weights: {sum(v.numel() for v in weights.values()) / 1e9:.2f} B params on {self.tdev} "
              f"in {time.time() - t0:.1f} s", flush=True)
        self.params = [tvm_ffi.from_dlpack(weights[n]) for n in self.cfg["param_names"]]
        self._weights = weights  # the params view these tensors
        self.requests = load_requests(a.requests, a.num_prompts or size["num_prompts"],
                                      a.max_prompt_len or size["max_prompt_len"],
                                      a.max_output_len or size["max_output_len"])
        self.note = requests_note(a.requests)
        self.options = engine_options()
        self.max_num_seqs = a.max_num_seqs or size["max_batch_size"]
        self.pool_pages = a.pool_pages or size["pool_pages"]
        self.host_bytes = int((a.host_gib or size["host_gib"]) * 2 ** 30)
        self.adapter_dir = Path(a.adapter_dir) if a.adapter_dir else Path(tempfile.mkdtemp(prefix="bench-adapters-"))
        self._temp_dir = a.adapter_dir is None
        print(f"{len(self.requests)} requests, {sum(len(p) for p, _ in self.requests)} prompt tokens, "
              f"{sum(n for _, n in self.requests)} output tokens; {self.note}", flush=True)
        print(f"engine options here: {', '.join(sorted(self.options)) or 'none'} of {', '.join(OPTIONS)}")

    def close(self) -> None:
        if self._temp_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    # --- adapters on disk

    def pages(self, rank: int) -> int:
        from mlc_lora.lora.layout import layout_adapter  # pylint: disable=import-outside-toplevel

        return layout_adapter(self.spec.page_elems, self.spec.modules, rank).num_pages

    def page_bytes(self) -> int:
        return self.spec.num_layers * self.spec.page_elems * np.dtype(self.cfg["dtype"]).itemsize

    def adapter_folders(self, named_ranks) -> dict[str, Path]:
        """{name: its PEFT folder} for [(name, rank)]: the adapter of index i among those of its rank
        takes weight set i % distinct_per_rank of that rank (written once, made on the device),
        hard-linked into a folder of its own."""
        from mlc_lora.lora.peft import CONFIG, WEIGHTS  # pylint: disable=import-outside-toplevel
        from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

        k = self.a.distinct_per_rank or self.size["distinct_per_rank"]
        modules = [m.name for m in self.spec.modules]
        seen: dict[int, int] = {}
        out = {}
        for name, rank in tqdm(named_ranks, desc="adapter folders", unit="adapter"):
            i = seen[rank] = seen.get(rank, -1) + 1
            src = self.adapter_dir / "weights" / f"r{rank}-{i % k}"
            if not (src / WEIGHTS).is_file():
                ad = random_model.random_adapter(src.name, self.cfg["model_config"], modules, rank, self.torch,
                                                 self.tdev, seed=self.a.seed * 1000 + rank * 100 + i % k)
                random_model.write_adapter(ad, src, "float16")
            dst = self.adapter_dir / "adapters" / name
            dst.mkdir(parents=True, exist_ok=True)
            for f in (CONFIG, WEIGHTS):
                if not (dst / f).exists():
                    os.link(src / f, dst / f)
            out[name] = dst
        return out

    def host_check(self, named_ranks) -> str | None:
        """Why these adapters cannot all be loaded here (their packed host copies exceed 70% of the
        available memory and the engine has no host tier to bound them), or None."""
        need = sum(self.pages(r) for _, r in named_ranks) * self.page_bytes()
        avail = host_bytes_available()
        if "adapter_host_bytes" in self.options or not avail or need <= 0.7 * avail:
            return None
        return (f"{len(named_ranks)} adapters need {need / 2 ** 30:.1f} GiB of packed host copies and "
                f"{avail / 2 ** 30:.1f} GiB are available: needs the engine's host tier (adapter_host_bytes)")

    # --- engines

    def with_engine(self, folders: dict[str, Path], label: str, fn, **opts):
        """fn(engine, the options given) on a fresh AsyncMLCEngine on the shared weights with `folders`
        loaded (unpinned, before the clock) and a short warm-up; returns what fn returns. The options
        the engine lacks are dropped (the sections check those they need). The engine and its pool
        are gone when this returns (only this frame holds them), before the next one is made."""
        from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

        if "adapter_host_bytes" in self.options:
            opts.setdefault("adapter_host_bytes", self.host_bytes)
        given = {k: v for k, v in opts.items() if k in self.options}
        eng = AsyncMLCEngine(self.folder, self.a.device, max_num_seqs=self.max_num_seqs,
                             max_total_tokens=self.pool_pages * 16, params=self.params, **given)
        try:
            t0 = time.perf_counter()

            async def load():  # a few at a time: each reads and packs its folder on a thread of its own
                gate, bar = asyncio.Semaphore(LOAD_CONCURRENCY), tqdm(total=len(folders), desc=f"{label}: load",
                                                                      unit="adapter")

                async def one(name, path):
                    async with gate:
                        await eng.load_adapter(name, path)
                    bar.update()

                await asyncio.gather(*(one(n, p) for n, p in folders.items()))
                bar.close()

            asyncio.run(load())
            print(f"{label}: {len(folders)} adapters loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            n = self.size["warmup"] if self.a.warmup is None else self.a.warmup
            if n:
                names = list(folders) or [None]
                offline.drive(eng, [(p[:8], 4) for p, _ in self.requests[:n]],
                              [names[i % len(names)] for i in range(n)], f"{label}: warm-up")
            return fn(eng, given)
        finally:
            eng.close()
            alive = weakref.ref(eng.engine)
            del eng
            gc.collect()
            if alive() is not None:
                print(f"warning: the {label} engine is still referenced; its pool was not freed", flush=True)

    def run(self, eng, label: str, requests, adapters, rate: float, seed: int) -> dict:
        """`requests` [(prompt, output_len)] arriving at `rate` (Poisson, seeded), request i on
        adapters[i]: see run_at."""
        gaps = arrival_gaps(len(requests), rate, 1.0, np.random.default_rng(seed))
        return self.run_at(eng, label, requests, adapters, np.concatenate([[0.0], np.cumsum(gaps[:-1])]))

    def run_at(self, eng, label, requests, adapters, at, tenants=None) -> dict:
        """Request i arrives at at[i] seconds: vLLM's metrics over all requests and, with `tenants`
        {tenant: adapter name}, per tenant; the engine's counters over the run."""
        before = asyncio.run(eng.stats())
        results, duration = asyncio.run(drive(eng, requests, adapters, at, label))
        after = asyncio.run(eng.stats())
        failed = [r.error for r in results if not r.success]
        if failed:
            print(f"{label}: {len(failed)} requests failed, e.g. {failed[0]}", flush=True)
        out = dict(label=label, requests=len(requests), metrics=summarize(results, duration, (50, 99)),
                   engine={k: after[k] - before.get(k, 0) for k in ENGINE_COUNTERS if k in after})
        split = time_split(before, after, duration)
        if split is not None:
            out["time"] = split
        q, h = "prefix_cache_query_tokens", "prefix_cache_hit_tokens"
        if q in after and h in after:  # the prefix cache's hit rate over this run's prompts
            asked = after[q] - before.get(q, 0)
            out["engine"]["prefix_cache_hit_rate"] = (after[h] - before.get(h, 0)) / asked if asked else 0.0
        elif "prefix_cache_hit_rate" in after:  # (since the engine started)
            out["engine"]["prefix_cache_hit_rate"] = after["prefix_cache_hit_rate"]
        if tenants:
            out["tenants"] = {t: summarize([r for r, ad in zip(results, adapters) if ad == name], duration, (50, 99))
                              for t, name in tenants.items()}
        m = out["metrics"]
        print(f"{label}: {m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} output tok/s, TTFT p50 "
              f"{m['p50_ttft_ms']:.1f} / p99 {m['p99_ttft_ms']:.1f} ms, E2E p99 {m['p99_e2el_ms']:.1f} ms "
              f"({m['completed']} done, {m['failed']} failed)", flush=True)
        if "time" in out:
            print("\n".join(time_lines(label, out["time"])), flush=True)
        return out


ENGINE_COUNTERS = ("num_steps", "num_preemptions", "adapter_evictions", "adapter_page_ins")


def time_split(before: dict, after: dict, duration: float) -> dict | None:
    """Where a run's wall time went, from the engine's stats before and after it: the steps' forwards
    by kind (prefill, decode), the engine's host work outside them (host_times: the adapters' tiers,
    scheduling with its page-ins, outputs, waiting for adapter reads) and the rest (`other`: the
    engine waiting for arrivals, taking requests); and decode steps by their distinct adapters
    (decode_adapter_steps): ms a step, sequences a step, GB of adapter pages a step and the rate the
    step read them at (those bytes over the step's whole time: a lower bound of the LoRA kernels').
    None for an engine without these stats."""
    if "host_times" not in after or "decode_adapter_steps" not in after:
        return None
    steps = offline.stats_delta(after["step_times"], before.get("step_times"))
    fwd = {kind: sum(v["seconds"] for k, v in steps.items() if k.startswith(kind + "_")) for kind in ("prefill", "decode")}
    host = offline.stats_delta(after["host_times"], before.get("host_times"))
    by_adapters = {}
    for k, v in offline.stats_delta(after["decode_adapter_steps"], before.get("decode_adapter_steps")).items():
        if v["steps"] > 0:
            by_adapters[k] = dict(steps=v["steps"], ms_per_step=1e3 * v["seconds"] / v["steps"],
                                  sequences_per_step=v["sequences"] / v["steps"],
                                  adapter_gb_per_step=v["adapter_bytes"] / v["steps"] / 1e9,
                                  adapter_gb_per_s=v["adapter_bytes"] / v["seconds"] / 1e9 if v["seconds"] else 0.0)
    seconds = {**fwd, **host}
    seconds["other"] = duration - sum(seconds.values())
    return dict(seconds=seconds, decode_by_adapters=by_adapters)  # (in the engine's order: by adapters)


def time_lines(label: str, split: dict) -> list[str]:
    s = split["seconds"]
    out = [f"{label}: time " + ", ".join(f"{k} {v:.1f} s" for k, v in s.items())]
    for k, v in split["decode_by_adapters"].items():
        out.append(f"  decode steps with {k} adapters: {v['steps']}, {v['ms_per_step']:.1f} ms, "
                   f"{v['sequences_per_step']:.0f} sequences, {v['adapter_gb_per_step']:.2f} GB of adapter pages "
                   f"a step ({v['adapter_gb_per_s']:.0f} GB/s over the step)")
    return out


async def drive(engine, requests, adapters, at, desc: str):
    """(a Result per request, seconds from the first arrival to the last completion): request i
    [(prompt, output_len)] on adapters[i] arrives at start + at[i], greedy, EOS ignored."""
    from mlc_lora.engine.frontend import Request  # pylint: disable=import-outside-toplevel

    loop = asyncio.get_running_loop()
    bar = tqdm(total=len(requests), desc=desc, unit="req")
    start = time.perf_counter()

    async def one(i):
        await asyncio.sleep(max(0.0, start + at[i] - time.perf_counter()))
        prompt, n = requests[i]
        res = Result(adapters[i] or "base", len(prompt))
        done = loop.create_future()
        t0 = last = time.perf_counter()

        def put(item):  # on the engine thread, as each output is made
            nonlocal last
            out, now = item[1], time.perf_counter()
            if out.tokens:
                if res.output_len == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                res.output_len += len(out.tokens)
            if out.error is not None:
                res.error = f"{type(out.error).__name__}: {out.error}"
            if out.finish_reason is not None or out.error is not None:
                res.latency = now - t0
                res.success = out.error is None and res.output_len == n
                loop.call_soon_threadsafe(done.set_result, None)

        try:
            await loop.run_in_executor(None, functools.partial(
                Request, engine, False, True, put, prompt=prompt, adapter_id=adapters[i], max_tokens=n,
                temperature=0.0, ignore_eos=True))
            await done
        except Exception as e:  # pylint: disable=broad-except  (a refused request is counted, not fatal)
            res.error = f"{type(e).__name__}: {e}"
        bar.update()
        return res

    results = await asyncio.gather(*(one(i) for i in range(len(requests))))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


# --- the sections ----------------------------------------------------------------------------------


def ranks_of(n: int) -> list[tuple[str, int]]:
    """n adapters, ranks 8/16/32/64 in turn, shuffled (harness.workload.adapter_set)."""
    return adapter_set([(r, n // len(RANKS) + (i < n % len(RANKS))) for i, r in enumerate(RANKS)], seed=0)


def section_scale(b: Bench) -> dict:
    a = b.a
    counts = [int(x) for x in (a.adapter_counts or b.size["adapter_counts"]).split(",")]
    runs, skipped = [], []
    opts = {"prefetch_adapters": True} if "prefetch_adapters" in b.options else {}
    for n in counts:
        named = ranks_of(n)
        why = b.host_check(named)
        if why:
            print(f"scale: {n} adapters skipped: {why}", flush=True)
            skipped.append(dict(adapters=n, why=why))
            continue
        folders = b.adapter_folders(named)
        names = list(folders)

        def both(eng, given, n=n, named=named, names=names):
            out = []
            for pop in ("uniform", "zipf"):
                which = adapter_ids(len(b.requests), n, pop, np.random.default_rng(a.seed), zipf_s=a.zipf_s)
                r = b.run(eng, f"{n} adapters, {pop}", b.requests, [names[i] for i in which],
                          a.request_rate or b.size["request_rate"], a.seed)
                out.append(dict(r, adapters=n, popularity=pop, ranks=sorted({k for _, k in named}),
                                adapter_pages=sum(b.pages(k) for _, k in named), engine_options=given,
                                distinct_adapters_used=len(set(which.tolist()))))
            return out

        runs += b.with_engine(folders, f"scale-{n}", both, **opts)
    low = {}
    for r in runs:
        low.setdefault(r["popularity"], r)  # the smallest count run of each popularity
        fewest = low[r["popularity"]]["metrics"]["output_throughput"]
        r["throughput_vs_fewest"] = r["metrics"]["output_throughput"] / fewest
    return dict(runs=runs, skipped_counts=skipped, request_rate=a.request_rate or b.size["request_rate"],
                adapter_counts=counts)


def _on_off(b: Bench, section: str, option: str, folders, requests, adapters, rate, label) -> dict:
    """The same requests on two fresh engines, `option` off then on."""
    def one(eng, given, on):
        r = b.run(eng, f"{label}, {option} {'on' if on else 'off'}", requests, adapters, rate, b.a.seed)
        return dict(r, **{option: on}, engine_options=given)

    return dict(runs=[b.with_engine(folders, f"{section}-{'on' if on else 'off'}",
                                    functools.partial(one, on=on), **{option: on}) for on in (False, True)])


def section_prefetch(b: Bench) -> dict:
    if "prefetch_adapters" not in b.options:
        return dict(skipped="the engine has no prefetch_adapters option")
    a = b.a
    counts = [int(x) for x in (a.adapter_counts or b.size["adapter_counts"]).split(",")]
    n = a.prefetch_adapters or max(counts)
    named = ranks_of(n)
    why = b.host_check(named)
    if why:
        return dict(skipped=why)
    folders = b.adapter_folders(named)
    names = list(folders)
    which = adapter_ids(len(b.requests), n, "uniform", np.random.default_rng(a.seed))
    rate = a.latency_rate or b.size["latency_rate"]
    return dict(_on_off(b, "prefetch", "prefetch_adapters", folders, b.requests, [names[i] for i in which], rate,
                        f"{n} adapters, uniform"), adapters=n, request_rate=rate)


def section_prefix(b: Bench) -> dict:
    if "enable_prefix_caching" not in b.options:
        return dict(skipped="the engine has no enable_prefix_caching option")
    a = b.a
    n = a.prefix_adapters or b.size["prefix_adapters"]
    length = a.system_prompt or b.size["system_prompt"]
    named = ranks_of(n)
    folders = b.adapter_folders(named)
    names = list(folders)
    rng = np.random.default_rng(a.seed)
    vocab = b.cfg["model_config"]["vocab_size"]
    system = {name: rng.integers(0, vocab, length).tolist() for name in names}
    which = adapter_ids(len(b.requests), n, "uniform", rng)
    adapters = [names[i] for i in which]
    requests = [(system[ad] + p, o) for (p, o), ad in zip(b.requests, adapters)]
    rate = a.latency_rate or b.size["latency_rate"]
    return dict(_on_off(b, "prefix", "enable_prefix_caching", folders, requests, adapters, rate,
                        f"{n} adapters, {length}-token system prompts"),
                adapters=n, system_prompt_tokens=length, request_rate=rate)


def section_fairness(b: Bench) -> dict:
    if "fair_share" not in b.options:
        return dict(skipped="the engine has no fair_share option")
    a = b.a
    heavy_rate, light_rate = a.heavy_rate or b.size["heavy_rate"], a.light_rate or b.size["light_rate"]
    folders = b.adapter_folders([("tenant-heavy", 16), ("tenant-light", 16)])
    rng = np.random.default_rng(a.seed)
    # the heavy tenant's requests arrive over `span` seconds (all at once at an infinite rate), the
    # light tenant's over the same span at its own rate
    heavy = b.requests
    span = len(heavy) / heavy_rate if math.isfinite(heavy_rate) else 4 / light_rate
    n_light = max(4, int(round(span * light_rate)))
    light = [b.requests[-1 - i % len(b.requests)] for i in range(n_light)]
    at = np.concatenate([np.concatenate([[0.0], np.cumsum(arrival_gaps(len(heavy) - 1, heavy_rate, 1.0, rng))]),
                         np.cumsum(arrival_gaps(n_light, light_rate, 1.0, rng))])
    order = np.argsort(at, kind="stable")
    requests = [(heavy + light)[i] for i in order]
    adapters = [("tenant-heavy" if i < len(heavy) else "tenant-light") for i in order]
    at = at[order]

    def one(eng, given, on):
        r = b.run_at(eng, f"two tenants, fair share {'on' if on else 'off'}", requests, adapters, at,
                     tenants={"heavy": "tenant-heavy", "light": "tenant-light"})
        r["tokens_served"] = asyncio.run(eng.stats()).get("tokens_served")
        t = r["tenants"]["light"]
        print(f"  light tenant: p50 {t['p50_e2el_ms']:.1f} / p99 {t['p99_e2el_ms']:.1f} ms end to end, "
              f"TTFT p99 {t['p99_ttft_ms']:.1f} ms", flush=True)
        return dict(r, fair_share=on, engine_options=given)

    runs = [b.with_engine(folders, f"fairness-{'on' if on else 'off'}", functools.partial(one, on=on), fair_share=on)
            for on in (False, True)]
    return dict(runs=runs, heavy_rate=heavy_rate, light_rate=light_rate, heavy_requests=len(heavy),
                light_requests=n_light)


SECTION_FNS = {"scale": section_scale, "prefetch": section_prefetch, "prefix": section_prefix,
               "fairness": section_fairness}


def run_bench(a) -> int:
    size = SIZES["smoke" if a.smoke else "7b"]
    sections = a.sections.split(",")
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    b = Bench(a, size)
    out = Path(a.out)
    doc = cli.read_results([out])[0] if a.append and out.is_file() else {}
    try:
        done = dict(doc.get("sections", {}))
        for s in sections:
            print(f"--- {s}", flush=True)
            done[s] = SECTION_FNS[s](b)
            if "skipped" in done[s]:
                print(f"{s}: skipped: {done[s]['skipped']}", flush=True)
            for c in done[s].get("skipped_counts", []):
                print(f"{s}: {c['adapters']} adapters skipped: {c['why']}", flush=True)
    finally:
        b.close()
    doc = {"model": b.cfg["model_name"], "model_config": b.cfg["model_config"], "dtype": b.cfg["dtype"],
           "device": a.device, "requests_file": str(a.requests), "tokenizer": b.note,
           "settings": dict(pool_pages=b.pool_pages, max_num_seqs=b.max_num_seqs, ranks=list(RANKS),
                            distinct_per_rank=a.distinct_per_rank or size["distinct_per_rank"],
                            zipf_s=a.zipf_s,
                            host_tier_bytes=b.host_bytes if "adapter_host_bytes" in b.options else None,
                            sampling="greedy, EOS ignored, reference output lengths"),
           "engine_options": sorted(b.options), "sections": done}
    cli.write_results(out, doc)
    print(f"results: {out}")
    draw(doc, out)
    print(table(doc))
    return 0


# --- report ------------------------------------------------------------------------------------------


def rows(doc: dict) -> list[tuple[str, str, dict]]:
    """(section, run label, metrics) of every run, and the fairness runs' light tenant."""
    out = []
    for name in SECTIONS:
        for r in doc["sections"].get(name, {}).get("runs", []):
            out.append((name, r["label"], r["metrics"]))
            if "tenants" in r:
                out.append((name, f"  light tenant (fair share {'on' if r['fair_share'] else 'off'})",
                            r["tenants"]["light"]))
    return out


def table(doc: dict) -> str:
    lines = ["| section | run | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | E2E p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for sec, label, m in rows(doc):
        lines.append(f"| {sec} | {label} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} | "
                     f"{m['p50_ttft_ms']:.1f} | {m['p99_ttft_ms']:.1f} | {m['p99_e2el_ms']:.1f} |")
    for r in doc["sections"].get("scale", {}).get("runs", []):
        lines.append(f"scale: {r['adapters']} adapters ({r['popularity']}): {r['throughput_vs_fewest']:.3f}x "
                     "the fewest adapters' output tokens/s")
    for name in SECTIONS:
        sec = doc["sections"].get(name)
        if sec is None:
            continue
        if "skipped" in sec:
            lines.append(f"{name}: skipped: {sec['skipped']}")
        for c in sec.get("skipped_counts", []):
            lines.append(f"{name}: {c['adapters']} adapters skipped: {c['why']}")
    return "\n".join(lines)


def draw(doc: dict, out: Path) -> None:
    """Charts beside `out` (.png): output tokens/s of the scale runs; where their time went
    (`-time.png`, time_split's parts stacked); the p99 latencies each on/off comparison is about
    (TTFT for prefetch and the prefix cache, the light tenant's end to end for fair share)."""
    out = Path(out)
    scale = doc["sections"].get("scale", {}).get("runs", [])
    if scale:
        charts.bars([f"{r['adapters']}\n{r['popularity']}" for r in scale],
                    [r["metrics"]["output_throughput"] for r in scale], out.with_name(out.stem + "-throughput.png"),
                    title="ShareGPT, Poisson arrivals: throughput by adapters and popularity", ylabel="output tokens/s",
                    notes=[f"{r['throughput_vs_fewest']:.2f}x" for r in scale])
    timed = [r for r in scale if "time" in r]
    if timed:  # where each scale run's wall time went (time_split)
        parts = list(timed[0]["time"]["seconds"])
        charts.stacked([f"{r['adapters']}\n{r['popularity']}" for r in timed],
                       {p: [max(0.0, r["time"]["seconds"][p]) for r in timed] for p in parts},
                       out.with_name(out.stem + "-time.png"), title="Where each run's time went",
                       ylabel="seconds")
    labels, values = [], []
    for sec, key, option, what in (("prefetch", "p99_ttft_ms", "prefetch_adapters", "TTFT"),
                                   ("prefix", "p99_ttft_ms", "enable_prefix_caching", "TTFT"),
                                   ("fairness", "p99_e2el_ms", "fair_share", "light E2E")):
        for r in doc["sections"].get(sec, {}).get("runs", []):
            m = r["tenants"]["light"] if sec == "fairness" else r["metrics"]
            labels.append(f"{sec} {'on' if r[option] else 'off'}\n{what}")
            values.append(m[key])
    if labels:
        charts.bars(labels, values, out.with_name(out.stem + "-latency.png"), title="p99 latency, feature off vs on",
                    ylabel="ms", notes=[f"{v:.0f}" for v in values])


def plot_cmd(a) -> int:
    doc = cli.read_results([a.result])[0]
    draw(doc, Path(a.result))
    print(table(doc))
    return 0


def main(argv=None) -> int:
    ap, sub = cli.parser(__doc__, __file__)
    add_prepare(sub)
    c = cli.add_compile(sub, "build the LoRA library into DIR/lora (here)")
    c.add_argument("--target", default="cuda", choices=["cuda", "llvm"])
    c.add_argument("--smoke", action="store_true", help="the 2-layer model")
    c.add_argument("--lora-rows", choices=ROW_FORMATS, default="model",
                   help="how the pool stores adapter rows (int8: half the bytes, lossy; mlc_lora compile --lora-rows)")
    r = sub.add_parser("run", help="the sections, weights and adapters made on the device")
    r.add_argument("--lib-dir", required=True, help="the folder of `compile` (its lora/ library)")
    r.add_argument("--requests", required=True, help="the file of `prepare`")
    r.add_argument("--device", default="cuda")
    r.add_argument("--smoke", action="store_true", help="every section at a small scale on the 2-layer model")
    r.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    r.add_argument("--adapter-counts", default=None, help="scale: comma-separated (default 5,100,1000)")
    r.add_argument("--adapter-dir", default=None, help="where the adapter folders are written and kept "
                   "(default: a temporary folder, removed at the end)")
    r.add_argument("--distinct-per-rank", type=int, default=None, help="weight sets written per rank (default 8)")
    r.add_argument("--num-prompts", type=int, default=None, help="requests of a run (default 600)")
    r.add_argument("--max-prompt-len", type=int, default=None)
    r.add_argument("--max-output-len", type=int, default=None)
    r.add_argument("--request-rate", type=float, default=None, help="scale: requests/s (default 20)")
    r.add_argument("--latency-rate", type=float, default=None, help="prefetch, prefix: requests/s (default 8)")
    r.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of the popularity")
    r.add_argument("--prefetch-adapters", type=int, default=None,
                   help="prefetch: adapters (default: the largest count)")
    r.add_argument("--prefix-adapters", type=int, default=None, help="prefix: adapters (default 10)")
    r.add_argument("--system-prompt", type=int, default=None, help="prefix: system prompt tokens (default 1000)")
    r.add_argument("--heavy-rate", type=float, default=None,
                   help="fairness: the heavy tenant's requests/s (default 24)")
    r.add_argument("--light-rate", type=float, default=None, help="fairness: the light tenant's requests/s (default 1)")
    r.add_argument("--host-gib", type=float, default=None, help="the engine's host tier budget where it has one "
                   "(adapter_host_bytes; default 32)")
    r.add_argument("--pool-pages", type=int, default=None, help="pages of the unified pool (default 11264)")
    r.add_argument("--max-num-seqs", type=int, default=None)
    r.add_argument("--warmup", type=int, default=None, help="short requests each engine runs before the clock")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default="bench_adapters.json")
    r.add_argument("--append", action="store_true",
                   help="keep the sections already in --out that this run does not redo")
    g = sub.add_parser("plot", help="the charts and the table of a result file (here)")
    g.add_argument("result")
    a = cli.parse(ap, argv)
    return {"prepare": prepare_requests, "compile": compile_lib, "run": run_bench, "plot": plot_cmd}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
