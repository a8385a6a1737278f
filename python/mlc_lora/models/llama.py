"""Llama-architecture models (Llama 2/3, SmolLM2, Mistral-style configs) as one Relax nn.Module family.

The file holds the config dataclass, the modules, the export spec and the map from Hugging Face
weight names to ours. q/k/v and gate/up are fused into one linear each (``qkv_proj``,
``gate_up_proj``) so that a layer runs four GEMMs; the LoRA passes know the fused row ranges.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.core import wrap_nested
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from ..errors import ModelConfigError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclasses.dataclass
class LlamaConfig:  # pylint: disable=too-many-instance-attributes
    """The subset of a Hugging Face Llama config.json that defines the computation."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    vocab_size: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    # Compile-time sizes, not from the HF config.
    context_window_size: int = 0
    prefill_chunk_size: int = 2048
    max_batch_size: int = 64
    # Megatron-style tensor parallelism over this many GPUs (docs/TP.md); 1 = one device.
    tensor_parallel_shards: int = 1

    def __post_init__(self):
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ModelConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads} and config.json gives no head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        self._check_shards()
        if self.context_window_size == 0:
            self.context_window_size = self.max_position_embeddings
        self.prefill_chunk_size = min(self.prefill_chunk_size, self.context_window_size)

    def _check_shards(self):
        k = self.tensor_parallel_shards
        if not isinstance(k, int) or k < 1:
            raise ModelConfigError(f"tensor_parallel_shards must be a positive integer, got {k!r}")
        # Every shard holds whole heads (and whole KV heads: no KV replication) and an equal slice
        # of the MLP.
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % k:
                raise ModelConfigError(
                    f"cannot split the model over {k} tensor-parallel shards: {name} "
                    f"{getattr(self, name)} is not divisible by {k}"
                )

    def shard(self, n: int) -> int:
        """`n` (heads, intermediate size) divided over the tensor-parallel shards."""
        return n // self.tensor_parallel_shards

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], **overrides) -> "LlamaConfig":
        """Build from a config.json dict; refuses other architectures and features we lack."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if not any(a in ARCHITECTURES for a in archs) and cfg.get("model_type") not in ("llama", "mistral"):
            raise ModelConfigError(
                f"unsupported architecture {archs}: mlc-lora supports {', '.join(ARCHITECTURES)}"
            )
        if cfg.get("sliding_window") and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            # Mistral-v0.1-style sliding window: refuse rather than silently attend to everything.
            raise ModelConfigError(
                f"sliding_window={cfg['sliding_window']} is not supported (set it to null or raise "
                "max_position_embeddings to run without it)"
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ModelConfigError(f"{key}=true is not supported by the Llama model of mlc-lora")
        missing = [f for f in ("hidden_size", "intermediate_size", "num_attention_heads",
                               "num_hidden_layers", "vocab_size") if f not in cfg]
        if missing:
            raise ModelConfigError(f"config.json lacks required fields: {', '.join(missing)}")
        cfg = dict(cfg)
        # transformers >= 5 writes RoPE settings as one `rope_parameters` dict.
        rope = cfg.pop("rope_parameters", None)
        if rope:
            rope = dict(rope)
            cfg.setdefault("rope_theta", rope.pop("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                cfg["rope_scaling"] = rope
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if k in names and v is not None}
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)

    def _rope_scaling(self) -> dict[str, Any]:
        """rope_scaling with the older `type` key read as `rope_type`."""
        rs = dict(self.rope_scaling or {})
        if "type" in rs and "rope_type" not in rs:
            rs["rope_type"] = rs.pop("type")
        return rs

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        rs = self._rope_scaling()
        if rs.get("rope_type") in (None, "default", "linear"):  # linear: rope_scale below
            return {}
        if rs["rope_type"] != "llama3":
            raise ModelConfigError(f"unsupported rope_scaling type {rs['rope_type']!r} "
                                   "(supported: linear, llama3)")
        return rs

    @property
    def rope_scale(self) -> float:
        """Multiplier of the positions in RoPE: 1 / factor for linear scaling (position
        interpolation), else 1."""
        rs = self._rope_scaling()
        if rs.get("rope_type") != "linear":
            return 1.0
        factor = float(rs.get("factor", 1.0))
        if not factor > 0:
            raise ModelConfigError(f"linear rope_scaling needs a factor > 0, got {rs.get('factor')!r}")
        return 1.0 / factor

    @property
    def qkv_out(self) -> int:
        """Rows of one shard's fused qkv_proj."""
        return self.shard(self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim


def _allreduce(x: Tensor, cfg: LlamaConfig) -> Tensor:
    """Sum of the shards' partial outputs of a row-parallel linear (o_proj, down_proj)."""
    return op.ccl_allreduce(x, "sum") if cfg.tensor_parallel_shards > 1 else x


class LlamaMLP(nn.Module):
    """gate_up_proj is column-parallel, down_proj row-parallel (one all-reduce)."""

    def __init__(self, cfg: LlamaConfig):
        i = cfg.shard(cfg.intermediate_size)
        self.cfg = cfg
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return _allreduce(self.down_proj(op.silu(gate) * up), self.cfg)


class LlamaAttention(nn.Module):
    """A shard's heads: qkv_proj is column-parallel, o_proj row-parallel (one all-reduce)."""

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self.num_q = cfg.shard(cfg.num_attention_heads)
        self.num_kv = cfg.shard(cfg.num_key_value_heads)
        self.head_dim = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.qkv_out, bias=False)
        self.o_proj = nn.Linear(self.num_q * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q + 2 * self.num_kv, self.head_dim))
        # RoPE, the KV append and paged attention all happen inside the cache call.
        o = kv.attention_with_fused_qkv(layer_id, qkv, self.num_q, sm_scale=self.head_dim**-0.5)
        return _allreduce(self.o_proj(op.reshape(o, (b, s, self.num_q * self.head_dim))), self.cfg)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, h: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), kv, layer_id)
        return h + self.mlp(self.post_attention_layernorm(h))


