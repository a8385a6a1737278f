"""mlc-lora: a compiled multi-LoRA serving runtime on Apache TVM."""

__version__ = "0.1.0"

from .errors import MLCLoraError  # noqa: E402
from . import _ffi_api  # noqa: E402,F401  (loads the C++ runtime: mlc_lora.runtime.*)


def __getattr__(name):
    # the engine pulls in TVM: import it only when asked for
    if name in ("MLCEngine", "AsyncMLCEngine"):
        from . import engine  # pylint: disable=import-outside-toplevel

        return getattr(engine, name)
    raise AttributeError(f"module 'mlc_lora' has no attribute {name!r}")


__all__ = ["AsyncMLCEngine", "MLCEngine", "MLCLoraError", "__version__"]
