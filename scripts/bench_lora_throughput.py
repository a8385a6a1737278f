"""Multi-LoRA offline throughput on a GPU: the base model vs LoRA on a Llama-2-7B-shaped model with
seeded random weights made on the device (nothing downloaded, no weights travel), one process.

  prepare (here):   python scripts/bench_lora_throughput.py prepare --out requests.npz
  compile (here):   python scripts/bench_lora_throughput.py compile --out DIR            # [--smoke] [--target llvm]
  run (the GPU):    python scripts/bench_lora_throughput.py run --lib-dir DIR --requests requests.npz
  merge + chart:    python scripts/bench_lora_throughput.py plot A.json [B.json ...] --out F.json

Requests: ShareGPT sampled as scripts/bench_throughput.py does (vLLM's rules), all submitted at
once, EOS ignored. Configs: `base` (the base library), `lora4` (4 adapters of rank 8) and `lora64`
(64 adapters of mixed ranks 8..64), all on q,k,v,o,gate,up,down, through the sgmv LoRA library;
requests get their adapter round-robin (or `--assign uniform`, seeded). `--smoke` does the same on a
2-layer model with 16 short prompts (`run --smoke --device cpu` with a `compile --smoke --target
llvm` library runs here) after checking the LoRA library's logits against harness/torch_llama.py.
There is no Llama-2 tokenizer offline: prompts are tokenized with the embedded SmolLM2 tokenizer
and the ids mapped into Llama-2's 32000-token vocabulary (id % 32000); only the lengths matter.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import sys
import time
import weakref
from pathlib import Path

from harness import cli, offline, plot as charts
from harness.cli import config_of, is_base_run, run_labels, tqdm
from harness.workload import (add_prepare, adapter_set, assign_adapters, load_requests, prepare_requests,
                              requests_note)

KV_PAGES = 9216  # KV pages of the 7B runs: 147,456 tokens, 72 GiB (a page: 16 tokens, 8 MiB)
MAX_RANK, NUM_ADAPTERS_MAX = 64, 64
SIZES = {  # compile options per model size; the KV/pool pages are checked against layout.py below
    "7b": dict(prefill_chunk_size=4096, max_batch_size=256, kv_pages=KV_PAGES, num_prompts=1000),
    "smoke": dict(prefill_chunk_size=256, max_batch_size=16, kv_pages=256, num_prompts=16),
}
CONFIGS = {  # name -> (library, [(rank, count)])
    "base": ("base", []),
    "lora4": ("lora", [(8, 4)]),
    "lora64": ("lora", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    "lora0": ("lora", []),  # the LoRA library with no adapter: batches run its functions without LoRA
    # the same 4 x r8 on the library without the _fused functions (--no-lora-fused): every batch
    # runs cuBLAS + the sgmv kernels
    "lora4-nofused": ("lora-nofused", [(8, 4)]),
    # the same 4 x r8 and 64 mixed with the Triton tensor-core stage 3 asked for by name
    # (--lora-sgmv-backend triton; what `auto` picks where Triton is installed)
    "lora4-triton": ("lora-triton", [(8, 4)]),
    "lora64-triton": ("lora-triton", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    # the same 4 x r8 on a library compiled for max rank 16 (vLLM's default max_lora_rank) instead
    # of 64: the kernels' register tiles and loops are sized by the compiled maximum
    "lora4-r16": ("lora-r16", [(8, 4)]),
    # the same 4 x r8 on the TIR stage-3 kernels (a shrink and an expand per module, then the
    # concat and add), which the CUDA kernels (one pair per fused linear, in place) replace
    "lora4-tir": ("lora-tir", [(8, 4)]),
    # the library with rank rows (--lora-rank-rows): past 64 tokens the fused functions run the
    # shrink inside cuBLAS's GEMM; and with no adapter (its base functions read views of the weights)
    "lora4-rows": ("lora-rows", [(8, 4)]),
    "lora0-rows": ("lora-rows", []),
    # the library whose targeted weights carry the rank columns route's spare columns (the default
    # where the fused functions are built; asked for by name): every GEMM over them reads their first
    # columns with the wider row stride
    "lora4-cols": ("lora-cols", [(8, 4)]),
    "lora64-cols": ("lora-cols", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    "lora0-cols": ("lora-cols", []),
    # the library without them (--no-lora-spare-columns): past 64 tokens cuBLAS + the shrink/expand pair
    "lora4-pair": ("lora-pair", [(8, 4)]),
    "lora0-pair": ("lora-pair", []),
    # the same 64 mixed with the engine's max_loras (as vLLM's --max-loras): the running requests
    # span at most that many adapters, so a step reads fewer adapters' rows (MAX_LORAS below)
    "lora64-max16": ("lora", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    "lora64-max8": ("lora", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    # the same on a library whose pool stores adapter rows as int8 with a scale per row
    # (--lora-rows int8: half the rows' bytes and pages, lossy; no fused functions)
    "lora4-int8": ("lora-int8", [(8, 4)]),
    "lora64-int8": ("lora-int8", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    "lora0-int8": ("lora-int8", []),
}
MAX_LORAS = {"lora64-max16": 16, "lora64-max8": 8}


def pool_pages(model_cfg: dict, kv_pages: int) -> tuple[int, int]:
    """(pages of the largest adapter set of CONFIGS, compiled --lora-pool-pages = KV + that)."""
    import types  # pylint: disable=import-outside-toplevel

    from mlc_lora.contract import LORA_MODULES  # pylint: disable=import-outside-toplevel
    from mlc_lora.lora.layout import layout_adapter, make_spec  # pylint: disable=import-outside-toplevel

    spec = make_spec(types.SimpleNamespace(**model_cfg, head_dim=model_cfg["hidden_size"] // model_cfg["num_attention_heads"]),
                     MAX_RANK, 1, LORA_MODULES, "sgmv")
    worst = layout_adapter(spec.page_elems, spec.modules, MAX_RANK).num_pages * NUM_ADAPTERS_MAX
    return worst, kv_pages + worst


def compile_libs(a) -> int:
    from mlc_lora.compile import CompileOptions  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes.ops import kernel_attrs  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    kernel_attrs.PDL = not a.no_pdl  # our kernels' launches programmatic (the default) or not
    if a.attention_decode:  # the attention's decode kernel, where not the default (to time against)
        from mlc_lora.compiler_passes.ops.attention import attention_cuda  # pylint: disable=import-outside-toplevel

        attention_cuda.DECODE_KERNEL = f"mlc_lora_attn_decode_{a.attention_decode}"

    size = SIZES["smoke" if a.smoke else "7b"]
    model_cfg = random_model.TINY if a.smoke else random_model.LLAMA2_7B
    adapters, pages = pool_pages(model_cfg, size["kv_pages"])
    common = dict(target=a.target, dtype="float32" if a.target == "llvm" else "float16",
                  prefill_chunk_size=size["prefill_chunk_size"], max_batch_size=size["max_batch_size"],
                  gemm="cublas", cuda_graph=True, rope_append=a.rope_append, add_norm=a.add_norm,
                  bounded_prefill_memory=a.bounded_prefill_memory)
    lora = dict(common, lora_pool_pages=pages, lora_kernel="sgmv")
    libs = {"base": CompileOptions(**common),
            "lora": CompileOptions(**lora, max_lora_rank=MAX_RANK),
            "lora-nofused": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_fused=False),
            "lora-triton": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_sgmv_backend="triton"),
            "lora-r16": CompileOptions(**lora, max_lora_rank=16),
            "lora-tir": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_sgmv_backend="tir"),
            "lora-rows": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_rank_rows=True),
            "lora-cols": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_spare_columns=True),
            "lora-pair": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_spare_columns=False),
            "lora-int8": CompileOptions(**lora, max_lora_rank=MAX_RANK, lora_rows="int8")}
    # by default every library the target can build (the CUDA C++ and Triton stage 3 and the rank
    # rows and columns routes are CUDA only; without them lora-pair and lora-cols are lora), int8 rows
    # (lossy) only when named
    names = a.libs.split(",") if a.libs else [n for n, o in libs.items() if o.lora_rows == "model" and (
        a.target == "cuda" or (o.lora_sgmv_backend not in ("cuda", "triton") and not o.lora_rank_rows
                               and o.lora_spare_columns is None))]
    for name in names:
        if name not in libs:
            raise SystemExit(f"unknown library {name!r}; choose from {', '.join(libs)}")
        opts = libs[name]
        secs = random_model.build(a.out / name, model_cfg, opts, name=f"llama-{'tiny' if a.smoke else '2-7b'}-random")
        notes = ", ".join(n for n, on in (("no programmatic launches", a.no_pdl),
                                           ("TVM's RoPE and KV append", not a.rope_append),
                                           ("TVM's residual add and RMSNorm", not a.add_norm),
                                           ("prefill memory per token count", not a.bounded_prefill_memory),
                                           (f"the attention's {a.attention_decode} decode kernel",
                                            a.attention_decode)) if on)
        print(f"{a.out / name}: built in {secs:.0f} s{f' ({notes})' if notes else ''}")
    print(f"pool: {size['kv_pages']} KV pages + {adapters} for {NUM_ADAPTERS_MAX} adapters of rank {MAX_RANK} "
          f"on all 7 modules = --lora-pool-pages {pages}")
    return 0


def run_config(name, lib_dir, device, requests, weights, torch, a, size):
    """One config through AsyncMLCEngine; adapters are made and loaded before the clock starts."""
    from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    lib, ranks_counts = CONFIGS[config_of(name)]
    adapters = adapter_set(ranks_counts, a.seed)
    folder = lib_dir / lib
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    spec_pages = 0
    if adapters:
        from mlc_lora.lora.layout import LoraSpec, layout_adapter  # pylint: disable=import-outside-toplevel

        spec = LoraSpec.from_json(cfg["lora"])
        spec_pages = sum(layout_adapter(spec.page_elems, spec.modules, r).num_pages for _, r in adapters)
    # every config gets the same KV pages; the LoRA pool holds the adapters on top of them
    total_tokens = (a.kv_pages or size["kv_pages"]) * 16 + spec_pages * 16
    engine = AsyncMLCEngine(folder, a.device, max_num_seqs=a.max_num_seqs or size["max_batch_size"],
                            max_loras=MAX_LORAS.get(config_of(name)),
                            max_total_tokens=total_tokens, params=random_model.lib_params(weights, cfg))
    try:
        t0 = time.perf_counter()
        modules = [m["name"] for m in cfg["lora"]["modules"]] if cfg.get("lora") else []
        for i, (aname, rank) in enumerate(tqdm(adapters, desc=f"{name}: adapters", unit="adapter", disable=not adapters)):
            ad = random_model.random_adapter(aname, cfg["model_config"], modules, rank, torch, device,
                                             seed=a.seed * 1000 + i)
            asyncio.run(engine.load_adapter(aname, ad, pin=True))
        load_s = time.perf_counter() - t0
        assign = assign_adapters([n for n, _ in adapters], len(requests), a.assign, a.seed)
        if a.warmup:  # kernel loading and first captures out of the clock
            offline.drive(engine, [(p[:8], 4) for p, _ in requests[:a.warmup]], assign[:a.warmup], f"{name} warm-up")
        if a.capture_all:
            # requests of 1..B output tokens: the decode batch shrinks by one per step, so every batch
            # size's CUDA graph is captured before the clock (as servers capture at startup)
            b = min(a.max_num_seqs or size["max_batch_size"], len(requests))
            offline.drive(engine, [(p[:8], i + 1) for i, (p, _) in enumerate(requests[:b])], assign[:b],
                          f"{name} capture")
        base_stats = asyncio.run(engine.stats())
        with cli.GpuMonitor() as gpu:  # a hot or power-capped GPU runs slower: recorded with the result
            elapsed = offline.drive(engine, requests, assign, name)
        stats = asyncio.run(engine.stats())
    finally:
        engine.close()
    alive = weakref.ref(engine.engine)
    del engine
    # the engine's pool (KV + adapters) must go before the next config makes its own, and the
    # allocators' cached memory with it (a 4 x r8 run after two 64-adapter ones in one process
    # ran 10% slower, on an H100 and an H200, while gc.collect() alone was called here)
    offline.release()
    if alive() is not None:
        print(f"warning: the {name} engine is still referenced; its pool was not freed", flush=True)
    steps = {k: stats[k] - base_stats[k] for k in ("num_steps", "num_prefill_steps", "num_decode_steps")}
    # which compiled functions the timed steps ran (the fused ones, the LoRA stage, the base ones)
    forwards = {k: n - base_stats["forwards"].get(k, 0) for k, n in sorted(stats["forwards"].items())}
    step_times = {k: dict(steps=v["steps"], seconds=round(v["seconds"], 4)) for k, v in sorted(
        offline.stats_delta(stats.get("step_times", {}), base_stats.get("step_times")).items())}
    return dict(config=name, library=lib, adapters=len(adapters),
                ranks=sorted({r for _, r in adapters}), assign=a.assign if adapters else None,
                max_loras=MAX_LORAS.get(config_of(name)),
                adapter_load_s=round(load_s, 2), elapsed_s=elapsed, requests=len(requests),
                prompt_tokens=sum(len(p) for p, _ in requests), output_tokens=sum(n for _, n in requests),
                **offline.rates(elapsed, requests),
                kv_pages=a.kv_pages or size["kv_pages"], adapter_pages=spec_pages,
                peak_batch=stats["max_running"], preemptions=stats["num_preemptions"], **steps,
                forwards={k: n for k, n in forwards.items() if n},
                step_times={k: v for k, v in step_times.items() if v["steps"]}, gpu=gpu.summary)


def check_parity(lib_dir, device, tdev, weights, torch, seed, ranks=(8, 64), lib="lora") -> float:
    """The LoRA library `lib`'s prefill and (graph-captured) decode with the pool's tables, a mixed
    batch (an adapter of ranks[0], base model, an adapter of ranks[1]), against
    harness.torch_llama in float32; returns the largest relative error ||ours - ref|| / ||ref||
    over the rows. Ranks summing to at most the library's fused rank columns run prefill_fused
    (110 tokens: cuBLAS + the shrink/expand pair, or the rank rows route) and decode_fused (3 tokens:
    the one-kernel linear; then the first row alone, one token), others prefill and decode."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from harness.torch_llama import TorchLlama  # pylint: disable=import-outside-toplevel
    from mlc_lora.contract import CONFIG_FILE, FUSED_FUNCTION_SUFFIX  # pylint: disable=import-outside-toplevel
    from mlc_lora.lora.layout import as_int8_rows, pack_adapter  # pylint: disable=import-outside-toplevel
    from mlc_lora.models.random_model import lib_params, random_adapter  # pylint: disable=import-outside-toplevel
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    folder = lib_dir / lib
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    mc = cfg["model_config"]
    r = ModelRunner(folder, device, params=lib_params(weights, cfg))
    spec = r.lora
    kv = r.create_pool(4, 128 * 16)
    ads = {i: random_adapter(f"check{i}", mc, spec.module_names, rank, torch, tdev, seed=seed + 77 + i)
           for i, rank in enumerate(ranks)}
    fused = spec.fused_fits(2, sum(ranks))
    suffix = FUSED_FUNCTION_SUFFIX if fused else ""
    print(f"check {lib_dir.name}/{lib}: adapters of ranks {ranks}: prefill{suffix} and decode{suffix} run")
    for i, ad in ads.items():
        p = pack_adapter(spec, ad, r.compiled.numpy_dtype)
        kv.load_packed_adapter(i, p, True)
    if spec.rows == "int8":  # the reference serves the rows int8 rows stand for
        ads = {i: as_int8_rows(ad) for i, ad in ads.items()}
    rng = np.random.default_rng(seed)
    # 326 tokens in the prefill (the chunk permitting): past the one-kernel linear's 64 and the decode
    # sizes' 256, so prefill takes the kernels of prefill-sized batches
    long = min(300, r.compiled.prefill_chunk_size - 26)
    rows = [(0, rng.integers(0, r.vocab_size, 7).tolist()), (None, rng.integers(0, r.vocab_size, 19).tolist()),
            (1, rng.integers(0, r.vocab_size, long).tolist())]
    for sid, (aid, _) in enumerate(rows):
        kv.add_sequence(sid)
        kv.set_sequence_adapter(sid, aid)
    seqs = [list(p) for _, p in rows]
    base = json.loads((lib_dir / "base" / CONFIG_FILE).read_text())["param_shapes"]
    ref_model = TorchLlama({n: w[:base[n][0]] for n, w in weights.items()}, mc, torch, torch.float32)

    def ref(ids, adapter):
        return ref_model.prefill(torch.as_tensor([ids], device=tdev), adapter)[0]

    worst = 0.0
    for step in range(4):  # a prefill, two decode steps (the first captures the graphs), the first row alone
        if step == 0:
            got = r.prefill(kv, [0, 1, 2], seqs, lora="pool")
        elif step < 3:
            got = r.decode(kv, [0, 1, 2], [s[-1] for s in seqs], lora="pool")
        else:
            got = r.decode(kv, [0], [seqs[0][-1]], lora="pool")
        got = torch.from_dlpack(got).float().to(tdev)
        for i, (aid, _) in enumerate(rows[:got.shape[0]]):
            want = ref(seqs[i], ads.get(aid))
            err = ((got[i] - want).norm() / want.norm()).item()
            worst = max(worst, err)
            if step == 0 and aid is not None:
                base = ref(seqs[i], None)
                print(f"check: adapter {aid} moves the logits by {((want - base).norm() / want.norm()).item():.2e} "
                      "(relative), which the errors below must stay well under")
            print(f"check: step {step} row {i} ({'base' if aid is None else f'adapter {aid}'}): rel err {err:.2e}")
        for s in seqs[:got.shape[0]]:
            s.append(int(rng.integers(0, r.vocab_size)))
    del kv, r
    gc.collect()
    return worst


