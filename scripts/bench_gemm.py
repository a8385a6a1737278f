"""Our compiled linear (y = x @ W^T through DispatchCublas with the default `gemv_max_rows`: our
gemv kernel at one token, cuBLAS above) against torch.matmul and against cuBLAS alone.

Two steps:
  compile (any machine, no GPU):  python scripts/bench_gemm.py compile --out DIR [--sweep]
  run (the GPU machine):          python scripts/bench_gemm.py run --lib-dir DIR [--log-dir OUT]
DIR holds ours.so (the default dispatch) and cublas.so (gemv_max_rows=0, and a static-1 twin of
every linear left to dlight's GEMV); with --sweep also sweep_r{ROWS}_u{UNROLL}.so, the gemv kernel
with other tile sizes up to 8 tokens (float16), timed against ours.so in the same run.
Timing: scripts/harness/timing.py: a CUDA graph per candidate holding one call per weight copy, the
copies (>= 256 MB in all) rotated so that the weights never sit in the 50 MB L2; the graphs' replays
interleaved with the order rotated every repetition; median per call.
Error: ||y - ref|| / ||ref|| against a float64 product of the same inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import cli
from harness.timing import Replay, copies_for, replay_times

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096)]  # W: (N, K)
NS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
DTYPES = ["float16", "bfloat16"]
SWEEP = [(2, 2), (2, 4), (4, 4), (8, 1), (8, 2)]  # (ROWS, UNROLL) of gemv.cu beside the default


ROW_KEYS = ("dtype", "W", "n", "torch_us", "ours_us", "ours_over_torch", "rel_err", "torch_rel_err",
            "static1_gemv_us_err", "rel_err_beyond_rounding", "torch_rerun_over_torch", "cublas_us", "cublas_rel_err")


def fname(kind, dtype, n, k):
    return f"{kind}_{dtype}_{n}x{k}"


def compile_lib(out_dir: Path, sweep: bool) -> None:
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from harness import compiler as C  # pylint: disable=import-outside-toplevel

    target = C.target("cuda")
    out_dir.mkdir(parents=True, exist_ok=True)
    gemv = C.gemv_cuda
    # ours: the default dispatch; the sweep builds take the gemv kernel up to 8 rows
    libs = [("ours", C.GEMV_MAX_ROWS, DTYPES, gemv.ROWS, gemv.UNROLL), ("cublas", 0, DTYPES, 0, 0)]
    libs += [(f"sweep_r{r}_u{u}", 8, ["float16"], r, u) for r, u in (SWEEP if sweep else [])]
    default = gemv.ROWS, gemv.UNROLL
    for lib, gemv_max_rows, dtypes, rows_, unroll in libs:
        if gemv_max_rows:
            gemv.ROWS, gemv.UNROLL = rows_, unroll
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
            pipeline = C.get_pipeline(target, gemm="cublas", gemv_max_rows=gemv_max_rows)
            ex = tvm.compile(bb.get(), target, relax_pipeline=pipeline)
            ex.export_library(str(out_dir / f"{lib}.so"))
        gemv.ROWS, gemv.UNROLL = default
        print(f"built {out_dir / lib}.so")


def run(args) -> int:  # pylint: disable=too-many-locals
    import torch  # pylint: disable=import-outside-toplevel

    tvm = cli.gpu_runtime()
    dev = tvm.cuda(0)
    cli.load_cublas(dev)
    lib_dir = Path(args.lib_dir)
    vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(lib_dir / "ours.so")), dev)
    vm_cublas = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(lib_dir / "cublas.so")), dev)
    log = cli.Log(args.log_dir, "bench_gemm")
    torch.manual_seed(0)

    def capture(fn, copies, xs):
        """fn(xs, w) for every weight copy w, as one CUDA graph."""
        return Replay(lambda c: fn(xs, copies[c]), len(copies))

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
                      for _ in range(copies_for(wbytes, min_copies=3))]
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
                times = replay_times(graphs)  # 20 repetitions: each position equally often for 4 or 5
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
                log.say(msg)
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
                      for _ in range(copies_for(n * k * 2, min_copies=3))]
            for m in (1, 2, 4, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.double() @ copies[0].double().T
                cells = []
                for machine in vms:
                    y = as_torch(machine[fname("linear", "float16", n, k)](x, copies[0])).double()
                    cells.append(((y - ref).norm() / ref.norm()).item())
                times = replay_times([capture(ours("linear", "float16", n, k), copies, x)]
                                     + [capture(ours("linear", "float16", n, k, mc), copies, x) for mc in vms])
                lines.append(f"| {n}x{k} | {m} | {times[0]:.1f} | "
                             + " | ".join(f"{t:.1f} ({e:.0e})" for t, e in zip(times[1:], cells)) + " |")
                log.say(lines[-1])
            del copies
    log.say("\n".join(lines))
    cli.write_results(log.json, {"rows": [dict(zip(ROW_KEYS, r)) for r in rows]})
    return 0


def main(argv=None) -> int:
    ap, sub = cli.parser(__doc__, __file__)
    c = cli.add_compile(sub, "ours.so and cublas.so (and the --sweep builds) into one folder (here)")
    c.add_argument("--sweep", action="store_true", help="also build the gemv kernel with other tile sizes")
    r = cli.add_run(sub, "time them against torch.matmul (the GPU machine)")
    r.add_argument("--lib-dir", required=True)
    a = cli.parse(ap, argv)
    if a.cmd == "compile":
        compile_lib(a.out, a.sweep)
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
