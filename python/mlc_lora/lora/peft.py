"""Load a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors).

Only the plain LoRA forward `y += scale * (x @ A.T) @ B.T` on Llama linears is served; every PEFT
option that changes that maths is refused by name rather than silently ignored. Weights are read
from safetensors only (never pickle).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LoraError
from ..contract import LORA_MODULES
from .layout import LoraSpec, module_shapes

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# Options whose non-default value changes the forward pass (or needs weights we do not load).
# option -> values that are harmless.
_NEUTRAL: dict[str, tuple] = {
    "bias": ("none",),
    "modules_to_save": (None, []),
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
    "megatron_config": (None,),
    "use_bdlora": (None, False),
    "velora_config": (None,),
    "monteclora_config": (None,),
    "arrow_config": (None,),
    "kasa_config": (None,),
}
# init_lora_weights values that also rewrite the base weights: the adapter alone is not the model.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

_KEY = re.compile(r"^(?:base_model\.model\.)?(.*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclasses.dataclass
class LoraAdapter:
    """An adapter ready for packing: per (layer, module) A (rank, in) and B^T (rank, out) in float32,
    padded with zero rows to `rank` (the adapter's largest) and with any per-layer scale folded in."""

    name: str
    rank: int
    modules: list[str]  # targeted modules, canonical order
    scales: dict[str, float]  # module -> scale used in the tables
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    config: dict[str, Any]


def load_peft_adapter(path: str | Path, model_cfg, spec: LoraSpec | None = None,
                      name: str | None = None) -> LoraAdapter:
    """Read and validate a PEFT folder against the base model config (and the compiled `spec`)."""
    path = Path(path)
    name = name or path.name
    cfg = _read_config(path)
    tensors = _read_weights(path)
    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    for key, val in (("r", r_default), ("lora_alpha", alpha_default)):
        if not isinstance(val, (int, float)) or isinstance(val, bool) or val <= 0:
            raise LoraError(f"{path / CONFIG}: {key} must be a positive number, got {val!r}")
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    shapes = module_shapes(model_cfg)
    L = model_cfg.num_hidden_layers

    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    keys: dict[tuple[int, str], str] = {}
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"{path / WEIGHTS}: tensor {key!r} is not a LoRA A/B weight of a Llama "
                            f"linear ({', '.join(LORA_MODULES)}); such modules are not supported")
        module_key, layer, module, ab = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if module not in shapes:
            raise LoraError(f"{path / WEIGHTS}: tensor {key!r} targets {module!r}; supported LoRA "
                            f"modules are {', '.join(LORA_MODULES)}")
        if layer >= L:
            raise LoraError(f"{path / WEIGHTS}: tensor {key!r} is for layer {layer}, but the base "
                            f"model has {L} layers")
        pairs.setdefault((layer, module), {})[ab] = (key, arr)
        keys[(layer, module)] = module_key

    if not pairs:
        raise LoraError(f"{path / WEIGHTS} holds no LoRA weights")
    ranks, scales_lm = {}, {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{path / WEIGHTS}: layer {layer} {module} has lora_{''.join(ab)} but not "
                            f"lora_{'B' if 'A' in ab else 'A'}")
        (ka, a), (kb, b) = ab["A"], ab["B"]
        in_f, out_f = shapes[module]
        if a.ndim != 2 or a.shape[1] != in_f:
            raise LoraError(f"{path / WEIGHTS}: tensor {ka!r} has shape {a.shape}, expected (r, {in_f}) "
                            f"for {module} of the base model")
        r = a.shape[0]
        if b.shape != (out_f, r):
            raise LoraError(f"{path / WEIGHTS}: tensor {kb!r} has shape {b.shape}, expected "
                            f"({out_f}, {r}) for {module} of the base model")
        mk = keys[(layer, module)]
        r_cfg = rank_pattern.get(_pattern_key(rank_pattern, mk), r_default)
        if r != r_cfg:
            raise LoraError(f"{path / WEIGHTS}: tensor {ka!r} has rank {r}, but adapter_config.json "
                            f"gives r={r_cfg} for {mk}")
        alpha = alpha_pattern.get(_pattern_key(alpha_pattern, mk), alpha_default)
        ranks[(layer, module)] = r
        scales_lm[(layer, module)] = alpha / math.sqrt(r) if rslora else alpha / r

    rank = max(ranks.values())
    modules = [m for m in LORA_MODULES if any(mod == m for _, mod in pairs)]
    if spec is not None:
        if rank > spec.max_rank:
            raise LoraError(f"adapter {name} has rank {rank}, above the compiled --max-lora-rank "
                            f"{spec.max_rank}")
        missing = [m for m in modules if m not in spec.module_names]
        if missing:
            raise LoraError(f"adapter {name} targets {missing}, which the model was not compiled for "
                            f"(compiled LoRA modules: {', '.join(spec.module_names)})")
    # The table scale of a module is its scale in the lowest layer; other layers fold the ratio.
    scales = {m: scales_lm[min(l for l, mod in pairs if mod == m), m] for m in modules}
    weights = {}
    for (layer, module), ab in pairs.items():
        a = ab["A"][1].astype(np.float32)
        bt = ab["B"][1].astype(np.float32).T * (scales_lm[layer, module] / scales[module])
        r = a.shape[0]
        if r < rank:  # zero rows contribute nothing
            a = np.concatenate([a, np.zeros((rank - r, a.shape[1]), np.float32)])
            bt = np.concatenate([bt, np.zeros((rank - r, bt.shape[1]), np.float32)])
        weights[(layer, module)] = (a, np.ascontiguousarray(bt))
    return LoraAdapter(name, rank, modules, scales, weights, cfg)


