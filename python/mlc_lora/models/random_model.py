"""Benchmark models with seeded random weights: compiled here, weights made on the device.

Nothing is downloaded and no 13 GB of weights travel: `build` compiles a Llama-shaped library and
writes its mlc-lora-config.json (no params file); `make_params` makes the weights with torch on
the device the model runs on (N(0, 0.02) matrices, unit norms: HF's init) and `random_adapter`
makes a LoRA adapter the same way, ready for `MLCEngine.load_adapter`; `write_adapter` saves one as
a PEFT folder (for the engine to read from disk, as it reads trained adapters).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
    "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
# A 2-layer model with Llama-2's vocabulary and head_dim 64 (the flash attention kernels' size): the
# same token ids run on it, in seconds.
TINY = dict(LLAMA2_7B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=2)
_MLP = ("gate_proj", "up_proj", "down_proj")  # the LoRA modules under `mlp.` in PEFT's names (others: `self_attn.`)


def build(out: Path, model_cfg: dict, opts, name: str = "llama-random") -> float:
    """Compile `model_cfg` (an HF config dict) with `opts` (CompileOptions) into `out`; returns seconds."""
    from .. import compile as C  # pylint: disable=import-outside-toplevel
    from ..contract import CONFIG_FILE, compiled_contract  # pylint: disable=import-outside-toplevel
    from . import llama, llama_loader  # pylint: disable=import-outside-toplevel

    out.mkdir(parents=True, exist_ok=True)
    cfg = llama.LlamaConfig.from_dict(model_cfg, context_window_size=opts.context_window_size,
                                      prefill_chunk_size=opts.prefill_chunk_size,
                                      max_batch_size=opts.max_batch_size)
    lora = C.lora_spec(cfg, opts)
    lib = f"lib.{opts.target}.so"
    t0 = time.time()
    names = C.build_library(llama, cfg, opts.resolved_dtype(), opts, out / lib, lora=lora)
    shapes = llama_loader.param_shapes(cfg)
    reserved = C.weight_reserved(lora, llama, cfg)
    shapes = {n: (s[0] + reserved(n)[0], s[1] + reserved(n)[1]) if len(s) == 2 else s for n, s in shapes.items()}
    (out / CONFIG_FILE).write_text(json.dumps({
        "model_name": name, "architecture": "LlamaForCausalLM",
        "model_config": dataclasses.asdict(cfg), "dtype": opts.resolved_dtype(),
        "target": {"kind": opts.target, "arch": opts.cuda_arch if opts.target == "cuda" else None},
        "library": lib, "params_file": None, "param_names": names,
        "param_shapes": {n: list(shapes[n]) for n in names}, "tokenizer": {},
        "compile_options": dataclasses.asdict(opts),
        "lora": lora.to_json() if lora is not None else None, "contract": compiled_contract(),
    }, indent=1))
    return time.time() - t0


def make_params(cfg_json: dict, torch, device: str = "cuda", seed: int = 0, others=()) -> dict:
    """Seeded random weights on `device`, by name, in the model's dtype; with `others` (the configs
    of other libraries of the same model) each as tall as any of them asks (a library with rank
    rows stores its targeted weights taller), so one set serves them all (`lib_params`)."""
    shapes = dict(cfg_json["param_shapes"])
    for other in others:
        if other["param_names"] != cfg_json["param_names"]:
            raise ValueError(f"{other.get('model_name')} and {cfg_json.get('model_name')}: different models")
        shapes.update({n: [s[0], *shapes[n][1:]] for n, s in other["param_shapes"].items() if s[0] > shapes[n][0]})
    dtype = getattr(torch, cfg_json["dtype"])
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name in cfg_json["param_names"]:
        shape = shapes[name]
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return out


def lib_params(weights: dict, cfg_json: dict) -> list:
    """The params of the library with config `cfg_json` from `make_params`'s weights: each a view
    (no copy) of the first rows its library expects; where the library stores a weight with another
    row length (spare columns beside it), a copy with the weight's values in its first columns and
    zeros in the others."""
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    out = []
    for n in cfg_json["param_names"]:
        shape, w = cfg_json["param_shapes"][n], weights[n]
        if len(shape) == 2 and shape[1] != w.shape[1]:
            wide = w.new_zeros(shape)
            k = min(shape[1], w.shape[1])
            wide[:min(shape[0], w.shape[0]), :k] = w[:shape[0], :k]
            w = wide
        out.append(tvm_ffi.from_dlpack(w[:shape[0]]))
    return out


def random_adapter(name: str, model_config: dict, modules, rank: int, torch, device: str = "cuda",
                   seed: int = 0, alpha: float | None = None):
    """A `peft.LoraAdapter` of `rank` on `modules` in every layer: A ~ N(0, 1/in) (PEFT's kaiming
    scale), B ~ N(0, 0.02) (PEFT starts B at 0; trained adapters are not), drawn on `device`."""
    import types  # pylint: disable=import-outside-toplevel

    from ..contract import LORA_MODULES
    from ..lora.layout import module_shapes  # pylint: disable=import-outside-toplevel
    from ..lora.peft import LoraAdapter  # pylint: disable=import-outside-toplevel

    shapes = module_shapes(types.SimpleNamespace(**model_config))
    mods = [m for m in LORA_MODULES if m in modules]
    alpha = float(alpha if alpha is not None else 2 * rank)
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for layer in range(model_config["num_hidden_layers"]):
        for m in mods:
            i, o = shapes[m]
            a = torch.randn((rank, i), generator=g, device=device) * (1.0 / i ** 0.5)
            bt = torch.randn((rank, o), generator=g, device=device) * 0.02
            weights[(layer, m)] = (a.cpu().numpy(), bt.cpu().numpy())
    return LoraAdapter(name=name, rank=rank, modules=mods, scales={m: alpha / rank for m in mods},
                       weights=weights, config={"r": rank, "lora_alpha": alpha, "target_modules": mods})


def write_adapter(adapter, folder: Path, dtype: str = "float16") -> Path:
    """Save `adapter` (a `peft.LoraAdapter` with uniform scales, as `random_adapter` makes) as a PEFT
    folder: adapter_config.json (r, lora_alpha, target_modules) and adapter_model.safetensors
    (PEFT's names and shapes, lora_B = the transpose of B^T) in `dtype`. Returns the folder."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    from ..lora.peft import CONFIG, WEIGHTS  # pylint: disable=import-outside-toplevel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, bt) in adapter.weights.items():
        key = f"base_model.model.model.layers.{layer}.{'mlp' if module in _MLP else 'self_attn'}.{module}"
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a, dtype)
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(np.asarray(bt).T, dtype)
    save_file(tensors, str(folder / WEIGHTS))
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.config["lora_alpha"],
              "target_modules": list(adapter.modules), "bias": "none", "lora_dropout": 0.0}
    (folder / CONFIG).write_text(json.dumps(config, indent=1))
    return folder
