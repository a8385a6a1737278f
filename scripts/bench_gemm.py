"""Our compiled linear (y = x @ W^T through DispatchCublas with the default `gemv_max_rows`: our
gemv kernel at one token, cuBLAS above) against torch.matmul and against cuBLAS alone.

Two steps:
  compile (any machine, no GPU):  python scripts/bench_gemm.py compile --out DIR [--sweep]
  run (the GPU machine):          python scripts/bench_gemm.py run --lib-dir DIR [--ext libcublas_gemm.so]
DIR holds ours.so (the default dispatch) and cublas.so (gemv_max_rows=0, and a static-1 twin of
every linear left to dlight's GEMV); with --sweep also sweep_r{ROWS}_u{UNROLL}.so, the gemv kernel
with other tile sizes up to 8 tokens (float16), timed against ours.so in the same run.
Timing: CUDA events around replays of a CUDA graph that holds one call per weight copy, the copies
rotated so that the weights (>= 256 MB in all) never sit in the 50 MB L2; the graphs' replays are
interleaved with the order rotated every repetition; median per call.
Error: ||y - ref|| / ||ref|| against a float64 product of the same inputs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096)]  # W: (N, K)
NS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
DTYPES = ["float16", "bfloat16"]
SWEEP = [(2, 2), (2, 4), (4, 4), (8, 1), (8, 2)]  # (ROWS, UNROLL) of gemv.cu beside the default


def fname(kind, dtype, n, k):
    return f"{kind}_{dtype}_{n}x{k}"


def compile_lib(out_dir: Path, sweep: bool) -> None:
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from mlc_lora.compile import prepare_cuda_build  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes import get_pipeline  # pylint: disable=import-outside-toplevel

    prepare_cuda_build()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    out_dir.mkdir(parents=True, exist_ok=True)
    from mlc_lora.compiler_passes.ops.gemv import gemv_cuda as gemv_kernels  # pylint: disable=import-outside-toplevel

    from mlc_lora.compiler_passes.passes.dispatch_cublas import GEMV_MAX_ROWS  # pylint: disable=import-outside-toplevel

    # ours: the default dispatch; the sweep builds take the gemv kernel up to 8 rows
    libs = [("ours", GEMV_MAX_ROWS, DTYPES, gemv_kernels.ROWS, gemv_kernels.UNROLL), ("cublas", 0, DTYPES, 0, 0)]
    libs += [(f"sweep_r{r}_u{u}", 8, ["float16"], r, u) for r, u in (SWEEP if sweep else [])]
    default = gemv_kernels.ROWS, gemv_kernels.UNROLL
    for lib, gemv_max_rows, dtypes, rows_, unroll in libs:
        if gemv_max_rows:
            gemv_kernels.ROWS, gemv_kernels.UNROLL = rows_, unroll
        bb = relax.BlockBuilder()
        rows = tvm.tirx.Var("n", "int64")
        for dtype in dtypes:
            for n, k in SHAPES:
                # "linear": a symbolic token count; "gemv": a static 1 (cublas.so: dlight's GEMV)
                for kind, m in (("linear", rows), ("gemv", 1)):
                    x = relax.Var("x", relax.TensorType([m, k], dtype))
                    w = relax.Var("w", relax.TensorType([n, k], dtype))
                    with bb.function(fname(kind, dtype, n, k), [x, w]):
                        with bb.dataflow():
                            y = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
                        bb.emit_func_output(y)
        with target:
            pipeline = get_pipeline(target, gemm="cublas", gemv_max_rows=gemv_max_rows)
            ex = tvm.compile(bb.get(), target, relax_pipeline=pipeline)
            ex.export_library(str(out_dir / f"{lib}.so"))
        gemv_kernels.ROWS, gemv_kernels.UNROLL = default
        print(f"built {out_dir / lib}.so")


def run(args) -> int:  # pylint: disable=too-many-locals
    import torch  # pylint: disable=import-outside-toplevel
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    from mlc_lora.runner import _tvm, load_cublas, load_cuda_runtime  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    load_cuda_runtime()
    ext = None  # keep it alive: unloading would drop the globals it registered
    if args.ext and tvm_ffi.get_global_func("mlc_lora.runtime.cublas_gemm", allow_missing=True) is None:
        ext = tvm_ffi.load_module(args.ext)
    dev = tvm.cuda(0)
    load_cublas(dev)
    lib_dir = Path(args.lib_dir)
    vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(lib_dir / "ours.so")), dev)
    vm_cublas = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(lib_dir / "cublas.so")), dev)
    out_dir = Path(args.log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "bench_gemm.log", "w")  # pylint: disable=consider-using-with
    torch.manual_seed(0)

    def capture(fn, copies, xs):
        """A CUDA graph of one call per weight copy (outputs kept alive by the graph's owner)."""
        outs = [fn(xs, w) for w in copies]  # warm up (and fill TVM's allocator pool)
        torch.cuda.synchronize()
        del outs
        g = torch.cuda.CUDAGraph()
        keep = []
        with tvm_ffi.use_torch_stream(torch.cuda.graph(g, capture_error_mode="relaxed")):
            for w in copies:
                keep.append(fn(xs, w))
        g.replay()
        return g, keep

    def timed(graphs, calls, reps=20):  # 20: every position equally often for 4 or 5 graphs
        """Median us per call of each graph; replays interleaved, and the order rotated every
        repetition, so that clock drift and the position in the sequence hit all alike."""
        ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)] for _ in graphs]
        for i in range(reps):
            for j in range(len(graphs)):
                k = (i + j) % len(graphs)
                ev[k][i][0].record()
                graphs[k][0].replay()
                ev[k][i][1].record()
        torch.cuda.synchronize()
        return [statistics.median(a.elapsed_time(b) for a, b in e) * 1e3 / calls for e in ev]

    def ours(kind, dtype, n, k, machine=None):
        f = (machine or vm)[fname(kind, dtype, n, k)]
        return lambda x, w: f(x, w)

    def as_torch(y):
        return y if isinstance(y, torch.Tensor) else torch.from_dlpack(y)

    rows = []
    for dtype in DTYPES:
        tdt = getattr(torch, dtype)
        for n, k in SHAPES:
            wbytes = n * k * 2
            copies = [torch.randn(n, k, device="cuda", dtype=torch.float32).to(tdt) * k ** -0.5
                      for _ in range(max(3, math.ceil((256 << 20) / wbytes)))]
            for m in NS:
                x = torch.randn(m, k, device="cuda", dtype=tdt)
                ref = (x.double() @ copies[0].double().T)
                # Rounding the exact product to the output dtype already costs ~2^-9 (bf16) or
                # ~2^-12 (fp16) relative: `acc` is the error beyond that, the accumulation's own.
                ref_r = ref.to(tdt).double()
                y_ours = as_torch(vm[fname("linear", dtype, n, k)](x, copies[0])).double()
                y_cub = as_torch(vm_cublas[fname("linear", dtype, n, k)](x, copies[0])).double()
                cerr = ((y_cub - ref).norm() / ref.norm()).item()
                y_torch = torch.matmul(x, copies[0].T).double()
                err = ((y_ours - ref).norm() / ref.norm()).item()
                acc = ((y_ours - ref_r).norm() / ref.norm()).item()
                terr = ((y_torch - ref).norm() / ref.norm()).item()
                # torch twice: the spread of one version against itself, the noise floor.
                graphs = [capture(lambda x, w: torch.matmul(x, w.T), copies, x),
                          capture(ours("linear", dtype, n, k), copies, x),
                          capture(lambda x, w: torch.matmul(x, w.T), copies, x),
                          capture(ours("linear", dtype, n, k, vm_cublas), copies, x)]
                if m == 1:
                    graphs.append(capture(ours("gemv", dtype, n, k, vm_cublas), copies, x))
                times = timed(graphs, len(copies))
                t_torch, t_ours = times[0], times[1]
                row = [dtype, f"{n}x{k}", m, t_torch, t_ours, t_ours / t_torch, err, terr, None, acc,
                       times[2] / t_torch, times[3], cerr]
                if m == 1:
                    yg = as_torch(vm_cublas[fname("gemv", dtype, n, k)](x, copies[0])).double()
                    gerr = ((yg - ref).norm() / ref.norm()).item()
                    row[8] = (times[4], gerr)
                del graphs
                rows.append(row)
                msg = (f"{dtype} W={n}x{k} n={m}: torch {t_torch:.1f} us, ours {t_ours:.1f} us, "
                       f"ratio {t_ours / t_torch:.3f}, err {err:.1e} (torch {terr:.1e}, "
                       f"beyond output rounding {acc:.1e}); cuBLAS alone {times[3]:.1f} us err {cerr:.1e}")
                if row[8]:
                    msg += f", static-1 dlight GEMV {row[8][0]:.1f} us err {row[8][1]:.1e}"
                print(msg, flush=True)
                log.write(msg + "\n")
            del copies
    worst = max(r[5] for r in rows)
    worst_err = max(r[6] for r in rows)
    worst_acc = max(r[9] for r in rows)
    lines = ["| dtype | W (N x K) | n | torch.matmul us | ours us | ours/torch | cuBLAS alone us | ours/cuBLAS "
             "| rel err ours | rel err torch | ours, beyond output rounding | TB/s ours | TFLOP/s ours "
             "| torch rerun/torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, w, m, tt, to, ratio, err, terr, _, acc, spread, tc, _ in rows:
        nn_, kk = map(int, w.split("x"))
        lines.append(f"| {d} | {w} | {m} | {tt:.1f} | {to:.1f} | {ratio:.3f} | {tc:.1f} | {to / tc:.3f} | "
                     f"{err:.1e} | {terr:.1e} | {acc:.1e} | {2 * (m + nn_) * kk / to / 1e6:.2f} | "
                     f"{2 * m * nn_ * kk / to / 1e6:.0f} | {spread:.3f} |")
    lines.append("\n| dtype | W | static-1 GEMV (dlight) us | ours n=1 us | cuBLAS n=1 us | dlight/cuBLAS | ours/dlight "
                 "| dlight rel err |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for d, w, m, tt, to, ratio, err, terr, gemv, _, _, tc, _ in rows:
        if gemv:
            lines.append(f"| {d} | {w} | {gemv[0]:.1f} | {to:.1f} | {tc:.1f} | {gemv[0] / tc:.2f} | "
                         f"{to / gemv[0]:.2f} | {gemv[1]:.1e} |")
    small = [r[4] / r[11] for r in rows if r[2] == 1]
    lines.append(f"\nn = 1 (our gemv kernel): ours/cuBLAS-alone {min(small):.2f}-{max(small):.2f}")
    lines.append(f"worst ours/torch ratio {worst:.3f} (goal <= 1.10); worst rel err {worst_err:.1e}, "
                 f"{worst_acc:.1e} beyond output rounding (goal <= 1e-3)")
    sweeps = sorted(lib_dir.glob("sweep_*.so"))
    if sweeps:
        lines.append("\n| W (float16) | n | ours.so (default dispatch) us | " + " | ".join(f.stem for f in sweeps) + " |")
        lines.append("|---|---|---|" + "---|" * len(sweeps))
        vms = [tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(f)), dev) for f in sweeps]
        for n, k in SHAPES:
            copies = [torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5
                      for _ in range(max(3, math.ceil((256 << 20) / (n * k * 2))))]
            for m in (1, 2, 4, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.double() @ copies[0].double().T
                cells = []
                for machine in vms:
                    y = as_torch(machine[fname("linear", "float16", n, k)](x, copies[0])).double()
                    cells.append(((y - ref).norm() / ref.norm()).item())
                times = timed([capture(ours("linear", "float16", n, k), copies, x)]
                              + [capture(ours("linear", "float16", n, k, mc), copies, x) for mc in vms], len(copies))
                lines.append(f"| {n}x{k} | {m} | {times[0]:.1f} | "
                             + " | ".join(f"{t:.1f} ({e:.0e})" for t, e in zip(times[1:], cells)) + " |")
                print(lines[-1], flush=True)
            del copies
    text = "\n".join(lines)
    log.write(text + "\n")
    print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--out", required=True)
    c.add_argument("--sweep", action="store_true", help="also build the gemv kernel with other tile sizes")
    r = sub.add_parser("run")
    r.add_argument("--lib-dir", required=True)
    r.add_argument("--ext", default=None, help="src/runtime/cublas_gemm.cc built alone (scripts/build_cublas_gemm.sh), "
                   "for a runtime library without it")
    r.add_argument("--log-dir", default="bench_logs")
    a = ap.parse_args()
    if a.cmd == "compile":
        compile_lib(Path(a.out), a.sweep)
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
