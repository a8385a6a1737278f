"""mlc-lora: a compiled multi-LoRA serving runtime on Apache TVM."""

__version__ = "0.1.0"

from .errors import MLCLoraError  # noqa: E402

__all__ = ["MLCLoraError", "__version__"]
