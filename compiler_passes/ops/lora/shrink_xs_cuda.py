"""The rank columns route's shrink into [x | s] on hand-written CUDA (shrink_xs.cu beside this file):
linear_triton.lora_shrink_xs_kernel's semantics, on tensor cores with its operands loaded straight
into registers, and only the rank columns of the slots a tile's tokens use (shrink_xs.cu's header
says how). `shrink_xs_ref` is its numpy reference; the tests run the .cu source on the CPU emulation
(tests/python/compiler/cuda_emu/) against it.

Semantics: xe (n, KE) = [x | s], x in its first K columns (its producer wrote it there); for token
t on slot j = slot[t] >= 0 and part p of module m = mods[p] >= 0 with scale[j, m] != 0:
s[t, p * RS + c] = round(scale[j, m] * x[t] . A[j, m][kc(c)]) for the rank columns c of slot j
(linear_triton's rank columns: the slots' ranks side by side, RS = RANK_COLUMNS); every other
column of s, and the padding up to KE, is 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .. import cuda_build
from ..kernel_attrs import kernel_attrs
from .stage import RANK_COLUMNS, SLOT_COLUMNS

SOURCE = Path(__file__).parent / "shrink_xs.cu"
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
BM, THREADS, WARPS, KSTEP = 16, 128, 4, 16  # shrink_xs.cu's tile height, threads, warps, inputs per MMA
MAX_PARTS = 3
# Input splits: as many as bring the blocks to about TARGET_BLOCKS (4 per SM of an H100/H200: the
# P = 3 kernel's 122 registers allow 4), each warp keeping at least MIN_WARP_STEPS input steps, at
# most MAX_SPLIT (linear_triton.scratch_elems holds that many splits' partial sums).
TARGET_BLOCKS, MIN_WARP_STEPS, MAX_SPLIT = 528, 2, 16


def supported(dtype: str, in_f: int, num_parts: int) -> str | None:
    """None when these kernels can run the linear's shrink, else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if in_f % KSTEP:
        return f"{in_f} inputs (a multiple of {KSTEP})"
    if not 1 <= num_parts <= MAX_PARTS:
        return f"a linear of {num_parts} parts (the kernels take 1..{MAX_PARTS})"
    return None


def kernel_name(dtype: str, num_parts: int) -> str:
    return f"mlc_lora_shrink_xs_{DTYPES[dtype]}_p{num_parts}"


def build_module(dtype: str, arch: str):
    """The CUDA module of the three kernels (1..3 parts) for `dtype`, built by nvcc for `arch`."""
    defines = {"MLC_RANK_COLUMNS": RANK_COLUMNS, "MLC_SLOT_COLUMNS": SLOT_COLUMNS}
    if dtype == "bfloat16":
        defines["MLC_BF16"] = None
    cubin = cuda_build.build_cubin(SOURCE, arch, defines)
    ptr, i32, i64 = "handle", "int32", "int64"
    # arena, slot, rank, scale, a_off, xe, part, cnt; n, S, K, KE, M, R, m0, m1, m2, split; base
    sig = [ptr] * 8 + [i32] * 10 + [i64]
    return cuda_build.cuda_module(cubin, {kernel_name(dtype, p): sig for p in range(1, MAX_PARTS + 1)}, arch)


