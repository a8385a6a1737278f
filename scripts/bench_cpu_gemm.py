"""The runtime's CPU GEMM (mlc_lora.runtime.cublas_gemm on CPU tensors) against numpy's matmul.

  python scripts/bench_cpu_gemm.py [--repeat 20] [--m 1 8 64 256]

out (M, N) = x (M, K) @ w (N, K)^T in float32 on SmolLM2-135M's linear shapes (N x K): q/o 576x576,
gate/up 1536x576, down 576x1536, the tied lm_head 49152x576. Prints GFLOP/s of both, side by side,
and our/numpy's ratio (numpy: x @ w.T into a preallocated out, its BLAS with its own threads).
MLC_LORA_NUM_THREADS sets our thread count.
"""

from __future__ import annotations

import argparse

import numpy as np

from harness.timing import wall_time

SHAPES = [("q/o_proj", 576, 576), ("gate/up", 1536, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 256])
    args = p.parse_args()

    import tvm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import mlc_lora  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (loads the runtime)

    gemm = tvm.get_global_func("mlc_lora.runtime.cublas_gemm")
    rng = np.random.default_rng(0)
    print(f"{'shape':>10} {'M':>4} {'N':>6} {'K':>5} | {'ours GF/s':>9} {'numpy GF/s':>10} | ours/numpy")
    for name, n, k in SHAPES:
        w = rng.standard_normal((n, k)).astype("float32")
        wt = w.T
        for m in args.m:
            x = rng.standard_normal((m, k)).astype("float32")
            out, ref = np.empty((m, n), "float32"), np.empty((m, n), "float32")
            repeat = max(3, args.repeat if m * n * k < 1e8 else args.repeat // 4)
            # a loaded host: the least-disturbed sample of each
            t_ours = wall_time(lambda: gemm(x, w, out), repeat=repeat, stat="min")
            t_np = wall_time(lambda: np.matmul(x, wt, out=ref), repeat=repeat, stat="min")
            err = float(np.abs(out - ref).max() / (np.abs(ref).max() + 1e-30))
            if err > 1e-4:
                raise SystemExit(f"{name} M={m}: ours differs from numpy by {err:.2e} (relative)")
            flops = 2.0 * m * n * k
            print(f"{name:>10} {m:>4} {n:>6} {k:>5} | {flops / t_ours / 1e9:9.1f} {flops / t_np / 1e9:10.1f} |"
                  f" {t_np / t_ours:6.2f}x")


if __name__ == "__main__":
    main()
