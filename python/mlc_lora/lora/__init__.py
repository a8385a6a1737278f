"""LoRA adapters: PEFT loading, page layout in the unified pool, per-batch tables.

Flow: `mlc_lora compile ... --max-lora-rank R --lora-pool-pages N` records a `LoraSpec` under "lora"
in mlc-lora-config.json; `pack_peft_adapter(folder, config)` reads a PEFT folder and returns the
`PackedAdapter` that `mlc_lora.runtime.pool_load_adapter` takes; the pool then builds the per-batch
tables that the compiled prefill/decode read (`ModelRunner.prefill(..., lora="pool")`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import LoraError
from .layout import LoraSpec, PackedAdapter, pack_adapter
from .peft import load_peft_adapter


def pack_peft_adapter(folder: str | Path, compiled_config: dict[str, Any],
                      name: str | None = None, shard: int = 0) -> PackedAdapter:
    """A PEFT adapter folder -> pool input, for the model of `compiled_config` (its JSON config);
    under tensor parallelism, the input of shard `shard`'s pool."""
    from ..models.llama import LlamaConfig  # pylint: disable=import-outside-toplevel

    if not compiled_config.get("lora"):
        raise LoraError(f"model {compiled_config.get('model_name')!r} was compiled without LoRA; "
                        "recompile with --max-lora-rank and --lora-pool-pages")
    spec = LoraSpec.from_json(compiled_config["lora"])
    cfg = LlamaConfig(**compiled_config["model_config"])
    dtype = compiled_config["dtype"]
    if dtype == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        dtype = ml_dtypes.bfloat16
    return pack_adapter(spec, load_peft_adapter(folder, cfg, spec, name), dtype, shard)


__all__ = ["LoraSpec", "PackedAdapter", "load_peft_adapter", "pack_adapter", "pack_peft_adapter"]
