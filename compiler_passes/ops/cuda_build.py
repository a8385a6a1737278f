"""The shared CUDA build of ops/: hand-written CUDA C++ kernels (ops/<op>/*.cu, each including
the element type of ops/dtype.cuh) as TVM modules. nvcc builds a cubin for the target's arch, and
the module rides in the IRModule's `external_mods` (relax.build links it into the library, as
`T.call_kernel` does). Host-side TIR wrappers launch the kernels by name with `T.call_packed`;
the launch arguments follow the kernel's own (grid x, y, z, then block x).

Needs nvcc on PATH and TVM's CUDA runtime loaded (mlc_lora.compile.prepare_cuda_build); no GPU.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import tvm

from mlc_lora.contract import cache_dir, write_cached

from . import kernel_attrs

LAUNCH_TAGS = ["blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x"]  # (+ kernel_attrs.pdl_tags(arch))
INCLUDE = Path(__file__).parent  # dtype.cuh, the element type every .cu of ops/ includes


class CudaBuildError(RuntimeError):
    """nvcc is missing or rejected a kernel source."""


def _cache_dir() -> Path:
    return cache_dir() / "cubin"


def build_cubin(source: Path, arch: str, defines: dict[str, str | int | None]) -> bytes:
    """`source` compiled for `arch` (e.g. "sm_90a") with `-D` defines; cached by content."""
    flags = ["-O3", "-std=c++17", "--cubin", f"-arch={arch}", "-lineinfo"]
    flags += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted(defines.items())]
    # the key covers the headers the source may include (#include "x.cuh": beside it or the shared
    # ones in INCLUDE), not only the source
    headers = sorted({*source.parent.glob("*.cuh"), *INCLUDE.glob("*.cuh")})
    text = "".join(f.read_text() for f in [source, *headers])
    key = hashlib.sha256((text + "\0" + " ".join(flags)).encode()).hexdigest()[:24]
    out = _cache_dir() / f"{source.stem}-{key}.cubin"
    if out.exists():
        return out.read_bytes()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CudaBuildError(f"building {source.name} for {arch} needs nvcc (the CUDA toolkit) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([nvcc, *flags, f"-I{INCLUDE}", "-o", str(tmp_out), str(source)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CudaBuildError(f"nvcc failed on {source.name} ({' '.join(flags)}):\n{proc.stderr}")
        cubin = tmp_out.read_bytes()
    write_cached(out, cubin)
    return cubin


def cuda_module(cubin: bytes, kernels: dict[str, list[str]], arch: str) -> tvm.runtime.Module:
    """A TVM CUDA module over `cubin` (built for `arch`); `kernels` maps each kernel name to its
    argument types ("handle" for pointers, "int32", "float32"). Every kernel takes LAUNCH_TAGS after
    them; with kernel_attrs.PDL it is launched programmatically (each .cu kernel starts with
    wait_for_producers() of dtype.cuh)."""
    tags = LAUNCH_TAGS + kernel_attrs.pdl_tags(arch)
    meta = {"tvm_version": tvm.__version__,
            "func_info": {name: {"name": "", "arg_types": types, "launch_param_tags": tags}
                          for name, types in kernels.items()}}
    fmap = tvm.get_global_func("runtime.LoadMetaDataFromJSON")(json.dumps(meta))
    create = tvm.get_global_func("ffi.Module.create.cuda", allow_missing=True)
    if create is None:
        raise CudaBuildError("TVM's CUDA runtime is not loaded (call mlc_lora.compile.prepare_cuda_build)")
    return create(cubin, "cubin", fmap, {})


def attach(mod: tvm.IRModule, ext: tvm.runtime.Module) -> tvm.IRModule:
    """`mod` with `ext` added to the modules relax.build links into the library."""
    attrs = mod.attrs or {}
    mods = list(attrs["external_mods"]) if "external_mods" in attrs else []
    return mod.with_attr("external_mods", mods + [ext])
