"""The one list of passes that turns an exported model into a library for a target."""

from __future__ import annotations

import tvm
from tvm import relax

from .passes import (AttachSampler, DispatchActivation, DispatchAttention, DispatchCublas, DispatchKVCache,
                     DispatchNorm, LoraRewrite, ReserveRankColumns, ReserveRankRows)
from .passes.dispatch_cublas import GEMV_MAX_ROWS

GEMM_BACKENDS = ("cublas", "tvm")


def get_pipeline(target: tvm.target.Target, *, extra_passes: list | None = None,
                 lora: dict | None = None, rank_rows: bool = False, spare_columns: bool = False,
                 stock_kv_cache: bool = False,
                 gemm: str = "cublas", attention: str = "flash",
                 gemv_max_rows: int = GEMV_MAX_ROWS, default_rope: bool = False,
                 add_norm: bool = False) -> tvm.transform.Pass:
    """Our model-level passes, then TVM's default lowering for `target`.

    `lora` (LoraRewrite's keyword arguments; `rank_rows` / `spare_columns`: ReserveRankRows /
    ReserveRankColumns before it) and
    `extra_passes` run first, on the exported module,
    while linears are still `permute_dims(W)` + `matmul` (the LoRA rewrite matches that shape).
    `stock_kv_cache` keeps TVM's own paged KV cache (tests compare the two). `gemm` picks who runs
    the base linears: "cublas" (our runtime's GEMM extern: cuBLAS on CUDA, its multi-threaded
    float32 GEMM on llvm) or "tvm" (dlight kernels on CUDA, unscheduled loops on llvm); with
    "cublas" on CUDA, fp16/bf16 linears of up to `gemv_max_rows` tokens run our gemv kernel (0: none).
    `attention` "flash" runs the pool cache's attention on our tensor-core CUDA kernels where they
    fit the model (CUDA, fp16/bf16, head_dim 64/128), "tir" keeps TVM's kernels; with it and
    `default_rope` (the model's RoPE frequencies are the default ones, at most a linear position
    scale) the cache's RoPE and append of new keys and values run as one Triton kernel. `add_norm`
    (CUDA): each RMSNorm of the hidden state, with the residual add that makes its input, on one
    Triton kernel (in the rank columns route's linears too, which run it as x's producer).
    """
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm must be one of {GEMM_BACKENDS}, not {gemm!r}")
    passes = []
    if lora is not None:
        reserve = {"param_names": lora["param_names"], "modules": lora["modules"], "linears": lora["linears"]}
        if rank_rows:
            # Rows below each targeted weight for the batch's A rows (the fused linears' rank rows route).
            passes.append(ReserveRankRows(**reserve))
        if spare_columns:
            # Columns beside each targeted weight for the batch's B rows (the rank columns route).
            passes.append(ReserveRankColumns(**reserve))
        # Paged-adapter tables on prefill/decode, base + delta on every target linear.
        passes.append(LoraRewrite(target=target, add_norm=add_norm and target.kind.name == "cuda", **lora))
    passes += list(extra_passes or [])
    if target.kind.name in ("cuda", "llvm") and gemm == "cublas":
        # After LoraRewrite: it keeps the base matmul and adds its delta to the output.
        cpu = target.kind.name == "llvm"
        passes.append(DispatchCublas(cpu=cpu, arch=None if cpu else str(target.arch),
                                     gemv_max_rows=gemv_max_rows))
    if target.kind.name == "cuda":
        # silu(gate) * up on one Triton kernel (fp16/bf16, where Triton is installed), in every
        # function, base and LoRA alike.
        passes.append(DispatchActivation(str(target.arch)))
        if add_norm:
            # rms_norm (and add + rms_norm) left by LoraRewrite on one Triton kernel, in every function
            passes.append(DispatchNorm(str(target.arch)))
    if not stock_kv_cache:
        # KV pages and adapter pages in one pool: mlc-lora's cache instead of TVM's.
        passes.append(DispatchKVCache())
        if target.kind.name == "cuda" and attention == "flash":
            passes.append(DispatchAttention(str(target.arch), rope_append=default_rope))
    passes.append(AttachSampler(target))
    # permute_dims + matmul -> one NT_matmul kernel; no separate transpose of the weights.
    passes.append(relax.transform.FuseTransposeMatmul())
    if "gpu" in target.keys:
        passes.append(relax.get_default_pipeline(target))
    else:
        # The generic CPU pipeline: no FuseOps, which may drop packed calls kept for side effects.
        passes.append(relax.get_pipeline("default"))
    return tvm.transform.Sequential(passes, name="mlc_lora_pipeline")
