"""Stage 1 (`single`) as TIR: gather the batch's one adapter (slot 0) into dense A and scale*B^T
per module, then two dense matmuls. Rows past rank[0], and every row of a module the adapter does
not target (scale 0: its pages hold no rows for it), are zero (a dense GEMM has a fixed R).
Reference: reference.lora_dense_rows_ref (semantics: reference.py).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tvm
from tvm import relax
from tvm.script import tirx as T

from ..kernel_attrs import is_gpu, kernel_attrs
from .stage import LoraContext, LoraStage, Part, add_module_deltas, layer_arg, tokens

GPU_THREADS = 128


def lora_dense_rows_kernel(in_f: int, out_f: int, m: int, num_layers: int, max_rank: int,
                           num_modules: int, dtype: str, target: tvm.target.Target):
    """The stage-1 row gather of module `m`; reference: `reference.lora_dense_rows_ref`.

    Semantics: A[k] = A[0, m][k], Bs[k] = scale[0, m] * B[0, m].T[k] for k < rank[0] where
    scale[0, m] != 0, zero rows otherwise (an untargeted module's offsets point at no rows: reading
    them would put whatever the pages hold into x @ A.T, and 0 * inf is NaN); the pass then adds
    ((x * (slot >= 0)) @ A.T) @ Bs to y, i.e. y[t] += scale[0, m] * (x[t] @ A[0, m].T) @ B[0, m].T
    for every token on slot 0 (stage 1: one slot per batch).

    Signature: (arena (size,), rank (S,), scale (S, M), a_off (S, M, R), b_off (S, M, R),
    layer: int64, A (R, in_f) [out], Bs (R, out_f) [out]).
    """
    R, M, L = max_rank, num_modules, num_layers
    gpu = is_gpu(target)
    attrs = kernel_attrs(gpu)
    width = max(in_f, out_f)

    @T.prim_func(s_tir=True)
    def lora_dense_rows_cpu(arena_h: T.handle, rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle,
                            boff_h: T.handle, layer: T.int64, a_h: T.handle, b_h: T.handle):
        T.func_attr(attrs)
        S, size = T.int64(), T.int64()
        arena = T.match_buffer(arena_h, (size,), dtype)
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        A = T.match_buffer(a_h, (R, in_f), dtype)
        B = T.match_buffer(b_h, (R, out_f), dtype)
        for k in T.parallel(R):
            with T.sblock("row"):
                T.reads()
                T.writes()
                base: T.let[T.int64] = layer * (size // L)
                for i in T.serial(in_f):
                    A[k, i] = T.cast(0, dtype)
                for o in T.serial(out_f):
                    B[k, o] = T.cast(0, dtype)
                if S > 0:
                    if k < rank[0] and scale[0, m] != T.float32(0):
                        for i in T.serial(in_f):
                            A[k, i] = arena[base + T.cast(a_off[0, m, k], "int64") + i]
                        for o in T.serial(out_f):
                            B[k, o] = T.cast(scale[0, m] * T.cast(
                                arena[base + T.cast(b_off[0, m, k], "int64") + o], "float32"), dtype)

    NT = GPU_THREADS

    @T.prim_func(s_tir=True)
    def lora_dense_rows_gpu(arena_h: T.handle, rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle,
                            boff_h: T.handle, layer: T.int64, a_h: T.handle, b_h: T.handle):
        T.func_attr(attrs)
        S, size = T.int64(), T.int64()
        arena = T.match_buffer(arena_h, (size,), dtype)
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        A = T.match_buffer(a_h, (R, in_f), dtype)
        B = T.match_buffer(b_h, (R, out_f), dtype)
        # Block (k, chunk) copies a slice of row k of A and of B^T; threads stride the columns.
        for bk in T.thread_binding(R, thread="blockIdx.y"):
            for bc in T.thread_binding(T.ceildiv(width, NT), thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("row"):
                        T.reads()
                        T.writes()
                        base: T.let[T.int64] = layer * (size // L)
                        c: T.let[T.int32] = bc * NT + tx
                        flag = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        flag[0] = 0
                        if S > 0:
                            if bk < rank[0] and scale[0, m] != T.float32(0):
                                flag[0] = 1
                        if c < in_f:
                            A[bk, c] = T.cast(0, dtype)
                            if flag[0] == 1:
                                A[bk, c] = arena[base + T.cast(a_off[0, m, bk], "int64") + T.cast(c, "int64")]
                        if c < out_f:
                            B[bk, c] = T.cast(0, dtype)
                            if flag[0] == 1:
                                B[bk, c] = T.cast(scale[0, m] * T.cast(
                                    arena[base + T.cast(b_off[0, m, bk], "int64") + T.cast(c, "int64")],
                                    "float32"), dtype)

    return lora_dense_rows_gpu if gpu else lora_dense_rows_cpu


class SingleTir(LoraStage):
    """Stage 1 on any target: x masked to the adapter tokens, then per module
    ((x @ A.T) @ Bs) with A, Bs from lora_dense_rows_kernel; y + the deltas."""

    stage, backend = "single", "tir"

    def supported(self, target, dtype, max_rank, num_parts, rows="model"):
        if rows != "model":
            return f"{rows} adapter rows (the sgmv stage reads them)"
        return None  # plain TIR and dense matmuls: every target, dtype, rank and fused linear

    def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        bb, t, n, R = ctx.builder, tables, tokens(x), ctx.max_rank
        y = bb.emit(base)  # (the TIR stages' order does not matter)
        in_f, dtype = int(x.ty.shape.values[-1]), str(base.ty.dtype)
        # (n, 1): 1 for tokens on an adapter slot, 0 for base-model tokens (slot -1), which get no
        # delta. Emitted per linear: a var kept across linears could belong to another dataflow block.
        on = relax.op.greater_equal(t["lora_token_slot"], relax.const(0, "int32"))
        mask = bb.emit(relax.op.reshape(relax.op.astype(on, dtype), relax.ShapeExpr([n, 1])))
        xm = bb.emit(relax.op.multiply(x, mask))

        def delta(p: Part) -> relax.Var:
            gv = ctx.kernel(("single", in_f, p.width, p.module, dtype), f"lora_single_m{p.module}_{in_f}x{p.width}",
                            lambda: lora_dense_rows_kernel(in_f, p.width, p.module, ctx.num_layers, ctx.max_rank,
                                                           ctx.num_modules, dtype, ctx.target))
            ab = bb.emit(relax.call_tir(gv, [t["lora_arena"], t["lora_rank"], t["lora_scale"], t["lora_a_off"],
                                             t["lora_b_off"], layer_arg(layer)],
                                        [relax.TensorType([R, in_f], dtype), relax.TensorType([R, p.width], dtype)]))
            a = bb.emit(relax.TupleGetItem(ab, 0))
            b = bb.emit(relax.TupleGetItem(ab, 1))
            h = bb.emit(relax.op.matmul(xm, relax.op.permute_dims(a)))
            return bb.emit(relax.op.matmul(h, b))

        return add_module_deltas(ctx, y, x, parts, delta)


STAGE = SingleTir()
