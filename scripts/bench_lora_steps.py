"""Where a LoRA step's time goes inside ModelRunner: the Llama-2-7B-shaped libraries of
bench_lora_throughput.py (`base`, `lora`, `lora-nofused`), one decode or prefill step at a time,
base vs 4 adapters of rank 8 (or 64 of ranks 8/16/32/64 in turn: `lora64`), on a GPU, one process.

  python scripts/bench_lora_throughput.py compile --out DIR --libs base,lora,lora-nofused   # here
  python scripts/bench_lora_steps.py run --lib-dir DIR [--batches 1,16,64,128,256] [--prefill 512,1024,2048]
  python scripts/bench_lora_steps.py run --lib-dir NEW --compare-lib-dir OLD \
      --configs lora4-cols,lora4-cols@cmp,lora4-cols@cmp,lora4-cols   # A/B in one process, repeats averaged

For every (library, adapters, step) it reports: the step's wall time with a sync (median of
samples, harness/timing.wall_time), the host time of the call alone (launches queued, no sync:
what the engine pays before the GPU starts when it waits on every step), the step's GPU work alone
(harness/timing.queued_time: without the gaps a slow host leaves; decode steps only, a prefill
call waits on the GPU inside), and the GPU kernel time by kind from a torch.profiler
trace (cuBLAS GEMMs, LoRA kernels, attention, other), per step.
Decode runs with `--ctx` tokens of context per sequence (adapters round-robin over the batch);
prefill is one batch of 4 sequences of T/4 tokens each; `--mixed T` adds the steps the engine runs
most under load: every decode batch's sequences one token each plus a prefill chunk of T tokens of
one more sequence, in one call. Seeded random weights made on the device.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from harness import cli, offline
from harness.timing import HBM_TBS, queued_time, wall_time

LIBS = {"base": ("base", 0), "lora4": ("lora", 4), "lora4-nofused": ("lora-nofused", 4),
        "lora4-rows": ("lora-rows", 4), "lora4-cols": ("lora-cols", 4), "lora4-pair": ("lora-pair", 4),
        "lora64": ("lora", 64), "lora0": ("lora", 0), "lora0-cols": ("lora-cols", 0)}
# (lora-rows: --lora-rank-rows; lora-cols / lora-pair: CompileOptions.lora_spare_columns True / False)
RANK = 8
RANKS = {"lora64": (8, 16, 32, 64)}  # adapter i's rank: RANKS[config][i % 4] (bench_lora_throughput's lora64), else RANK
KINDS = ("gemm", "lora", "attention", "other")


def rows_bytes(spec, ranks, adapters, itemsize: int) -> int:
    """Bytes of the rank rows a step over `adapters` (ids; adapter i has rank ranks[i % len]) must
    read: every layer's A and B rows of each distinct adapter (rank x (in + out) per module)."""
    per_rank = sum(m.in_features + m.out_features for m in spec.modules) * spec.num_layers * itemsize
    return sum(ranks[i % len(ranks)] for i in set(adapters)) * per_rank


def kind_of(key: str) -> str:
    """gemm (cuBLAS, our GEMV; the one-kernel fused linear counts as lora), lora, attention, other."""
    k = key.lower()
    if any(s in k for s in ("shrink", "expand", "sgmv", "triton_linear")):
        return "lora"
    if any(s in k for s in ("gemm", "gemv", "nvjet", "sm90_xmma", "cutlass", "cublas")):
        return "gemm"
    if any(s in k for s in ("attention", "attn", "paged_kv", "ragged_kv", "merge_state", "flash", "_kv_cache",
                            "rope")):
        return "attention"
    return "other"


def mean_ms(rows: list[dict], which) -> dict[str, float]:
    """Per step, the mean ms of the runs whose label `which` takes."""
    got: dict[str, list[float]] = {}
    for x in rows:
        if which(x["config"]):
            got.setdefault(x["step"], []).append(x["ms"])
    return {step: sum(v) / len(v) for step, v in got.items()}


def compare_rows(rows: list[dict]) -> list[tuple[str, str, float, float]]:
    """(step, config, mean ms, mean ms of config@cmp) for each step a config ran on both libraries,
    its repeats (NAME#2, NAME@cmp#2) averaged: run NAME,NAME@cmp,NAME@cmp,NAME against the drift."""
    out = []
    for name in dict.fromkeys(cli.config_of(x["config"]) for x in rows):
        on = mean_ms(rows, lambda c, n=name: cli.config_of(c) == n and not cli.on_compare_dir(c))
        off = mean_ms(rows, lambda c, n=name: cli.config_of(c) == n and cli.on_compare_dir(c))
        out += [(step, name, on[step], off[step]) for step in on if step in off]
    return sorted(out)


