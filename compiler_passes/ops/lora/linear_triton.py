"""The base linear and its multi-LoRA delta in ONE Triton kernel, for decode batches.

Separate LoRA launches cost more than the adapters' bytes: at 4 adapters of rank 8 a Llama-2-7B
layer moves ~1.3 MB of adapter rows against ~400 MB of weights, but each shrink/expand pair is a
launch of its own. This kernel is the base GEMM `x @ W.T` of a fused linear (q|k|v, gate|up, ...)
that also multiplies, while it streams x, by the active adapters' A rows, and adds their B rows in
its epilogue: no LoRA launch at all. LoraRewrite builds it into `decode_fused`
(contract.FUSED_FUNCTION_SUFFIX), which the runner picks for a batch of at most FUSED_MAX_TOKENS
tokens whose adapters' ranks sum to at most RANK_COLUMNS over at most SLOT_COLUMNS slots; other
batches run `decode` (cuBLAS + the sgmv stage).

Semantics (x (n, K); W (N, K) as the model stores it; parts p of widths w_p are modules m_p of the
tables, -1 none; token t has slot s = slot[t], -1 = base model; o_p = the widths before p):
  y[t, o] = sum_i x[t, i] W[o, i]
          + [s >= 0, m = m_p(o) >= 0, scale[s, m] != 0]
            scale[s, m] * sum_{k < rank[s]} (sum_i x[t, i] A[s, m][k, i]) * B^T[s, m][k, o - o_p]
  A[s, m][k] = arena[base + a_off[s, m, k] : + K],  B^T[s, m][k] = arena[base + b_off[s, m, k] : + w_p]
How: the slots' rank rows sit side by side as "rank columns" c (slot j owns columns
start_j .. start_j + rank[j], start_j = the ranks of the slots before it). A block of BM tokens x
BN outputs accumulates x @ W.T and xa = x @ A_cat.T (BM x RANK_COLUMNS) in the same K loop, keeps of
xa only each token's own slot's columns, scales them, and adds xa @ B_cat.T over its outputs in
fp32 before the one store. The LoRA product rounds xa to the model dtype (as PEFT's lora_A output).
Reference: `linear_ref` below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence  # noqa: F401

import numpy as np

from .. import triton_build

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

FUSED_MAX_TOKENS = 64  # decode batches up to this many tokens (at 128 it measured slower than cuBLAS + the peers)
SMALL_MAX_TOKENS = 16  # up to here blocks of 16 tokens, above 64
RANK_COLUMNS = 32  # the adapters' ranks of a batch sum to at most this (4 x r8, 2 x r16, 1 x r32)
SLOT_COLUMNS = 16  # the batch's adapters (slots) number at most this
DTYPES = ("float16", "bfloat16")
MAX_PARTS = 3


def linear_ref(x, w, arena, base, slot, rank, scale, a_off, b_off, mods, widths):
    """Semantics of the kernel in float64: y (n, N)."""
    y = x.astype(np.float64) @ w.astype(np.float64).T
    o = 0
    for m, wp in zip(mods, widths):
        for t in range(x.shape[0]):
            s = int(slot[t])
            if s < 0 or m < 0 or scale[s, m] == 0:
                continue
            for k in range(int(rank[s])):
                a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + x.shape[1]].astype(np.float64)
                b = arena[base + b_off[s, m, k]: base + b_off[s, m, k] + wp].astype(np.float64)
                y[t, o:o + wp] += scale[s, m] * (x[t].astype(np.float64) @ a) * b
        o += wp
    return y


def tile_config(in_f: int, widths: Sequence[int], bm: int) -> dict:
    """Block shape for a linear of `in_f` inputs and these part widths, blocks of `bm` tokens:
    the best measured on the H200 for the Llama-2-7B linears (docs/SGMV.md), 32 output columns
    for narrow linears (enough blocks to keep the memory busy), 128 for wide ones."""
    n_out = sum(widths)
    bn = next(b for b in ((128, 64, 32, 16) if n_out >= 8192 else (32, 16)) if all(w % b == 0 for w in widths))
    prefer = 256 if (bn == 32 and bm == 16) else (64 if n_out >= 16384 else 128)
    bk = next((b for b in (256, 128, 64, 32, 16) if b <= prefer and in_f % b == 0), None)
    warps = 8 if (bn == 128 and bk == 128) else 4
    return dict(BM=bm, BN=bn, BK=bk, STAGES=4, num_warps=warps)


def supported(dtype: str, weight_dtype: str, in_f: int, widths: Sequence[int]) -> str | None:
    """None when the kernel can run this linear, else why not."""
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES or weight_dtype != dtype:
        return f"dtype {dtype} / weights {weight_dtype} (the kernel is float16/bfloat16, unquantized)"
    if not 1 <= len(widths) <= MAX_PARTS:
        return f"a linear of {len(widths)} parts (1..{MAX_PARTS})"
    if any(w % 16 for w in widths) or in_f % 16:
        return f"in {in_f} / widths {tuple(widths)} (multiples of 16)"
    return None


if triton is not None:

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_linear", "x_ptr"))
    def lora_linear_kernel(x_ptr, w_ptr, arena_ptr, slot_ptr, rank_ptr, scale_ptr, aoff_ptr, boff_ptr, y_ptr,
                           n, S, base,
                           K: tl.constexpr, N: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                           m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, W0: tl.constexpr,
                           W1: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           RS: tl.constexpr, SC: tl.constexpr, STAGES: tl.constexpr, ALIGN: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < n
        cols = pid_n * BN + tl.arange(0, BN)
        n0 = pid_n * BN
        # this block's part (BN divides every part width)
        in1 = (n0 >= W0).to(tl.int32)
        in2 = (n0 >= W0 + W1).to(tl.int32)
        m = m0 + in1 * (m1 - m0) + in2 * (m2 - m1)
        o_p = in1 * W0 + in2 * W1
        # rank columns: slot j owns start_j .. start_j + rank[j]
        jj = tl.arange(0, SC)
        # clamped: a captured graph's fixed tables hold whatever rows past the batch's slots
        rk = tl.minimum(tl.maximum(tl.load(rank_ptr + jj, mask=jj < S, other=0), 0), R)
        end = tl.cumsum(rk, axis=0)
        start = end - rk
        c = tl.arange(0, RS)
        jc = tl.sum((end[None, :] <= c[:, None]).to(tl.int32), axis=1)
        kc = c - tl.sum(tl.where(jj[None, :] == jc[:, None], start[None, :], 0), axis=1)
        js = tl.minimum(jc, SC - 1)
        mm = tl.maximum(m, 0)
        scale_c = tl.load(scale_ptr + js * M + mm, mask=(jc < SC) & (m >= 0), other=0.0)
        valid = (jc < SC) & (m >= 0) & (scale_c != 0.0)
        tab = (js * M + mm) * R + tl.minimum(kc, R - 1)
        a_row = tl.multiple_of(tl.load(aoff_ptr + tab, mask=valid, other=0).to(tl.int64) + base, ALIGN)
        kk = tl.arange(0, BK)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * K + kk[:, None]
        a_ptrs = arena_ptr + a_row[None, :] + kk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        xa = tl.zeros((BM, RS), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            xt = tl.load(x_ptrs + k0, mask=rmask[:, None], other=0.0)
            acc = tl.dot(xt, tl.load(w_ptrs + k0), acc)
            xa = tl.dot(xt, tl.load(a_ptrs + k0, mask=valid[None, :], other=0.0), xa)
        ts = tl.load(slot_ptr + rows, mask=rmask, other=-1)
        keep = (ts[:, None] == jc[None, :]) & valid[None, :]
        xa16 = tl.where(keep, xa * scale_c[None, :], 0.0).to(x_ptr.dtype.element_ty)
        # B rows only of the slots this tile's tokens use: rows of other slots (a captured graph's
        # tables keep stale slots past the batch's) may point at pages holding anything, and
        # 0 * NaN would reach y through the dot
        used = tl.max(keep.to(tl.int32), axis=0) > 0
        b_row = tl.multiple_of(tl.load(boff_ptr + tab, mask=used, other=0).to(tl.int64) + base, ALIGN)
        bt = tl.load(arena_ptr + b_row[:, None] + (cols - o_p)[None, :], mask=used[:, None], other=0.0)
        acc = tl.dot(xa16, bt, acc)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None])


def _signature(dtype: str) -> dict:
    e = triton_build.PTR[dtype]
    sig = dict(x_ptr=e, w_ptr=e, arena_ptr=e, slot_ptr="*i32", rank_ptr="*i32", scale_ptr="*fp32",
               aoff_ptr="*i32", boff_ptr="*i32", y_ptr=e, n="i32", S="i32", base="i64")
    sig.update({k: "constexpr" for k in ("K", "N", "M", "R", "m0", "m1", "m2", "W0", "W1", "BM", "BN", "BK",
                                          "RS", "SC", "STAGES", "ALIGN")})
    return sig


def constants(in_f: int, widths: Sequence[int], mods: Sequence[int], num_modules: int, max_rank: int,
              bm: int, align: int) -> tuple[dict, int]:
    """(compile-time constants, num_warps) of the kernel for one linear and block height."""
    cfg = tile_config(in_f, widths, bm)
    m = (list(mods) + [-1] * MAX_PARTS)[:MAX_PARTS]
    w = (list(widths) + [0] * MAX_PARTS)[:2]
    consts = dict(K=in_f, N=sum(widths), M=num_modules, R=max_rank, m0=m[0], m1=m[1], m2=m[2], W0=w[0], W1=w[1],
                  BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], RS=RANK_COLUMNS, SC=SLOT_COLUMNS,
                  STAGES=cfg["STAGES"], ALIGN=align)
    return consts, cfg["num_warps"]


def linear_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   align: int, arch: str):
    """(TIR wrapper, CUDA modules). Signature: (x (n, in_f), w (W, in_f), arena (size,), slot (n,),
    rank (S,), scale (S, M), a_off (S, M, R), b_off (S, M, R), layer: int64, y (n, W) [out])."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    from ..kernel_attrs import kernel_attrs  # pylint: disable=import-outside-toplevel

    R, M, L, W = max_rank, num_modules, num_layers, sum(widths)
    built = {}
    for bm in (16, 64):
        consts, warps = constants(in_f, widths, mods, M, R, bm, align)
        name, threads, shared, mod = triton_build.cuda_module(lora_linear_kernel, _signature(dtype), consts, warps,
                                                              arch, Path(__file__))
        built[bm] = (name, threads, shared, mod, W // consts["BN"])
    sn, sth, ssh, _, s_nt = built[16]
    ln, lth, lsh, _, l_nt = built[64]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def lora_linear_triton(x_h: T.handle, w_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                           scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        w = T.match_buffer(w_h, (W, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, W), dtype)
        if n > 0:
            if n <= SMALL_MAX_TOKENS:
                T.call_packed(sn, x.data, w.data, arena.data, slot.data, rank.data, scale.data, a_off.data,
                              b_off.data, y.data, T.Cast("int32", n), T.Cast("int32", S), layer * (size // L),
                              T.int64(0), T.int64(0), T.Cast("int32", (n + 15) // 16), s_nt, sth, ssh)
            else:
                T.call_packed(ln, x.data, w.data, arena.data, slot.data, rank.data, scale.data, a_off.data,
                              b_off.data, y.data, T.Cast("int32", n), T.Cast("int32", S), layer * (size // L),
                              T.int64(0), T.int64(0), T.Cast("int32", (n + 63) // 64), l_nt, lth, lsh)

    return lora_linear_triton, [b[3] for b in built.values()]


class FusedLinear:
    """The fused linear of `decode_fused`: LoraRewrite replaces `x @ W.T` + the stage's update by one
    call of this kernel where `supported` is None (other linears keep the stage's update)."""

    def supported(self, target, dtype: str, weight_dtype: str, in_f: int, widths: Sequence[int]) -> str | None:
        if target.kind.name != "cuda":
            return f"target {target.kind.name} (the kernel is CUDA)"
        return supported(dtype, weight_dtype, in_f, widths)

    def emit(self, ctx, x, w, layer: int, parts: Sequence, tables: Mapping, out_shape):
        """y = x @ W.T + every token's delta, (n, W) reshaped to `out_shape` (not yet emitted).
        ctx: the rewrite's LoraContext; x (n, in) and w (W, in) relax Vars; parts: ops/lora Parts."""
        from tvm import relax  # pylint: disable=import-outside-toplevel

        from .stage import layer_arg, tokens  # pylint: disable=import-outside-toplevel

        bb, t, n = ctx.builder, tables, tokens(x)
        in_f, dtype = int(x.ty.shape.values[-1]), str(x.ty.dtype)
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        align = ctx.row_align if all(v % ctx.row_align == 0 for v in (in_f, *widths)) else 1
        key = ("linear_triton", in_f, mods, widths, dtype)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)

        def make():
            func, mods_ = linear_wrapper(in_f, widths, mods, ctx.num_layers, ctx.max_rank, ctx.num_modules, dtype,
                                         align, str(ctx.target.arch))
            for i, mod in enumerate(mods_):
                ctx.external(key + ("module", i), lambda mod=mod: mod)
            return func

        fn = ctx.kernel(key, f"lora_linear_triton_m{tag}_{in_f}x{sum(widths)}", make)
        y = bb.emit(relax.call_tir(fn, [x, w, t["lora_arena"], t["lora_token_slot"], t["lora_rank"], t["lora_scale"],
                                        t["lora_a_off"], t["lora_b_off"], layer_arg(layer)],
                                   relax.TensorType([n, sum(widths)], dtype)))
        return relax.op.reshape(y, out_shape)


FUSED = FusedLinear()
