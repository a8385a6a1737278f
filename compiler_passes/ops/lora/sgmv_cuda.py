"""Stage 3 (`sgmv`) on CUDA as hand-written kernels (sgmv.cu beside this file) and the TIR wrappers
that launch them. One shrink and one expand per fused linear, for all its parts (q|k|v, gate|up):
the parts share x, and the expand adds each part's delta into the base GEMM's output in place,
so a Llama layer takes 8 LoRA launches (per-module kernels: 14, plus the concats and adds).

Semantics (a part p is module mods[p] of the tables, -1 = none; s = slot[t] >= 0, m = mods[p] >= 0,
scale[s, m] != 0, k < rank[s]):
  shrink: v[t, p, c, k] = scale[s, m] * sum_{i in chunk c} x[t, i] * A[s, m][k, i], 0 elsewhere;
          v (n, P, C, R) float32, C = ceil(in / 512).
  expand: y[t, o_p:o_p + w_p] += sum_k (sum_c v[t, p, c, k]) * B[s, m].T[k], in place; o_p = the
          widths of the parts before p; other rows and parts untouched.
References: reference.sgmv_parts_shrink_ref / sgmv_parts_expand_ref, built on the per-module
references of the TIR stage 3 (sgmv_tir.py, which the tests compare both with).

What they do better than the TIR kernels: a block owns a tile of 16 tokens and reads each A/B
row once per distinct slot of the tile (16-byte loads), instead of once per token. The tiles are
taken along `order` (the pool's lora_token_order: the tokens sorted by slot), so a decode batch of
many adapters in random order still reads each adapter's rows in about one tile, not in every
tile one of its tokens falls in; any permutation gives the same results. The grid is
(ceil(n / 16), C, z) and (ceil(n / 16), out tiles of all parts, z), z in 1..8 splitting a tile's
rows over more blocks when there are few tiles: token count and layer shape only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from tvm import relax
from tvm.script import tirx as T

from .. import cuda_build
from ..kernel_attrs import kernel_attrs
from .reference import num_chunks
from .stage import MAX_PARTS, LoraContext, LoraStage, Part, layer_arg, tokens

SOURCE = Path(__file__).parent / "sgmv.cu"
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
MAX_RANK = 128  # the .cu sizes shared memory for R <= 128
TILE = 16  # tokens per block (TILE in sgmv.cu)
SHRINK_THREADS, EXPAND_THREADS, EXPAND_OUT = 128, 64, 512
TARGET_BLOCKS = 528  # 4 per H200 SM: below that, gridDim.z splits a tile's rows over more blocks
MAX_SPLIT = 8


def _split(blocks):
    """gridDim.z for `blocks` (tile, chunk) or (tile, out tile) pairs: a function of the token
    count and the layer shape only."""
    return T.Cast("int32", T.max(1, T.min(MAX_SPLIT, (TARGET_BLOCKS + blocks - 1) // blocks)))


def defines_for(dtype: str, max_rank: int) -> dict:
    """sgmv.cu's -D defines for one build (dtype, max rank), but the dtype's own (MLC_BF16)."""
    return {"MLC_MAX_RANK": max_rank, "MLC_MAX_PARTS": MAX_PARTS, "MLC_SUFFIX": f"{DTYPES[dtype]}_r{max_rank}"}


def supported(dtype: str, max_rank: int, num_parts: int = 1) -> str | None:
    """None when these kernels can run stage 3 of a model, else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if not 1 <= max_rank <= MAX_RANK:
        return f"max rank {max_rank} (the kernels are built for 1..{MAX_RANK})"
    if not 1 <= num_parts <= MAX_PARTS:
        return f"a linear of {num_parts} parts (the kernels take 1..{MAX_PARTS})"
    return None


def kernel_names(dtype: str, max_rank: int) -> tuple[str, str]:
    suffix = f"{DTYPES[dtype]}_r{max_rank}"
    return f"mlc_lora_sgmv_shrink_{suffix}", f"mlc_lora_sgmv_expand_{suffix}"


def build_module(dtype: str, max_rank: int, arch: str):
    """The CUDA module holding both kernels for (dtype, max_rank), built by nvcc for `arch`."""
    why = supported(dtype, max_rank)
    if why is not None:
        raise ValueError(f"no CUDA sgmv kernels for {why}")
    shrink, expand = kernel_names(dtype, max_rank)
    defines = defines_for(dtype, max_rank)
    if dtype == "bfloat16":
        defines["MLC_BF16"] = None
    cubin = cuda_build.build_cubin(SOURCE, arch, defines)
    ptr, i32, i64 = "handle", "int32", "int64"
    return cuda_build.cuda_module(cubin, {
        shrink: [ptr] * 8 + [i32] * 7 + [i64],   # ..., n, in_f, P, m0..m2, num_modules, base
        expand: [ptr] * 8 + [i32] * 10 + [i64],  # ..., n, C, P, m0..m2, w0..w2, num_modules, base
    }, arch)


def _padded(values, fill):
    values = [int(v) for v in values]
    if not 1 <= len(values) <= MAX_PARTS:
        raise ValueError(f"a linear of {len(values)} parts (the kernels take 1..{MAX_PARTS})")
    return values + [fill] * (MAX_PARTS - len(values))


def shrink_launch(n, base, in_f: int, mods, num_modules: int):
    """The shrink's arguments after its pointers (n, in_f, P, m0..m2, num_modules, base) and its launch
    (grid x, y, z, threads), for n tokens and the layer's arena offset `base` (TIR expressions)."""
    C, (m0, m1, m2) = num_chunks(in_f), _padded(mods, -1)
    tiles = (n + TILE - 1) // TILE
    return (T.Cast("int32", n), in_f, len(mods), m0, m1, m2, num_modules, base, T.Cast("int32", tiles), C,
            _split(tiles * C), SHRINK_THREADS)


