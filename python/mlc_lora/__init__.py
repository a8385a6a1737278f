"""mlc-lora: a compiled multi-LoRA serving runtime on Apache TVM."""

__version__ = "0.1.0"

from .errors import MLCLoraError  # noqa: E402
from . import _ffi_api  # noqa: E402,F401  (loads the C++ runtime: mlc_lora.runtime.*)

__all__ = ["MLCLoraError", "__version__"]
