"""The gated MLP's activation `silu(gate) * up` over a gate|up linear's output, as one Triton kernel.

TVM's fused split/silu/multiply kernel reads the (n, 2I) output of gate|up and writes (n, I) at
about a third of the memory bandwidth (61 us at 1024 Llama-2-7B tokens on the H200 in a profiler
trace of a prefill step, where the 67 MB take ~20 us; this kernel added ~20 us to cuBLAS's gate|up
in `bench_lora_fused.py routes`: two methods, so the end-to-end before/after in
docs/BENCHMARKS.md is what decides). DispatchActivation puts it in that kernel's place on CUDA fp16/bf16,
in every function of a library, base or LoRA.

Semantics (y (n, 2I) = [gate | up], model dtype; h (n, I)):
  h[t, j] = round(silu(g) * u),  g = y[t, j], u = y[t, I + j] (as float32),
  silu(g) = g / (1 + exp(-g)), computed in float32 and rounded once to the model dtype.
Reference: `silu_mul_ref` below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import triton_build

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

DTYPES = ("float16", "bfloat16")
BM, WARPS = 32, 4  # tokens per block; 4 warps


def silu_mul_ref(y: np.ndarray) -> np.ndarray:
    """Semantics in float64: (n, 2I) -> (n, I)."""
    i = y.shape[-1] // 2
    g, u = y[..., :i].astype(np.float64), y[..., i:].astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u


def block_cols(inter: int) -> int | None:
    """Outputs per block for an intermediate size `inter` (None: the kernel cannot run it)."""
    return next((b for b in (256, 128, 64, 32, 16) if inter % b == 0), None)


def supported(dtype: str, inter: int) -> str | None:
    """None when the kernel runs this activation, else why not."""
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernel is float16/bfloat16)"
    if block_cols(inter) is None:
        return f"intermediate size {inter} (a multiple of 16)"
    return None


if triton is not None:

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_silu_mul", "y_ptr"))
    def silu_mul_kernel(y_ptr, h_ptr, n, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LDH: tl.constexpr):
        """Grid (token tiles, I / BN): h = silu(gate) * up, h's rows LDH apart (I; or the width of
        the rank columns route's [x | s], whose first I columns h is)."""
        triton_build.wait_for_producers()
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < n
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        p = y_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        g = tl.load(p, mask=rmask[:, None], other=0.0).to(tl.float32)
        u = tl.load(p + I, mask=rmask[:, None], other=0.0).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + rows[:, None].to(tl.int64) * LDH + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rmask[:, None])


def _signature(dtype: str) -> dict:
    e = triton_build.PTR[dtype]
    return dict(y_ptr=e, h_ptr=e, n="i32", I="constexpr", BM="constexpr", BN="constexpr", LDH="constexpr")


def build(inter: int, dtype: str, arch: str, ldh: int | None = None):
    """(kernel name, threads, shared bytes, TVM CUDA module) of the kernel for one intermediate size,
    h's rows `ldh` apart (default: inter)."""
    return triton_build.cuda_module(silu_mul_kernel, _signature(dtype),
                                    dict(I=inter, BM=BM, BN=block_cols(inter), LDH=ldh or inter), WARPS, arch,
                                    Path(__file__))


def wrapper(inter: int, dtype: str, arch: str):
    """(TIR wrapper (y (n, 2I), h (n, I) [out]), CUDA module)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    from .kernel_attrs import kernel_attrs  # pylint: disable=import-outside-toplevel

    name, threads, shared, mod = build(inter, dtype, arch)
    tiles = inter // block_cols(inter)

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def silu_mul_triton(y_h: T.handle, h_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n = T.int64()
        y = T.match_buffer(y_h, (n, 2 * inter), dtype)
        h = T.match_buffer(h_h, (n, inter), dtype)
        # a root block: Relax's reshape analysis (of a call with one input and one output) reads it
        with T.sblock("root"):
            T.reads(y[0:n, 0:2 * inter])
            T.writes(h[0:n, 0:inter])
            if n > 0:
                T.call_packed(name, y.data, h.data, T.Cast("int32", n), T.int64(0), T.int64(0),
                              T.Cast("int32", (n + BM - 1) // BM), tiles, threads, shared)

    return silu_mul_triton, mod
