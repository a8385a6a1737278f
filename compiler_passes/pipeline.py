"""The one list of passes that turns an exported model into a library for a target."""

from __future__ import annotations

import tvm
from tvm import relax

from .dispatch_cublas import DispatchCublas

GEMM_BACKENDS = ("cublas", "tvm")


def get_pipeline(target: tvm.target.Target, *, extra_passes: list | None = None,
                 gemm: str = "cublas") -> tvm.transform.Pass:
    """Our model-level passes, then TVM's default lowering for `target`.

    `extra_passes` run first, on the exported module, while linears are still
    `permute_dims(W)` + `matmul` (the LoRA rewrite matches that shape). `gemm` picks who runs the
    base linears on CUDA: "cublas" (our runtime's cuBLAS extern) or "tvm" (dlight kernels).
    """
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm must be one of {GEMM_BACKENDS}, not {gemm!r}")
    passes = list(extra_passes or [])
    if target.kind.name == "cuda" and gemm == "cublas":
        passes.append(DispatchCublas())
    # permute_dims + matmul -> one NT_matmul kernel; no separate transpose of the weights.
    passes.append(relax.transform.FuseTransposeMatmul())
    if "gpu" in target.keys:
        passes.append(relax.get_default_pipeline(target))
    else:
        # The generic CPU pipeline: no FuseOps, which may drop packed calls kept for side effects.
        passes.append(relax.get_pipeline("default"))
    return tvm.transform.Sequential(passes, name="mlc_lora_pipeline")
