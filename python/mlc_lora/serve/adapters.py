"""Where adapters loaded through the API may come from: real paths inside the --adapter-dir roots."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import LoraError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


class AdapterRoots:
    """The folders an API client may load adapters from.

    A requested path (absolute, or relative to a root) is resolved to its real path -- every
    symlink and `..` followed -- and must lie inside a root's real path; so must the two files the
    loader reads. Only PEFT folders with safetensors weights pass (a pickle is never opened).
    """

    def __init__(self, roots: list[str | Path]):
        self.roots: list[Path] = []
        for r in roots:
            real = Path(os.path.realpath(r))
            if not real.is_dir():
                raise LoraError(f"--adapter-dir {str(r)!r} is not a folder")
            self.roots.append(real)

    def find(self, name: str) -> Path | None:
        """The adapter folder `name` in the first root that has a folder of that name, resolved and
        checked as `resolve` does (LoraError when that folder is not a loadable adapter); None when
        no root has one, or `name` is not a plain folder name (so a name never walks out of a root)."""
        if not self.roots or not isinstance(name, str) or not name or name in (".", "..") or any(
                c in name for c in ("/", "\\", "\x00")):
            return None
        if not any((root / name).is_dir() for root in self.roots):
            return None
        return self.resolve(name)

    def resolve(self, path: str) -> Path:
        """The real path of an adapter folder the API may load; LoraError naming the problem otherwise."""
        if not self.roots:
            raise LoraError("loading adapters through the API is disabled: start the server with "
                            "--adapter-dir DIR to name the folders they may come from")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise LoraError("lora_path must be a non-empty string")
        p = Path(path)
        candidates = [p] if p.is_absolute() else [root / p for root in self.roots]
        for cand in candidates:
            real = Path(os.path.realpath(cand))
            root = next((r for r in self.roots if _inside(real, r)), None)
            if root is None or (len(candidates) > 1 and not real.exists()):
                continue  # a relative path is looked up in every root, in order
            if not real.is_dir():
                raise LoraError(f"lora_path {path!r} is not an adapter folder")
            for name in (CONFIG, WEIGHTS):
                f = real / name
                if not f.exists():
                    if name == WEIGHTS and (real / "adapter_model.bin").exists():
                        raise LoraError(f"lora_path {path!r} holds adapter_model.bin (a pickle); only "
                                        f"{WEIGHTS} is loaded")
                    raise LoraError(f"lora_path {path!r} has no {name}")
                # a file symlinked out of the root is as bad as a folder outside it
                if not _inside(Path(os.path.realpath(f)), root) or not Path(os.path.realpath(f)).is_file():
                    raise LoraError(f"lora_path {path!r}: {name} resolves outside the adapter folders")
            return real
        raise LoraError(f"lora_path {path!r} is outside the allowed adapter folders "
                        "(--adapter-dir); symlinks and '..' are resolved before the check")
