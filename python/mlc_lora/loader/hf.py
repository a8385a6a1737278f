"""Hugging Face model folders: config.json + safetensors (one file, or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ..errors import ModelConfigError, WeightError
from .model_source import ModelSource


def load_hf_folder(folder: Path) -> ModelSource:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelConfigError(f"{folder} has no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg_path} is not valid JSON: {e}") from e
    files = _safetensors_files(folder)
    names = []
    for f in files:
        with safe_open(f, framework="numpy") as st:
            names += [(f, k) for k in st.keys()]

    def weights():
        for f in files:
            with safe_open(f, framework="numpy") as st:
                for k in st.keys():
                    yield k, st.get_tensor(k)

    tok_json = folder / "tokenizer.json"
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    # transformers >= 4.43 saves the chat template beside tokenizer_config.json
    template = folder / "chat_template.jinja"
    if "chat_template" not in tok_cfg and template.is_file():
        tok_cfg["chat_template"] = template.read_text()
    for extra in ("generation_config.json",):
        p = folder / extra
        if p.is_file():
            gen = _read_json(p)
            for key in ("bos_token_id", "eos_token_id"):
                if key in gen:
                    tok_cfg.setdefault(key, gen[key])
    for key in ("bos_token_id", "eos_token_id"):
        if key in config:
            tok_cfg.setdefault(key, config[key])
    return ModelSource(
        name=folder.name,
        config=config,
        weights=weights,
        num_weights=len(names),
        tokenizer_json=tok_json.read_text() if tok_json.is_file() else None,
        tokenizer_config=tok_cfg,
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from e


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightError(f"{index} is malformed: {e}") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise WeightError(f"{index.name} names shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
            raise WeightError(f"{folder} holds only pickle weights (.bin/.pt); mlc-lora reads safetensors only")
        raise WeightError(f"{folder} has no .safetensors weights")
    return files
