"""Stage 3 (`sgmv`) on CUDA as hand-written kernels (cuda/lora_sgmv.cu): the TIR wrappers that
launch them, with the TIR kernels' signatures and semantics (lora_sgmv.py, whose numpy
references `lora_sgmv_shrink_ref` / `lora_sgmv_expand_ref` the tests compare both with).

Semantics (as lora_sgmv.py):
  shrink: v[t, c, k] = scale[s, m] * sum_{i in chunk c} x[t, i] * A[s, m][k, i] for
          s = slot[t] >= 0, k < rank[s]; 0 elsewhere; v (n, C, R) float32, C = ceil(in / 512).
  expand: delta[t] = sum_{k < rank[s]} (sum_c v[t, c, k]) * B[s, m].T[k] for s = slot[t] >= 0,
          else 0; delta (n, out).

What they do better than the TIR kernels: a block owns a tile of 16 tokens and reads each A/B
row once per distinct slot of the tile (16-byte loads), instead of once per token; the grid is
(ceil(n / 16), C, z) and (ceil(n / 16), ceil(out / 512), z), z in 1..8 splitting a tile's
rows over more blocks when there are few tiles: token count and layer shape only.
"""

from __future__ import annotations

from pathlib import Path

from tvm.script import tirx as T

from . import cuda_source
from .lora_kernels import _attrs
from .lora_sgmv import num_chunks

SOURCE = Path(__file__).parent / "cuda" / "lora_sgmv.cu"
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
MAX_RANK = 128  # the .cu sizes shared memory for R <= 128
TILE = 16  # tokens per block (TILE in lora_sgmv.cu)
SHRINK_THREADS, EXPAND_THREADS, EXPAND_OUT = 128, 64, 512
TARGET_BLOCKS = 528  # 4 per H200 SM: below that, gridDim.z splits a tile's rows over more blocks
MAX_SPLIT = 8


def _split(blocks):
    """gridDim.z for `blocks` (tile, chunk) or (tile, out tile) pairs: a function of the token
    count and the layer shape only."""
    return T.Cast("int32", T.max(1, T.min(MAX_SPLIT, (TARGET_BLOCKS + blocks - 1) // blocks)))


def supported(dtype: str, max_rank: int) -> str | None:
    """None when these kernels can run stage 3 of a model, else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if not 1 <= max_rank <= MAX_RANK:
        return f"max rank {max_rank} (the kernels are built for 1..{MAX_RANK})"
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
    defines = {"MLC_MAX_RANK": max_rank, "MLC_SUFFIX": f"{DTYPES[dtype]}_r{max_rank}"}
    if dtype == "bfloat16":
        defines["MLC_BF16"] = None
    cubin = cuda_source.build_cubin(SOURCE, arch, defines)
    ptr, i32, i64 = "handle", "int32", "int64"
    return cuda_source.cuda_module(cubin, {
        shrink: [ptr] * 7 + [i32, i32, i32, i32, i64],
        expand: [ptr] * 6 + [i32, i32, i32, i32, i32, i64],
    })


def shrink_wrapper(in_f: int, m: int, num_layers: int, max_rank: int, num_modules: int, dtype: str):
    """Signature: (x (n, in_f), arena (size,), slot (n,), rank (S,), scale (S, M), a_off (S, M, R),
    layer: int64, v (n, C, R) float32 [out]): lora_sgmv_shrink_kernel's."""
    R, M, L, C = max_rank, num_modules, num_layers, num_chunks(in_f)
    name = kernel_names(dtype, max_rank)[0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)  # as the TIR kernels (and as relax.BlockBuilder.add_func leaves them)
    def sgmv_shrink_cuda(x_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                         scale_h: T.handle, aoff_h: T.handle, layer: T.int64, v_h: T.handle):
        T.func_attr(_attrs(True))
        n, S, size = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, C, R), "float32")
        if n > 0:
            T.call_packed(name, x.data, arena.data, slot.data, rank.data, scale.data, a_off.data,
                          v.data, T.Cast("int32", n), in_f, m, M, layer * (size // L),
                          T.Cast("int32", (n + TILE - 1) // TILE), C, _split((n + TILE - 1) // TILE * C),
                          SHRINK_THREADS)

    return sgmv_shrink_cuda


def expand_wrapper(in_f: int, out_f: int, m: int, num_layers: int, max_rank: int, num_modules: int,
                   dtype: str):
    """Signature: (v (n, C, R) float32, arena (size,), slot (n,), rank (S,), b_off (S, M, R),
    layer: int64, delta (n, out_f) [out]): lora_sgmv_expand_kernel's."""
    R, M, L, C = max_rank, num_modules, num_layers, num_chunks(in_f)
    name = kernel_names(dtype, max_rank)[1]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)  # as the TIR kernels (and as relax.BlockBuilder.add_func leaves them)
    def sgmv_expand_cuda(v_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                         boff_h: T.handle, layer: T.int64, y_h: T.handle):
        T.func_attr(_attrs(True))
        n, S, size = T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, C, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, out_f), dtype)
        if n > 0:
            T.call_packed(name, v.data, arena.data, slot.data, rank.data, b_off.data, y.data,
                          T.Cast("int32", n), C, out_f, m, M, layer * (size // L),
                          T.Cast("int32", (n + TILE - 1) // TILE), (out_f + EXPAND_OUT - 1) // EXPAND_OUT,
                          _split((n + TILE - 1) // TILE * ((out_f + EXPAND_OUT - 1) // EXPAND_OUT)),
                          EXPAND_THREADS)

    return sgmv_expand_cuda