def merged_runs(old: list, new: list) -> list:
    """The runs of an earlier file (`--append`) with this call's, a config's new run replacing its old
    one, in CONFIGS order."""
    by = {r["config"]: r for r in old}
    by.update({r["config"]: r for r in new})
    order = {c: i for i, c in enumerate(CONFIGS)}
    return sorted(by.values(), key=lambda r: (order[config_of(r["config"])], r["config"]))


def run_lora(a) -> int:  # pylint: disable=too-many-locals
    import torch  # pylint: disable=import-outside-toplevel  (before TVM: loads libcublas first)

    from mlc_lora.contract import CONFIG_FILE  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    size = SIZES["smoke" if a.smoke else "7b"]
    lib_dir = Path(a.lib_dir)
    tdev = "cpu" if a.device == "cpu" else a.device
    if tdev != "cpu":
        cli.gpu_runtime()
    num = a.num_prompts or size["num_prompts"]
    requests = load_requests(a.requests, num, a.max_prompt_len or (128 if a.smoke else None),
                             a.max_output_len or (32 if a.smoke else None))
    note = requests_note(a.requests)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens; {note}")
    cfg = json.loads((lib_dir / "base" / CONFIG_FILE).read_text())
    configs = a.configs.split(",")
    cli.check_run_names(configs, CONFIGS, a.compare_lib_dir)

    def where(name):  # the library folder a config runs
        return Path(a.compare_lib_dir) if cli.on_compare_dir(name) else lib_dir

    libs = list(dict.fromkeys(["lora"] + [CONFIGS[config_of(n)][0] for n in configs if not cli.on_compare_dir(n)]))
    folders = list(dict.fromkeys([lib_dir / lib for lib in libs]
                                 + [where(n) / CONFIGS[config_of(n)][0] for n in configs]))
    t0 = time.time()
    try:  # one set of weights for every library (a library with rank rows takes taller ones)
        weights = random_model.make_params(cfg, torch, tdev, seed=a.seed, others=[
            json.loads((f / CONFIG_FILE).read_text()) for f in folders])
    except ValueError as e:
        raise SystemExit(f"the libraries were compiled from different models: {e}") from e
    if tdev != "cpu":
        torch.cuda.synchronize()
    print(f"weights: {sum(v.numel() for v in weights.values()) / 1e9:.2f} B params on {tdev} in {time.time() - t0:.1f} s")
    if (a.smoke or a.check) and not a.no_check:  # every LoRA library the configs run (--compare-lib-dir's too)
        checked = dict.fromkeys([(lib_dir, lib) for lib in libs] + [(where(n), CONFIGS[config_of(n)][0]) for n in configs])
        err = max(check_parity(d, a.device, tdev, weights, torch, a.seed, ranks, lib)
                  for d, lib in checked if lib != "base" for ranks in ((8, 64), (8, 16)))
        tol = 1e-4 if cfg["dtype"] == "float32" else 2e-2
        print(f"check: LoRA library vs torch reference, worst rel err {err:.2e} (tolerance {tol:g})", flush=True)
        if not err < tol:
            raise SystemExit("the LoRA library's logits do not match the torch reference")
        if tdev != "cpu":  # the float32 reference's memory back to the device for the engines' pools
            torch.cuda.empty_cache()
    results = []
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() and a.append else {}
    for i, (name, label) in enumerate(zip(configs, run_labels(configs))):
        r = run_config(label, where(name), tdev, requests, weights, torch, a, size)
        r["position"] = i + 1  # in this process
        if cli.on_compare_dir(name):
            r["lib_dir"] = str(a.compare_lib_dir)
        results.append(r)
        # each run kept as it ends: a call cut short (a device's time limit) still leaves its runs
        cli.write_results(out, {"model": cfg["model_name"], "device": a.device,
                                "results": merged_runs(old.get("results", []), results), "complete": False})
        print(f"{label}: {r['elapsed_s']:.2f} s, {r['requests_per_s']:.2f} requests/s, "
              f"{r['output_tokens_per_s']:.1f} output tokens/s, {r['total_tokens_per_s']:.1f} total tokens/s "
              f"(peak batch {r['peak_batch']}, {r['preemptions']} preemptions, {r['num_steps']} steps; "
              f"adapters loaded in {r['adapter_load_s']} s)", flush=True)
        print(f"{label}: forwards by function {r['forwards']}", flush=True)
        if r["gpu"]:
            g = r["gpu"]
            print(f"{label}: GPU SM clock {g['sm_clock_mhz_mean']} MHz mean, {g['sm_clock_mhz_min']} min; "
                  f"{g['temperature_c_max']:.0f} C max; {g['power_w_mean']} W mean, {g['power_w_max']:.0f} max; "
                  f"throttle reasons {', '.join(g['throttle_reasons']) or 'none'}", flush=True)
    results = with_ratios(merged_runs(old.get("results", []), results))
    print("\n| config | run | adapters | req/s | output tok/s | total tok/s | req/s vs base |\n"
          "|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['config']} | {r.get('position', '-')} | {r['adapters']} | {r['requests_per_s']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} | {r['ratio_vs_base']:.3f} |")
    if sum(is_base_run(r["config"]) for r in results) > 1:
        print("(vs base: against the mean of the base runs)")
    sums = step_sums(results)
    if sums:
        print("\n| config | runs | prefill steps, s | decode steps, s | both | vs base |\n|---|---|---|---|---|---|")
        base = sums.get("base", {}).get("steps")
        for label, v in sums.items():
            print(f"| {label} | {v['runs']} | {v['prefill']:.2f} | {v['decode']:.2f} | {v['steps']:.2f} | "
                  f"{v['steps'] / base if base else float('nan'):.3f} |")
        print("(each bucket's mean step time in the config's runs times its mean step count over all runs)")
        if "base" in sums and len(sums) > 1:  # where each config's extra seconds sit, bucket by bucket
            others = [k for k in sums if k != "base"]
            keys = sorted(sums["base"]["buckets"], key=lambda k: (k.split("_")[0], int(k.split("=")[1])))
            print("\n| bucket | base, s | " + " | ".join(f"{k} - base" for k in others) + " |\n|---|---|" +
                  "---|" * len(others))
            for k in keys:
                b = sums["base"]["buckets"][k]
                print(f"| {k} | {b:.3f} | " + " | ".join(f"{sums[o]['buckets'].get(k, float('nan')) - b:+.3f}"
                                                         for o in others) + " |")
    cli.write_results(out, {"model": cfg["model_name"], "model_config": cfg["model_config"], "device": a.device,
                            "requests_file": str(a.requests), "tokenizer": note,
                            "sampling": "temperature 1.0, top_p 1.0, EOS ignored", "results": results,
                            "step_sums": sums, "complete": True})
    print(f"results: {out}")
    draw(results, out.with_suffix(".png"))
    return 0


