"""The LoRA op and its stage registry: which implementation updates a target linear.

A LoRA stage (contract.LORA_KERNELS: "single", "gather", "sgmv") is one way of computing
    y[t] += scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T    (s = slot[t] >= 0; reference.py)
over the adapter rows of the unified page arena. Each stage has one or more implementations, one
per backend ("tir", "cuda", ...), each in its own file here beside its kernels:
    single_tir.py   stage 1: dense rows of slot 0 + two matmuls per module (TIR, any target)
    gather_tir.py   stage 2: a per-token gather kernel per module (TIR, any target)
    sgmv_triton.py  stage 3 on tensor cores: Triton kernels over tokens sorted by slot, one
                    shrink + one in-place expand per fused linear (CUDA fp16/bf16, rank <= 128)
    sgmv_cuda.py    stage 3: one shrink + one in-place expand per fused linear (sgmv.cu; CUDA
                    fp16/bf16, rank <= 128, <= 3 parts)
    sgmv_tir.py     stage 3: a shrink + expand pair per module (TIR, any target)
    linear_triton.py  not a stage: the base linear and the delta over the batch's rank columns, for
                    prefill_fused/decode_fused (LoraRewrite(fused=True); batches over a few low-rank
                    adapters): one kernel up to 64 tokens, cuBLAS + a shrink/expand pair above
    reference.py    the numpy reference of every kernel above, and the semantics they share

The interface (stage.py), called by passes/lora_rewrite.py once per target linear:

    class LoraStage:
        stage: str      # a name of contract.LORA_KERNELS
        backend: str    # "tir", "cuda", ...
        def supported(self, target: tvm.target.Target, dtype: str, max_rank: int,
                      num_parts: int, rows: str = "model") -> str | None
            # None if it can run this linear, else the reason in words
        def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int,
                 parts: Sequence[Part], tables: Mapping[str, relax.Var]) -> relax.Expr
            # emits the base GEMM and the update with ctx.builder, returns the new y

    Part(name: str, module: int, lo: int, hi: int)   # a slice y[:, lo:hi]; module -1: no adapter
    LoraContext: builder, target, num_layers, max_rank, num_modules, rows (the rows' format),
        kernel(key, name, make) -> GlobalVar   # add a PrimFunc once per key
        external(key, make)                    # link a runtime module (a cubin) once per key
    x is the linear's input as (n, in), base the base output's call (..., W) with W = parts[-1].hi
    (emitted by the stage: a shrink that reads only x may go before it), tables
    the function's contract.LORA_TABLE_INPUTS parameters (see LoraStage.emit).

`select(stage, backend, ...)` picks the implementation for one linear: an explicit backend must
be registered for the stage and support the linear (else a ValueError naming why); "auto" takes
the first implementation of the stage in STAGES whose supported() is None, so faster ones are
listed first. Adding an implementation (e.g. a tensor-core or Triton sgmv) is: a new file here
with its kernels and a LoraStage, one entry in STAGES, and its tests
(tests/python/compiler/ops/lora/: against reference.py, and LoraRewrite Before/After).
"""

from __future__ import annotations

import functools

from mlc_lora.contract import LORA_KERNELS

# The registry and the interface import TVM's compiler; they load on first use, so that the Triton
# kernels here import with TVM's runtime alone (the GPU benchmarks run them there).
_LAZY = {"LoraContext": "stage", "LoraStage": "stage", "Part": "stage"}


@functools.lru_cache(maxsize=None)
def _stages() -> dict:
    """(stage, backend) -> implementation; per stage in the order "auto" tries them."""
    from . import gather_tir, sgmv_cuda, sgmv_tir, sgmv_triton, single_tir  # pylint: disable=import-outside-toplevel

    # sgmv: the Triton tensor-core kernels first (faster than the CUDA C++ ones at every token count
    # measured, docs/SGMV.md), then the CUDA C++ kernels (where Triton is not installed)
    return {(impl.stage, impl.backend): impl
            for impl in (single_tir.STAGE, gather_tir.STAGE, sgmv_triton.STAGE, sgmv_cuda.STAGE, sgmv_tir.STAGE)}


def __getattr__(name: str):
    if name == "STAGES":
        return _stages()
    if name == "BACKENDS":
        return ("auto", *sorted({backend for _, backend in _stages()}))
    if name in _LAZY:
        from . import stage  # pylint: disable=import-outside-toplevel

        return getattr(stage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def implementations(stage: str) -> list:
    """The registered implementations of `stage`, in the order "auto" tries them."""
    return [impl for (s, _), impl in _stages().items() if s == stage]


def check(stage: str, backend: str) -> None:
    """A ValueError unless `stage` is a LoRA stage and `backend` "auto" or one it is registered for."""
    backends = __getattr__("BACKENDS")
    if stage not in LORA_KERNELS:
        raise ValueError(f"unknown LoRA kernel {stage!r}; choose from {', '.join(LORA_KERNELS)}")
    if backend not in backends:
        raise ValueError(f"unknown LoRA kernel backend {backend!r}; choose from {', '.join(backends)}")
    if backend != "auto" and (stage, backend) not in _stages():
        have = ", ".join(impl.backend for impl in implementations(stage))
        raise ValueError(f"LoRA kernel {stage!r} has no {backend!r} implementation (it has: {have})")


def select(stage: str, backend: str, target, dtype: str, max_rank: int, num_parts: int, rows: str = "model"):
    """The implementation that updates a linear of `num_parts` parts (see the module docstring)."""
    check(stage, backend)
    if backend != "auto":
        impl = _stages()[(stage, backend)]
        why = impl.supported(target, dtype, max_rank, num_parts, rows)
        if why is not None:
            raise ValueError(f"LoRA kernel {stage!r} on backend {backend!r} cannot run {why}")
        return impl
    reasons = []
    for impl in implementations(stage):
        why = impl.supported(target, dtype, max_rank, num_parts, rows)
        if why is None:
            return impl
        reasons.append(f"{impl.backend}: {why}")
    raise ValueError(f"no implementation of LoRA kernel {stage!r} runs this linear ({'; '.join(reasons)})")


__all__ = ["BACKENDS", "STAGES", "LoraContext", "LoraStage", "Part", "check", "implementations", "select"]
