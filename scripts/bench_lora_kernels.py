"""LoRA kernels on the GPU: stage 2 (`gather`), stage 3 (`sgmv`) as TIR kernels and as the CUDA C++
kernels (compiler_passes/ops/lora/sgmv.cu, `sgmv_cuda`), a torch gathered-bmm reference, against
the base GEMM (torch.matmul = cuBLAS) of the same linear.

  compile (any machine, no GPU):  python scripts/bench_lora_kernels.py compile --out lora_k.so
  run (the GPU machine):          python scripts/bench_lora_kernels.py run --lib lora_k.so --log-dir DIR [--quick]
  one Llama-2-7B layer:           python scripts/bench_lora_kernels.py layer --lib lora_k.so --log-dir DIR
  its chart again:                python scripts/bench_lora_kernels.py plot DIR/bench_lora_layer.json --out F.svg

`layer` times the LoRA of all seven linears of a Llama-2-7B layer against the layer's four base
GEMMs (qkv, o, gate_up, down through torch.matmul = cuBLAS) in one run: the TIR stage 3 as the
model ran it before (a shrink and an expand per module, then torch.cat and the add into the GEMM
output) and the CUDA stage 3 as the model runs it now (one shrink and one in-place expand per
fused linear), both checked against a float64 reference of the whole layer's deltas.

Timing: CUDA events around replays of a CUDA graph holding one call per copy; the base weights and
the adapter rows are rotated over >= 256 MB (copies capped for the big token counts) so they are
read from HBM as in a real forward. Median of the replays, per call. Roofline: the bytes that must
move (A and B^T rows of the distinct adapters used + x + y read and write) at 4.2 TB/s.
Tokens sit on uniformly random slots in random order (decode's worst case); the "grouped" points
sort them by slot (a prefill batch). Every kernel is checked against a float64 product.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]  # (in, out)
# A Llama-2-7B layer: fused linear -> (in, the parts' widths); the parts are modules 0..6 in order
# q, k, v, o, gate, up, down.
LAYER = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
         "down": (11008, (4096,))}
LAYER_POINTS = [(t, n, r) for t in (1, 16, 64, 256, 1024) for n, r in ((4, 8), (16, 16))]
RS = [16, 64]  # compiled max ranks
DTYPE = "float16"
HBM = 4.2e12
# (shape, T, N, ranks): the headline shape over T and N, the rank variants, the other shapes.
POINTS = ([((4096, 4096), t, 16, 16) for t in (1, 16, 64, 256, 1024, 4096)]
          + [((4096, 4096), t, n, 16) for t in (1, 64, 1024, 4096) for n in (1, 4, 64)]
          + [((4096, 4096), 64, 16, r) for r in (8, 64, "mixed")]
          + [((4096, 4096), 1024, 16, r) for r in (64, "mixed")]
          + [(s, t, 16, 16) for s in SHAPES[1:] for t in (1, 64, 1024, 4096)]
          # Tokens grouped by adapter (a prefill batch: each request's tokens are contiguous).
          + [((4096, 4096), t, 16, r, "grouped") for t in (64, 1024, 4096) for r in (16, 64)])


def fname(kind, r, i, o):
    return f"{kind}_r{r}_{i}x{o}"


def compile_lib(out: Path) -> None:
    import tvm  # pylint: disable=import-outside-toplevel
    from mlc_lora.compile import prepare_cuda_build  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes.ops.lora import gather_tir as K, sgmv_tir as G  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes.ops.lora import sgmv_cuda as GC  # pylint: disable=import-outside-toplevel

    prepare_cuda_build()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    funcs = {}
    for r in RS:
        for i, o in SHAPES:
            funcs[fname("gather", r, i, o)] = K.lora_gather_kernel(i, o, 0, 1, r, 1, DTYPE, target)
            funcs[fname("shrink", r, i, o)] = G.lora_sgmv_shrink_kernel(i, 0, 1, r, 1, DTYPE, target)
            funcs[fname("expand", r, i, o)] = G.lora_sgmv_expand_kernel(i, o, 0, 1, r, 1, DTYPE, target)
            funcs[fname("cshrink", r, i, o)] = GC.shrink_wrapper(i, (0,), 1, r, 1, DTYPE)
            funcs[fname("cexpand", r, i, o)] = GC.expand_wrapper(i, (o,), (0,), 1, r, 1, DTYPE)
        first = 0
        for name, (i, widths) in LAYER.items():
            mods = tuple(range(first, first + len(widths)))
            first += len(widths)
            funcs[f"lshrink_{name}_r{r}"] = GC.shrink_wrapper(i, mods, 1, r, 7, DTYPE)
            funcs[f"lexpand_{name}_r{r}"] = GC.expand_wrapper(i, widths, mods, 1, r, 7, DTYPE)
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    with target:
        ex = tvm.compile(mod, target=target)
    # both variants of stage 3 in one library; a TIR-only build ignores the IRModule's
    # external_mods (relax.build links them), so the CUDA kernels are imported here
    for r in RS:
        ex.mod.import_module(GC.build_module(DTYPE, r, str(target.arch)))
    ex.export_library(str(out))
    print(f"built {out}")


def _open(args, name):
    """(the kernels' library, the log folder, the open log DIR/name.log); seeds torch."""
    import torch  # pylint: disable=import-outside-toplevel
    from mlc_lora.runner import _tvm, load_cuda_runtime  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    load_cuda_runtime()
    out_dir = Path(args.log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    return tvm.runtime.load_module(args.lib), out_dir, open(out_dir / f"{name}.log", "w")  # pylint: disable=consider-using-with


def capture(fn, n_calls):
    """A CUDA graph of fn(0) .. fn(n_calls - 1) (after one eager warm-up call)."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(g, capture_error_mode="relaxed")):
        for c in range(n_calls):
            fn(c)
    g.replay()
    return g


def timed(graphs, calls, reps=10):
    """Median us per call of each graph, the graphs' replays interleaved."""
    import torch  # pylint: disable=import-outside-toplevel

    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(reps)] for _ in graphs]
    for i in range(reps):
        for g, e in zip(graphs, ev):
            e[i][0].record()
            g.replay()
            e[i][1].record()
    torch.cuda.synchronize()
    return [statistics.median(a.elapsed_time(b) for a, b in e) * 1e3 / calls for e in ev]


