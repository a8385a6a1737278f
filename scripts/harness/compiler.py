"""The compiler pieces the benchmarks' `compile` sub-commands build from: the one place the scripts
import mlc_lora.compiler_passes. Import this module only where a script compiles (the GPU
machine's runtime-only TVM has no compiler).
"""

from __future__ import annotations

from pathlib import Path

import tvm

from mlc_lora.compile import prepare_cuda_build
from mlc_lora.compiler_passes import get_pipeline  # noqa: F401  pylint: disable=unused-import
from mlc_lora.compiler_passes.ops.attention import attention_cuda  # noqa: F401  pylint: disable=unused-import
from mlc_lora.compiler_passes.ops.gemv import gemv_cuda  # noqa: F401  pylint: disable=unused-import
from mlc_lora.compiler_passes.ops.lora import (  # noqa: F401  pylint: disable=unused-import
    gather_tir, sgmv_cuda, sgmv_tir, sgmv_triton)
from mlc_lora.compiler_passes.passes.dispatch_cublas import GEMV_MAX_ROWS  # noqa: F401  pylint: disable=unused-import

ARCH = "sm_90a"  # the H200's


def target(kind: str = "cuda") -> tvm.target.Target:
    """The target of the benchmark libraries: CUDA for ARCH (built here with nvcc, no GPU needed)
    or llvm (the CPU dry runs)."""
    if kind == "cuda":
        prepare_cuda_build()
        return tvm.target.Target({"kind": "cuda", "arch": ARCH}, host="llvm")
    if kind == "llvm":
        return tvm.target.Target("llvm")
    raise ValueError(f"unknown target {kind!r}: cuda or llvm")


def build_library(funcs: dict, out: Path, tgt: tvm.target.Target, imports=()) -> Path:
    """One shared library exporting each prim_func of `funcs` under its key, with the modules of
    `imports` (e.g. hand-written CUDA kernels the functions launch) linked in."""
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    with tgt:
        ex = tvm.compile(mod, target=tgt)
    for m in imports:
        ex.mod.import_module(m)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ex.export_library(str(out))
    return out
