"""GGUF files (llama.cpp's format): metadata -> HF-style config, tensors -> HF-named float32 weights.

GGUF lists a tensor's dims fastest-first, so (out, in) in numpy order is dims reversed; llama.cpp's
converter also permutes the rows of q_proj (with n_head) and k_proj (with n_head_kv) so that its
RoPE can rotate adjacent pairs. Both are undone here, so the weights come out exactly as in HF.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import ModelConfigError, WeightError
from .gguf_file import read_gguf
from .gguf_tokenizer import gguf_tokenizer
from .model_source import ModelSource

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a llama GGUF tensor; WeightError for a tensor the Llama model has no place for."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"
    raise WeightError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama model")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows: per head, halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_qk: interleaved pairs -> HF's rotate-half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path) -> ModelSource:
    """A llama-architecture GGUF as a ModelSource; weights() dequantizes one tensor at a time."""
    path = Path(path)
    gf = read_gguf(path)
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelConfigError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; mlc-lora reads llama GGUF files"
        )
    tensors = gf.tensors
    config = llama_config(meta, tensors, path.name)
    names = {}  # gguf name -> hf name, checked before anything is dequantized
    for name in tensors:
        if name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        names[name] = hf_tensor_name(name)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    def weights() -> Iterator[tuple[str, np.ndarray]]:
        for gname, hname in names.items():
            arr = dequantize_tensor(tensors[gname])
            heads = n_head if hname.endswith("q_proj.weight") else n_kv if hname.endswith("k_proj.weight") else 0
            if heads:
                if arr.ndim != 2 or arr.shape[0] % (2 * heads):
                    raise WeightError(f"weight {hname!r} (GGUF {gname!r}) has shape {arr.shape}: its rows "
                                      f"are not {heads} heads of an even head_dim")
                arr = unpermute_qk(arr, heads)
            yield hname, arr

    tokenizer_json, tokenizer_config = gguf_tokenizer(meta)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tokenizer_config:
            config[key] = tokenizer_config[key]
    return ModelSource(
        name=path.stem,
        config=config,
        weights=weights,
        num_weights=len(names),
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
    )


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF tensor (gguf_file.GGUFTensor or gguf-py's ReaderTensor) as float32, numpy dim order."""
    from gguf import GGMLQuantizationType as Q  # pylint: disable=import-outside-toplevel
    from gguf.quants import dequantize  # pylint: disable=import-outside-toplevel

    shape = tuple(reversed([int(d) for d in t.shape]))
    if t.tensor_type == Q.F64:
        return t.data.view("<f8").astype(np.float32).reshape(shape)
    if t.tensor_type in (Q.I8, Q.I16, Q.I32, Q.I64):
        raise WeightError(f"GGUF tensor {t.name!r} holds integers ({t.tensor_type.name}), not weights")
    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise WeightError(f"GGUF tensor {t.name!r}: cannot dequantize {t.tensor_type.name}: {e}") from e
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def llama_config(meta: dict[str, Any], tensors: dict, name: str) -> dict[str, Any]:
    """HF LlamaConfig-style dict from llama.* metadata."""

    def get(key, default=None, required=False):
        v = meta.get(f"llama.{key}", default)
        if v is None and required:
            raise ModelConfigError(f"{name}: GGUF metadata lacks llama.{key}")
        if isinstance(v, list):  # per-layer values: only uniform layers are supported
            if len(set(v)) != 1:
                raise ModelConfigError(f"{name}: llama.{key} differs between layers ({v}); not supported")
            v = v[0]
        return v

    if get("expert_count", 0):
        raise ModelConfigError(f"{name}: mixture-of-experts llama GGUF files are not supported")
    n_head = get("attention.head_count", required=True)
    hidden = get("embedding_length", required=True)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_attention_heads": n_head,
        "num_key_value_heads": get("attention.head_count_kv", n_head),
        "num_hidden_layers": get("block_count", required=True),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelConfigError(f"{name}: GGUF file has no token_embd.weight tensor")
    cfg["vocab_size"] = int(emb.shape[1])  # dims are fastest-first: (hidden, vocab)
    head_dim = get("attention.key_length")
    if head_dim is not None:
        if get("attention.value_length", head_dim) != head_dim:
            raise ModelConfigError(f"{name}: key_length != value_length is not supported")
        cfg["head_dim"] = head_dim
    head_dim = head_dim or hidden // n_head
    rot = get("rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise ModelConfigError(f"{name}: partial RoPE (rope.dimension_count {rot} < head_dim {head_dim}) "
                               "is not supported")
    scaling = _rope_scaling(meta, tensors, cfg, head_dim, name)
    if scaling:
        cfg["rope_scaling"] = scaling
    return cfg


def _rope_scaling(meta, tensors, cfg, head_dim, name) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor") or meta.get("llama.rope.scale_linear")
    if "rope_freqs.weight" in tensors:
        return _llama3_from_freq_factors(dequantize_tensor(tensors["rope_freqs.weight"]), cfg, head_dim, name)
    if kind in (None, "none") and not factor:
        return None
    scaling = {"rope_type": kind or "linear", "factor": float(factor or 1.0)}
    orig = meta.get("llama.rope.scaling.original_context_length")
    if orig:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _llama3_from_freq_factors(factors: np.ndarray, cfg, head_dim, name) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor (per-frequency divisors).

    llama3 divides frequency f by 1 (high f), by `factor` (low f) or, in between, by
    1 / ((1 - s) / factor + s) with s = (L / wavelen - lo) / (hi - lo), linear in 1/wavelen.
    The in-between points give s's slope and intercept, which fix lo and hi for a chosen L.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    theta = cfg["rope_theta"]
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * np.pi)
    if factors.shape != inv_wavelen.shape:
        raise ModelConfigError(f"{name}: rope_freqs has {factors.size} values, expected {inv_wavelen.size}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return {}
    tol = 1e-5
    high = factors < 1 + tol
    low = factors > factor * (1 - tol)
    mid = ~high & ~low
    if factor <= 1 + tol:
        raise ModelConfigError(f"{name}: rope_freqs does not follow Llama-3 RoPE scaling; not supported")
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(inv_wavelen[mid], s[mid], 1)
    else:
        # Too few in-between points to fit: any line through them that puts every high frequency
        # at s >= 1 and every low one at s <= 0 reproduces the same divisors; take the flattest.
        x0, s0 = (inv_wavelen[mid][0], s[mid][0]) if mid.any() else (inv_wavelen[low].max(), 0.0)
        slopes = [1e-12]
        if high.any():
            slopes.append((1 - s0) / (inv_wavelen[high].min() - x0))
        if low.any() and inv_wavelen[low].max() < x0:
            slopes.append(s0 / (x0 - inv_wavelen[low].max()))
        slope = max(slopes)
        intercept = s0 - slope * x0
    sm = np.clip(slope * inv_wavelen + intercept, 0, 1)
    if slope <= 0 or not np.allclose(1 / ((1 - sm) / factor + sm), factors, rtol=1e-4):
        raise ModelConfigError(f"{name}: rope_freqs does not follow Llama-3 RoPE scaling; not supported")
    orig = min(8192, cfg["max_position_embeddings"])  # any L gives the same divisors; Llama 3.x used 8192
    return {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": orig,
            "low_freq_factor": float(-intercept * orig / slope),
            "high_freq_factor": float((1 - intercept) * orig / slope)}
