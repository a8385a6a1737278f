"""Model sources: Hugging Face folders, GGUF files and the embedded default model."""

from .source import ModelSource, resolve_model

__all__ = ["ModelSource", "resolve_model"]
