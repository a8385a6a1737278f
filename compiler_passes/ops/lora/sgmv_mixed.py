"""Stage 3 (`sgmv`) by token count: the CUDA C++ kernels (sgmv_cuda.py) for decode-sized batches,
the Triton tensor-core kernels (sgmv_triton.py, their large tiles) for prefill-sized ones.

The CUDA kernels multiply on CUDA cores: past a few hundred tokens of one adapter (a prefill chunk
holds a few sequences, each of one adapter) they are bound by their arithmetic, which the Triton
kernels do on tensor cores; at decode sizes (many slots of a few tokens) the CUDA kernels are the
faster (docs/SGMV.md). One shrink and one in-place expand per fused linear, as both stages; the
branch is taken inside the launch wrapper on the token count, so the grid stays a function of the
token count (CUDA graphs) and one library serves both.

Semantics: those of both stages (y[t] += scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T over the
parts, sgmv_cuda.py); v is scratch whose layout each branch defines for itself: (n, P, C, R) by
token for the CUDA kernels (C = ceil(in / 512)), (n, P, C', R) by sorted position for the Triton
ones (C' = sgmv_triton.num_chunks(in, "large")), so the buffer holds the larger (scratch_chunks). References:
reference.sgmv_parts_shrink_ref / sgmv_parts_expand_ref (CUDA), sgmv_triton.shrink_ref / expand_ref.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tvm import relax

from ..kernel_attrs import kernel_attrs
from . import sgmv_cuda, sgmv_triton
from .reference import num_chunks
from .stage import LoraContext, LoraStage, Part, layer_arg, tokens

MIXED_MIN_TOKENS = sgmv_triton.SMALL_MAX_TOKENS + 1  # from here on the Triton kernels (large tiles)


def scratch_chunks(in_f: int) -> int:
    """C of the scratch v: room for both branches' partial sums (each indexes it with its own C)."""
    return max(num_chunks(in_f), sgmv_triton.num_chunks(in_f, "large"))