def api_calls(prof, steps: int):
    """The CUDA runtime/driver calls the host made (kernel launches outside graphs, graph launches,
    copies, syncs, allocations): (name, calls per step, host us per step), most time first."""
    out = []
    for e in prof.key_averages():
        if e.key.startswith(("cuda", "cu")) and getattr(e, "self_cpu_time_total", 0) > 0:
            out.append((e.key[:60], e.count / steps, e.self_cpu_time_total / steps))
    return sorted(out, key=lambda r: -r[2])[:12]


def breakdown(prof, steps: int):
    """GPU kernel ms per step by kind, and the top kernels (name, calls per step, us per call)."""
    cats = dict.fromkeys(KINDS, 0.0)
    top = []
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dt <= 0 or e.key.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaStream")):
            continue
        if getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
            continue
        cats[kind_of(e.key)] += dt
        top.append((e.key[:90], e.count / steps, dt / max(e.count, 1)))
    top.sort(key=lambda r: -r[1] * r[2])
    return {k: round(v / 1e3 / steps, 3) for k, v in cats.items()}, top[:14]


_PARTS = {"pool": ("begin_forward", "end_forward", "lora_tables", "lora_num_slots", "lora_rank_total"),
          "runner": ("embed", "_graph_tables", "_lora_args")}


def host_parts(r, kv) -> dict:
    """Wrap the parts of a decode call with host timers (seconds, summed); the VM functions too."""
    acc = {}

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
        setattr(obj, name, timed)

    for name in _PARTS["pool"]:
        wrap(kv, name, f"pool.{name}")
    for name in _PARTS["runner"]:
        wrap(r, name, f"runner.{name}")
    r._saved_fns = (r._decode, r._base_fns, r._fused_fns)  # pylint: disable=protected-access
    holder = type("H", (), {})()
    holder.decode = r._decode  # pylint: disable=protected-access
    wrap(holder, "decode", "vm decode")
    r._decode = holder.decode  # pylint: disable=protected-access
    if r._base_fns is not None:  # pylint: disable=protected-access
        holder.base = r._base_fns[1]  # pylint: disable=protected-access
        wrap(holder, "base", "vm decode_base")
        r._base_fns = (r._base_fns[0], holder.base)  # pylint: disable=protected-access
    if r._fused_fns[1] is not None:  # pylint: disable=protected-access
        holder.fused = r._fused_fns[1]  # pylint: disable=protected-access
        wrap(holder, "fused", "vm decode_fused")
        r._fused_fns = (r._fused_fns[0], holder.fused)  # pylint: disable=protected-access
    return acc


def restore_parts(r, kv) -> None:
    for name in _PARTS["pool"]:
        delattr(kv, name)
    for name in _PARTS["runner"]:
        delattr(r, name)
    r._decode, r._base_fns, r._fused_fns = r._saved_fns  # pylint: disable=protected-access