def step_sums(results) -> dict:
    """Per config (its runs NAME, NAME#2, ... together; NAME@cmp apart), the seconds of its prefill
    and decode steps with the runs' different mixes of batch sizes taken out: each step-size bucket's
    mean time per step in the config's runs times the bucket's mean step count over all runs (runs
    of one request set schedule the same work into slightly different buckets, which moves their raw
    sums by more than most changes being timed). Only the buckets every config stepped in count;
    "buckets" holds each one's seconds."""
    timed = [r for r in results if r.get("step_times")]
    groups: dict[str, list] = {}
    for r in timed:
        groups.setdefault(r["config"].split("#")[0], []).append(r)
    # the buckets every config stepped in (a bucket of a step or two in some runs only is left out)
    buckets = sorted(k for k in {k for r in timed for k in r["step_times"]}
                     if all(any(k in r["step_times"] for r in runs) for runs in groups.values()))
    count = {k: sum(r["step_times"].get(k, {}).get("steps", 0) for r in timed) / len(timed) for k in buckets}
    out = {}
    for label, runs in groups.items():
        v = {"runs": len(runs), "prefill": 0.0, "decode": 0.0, "buckets": {}}
        for k in buckets:
            steps = sum(r["step_times"].get(k, {}).get("steps", 0) for r in runs)
            secs = sum(r["step_times"].get(k, {}).get("seconds", 0.0) for r in runs)
            if steps:
                v["buckets"][k] = secs / steps * count[k]
                v[k.split("_")[0]] += v["buckets"][k]
        v["steps"] = v["prefill"] + v["decode"]
        out[label] = v
    return out