def shrink_wrapper(in_f: int, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str):
    """(TIR wrapper, [Triton module]). Signature: (x (n, in_f), arena (size,), slot (n,), order (n,),
    slot_start (cap + 1,), rank (S,), scale (S, M), a_off (S, M, R), layer: int64, v (n, P, C, R)
    float32 [scratch]); C = scratch_chunks(in_f)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    R, M, L, P, C = max_rank, num_modules, num_layers, len(mods), scratch_chunks(in_f)
    cuda = sgmv_cuda.kernel_names(dtype, max_rank)[0]
    large = sgmv_triton.variant_kernel("shrink", "large", in_f, mods, None, R, M, dtype, max_slots, align, arch)
    SP = sgmv_triton._slot_pad(max_slots)  # pylint: disable=protected-access

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def sgmv_shrink_mixed(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, order_h: T.handle, start_h: T.handle,
                          rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle, layer: T.int64, v_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, cap1 = T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, P, C, R), "float32")
        assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
        if n > 0:
            if n < MIXED_MIN_TOKENS:
                T.call_packed(cuda, x.data, arena.data, slot.data, order.data, rank.data, scale.data, a_off.data,
                              v.data, *sgmv_cuda.shrink_launch(n, layer * (size // L), in_f, mods, M))
            else:
                T.call_packed(large[0], x.data, arena.data, order.data, start.data, rank.data, scale.data, a_off.data,
                              v.data, *sgmv_triton.launch("large", large, n, cap1, layer * (size // L)))

    return sgmv_shrink_mixed, [large[3]]


def expand_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str):
    """(TIR wrapper, [Triton module]). Signature: (v (n, P, C, R) float32, arena (size,), slot (n,),
    order (n,), slot_start (cap + 1,), rank (S,), scale (S, M), b_off (S, M, R), layer: int64,
    y (n, W) [in place]); W = sum(widths)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    R, M, L, P, C, W = max_rank, num_modules, num_layers, len(mods), scratch_chunks(in_f), sum(widths)
    if len(widths) != P:
        raise ValueError(f"{len(widths)} widths for {P} parts")
    cuda = sgmv_cuda.kernel_names(dtype, max_rank)[1]
    large = sgmv_triton.variant_kernel("expand", "large", in_f, mods, widths, R, M, dtype, max_slots, align, arch)
    SP = sgmv_triton._slot_pad(max_slots)  # pylint: disable=protected-access

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def sgmv_expand_mixed(v_h: T.handle, arena_h: T.handle, slot_h: T.handle, order_h: T.handle, start_h: T.handle,
                          rank_h: T.handle, scale_h: T.handle, boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, cap1 = T.int64(), T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, P, C, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, W), dtype)
        assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
        if n > 0:
            if n < MIXED_MIN_TOKENS:
                T.call_packed(cuda, v.data, arena.data, slot.data, order.data, rank.data, scale.data, b_off.data,
                              y.data, *sgmv_cuda.expand_launch(n, layer * (size // L), in_f, widths, mods, M))
            else:
                T.call_packed(large[0], v.data, arena.data, order.data, start.data, rank.data, scale.data, b_off.data,
                              y.data, *sgmv_triton.launch("large", large, n, cap1, layer * (size // L)))

    return sgmv_expand_mixed, [large[3]]


class SgmvMixed(LoraStage):
    """Stage 3 on CUDA fp16/bf16: the CUDA C++ kernels below MIXED_MIN_TOKENS tokens, the Triton
    tensor-core kernels from there on; one shrink and one in-place expand per fused linear."""

    stage, backend = "sgmv", "mixed"

    def supported(self, target, dtype, max_rank, num_parts):
        for impl in (sgmv_cuda.STAGE, sgmv_triton.STAGE):
            why = impl.supported(target, dtype, max_rank, num_parts)
            if why is not None:
                return why
        return None

    def emit(self, ctx: LoraContext, y: relax.Var, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        """y + the deltas of all parts: one shrink (v) and one expand adding into y in place."""
        bb, t, n, R = ctx.builder, tables, tokens(x), ctx.max_rank
        in_f, dtype, L, M = int(x.ty.shape.values[-1]), str(y.ty.dtype), ctx.num_layers, ctx.num_modules
        arch = str(ctx.target.arch)
        ctx.external(("sgmv_cuda", dtype, R), lambda: sgmv_cuda.build_module(dtype, R, arch))
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        key = ("sgmv_mixed", in_f, mods, widths, dtype)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)
        align = ctx.row_align if all(w % ctx.row_align == 0 for w in (in_f, *widths)) else 1

        def make(kind):
            fn, modules = (shrink_wrapper(in_f, mods, L, R, M, dtype, ctx.max_slots, align, arch) if kind == "shrink"
                           else expand_wrapper(in_f, widths, mods, L, R, M, dtype, ctx.max_slots, align, arch))
            for i, m in enumerate(modules):
                ctx.external(key + (kind, i), lambda m=m: m)
            return fn

        shrink = ctx.kernel(key + ("shrink",), f"lora_sgmv_mixed_shrink_m{tag}_{in_f}", lambda: make("shrink"))
        expand = ctx.kernel(key + ("expand",), f"lora_sgmv_mixed_expand_m{tag}_{in_f}x{sum(widths)}",
                            lambda: make("expand"))
        common = [t["lora_arena"], t["lora_token_slot"], t["lora_token_order"], t["lora_slot_start"], t["lora_rank"],
                  t["lora_scale"]]
        v = bb.emit(relax.call_tir(shrink, [x, *common, t["lora_a_off"], layer_arg(layer)],
                                   relax.TensorType([n, len(parts), scratch_chunks(in_f), R], "float32")))
        y2 = bb.emit(relax.op.reshape(y, relax.ShapeExpr([n, sum(widths)])))
        # in place: the GEMM's output takes the deltas (no delta tensor, no add, no concat)
        y2 = bb.emit(relax.call_tir_inplace(expand, [v, *common, t["lora_b_off"], layer_arg(layer), y2], [9],
                                            relax.TensorType([n, sum(widths)], dtype)))
        return relax.op.reshape(y2, y.ty.shape)


STAGE = SgmvMixed()
