"""Triton kernels in a model library: compile a @triton.jit function to cubin for the target's arch
(Triton compiles sm_90a without a GPU), cache it on disk, and wrap it as a TVM CUDA module that TIR
launches with `T.call_packed(name, *args, 0, 0, grid..., threads, shared_bytes)`.

A kernel's signature maps each argument to a Triton type ("*fp16", "i32", "i64", "fp32", "constexpr");
pointers and the `base` offset are declared 16-byte divisible (TVM's allocations are; the layer base
of the LoRA arena too) so loads vectorize. Triton appends two scratch pointers (global and profile
scratch, unused: the launch passes null) and the grid/launch arguments follow them.

Every kernel starts with `wait_for_producers()` (programmatic dependent launch: kernel_attrs.PDL;
the wait is compiled for sm_90 and later only); with PDL on, a kernel whose PTX does not wait is
refused the programmatic launch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mlc_lora.contract import cache_dir, write_cached

from . import kernel_attrs

try:  # compiling these kernels needs Triton; nothing else in mlc-lora does
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

PTR = {"float16": "*fp16", "bfloat16": "*bf16"}
SCRATCH = 2  # the scratch pointers Triton appends
_ARG_TYPES = {"i32": "int32", "i64": "int64", "fp32": "float32"}  # a scalar argument's TVM type
_WAIT = "griddepcontrol.wait"
_DIVISIBLE = ("base",)  # integer arguments that are multiples of 16 bytes' worth of elements
# the most dynamic shared memory a block may take, by compute capability (CUDA's opt-in limit per
# block): a kernel built past it would be refused only at its first launch, on the GPU
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


if triton is None:  # pragma: no cover
    wait_for_producers = None
elif os.environ.get("TRITON_INTERPRET") == "1":  # the CPU emulation runs no inline PTX, overlaps no launch

    @triton.jit
    def wait_for_producers():
        """(Triton's interpreter: nothing to wait for.)"""

else:
    _HAS_WAIT = tl.constexpr(True)  # the arch being compiled has griddepcontrol (set by compile_kernel)

    @triton.jit
    def wait_for_producers():
        """A kernel's first step: wait until the kernels before it in the stream have finished and
        their writes are visible (griddepcontrol.wait; a no-op after a launch that was not
        programmatic; nothing before sm_90)."""
        if _HAS_WAIT:
            tl.extra.cuda.gdc_wait()


def launch_tags(waits: bool, arch: str) -> list[str]:
    """TVM's launch tags of a kernel built for `arch` (grid x, y, block x, dynamic shared memory
    last); with kernel_attrs.PDL, the programmatic launch, which only a kernel that waits for its
    producers (`waits`: its PTX has griddepcontrol.wait) may take."""
    pdl = kernel_attrs.pdl_tags(arch)
    if pdl and not waits:
        raise ValueError("a kernel launched programmatically must wait for its producers first "
                         "(wait_for_producers): this one reads them without waiting")
    return ["blockIdx.x", "blockIdx.y", "threadIdx.x"] + pdl + ["tirx.use_dyn_shared_memory"]


def compile_triton(fn, sig: dict, consts: dict, num_warps: int, arch: str, num_stages: int = 3):
    """Triton's compiled kernel of `fn` (its `asm` holds the PTX and the cubin), uncached: what
    compile_kernel builds, for inspecting the code (scripts/triton_ptx.py)."""
    from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
    from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel

    global _HAS_WAIT  # pylint: disable=global-statement  (read by wait_for_producers as Triton compiles)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig)
             if sig[k].startswith("*") or k in _DIVISIBLE}
    cap = kernel_attrs.sm_version(arch)
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    _HAS_WAIT = tl.constexpr(cap >= kernel_attrs.PDL_MIN_SM)
    return triton.compiler.compile(src, target=GPUTarget("cuda", cap, 32),
                                   options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_kernel(fn, sig: dict, consts: dict, num_warps: int, arch: str, source: Path, num_stages: int = 3):
    """(kernel name, cubin, metadata) of `fn` built with `consts` (num_stages: the software
    pipeline's depth, Triton's default 3); cached on disk by the content of `source` (the file
    holding fn), the signature, the constants, the launch options, the arch and Triton's version."""
    cap = kernel_attrs.sm_version(arch)
    key = hashlib.sha256(json.dumps([Path(source).read_text(), Path(__file__).read_text(), fn.__name__, sig,
                                     consts, num_warps, num_stages, arch, triton.__version__]).encode()).hexdigest()[:24]
    out = cache_dir() / "triton" / f"{fn.__name__}-{key}"
    if out.with_suffix(".json").exists():
        meta = json.loads(out.with_suffix(".json").read_text())
        _check_shared(meta, cap, consts)
        return meta["name"], out.with_suffix(".cubin").read_bytes(), meta
    k = compile_triton(fn, sig, consts, num_warps, arch, num_stages)
    md = k.metadata
    if md.global_scratch_size or getattr(md, "profile_scratch_size", 0) or md.num_ctas != 1:
        raise RuntimeError(f"{md.name}: the Triton kernel needs scratch memory or clusters; unsupported")
    meta = dict(name=md.name, num_warps=md.num_warps, shared=md.shared, waits=_WAIT in k.asm["ptx"])
    _check_shared(meta, cap, consts)
    write_cached(out.with_suffix(".cubin"), k.asm["cubin"])
    write_cached(out.with_suffix(".json"), json.dumps(meta))  # last: a reader that sees it finds the cubin
    return md.name, k.asm["cubin"], meta


def _check_shared(meta: dict, cap: int, consts: dict) -> None:
    """Refuse a kernel that takes more shared memory than a block of compute capability `cap` may."""
    limit = MAX_SHARED.get(cap)
    if limit is not None and meta["shared"] > limit:
        raise ValueError(f"{meta['name']}: {meta['shared']} bytes of shared memory, more than the {limit} a block "
                         f"may take on sm_{cap} (constants {consts}); fewer stages or smaller tiles")


def arg_types(sig: dict) -> list[str]:
    """The TVM types of a kernel's launch arguments (its signature's non-constexpr ones, then the
    scratch pointers): how TVM's CUDA module packs each value it is called with."""
    bad = [f"{k}: {t}" for k, t in sig.items() if not t.startswith("*") and t != "constexpr" and t not in _ARG_TYPES]
    if bad:
        raise ValueError(f"scalar kernel arguments of types {bad}: only {sorted(_ARG_TYPES)} are launched")
    return ["handle" if t.startswith("*") else _ARG_TYPES[t] for t in sig.values() if t != "constexpr"] + [
        "int64"] * SCRATCH


def cuda_module(fn, sig: dict, consts: dict, num_warps: int, arch: str, source: Path, num_stages: int = 3):
    """(name, launch threads, dynamic shared bytes, TVM CUDA module) of one kernel variant."""
    import tvm  # pylint: disable=import-outside-toplevel

    name, cubin, meta = compile_kernel(fn, sig, consts, num_warps, arch, source, num_stages)
    types = arg_types(sig)
    info = {"tvm_version": tvm.__version__, "func_info": {name: {
        "name": "", "arg_types": types, "launch_param_tags": launch_tags(meta.get("waits", False), arch)}}}
    fmap = tvm.get_global_func("runtime.LoadMetaDataFromJSON")(json.dumps(info))
    create = tvm.get_global_func("ffi.Module.create.cuda", allow_missing=True)
    if create is None:
        raise RuntimeError("TVM's CUDA runtime is not loaded (mlc_lora.compile.prepare_cuda_build)")
    return name, meta["num_warps"] * 32, meta["shared"], create(cubin, "cubin", fmap, {})


def kernel_namer(prefix: str, ptr_arg: str):
    """A `repr` for @triton.jit naming each built variant by all its compile-time constants and the
    dtype of `ptr_arg` (a library links many variants; one looked up by another's name would run
    with the wrong constants)."""

    def name(proxy) -> str:
        c, dtype = proxy.constants, proxy.signature[ptr_arg].lstrip("*")
        return f"{prefix}_{dtype}_" + "_".join(f"{k}{v}".replace("-", "n") for k, v in sorted(c.items()))

    return name
