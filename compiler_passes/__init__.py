"""Relax passes of mlc-lora and the kernels they insert; imported as ``mlc_lora.compiler_passes``.

    pipeline.py        get_pipeline: the one list of passes, then TVM's lowering
    passes/            one Relax pass per file: LoraRewrite, DispatchCublas, DispatchKVCache,
                       DispatchAttention, AttachSampler
    ops/               one folder per op the passes insert, each with its semantics, kernels
                       and numpy reference (reference.py):
      lora/            the LoRA stages and their registry (ops/lora/__init__.py)
      gemv/            the base linear's small-batch CUDA kernel
      attention/       paged attention on tensor cores (CUDA)
      sampler/         on-device sampling (TIR)
      cuda_build.py    nvcc -> cubin -> TVM module, shared by the CUDA kernels (with dtype.cuh)
      kernel_attrs.py  the PrimFunc attributes of every kernel

Imports run one way: nothing here imports the engine, runtime or server; the only mlc_lora module
used is mlc_lora.contract. The compile step of ``mlc_lora`` calls into this package.
"""

__all__ = ["get_pipeline"]


def __getattr__(name: str):
    # Lazily: the Triton kernels under ops/ import without TVM's compiler (the GPU benchmarks run
    # them on a machine that has only TVM's runtime).
    if name == "get_pipeline":
        from .pipeline import get_pipeline  # pylint: disable=import-outside-toplevel

        return get_pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
