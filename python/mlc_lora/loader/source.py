"""Resolve what the user named (a folder, a GGUF file, an embedded name) into a ModelSource."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import ModelConfigError
from .model_source import ModelSource


# Embedded models: name -> callable returning the path of a file shipped in a PyPI package.
def _smollm2_path() -> Path:
    from .embedded import smollm2_gguf_path  # pylint: disable=import-outside-toplevel

    return smollm2_gguf_path()


EMBEDDED: dict[str, Callable[[], Path]] = {"smollm2-135m": _smollm2_path}
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(model: str | Path) -> ModelSource:
    """`model` is an embedded name (smollm2-135m), an HF folder or a .gguf file."""
    if str(model) in EMBEDDED:
        path = EMBEDDED[str(model)]()
        source = _from_path(path)
        source.name = str(model)
        return source
    return _from_path(Path(model))


def _from_path(path: Path) -> ModelSource:
    if path.is_dir():
        from .hf import load_hf_folder  # pylint: disable=import-outside-toplevel

        return load_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        from .gguf_loader import load_gguf  # pylint: disable=import-outside-toplevel

        return load_gguf(path)
    if not path.exists():
        raise ModelConfigError(
            f"model {str(path)!r} not found: give a Hugging Face folder, a .gguf file, or one of "
            f"the embedded names ({', '.join(EMBEDDED)})"
        )
    raise ModelConfigError(f"{path} is neither a model folder nor a .gguf file")