def run(a) -> int:  # pylint: disable=too-many-locals,too-many-statements
    import torch  # pylint: disable=import-outside-toplevel  (loads libcublas first)
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel

    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel
    from mlc_lora.lora.layout import pack_adapter  # pylint: disable=import-outside-toplevel
    from mlc_lora.models.random_model import lib_params, make_params, random_adapter  # pylint: disable=import-outside-toplevel
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    dev = a.device
    if dev == "cuda":
        cli.gpu_runtime()
    log = cli.Log(a.log_dir, "bench_lora_steps")
    say = log.say
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    lib_dir = Path(a.lib_dir)
    cfg = json.loads((lib_dir / "base" / CONFIG_FILE).read_text())
    mc = cfg["model_config"]
    configs = a.configs.split(",")
    cli.check_run_names(configs, LIBS, a.compare_lib_dir)

    def folder_of(name):  # the library a run's config runs on
        return (Path(a.compare_lib_dir) if cli.on_compare_dir(name) else lib_dir) / LIBS[cli.config_of(name)][0]

    p = make_params(cfg, torch, dev, others=[json.loads((folder_of(n) / CONFIG_FILE).read_text()) for n in configs])
    sync()
    V = mc["vocab_size"]
    gen = torch.Generator(device="cpu").manual_seed(a.seed)
    bw = a.bandwidth_tbs
    if bw is None and dev == "cuda":
        name = torch.cuda.get_device_name()
        bw = next((v for k, v in HBM_TBS.items() if k in name), None)

    def floor_ms(r, n_ad, ranks, ids):
        """The step's rank rows at the bandwidth, ms (None without adapters or a bandwidth)."""
        if not n_ad or not bw:
            return None
        item = np.dtype(r.compiled.numpy_dtype).itemsize
        return round(rows_bytes(r.lora, ranks, [i % n_ad for i in ids], item) / (bw * 1e12) * 1e3, 3)

    batches = [int(b) for b in a.batches.split(",") if b]
    prefills = [int(t) for t in a.prefill.split(",") if t]
    mixed = [int(t) for t in a.mixed.split(",") if t]
    rows = []

    def queued(fn, setup=None):  # (host ms, GPU ms alone) of a call; (None, None) off CUDA
        return queued_time(fn, setup=setup) if dev == "cuda" else (None, None)

    for name in cli.run_labels(configs):  # (a config named again runs again: NAME#2)
        n_ad = LIBS[cli.config_of(name)][1]
        folder = folder_of(name)
        lcfg = json.loads((folder / CONFIG_FILE).read_text())
        r = ModelRunner(folder, dev, params=lib_params(p, lcfg))
        packed, ranks = [], RANKS.get(cli.config_of(name), (RANK,))
        if n_ad:
            for i in range(n_ad):
                ad = random_adapter(f"a{i}", mc, r.lora.module_names, ranks[i % len(ranks)], torch, dev, seed=a.seed + i)
                packed.append(pack_adapter(r.lora, ad, r.compiled.numpy_dtype))

        # one pool per runner (decode graphs stay bound to its LoRA arena); sequences come and go
        pages = sum(pk.pages.shape[1] for pk in packed)
        kv = r.create_pool(r.compiled.max_batch_size, max(batches) * (a.ctx + 128) + 2 * max(prefills + mixed + [0])
                           + 16 * pages)
        for i, pk in enumerate(packed):
            kv.load_packed_adapter(i, pk, True)
        lora = "pool" if packed else None

        def fresh(ids, kv=kv, packed=packed):
            for s in ids:
                try:
                    kv.remove_sequence(s)
                except Exception:  # pylint: disable=broad-except  (not there yet)
                    pass
                kv.add_sequence(s)
                if packed:
                    kv.set_sequence_adapter(s, s % len(packed))

        def one_prefill(step, ids, toks, new):
            """Time and profile one prefill call over `ids` (`new`: its sequences added afresh
            before each call, removed after) and record the row."""
            ms = wall_time(lambda: r.prefill(kv, ids, toks, lora=lora), setup=lambda: fresh(new), repeat=5,
                           warmup=1, sync=sync) * 1e3
            host, gpu = queued(lambda: r.prefill(kv, ids, toks, lora=lora), setup=lambda: fresh(new))
            fresh(new)
            sync()
            acts = [ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]
            host_acts = [ProfilerActivity.CPU] if a.profile_host and dev == "cuda" else []
            with profile(activities=acts + host_acts) as prof:
                r.prefill(kv, ids, toks, lora=lora)
                sync()
            cats, top = breakdown(prof, 1)
            if a.profile_host:
                say(f"{name} {step}: CUDA API calls per step (calls, host us per step)")
                for key, calls, us in api_calls(prof, 1):
                    say(f"  {calls:8.1f} {us:9.1f}  {key}")
            rows.append(dict(config=name, step=step, ms=round(ms, 3), host_ms=host, gpu_ms=gpu, **cats, top=top,
                             rows_ms=floor_ms(r, n_ad, ranks, ids)))
            say(f"{name} {step}: {ms:.3f} ms/step, host {host} ms, GPU alone {gpu} ms, kernels {cats}")
            for s in new:
                kv.remove_sequence(s)

        for b in batches:
            seqs, tok = list(range(b)), [1] * b
            fresh(seqs)
            for s in range(0, b, 8):
                chunk = list(range(s, min(b, s + 8)))
                r.prefill(kv, chunk, [torch.randint(0, V, (a.ctx,), generator=gen).tolist() for _ in chunk], lora=lora)
            for _ in range(3):  # the first steps capture the graphs
                r.decode(kv, seqs, tok, lora=lora)
            sync()
            ms = wall_time(lambda: r.decode(kv, seqs, tok, lora=lora), number=10, repeat=3, warmup=0, sync=sync) * 1e3
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                r.decode(kv, seqs, tok, lora=lora)
            host = (time.perf_counter() - t0) / 10 * 1e3  # launches only, unless the call waits on the GPU
            sync()
            _, gpu = queued(lambda: r.decode(kv, seqs, tok, lora=lora))
            if a.profile_host:  # host ms per call of each part of ModelRunner.decode
                acc = host_parts(r, kv)
                for _ in range(10):
                    r.decode(kv, seqs, tok, lora=lora)
                sync()
                parts = {k: round(v * 100, 3) for k, v in acc.items()}  # seconds over 10 calls -> ms per call
                say(f"{name} decode b={b}: host ms per call by part {parts}")
                restore_parts(r, kv)
            acts = [ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]
            with profile(activities=acts + ([ProfilerActivity.CPU] if a.profile_host and dev == "cuda" else [])) as prof:
                for _ in range(5):
                    r.decode(kv, seqs, tok, lora=lora)
                sync()
            cats, top = breakdown(prof, 5)
            if a.profile_host:
                say(f"{name} decode b={b}: CUDA API calls per step (calls, host us per step)")
                for key, calls, us in api_calls(prof, 5):
                    say(f"  {calls:8.1f} {us:9.1f}  {key}")
            rows.append(dict(config=name, step=f"decode b={b}", ms=round(ms, 3), host_ms=round(host, 3), gpu_ms=gpu,
                             **cats, top=top, rows_ms=floor_ms(r, n_ad, ranks, seqs)))
            say(f"{name} decode b={b}: {ms:.3f} ms/step, host {host:.3f} ms, GPU alone {gpu} ms, kernels {cats}")
            for T in mixed:  # the decode batch's next tokens and a prefill chunk of a new sequence
                chunk = torch.randint(0, V, (T,), generator=gen).tolist()
                one_prefill(f"mixed b={b}+T={T}", seqs + [2000], [[1]] * b + [chunk], [2000])
            for s in seqs:
                kv.remove_sequence(s)
        for T in prefills:
            ids = list(range(1000, 1004))
            one_prefill(f"prefill T={T}", ids, [torch.randint(0, V, (T // len(ids),), generator=gen).tolist()
                                                 for _ in ids], ids)
        del kv, r, fresh, one_prefill  # (fresh holds the pool too, as its default argument)
        offline.release()  # the next config's pool must fit beside nothing of this one
        cli.write_results(log.json, dict(rows=rows, ctx=a.ctx, rank=RANK, complete=False))  # (a run cut short)
    say(f"\n(rows ms: the step's adapter rank rows read once at {bw} TB/s, the least any LoRA kernels take)"
        "\n| step | config | ms | host ms | GPU alone ms | gemm | lora | attention | other | vs base | rows ms |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|")
    base = mean_ms(rows, cli.is_base_run)
    for x in sorted(rows, key=lambda x: (x["step"], x["config"])):
        vs = f"{x['ms'] / base[x['step']]:.3f}" if x["step"] in base else "-"
        say(f"| {x['step']} | {x['config']} | {x['ms']:.3f} | {x['host_ms'] if x['host_ms'] is not None else '-'} | "
            f"{x.get('gpu_ms') if x.get('gpu_ms') is not None else '-'} | "
            f"{x['gemm']:.3f} | {x['lora']:.3f} | {x['attention']:.3f} | {x['other']:.3f} | {vs} | "
            f"{x['rows_ms'] if x['rows_ms'] is not None else '-'} |")
    pairs = compare_rows(rows)
    if pairs:
        say("\n(NAME against NAME@cmp, the same config on --compare-lib-dir's library)"
            "\n| step | config | ms | @cmp ms | ratio |\n|---|---|---|---|---|")
        for step, name, ms, cmp_ms in pairs:
            say(f"| {step} | {name} | {ms:.3f} | {cmp_ms:.3f} | {ms / cmp_ms:.3f} |")
    for x in rows:
        if x["config"] != "base":
            say(f"\n{x['config']} {x['step']}: top kernels (calls/step, us/call)")
            for k, c, us in x["top"]:
                say(f"  {c:6.1f} x {us:8.2f} us  {k}")
    cli.write_results(log.json, dict(rows=rows, ctx=a.ctx, rank=RANK, complete=True))
    return 0


def main(argv=None) -> int:
    ap, sub = cli.parser(__doc__, __file__)
    r = cli.add_run(sub, "time steps on the GPU")
    r.add_argument("--lib-dir", required=True, help="the folder of bench_lora_throughput.py compile")
    r.add_argument("--configs", default="base,lora4,lora4-nofused", help=f"of {', '.join(LIBS)}")
    r.add_argument("--compare-lib-dir", default=None, help="a second folder of libraries (e.g. the build before a "
                   "change): config NAME@cmp runs NAME with its library from there, in the same process")
    r.add_argument("--batches", default="1,16,64,128,256", help="decode batch sizes")
    r.add_argument("--prefill", default="512,1024,2048", help="prefill token counts (4 sequences)")
    r.add_argument("--mixed", default="", help="prefill chunk sizes run beside each decode batch in one step")
    r.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="memory bandwidth for the rows floor (default: by GPU name, H100 3.35, H200 4.8)")
    r.add_argument("--ctx", type=int, default=320, help="context tokens per sequence before the decode steps")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--profile-host", action="store_true",
                   help="host time of each part of 10 decode calls; the CUDA API calls of every step")
    r.add_argument("--device", default="cuda", help="cuda, or cpu to check the script on llvm libraries")
    a = cli.parse(ap, argv)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
