"""TIR kernels that the LoRA rewrite inserts, each beside its plain numpy reference.

All kernels read adapter rows straight out of the unified page arena (docs/DESIGN.md):
row `k` of `A[s, m]` in layer `l` is `arena[l*P*E + a_off[s, m, k] : ... + in_m]`, row `k` of
`B[s, m]^T` is `arena[l*P*E + b_off[s, m, k] : ... + out_m]`; `P*E = arena.size // L`.
Index arithmetic is 64-bit. Ranks below R are not padded: loops stop at `rank[s]`.

Kernels for GPU targets are hand-scheduled (thread-bound, `tirx.is_scheduled`) and opaque
(`op_pattern` 8) so that FuseOps leaves them alone: dlight's Fallback cannot schedule a
gather-reduction. `layer` is a scalar argument so that one kernel serves every layer.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

OPAQUE = 8  # relax OpPatternKind kOpaque
_GPU_THREADS = 128
_WARP = 32


def _is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def _attrs(gpu: bool) -> dict:
    return {"tirx.is_scheduled": True, "op_pattern": OPAQUE} if gpu else {"op_pattern": OPAQUE}


# ---------------------------------------------------------------------------------------------
# Stage 2 (`gather`): one naive per-token gather kernel per module.


def lora_gather_ref(x, arena, layer, num_layers, slot, rank, scale, a_off, b_off, m, out_f):
    """Semantics: delta[t] = scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T for s = slot[t] >= 0,
    else 0; x (n, in_m) -> delta (n, out_m); A, B read from the arena rows of layer `layer`."""
    n, in_f = x.shape
    base = layer * (arena.size // num_layers)
    delta = np.zeros((n, out_f), np.float32)
    for t in range(n):
        s = slot[t]
        if s < 0:
            continue
        for k in range(rank[s]):
            a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + in_f].astype(np.float32)
            b = arena[base + b_off[s, m, k]: base + b_off[s, m, k] + out_f].astype(np.float32)
            delta[t] += scale[s, m] * float(x[t].astype(np.float32) @ a) * b
    return delta.astype(x.dtype)


def lora_gather_kernel(in_f: int, out_f: int, m: int, num_layers: int, max_rank: int,
                       num_modules: int, dtype: str, target: tvm.target.Target):
    """The stage-2 kernel of module `m`; reference: `lora_gather_ref`.

    Semantics: delta[t] = scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T for s = slot[t] >= 0, else 0;
    the pass adds delta to the base output y[t] (and loops k < rank[s] only).

    Signature: (x (n, in_f), arena (size,), slot (n,), rank (S,), scale (S, M), a_off (S, M, R),
    b_off (S, M, R), layer: int64, delta (n, out_f) [out]).
    """
    R, M, L = max_rank, num_modules, num_layers
    gpu = _is_gpu(target)
    attrs = _attrs(gpu)

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
    NT, NW = _GPU_THREADS, _GPU_THREADS // _WARP

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
                    lane: T.let[T.int32] = T.cast(tx, "int32") % _WARP
                    warp: T.let[T.int32] = T.cast(tx, "int32") // _WARP
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
                                for ii in T.serial(T.ceildiv(in_f, _WARP)):
                                    i: T.let[T.int32] = ii * _WARP + lane
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


# ---------------------------------------------------------------------------------------------
# Stage 1 (`single`): gather the batch's one adapter (slot 0) into dense A and scale*B^T; the
# pass then runs two dense matmuls. Rows past rank[0] are zero (a dense GEMM has a fixed R).


def lora_dense_rows_ref(arena, layer, num_layers, rank, scale, a_off, b_off, m, in_f, out_f, max_rank):
    """Semantics: A[k] = A[0, m] row k, Bs[k] = scale[0, m] * B[0, m]^T row k for k < rank[0];
    zero rows for k >= rank[0] or when there is no slot (S == 0). A (R, in_m), Bs (R, out_m)."""
    base = layer * (arena.size // num_layers)
    a = np.zeros((max_rank, in_f), arena.dtype)
    b = np.zeros((max_rank, out_f), arena.dtype)
    if len(rank) == 0:
        return a, b
    for k in range(rank[0]):
        a[k] = arena[base + a_off[0, m, k]: base + a_off[0, m, k] + in_f]
        b[k] = (scale[0, m] * arena[base + b_off[0, m, k]: base + b_off[0, m, k] + out_f]
                .astype(np.float32)).astype(arena.dtype)
    return a, b


def lora_dense_rows_kernel(in_f: int, out_f: int, m: int, num_layers: int, max_rank: int,
                           num_modules: int, dtype: str, target: tvm.target.Target):
    """The stage-1 row gather of module `m`; reference: `lora_dense_rows_ref`.

    Semantics: A[k] = A[0, m][k], Bs[k] = scale[0, m] * B[0, m].T[k] for k < rank[0], zero rows
    otherwise; the pass then adds ((x * (slot >= 0)) @ A.T) @ Bs to y, i.e. y[t] += scale[0, m] *
    (x[t] @ A[0, m].T) @ B[0, m].T for every token on slot 0 (stage 1: one slot per batch).

    Signature: (arena (size,), rank (S,), scale (S, M), a_off (S, M, R), b_off (S, M, R),
    layer: int64, A (R, in_f) [out], Bs (R, out_f) [out]).
    """
    R, M, L = max_rank, num_modules, num_layers
    gpu = _is_gpu(target)
    attrs = _attrs(gpu)
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
                    if k < rank[0]:
                        for i in T.serial(in_f):
                            A[k, i] = arena[base + T.cast(a_off[0, m, k], "int64") + i]
                        for o in T.serial(out_f):
                            B[k, o] = T.cast(scale[0, m] * T.cast(
                                arena[base + T.cast(b_off[0, m, k], "int64") + o], "float32"), dtype)

    NT = _GPU_THREADS

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
                            if bk < rank[0]:
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


KERNELS = {"gather": lora_gather_kernel, "single": lora_dense_rows_kernel}
