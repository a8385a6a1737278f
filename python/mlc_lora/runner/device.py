"""TVM's runtime in this process: its import, the CUDA device API, cuBLAS, device names.

Needs only TVM's runtime (it works with the runtime-only bundle used on GPU machines).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MLCLoraError


def _tvm():
    """TVM with its VM runtime imported."""
    import tvm  # pylint: disable=import-outside-toplevel
    import tvm.runtime.vm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    return tvm


def keep_gil(*fns) -> None:
    """Calls of these tvm-ffi functions keep the GIL (tvm-ffi lets it go by default). A call that lets
    it go must win it back from the thread that took it meanwhile: the engine's asyncio side, which
    may keep it for the interpreter's switch interval (5 ms). For calls of microseconds, and those
    that only queue GPU work, that wait is the whole cost (~1 ms a step on the H200 for the pool's
    few calls); the engine thread lets the GIL go only where it waits (reading results back from
    the device, a forward on the CPU)."""
    for f in fns:
        if f is not None:
            f.release_gil = False


# tvm-ffi's container accessors: what reading an Array or a Map returned by the runtime calls, once
# per element (the engine thread reads the pool's stats, adapter infos and LoRA tables every step).
CONTAINER_ACCESSORS = ("ArrayGetItem", "ArraySize", "MapGetItem", "MapGetItemOrMissing", "MapCount", "MapSize")


def keep_gil_in_container_access() -> None:
    """Set once, at import, for the whole process (these functions are tvm-ffi's own singletons)."""
    import tvm_ffi._ffi_api as api  # pylint: disable=import-outside-toplevel

    keep_gil(*(getattr(api, name, None) for name in CONTAINER_ACCESSORS))


keep_gil_in_container_access()


def load_cuda_runtime() -> None:
    """Runtime-only TVM does not autoload its CUDA device API; load it once."""
    tvm = _tvm()
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_GLOBAL",
                                    extra_lib_paths=tvm.libinfo.package_lib_paths())


def load_cublas(device) -> None:
    """Ready the cuBLAS extern of models compiled with `--gemm cublas`: preload libcublas(Lt).so.13
    from the nvidia-cublas wheel when the loader cannot find them, then make the device's handle and
    workspace now, before any CUDA-graph capture (which cannot allocate)."""
    import ctypes  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    init = tvm.get_global_func("mlc_lora.runtime.cublas_init", allow_missing=True)
    if init is None:
        raise MLCLoraError("this model runs its GEMMs through cuBLAS (--gemm cublas), but the mlc_lora "
                           "runtime library with mlc_lora.runtime.cublas_gemm is not loaded")
    for name in ("libcublasLt.so.13", "libcublas.so.13"):
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            continue
        except OSError:
            pass
        for path in nvidia_lib_dirs(("cu13", "cublas")):
            if (path / name).is_file():
                ctypes.CDLL(str(path / name), mode=ctypes.RTLD_GLOBAL)
                break
        else:
            raise MLCLoraError(f"{name} not found: pip install nvidia-cublas (of mlc-lora's cuda extra), "
                               "or compile with --gemm tvm")
    init(device.index)


def nvidia_lib_dirs(subdirs: tuple[str, ...]) -> list[Path]:
    """The lib folders of the installed nvidia-* wheels (`nvidia/<sub>/lib`)."""
    try:
        import nvidia  # pylint: disable=import-outside-toplevel
    except ImportError:
        return []
    return [Path(p) / sub / "lib" for p in nvidia.__path__ for sub in subdirs]


def device_of(name: str):
    """TVM's device for "cpu", "cuda" or "cuda:N"."""
    tvm = _tvm()
    if name == "cpu":
        return tvm.cpu(0)
    if name.startswith("cuda"):
        load_cuda_runtime()
        idx = int(name.split(":", 1)[1]) if ":" in name else 0
        dev = tvm.cuda(idx)
        if not dev.exist:
            raise MLCLoraError(f"device {name!r} requested but no CUDA GPU is visible")
        return dev
    raise MLCLoraError(f"unknown device {name!r}; use 'cpu' or 'cuda'")


def keep_gil_on_device(device, *fns) -> None:
    """`keep_gil(*fns)` where `device` is not the CPU: on a GPU a model function only queues work
    (kernels, graph launches); on the CPU the call is the computation itself, and there the GIL
    goes, so that other threads run meanwhile."""
    if device.dlpack_device_type() != _tvm().cpu(0).dlpack_device_type():
        keep_gil(*fns)


# The Relax VM's memory allocators. "pooled" keeps every buffer it ever freed, keyed by size, for
# reuse: each new prefill length leaves buffers of new sizes behind, so memory would grow with every
# distinct prompt length; ModelRunner releases the cached buffers after POOLED_PREFILL_SIZES new
# prefill token counts. "naive" hands each buffer back when it is freed.
ALLOCATORS = ("naive", "pooled")
POOLED_PREFILL_SIZES = 8


# glibc's malloc serves a block of at least its mmap threshold (128 KiB at start) with mmap and
# unmaps it when freed, but raises the threshold to the size of every mmap'd block freed (up to 32
# MiB, the trim threshold to twice that): from then on blocks that size come from the heap, which
# keeps its free space (malloc_trim(0) after every soak round returned next to none of it). The naive
# allocator frees a forward's activations every step, and under prompts of varied lengths resident
# memory grew in steps for an hour without levelling off (+76 MB; docs/BENCHMARKS.md, "Soak"); a
# CUDA runner's host side did the same (+377 MB in ~24 MB steps, +22 MB pinned, at no cost measured).
# Pinned at these values (mallopt, which also ends the raising), large buffers go back on free.
MALLOC_MMAP_THRESHOLD = 128 << 10
_MALLOPT_DONE = False


def hand_back_freed_buffers() -> bool:
    """Pin glibc's mmap threshold (and trim threshold) for this process, once; where the allocator
    is not glibc's, or MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment set them
    already, leave them. Returns whether they were set."""
    global _MALLOPT_DONE  # pylint: disable=global-statement
    import os  # pylint: disable=import-outside-toplevel

    if _MALLOPT_DONE or any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    _MALLOPT_DONE = True
    try:
        import ctypes  # pylint: disable=import-outside-toplevel

        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # not glibc
            return False
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                    and libc.mallopt(m_trim_threshold, 2 * MALLOC_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def default_allocator(device: str) -> str:
    """The allocator a runner on `device` uses unless told otherwise: "naive" on the CPU, where it is
    as fast as "pooled" and holds nothing (docs/BENCHMARKS.md, "Memory under varied prompt
    lengths"); "pooled" on CUDA, where a cudaFree per buffer would stall the host behind the GPU."""
    return "naive" if device == "cpu" else "pooled"
