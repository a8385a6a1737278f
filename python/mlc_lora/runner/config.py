"""The compiled model folder's mlc-lora-config.json, read once into a typed view."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..contract import CONFIG_FILE
from ..errors import MLCLoraError
from ..lora.layout import LoraSpec


@dataclasses.dataclass(frozen=True)
class CompiledConfig:  # pylint: disable=too-many-instance-attributes
    """What a runner needs of a compiled folder; `raw` is the JSON as written (the adapter packers,
    `mlc_lora.lora.pack_peft_adapter` and `peft_adapter_plan`, take it)."""

    model_dir: Path
    raw: dict[str, Any]
    model_name: Optional[str]
    dtype: str
    target_kind: str  # "llvm" or "cuda"
    library: str  # file name of the compiled library
    params_file: str
    param_names: tuple[str, ...]
    model_config: dict[str, Any]
    compile_options: dict[str, Any]
    tokenizer: dict[str, Any]
    tensor_parallel_shards: int
    lora: Optional[LoraSpec]  # None: compiled without LoRA

    @classmethod
    def read(cls, model_dir: str | Path, device: Optional[str] = None) -> "CompiledConfig":
        """The folder's config; with `device`, checked to be compiled for that device's target."""
        model_dir = Path(model_dir)
        path = model_dir / CONFIG_FILE
        if not path.is_file():
            raise MLCLoraError(f"{model_dir} is not a compiled mlc-lora model (no {CONFIG_FILE})")
        raw = json.loads(path.read_text())
        kind = raw["target"]["kind"]
        if device is not None and (kind == "llvm") != (device == "cpu"):
            raise MLCLoraError(f"{model_dir} was compiled for target {kind!r} and cannot run on device {device!r}")
        mc = raw["model_config"]
        shards = int(raw.get("tensor_parallel_shards", mc.get("tensor_parallel_shards", 1)))
        return cls(model_dir=model_dir, raw=raw, model_name=raw.get("model_name"), dtype=raw["dtype"],
                   target_kind=kind, library=raw["library"], params_file=raw["params_file"],
                   param_names=tuple(raw["param_names"]), model_config=mc,
                   compile_options=raw.get("compile_options", {}), tokenizer=raw.get("tokenizer", {}),
                   tensor_parallel_shards=shards,
                   lora=LoraSpec.from_json(raw["lora"]) if raw.get("lora") else None)

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def context_window_size(self) -> int:
        return self.model_config["context_window_size"]

    @property
    def prefill_chunk_size(self) -> int:
        return self.model_config["prefill_chunk_size"]

    @property
    def max_batch_size(self) -> int:
        return self.model_config.get("max_batch_size", 64)

    @property
    def numpy_dtype(self):
        """The model dtype as numpy spells it (ml_dtypes' bfloat16 for bfloat16)."""
        if self.dtype == "bfloat16":
            import ml_dtypes  # pylint: disable=import-outside-toplevel

            return ml_dtypes.bfloat16
        return np.dtype(self.dtype)

    @property
    def uses_cublas(self) -> bool:
        """CUDA libraries compiled with `--gemm cublas` (the runtime's cuBLAS extern)."""
        return self.target_kind == "cuda" and self.compile_options.get("gemm") == "cublas"

    @property
    def bounded_prefill_memory(self) -> bool:
        """prefill and embed planned at their bounds (compiled with bounded_prefill_memory): prefills
        of at most prefill_chunk_size tokens (and max_batch_size sequences) only."""
        return bool(self.compile_options.get("bounded_prefill_memory"))

    @property
    def cuda_graph(self) -> bool:
        """Decode captured in CUDA graphs (CUDA libraries compiled with --cuda-graph)."""
        return self.target_kind == "cuda" and bool(self.compile_options.get("cuda_graph"))


def read_compiled_config(model_dir: str | Path, device: str) -> dict[str, Any]:
    """The folder's mlc-lora-config.json (as a dict), checked to be a compiled model for `device`."""
    return CompiledConfig.read(model_dir, device).raw
