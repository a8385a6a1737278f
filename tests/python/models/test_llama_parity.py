"""Compiled Llama logits against HF transformers (torch, float32) on tiny random configs."""

import numpy as np
import pytest
import torch

from mlc_lora.runner import ModelRunner

from ..conftest import TINY_CONFIGS

PROMPTS = [[1, 5, 7, 9, 3, 11, 2], [2, 4, 6], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]


def _hf_last_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].numpy()


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_ragged_prefill_and_decode_match_hf(tiny_models, name):
    hf, compiled = tiny_models[name]
    r = ModelRunner(compiled)
    kv = r.create_pool(max_batch_size=8, max_total_seq_len=512, prefill_chunk_size=256)
    seq_ids = [0, 1, 2]
    for s in seq_ids:
        kv.add_sequence(s)
    # One ragged prefill of three sequences of different lengths.
    logits = r.prefill(kv, seq_ids, PROMPTS).numpy()
    assert logits.shape == (3, TINY_CONFIGS[name]["vocab_size"])
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(logits[i], _hf_last_logits(hf, p), atol=1e-4, rtol=0)
    # Several decode steps at batch 3, then at batch 2 after one sequence leaves.
    seqs = [list(p) for p in PROMPTS]
    rng = np.random.default_rng(0)
    for step in range(4):
        active = seq_ids if step < 2 else [0, 2]
        if step == 2:
            kv.remove_sequence(1)
        nxt = rng.integers(0, TINY_CONFIGS[name]["vocab_size"], len(active)).tolist()
        out = r.decode(kv, active, nxt).numpy()
        for row, s in enumerate(active):
            seqs[s].append(nxt[row])
            np.testing.assert_allclose(out[row], _hf_last_logits(hf, seqs[s]), atol=1e-4, rtol=0)


def test_prefill_chunks_continue_a_sequence(tiny_models):
    """A prompt prefilled in two chunks gives the same logits as in one."""
    hf, compiled = tiny_models["gqa"]
    r = ModelRunner(compiled)
    kv = r.create_pool(max_batch_size=4, max_total_seq_len=256, prefill_chunk_size=64)
    kv.add_sequence(7)
    p = PROMPTS[2]
    r.prefill(kv, [7], [p[:9]])
    last = r.prefill(kv, [7], [p[9:]]).numpy()[0]
    np.testing.assert_allclose(last, _hf_last_logits(hf, p), atol=1e-4, rtol=0)


def test_rope_scaling_kinds():
    """linear scales the positions (HF parity above: `linear_rope`); llama3 goes to TVM's RoPE
    kernels; the others are refused by name."""
    from mlc_lora.errors import ModelConfigError
    from mlc_lora.models.llama import LlamaConfig

    base = dict(TINY_CONFIGS["gqa"])
    lin = LlamaConfig(**base, rope_scaling={"type": "linear", "factor": 4.0})
    assert lin.rope_scale == 0.25 and lin.rope_scaling_dict == {}
    l3 = LlamaConfig(**TINY_CONFIGS["llama3"])
    assert l3.rope_scale == 1.0 and l3.rope_scaling_dict["rope_type"] == "llama3"
    for kind in ("dynamic", "yarn"):
        with pytest.raises(ModelConfigError, match=f"'{kind}'.*supported: linear, llama3"):
            LlamaConfig(**base, rope_scaling={"rope_type": kind, "factor": 2.0}).rope_scaling_dict
    with pytest.raises(ModelConfigError, match="factor > 0"):
        LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 0}).rope_scale
