"""Stage 3 (`sgmv`) as TIR: fused shrink + expand kernels over the pool's pages, one pair per
module; references: reference.lora_sgmv_shrink_ref / lora_sgmv_expand_ref (semantics: reference.py).

Tokens come in any order with any slot (no sorting, no padding of the maths: loops stop at
`rank[s]`). The launch grid depends only on the token count and the layer shape, never on
which or how many adapters a batch uses, so decode can run under CUDA graphs.

Shrink splits `in_f` into chunks of `CHUNK` (one block per (token, chunk): enough blocks at
T = 1 to pull the A rows at full bandwidth) and writes fp32 partials; expand sums the partials
once per block and streams B^T rows coalesced along `out`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tvm
from tvm import relax
from tvm.script import tirx as T

from mlc_lora.contract import INT8_ROW_ALIGN

from ..kernel_attrs import is_gpu, kernel_attrs
from .reference import CHUNK, num_chunks
from .stage import LoraContext, LoraStage, Part, add_module_deltas, layer_arg, tokens

_NT = 128  # threads per block
_OV = 4  # outputs per expand thread


def lora_sgmv_shrink_kernel(in_f: int, m: int, num_layers: int, max_rank: int, num_modules: int,
                            dtype: str, target: tvm.target.Target, rows: str = "model"):
    """The stage-3 shrink of module `m`; reference: `reference.lora_sgmv_shrink_ref`.

    Semantics: v[t, c, k] = scale[s, m] * sum_{i in chunk c} x[t, i] * A[s, m][k, i] for
    s = slot[t] >= 0, k < rank[s]; 0 elsewhere (the expand sums over c). With `rows` "int8"
    (CPU only), A[s, m][k, i] = q_i * s_k of the row's int8 values and scale (layout.py): the sum
    over q, then times s_k.

    Signature: (x (n, in_f), arena (size,), slot (n,), rank (S,), scale (S, M), a_off (S, M, R),
    layer: int64, v (n, C, R) float32 [out]).
    """
    R, M, L, C = max_rank, num_modules, num_layers, num_chunks(in_f)
    gpu = is_gpu(target)
    attrs = kernel_attrs(gpu)
    q8, EB, LEAD = rows == "int8", tvm.DataType(dtype).bits // 8, INT8_ROW_ALIGN  # the scale: LEAD bytes before
    assert not (q8 and gpu), "int8 rows: the TIR kernels run on the CPU only"

    @T.prim_func(s_tir=True)
    def sgmv_shrink_cpu(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                        scale_h: T.handle, aoff_h: T.handle, layer: T.int64, v_h: T.handle):
        T.func_attr(attrs)
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, C, R), "float32")
        arena8 = T.decl_buffer((size * EB,), "int8", data=arena.data)  # int8 rows: their values
        arenaf = T.decl_buffer((size * EB // 4,), "float32", data=arena.data)  # ... and scales
        for t in T.parallel(n):
            with T.sblock("token"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float32")
                rk = T.sblock_alloc_buffer((1,), "int32")
                s: T.let[T.int32] = slot[t]
                base: T.let[T.int64] = layer * (size // L)
                rk[0] = 0
                if s >= 0:
                    if scale[s, m] != T.float32(0):
                        rk[0] = rank[s]
                for c in T.serial(C):
                    for k in T.serial(R):
                        acc[0] = T.float32(0)
                        if k < rk[0]:
                            off: T.let[T.int64] = base + T.cast(a_off[s, m, k], "int64")
                            for j in T.serial(CHUNK):
                                if c * CHUNK + j < in_f:
                                    if q8:
                                        acc[0] += T.cast(x[t, c * CHUNK + j], "float32") * T.cast(
                                            arena8[off * EB + c * CHUNK + j], "float32")
                                    else:
                                        acc[0] += T.cast(x[t, c * CHUNK + j], "float32") * T.cast(
                                            arena[off + c * CHUNK + j], "float32")
                            if q8:  # the row's scale
                                acc[0] = acc[0] * arenaf[(off * EB - LEAD) // 4]
                            acc[0] = acc[0] * scale[s, m]
                        v[t, c, k] = acc[0]

    NT = _NT
    NW = NT // 32

    # GPU: block (t, c); thread tx keeps R fp32 accumulators (registers: the rank loop is unrolled
    # with a k < rank guard) over the elements c*CHUNK + tx + NT*j, so each A row is read
    # coalesced and x[t, i] once; warp shuffles reduce, then one shared step across the warps.
    @T.prim_func(s_tir=True)
    def sgmv_shrink_gpu(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                        scale_h: T.handle, aoff_h: T.handle, layer: T.int64, v_h: T.handle):
        T.func_attr(attrs)
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, C, R), "float32")
        for bx in T.thread_binding(n, thread="blockIdx.x"):
            for bc in T.thread_binding(C, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("shrink"):
                        T.reads()
                        T.writes()
                        red = T.sblock_alloc_buffer((R, NW), "float32", scope="shared")
                        hs = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        mask = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                        acc = T.sblock_alloc_buffer((R,), "float32", scope="local")
                        offs = T.sblock_alloc_buffer((R,), "int64", scope="local")
                        rk = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        s: T.let[T.int32] = slot[bx]
                        base: T.let[T.int64] = layer * (size // L)
                        lane: T.let[T.int32] = T.cast(tx, "int32") % 32
                        warp: T.let[T.int32] = T.cast(tx, "int32") // 32
                        mask[0] = T.tvm_warp_activemask()
                        rk[0] = 0
                        if s >= 0:
                            if scale[s, m] != T.float32(0):
                                rk[0] = rank[s]
                        for k in T.unroll(R):
                            acc[k] = T.float32(0)
                            offs[k] = T.int64(0)
                            if k < rk[0]:
                                offs[k] = base + T.cast(a_off[s, m, k], "int64")
                        # Full chunks run unguarded (a per-element bound check in the unrolled
                        # body serializes the loads); only the last, partial chunk checks i < in_f.
                        if rk[0] > 0 and bc * CHUNK + CHUNK <= in_f:
                            for j in T.unroll(CHUNK // NT):
                                i: T.let[T.int32] = bc * CHUNK + j * NT + T.cast(tx, "int32")
                                xv: T.let[T.float32] = T.cast(x[bx, i], "float32")
                                for k in T.unroll(R):
                                    if k < rk[0]:
                                        acc[k] += xv * T.cast(arena[offs[k] + T.cast(i, "int64")], "float32")
                        elif rk[0] > 0:
                            for j in T.serial(CHUNK // NT):
                                i: T.let[T.int32] = bc * CHUNK + j * NT + T.cast(tx, "int32")
                                if i < in_f:
                                    xv: T.let[T.float32] = T.cast(x[bx, i], "float32")
                                    for k in T.unroll(R):
                                        if k < rk[0]:
                                            acc[k] += xv * T.cast(arena[offs[k] + T.cast(i, "int64")],
                                                                  "float32")
                        # Warp shuffles reduce each lane's R sums; lane 0 of warp w writes red[k, w].
                        for k in T.unroll(R):
                            if k < rk[0]:
                                for st in T.unroll(5):
                                    acc[k] = acc[k] + T.tvm_warp_shuffle_down(
                                        mask[0], acc[k], 16 >> st, 32, 32)
                                if lane == 0:
                                    red[k, warp] = acc[k]
                        T.tvm_storage_sync("shared")
                        for kk in T.serial(T.ceildiv(R, NT)):
                            k: T.let[T.int32] = kk * NT + T.cast(tx, "int32")
                            if k < R:
                                hs[0] = T.float32(0)
                                if k < rk[0]:
                                    for w in T.unroll(NW):
                                        hs[0] += red[k, w]
                                    hs[0] = hs[0] * scale[s, m]
                                v[bx, bc, k] = hs[0]

    return sgmv_shrink_gpu if gpu else sgmv_shrink_cpu


def lora_sgmv_expand_kernel(in_f: int, out_f: int, m: int, num_layers: int, max_rank: int,
                            num_modules: int, dtype: str, target: tvm.target.Target, rows: str = "model"):
    """The stage-3 expand of module `m`; reference: `reference.lora_sgmv_expand_ref`.

    Semantics: delta[t] = sum_{k < rank[s]} (sum_c v[t, c, k]) * B[s, m].T[k] for s = slot[t] >= 0
    with rows for m (b_off[s, m, 0] >= 0), else 0 (the shrink already applied scale[s, m] and wrote
    0 where the module is not targeted; such a module's offsets are -1, and its "rows" would be
    whatever precedes the layer region, NaN included: 0 * NaN is NaN, so none is read). With
    `rows` "int8" (CPU only), B^T[k, o] = q_o * s_k of the row's int8 values and scale.

    Signature: (v (n, C, R) float32, arena (size,), slot (n,), rank (S,), b_off (S, M, R),
    layer: int64, delta (n, out_f) [out]).
    """
    R, M, L, C = max_rank, num_modules, num_layers, num_chunks(in_f)
    gpu = is_gpu(target)
    attrs = kernel_attrs(gpu)
    q8, EB, LEAD = rows == "int8", tvm.DataType(dtype).bits // 8, INT8_ROW_ALIGN  # the scale: LEAD bytes before
    assert not (q8 and gpu), "int8 rows: the TIR kernels run on the CPU only"

    @T.prim_func(s_tir=True)
    def sgmv_expand_cpu(v_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                        boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(attrs)
        n, S, size = T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, C, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, out_f), dtype)
        arena8 = T.decl_buffer((size * EB,), "int8", data=arena.data)  # int8 rows: their values
        arenaf = T.decl_buffer((size * EB // 4,), "float32", data=arena.data)  # ... and scales
        for t in T.parallel(n):
            with T.sblock("token"):
                T.reads()
                T.writes()
                h = T.sblock_alloc_buffer((R,), "float32")
                acc = T.sblock_alloc_buffer((1,), "float32")
                rk = T.sblock_alloc_buffer((1,), "int32")
                s: T.let[T.int32] = slot[t]
                base: T.let[T.int64] = layer * (size // L)
                rk[0] = 0
                if s >= 0:
                    if b_off[s, m, 0] >= 0:
                        rk[0] = rank[s]
                for k in T.serial(R):
                    h[k] = T.float32(0)
                    for c in T.serial(C):
                        h[k] += v[t, c, k]
                for o in T.serial(out_f):
                    acc[0] = T.float32(0)
                    for k in T.serial(rk[0]):
                        if q8:  # h times the row's scale, times its int8 values
                            acc[0] += h[k] * arenaf[((base + T.cast(b_off[s, m, k], "int64")) * EB - LEAD) // 4] * T.cast(
                                arena8[(base + T.cast(b_off[s, m, k], "int64")) * EB + o], "float32")
                        else:
                            acc[0] += h[k] * T.cast(arena[base + T.cast(b_off[s, m, k], "int64") + o], "float32")
                    y[t, o] = T.cast(acc[0], dtype)

    NT, OT = _NT, _NT * _OV

    # GPU: block (t, out tile of NT*OV); threads sum the chunk partials into shared h, then each
    # thread owns OV outputs strided by NT, so every B^T row is read coalesced.
    @T.prim_func(s_tir=True)
    def sgmv_expand_gpu(v_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                        boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(attrs)
        n, S, size = T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, C, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, out_f), dtype)
        for bx in T.thread_binding(n, thread="blockIdx.x"):
            for bo in T.thread_binding(T.ceildiv(out_f, OT), thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("expand"):
                        T.reads()
                        T.writes()
                        h = T.sblock_alloc_buffer((R,), "float32", scope="shared")
                        hs = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((_OV,), "float32", scope="local")
                        rk = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        s: T.let[T.int32] = slot[bx]
                        base: T.let[T.int64] = layer * (size // L)
                        rk[0] = 0
                        if s >= 0:
                            if b_off[s, m, 0] >= 0:
                                rk[0] = rank[s]
                        for kk in T.serial(T.ceildiv(R, NT)):
                            k: T.let[T.int32] = kk * NT + T.cast(tx, "int32")
                            if k < rk[0]:
                                hs[0] = T.float32(0)
                                for c in T.serial(C):
                                    hs[0] += v[bx, c, k]
                                h[k] = hs[0]
                        T.tvm_storage_sync("shared")
                        for j in T.unroll(_OV):
                            acc[j] = T.float32(0)
                        # Unrolled with a guard (not a rank-bounded loop) so all R*OV loads are in
                        # flight at once: a serial loop waits one HBM latency per row.
                        for k in T.unroll(R):
                            if k < rk[0]:
                                off: T.let[T.int64] = base + T.cast(b_off[s, m, k], "int64")
                                hk: T.let[T.float32] = h[k]
                                for j in T.unroll(_OV):
                                    o: T.let[T.int32] = bo * OT + j * NT + T.cast(tx, "int32")
                                    if o < out_f:
                                        acc[j] += hk * T.cast(arena[off + T.cast(o, "int64")], "float32")
                        for j in T.unroll(_OV):
                            o: T.let[T.int32] = bo * OT + j * NT + T.cast(tx, "int32")
                            if o < out_f:
                                y[bx, o] = T.cast(acc[j], dtype)

    return sgmv_expand_gpu if gpu else sgmv_expand_cpu


class SgmvTir(LoraStage):
    """Stage 3 on any target: per module, v = shrink(x) and delta = expand(v); y + the deltas."""

    stage, backend = "sgmv", "tir"

    def supported(self, target, dtype, max_rank, num_parts, rows="model"):
        if rows == "int8" and is_gpu(target):
            return "int8 adapter rows on a GPU (the TIR kernels read them on the CPU; on CUDA: triton)"
        return None  # plain TIR: every target, dtype, rank and fused linear

    def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        bb, t, n, R = ctx.builder, tables, tokens(x), ctx.max_rank
        y = bb.emit(base)  # (the TIR stages' order does not matter)
        in_f, dtype = int(x.ty.shape.values[-1]), str(base.ty.dtype)
        L, M = ctx.num_layers, ctx.num_modules

        def delta(p: Part) -> relax.Var:
            m, w = p.module, p.width
            shrink = ctx.kernel(("sgmv", "shrink", in_f, 0, m, dtype), f"lora_sgmv_shrink_m{m}_{in_f}",
                                lambda: lora_sgmv_shrink_kernel(in_f, m, L, R, M, dtype, ctx.target, ctx.rows))
            expand = ctx.kernel(("sgmv", "expand", in_f, w, m, dtype), f"lora_sgmv_expand_m{m}_{in_f}x{w}",
                                lambda: lora_sgmv_expand_kernel(in_f, w, m, L, R, M, dtype, ctx.target, ctx.rows))
            v = bb.emit(relax.call_tir(shrink, [x, t["lora_arena"], t["lora_token_slot"], t["lora_rank"],
                                                t["lora_scale"], t["lora_a_off"], layer_arg(layer)],
                                       relax.TensorType([n, num_chunks(in_f), R], "float32")))
            return bb.emit(relax.call_tir(expand, [v, t["lora_arena"], t["lora_token_slot"], t["lora_rank"],
                                                   t["lora_b_off"], layer_arg(layer)],
                                          relax.TensorType([n, w], dtype)))

        return add_module_deltas(ctx, y, x, parts, delta)


STAGE = SgmvTir()