def _pattern_key(patterns: dict, key: str) -> str:
    """PEFT's get_pattern_key: the first pattern that matches a dotted suffix of `key`."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return key


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise LoraError(f"LoRA adapter {str(path)!r} is not a folder")
    f = path / CONFIG
    if not f.is_file():
        raise LoraError(f"{path} is not a PEFT adapter folder: no {CONFIG}")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoraError(f"{f} must hold a JSON object")
    ptype = cfg.get("peft_type", "LORA")
    if ptype != "LORA":
        raise LoraError(f"{f}: peft_type {ptype!r} is not supported (only LORA)")
    for opt, ok in _NEUTRAL.items():
        if opt in cfg and cfg[opt] not in ok:
            raise LoraError(f"{f}: {opt}={cfg[opt]!r} is not supported by mlc-lora "
                            f"(supported: {ok[0]!r})")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoraError(f"{f}: init_lora_weights={init!r} also changes the base weights; convert the "
                        "adapter to plain LoRA (PEFT path_initial_model_for_weight_conversion) first")
    if cfg.get("fan_in_fan_out"):
        # PEFT itself resets it to False for nn.Linear targets; the A/B shapes are unaffected.
        warnings.warn(f"{f}: fan_in_fan_out=true is ignored for Llama linear layers, as PEFT does")
    for opt in ("rank_pattern", "alpha_pattern"):
        if cfg.get(opt) is not None and not isinstance(cfg[opt], dict):
            raise LoraError(f"{f}: {opt} must be an object, got {type(cfg[opt]).__name__}")
    tm = cfg.get("target_modules")
    if tm is not None and not isinstance(tm, (str, list)):
        raise LoraError(f"{f}: target_modules must be a list or a regex string")
    if isinstance(tm, list):  # a regex string is checked through the tensors it produced
        bad = [t for t in tm if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in LORA_MODULES]
        if bad:
            raise LoraError(f"{f}: target_modules {bad} are not supported; mlc-lora serves LoRA on "
                            f"{', '.join(LORA_MODULES)}")
    return cfg


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": "bf16"}


def _read_weights(path: Path) -> dict[str, np.ndarray]:
    f = path / WEIGHTS
    if not f.is_file():
        if (path / "adapter_model.bin").is_file():
            raise LoraError(f"{path} holds adapter_model.bin (a pickle); mlc-lora loads only "
                            f"{WEIGHTS}. Re-save the adapter with safe_serialization=True")
        raise LoraError(f"{path} has no {WEIGHTS}")
    data = f.read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraError(f"{f} is not a safetensors file: {e}") from e
    body = memoryview(data)[8 + n:]
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise LoraError(f"{f}: tensor {key!r} has dtype {info.get('dtype')}; expected F32, F16 or BF16")
        lo, hi = info["data_offsets"]
        raw = body[lo:hi]
        if dt == "bf16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dt)
        shape = tuple(info["shape"])
        if arr.size != math.prod(shape):
            raise LoraError(f"{f}: tensor {key!r} has {arr.size} values for shape {shape}")
        out[key] = arr.reshape(shape)
    return out