def with_ratios(results):
    """Each result's req/s over base's (the mean of base's runs where it ran more than once)."""
    bases = [r["requests_per_s"] for r in results if is_base_run(r["config"])]
    base = sum(bases) / len(bases) if bases else None
    for r in results:
        r["ratio_vs_base"] = r["requests_per_s"] / base if base else float("nan")
    return results


def draw(results, path) -> None:
    """req/s per config, each bar labelled with its value and its ratio to base."""
    notes = [f"{r['requests_per_s']:.2f}" + (f" ({r['ratio_vs_base']:.2f}x)" if math.isfinite(r["ratio_vs_base"]) else "")
             for r in results]
    charts.bars([r["config"] for r in results], [r["requests_per_s"] for r in results], path,
                title="ShareGPT offline throughput", ylabel="requests/s", notes=notes)


def merge_plot(a) -> int:
    """Merge result files of runs split over processes; write the merged JSON and its charts."""
    docs = cli.read_results(a.results)
    merged = {k: v for k, v in docs[0].items() if k not in ("machine", "command", "time")}
    merged["results"] = with_ratios([r for d in docs for r in d["results"]])
    merged["merged_from"] = [{"file": str(f), "machine": d.get("machine"), "command": d.get("command")}
                             for f, d in zip(a.results, docs)]
    out = Path(a.out)
    cli.write_results(out, merged)
    draw(merged["results"], out.with_suffix(".svg"))
    draw(merged["results"], out.with_suffix(".png"))
    return 0


