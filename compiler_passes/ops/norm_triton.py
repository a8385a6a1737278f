"""The RMSNorm of the model's hidden state, with the residual add before it, as one Triton kernel.

A Llama layer adds each branch's output to the hidden state and normalizes the sum for the next
branch: `h = h + o_proj(...)`, `x = rms_norm(h)` (and `h + down_proj(...)` before the next layer's
or the final norm). TVM runs the add and the norm as two kernels (the add ~47% of the memory
bandwidth in prefill, the norm about half; docs/SGMV.md "What is left"), reading the sum back after
writing it. This kernel reads h and the branch's output once, writes the sum (the residual stream
the model keeps) and x. DispatchNorm puts it in place of TVM's kernels in every function of a CUDA
fp16/bf16 library; the rank columns route's linears (ops/lora/linear_triton.py) run it as x's
producer, writing x into the first columns of [x | s].

Semantics (h, r (n, K), g (K,), model dtype; eps; x's rows LDO >= K apart):
  with r:    h1[t, i] = round(h[t, i] + r[t, i]); without: h1 = h
  x[t, i] = round(h1[t, i] * g[i] / sqrt(sum_i h1[t, i]^2 / K + eps)), in float32 from the rounded
  h1 (as TVM's add, then rms_norm), rounded once to the model dtype.
Reference: `rms_norm_ref` below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import triton_build

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

DTYPES = ("float16", "bfloat16")
MAX_K = 16384  # a row per block, loaded once into registers


def rms_norm_ref(h: np.ndarray, g: np.ndarray, eps: float, r: np.ndarray | None = None):
    """Semantics: (h1, x) in float64 from h (n, K), g (K,) and, with the residual add, r (n, K)
    (h1 rounded to h's dtype first, as the kernel stores and reads it)."""
    h1 = h if r is None else (h.astype(np.float32) + r.astype(np.float32)).astype(h.dtype)
    f = h1.astype(np.float64)
    x = f / np.sqrt((f * f).mean(axis=-1, keepdims=True) + eps) * g.astype(np.float64)
    return h1, x


def supported(dtype: str, k: int) -> str | None:
    """None when the kernel runs an RMSNorm of rows of k in this dtype, else why not."""
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernel is float16/bfloat16)"
    if k > MAX_K:
        return f"rows of {k} (at most {MAX_K})"
    return None


if triton is not None:

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_rms_norm", "out_ptr"))
    def rms_norm_kernel(h_ptr, r_ptr, g_ptr, out_ptr, h1_ptr, eps, K: tl.constexpr, BK: tl.constexpr,
                        LDO: tl.constexpr, RES: tl.constexpr):
        """Grid (n,), one row per block, the row loaded once (BK: K rounded up to a power of two):
        with RES, h1[t] = h[t] + r[t] (stored) and x of h1; else x of h[t] (r_ptr, h1_ptr unread).
        x's row t at out_ptr + t * LDO (LDO = K; the rank columns route's [x | s]: its width)."""
        triton_build.wait_for_producers()
        cols = tl.arange(0, BK)
        row = tl.program_id(0).to(tl.int64) * K
        mask = cols < K
        if BK == K:
            h = tl.load(h_ptr + row + cols)
            g = tl.load(g_ptr + cols).to(tl.float32)
        else:
            h = tl.load(h_ptr + row + cols, mask=mask, other=0.0)
            g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if RES:
            if BK == K:
                r = tl.load(r_ptr + row + cols)
            else:
                r = tl.load(r_ptr + row + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h1_ptr.dtype.element_ty)
            tl.store(h1_ptr + row + cols, h, mask=mask)
        f = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(f * f, axis=0) / K + eps)
        x = (f * rstd * g).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * LDO + cols, x, mask=mask)


def launch(k: int, ldo: int | None = None, residual: bool = False) -> dict:
    """Constants and warps of rms_norm_kernel for rows of k, x's rows `ldo` apart (default k; [x | s]'s
    width for its first columns), with the residual add or not."""
    bk = 1 << (k - 1).bit_length()
    return dict(consts=dict(K=k, BK=bk, LDO=ldo or k, RES=int(residual)), warps=4 if bk <= 4096 else 8)


def _signature(dtype: str) -> dict:
    e = triton_build.PTR[dtype]
    return dict(h_ptr=e, r_ptr=e, g_ptr=e, out_ptr=e, h1_ptr=e, eps="fp32", K="constexpr", BK="constexpr",
                LDO="constexpr", RES="constexpr")


def build(k: int, dtype: str, arch: str, ldo: int | None = None, residual: bool = False):
    """(kernel name, threads, shared bytes, TVM CUDA module) of the kernel for rows of k."""
    nl = launch(k, ldo, residual)
    return triton_build.cuda_module(rms_norm_kernel, _signature(dtype), nl["consts"], nl["warps"], arch,
                                    Path(__file__))


def wrapper(k: int, dtype: str, eps: float, arch: str, residual: bool):
    """(TIR wrapper, CUDA module): (h (n, k), g (k,), x (n, k) [out]), or with the residual add
    (h (n, k), r (n, k), g (k,), h1 (n, k) [out], x (n, k) [out])."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    from .kernel_attrs import kernel_attrs  # pylint: disable=import-outside-toplevel

    name, threads, shared, mod = build(k, dtype, arch, residual=residual)

    # pylint: disable=unused-variable
    if residual:
        @T.prim_func(s_tir=True)
        def add_rms_norm_triton(h_h: T.handle, r_h: T.handle, g_h: T.handle, h1_h: T.handle, x_h: T.handle):
            T.func_attr(kernel_attrs(True))
            n = T.int64()
            h = T.match_buffer(h_h, (n, k), dtype)
            r = T.match_buffer(r_h, (n, k), dtype)
            g = T.match_buffer(g_h, (k,), dtype)
            h1 = T.match_buffer(h1_h, (n, k), dtype)
            x = T.match_buffer(x_h, (n, k), dtype)
            if n > 0:
                T.call_packed(name, h.data, r.data, g.data, x.data, h1.data, T.float32(eps), T.int64(0), T.int64(0),
                              T.Cast("int32", n), 1, threads, shared)

        return add_rms_norm_triton, mod

    @T.prim_func(s_tir=True)
    def rms_norm_triton(h_h: T.handle, g_h: T.handle, x_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n = T.int64()
        h = T.match_buffer(h_h, (n, k), dtype)
        g = T.match_buffer(g_h, (k,), dtype)
        x = T.match_buffer(x_h, (n, k), dtype)
        if n > 0:
            T.call_packed(name, h.data, h.data, g.data, x.data, x.data, T.float32(eps), T.int64(0), T.int64(0),
                          T.Cast("int32", n), 1, threads, shared)

    return rms_norm_triton, mod
