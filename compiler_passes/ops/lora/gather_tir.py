"""Stage 2 (`gather`) as TIR: one naive per-token gather kernel per module, read straight out
of the unified page arena; reference: reference.lora_gather_ref (semantics: reference.py).

Index arithmetic is 64-bit. Ranks below R are not padded: loops stop at `rank[s]`. The GPU
variant is hand-scheduled (kernel_attrs.py); `layer` is a scalar argument so that one kernel
serves every layer.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tvm
from tvm import relax
from tvm.script import tirx as T

from ..kernel_attrs import is_gpu, kernel_attrs
from .stage import LoraContext, LoraStage, Part, add_module_deltas, layer_arg, tokens

GPU_THREADS = 128
WARP = 32


def lora_gather_kernel(in_f: int, out_f: int, m: int, num_layers: int, max_rank: int,
                       num_modules: int, dtype: str, target: tvm.target.Target):
    """The stage-2 kernel of module `m`; reference: `reference.lora_gather_ref`.

    Semantics: delta[t] = scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T for s = slot[t] >= 0, else 0;
    the pass adds delta to the base output y[t] (and loops k < rank[s] only).

    Signature: (x (n, in_f), arena (size,), slot (n,), rank (S,), scale (S, M), a_off (S, M, R),
    b_off (S, M, R), layer: int64, delta (n, out_f) [out]).
    """
    R, M, L = max_rank, num_modules, num_layers
    gpu = is_gpu(target)
    attrs = kernel_attrs(gpu)

    @T.prim_func(s_tir=True)
    def lora_gather_cpu(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                        scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle, layer: T.int64,
                        y_h: T.handle):
        T.func_attr(attrs)
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, out_f), dtype)
        for t in T.parallel(n):
            with T.sblock("token"):
                T.reads()
                T.writes()
                h = T.sblock_alloc_buffer((R,), "float32")
                acc = T.sblock_alloc_buffer((1,), "float32")
                s: T.let[T.int32] = slot[t]
                base: T.let[T.int64] = layer * (size // L)
                for o in T.serial(out_f):
                    y[t, o] = T.cast(0, dtype)
                if s >= 0:
                    if scale[s, m] != T.float32(0):
                        for k in T.serial(rank[s]):
                            acc[0] = T.float32(0)
                            for i in T.serial(in_f):
                                acc[0] += T.cast(x[t, i], "float32") * T.cast(
                                    arena[base + T.cast(a_off[s, m, k], "int64") + i], "float32")
                            h[k] = acc[0] * scale[s, m]
                        for o in T.serial(out_f):
                            acc[0] = T.float32(0)
                            for k in T.serial(rank[s]):
                                acc[0] += h[k] * T.cast(
                                    arena[base + T.cast(b_off[s, m, k], "int64") + o], "float32")
                            y[t, o] = T.cast(acc[0], dtype)

    # GPU: one block per token. Shrink: warp w takes rows k = w, w+4, ...; its lanes stride the
    # row (coalesced) and reduce through shared memory. Expand: threads stride the output row.
    NT, NW = GPU_THREADS, GPU_THREADS // WARP

    @T.prim_func(s_tir=True)
    def lora_gather_gpu(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                        scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle, layer: T.int64,
                        y_h: T.handle):
        T.func_attr(attrs)
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, out_f), dtype)
        for bx in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("token"):
                    T.reads()
                    T.writes()
                    h = T.sblock_alloc_buffer((R,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    s: T.let[T.int32] = slot[bx]
                    base: T.let[T.int64] = layer * (size // L)
                    lane: T.let[T.int32] = T.cast(tx, "int32") % WARP
                    warp: T.let[T.int32] = T.cast(tx, "int32") // WARP
                    flag = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    flag[0] = 0
                    if s >= 0:
                        if scale[s, m] != T.float32(0):
                            flag[0] = 1
                    if flag[0] == 1:
                        for kk in T.serial(T.ceildiv(rank[s], NW)):
                            k: T.let[T.int32] = kk * NW + warp
                            acc[0] = T.float32(0)
                            if k < rank[s]:
                                for ii in T.serial(T.ceildiv(in_f, WARP)):
                                    i: T.let[T.int32] = ii * WARP + lane
                                    if i < in_f:
                                        acc[0] += T.cast(x[bx, i], "float32") * T.cast(
                                            arena[base + T.cast(a_off[s, m, k], "int64") + T.cast(i, "int64")],
                                            "float32")
                            red[tx] = acc[0]
                            T.tvm_storage_sync("shared")
                            for st in T.unroll(5):
                                if lane < (16 >> st):
                                    red[tx] = red[tx] + red[tx + (16 >> st)]
                                T.tvm_storage_sync("shared")
                            if lane == 0 and k < rank[s]:
                                h[k] = red[tx] * scale[s, m]
                            T.tvm_storage_sync("shared")
                    for oo in T.serial(T.ceildiv(out_f, NT)):
                        o: T.let[T.int32] = oo * NT + T.cast(tx, "int32")
                        if o < out_f:
                            acc[0] = T.float32(0)
                            if flag[0] == 1:
                                for k in T.serial(rank[s]):
                                    acc[0] += h[k] * T.cast(
                                        arena[base + T.cast(b_off[s, m, k], "int64") + T.cast(o, "int64")],
                                        "float32")
                            y[bx, o] = T.cast(acc[0], dtype)

    return lora_gather_gpu if gpu else lora_gather_cpu


class GatherTir(LoraStage):
    """Stage 2 on any target: per module, delta = lora_gather_kernel(x); y + the deltas."""

    stage, backend = "gather", "tir"

    def supported(self, target, dtype, max_rank, num_parts, rows="model"):
        if rows != "model":
            return f"{rows} adapter rows (the sgmv stage reads them)"
        return None  # plain TIR: every target, dtype, rank and fused linear

    def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        bb, t, n, in_f, dtype = ctx.builder, tables, tokens(x), int(x.ty.shape.values[-1]), str(base.ty.dtype)
        y = bb.emit(base)  # (the TIR stages' order does not matter)

        def delta(p: Part) -> relax.Var:
            gv = ctx.kernel(("gather", in_f, p.width, p.module, dtype), f"lora_gather_m{p.module}_{in_f}x{p.width}",
                            lambda: lora_gather_kernel(in_f, p.width, p.module, ctx.num_layers, ctx.max_rank,
                                                       ctx.num_modules, dtype, ctx.target))
            return bb.emit(relax.call_tir(gv, [x, t["lora_arena"], t["lora_token_slot"], t["lora_rank"],
                                               t["lora_scale"], t["lora_a_off"], t["lora_b_off"], layer_arg(layer)],
                                          relax.TensorType([n, p.width], dtype)))

        return add_module_deltas(ctx, y, x, parts, delta)


STAGE = GatherTir()
