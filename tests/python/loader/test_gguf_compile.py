"""A GGUF compiled end to end: the Llama-3 RoPE scaling recovered from rope_freqs drives TVM's RoPE."""

import numpy as np
import torch

from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.runner import ModelRunner

from ..conftest import make_tiny_hf_model
from .gguf_writer import write_llama_gguf


def test_compiled_llama3_gguf_matches_original_hf(tmp_path):
    hf = make_tiny_hf_model(tmp_path / "hf", "llama3")
    path = write_llama_gguf(tmp_path / "tiny-llama3.gguf", hf)  # F32 weights: exact
    out = compile_model(path, tmp_path / "llvm", CompileOptions(prefill_chunk_size=128, max_batch_size=4),
                        progress=False)
    r = ModelRunner(out)
    # Past original_max_position_embeddings (64), where the scaled low frequencies matter.
    prompts = [list(np.random.default_rng(0).integers(0, 112, 150)), [3, 1, 4, 1, 5]]
    kv = r.create_pool(max_batch_size=4, max_total_seq_len=512, prefill_chunk_size=128)
    for s in (0, 1):
        kv.add_sequence(s)
    # two chunks of sequence 0 (so positions > 128 too), then both together
    r.prefill(kv, [0], [prompts[0][:100]])
    logits = r.prefill(kv, [0, 1], [prompts[0][100:], prompts[1]]).numpy()
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([[int(t) for t in p]])).logits[0, -1].numpy()
            np.testing.assert_allclose(logits[i], ref, atol=1e-4, rtol=0)