def split_for(n, in_f: int, target: int = TARGET_BLOCKS, lo=max, hi=min):
    """(token tiles, input splits) of a launch for n tokens: splits until about `target` blocks,
    at most MAX_SPLIT, each warp at least MIN_WARP_STEPS input steps. Python ints, or TIR
    expressions with lo/hi = T.max/T.min."""
    tiles = (n + BM - 1) // BM
    most = max(1, min(MAX_SPLIT, in_f // KSTEP // (WARPS * MIN_WARP_STEPS)))
    return tiles, hi(most, lo(1, (target + tiles - 1) // tiles))


def scratch_floats(n: int, num_parts: int, target: int = TARGET_BLOCKS) -> int:
    """fp32 elements of the split partial sums for n tokens (the most any launch writes)."""
    return min(MAX_SPLIT, target) * n * num_parts * RANK_COLUMNS


def rank_columns(rank, max_rank: int):
    """(slot jc, row kc) of each rank column (jc = SLOT_COLUMNS: no slot), as the kernels find them."""
    rk = np.zeros(SLOT_COLUMNS, np.int64)
    rk[:min(len(rank), SLOT_COLUMNS)] = np.clip(np.asarray(rank)[:SLOT_COLUMNS], 0, max_rank)
    end = np.cumsum(rk)
    jc = np.array([int(np.sum(end <= c)) for c in range(RANK_COLUMNS)])
    start = end - rk
    kc = np.array([c - start[j] if j < SLOT_COLUMNS else 0 for c, j in enumerate(jc)])
    return jc, kc


def shrink_xs_ref(x, arena, base, slot, rank, scale, a_off, mods: Sequence[int], max_rank: int, cols: int):
    """Semantics in float64: s (n, cols), the columns beside x in [x | s] (P * RANK_COLUMNS of them,
    then the padding)."""
    n, K = x.shape
    jc, kc = rank_columns(rank, max_rank)
    s = np.zeros((n, cols))
    xf = x.astype(np.float64)
    for p, m in enumerate(mods):
        for c in range(RANK_COLUMNS):
            j = int(jc[c])
            if j >= SLOT_COLUMNS or m < 0 or scale[min(j, len(scale) - 1), m] == 0:
                continue
            off = base + int(a_off[j, m, min(int(kc[c]), max_rank - 1)])
            a = arena[off:off + K].astype(np.float64)
            on = slot == j
            s[on, p * RANK_COLUMNS + c] = float(scale[j, m]) * (xf[on] @ a)
    return s


def wrapper(in_f: int, cols: int, mods: Sequence[int], num_layers: int, max_rank: int, num_modules: int,
            dtype: str, target: int = TARGET_BLOCKS):
    """Signature: (arena (size,), slot (n,), rank (S,), scale (S, M), a_off (S, M, R), xe (n, in_f +
    cols) [in: x; out: s beside it], part (w,) float32, cnt (c,) int32 [workspace: counters zero
    before the first call, left zero after each], layer: int64); part p is module mods[p] (-1: none)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel  (the GPU machine's TVM runs without it)

    why = supported(dtype, in_f, len(mods))
    if why is not None:
        raise ValueError(f"no CUDA shrink into [x | s] for {why}")
    if cols < len(mods) * RANK_COLUMNS:
        raise ValueError(f"[x | s] needs at least {len(mods) * RANK_COLUMNS} columns beside x, got {cols}")
    R, M, L, P, KE = max_rank, num_modules, num_layers, len(mods), in_f + cols
    m0, m1, m2 = (list(mods) + [-1] * MAX_PARTS)[:MAX_PARTS]
    name = kernel_name(dtype, P)

    def split(n):
        return split_for(n, in_f, target, lambda a, b: T.max(T.int64(a), b), lambda a, b: T.min(T.int64(a), b))

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def shrink_xs_cuda(arena_h: T.handle, slot_h: T.handle, rank_h: T.handle, scale_h: T.handle,
                       aoff_h: T.handle, xe_h: T.handle, part_h: T.handle, cnt_h: T.handle, layer: T.int64):
        T.func_attr(kernel_attrs(True))
        n, S, size, w, c = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        xe = T.match_buffer(xe_h, (n, KE), dtype)
        part = T.match_buffer(part_h, (w,), "float32")
        cnt = T.match_buffer(cnt_h, (c,), "int32")
        if n > 0:
            T.call_packed(name, arena.data, slot.data, rank.data, scale.data, a_off.data, xe.data, part.data,
                          cnt.data, T.Cast("int32", n), T.Cast("int32", S), in_f, KE, M, R, m0, m1, m2,
                          T.Cast("int32", split(n)[1]), layer * (size // L),
                          T.Cast("int32", split(n)[0]), T.Cast("int32", split(n)[1]), 1, THREADS)

    return shrink_xs_cuda
