"""Fixtures of the runner tests: a tiny Llama with LoRA on q/v, compiled unsharded and for 2 shards
with a small pool, and PEFT adapters for it."""

from __future__ import annotations

import pytest

from ..conftest import make_tiny_hf_model, save_adapter

POOL_PAGES = 12
QV = dict(target_modules=["q_proj", "v_proj"])
# name -> (seed, rank, alpha, extra options); pages on one shard: qv8 2, qv4 1, qv64 14 (> the pool)
ADAPTERS = {"qv8": (1, 8, 16, {}), "qv4": (2, 4, 4, {"use_rslora": True}), "qv64": (3, 64, 16, {})}


@pytest.fixture(scope="session")
def qv_models(tmp_path_factory, compile_once):
    """(root, {shards: compiled dir}, {name: PEFT reference}) for K = 1 and 2."""
    from mlc_lora.compile import CompileOptions

    root = tmp_path_factory.mktemp("runner-qv")
    base = make_tiny_hf_model(root / "hf", "gqa")
    refs = {None: base}
    for name, (seed, r, alpha, extra) in ADAPTERS.items():
        refs[name] = save_adapter(base, root / name, seed, r=r, lora_alpha=alpha, **QV, **extra)
    compiled = {k: compile_once(root / "hf", CompileOptions(
        prefill_chunk_size=64, max_batch_size=8, lora_pool_pages=POOL_PAGES, max_lora_rank=64,
        lora_target_modules=["q_proj", "v_proj"], tensor_parallel_shards=k)) for k in (1, 2)}
    return root, compiled, refs