def take_clipped(x: Tensor, indices: Tensor, axis: int) -> Tensor:
    """`op.take` in TVM's "clip" mode: an index outside the axis is clamped into it.

    nn's `op.take` (and so `nn.Embedding`) emits relax.take's default "fast" mode, whose lowering
    (topi.take) prints "Fast mode segfaults when there are out-of-bounds indices" for each take on
    every compile. The indices here are in range by construction (the engine checks prompt token ids
    against the vocabulary and builds the logit positions itself), so the clamp never changes a
    result, costs one min/max per index, and keeps a bad index from reading outside the tensor.
    """
    return wrap_nested(relax.op.take(x._expr, indices._expr, axis, mode="clip"), "take")


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, h: Tensor, kv: PagedKVCache) -> Tensor:
        for i, layer in enumerate(self.layers):
            h = layer(h, kv, i)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):  # pylint: disable=too-many-instance-attributes
    """Embed / ragged prefill / batched decode over a paged KV cache; logits in float32."""

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.dtype = "float32"

    def to(self, dtype: str | None = None):
        super().to(dtype=dtype)
        if dtype is not None:
            self.dtype = dtype

    def _logits(self, h: Tensor) -> Tensor:
        if self.tie_word_embeddings:
            logits = op.matmul(h, op.permute_dims(self.model.embed_tokens.weight))
        else:
            logits = self.lm_head(h)
        return logits.astype("float32") if logits.dtype != "float32" else logits

    def embed(self, input_ids: Tensor) -> Tensor:
        return take_clipped(self.model.embed_tokens.weight, input_ids, axis=0)  # (n,) -> (n, H)

    def prefill(self, input_embed: Tensor, logit_positions: Tensor, paged_kv_cache: PagedKVCache):
        """input_embed (1, n, H): the tokens of every sequence, concatenated in begin_forward order;
        logit_positions (b,): index of each sequence's last token. Returns logits (1, b, V)."""
        h = self.model(input_embed, paged_kv_cache)
        h = take_clipped(h, logit_positions, axis=1)
        return self._logits(h), paged_kv_cache

    def decode(self, input_embed: Tensor, paged_kv_cache: PagedKVCache):
        """input_embed (b, 1, H), one token per sequence. Returns logits (b, 1, V)."""
        h = self.model(input_embed, paged_kv_cache)
        return self._logits(h), paged_kv_cache

    def create_paged_kv_cache(  # pylint: disable=too-many-arguments
        self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window
    ) -> PagedKVCache:
        cfg = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, cfg.num_hidden_layers]),
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.shard(cfg.num_attention_heads),
            num_key_value_heads=cfg.shard(cfg.num_key_value_heads),
            qk_head_dim=cfg.head_dim,
            v_head_dim=cfg.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=cfg.rope_scale,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling_dict,
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=cfg.head_dim,
            enable_disaggregation=False,
            dtype=self.dtype,
            target=_current_target(),
        )

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        h, dt = self.cfg.hidden_size, self.dtype
        packed = {"param_mode": "packed", "effect_mode": "none"}
        spec = {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {
                "input_embed": nn.spec.Tensor([1, "seq_len", h], dt),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "paged_kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": packed,
            },
            "decode": {
                "input_embed": nn.spec.Tensor(["batch_size", 1, h], dt),
                "paged_kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": packed,
            },
            "create_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        return nn.spec.ModuleSpec.from_raw(spec, self)


def _current_target():
    import tvm  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.current(allow_none=True)
    return target if target is not None else tvm.target.Target("llvm")


# The Hugging Face names of the linear layers inside our fused parameters, with their row ranges,
# so that LoRA targets (q_proj, gate_proj, ...) can be located in the fused outputs.
# Sizes are one tensor-parallel shard's (the whole model when tensor_parallel_shards is 1).
def fused_linear_parts(cfg: LlamaConfig) -> dict[str, list[tuple[str, int, int]]]:
    q = cfg.shard(cfg.num_attention_heads) * cfg.head_dim
    kv = cfg.shard(cfg.num_key_value_heads) * cfg.head_dim
    i = cfg.shard(cfg.intermediate_size)
    return {
        "qkv_proj": [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)],
        "gate_up_proj": [("gate_proj", 0, i), ("up_proj", i, 2 * i)],
        "o_proj": [("o_proj", 0, cfg.hidden_size)],
        "down_proj": [("down_proj", 0, cfg.hidden_size)],
    }


def kv_bytes_per_token(cfg: LlamaConfig, dtype: str) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * np.dtype(
        "float16" if dtype == "bfloat16" else dtype).itemsize



# The names compile.py looks up in every model file.
Config = LlamaConfig
Model = LlamaForCausalLM
