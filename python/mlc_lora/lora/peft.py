"""PEFT LoRA adapters: folders (adapter_config.json + adapter_model.safetensors) and adapters in
memory (`LoraAdapter`).

Reading, checking and packing a folder is the runtime's (src/runtime/peft_adapter.{h,cc}, the one
implementation, shared with the C++ API): only the plain LoRA forward `y += scale * (x @ A.T) @ B.T`
on Llama linears is served; every PEFT option that changes that maths is refused by name, as a
`LoraError`, rather than silently ignored. Weights are read from safetensors only (never pickle).
Options accepted but ignored come back as warnings, re-emitted here with `warnings.warn`.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .layout import PackedAdapter

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@dataclasses.dataclass
class LoraAdapter:
    """An adapter in memory, ready for `layout.pack_adapter`: per (layer, module) A (rank, in) and
    B^T (rank, out) in float32 at the base model's (unsharded) shapes, padded with zero rows to
    `rank` (the adapter's largest) and with any per-layer scale folded in."""

    name: str
    rank: int
    modules: list[str]  # targeted modules, canonical order
    scales: dict[str, float]  # module -> scale used in the tables
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    config: dict[str, Any]


@dataclasses.dataclass
class AdapterPlan:
    """A PEFT folder checked against a compiled model, without packing it."""

    name: str
    rank: int
    modules: list[str]  # targeted modules, canonical order
    scales: dict[str, float]  # module -> table scale
    num_pages: int  # pages the packed adapter takes (per tensor-parallel shard)
    lora_alpha: float
    use_rslora: bool


def _config_json(compiled_config: dict[str, Any]) -> str:
    return json.dumps(compiled_config)


def _warn(out) -> None:
    for w in out["warnings"]:
        warnings.warn(str(w), stacklevel=3)


def pack_peft_adapter(folder: str | Path, compiled_config: dict[str, Any],
                      name: str | None = None, shard: int = 0) -> PackedAdapter:
    """A PEFT adapter folder -> pool input, for the model of `compiled_config` (its JSON config);
    under tensor parallelism, the input of shard `shard`'s pool. `name` (default: the folder's
    name) names the adapter in errors."""
    from .. import _ffi_api  # pylint: disable=import-outside-toplevel  (loads the runtime)

    out = _ffi_api.pack_peft_adapter(str(folder), _config_json(compiled_config), name or "", shard)
    _warn(out)
    return PackedAdapter.from_runtime(out, lora_alpha=out["lora_alpha"], use_rslora=bool(out["use_rslora"]))


def peft_adapter_plan(folder: str | Path, compiled_config: dict[str, Any]) -> AdapterPlan:
    """Read and check a PEFT folder against the model of `compiled_config` (adapter_config.json and
    the safetensors header only): its rank, modules and the pages it will take, no packing."""
    from .. import _ffi_api  # pylint: disable=import-outside-toplevel  (loads the runtime)

    out = _ffi_api.peft_adapter_plan(str(folder), _config_json(compiled_config))
    _warn(out)
    return AdapterPlan(str(out["name"]), int(out["rank"]), [str(m) for m in out["modules"]],
                       {str(k): float(v) for k, v in out["scales"].items()}, int(out["num_pages"]),
                       out["lora_alpha"], bool(out["use_rslora"]))
