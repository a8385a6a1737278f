"""LoRA adapters: PEFT folders, page layout in the unified pool, per-batch tables.

Flow: `mlc_lora compile ... --max-lora-rank R --lora-pool-pages N` records a `LoraSpec` under "lora"
in mlc-lora-config.json; `pack_peft_adapter(folder, config)` reads a PEFT folder and returns the
`PackedAdapter` that `mlc_lora.runtime.pool_load_adapter` takes (`peft_adapter_plan` checks one
without packing it; `layout.pack_adapter` packs a `LoraAdapter` already in memory); the pool then
builds the per-batch tables that the compiled prefill/decode read (`ModelRunner.prefill(...,
lora="pool")`). Reading, layout and packing are the C++ runtime's (src/runtime), one
implementation for Python and the C++ API.
"""

from .layout import LoraModule, LoraSpec, PackedAdapter, layout_adapter, make_spec, pack_adapter
from .peft import AdapterPlan, LoraAdapter, pack_peft_adapter, peft_adapter_plan

__all__ = ["AdapterPlan", "LoraAdapter", "LoraModule", "LoraSpec", "PackedAdapter", "layout_adapter",
           "make_spec", "pack_adapter", "pack_peft_adapter", "peft_adapter_plan"]
