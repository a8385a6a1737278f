"""SmolLM2-135M-Instruct end to end: the compiled embedded model against HF transformers."""

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from mlc_lora.loader import resolve_model
from mlc_lora.runner import ModelRunner

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


@pytest.fixture(scope="module")
def runner(smollm2_compiled):
    return ModelRunner(smollm2_compiled)


@pytest.fixture(scope="module")
def tokenizer(smollm2_compiled):
    return Tokenizer.from_file(str(smollm2_compiled / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model():
    """transformers' Llama built from our GGUF-derived config, holding the same dequantized weights."""
    src = resolve_model("smollm2-135m")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**src.config))
    state = {k: torch.from_numpy(np.array(v)) for k, v in src.weights()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # The RoPE tables are buffers, not weights: rebuild them off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model.eval()


def _assert_close(ours, ref, what):
    # float32 through 30 layers in different summation orders: we measured at most ~6e-6 of the
    # logit scale (|logits| ~ 20-40); 2e-5 of it still fails on any real error (those are O(1)).
    atol = 2e-5 * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=atol, rtol=0, err_msg=what)
    assert ours.argmax() == ref.argmax(), what


def test_ragged_prefill_and_decode_match_hf(runner, tokenizer, hf_model):
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    assert len({len(i) for i in ids}) > 1  # a ragged batch
    kv = runner.create_pool(max_batch_size=4, max_total_seq_len=1024, prefill_chunk_size=256)
    seq_ids = list(range(len(ids)))
    for s in seq_ids:
        kv.add_sequence(s)
    seqs = [list(p) for p in ids]
    out = runner.prefill(kv, seq_ids, ids).numpy()
    assert out.shape == (3, 49152)
    steps = [("prefill", out)]  # (what, logits (b, V) at each sequence's last token)
    for step in range(3):
        nxt = out.argmax(axis=1).tolist()
        for s in seq_ids:
            seqs[s].append(nxt[s])
        out = runner.decode(kv, seq_ids, nxt).numpy()
        steps.append((f"decode step {step}", out))
    # One causal HF forward over each final sequence gives the reference of every step.
    for s, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq])).logits[0].numpy()
        for k, (what, logits) in enumerate(steps):
            _assert_close(logits[s], ref[len(ids[s]) - 1 + k], f"{what}, prompt {s}")


def test_greedy_continuation_knows_paris(runner, tokenizer):
    kv = runner.create_pool(max_batch_size=1, max_total_seq_len=256, prefill_chunk_size=64)
    kv.add_sequence(0)
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False).ids
    nxt = int(runner.prefill(kv, [0], [prompt]).numpy()[0].argmax())
    generated = []
    for _ in range(8):
        generated.append(nxt)
        nxt = int(runner.decode(kv, [0], [nxt]).numpy()[0].argmax())
    assert "Paris" in tokenizer.decode(generated)
