"""The plain-PyTorch Llama the model benchmarks compare against (bench_decode's prefill speed,
bench_lora_throughput's logits check): cuBLAS linears, SDPA attention, HF's RoPE and RMSNorm, on the
parameters of our compiled models (fused qkv_proj and gate_up_proj, names as param_names).

Semantics: HF LlamaForCausalLM's forward of each prompt, causal, no cache, last-token logits;
with a LoRA adapter, each targeted module's output gets + scale * (x @ A^T) @ B^T (PEFT's LoRA).
"""

from __future__ import annotations


class TorchLlama:
    """`params` {name: tensor} of the model config `mc` (an mlc-lora-config's model_config), computed
    in `dtype` (default: the parameters' own). RMSNorm squares in float32, as HF does."""

    def __init__(self, params: dict, mc: dict, torch, dtype=None):
        self.t, self.mc = torch, mc
        self.dtype = dtype or next(iter(params.values())).dtype
        self.p = {n: v.to(self.dtype) for n, v in params.items()}
        self.device = next(iter(self.p.values())).device

    def _rope_tables(self, n: int):
        t, d = self.t, self.mc["head_dim"]
        inv = 1.0 / (self.mc["rope_theta"] ** (t.arange(0, d, 2, device=self.device, dtype=t.float32) / d))
        ang = t.outer(t.arange(n, device=self.device, dtype=t.float32), inv)
        ang = t.cat([ang, ang], dim=-1)
        return ang.cos().to(self.dtype), ang.sin().to(self.dtype)

    def norm(self, x, w):
        xf = x.float()
        return (xf * self.t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.mc["rms_norm_eps"])).to(self.dtype) * w

    def _linear(self, v, layer: int, name: str, modules, adapter):
        """v @ W^T for the fused parameter `name`, plus the adapter's delta of each of its `modules`
        (the parts of the fused output, in order) that the adapter targets."""
        y = self.t.nn.functional.linear(v, self.p[name])
        if adapter is None or not any(m in adapter.modules for m in modules):
            return y
        mc = self.mc
        d = mc["head_dim"]
        widths = ([mc["num_attention_heads"] * d, mc["num_key_value_heads"] * d, mc["num_key_value_heads"] * d]
                  if len(modules) == 3 else [y.shape[-1] // len(modules)] * len(modules))
        parts = []
        for m, w in zip(modules, widths):
            if m in adapter.modules:
                a, bt = (self.t.as_tensor(z, device=self.device, dtype=self.dtype) for z in adapter.weights[(layer, m)])
                parts.append(adapter.scales[m] * (v @ a.T) @ bt)
            else:
                parts.append(self.t.zeros(*v.shape[:-1], w, device=self.device, dtype=self.dtype))
        return y + self.t.cat(parts, -1)

    def prefill(self, ids, adapter=None):
        """ids (B, S) int64 -> the last token's logits (B, V) in float32; `adapter`: a
        mlc_lora.lora.peft.LoraAdapter (weights[(layer, module)] = (A (r, in), B^T (r, out)))."""
        t, p, mc = self.t, self.p, self.mc
        F = t.nn.functional
        nh, nkv, d = mc["num_attention_heads"], mc["num_key_value_heads"], mc["head_dim"]
        b, s = ids.shape
        cos, sin = self._rope_tables(s)

        def rope(v):  # (B, heads, S, D)
            return v * cos + t.cat([-v[..., d // 2:], v[..., :d // 2]], dim=-1) * sin

        x = F.embedding(ids, p["model.embed_tokens.weight"])
        for layer in range(mc["num_hidden_layers"]):
            pre = f"model.layers.{layer}."
            qkv = self._linear(self.norm(x, p[pre + "input_layernorm.weight"]), layer, pre + "self_attn.qkv_proj.weight",
                               ("q_proj", "k_proj", "v_proj"), adapter)
            qkv = qkv.view(b, s, nh + 2 * nkv, d).transpose(1, 2)
            q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
            o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=nh != nkv)
            x = x + self._linear(o.transpose(1, 2).reshape(b, s, nh * d), layer, pre + "self_attn.o_proj.weight",
                                 ("o_proj",), adapter)
            gu = self._linear(self.norm(x, p[pre + "post_attention_layernorm.weight"]), layer,
                              pre + "mlp.gate_up_proj.weight", ("gate_proj", "up_proj"), adapter)
            gate, up = gu.chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer, pre + "mlp.down_proj.weight", ("down_proj",), adapter)
        x = self.norm(x[:, -1], p["model.norm.weight"])
        return F.linear(x, p["lm_head.weight"]).float()
