"""LoRA adapters: PEFT loading, page layout in the unified pool, per-batch tables."""
