"""A Llama-2-7B-shaped model on one GPU: decode step time against the bandwidth floor, prefill
against a plain PyTorch implementation of the same model (cuBLAS + SDPA), and where the time goes.

Two steps, so that no 13 GB of weights travel:
  compile (any machine, no GPU):  python scripts/bench_decode.py compile --out OUT
  run (the GPU machine):          python scripts/bench_decode.py run --model OUT [--ext libcublas_gemm.so]
The run makes seeded random fp16 weights on the GPU with torch and hands them to ModelRunner.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mlc_lora.models.random_model import LLAMA2_7B, build, make_params

PROMPT = 512  # tokens per prompt (prefill) and context before the timed decode steps
PEAK_BW = 4.2e12  # bytes/s: the H200's measured device-to-device copy rate (read + write)


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


class TorchLlama:
    """The same model in plain PyTorch: cuBLAS linears, SDPA attention, HF's RoPE and RMSNorm."""

    def __init__(self, p, mc, torch):
        self.p, self.mc, self.t = p, mc, torch
        d = mc["head_dim"]
        inv = 1.0 / (mc["rope_theta"] ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
        pos = torch.arange(PROMPT, device="cuda", dtype=torch.float32)
        ang = torch.outer(pos, inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = ang.cos().half(), ang.sin().half()

    def norm(self, x, w):
        t = self.t
        xf = x.float()
        return (xf * t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.mc["rms_norm_eps"])).half() * w

    def rope(self, x):  # x (B, heads, S, D)
        h = x.shape[-1] // 2
        rot = self.t.cat([-x[..., h:], x[..., :h]], dim=-1)
        return x * self.cos + rot * self.sin

    def prefill(self, ids):  # ids (B, S) -> last-token logits (B, V) float32
        t, p, mc = self.t, self.p, self.mc
        F = t.nn.functional
        nh, nkv, d = mc["num_attention_heads"], mc["num_key_value_heads"], mc["head_dim"]
        b, s = ids.shape
        x = F.embedding(ids, p["model.embed_tokens.weight"])
        for l in range(mc["num_hidden_layers"]):
            pre = f"model.layers.{l}."
            qkv = F.linear(self.norm(x, p[pre + "input_layernorm.weight"]), p[pre + "self_attn.qkv_proj.weight"])
            qkv = qkv.view(b, s, nh + 2 * nkv, d).transpose(1, 2)
            q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
            o = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True,
                                               enable_gqa=nh != nkv)
            x = x + F.linear(o.transpose(1, 2).reshape(b, s, nh * d), p[pre + "self_attn.o_proj.weight"])
            gu = F.linear(self.norm(x, p[pre + "post_attention_layernorm.weight"]), p[pre + "mlp.gate_up_proj.weight"])
            gate, up = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, p[pre + "mlp.down_proj.weight"])
        x = self.norm(x[:, -1], p["model.norm.weight"])
        return F.linear(x, p["lm_head.weight"]).float()


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

    from mlc_lora.runner import ModelRunner, _tvm, load_cuda_runtime  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    load_cuda_runtime()
    ext = None  # keep it alive: unloading would drop the globals it registered
    if args.ext and tvm_ffi.get_global_func("mlc_lora.runtime.cublas_gemm", allow_missing=True) is None:
        ext = tvm_ffi.load_module(args.ext)
    out_dir = Path(args.log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "bench_decode.log", "w")  # pylint: disable=consider-using-with

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    model = Path(args.model)
    cfg_json = json.loads((model / "graph" / "mlc-lora-config.json").read_text())
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
        times, ttimes = [], []
        for rep in range(4):
            kv = r.create_kv_cache(64, 16 * PROMPT + 1024)
            for i in range(b):
                r.kv_add(kv, i)
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = r.prefill(kv, list(range(b)), toks)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            del kv
            ids_c = ids.cuda()
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                tl = ref.prefill(ids_c)
            torch.cuda.synchronize()
            ttimes.append(time.perf_counter() - t)
        ours = torch.from_dlpack(logits).float()
        err = ((ours - tl).norm() / tl.norm()).item()
        ms, tms = statistics.median(times[1:]) * 1e3, statistics.median(ttimes[1:]) * 1e3
        rows.append((f"prefill[{v}]", f"{b}x{PROMPT}", ms, tms, tms / ms, err))
        say(f"prefill[{v}] {b}x{PROMPT}: ours {ms:.2f} ms, torch {tms:.2f} ms, speed {tms / ms:.2f}x, "
            f"logits rel err {err:.2e}, argmax agree {(ours.argmax(-1) == tl.argmax(-1)).float().mean():.2f}")

    # --- decode at batch 1, 16, 64 with PROMPT tokens of context --------------------------------
    dec = []
    first = {}  # (variant, batch) -> logits of the first decode step, same prompts in every variant
    steps = 20
    for v, r in runners.items():
        for b in batches:
            kv = r.create_kv_cache(64, 64 * (PROMPT + 64))
            for i in range(b):
                r.kv_add(kv, i)
            pgen = torch.Generator(device="cpu").manual_seed(100 + b)
            for s in range(0, b, 16):
                chunk = list(range(s, min(b, s + 16)))
                r.prefill(kv, chunk, [torch.randint(0, V, (PROMPT,), generator=pgen).tolist() for _ in chunk])
            seqs = list(range(b))
            tok = [1] * b
            first[(v, b)] = torch.from_dlpack(r.decode(kv, seqs, tok)).float().reshape(b, -1).clone()
            for _ in range(2):  # the first steps capture the graphs
                r.decode(kv, seqs, tok)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                r.decode(kv, seqs, tok)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / steps * 1e3
            ctx = PROMPT + 3 + steps // 2
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
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 20

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
        kv = r.create_kv_cache(64, 16 * PROMPT + 1024)
        for i in range(b):
            r.kv_add(kv, i)
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
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--out", required=True)
    c.add_argument("--layers", type=int, default=32)
    c.add_argument("--variants", default="graph,cublas,tir", help=f"comma-separated, of {', '.join(VARIANTS)}")
    rr = sub.add_parser("run")
    rr.add_argument("--model", required=True)
    rr.add_argument("--ext", default=None, help="src/runtime/cublas_gemm.cc built alone (scripts/build_cublas_gemm.sh), "
                   "for a runtime library without it")
    rr.add_argument("--log-dir", default="bench_logs")
    rr.add_argument("--variants", default="", help="comma-separated subset of the compiled variants")
    rr.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    rr.add_argument("--no-prefill", dest="prefill", action="store_false", help="decode only")
    a = ap.parse_args()
    if a.cmd == "compile":
        compile_variants(Path(a.out), a.layers, a.variants.split(","))
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
