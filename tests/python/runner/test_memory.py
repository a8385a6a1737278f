"""Resident memory stays bounded while a runner sees prompts of ever new lengths: the VM's pooled
allocator keeps a buffer of every size it has freed, so without a bounded memory plan each new
prefill length leaves megabytes behind (scripts/soak.py `alloc` measures the plans on SmolLM2)."""

from __future__ import annotations

import json

import pytest

import soak
from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.contract import CONFIG_FILE

LENGTHS = 40
MARGIN_MB = 24  # what a runner may add after warm-up over LENGTHS new prompt lengths


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A 2-layer Llama wide enough (hidden 256, MLP 1024) that one prefill's buffers are megabytes,
    prefill's memory planned per token count (not the default)."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                                   num_key_value_heads=4, num_hidden_layers=2, vocab_size=256,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "hf", safe_serialization=True)
    return compile_model(root / "hf", root / "llvm", CompileOptions(prefill_chunk_size=512, max_batch_size=4,
                                                                   context_window_size=1024,
                                                                   bounded_prefill_memory=False), progress=False)


def test_memory_stays_bounded_over_new_prompt_lengths(wide_model):
    default = soak.plan_in_subprocess(wide_model, "default", LENGTHS)
    assert default["allocator"] == "naive"
    assert default["rss_growth_mb"] < MARGIN_MB, default
    assert default["rss_after_repeat_mb"] < MARGIN_MB, default
    # the measurement can fail: TVM's pooled allocator grows past the margin on the same prompts
    pooled = soak.plan_in_subprocess(wide_model, "pooled", LENGTHS)
    assert pooled["rss_growth_mb"] > 4 * MARGIN_MB, pooled


def test_pooled_allocator_released_after_a_bounded_number_of_sizes(wide_model):
    """The pooled allocator (the CUDA default) as ModelRunner drives it: its cached buffers are
    released after POOLED_PREFILL_SIZES new prefill sizes, so it holds a few sizes' worth, not one per
    length (the pooled figure of the test above: > 4 margins)."""
    released = soak.plan_in_subprocess(wide_model, "released", LENGTHS)
    assert released["allocator"] == "pooled"
    assert released["rss_after_repeat_mb"] < 4 * MARGIN_MB, released


@pytest.fixture(scope="module")
def bounded_model(wide_model, tmp_path_factory):
    """The wide model compiled with prefill's and embed's memory planned at their bounds (the default)."""
    root = tmp_path_factory.mktemp("bounded")
    out = compile_model(wide_model.parent / "hf", root / "llvm",
                        CompileOptions(prefill_chunk_size=512, max_batch_size=4, context_window_size=1024),
                        progress=False)
    assert json.loads((out / CONFIG_FILE).read_text())["compile_options"]["bounded_prefill_memory"] is True
    return out


def test_bounded_prefill_memory_stays_bounded_without_releases(bounded_model):
    """With prefill planned at the chunk's bound TVM's pooled allocator, never released, holds no
    more over the new lengths than the naive one does (the pooled figure of the first test: > 4
    margins), and the runner does not release it."""
    pooled = soak.plan_in_subprocess(bounded_model, "pooled", LENGTHS)
    assert pooled["allocator"] == "pooled"
    assert pooled["rss_growth_mb"] < MARGIN_MB, pooled
    assert pooled["rss_after_repeat_mb"] < MARGIN_MB, pooled


def test_bounded_prefill_memory_gives_the_same_logits_and_refuses_longer_prefills(wide_model, bounded_model):
    import numpy as np

    from mlc_lora.errors import MLCLoraError
    from mlc_lora.runner import ModelRunner

    a, b = ModelRunner(wide_model), ModelRunner(bounded_model)
    assert b.pooled_prefill_sizes == 0 and a.pooled_prefill_sizes > 0
    rng = np.random.default_rng(1)
    kv_a, kv_b = a.create_pool(4, 1024, 512), b.create_pool(4, 1024, 512)
    for n in (37, 250, 1):  # two sequences of n tokens (at most the 512 of the chunk)
        for s in range(2):
            kv_a.add_sequence(s)
            kv_b.add_sequence(s)
        toks = [rng.integers(0, a.vocab_size, n).tolist() for _ in range(2)]
        # every position's logits (prompt logprobs): 2n rows, more than the 4 sequences of the bound
        pos = [list(range(n))] * 2 if n == 250 else None
        np.testing.assert_allclose(b.prefill(kv_b, [0, 1], toks, positions=pos).numpy(),
                                   a.prefill(kv_a, [0, 1], toks, positions=pos).numpy(), rtol=0, atol=1e-5)
        for s in range(2):
            kv_a.remove_sequence(s)
            kv_b.remove_sequence(s)
    kv_b.add_sequence(0)
    with pytest.raises(MLCLoraError, match="at most 512 tokens"):
        b.prefill(kv_b, [0], [[1] * 513])
    with pytest.raises(MLCLoraError, match="at most 512"):
        b.create_pool(4, 2048, 1024)
    with pytest.raises(MLCLoraError, match="over 4 sequences"):
        b.create_pool(8, 1024, 512)
