"""Hugging Face weight names and layouts -> the parameters of models/llama.py.

Pure numpy (no TVM import), so weights can also be converted where only TVM's runtime exists.
`cfg` is a LlamaConfig or anything with the same attributes.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from ..errors import WeightError




def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter of LlamaForCausalLM with its shape, in export order."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}"
        shapes[f"{p}.self_attn.qkv_proj.weight"] = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * d)
        shapes[f"{p}.mlp.gate_up_proj.weight"] = (2 * i, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


# Our fused parameters and the HF tensors they concatenate (along the output rows).
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def hf_param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The shape every Hugging Face tensor must have."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}"
        out.update({
            f"{p}.self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            f"{p}.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            f"{p}.mlp.gate_proj.weight": (i, h),
            f"{p}.mlp.up_proj.weight": (i, h),
            f"{p}.mlp.down_proj.weight": (h, i),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        })
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def convert_hf_weights(
    cfg, hf: Iterable[tuple[str, np.ndarray]], dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """Check every HF tensor's shape (naming the offender) and yield our parameters in `dtype`.

    `hf` yields (name, array) in any order; fused parameters are emitted once all their parts
    have arrived, so at most one layer's q/k/v or gate/up is held at a time.
    """
    want = hf_param_shapes(cfg)
    pending: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    part_of = {}
    for l in range(cfg.num_hidden_layers):
        for fused, parts in _FUSED.items():
            for part in parts:
                part_of[f"model.layers.{l}.{part}"] = (f"model.layers.{l}.{fused}",
                                                       [f"model.layers.{l}.{p}" for p in parts])
    np_dtype = _np_dtype(dtype)
    for name, arr in hf:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in want:
            raise WeightError(f"unexpected weight {name!r} (shape {tuple(arr.shape)}) for a Llama model")
        if tuple(arr.shape) != want[name]:
            raise WeightError(
                f"weight {name!r} has shape {tuple(arr.shape)}, expected {want[name]} from config.json"
            )
        seen.add(name)
        if name in part_of:
            fused, parts = part_of[name]
            pending[name] = arr
            if all(p in pending for p in parts):
                yield fused, np.concatenate([pending.pop(p) for p in parts], axis=0).astype(np_dtype)
            continue
        yield name, np.ascontiguousarray(arr).astype(np_dtype)
    missing = sorted(set(want) - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightError(f"missing weights: {', '.join(missing[:5])}{more}")
    if pending:
        raise WeightError(f"incomplete fused weights: {', '.join(sorted(pending))}")


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def shard_param(cfg, name: str, arr: np.ndarray, shard: int) -> np.ndarray:
    """Shard `shard`'s slice of our (whole-model) parameter `name` under tensor parallelism.

    Column-parallel (split by output rows): qkv_proj takes its heads' rows of each of q, k and v;
    gate_up_proj its rows of gate and of up. Row-parallel (split by input columns): o_proj, down_proj.
    Embedding, norms and lm_head are replicated. With one shard this is the identity.
    """
    k = cfg.tensor_parallel_shards
    if k == 1:
        return arr
    d = cfg.head_dim
    if name.endswith("qkv_proj.weight"):
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        parts = np.split(arr, [q, q + kv], axis=0)
    elif name.endswith("gate_up_proj.weight"):
        parts = np.split(arr, 2, axis=0)
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        return np.ascontiguousarray(np.split(arr, k, axis=1)[shard])
    else:
        return arr
    return np.concatenate([np.split(p, k, axis=0)[shard] for p in parts], axis=0)
