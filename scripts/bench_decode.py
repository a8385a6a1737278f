"""A Llama-2-7B-shaped model on one GPU: decode step time against the bandwidth floor, prefill
against a plain PyTorch implementation of the same model (cuBLAS + SDPA), and where the time goes.

Two steps, so that no 13 GB of weights travel:
  compile (any machine, no GPU):  python scripts/bench_decode.py compile --out OUT
  run (the GPU machine):          python scripts/bench_decode.py run --model OUT [--log-dir DIR]
The run makes seeded random fp16 weights on the GPU with torch and hands them to ModelRunner.
Timing (scripts/harness/timing.py): prefill and decode steps by the host clock around synchronized
GPU work (median of samples after warm-up); SDPA by the CUDA-graph method (20 calls on the same
q/k/v per graph). The torch model: scripts/harness/torch_llama.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness import cli
from harness.timing import PEAK_BW, compare, wall_time
from harness.torch_llama import TorchLlama
from mlc_lora.contract import CONFIG_FILE
from mlc_lora.models.random_model import LLAMA2_7B, build, make_params

PROMPT = 512  # tokens per prompt (prefill) and context before the timed decode steps


# name: (CUDA graphs for decode, attention kernels, gemv_max_rows; None: the default). graph: the default build;
# cublas: the same without our gemv kernel (every linear on cuBLAS); nograph: without graphs;
# tir: TVM's TIR attention kernels and no gemv (the baseline); gemv8: our kernels up to 8 tokens.
VARIANTS = {"graph": (True, "flash", None), "cublas": (True, "flash", 0), "nograph": (False, "flash", None),
            "tir": (True, "tir", 0), "gemv8": (True, "flash", 8)}
DECODE_BATCHES = (1, 4, 8, 16, 64)


def compile_variants(out: Path, layers: int, variants: list[str]) -> None:
    from mlc_lora import compile as C  # pylint: disable=import-outside-toplevel

    for name in variants:
        graph, attention, gemv = VARIANTS[name]
        gemv = C.CompileOptions.gemv_max_rows if gemv is None else gemv
        opts = C.CompileOptions(target="cuda", dtype="float16", prefill_chunk_size=16 * PROMPT,
                                context_window_size=16 * PROMPT, max_batch_size=64, gemm="cublas",
                                cuda_graph=graph, attention=attention, gemv_max_rows=gemv)
        secs = build(out / name, dict(LLAMA2_7B, num_hidden_layers=layers), opts, name="llama-2-7b-shape-random")
        print(f"{name}: built in {secs:.0f} s, {(out / name / 'lib.cuda.so').stat().st_size >> 10} KiB")


# --------------------------------------------------------------------------------------------
# GPU side


def kernel_breakdown(prof, steps):
    """GPU kernel time (ms per step) by kind, from a torch.profiler trace."""
    cats = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dt <= 0 or e.key.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "Memcpy", "Memset")):
            continue
        if getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
            continue
        k = e.key.lower()
        if any(s in k for s in ("gemm", "gemv", "nvjet", "sm90_xmma", "cutlass", "cublas")):
            cats["gemm"] += dt
        elif any(s in k for s in ("attention", "attn", "paged_kv", "ragged_kv", "merge_state", "flash",
                                  "fmha", "sdpa", "_kv_cache", "rope")):
            cats["attention"] += dt
        else:
            cats["other"] += dt
    return {k: v / 1e3 / steps for k, v in cats.items()}, prof.key_averages()


def run(args) -> int:
    import torch  # pylint: disable=import-outside-toplevel  (loads libcublas first)
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    cli.gpu_runtime()
    log = cli.Log(args.log_dir, "bench_decode")
    out_dir, say, sync = log.dir, log.say, torch.cuda.synchronize

    model = Path(args.model)
    cfg_json = json.loads((model / "graph" / CONFIG_FILE).read_text())
    mc = cfg_json["model_config"]
    t0 = time.time()
    p = make_params(cfg_json, torch, "cuda")
    torch.cuda.synchronize()
    say(f"params: {sum(v.numel() for v in p.values()) / 1e9:.2f} B on GPU in {time.time() - t0:.1f} s")
    names = cfg_json["param_names"]
    tparams = [tvm_ffi.from_dlpack(p[n]) for n in names]
    variants = [v for v in VARIANTS if (model / v).is_dir() and (not args.variants or v in args.variants.split(","))]
    batches = [int(b) for b in args.batches.split(",")]
    runners = {v: ModelRunner(model / v, "cuda", params=tparams) for v in variants}

    L, H, V = mc["num_hidden_layers"], mc["hidden_size"], mc["vocab_size"]
    kv_bytes_tok = L * 2 * mc["num_key_value_heads"] * mc["head_dim"] * 2
    w_bytes = sum(v.numel() * 2 for n, v in p.items() if n != "model.embed_tokens.weight")
    gen = torch.Generator(device="cpu").manual_seed(1)
    rows = []

    # --- prefill: ours vs plain torch, same weights, same prompts -------------------------------
    ref = TorchLlama(p, mc, torch)
    for v, b in [(v, b) for v in ("graph", "tir") if v in runners and args.prefill for b in (1, 4, 16)]:
        r = runners[v]
        ids = torch.randint(0, V, (b, PROMPT), generator=gen)
        toks = [row.tolist() for row in ids]
        ids_c = ids.cuda()
        out = {}

        def fresh_cache(r=r, b=b):
            kv = r.create_pool(64, 16 * PROMPT + 1024)
            for i in range(b):
                kv.add_sequence(i)
            return kv

        def ours_prefill(kv, r=r, b=b, toks=toks):
            out["ours"] = r.prefill(kv, list(range(b)), toks)

        def torch_prefill(ids_c=ids_c):
            with torch.no_grad():
                out["torch"] = ref.prefill(ids_c)

        ms = wall_time(ours_prefill, setup=fresh_cache, repeat=3, warmup=1, sync=sync) * 1e3
        tms = wall_time(torch_prefill, repeat=3, warmup=1, sync=sync) * 1e3
        ours, tl = torch.from_dlpack(out["ours"]).float(), out["torch"]
        err = ((ours - tl).norm() / tl.norm()).item()
        rows.append((f"prefill[{v}]", f"{b}x{PROMPT}", ms, tms, tms / ms, err))
        say(f"prefill[{v}] {b}x{PROMPT}: ours {ms:.2f} ms, torch {tms:.2f} ms, speed {tms / ms:.2f}x, "
            f"logits rel err {err:.2e}, argmax agree {(ours.argmax(-1) == tl.argmax(-1)).float().mean():.2f}")

    # --- decode at batch 1, 16, 64 with PROMPT tokens of context --------------------------------
    dec = []
    first = {}  # (variant, batch) -> logits of the first decode step, same prompts in every variant
    steps, samples = 10, 3  # the median of 3 samples of 10 steps
    for v, r in runners.items():
        for b in batches:
            kv = r.create_pool(64, 64 * (PROMPT + 64))
            for i in range(b):
                kv.add_sequence(i)
            pgen = torch.Generator(device="cpu").manual_seed(100 + b)
            for s in range(0, b, 16):
                chunk = list(range(s, min(b, s + 16)))
                r.prefill(kv, chunk, [torch.randint(0, V, (PROMPT,), generator=pgen).tolist() for _ in chunk])
            seqs = list(range(b))
            tok = [1] * b
            first[(v, b)] = torch.from_dlpack(r.decode(kv, seqs, tok)).float().reshape(b, -1).clone()
            for _ in range(2):  # the first steps capture the graphs
                r.decode(kv, seqs, tok)
            ms = wall_time(lambda r=r, kv=kv, seqs=seqs, tok=tok: r.decode(kv, seqs, tok), number=steps,
                           repeat=samples, warmup=0, sync=sync) * 1e3
            ctx = PROMPT + 3 + steps * samples // 2
            floor = (w_bytes + b * ctx * kv_bytes_tok) / PEAK_BW * 1e3
            bd = None
            if v in ("graph", "cublas", "tir", "gemv8"):
                from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        r.decode(kv, seqs, tok)
                    torch.cuda.synchronize()
                bd, ka = kernel_breakdown(prof, 5)
                if b in (1, 64) or v == "graph":
                    (out_dir / f"decode{b}_{v}_kernels.txt").write_text(
                        ka.table(sort_by="device_time_total", row_limit=25))
            dec.append((v, b, ms, floor, bd))
            say(f"decode[{v}] b={b}: {ms:.3f} ms/step, floor {floor:.3f} ms "
                f"({floor / ms * 100:.0f}% of the floor's bandwidth)" + (f", kernels {bd}" if bd else ""))
            del kv
    # Same weights, same prompts: every variant's first decode logits against the cuBLAS-only one
    # (whose prefill matches the torch model above).
    agree = []
    ref_v = "cublas" if "cublas" in runners else None
    for (v, b), lg in first.items():
        if ref_v and v != ref_v:
            rl = first[(ref_v, b)]
            agree.append((v, b, ((lg - rl).norm() / rl.norm()).item(),
                          (lg.argmax(-1) == rl.argmax(-1)).float().mean().item()))
            say(f"decode[{v}] b={b} first-step logits vs [{ref_v}]: rel err {agree[-1][2]:.2e}, "
                f"argmax agree {agree[-1][3]:.2f}")

    # --- attention kernels vs SDPA on the same shapes ------------------------------------------
    nh, d = mc["num_attention_heads"], mc["head_dim"]
    F = torch.nn.functional

    def sdpa_ms(q, k, v, causal):
        """One SDPA call, ms: 20 calls in one CUDA graph (harness.timing)."""
        return compare({"sdpa": (lambda _c: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 20)})["sdpa"] / 1e3

    att = []
    for b in batches:
        q = torch.randn(b, nh, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, nh, PROMPT + 13, d, device="cuda", dtype=torch.float16)
        sd = sdpa_ms(q, k, k.clone(), False) * L
        for v in ("graph", "cublas", "tir", "gemv8"):
            ours = next((x[4]["attention"] for x in dec if x[0] == v and x[1] == b), None)
            if ours is not None:
                att.append((f"decode[{v}]", b, ours, sd))
    for v, b in [(v, b) for v in ("graph", "tir") if v in runners and args.prefill for b in (1, 4, 16)]:
        r = runners[v]
        kv = r.create_pool(64, 16 * PROMPT + 1024)
        for i in range(b):
            kv.add_sequence(i)
        toks = [torch.randint(0, V, (PROMPT,), generator=gen).tolist() for _ in range(b)]
        from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r.prefill(kv, list(range(b)), toks)
            torch.cuda.synchronize()
        bd, ka = kernel_breakdown(prof, 1)
        q = torch.randn(b, nh, PROMPT, d, device="cuda", dtype=torch.float16)
        att.append((f"prefill[{v}]", b, bd["attention"], sdpa_ms(q, q.clone(), q.clone(), True) * L))
        say(f"prefill[{v}] {b}x{PROMPT} kernels: {bd}")
        if b == 16:
            (out_dir / f"prefill16_{v}_kernels.txt").write_text(ka.table(sort_by="device_time_total", row_limit=25))
        del kv

    say("\n| phase | shape | ours ms | torch ms | torch/ours | rel err |\n|---|---|---|---|---|---|")
    for ph, shape, ms, tms, sp, err in rows:
        say(f"| {ph} | {shape} | {ms:.2f} | {tms:.2f} | {sp:.2f} | {err:.1e} |")
    say("\n| decode | batch | ms/step | floor ms | % of floor bw | gemm ms | attn ms | other ms |\n"
        "|---|---|---|---|---|---|---|---|")
    for v, b, ms, floor, bd in dec:
        g = f"{bd['gemm']:.3f} | {bd['attention']:.3f} | {bd['other']:.3f}" if bd else "- | - | -"
        say(f"| {v} | {b} | {ms:.3f} | {floor:.3f} | {floor / ms * 100:.0f}% | {g} |")
    say("\n| decode | batch | first-step logits rel err vs cublas | argmax agree |\n|---|---|---|---|")
    for v, b, e, a in agree:
        say(f"| {v} | {b} | {e:.1e} | {a:.2f} |")
    say("\n| attention | batch | paged-KV kernels ms (all layers) | SDPA ms (x layers) | ratio |\n|---|---|---|---|---|")
    for ph, b, ours, sd in att:
        say(f"| {ph} | {b} | {ours:.3f} | {sd:.3f} | {ours / sd:.2f} |")
    cli.write_results(log.json, {
        "prefill": [dict(zip(("phase", "shape", "ours_ms", "torch_ms", "torch_over_ours", "rel_err"), x)) for x in rows],
        "decode": [dict(zip(("variant", "batch", "ms_per_step", "floor_ms", "kernels_ms"), x)) for x in dec],
        "decode_agreement": [dict(zip(("variant", "batch", "rel_err_vs_cublas", "argmax_agree"), x)) for x in agree],
        "attention": [dict(zip(("phase", "batch", "ours_ms", "sdpa_ms"), x)) for x in att]})
    return 0


def main(argv=None) -> int:
    ap, sub = cli.parser(__doc__, __file__)
    c = cli.add_compile(sub, "the variants' libraries, one folder each (here)")
    c.add_argument("--layers", type=int, default=32)
    c.add_argument("--variants", default="graph,cublas,tir", help=f"comma-separated, of {', '.join(VARIANTS)}")
    rr = cli.add_run(sub, "prefill, decode and attention on the GPU, weights made there")
    rr.add_argument("--model", required=True, help="the folder of `compile`")
    rr.add_argument("--variants", default="", help="comma-separated subset of the compiled variants")
    rr.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    rr.add_argument("--no-prefill", dest="prefill", action="store_false", help="decode only")
    a = cli.parse(ap, argv)
    if a.cmd == "compile":
        compile_variants(a.out, a.layers, a.variants.split(","))
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
