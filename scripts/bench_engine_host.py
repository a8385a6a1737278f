"""The engine's host time per step outside the forward, on CPU: many concurrent requests through
AsyncMLCEngine (as scripts/harness/offline.py drives them) on a tiny random Llama, whose forward is
cheap, so that what the host does around each step (scheduling, appending tokens, detokenizing,
stop checks, handing outputs to the asyncio side, the engine loop) shows.

  python scripts/bench_engine_host.py [--requests 256] [--out-len 64 200] [--adapters 4] [--base]
                                      [--tokenizer smollm2|none] [--stream] [--profile] [--workdir DIR]
  python scripts/bench_engine_host.py --tables [--max-rank 64]   # begin_forward's LoRA tables alone

The model: 2 layers, hidden 64, a vocabulary of 8192 tokens (the first of the embedded SmolLM2's
tokenizer; `--tokenizer none`: no tokenizer, as the random Llama-2 of
scripts/bench_lora_throughput.py), compiled for llvm with LoRA (rank <= 8, the `sgmv` stage) into
--workdir (kept: a second run reuses it); its forward runs on the engine thread alone
(TVM_NUM_THREADS=1), so that TVM's workers do not compete with the host's threads. Requests:
prompts of 8..32 random tokens, --out-len tokens each (uniform, seeded), EOS ignored, temperature
1; request i on adapter i % (adapters + 1) (the last residue: the base model).

Prints per step, for each of --repeat runs and the best: the wall time outside the forward (the
run's wall time less the engine's `stats()["step_times"]`, forward + sampling), the engine
thread's CPU time outside the forward and sampling, and the asyncio thread's CPU time; then the
engine thread's time by part (schedule, append: stop checks, detokenize, emit: hand the output
to the request; with `--parts`, which adds a timer to each of those calls). `--profile` adds cProfile's top functions of the engine thread
(`--profile-main`: of the asyncio thread).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
             architectures=["LlamaForCausalLM"], model_type="llama")
VOCAB = 8192  # (with the tokenizer: its first 8192 tokens) a cheap lm_head and sampler
MAX_BATCH, CHUNK, RANK, POOL_PAGES = 256, 2048, 8, 6144


def build(out: Path, tokenizer: str, lora: bool = True, rank: int = RANK) -> Path:
    """The tiny model's compiled folder (compiled on first use; LoRA up to `rank`)."""
    from mlc_lora.compile import CompileOptions  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import CONFIG_FILE, TOKENIZER_FILE  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    out = out / (f"{tokenizer}-base" if not lora else tokenizer if rank == RANK else f"{tokenizer}-r{rank}")
    if (out / CONFIG_FILE).is_file():
        return out
    info = {}
    if tokenizer == "smollm2":
        from mlc_lora.loader.source import resolve_model  # pylint: disable=import-outside-toplevel

        src = resolve_model("smollm2-135m")
        out.mkdir(parents=True, exist_ok=True)
        (out / TOKENIZER_FILE).write_text(src.tokenizer_json)
        info = {k: v for k, v in src.tokenizer_config.items() if k != "chat_template"}
        info["file"] = TOKENIZER_FILE
    lora_opts = dict(max_lora_rank=rank, lora_pool_pages=POOL_PAGES, lora_kernel="sgmv") if lora else {}
    opts = CompileOptions(target="llvm", dtype="float32", context_window_size=1024, prefill_chunk_size=CHUNK,
                          max_batch_size=MAX_BATCH, **lora_opts)
    secs = random_model.build(out, dict(MODEL, vocab_size=VOCAB), opts, name="llama-host-bench")
    cfg = json.loads((out / CONFIG_FILE).read_text())
    cfg["tokenizer"] = info
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=1))
    print(f"{out}: built in {secs:.0f} s", flush=True)
    return out


