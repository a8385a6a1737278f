"""Write GGUF files the way llama.cpp's convert_hf_to_gguf.py does, for the loader tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def byte_level_vocab(n: int) -> tuple[list[str], list[int], list[str]]:
    """n tokens: 2 control tokens, printable ASCII (space as GPT-2's "Ġ"), merges, unused fillers."""
    chars = ["Ġ"] + [chr(c) for c in range(33, 127)]
    tokens = ["<|endoftext|>", "<|im_start|>"] + chars
    types = [3, 3] + [1] * len(chars)
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "c"),
                 ("a", "t"), ("Ġc", "at"), ("o", "n"), ("Ġ", "s"), ("Ġs", "at")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    assert len(tokens) <= n, (len(tokens), n)
    types += [5] * (n - len(tokens))
    tokens += [f"<unused{i}>" for i in range(n - len(tokens))]
    return tokens, types, merges


def write_llama_gguf(path: Path, hf_model, qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
                     arch: str = "llama", tokens=None, permute: bool = True) -> Path:
    """Save a transformers LlamaForCausalLM as GGUF; `qtypes` maps HF names to quantization types."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    toks, types, merges = tokens or byte_level_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if rope.get("rope_type") == "llama3":
        # llama.cpp stores Llama-3 RoPE scaling as per-frequency divisors of the plain frequencies.
        plain = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        scaled = hf_model.model.rotary_emb.inv_freq.double().numpy()
        w.add_tensor("rope_freqs.weight", (plain / scaled).astype(np.float32))
    qtypes = qtypes or {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if not permute:
            pass
        elif name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        q = qtypes.get(name, gguf.GGMLQuantizationType.F32)
        if q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), arr)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
