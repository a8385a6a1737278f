"""Kernels of routes that `bench_lora_fused.py routes` times and the compiler does not build
(experiments; a route that is kept moves into compiler_passes/ops/ with its tests).

`producer_shrink_kernel`: the producer of a linear's input with the LoRA shrink folded in, for the
rank columns route (ops/lora/linear_triton.py: `lora_fill_cols_kernel` writes the B rows into the
weight's spare columns, which the GEMM over [x | shrink] then multiplies: the expand inside the GEMM).

Semantics (h (n, K); g (K,); the tables as compiler_passes/ops/lora/linear_triton.py's; xe
(n, K + P x RS), RS = RANK_COLUMNS):
  x[t] = round(h[t] * rsqrt(mean_i h[t, i]^2 + eps) * g)  with NORM (RMSNorm, in float32),
         h[t]                                            without (standing in for the producer's own pass)
  xe[t, :K] = x[t]
  xe[t, K + p x RS + c] = round(scale[s, m_p] * (x[t] . A(column c of part p))) where rank column c
         is token t's slot's (s = slot[t] >= 0) and live, else 0
so that xe @ [W | B_cols].T = x @ W.T + the LoRA delta, B_cols (N, P x RS) holding part p's B row of
column c in column p x RS + c over part p's outputs and zeros elsewhere (`lora_fill_cols_kernel`). The
producer: one block per BM tokens, with NORM a first pass over h for the mean square, then one pass
that writes x and multiplies it by the A rows of the rank columns on the tensor cores.
Reference: tests/python/scripts/test_route_kernels.py (float64, under Triton's interpreter); on the
GPU `routes` checks the route's output against float64, as every route's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mlc_lora.compiler_passes.ops.lora.linear_triton import (  # noqa: F401  (the kernels' callees)
    _a_rows, _rank_columns, _store_shrinks)


@triton.jit
def producer_shrink_kernel(h_ptr, g_ptr, arena_ptr, slot_ptr, rank_ptr, scale_ptr, aoff_ptr, xe_ptr, n, S,
                           base, eps, K: tl.constexpr, KE: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                           m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, P: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr, RS: tl.constexpr, SC: tl.constexpr,
                           ALIGN: tl.constexpr, NORM: tl.constexpr, SHRINK: tl.constexpr):
    """Grid (ceil(n / BM),): xe as the module's Semantics say (without SHRINK: its first K columns)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < n
    kk = tl.arange(0, BK)
    h_rows = h_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
    x_rows = xe_ptr + rows[:, None].to(tl.int64) * KE
    rstd = tl.full((BM,), 1.0, tl.float32)
    if NORM:
        ss = tl.zeros((BM,), tl.float32)
        for k0 in range(0, K, BK):
            ht = tl.load(h_rows + k0, mask=rmask[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(ht * ht, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
    a0, v0 = _a_rows(m0, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
    a1, v1 = _a_rows(m1, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
    a2, v2 = _a_rows(m2, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
    acc0 = tl.zeros((BM, RS), dtype=tl.float32)
    acc1 = tl.zeros((BM, RS), dtype=tl.float32)
    acc2 = tl.zeros((BM, RS), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ht = tl.load(h_rows + k0, mask=rmask[:, None], other=0.0)
        if NORM:
            gk = tl.load(g_ptr + k0 + kk).to(tl.float32)
            xt = (ht.to(tl.float32) * rstd[:, None] * gk[None, :]).to(xe_ptr.dtype.element_ty)
        else:
            xt = ht
        tl.store(x_rows + k0 + kk[None, :], xt, mask=rmask[:, None])
        if SHRINK:
            ka = (k0 + kk)[:, None]
            acc0 = tl.dot(xt, tl.load(arena_ptr + a0[None, :] + ka, mask=v0[None, :], other=0.0), acc0)
            if P > 1:
                acc1 = tl.dot(xt, tl.load(arena_ptr + a1[None, :] + ka, mask=v1[None, :], other=0.0), acc1)
            if P > 2:
                acc2 = tl.dot(xt, tl.load(arena_ptr + a2[None, :] + ka, mask=v2[None, :], other=0.0), acc2)
    if SHRINK:
        _store_shrinks(x_rows, rows, rmask, acc0, acc1, acc2, m0, m1, m2, slot_ptr, jc, kc, js, scale_ptr, K, M, R, P,
                       RS, SC)