def load_model(folder: Path, seed: int):
    """(compiled config, parameters) of the tiny model in `folder`: seeded random weights."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    cfg = json.loads((folder / CONFIG_FILE).read_text())
    weights = random_model.make_params(cfg, torch, "cpu", seed=seed)
    return cfg, [tvm_ffi.from_dlpack(weights[n]) for n in cfg["param_names"]]


def make_adapter(cfg: dict, name: str, seed: int):
    """A seeded random adapter of rank RANK on every LoRA module of the library."""
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    modules = [m["name"] for m in cfg["lora"]["modules"]]
    return random_model.random_adapter(name, cfg["model_config"], modules, RANK, torch, "cpu", seed=seed)


class Timers:
    """Wall and CPU seconds (of the calling thread) spent in wrapped callables, by name."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        self.seconds[name] = [0.0, 0.0]

        def timed(*args, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                acc = self.seconds[name]
                acc[0] += time.perf_counter() - t0
                acc[1] += time.thread_time() - c0

        setattr(owner, attr, timed)

    def take(self) -> dict[str, list[float]]:
        out = {k: list(v) for k, v in self.seconds.items()}
        for v in self.seconds.values():
            v[:] = [0.0, 0.0]
        return out


def profiled_loop(engine, prof: cProfile.Profile) -> None:
    """Restart the engine thread's loop under `prof` (the loop object is reused)."""
    loop = engine._loop  # pylint: disable=protected-access
    inner = loop._run  # pylint: disable=protected-access

    def run():
        prof.enable()
        try:
            inner()
        finally:
            prof.disable()

    with loop.cv:
        loop.closed = True
        loop.cv.notify()
    loop.thread.join()
    loop.closed = False
    loop.thread = threading.Thread(target=run, name="mlc_lora-engine", daemon=True)
    loop.thread.start()


def tables_bench(a) -> int:
    """--tables: the pool's begin_forward (its KV plan and the batch's LoRA tables) and the tables'
    handover, for a decode of --tables-seqs sequences over 1..that many distinct adapters of rank 8
    on a library compiled for --max-rank (the tables are (adapters, modules, max rank)); the
    forward is not run. Median of 200 steps per count."""
    from mlc_lora.engine.core import LLMEngine  # pylint: disable=import-outside-toplevel

    folder = build(Path(a.workdir), "none", rank=a.max_rank)
    cfg, params = load_model(folder, a.seed)
    eng = LLMEngine(folder, "cpu", max_num_seqs=MAX_BATCH, params=params)
    n = a.tables_seqs
    for i in range(n):
        eng.adapters.load(f"a{i}", make_adapter(cfg, f"a{i}", i))
    pool, seqs = eng.pool, list(range(10 ** 6, 10 ** 6 + n))
    for s in seqs:
        pool.add_sequence(s)
        pool.begin_forward([s], [4])
        pool.end_forward()
    for distinct in sorted({c for c in (1, 4, 16, 64) if c < n} | {n}):
        for k, s in enumerate(seqs):
            pool.set_sequence_adapter(s, eng.adapters.by_name[f"a{k % distinct}"].slot)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            pool.begin_forward(seqs, [1] * len(seqs))
            pool.lora_tables()
            times.append(time.perf_counter() - t0)
            pool.end_forward()
            for s in seqs:
                pool.popn(s, 1)
        print(f"decode of {len(seqs)} sequences over {distinct:3d} distinct adapters (max rank {a.max_rank}): "
              f"begin_forward + tables {np.median(times) * 1e6:.0f} us", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--out-len", type=int, nargs=2, default=[64, 200], metavar=("MIN", "MAX"))
    p.add_argument("--adapters", type=int, default=4, help="LoRA adapters (rank 8) the requests share with "
                   "the base model, round-robin (0: base model only)")
    p.add_argument("--tokenizer", choices=["smollm2", "none"], default="smollm2")
    p.add_argument("--base", action="store_true", help="the model compiled without LoRA (with --adapters 0; "
                   "against the LoRA library with --adapters 0: what LoRA costs the host with no adapter)")
    p.add_argument("--stream", action="store_true", help="stream every request (one chunk per token)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs (the best is reported)")
    p.add_argument("--parts", action="store_true", help="also time append, emit and detokenize (per token)")
    p.add_argument("--profile", action="store_true", help="cProfile the engine thread over the timed runs")
    p.add_argument("--profile-main", action="store_true", help="cProfile the asyncio thread instead")
    p.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumulative...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "mlc_lora_bench_engine_host"))
    p.add_argument("--tables", action="store_true", help="instead: the pool's begin_forward with the batch's "
                   "LoRA tables, by distinct adapters (tables_bench)")
    p.add_argument("--max-rank", type=int, default=64, help="--tables: the library's max LoRA rank")
    p.add_argument("--tables-seqs", type=int, default=MAX_BATCH, help="--tables: the decode's sequences")
    a = p.parse_args(argv)
    if a.tables:
        os.environ.setdefault("TVM_NUM_THREADS", "1")
        return tables_bench(a)

    # the forward on the engine thread alone: no TVM worker threads spinning beside the host's threads
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (before TVM, as before)

    from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import PAGE_SIZE  # pylint: disable=import-outside-toplevel
    from mlc_lora.tokenizer import Detokenizer  # pylint: disable=import-outside-toplevel

    if a.base and a.adapters:
        raise SystemExit("--base: the library has no LoRA; pass --adapters 0")
    folder = build(Path(a.workdir), a.tokenizer, lora=not a.base)
    cfg, params = load_model(folder, a.seed)
    vocab = cfg["model_config"]["vocab_size"]
    rng = np.random.default_rng(a.seed)
    reqs = [(rng.integers(3, vocab, int(rng.integers(8, 33))).tolist(), int(rng.integers(a.out_len[0], a.out_len[1] + 1)))
            for _ in range(a.requests)]
    names = [f"a{i}" for i in range(a.adapters)]
    assign = [(names + [None])[i % (len(names) + 1)] for i in range(len(reqs))]

    # the base library's KV pool as large as the LoRA library's (the same batches)
    total = (POOL_PAGES - 1) * PAGE_SIZE if a.base else None
    engine = AsyncMLCEngine(folder, "cpu", max_num_seqs=MAX_BATCH, max_total_tokens=total, params=params)
    timers, eng = Timers(), engine.engine  # the engine thread's time, by part (its calls looked up per call)
    timers.wrap(eng, "step", "step")
    timers.wrap(eng.scheduler, "schedule", "schedule")
    timers.wrap(eng, "_forward", "forward")
    timers.wrap(eng.sampler, "sample", "sample")
    if a.parts:  # per token: their timers cost the engine thread about a microsecond a call
        timers.wrap(eng, "_append", "append")
        timers.wrap(eng, "_emit", "emit")
        timers.wrap(Detokenizer, "push", "detokenize")

    async def one(prompt, n, adapter):
        kw = dict(prompt=prompt, max_tokens=n, temperature=1.0, top_p=1.0, ignore_eos=True, seed=len(prompt),
                  adapter_id=adapter)
        if not a.stream:
            r = await engine.completions.create(**kw)
            return r.usage.completion_tokens
        got = 0
        async for c in await engine.completions.create(stream=True, **kw):
            got += c.usage.completion_tokens if c.usage is not None else 0
        return n

    async def drive(rs, ads):
        return await asyncio.gather(*[one(pr, n, ad) for (pr, n), ad in zip(rs, ads)])

    def steps_and_seconds():
        st = asyncio.run(engine.stats())
        return st["num_steps"], sum(v["seconds"] for v in st["step_times"].values())

    try:
        for i, name in enumerate(names):
            asyncio.run(engine.load_adapter(name, make_adapter(cfg, name, i), pin=True))
        asyncio.run(drive([(pr[:8], 4) for pr, _ in reqs[:8]], assign[:8]))  # warm-up
        prof = cProfile.Profile() if (a.profile or a.profile_main) else None
        if a.profile:
            profiled_loop(engine, prof)
        runs = []
        for _ in range(a.repeat):
            n0, s0 = steps_and_seconds()
            timers.take()
            clock = time.pthread_getcpuclockid(engine._loop.thread.ident)  # pylint: disable=protected-access
            e0, m0 = time.clock_gettime(clock), time.thread_time()
            if a.profile_main:
                prof.enable()
            t0 = time.perf_counter()
            produced = asyncio.run(drive(reqs, assign))
            wall = time.perf_counter() - t0
            if a.profile_main:
                prof.disable()
            engine_cpu, main_cpu = time.clock_gettime(clock) - e0, time.thread_time() - m0
            part = timers.take()
            n1, s1 = steps_and_seconds()
            if produced != [n for _, n in reqs]:
                raise SystemExit("a request did not produce its requested length")
            steps, step_s = n1 - n0, s1 - s0
            ms = {k: (w / steps * 1e3, c / steps * 1e3) for k, (w, c) in part.items()}
            r = dict(wall=wall, steps=steps, outside=(wall - step_s) / steps * 1e3,
                     # the engine thread's CPU outside the forward and sampling, the asyncio thread's CPU
                     engine_cpu=(engine_cpu - part["forward"][1] - part["sample"][1]) / steps * 1e3,
                     main_cpu=main_cpu / steps * 1e3)
            runs.append(r)
            fwd = step_s / steps * 1e3
            print(f"wall {wall:6.2f} s, {steps} steps, forward + sampling {step_s:6.2f} s; per step: outside the "
                  f"forward {r['outside']:.2f} ms (wall); CPU: engine thread {r['engine_cpu']:.2f} ms, asyncio "
                  f"thread {r['main_cpu']:.2f} ms", flush=True)
            print(f"  wall ms/step: step() {ms['step'][0]:.2f} = schedule {ms['schedule'][0]:.2f} + forward/sampling "
                  f"{fwd:.2f} + the rest {ms['step'][0] - ms['schedule'][0] - fwd:.2f}; between steps "
                  f"{wall / steps * 1e3 - ms['step'][0]:.2f}; engine thread CPU ms/step: schedule "
                  f"{ms['schedule'][1]:.2f}", flush=True)
            if not a.parts:
                continue
            print(f"  wall ms/step: step() {ms['step'][0]:.2f} = schedule {ms['schedule'][0]:.2f} + forward/sampling "
                  f"{fwd:.2f} + append {ms['append'][0]:.2f} (emit {ms['emit'][0]:.2f}, detokenize "
                  f"{ms['detokenize'][0]:.2f}) + other {ms['step'][0] - ms['schedule'][0] - ms['append'][0] - fwd:.2f}; "
                  f"between steps {wall / steps * 1e3 - ms['step'][0]:.2f}", flush=True)
            print(f"  CPU ms/step (engine thread): schedule {ms['schedule'][1]:.2f}, append {ms['append'][1]:.2f} "
                  f"(emit {ms['emit'][1]:.2f}, detokenize {ms['detokenize'][1]:.2f})", flush=True)
    finally:
        engine.close()
    toks = sum(n for _, n in reqs)
    best = min(runs, key=lambda r: r["engine_cpu"] + r["main_cpu"])
    print(f"{a.requests} requests ({toks} output tokens, {a.adapters} adapters, tokenizer {a.tokenizer}, "
          f"{'stream' if a.stream else 'whole'}), best of {a.repeat}: per step {best['outside']:.2f} ms outside the "
          f"forward (wall), host CPU {best['engine_cpu']:.2f} ms engine thread + {best['main_cpu']:.2f} ms asyncio "
          f"thread ({best['steps']} steps, wall {best['wall']:.2f} s)")
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats(a.sort).print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