def expand_launch(n, base, in_f: int, widths, mods, num_modules: int):
    """The expand's arguments after its pointers (n, C, P, m0..m2, w0..w2, num_modules, base) and its
    launch (grid x, y, z, threads)."""
    (m0, m1, m2), (w0, w1, w2) = _padded(mods, -1), _padded(widths, 0)
    out_tiles = sum((w + EXPAND_OUT - 1) // EXPAND_OUT for w in widths)
    tiles = (n + TILE - 1) // TILE
    return (T.Cast("int32", n), num_chunks(in_f), len(mods), m0, m1, m2, w0, w1, w2, num_modules, base,
            T.Cast("int32", tiles), out_tiles, _split(tiles * out_tiles), EXPAND_THREADS)


def shrink_wrapper(in_f: int, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str):
    """Signature: (x (n, in_f), arena (size,), slot (n,), order (n,), rank (S,), scale (S, M),
    a_off (S, M, R), layer: int64, v (n, P, C, R) float32 [out]); part p is module mods[p] (-1:
    none); order: a permutation of the tokens, the order the blocks tile them in."""
    R, M, L, C, P = max_rank, num_modules, num_layers, num_chunks(in_f), len(mods)
    _padded(mods, -1)  # a ValueError for too many parts, before the script is parsed
    name = kernel_names(dtype, max_rank)[0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)  # as the TIR kernels (and as relax.BlockBuilder.add_func leaves them)
    def sgmv_shrink_cuda(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, order_h: T.handle,
                         rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle, layer: T.int64, v_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        order = T.match_buffer(order_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, P, C, R), "float32")
        if n > 0:
            T.call_packed(name, x.data, arena.data, slot.data, order.data, rank.data, scale.data, a_off.data,
                          v.data, *shrink_launch(n, layer * (size // L), in_f, mods, M))

    return sgmv_shrink_cuda


def expand_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str):
    """Signature: (v (n, P, C, R) float32, arena (size,), slot (n,), order (n,), rank (S,),
    scale (S, M), b_off (S, M, R), layer: int64, y (n, W) [in place]); W = sum(widths), part p =
    module mods[p]; order as the shrink's."""
    R, M, L, C, P, W = max_rank, num_modules, num_layers, num_chunks(in_f), len(mods), sum(widths)
    if len(widths) != P:
        raise ValueError(f"{len(widths)} widths for {P} parts")
    _padded(mods, -1)  # a ValueError for too many parts, before the script is parsed
    name = kernel_names(dtype, max_rank)[1]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)  # as the TIR kernels (and as relax.BlockBuilder.add_func leaves them)
    def sgmv_expand_cuda(v_h: T.handle, arena_h: T.handle, slot_h: T.handle, order_h: T.handle,
                         rank_h: T.handle, scale_h: T.handle, boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size = T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, P, C, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        order = T.match_buffer(order_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, W), dtype)
        if n > 0:
            T.call_packed(name, v.data, arena.data, slot.data, order.data, rank.data, scale.data, b_off.data, y.data,
                          *expand_launch(n, layer * (size // L), in_f, widths, mods, M))

    return sgmv_expand_cuda


class SgmvCuda(LoraStage):
    """Stage 3 on CUDA fp16/bf16: one shrink and one in-place expand (sgmv.cu) per fused linear."""

    stage, backend = "sgmv", "cuda"

    def supported(self, target, dtype, max_rank, num_parts, rows="model"):
        if target.kind.name != "cuda":
            return f"target {target.kind.name} (the kernels are CUDA)"
        if rows != "model":
            return f"{rows} adapter rows (on CUDA the triton kernels read them)"
        return supported(dtype, max_rank, num_parts)

    def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        """y + the deltas of all parts, by one shrink (before the GEMM) and one in-place expand."""
        bb, t, n, R = ctx.builder, tables, tokens(x), ctx.max_rank
        in_f, dtype, L, M = int(x.ty.shape.values[-1]), str(base.ty.dtype), ctx.num_layers, ctx.num_modules
        ctx.external(("sgmv_cuda", dtype, R), lambda: build_module(dtype, R, str(ctx.target.arch)))
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        key = ("sgmv_cuda", in_f, mods, widths, dtype)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)
        shrink = ctx.kernel(key + ("shrink",), f"lora_sgmv_shrink_m{tag}_{in_f}",
                            lambda: shrink_wrapper(in_f, mods, L, R, M, dtype))
        expand = ctx.kernel(key + ("expand",), f"lora_sgmv_expand_m{tag}_{in_f}x{sum(widths)}",
                            lambda: expand_wrapper(in_f, widths, mods, L, R, M, dtype))
        v = bb.emit(relax.call_tir(shrink, [x, t["lora_arena"], t["lora_token_slot"], t["lora_token_order"],
                                            t["lora_rank"], t["lora_scale"], t["lora_a_off"], layer_arg(layer)],
                                   relax.TensorType([n, len(parts), num_chunks(in_f), R], "float32")))
        y = bb.emit(base)
        y2 = bb.emit(relax.op.reshape(y, relax.ShapeExpr([n, sum(widths)])))
        # In place: the GEMM's output takes the deltas (no delta tensor, no add, no concat).
        y2 = bb.emit(relax.call_tir_inplace(expand, [v, t["lora_arena"], t["lora_token_slot"], t["lora_token_order"],
                                                     t["lora_rank"], t["lora_scale"], t["lora_b_off"], layer_arg(layer),
                                                     y2], [8],
                                            relax.TensorType([n, sum(widths)], dtype)))
        return relax.op.reshape(y2, y.ty.shape)


STAGE = SgmvCuda()
