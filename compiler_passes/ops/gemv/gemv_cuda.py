"""The base linear on CUDA with a measured choice by token count: our small-batch kernel
(gemv.cu beside this file) for n <= max_rows tokens, cuBLAS (mlc_lora.runtime.cublas_gemm) above.

Semantics: y[i] = x[i] @ W[:N, :K].T for every row i of x (..., K); W (N' >= N, K' >= K): a
weight may be stored with spare rows below or spare columns beside its own; fp32 accumulation
(reference: reference.gemv_ref).

Why two kernels: at a handful of tokens a linear only streams W, and cuBLAS splits K there and
adds a reduce kernel (docs/GPU.md); gemv.cu keeps enough loads of W in flight to run near the
copy rate. The token count is symbolic in the model's functions, so the wrapper (a host-side
PrimFunc) picks the kernel at run time; under CUDA graphs each batch size is captured with its
own pick.
"""

from __future__ import annotations

from pathlib import Path

from tvm.script import tirx as T

from .. import cuda_build
from ..kernel_attrs import kernel_attrs

SOURCE = Path(__file__).parent / "gemv.cu"
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
TOKENS = (1, 2, 4, 8)  # the kernels built: one per upper bound on the token count (NT in gemv.cu)
ROWS = 4  # rows of W per block (ROWS in gemv.cu)
UNROLL = 2  # 16-byte steps of K per row whose loads are in flight together (UNROLL in gemv.cu)
MAX_WARPS = 8
CUBLAS_GEMM = "mlc_lora.runtime.cublas_gemm"


def supported(dtype: str, k: int, ndim: int) -> str | None:
    """None when the kernels can run this linear, else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if k % 8:
        return f"K = {k} (the kernels read 16-byte steps: K % 8 == 0)"
    if ndim not in (2, 3):
        return f"x of {ndim} dimensions (the wrapper takes (n, K) or (b, s, K))"
    return None


def kernel_name(dtype: str, tokens: int) -> str:
    return f"mlc_lora_gemv_{DTYPES[dtype]}_t{tokens}"


def build_module(dtype: str, arch: str):
    """The CUDA module with the kernels for every bound in TOKENS, built by nvcc for `arch`."""
    defines = {"MLC_SUFFIX": DTYPES[dtype], "MLC_GEMV_ROWS": ROWS, "MLC_GEMV_UNROLL": UNROLL}
    if dtype == "bfloat16":
        defines["MLC_BF16"] = None
    cubin = cuda_build.build_cubin(SOURCE, arch, defines)
    args = ["handle"] * 3 + ["int32"] * 4  # x, w, y; n, K, N, W's row stride
    return cuda_build.cuda_module(cubin, {kernel_name(dtype, t): args for t in TOKENS}, arch)


def launch_threads(k: int) -> int:
    """Threads per block: enough warps that each has UNROLL 16-byte steps of K per row, <= 256."""
    steps = k // 8
    return 32 * max(1, min(MAX_WARPS, -(-steps // (32 * UNROLL))))


def wrapper(n_out: int, k: int, dtype: str, ndim: int, max_rows: int, w_rows: int | None = None,
            w_cols: int | None = None):
    """Signature: (x (..., k), w (w_rows or n_out, w_cols or k), y (..., n_out) [out]); our
    kernels for rows <= max_rows (rounded down to a bound in TOKENS), cuBLAS above; both read w's
    first n_out rows and first k columns (w_rows > n_out: rows reserved below the weight's own,
    passes/reserve_rank_rows.py; w_cols > k: columns reserved beside them)."""
    why = supported(dtype, k, ndim)
    if why is not None:
        raise ValueError(f"no gemv kernels for {why}")
    wc = k if w_cols is None else w_cols
    if wc < k or wc % 8:
        raise ValueError(f"a weight of {wc} columns for {k} inputs (at least k, a multiple of 8)")
    # n <= lim[t] runs kernel t; a bound above max_rows gets lim 0 (never taken: n >= 1 there)
    l1, l2, l4, l8 = (t if t <= max_rows else 0 for t in TOKENS)
    k1, k2, k4, k8 = (kernel_name(dtype, t) for t in TOKENS)
    grid, threads = -(-n_out // ROWS), launch_threads(k)
    wr = n_out if w_rows is None else w_rows
    if wr < n_out:
        raise ValueError(f"a weight of {wr} rows for {n_out} outputs")

    # pylint: disable=unused-variable
    if ndim == 2:
        @T.prim_func(s_tir=True)
        def linear(x_h: T.handle, w_h: T.handle, y_h: T.handle):
            T.func_attr(kernel_attrs(True))
            n = T.int64()
            x = T.match_buffer(x_h, (n, k), dtype)
            w = T.match_buffer(w_h, (wr, wc), dtype)
            y = T.match_buffer(y_h, (n, n_out), dtype)
            if n > 0:
                if n <= l1:
                    T.call_packed(k1, x.data, w.data, y.data, T.Cast("int32", n), k, n_out, wc, grid, 1, 1, threads)
                elif n <= l2:
                    T.call_packed(k2, x.data, w.data, y.data, T.Cast("int32", n), k, n_out, wc, grid, 1, 1, threads)
                elif n <= l4:
                    T.call_packed(k4, x.data, w.data, y.data, T.Cast("int32", n), k, n_out, wc, grid, 1, 1, threads)
                elif n <= l8:
                    T.call_packed(k8, x.data, w.data, y.data, T.Cast("int32", n), k, n_out, wc, grid, 1, 1, threads)
                else:
                    T.call_packed(CUBLAS_GEMM, x, w, y)
    else:
        @T.prim_func(s_tir=True)
        def linear(x_h: T.handle, w_h: T.handle, y_h: T.handle):
            T.func_attr(kernel_attrs(True))
            b, s = T.int64(), T.int64()
            x = T.match_buffer(x_h, (b, s, k), dtype)
            w = T.match_buffer(w_h, (wr, wc), dtype)
            y = T.match_buffer(y_h, (b, s, n_out), dtype)
            if b * s > 0:
                if b * s <= l1:
                    T.call_packed(k1, x.data, w.data, y.data, T.Cast("int32", b * s), k, n_out, wc, grid, 1, 1, threads)
                elif b * s <= l2:
                    T.call_packed(k2, x.data, w.data, y.data, T.Cast("int32", b * s), k, n_out, wc, grid, 1, 1, threads)
                elif b * s <= l4:
                    T.call_packed(k4, x.data, w.data, y.data, T.Cast("int32", b * s), k, n_out, wc, grid, 1, 1, threads)
                elif b * s <= l8:
                    T.call_packed(k8, x.data, w.data, y.data, T.Cast("int32", b * s), k, n_out, wc, grid, 1, 1, threads)
                else:
                    T.call_packed(CUBLAS_GEMM, x, w, y)
    return linear
