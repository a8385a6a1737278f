"""Stage 3 (`sgmv`) on tensor cores: Triton shrink/expand kernels over the pool's arena, built to
cubin at compile time (no GPU needed) and launched from TIR wrappers like the CUDA C++ stage.

Tokens are taken in the order the pool sorted them by slot (`lora_token_order`; slot s owns the
sorted positions `lora_slot_start[s] .. lora_slot_start[s + 1]`), so one thread block works on
one slot and up to BM of its tokens: the adapter's A and B^T rows are loaded once per tile and
multiplied on tensor cores (`tl.dot`). One shrink and one in-place expand cover every part of a
fused linear (q|k|v, gate|up).

Semantics (p a sorted position, t = order[p], s its slot, m = mods[part] >= 0, k < rank[s],
scale[s, m] != 0; C = ceil(in / CHUNK)):
  shrink: v[p, part, c, k] = scale[s, m] * sum_{i in chunk c} x[t, i] * A[s, m][k, i]
          (A[s, m][k] = arena[base + a_off[s, m, k] : + in]); entries of other positions are
          never read.
  expand: y[t, o_part + j] += sum_k (sum_c v[p, part, c, k]) * B^T[s, m][k, j]   in place
          (B^T[s, m][k] = arena[base + b_off[s, m, k] : + w_part], o_part = sum of earlier widths);
          rows of base-model tokens and parts no adapter module covers are left alone.
References: `shrink_ref` / `expand_ref` below.

Grid (static for CUDA graphs; a function of the token count and the table sizes only): x =
ceil(n / BM) + min(n, S) tiles (every slot's tokens in tiles of BM, the sum over slots of
ceil(n_s / BM) is at most that), y = chunks x parts (shrink) or output tiles of all parts (expand).
Blocks past the last tile leave at once. Two tile sizes are built: BM = 16 for n <= SMALL_MAX_TOKENS
(decode batches: many slots of few tokens) and BM = 64 above (prefill).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from tvm import relax

from .. import triton_build
from ..kernel_attrs import kernel_attrs
from .reference import sort_tokens_ref  # noqa: F401  (the pool's token order)
from .stage import LoraContext, LoraStage, Part, layer_arg, tokens

try:  # the kernels are written in Triton; compiling them needs it, nothing else in mlc-lora does
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

SMALL_MAX_TOKENS = 256
VARIANTS = {  # tile configurations: tokens per block, input chunk, output columns, warps
    "small": dict(BM=16, CHUNK=256, BN=128, num_warps=4),
    "large": dict(BM=64, CHUNK=1024, BN=128, num_warps=4),
}
BK, BR = 64, 16  # input elements per dot step; rank rows per dot (tl.dot needs >= 16)
DTYPES = {"float16": "fp16", "bfloat16": "bf16"}
MAX_RANK, MAX_PARTS = 128, 3


def num_chunks(in_f: int, variant: str) -> int:
    return -(-in_f // VARIANTS[variant]["CHUNK"])


def supported(dtype: str, max_rank: int, num_parts: int = 1) -> str | None:
    """None when these kernels can run stage 3 of a model, else why not."""
    if triton is None:
        return "triton is not installed (pip install triton==3.6.0, as mlc-lora's cuda extra does)"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if not 1 <= max_rank <= MAX_RANK:
        return f"max rank {max_rank} (the kernels are built for 1..{MAX_RANK})"
    if not 1 <= num_parts <= MAX_PARTS:
        return f"a linear of {num_parts} parts (the kernels take 1..{MAX_PARTS})"
    return None


# ---------------------------------------------------------------------------------------------
# numpy references


def shrink_ref(x, arena, base, order, slot_start, rank, scale, a_off, mods, max_rank, chunk):
    """Semantics of the shrink; returns v (n, P, C, R) float32 (zeros where nothing is written)."""
    n, in_f = x.shape
    C = -(-in_f // chunk)
    v = np.zeros((n, len(mods), C, max_rank), np.float32)
    for s in range(len(slot_start) - 1):
        for p in range(slot_start[s], slot_start[s + 1]):
            t = order[p]
            for part, m in enumerate(mods):
                if m < 0 or scale[s, m] == 0:
                    continue
                for k in range(rank[s]):
                    a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + in_f].astype(np.float64)
                    prod = x[t].astype(np.float64) * a
                    for c in range(C):
                        v[p, part, c, k] = scale[s, m] * prod[c * chunk:(c + 1) * chunk].sum()
    return v


def expand_ref(y, v, arena, base, order, slot_start, rank, scale, b_off, mods, widths):
    """Semantics of the expand; returns the updated y in float64."""
    out = y.astype(np.float64)
    for s in range(len(slot_start) - 1):
        for p in range(slot_start[s], slot_start[s + 1]):
            t = order[p]
            o = 0
            for part, (m, w) in enumerate(zip(mods, widths)):
                if m >= 0 and scale[s, m] != 0:
                    h = v[p, part].astype(np.float64).sum(0)
                    for k in range(rank[s]):
                        b = arena[base + b_off[s, m, k]: base + b_off[s, m, k] + w].astype(np.float64)
                        out[t, o:o + w] += h[k] * b
                o += w
    return out


# ---------------------------------------------------------------------------------------------
# the kernels

def _kernel_name(kind: str):
    return triton_build.kernel_namer(f"mlc_lora_triton_{kind}", "arena_ptr")


if triton is not None:

    @triton.jit
    def _my_tile(start_ptr, S, pid, BM: tl.constexpr, SP: tl.constexpr):
        """(slot, first sorted position, end position) of block `pid`'s tile; slot -1: none."""
        ss = tl.arange(0, SP)
        lo = tl.load(start_ptr + ss, mask=ss < S, other=0)
        hi = tl.load(start_ptr + ss + 1, mask=ss < S, other=0)
        ntiles = (hi - lo + BM - 1) // BM
        tend = tl.cumsum(ntiles, axis=0)
        s = tl.sum((tend <= pid).to(tl.int32), axis=0)
        tstart = tl.sum(tl.where(ss == s, tend - ntiles, 0), axis=0)
        p0 = tl.sum(tl.where(ss == s, lo, 0), axis=0) + (pid - tstart) * BM
        p1 = tl.sum(tl.where(ss == s, hi, 0), axis=0)
        return tl.where(s < S, s, -1), p0, p1

    @triton.jit(repr=_kernel_name("shrink"))
    def lora_shrink_kernel(x_ptr, arena_ptr, order_ptr, start_ptr, rank_ptr, scale_ptr, aoff_ptr, v_ptr,
                           n, S, base, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr,
                           m2: tl.constexpr, C: tl.constexpr, P: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr,
                           BK: tl.constexpr, BR: tl.constexpr, SP: tl.constexpr, ALIGN: tl.constexpr):
        pid = tl.program_id(0)
        pid_c = tl.program_id(1) % C
        part = tl.program_id(1) // C
        m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
        s, p0, p1 = _my_tile(start_ptr, S, pid, BM, SP)
        if (m < 0) | (s < 0):
            return
        sc = tl.load(scale_ptr + s * M + m)
        if sc == 0.0:
            return
        r_s = tl.load(rank_ptr + s)
        pos = p0 + tl.arange(0, BM)
        rmask = pos < p1
        tok = tl.load(order_ptr + pos, mask=rmask, other=0)
        i_start = pid_c * CHUNK
        for k0 in range(0, r_s, BR):
            kk = k0 + tl.arange(0, BR)
            kmask = kk < r_s
            aoff = tl.multiple_of(tl.load(aoff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
            aoff = aoff.to(tl.int64)
            acc = tl.zeros((BM, BR), dtype=tl.float32)
            for i0 in range(0, CHUNK, BK):
                ii = i_start + i0 + tl.arange(0, BK)
                imask = ii < K
                xt = tl.load(x_ptr + tok[:, None].to(tl.int64) * K + ii[None, :],
                             mask=rmask[:, None] & imask[None, :], other=0.0)
                at = tl.load(arena_ptr + base + aoff[None, :] + ii[:, None],
                             mask=kmask[None, :] & imask[:, None], other=0.0)
                acc += tl.dot(xt, at)
            vptr = v_ptr + ((pos[:, None].to(tl.int64) * P + part) * C + pid_c) * R + kk[None, :]
            tl.store(vptr, acc * sc, mask=rmask[:, None] & kmask[None, :])

    @triton.jit(repr=_kernel_name("expand"))
    def lora_expand_kernel(v_ptr, arena_ptr, order_ptr, start_ptr, rank_ptr, scale_ptr, boff_ptr, y_ptr,
                           n, S, base, C: tl.constexpr, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr,
                           m2: tl.constexpr, w0: tl.constexpr, w1: tl.constexpr, w2: tl.constexpr, P: tl.constexpr,
                           W: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BR: tl.constexpr, CP: tl.constexpr, SP: tl.constexpr, ALIGN: tl.constexpr):
        pid = tl.program_id(0)
        pid_o = tl.program_id(1)
        t0 = tl.cdiv(w0, BN)
        t1 = tl.cdiv(w1, BN)
        part = tl.where(pid_o < t0, 0, tl.where(pid_o < t0 + t1, 1, 2))
        m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
        s, p0, p1 = _my_tile(start_ptr, S, pid, BM, SP)
        if (m < 0) | (s < 0):
            return
        sc = tl.load(scale_ptr + s * M + m)
        if sc == 0.0:
            return
        r_s = tl.load(rank_ptr + s)
        width = tl.where(part == 0, w0, tl.where(part == 1, w1, w2))
        o_p = tl.where(part == 0, 0, tl.where(part == 1, w0, w0 + w1))
        tile = pid_o - tl.where(part == 0, 0, tl.where(part == 1, t0, t0 + t1))
        cols = tile * BN + tl.arange(0, BN)
        cmask = cols < width
        pos = p0 + tl.arange(0, BM)
        rmask = pos < p1
        tok = tl.load(order_ptr + pos, mask=rmask, other=0)
        cc = tl.arange(0, CP)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, r_s, BR):
            kk = k0 + tl.arange(0, BR)
            kmask = kk < r_s
            vptr = (v_ptr + ((pos[:, None, None].to(tl.int64) * P + part) * C + cc[None, :, None]) * R
                    + kk[None, None, :])
            vmask = rmask[:, None, None] & (cc < C)[None, :, None] & kmask[None, None, :]
            h = tl.sum(tl.load(vptr, mask=vmask, other=0.0), axis=1)
            boff = tl.multiple_of(tl.load(boff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
            boff = boff.to(tl.int64)
            bt = tl.load(arena_ptr + base + boff[:, None] + cols[None, :],
                         mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.dot(h.to(bt.dtype), bt)
        ymask = rmask[:, None] & cmask[None, :]
        yptr = y_ptr + tok[:, None].to(tl.int64) * W + (o_p + cols)[None, :]
        yv = tl.load(yptr, mask=ymask, other=0.0)
        tl.store(yptr, (yv.to(tl.float32) + acc).to(yv.dtype), mask=ymask)


# ---------------------------------------------------------------------------------------------
# building the kernels (cubin for the target's arch, no GPU needed) and launching them from TIR

def _signature(kind: str, dtype: str) -> dict:
    e = triton_build.PTR[dtype]
    if kind == "shrink":
        ptrs = dict(x_ptr=e, arena_ptr=e, order_ptr="*i32", start_ptr="*i32", rank_ptr="*i32",
                    scale_ptr="*fp32", aoff_ptr="*i32", v_ptr="*fp32")
        consts = ["M", "m0", "m1", "m2", "C", "P", "K", "R", "BM", "CHUNK", "BK", "BR", "SP", "ALIGN"]
    else:
        ptrs = dict(v_ptr="*fp32", arena_ptr=e, order_ptr="*i32", start_ptr="*i32", rank_ptr="*i32",
                    scale_ptr="*fp32", boff_ptr="*i32", y_ptr=e)
        consts = ["C", "M", "m0", "m1", "m2", "w0", "w1", "w2", "P", "W", "R", "BM", "BN", "BR", "CP", "SP", "ALIGN"]
    sig = dict(ptrs)
    sig.update({"n": "i32", "S": "i32", "base": "i64"})
    sig.update({k: "constexpr" for k in consts})
    return sig


def _module(kind: str, dtype: str, consts: dict, num_warps: int, arch: str):
    """(name, launch threads, dynamic shared bytes, TVM CUDA module) of one kernel variant."""
    fn = lora_shrink_kernel if kind == "shrink" else lora_expand_kernel
    return triton_build.cuda_module(fn, _signature(kind, dtype), consts, num_warps, arch, Path(__file__))


def _slot_pad(max_slots: int) -> int:
    return 1 << max(4, (max_slots - 1).bit_length())


def variant_kernel(kind: str, var: str, in_f: int, mods, widths, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str):
    """(name, launch threads, dynamic shared bytes, TVM CUDA module, blocks along y) of the shrink
    or expand kernel of tile variant `var` for a linear (widths: the parts' widths, for the expand)."""
    cfg, M, R, P = VARIANTS[var], num_modules, max_rank, len(mods)
    m0, m1, m2 = (list(mods) + [-1] * MAX_PARTS)[:MAX_PARTS]
    c = num_chunks(in_f, var)
    if kind == "shrink":
        consts = dict(M=M, m0=m0, m1=m1, m2=m2, C=c, P=P, K=in_f, R=R, BM=cfg["BM"], CHUNK=cfg["CHUNK"],
                      BK=BK, BR=BR, SP=_slot_pad(max_slots), ALIGN=align)
        grid_y = c * P
    else:
        w0, w1, w2 = (list(widths) + [0] * MAX_PARTS)[:MAX_PARTS]
        consts = dict(C=c, M=M, m0=m0, m1=m1, m2=m2, w0=w0, w1=w1, w2=w2, P=P, W=sum(widths), R=R, BM=cfg["BM"],
                      BN=cfg["BN"], BR=BR, CP=1 << max(0, (c - 1).bit_length()), SP=_slot_pad(max_slots),
                      ALIGN=align)
        grid_y = sum(-(-w // cfg["BN"]) for w in widths)
    return (*_module(kind, dtype, consts, cfg["num_warps"], arch), grid_y)


def launch(var: str, kernel: tuple, n, cap1, base) -> tuple:
    """The arguments after the pointers (n, S, base) and the launch (grid x, y, z, threads, shared
    bytes) of `kernel` (variant_kernel's tuple for tile variant `var`) over n tokens sorted by slot,
    slot_start of cap1 entries and the layer's arena offset `base` (TIR expressions): x = a tile per
    BM tokens plus one per slot that has tokens (a slot's last tile may be partial)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    _, threads, shared, _, grid_y = kernel
    bm = VARIANTS[var]["BM"]
    return (T.Cast("int32", n), T.Cast("int32", cap1 - 1), base, T.int64(0), T.int64(0),
            T.Cast("int32", (n + bm - 1) // bm + T.min(n, cap1 - 1)), grid_y, threads, shared)


def shrink_wrapper(in_f: int, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str):
    """(TIR wrapper, CUDA modules). Signature: (x (n, in_f), arena (size,), order (n,) int32,
    slot_start (cap + 1,) int32, rank (S,), scale (S, M), a_off (S, M, R), layer: int64,
    v (n, P, C, R) float32 [out]); part p is module mods[p] (-1: none), C = num_chunks(in_f, "small")."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    R, M, L, P, SP = max_rank, num_modules, num_layers, len(mods), _slot_pad(max_slots)
    C = num_chunks(in_f, "small")
    built = {var: variant_kernel("shrink", var, in_f, mods, None, R, M, dtype, max_slots, align, arch)
             for var in VARIANTS}
    sn, ln = built["small"][0], built["large"][0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def lora_shrink_triton(x_h: T.handle, arena_h: T.handle, order_h: T.handle, start_h: T.handle,
                           rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle, layer: T.int64, v_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, cap1 = T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, P, C, R), "float32")
        assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
        if n > 0:
            if n <= SMALL_MAX_TOKENS:
                T.call_packed(sn, x.data, arena.data, order.data, start.data, rank.data, scale.data, a_off.data,
                              v.data, *launch("small", built["small"], n, cap1, layer * (size // L)))
            else:
                T.call_packed(ln, x.data, arena.data, order.data, start.data, rank.data, scale.data, a_off.data,
                              v.data, *launch("large", built["large"], n, cap1, layer * (size // L)))

    return lora_shrink_triton, [b[3] for b in built.values()]


def expand_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str):
    """(TIR wrapper, CUDA modules). Signature: (v (n, P, C, R) float32, arena (size,), order (n,),
    slot_start (cap + 1,), rank (S,), scale (S, M), b_off (S, M, R), layer: int64, y (n, W) [in
    place]); W = sum(widths), part p = module mods[p]."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    R, M, L, P, SP, W = max_rank, num_modules, num_layers, len(mods), _slot_pad(max_slots), sum(widths)
    C = num_chunks(in_f, "small")
    built = {var: variant_kernel("expand", var, in_f, mods, widths, R, M, dtype, max_slots, align, arch)
             for var in VARIANTS}
    sn, ln = built["small"][0], built["large"][0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def lora_expand_triton(v_h: T.handle, arena_h: T.handle, order_h: T.handle, start_h: T.handle,
                           rank_h: T.handle, scale_h: T.handle, boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, cap1 = T.int64(), T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, P, C, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, W), dtype)
        assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
        if n > 0:
            if n <= SMALL_MAX_TOKENS:
                T.call_packed(sn, v.data, arena.data, order.data, start.data, rank.data, scale.data, b_off.data,
                              y.data, *launch("small", built["small"], n, cap1, layer * (size // L)))
            else:
                T.call_packed(ln, v.data, arena.data, order.data, start.data, rank.data, scale.data, b_off.data,
                              y.data, *launch("large", built["large"], n, cap1, layer * (size // L)))

    return lora_expand_triton, [b[3] for b in built.values()]


class SgmvTriton(LoraStage):
    """Stage 3 on tensor cores: the Triton shrink and in-place expand per fused linear."""

    stage, backend = "sgmv", "triton"

    def supported(self, target, dtype, max_rank, num_parts):
        if target.kind.name != "cuda":
            return f"target {target.kind.name} (the kernels are CUDA)"
        return supported(dtype, max_rank, num_parts)

    def emit(self, ctx: LoraContext, y: relax.Var, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        """y + the deltas of all parts: one shrink (v) and one expand adding into y in place."""
        bb, t, n, R = ctx.builder, tables, tokens(x), ctx.max_rank
        in_f, dtype, L, M = int(x.ty.shape.values[-1]), str(y.ty.dtype), ctx.num_layers, ctx.num_modules
        arch = str(ctx.target.arch)
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        key = ("sgmv_triton", in_f, mods, widths, dtype)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)
        align = ctx.row_align if all(w % ctx.row_align == 0 for w in (in_f, *widths)) else 1
        built = {}

        def make(kind):
            if kind not in built:
                built["shrink"] = shrink_wrapper(in_f, mods, L, R, M, dtype, ctx.max_slots, align, arch)
                built["expand"] = expand_wrapper(in_f, widths, mods, L, R, M, dtype, ctx.max_slots, align, arch)
                for i, m in enumerate(built["shrink"][1] + built["expand"][1]):
                    ctx.external(key + ("module", i), lambda m=m: m)
            return built[kind][0]

        shrink = ctx.kernel(key + ("shrink",), f"lora_sgmv_triton_shrink_m{tag}_{in_f}", lambda: make("shrink"))
        expand = ctx.kernel(key + ("expand",), f"lora_sgmv_triton_expand_m{tag}_{in_f}x{sum(widths)}",
                            lambda: make("expand"))
        common = [t["lora_arena"], t["lora_token_order"], t["lora_slot_start"], t["lora_rank"], t["lora_scale"]]
        v = bb.emit(relax.call_tir(shrink, [x, *common, t["lora_a_off"], layer_arg(layer)],
                                   relax.TensorType([n, len(parts), num_chunks(in_f, "small"), R], "float32")))
        y2 = bb.emit(relax.op.reshape(y, relax.ShapeExpr([n, sum(widths)])))
        # in place: the GEMM's output takes the deltas (no delta tensor, no add, no concat)
        y2 = bb.emit(relax.call_tir_inplace(expand, [v, *common, t["lora_b_off"], layer_arg(layer), y2], [8],
                                            relax.TensorType([n, sum(widths)], dtype)))
        return relax.op.reshape(y2, y.ty.shape)


STAGE = SgmvTriton()