def run(args) -> int:  # pylint: disable=too-many-locals,too-many-statements
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel

    lib, out_dir, log = _open(args, "bench_lora_kernels")
    rng = np.random.default_rng(0)
    dev = "cuda"

    rows = []
    points = [p for p in POINTS if not args.quick or (p[0] == (4096, 4096) and p[2] == 16 and p[3] == 16)]
    for point in points:
        (i_f, o_f), T, N, rk = point[:4]
        grouped = point[4:] == ("grouped",)
        ranks = [8, 16, 32, 64][:N] * (N // 4) if rk == "mixed" else [rk] * N
        ranks = ranks[:N] if ranks else [8]
        R = 16 if max(ranks) <= 16 else 64
        slot = rng.integers(0, N, T).astype(np.int32)
        if grouped:
            slot = np.sort(slot)
        used = sorted(set(slot.tolist()))
        region = sum(r * (i_f + o_f) for r in ranks)  # elements of one copy's adapter rows
        big = T >= 1024
        copies = max(2, min(8 if big else 64, math.ceil((256 << 20) / (2 * region))))
        arena = torch.randn(copies * region, device=dev, dtype=torch.float16) * 0.05
        tables = []
        for c in range(copies):
            a_off = np.zeros((N, 1, 64), np.int32)
            b_off = np.zeros((N, 1, 64), np.int32)
            pos = c * region
            for s, r in enumerate(ranks):
                for k in range(r):
                    a_off[s, 0, k] = pos
                    pos += i_f
                for k in range(r):
                    b_off[s, 0, k] = pos
                    pos += o_f
            tables.append([torch.from_numpy(a[:, :, :R].copy()).to(dev) for a in (a_off, b_off)])
        t_slot = torch.from_numpy(slot).to(dev)
        t_rank = torch.tensor(ranks, dtype=torch.int32, device=dev)
        scale = torch.full((N, 1), 2.0, dtype=torch.float32, device=dev)
        x = torch.randn(T, i_f, device=dev, dtype=torch.float16)
        wcopies = max(2, min(8 if big else 64, math.ceil((256 << 20) / (2 * i_f * o_f))))
        ws = [torch.randn(o_f, i_f, device=dev, dtype=torch.float16) * i_f ** -0.5 for _ in range(wcopies)]
        C = -(-i_f // 512)
        v = torch.empty(T, C, R, device=dev, dtype=torch.float32)
        y2 = torch.empty(T, o_f, device=dev, dtype=torch.float16)
        y3 = torch.empty(T, o_f, device=dev, dtype=torch.float16)
        y4 = torch.empty(T, o_f, device=dev, dtype=torch.float16)
        vc = torch.empty(T, 1, C, R, device=dev, dtype=torch.float32)
        gather, shrink, expand, cshrink, cexpand = (
            lib[fname(k, R, i_f, o_f)] for k in ("gather", "shrink", "expand", "cshrink", "cexpand"))

        def stage2(c):
            a, b = tables[c % copies]
            gather(x, arena, t_slot, t_rank, scale, a, b, 0, y2)

        def stage3(c):
            a, b = tables[c % copies]
            shrink(x, arena, t_slot, t_rank, scale, a, 0, v)
            expand(v, arena, t_slot, t_rank, b, 0, y3)

        def stage3_cuda(c):
            a, b = tables[c % copies]
            cshrink(x, arena, t_slot, t_rank, scale, a, 0, vc)
            cexpand(vc, arena, t_slot, t_rank, scale, b, 0, y4)  # y4 += delta

        # Correctness: both against a float64 torch reference of the same rows (copy 0).
        a0, b0 = (t.cpu().numpy().astype(np.int64) for t in tables[0])
        ar = arena.double()
        ref = torch.zeros(T, o_f, dtype=torch.float64, device=dev)
        for s in used:
            idx = torch.from_numpy(np.flatnonzero(slot == s)).to(dev)
            A = torch.stack([ar[int(a0[s, 0, k]):int(a0[s, 0, k]) + i_f] for k in range(ranks[s])])
            B = torch.stack([ar[int(b0[s, 0, k]):int(b0[s, 0, k]) + o_f] for k in range(ranks[s])])
            ref[idx] = 2.0 * (x[idx].double() @ A.T) @ B
        stage2(0)
        stage3(0)
        y4.zero_()
        stage3_cuda(0)
        torch.cuda.synchronize()
        err2 = ((y2.double() - ref).norm() / ref.norm()).item()
        err3 = ((y3.double() - ref).norm() / ref.norm()).item()
        err4 = ((y4.double() - ref).norm() / ref.norm()).item()
        errv = ((vc[:, 0].sum(1) - v.sum(1)).norm() / v.sum(1).norm()).item()  # shrink: CUDA vs TIR
        # torch gathered bmm over stacked (N, r_max, in) / (N, out, r_max) weights (padded ranks).
        rmax = max(ranks)
        As = torch.zeros(N, rmax, i_f, device=dev, dtype=torch.float16)
        Bs = torch.zeros(N, o_f, rmax, device=dev, dtype=torch.float16)
        for s in range(N):
            As[s, :ranks[s]] = arena[int(a0[s, 0, 0]):int(a0[s, 0, 0]) + ranks[s] * i_f].view(ranks[s], i_f)
            Bs[s, :, :ranks[s]] = arena[int(b0[s, 0, 0]):int(b0[s, 0, 0]) + ranks[s] * o_f].view(ranks[s], o_f).T * 2.0
        idx_l = t_slot.long()

        def torch_ref(_c):
            h = torch.bmm(As[idx_l], x.unsqueeze(2))  # (T, r, 1)
            return torch.bmm(Bs[idx_l], h)

        errt = ((torch_ref(0).squeeze(2).double() - ref).norm() / ref.norm()).item()
        graphs = [capture(lambda c: torch.matmul(x, ws[c % wcopies].T), wcopies),
                  capture(stage2, copies), capture(stage3, copies), capture(stage3_cuda, copies)]
        calls = [wcopies, copies, copies, copies]
        do_torch = T * rmax * (i_f + o_f) * 2 <= (2 << 30)
        if do_torch:
            graphs.append(capture(torch_ref, 4))
            calls.append(4)
        times = [timed([g], n)[0] for g, n in zip(graphs, calls)]
        t_base, t2, t3, t4 = times[:4]
        tt = times[4] if do_torch else float("nan")
        nbytes = 2 * (sum(ranks[s] * (i_f + o_f) for s in used) + T * i_f + 2 * T * o_f)
        roof = nbytes / HBM * 1e6
        row = dict(shape=f"{i_f}->{o_f}" + (" grouped" if grouped else ""), T=T, N=N, r=rk, R=R, base=t_base,
                   gather=t2, sgmv=t3, torch=tt, ratio=t3 / t_base, roof=roof / t3, err2=err2, err3=err3, errt=errt,
                   sgmv_cuda=t4, ratio_cuda=t4 / t_base, roof_cuda=roof / t4, tir_over_cuda=t3 / t4,
                   err4=err4, errv=errv)
        rows.append(row)
        msg = (f"{row['shape']} T={T} N={N} r={rk} (R={R}): base {t_base:.1f} us, gather {t2:.1f}, "
               f"sgmv {t3:.1f}, sgmv-cuda {t4:.1f}, torch-bmm {tt:.1f}; sgmv/base {t3 / t_base:.2f}, "
               f"cuda/base {t4 / t_base:.2f}, tir/cuda {t3 / t4:.2f}, roofline {roof:.1f} us = "
               f"{100 * roof / t3:.0f}% (cuda {100 * roof / t4:.0f}%); rel err gather {err2:.1e} "
               f"sgmv {err3:.1e} cuda {err4:.1e} (shrink cuda vs tir {errv:.1e}) torch {errt:.1e}")
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()
        del graphs, arena, ws, As, Bs
        torch.cuda.empty_cache()
    lines = ["| shape | T | N | r | R | base GEMM us | gather us | sgmv us | sgmv cuda us | torch bmm us | "
             "sgmv/base | cuda/base | tir/cuda | sgmv % roofline | cuda % roofline | rel err sgmv | rel err cuda |",
             "|" + "---|" * 17]
    for w in rows:
        lines.append(f"| {w['shape']} | {w['T']} | {w['N']} | {w['r']} | {w['R']} | {w['base']:.1f} | "
                     f"{w['gather']:.1f} | {w['sgmv']:.1f} | {w['sgmv_cuda']:.1f} | {w['torch']:.1f} | "
                     f"{w['ratio']:.2f} | {w['ratio_cuda']:.2f} | {w['tir_over_cuda']:.2f} | "
                     f"{100 * w['roof']:.0f} | {100 * w['roof_cuda']:.0f} | {w['err3']:.1e} | {w['err4']:.1e} |")
    text = "\n".join(lines)
    log.write(text + "\n")
    print(text)
    import json  # pylint: disable=import-outside-toplevel
    (out_dir / "bench_lora_kernels.json").write_text(json.dumps(rows, indent=1))
    return 0


def run_layer(args) -> int:  # pylint: disable=too-many-locals,too-many-statements
    """LoRA on all seven linears of a Llama-2-7B layer vs the layer's base GEMMs, per token count."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel

    lib, out_dir, log = _open(args, "bench_lora_layer")
    rng = np.random.default_rng(0)
    dev = "cuda"
    mods = [(name, i, w) for name, (i, ws) in LAYER.items() for w in ws]  # the 7 modules in order

    rows = []
    for T, N, rk in LAYER_POINTS:
        R = 16 if rk <= 16 else 64
        slot = rng.integers(0, N, T).astype(np.int32)
        region = N * rk * sum(i + w for _, i, w in mods)  # one copy of all adapters' rows, all modules
        copies = max(2, min(16, math.ceil((256 << 20) / (2 * region))))
        arena = torch.randn(copies * region, device=dev, dtype=torch.float16) * 0.05
        tabs = []  # per copy: (a_off, b_off) (N, 7, R) for the fused kernels
        pos = 0
        for _ in range(copies):
            a_off = np.zeros((N, 7, R), np.int32)
            b_off = np.zeros((N, 7, R), np.int32)
            for s in range(N):
                for m, (_, i, w) in enumerate(mods):
                    for k in range(rk):
                        a_off[s, m, k] = pos
                        pos += i
                    for k in range(rk):
                        b_off[s, m, k] = pos
                        pos += w
            tabs.append((a_off, b_off))
        t_tabs = [tuple(torch.from_numpy(t).to(dev) for t in ab) for ab in tabs]
        # the TIR kernels take one module's tables (N, 1, R)
        t_mod = [[tuple(torch.from_numpy(np.ascontiguousarray(t[:, m:m + 1])).to(dev) for t in ab)
                  for m in range(7)] for ab in tabs]
        t_slot = torch.from_numpy(slot).to(dev)
        t_rank = torch.full((N,), rk, dtype=torch.int32, device=dev)
        scale7 = torch.full((N, 7), 2.0, dtype=torch.float32, device=dev)
        scale1 = torch.full((N, 1), 2.0, dtype=torch.float32, device=dev)
        x = {name: torch.randn(T, i, device=dev, dtype=torch.float16) for name, (i, _) in LAYER.items()}
        wbytes = 2 * sum(i * sum(ws) for i, ws in LAYER.values())
        wcopies = max(2, min(16, math.ceil((512 << 20) / wbytes)))
        W = [{name: torch.randn(sum(ws), i, device=dev, dtype=torch.float16) * i ** -0.5
              for name, (i, ws) in LAYER.items()} for _ in range(wcopies)]
        y = {name: torch.empty(T, sum(ws), device=dev, dtype=torch.float16) for name, (_, ws) in LAYER.items()}
        C = {name: -(-i // 512) for name, (i, _) in LAYER.items()}
        v_tir = {name: torch.empty(T, C[name], R, device=dev, dtype=torch.float32) for name in LAYER}
        v_cuda = {name: torch.empty(T, len(ws), C[name], R, device=dev, dtype=torch.float32)
                  for name, (_, ws) in LAYER.items()}
        d_tir = [torch.empty(T, w, device=dev, dtype=torch.float16) for _, _, w in mods]
        shape_of = {"qkv": (4096, 4096), "o": (4096, 4096), "gate_up": (4096, 11008), "down": (11008, 4096)}

        def base(c):
            for name in LAYER:
                torch.matmul(x[name], W[c % wcopies][name].T, out=y[name])

        def lora_tir(c):
            base(c)
            m = 0
            for name, (i, ws) in LAYER.items():
                io = shape_of[name]
                parts = []
                for _ in ws:
                    a, b = t_mod[c % copies][m]
                    lib[fname("shrink", R, *io)](x[name], arena, t_slot, t_rank, scale1, a, 0, v_tir[name])
                    lib[fname("expand", R, *io)](v_tir[name], arena, t_slot, t_rank, b, 0, d_tir[m])
                    parts.append(d_tir[m])
                    m += 1
                y[name].add_(torch.cat(parts, 1) if len(parts) > 1 else parts[0])

        def lora_cuda(c):
            base(c)
            a, b = t_tabs[c % copies]
            for name in LAYER:
                lib[f"lshrink_{name}_r{R}"](x[name], arena, t_slot, t_rank, scale7, a, 0, v_cuda[name])
                lib[f"lexpand_{name}_r{R}"](v_cuda[name], arena, t_slot, t_rank, scale7, b, 0, y[name])

        # Correctness (copy 0): the deltas of both against float64, per fused linear.
        ar = arena.double()
        a0, b0 = tabs[0]
        errs = {"tir": 0.0, "cuda": 0.0}
        refs = {}
        m = 0
        for name, (i, ws) in LAYER.items():
            ref = []
            for w in ws:
                d = torch.zeros(T, w, dtype=torch.float64, device=dev)
                for s in sorted(set(slot.tolist())):
                    idx = torch.from_numpy(np.flatnonzero(slot == s)).to(dev)
                    A = ar[int(a0[s, m, 0]):int(a0[s, m, 0]) + rk * i].view(rk, i)
                    B = ar[int(b0[s, m, 0]):int(b0[s, m, 0]) + rk * w].view(rk, w)
                    d[idx] = 2.0 * (x[name][idx].double() @ A.T) @ B
                ref.append(d)
                m += 1
            refs[name] = torch.cat(ref, 1)
        for kind, fn in (("tir", lora_tir), ("cuda", lora_cuda)):
            base(0)
            torch.cuda.synchronize()
            y0 = {name: t.double() for name, t in y.items()}
            fn(0)
            torch.cuda.synchronize()
            errs[kind] = max(((y[name].double() - y0[name] - refs[name]).norm() / refs[name].norm()).item()
                             for name in LAYER)
        t_base = timed([capture(base, wcopies)], wcopies)[0]
        t_tir = timed([capture(lora_tir, wcopies)], wcopies)[0] - t_base
        t_cuda = timed([capture(lora_cuda, wcopies)], wcopies)[0] - t_base
        row = dict(T=T, N=N, r=rk, R=R, base=t_base, tir=t_tir, cuda=t_cuda, err_tir=errs["tir"],
                   err_cuda=errs["cuda"])
        rows.append(row)
        msg = (f"layer T={T} N={N} r={rk} (R={R}): base GEMMs {t_base:.1f} us; LoRA: tir per-module "
               f"{t_tir:.1f} us ({t_tir / t_base:.2f}x base), cuda fused in place {t_cuda:.1f} us "
               f"({t_cuda / t_base:.2f}x base), tir/cuda {t_tir / t_cuda:.2f}; rel err of the deltas tir "
               f"{errs['tir']:.1e} cuda {errs['cuda']:.1e}")
        print(msg, flush=True)
        log.write(msg + "\n")
        del arena, W, t_tabs, t_mod
        torch.cuda.empty_cache()
    lines = ["| T | N | r | R | base GEMMs us | LoRA tir us | LoRA cuda us | tir/base | cuda/base | tir/cuda | "
             "err tir | err cuda |", "|" + "---|" * 12]
    for w in rows:
        lines.append(f"| {w['T']} | {w['N']} | {w['r']} | {w['R']} | {w['base']:.1f} | {w['tir']:.1f} | "
                     f"{w['cuda']:.1f} | {w['tir'] / w['base']:.2f} | {w['cuda'] / w['base']:.2f} | "
                     f"{w['tir'] / w['cuda']:.2f} | {w['err_tir']:.1e} | {w['err_cuda']:.1e} |")
    text = "\n".join(lines)
    log.write(text + "\n")
    print(text)
    import json  # pylint: disable=import-outside-toplevel
    (out_dir / "bench_lora_layer.json").write_text(json.dumps(rows, indent=1))
    layer_svg(rows, out_dir / "bench_lora_layer.svg")
    return 0


def layer_svg(rows, path) -> None:
    """LoRA cost / the layer's GEMMs vs T (log scale), TIR per module and CUDA fused, one line per
    (N, r): a dependency-free SVG (the device has no matplotlib)."""
    w, h, left, top, right, bottom = 620, 340, 60, 40, 200, 50
    ts = sorted({r["T"] for r in rows})
    ymax = max(max(r["tir"], r["cuda"]) / r["base"] for r in rows) * 1.1

    def x(t):
        return left + (w - left - right) * (math.log(t + 1) / math.log(ts[-1] + 1))

    def y(v):
        return h - bottom - (h - top - bottom) * v / ymax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{(w - right) / 2}" y="18" text-anchor="middle" font-size="13">LoRA of a Llama-2-7B layer / '
           'its base GEMMs (H200)</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>']
    for t in ts:
        out.append(f'<text x="{x(t):.1f}" y="{h - bottom + 15}" text-anchor="middle">{t}</text>')
    out.append(f'<text x="{(w - right) / 2}" y="{h - 12}" text-anchor="middle">tokens T</text>')
    step = 0.25 if ymax < 2 else 0.5
    v = 0.0
    while v <= ymax:
        out.append(f'<line x1="{left - 4}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 7}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        v += step
    colors = {"tir": "#d62728", "cuda": "#1f77b4"}
    legend = 0
    for (n, r) in sorted({(row["N"], row["r"]) for row in rows}):
        pts = sorted((row for row in rows if (row["N"], row["r"]) == (n, r)), key=lambda row: row["T"])
        for kind, label in (("tir", "TIR per module"), ("cuda", "CUDA fused")):
            dash = "" if r == 8 else ' stroke-dasharray="5,3"'
            line = " ".join(f'{x(q["T"]):.1f},{y(q[kind] / q["base"]):.1f}' for q in pts)
            out.append(f'<polyline points="{line}" fill="none" stroke="{colors[kind]}" stroke-width="2"{dash}/>')
            ly = top + 14 * legend
            out.append(f'<line x1="{w - right + 10}" y1="{ly}" x2="{w - right + 30}" y2="{ly}" '
                       f'stroke="{colors[kind]}" stroke-width="2"{dash}/><text x="{w - right + 34}" y="{ly + 4}">'
                       f'{label}, {n} x r{r}</text>')
            legend += 1
    Path(path).write_text("\n".join(out + ["</svg>"]) + "\n")
    print(f"plot: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--lib", required=True)
    r.add_argument("--log-dir", default=".")
    r.add_argument("--quick", action="store_true", help="only 4096->4096, N=16, r=16 over T (random and grouped)")
    lay = sub.add_parser("layer")
    lay.add_argument("--lib", required=True)
    lay.add_argument("--log-dir", default=".")
    pl = sub.add_parser("plot", help="the SVG of a `layer` run's JSON")
    pl.add_argument("json")
    pl.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "plot":
        import json  # pylint: disable=import-outside-toplevel

        layer_svg(json.loads(Path(a.json).read_text()), a.out)
        return 0
    if a.cmd == "compile":
        compile_lib(a.out)
        return 0
    return run_layer(a) if a.cmd == "layer" else run(a)


if __name__ == "__main__":
    sys.exit(main())