def main(argv=None) -> int:
    ap, sub = cli.parser(__doc__, __file__)
    add_prepare(sub)
    c = cli.add_compile(sub, "build the base and LoRA (sgmv) libraries into one folder (here)")
    c.add_argument("--target", default="cuda", choices=["cuda", "llvm"])
    c.add_argument("--smoke", action="store_true", help="the 2-layer model")
    c.add_argument("--libs", default=None, help="comma-separated libraries to build, of base, lora, lora-nofused, lora-triton, "
                   "lora-r16, lora-tir (default: all the target can build; a config runs on its library)")
    c.add_argument("--no-pdl", action="store_true", help="launch the libraries' own CUDA kernels without "
                   "programmatic dependent launch (ops/kernel_attrs.py PDL; to time against: run --compare-lib-dir)")
    c.add_argument("--no-rope-append", dest="rope_append", action="store_false", help="TVM's RoPE and KV append "
                   "kernels instead of the one kernel of both (CompileOptions.rope_append; to time against)")
    c.add_argument("--no-add-norm", dest="add_norm", action="store_false", help="TVM's residual add and RMSNorm "
                   "kernels instead of the one kernel of both (CompileOptions.add_norm; to time against)")
    c.add_argument("--no-bounded-prefill-memory", dest="bounded_prefill_memory", action="store_false",
                   help="prefill's memory planned per token count instead of at the chunk's bound "
                   "(CompileOptions.bounded_prefill_memory; to time against)")
    c.add_argument("--attention-decode", default=None, choices=["pipe2", "pipe4"], help="the attention's "
                   "pipelined decode kernel instead of the default one (attention_cuda.DECODE_KERNELS; to time "
                   "against: run --compare-lib-dir)")
    r = sub.add_parser("run", help="base vs LoRA through AsyncMLCEngine, weights and adapters made on the device")
    r.add_argument("--lib-dir", required=True)
    r.add_argument("--compare-lib-dir", default=None, help="a second folder of libraries (e.g. the build before a "
                   "change): config NAME@cmp runs NAME with its library from there, in the same process")
    r.add_argument("--requests", required=True, help="the file of `prepare`")
    r.add_argument("--device", default="cuda")
    r.add_argument("--smoke", action="store_true", help="the 2-layer model, 16 short prompts, and a logits "
                   "check of the LoRA library (prefill + graph decode, mixed adapters) against torch")
    r.add_argument("--no-check", action="store_true", help="skip the smoke run's logits check")
    r.add_argument("--check", action="store_true", help="the logits check of --smoke on the full-size model too "
                   "(its torch reference in float32)")
    r.add_argument("--configs", default="base,lora4,lora64",
                   help=f"comma-separated, run in this order, from {', '.join(CONFIGS)}; a config named again runs "
                   "again (NAME#2, ...: the position in the process moves a result)")
    r.add_argument("--assign", choices=["roundrobin", "uniform"], default="roundrobin")
    r.add_argument("--num-prompts", type=int, default=None)
    r.add_argument("--max-prompt-len", type=int, default=None)
    r.add_argument("--max-output-len", type=int, default=None)
    r.add_argument("--max-num-seqs", type=int, default=None)
    r.add_argument("--kv-pages", type=int, default=None, help="KV pages of every config")
    r.add_argument("--warmup", type=int, default=8, help="short requests run before the clock starts")
    r.add_argument("--capture-all", action="store_true", help="before the clock, run every decode batch size "
                   "once (each size is a CUDA graph of its own, captured on first use)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default="bench_lora_throughput.json")
    r.add_argument("--append", action="store_true", help="merge with the configs already in --out")
    m = sub.add_parser("plot", help="merge result files of split runs into one JSON + charts (here)")
    m.add_argument("results", nargs="+")
    m.add_argument("--out", required=True)
    a = cli.parse(ap, argv)
    return {"prepare": prepare_requests, "compile": compile_libs, "run": run_lora, "plot": merge_plot}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
