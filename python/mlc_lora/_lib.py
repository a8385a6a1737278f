"""Find and load mlc-lora's C++ runtime library (src/runtime, built by `pip install`)."""

from __future__ import annotations

import ctypes
import os
import site
import sysconfig
from pathlib import Path

from .errors import MLCLoraError

LIB_NAME = "libmlc_lora_runtime.so"
_LIB = None


def _candidates() -> list[Path]:
    if os.environ.get("MLC_LORA_LIBRARY"):
        return [Path(os.environ["MLC_LORA_LIBRARY"])]
    # A wheel installs it next to this file; an editable install (scikit-build-core's redirect
    # mode) installs it under site-packages/mlc_lora/lib while the Python files stay in the tree.
    dirs = [Path(__file__).parent]
    roots = [sysconfig.get_paths()["platlib"], sysconfig.get_paths()["purelib"]]
    roots += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    dirs += [Path(r) / "mlc_lora" for r in roots]
    return [d / "lib" / LIB_NAME for d in dirs]


def load_library():
    """Load the runtime once; its static initializers register `mlc_lora.runtime.*`."""
    global _LIB  # pylint: disable=global-statement
    if _LIB is not None:
        return _LIB
    # libtvm_ffi and libtvm_runtime must be the ones Python already loaded.
    import tvm  # pylint: disable=import-outside-toplevel

    # Disco (tensor parallelism, src/runtime/nccl_ccl.cc) lives in libtvm_runtime_extra, which
    # `import tvm` does not load in every install (TVM's runtime-only mode): load it from tvm's
    # own lib folder so the runtime library's dependency resolves to that copy.
    extra = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_extra.so"
    if extra.is_file():
        ctypes.CDLL(str(extra), mode=ctypes.RTLD_GLOBAL)
    tried = _candidates()
    for path in tried:
        if path.is_file():
            _LIB = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return _LIB
    raise MLCLoraError(
        f"mlc-lora's C++ runtime ({LIB_NAME}) is not built; run `pip install -e .` "
        f"(looked in {', '.join(str(p.parent) for p in tried)})"
    )
