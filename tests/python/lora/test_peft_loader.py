"""PEFT adapter folders: what loads, and every bad input refused with a message naming it.

The runtime reads and packs the folder (`pack_peft_adapter`); what it loaded is read back from the
packed pages by the numpy reference (`reference.unpack`).
"""

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlc_lora.errors import LoraError
from mlc_lora.lora import make_spec, pack_peft_adapter, peft_adapter_plan
from mlc_lora.models.llama import LlamaConfig

from ..conftest import TINY_CONFIGS
from .reference import compiled_config, unpack

CFG = LlamaConfig(**TINY_CONFIGS["gqa"])  # hidden 64, q 64, kv 32, ffn 128, 2 layers
PREFIX = "base_model.model.model.layers"


def _load_packed(folder, cfg, spec=None):
    """The adapter as the runtime packed it, for a model compiled with `spec` (default: every
    module, ranks up to 64)."""
    spec = spec or make_spec(cfg, 64, 16)
    return unpack(spec, pack_peft_adapter(folder, compiled_config(spec)))


def _write(folder, config=None, tensors=None, r=4, modules=("q_proj", "v_proj"), layers=(0, 1)):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(modules), "bias": "none",
           "use_dora": False, "modules_to_save": None, "use_rslora": False, "fan_in_fan_out": False,
           "rank_pattern": {}, "alpha_pattern": {}}
    cfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        rng = np.random.default_rng(0)
        shapes = {"q_proj": (64, 64), "v_proj": (64, 32), "down_proj": (128, 64), "k_proj": (64, 32)}
        part = {"q_proj": "self_attn", "v_proj": "self_attn", "k_proj": "self_attn", "down_proj": "mlp"}
        tensors = {}
        for l in layers:
            for m in modules:
                i, o = shapes[m]
                tensors[f"{PREFIX}.{l}.{part[m]}.{m}.lora_A.weight"] = rng.standard_normal((r, i)).astype(np.float32)
                tensors[f"{PREFIX}.{l}.{part[m]}.{m}.lora_B.weight"] = rng.standard_normal((o, r)).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_loads_a_valid_folder(tmp_path):
    f = _write(tmp_path / "ok", config={"lora_alpha": 6})
    a = _load_packed(f, CFG, make_spec(CFG, 8, 16))
    assert a.rank == 4 and a.modules == ["q_proj", "v_proj"] and a.scales == {"q_proj": 1.5, "v_proj": 1.5}
    assert a.weights[(1, "v_proj")][0].shape == (4, 64) and a.weights[(1, "v_proj")][1].shape == (4, 32)


def test_rslora_and_patterns(tmp_path):
    f = _write(tmp_path / "rs", config={"use_rslora": True, "lora_alpha": 8})
    assert _load_packed(f, CFG).scales["q_proj"] == pytest.approx(8 / math.sqrt(4))
    # Per-module rank (padded with zero rows) and a per-layer alpha folded into B^T.
    rng = np.random.default_rng(1)
    t = {}
    for l in (0, 1):
        t[f"{PREFIX}.{l}.self_attn.q_proj.lora_A.weight"] = rng.standard_normal((4, 64)).astype(np.float32)
        t[f"{PREFIX}.{l}.self_attn.q_proj.lora_B.weight"] = rng.standard_normal((64, 4)).astype(np.float32)
        t[f"{PREFIX}.{l}.self_attn.v_proj.lora_A.weight"] = rng.standard_normal((2, 64)).astype(np.float32)
        t[f"{PREFIX}.{l}.self_attn.v_proj.lora_B.weight"] = rng.standard_normal((32, 2)).astype(np.float32)
    f = _write(tmp_path / "pat", tensors=t, config={"rank_pattern": {"v_proj": 2},
                                                    "alpha_pattern": {"layers.1.self_attn.q_proj": 16}})
    a = _load_packed(f, CFG)
    assert a.rank == 4 and a.scales == {"q_proj": 2.0, "v_proj": 4.0}
    va, vb = a.weights[(0, "v_proj")]
    assert (va[2:] == 0).all() and (vb[2:] == 0).all()
    np.testing.assert_allclose(a.weights[(1, "q_proj")][1], 2.0 * t[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"].T)


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(LoraError, match="not a folder"):
        _load_packed(tmp_path / "nope", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        _load_packed(tmp_path / "empty", CFG)
    f = _write(tmp_path / "bad")
    (f / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match="adapter_config.json is not valid JSON"):
        _load_packed(f, CFG)
    (f / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(LoraError, match="must hold a JSON object"):
        _load_packed(f, CFG)
    f = _write(tmp_path / "r0", config={"r": 0})
    with pytest.raises(LoraError, match="r must be a positive integer"):
        _load_packed(f, CFG)


def test_weights_file_problems(tmp_path):
    f = _write(tmp_path / "pickle")
    (f / "adapter_model.safetensors").unlink()
    (f / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(LoraError, match="adapter_model.bin \\(a pickle\\).*safetensors"):
        _load_packed(f, CFG)
    (f / "adapter_model.bin").unlink()
    with pytest.raises(LoraError, match="has no adapter_model.safetensors"):
        _load_packed(f, CFG)
    (f / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LoraError, match="is not a safetensors file"):
        _load_packed(f, CFG)


@pytest.mark.parametrize("option, value", [
    ("bias", "all"), ("bias", "lora_only"), ("use_dora", True), ("modules_to_save", ["lm_head"]),
    ("lora_bias", True), ("target_parameters", ["mlp.experts.down_proj"]), ("layer_replication", [[0, 1]]),
    ("trainable_token_indices", [1, 2]), ("peft_type", "IA3"), ("init_lora_weights", "pissa"),
    ("target_modules", ["q_proj", "lm_head"]), ("target_modules", 7),
])
def test_unsupported_options_are_named(tmp_path, option, value):
    f = _write(tmp_path / "opt", config={option: value})
    with pytest.raises(LoraError, match=option):
        _load_packed(f, CFG)


def test_shapes_that_do_not_fit_name_the_tensor(tmp_path):
    rng = np.random.default_rng(0)
    key = f"{PREFIX}.0.self_attn.v_proj"
    t = {f"{key}.lora_A.weight": rng.standard_normal((4, 64)).astype(np.float32),
         f"{key}.lora_B.weight": rng.standard_normal((64, 4)).astype(np.float32)}  # v is 32 rows
    f = _write(tmp_path / "shape", tensors=t)
    with pytest.raises(LoraError, match=r"lora_B.weight' has shape \(64, 4\), expected \(32, 4\)"):
        _load_packed(f, CFG)
    t = {f"{key}.lora_A.weight": rng.standard_normal((4, 48)).astype(np.float32),
         f"{key}.lora_B.weight": rng.standard_normal((32, 4)).astype(np.float32)}
    with pytest.raises(LoraError, match=r"v_proj.lora_A.weight' has shape \(4, 48\), expected \(r, 64\)"):
        _load_packed(_write(tmp_path / "shape2", tensors=t), CFG)
    t = {f"{PREFIX}.5.self_attn.v_proj.lora_A.weight": np.zeros((4, 64), np.float32),
         f"{PREFIX}.5.self_attn.v_proj.lora_B.weight": np.zeros((32, 4), np.float32)}
    with pytest.raises(LoraError, match="layer 5, but the base model has 2 layers"):
        _load_packed(_write(tmp_path / "layer", tensors=t), CFG)
    t = {f"{key}.lora_A.weight": np.zeros((4, 64), np.float32)}
    with pytest.raises(LoraError, match="has lora_A but not lora_B"):
        _load_packed(_write(tmp_path / "half", tensors=t), CFG)
    t = {"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}
    with pytest.raises(LoraError, match="lm_head.*not a LoRA A/B weight of a Llama linear"):
        _load_packed(_write(tmp_path / "head", tensors=t), CFG)
    f = _write(tmp_path / "rankcfg", config={"r": 8})  # tensors have rank 4
    with pytest.raises(LoraError, match="has rank 4, but adapter_config.json gives r=8"):
        _load_packed(f, CFG)


def test_rank_and_modules_checked_against_the_compiled_model(tmp_path):
    f = _write(tmp_path / "big", r=16)
    with pytest.raises(LoraError, match="rank 16, above the compiled --max-lora-rank 8"):
        _load_packed(f, CFG, make_spec(CFG, 8, 16))
    f = _write(tmp_path / "mods", modules=("q_proj", "down_proj"))
    with pytest.raises(LoraError, match=r"targets \['down_proj'\], which the model was not compiled for"):
        _load_packed(f, CFG, make_spec(CFG, 8, 16, target_modules=["q_proj", "v_proj"]))


def test_plan_agrees_with_packing_and_warnings_reach_python(tmp_path):
    """peft_adapter_plan checks a folder without packing it: the rank, modules, scales and pages
    of the packed adapter; options the runtime ignores come back as Python warnings."""
    f = _write(tmp_path / "ok", config={"lora_alpha": 6, "fan_in_fan_out": True})
    spec = make_spec(CFG, 8, 16)
    with pytest.warns(UserWarning, match="fan_in_fan_out=true is ignored"):
        plan = peft_adapter_plan(f, compiled_config(spec))
    with pytest.warns(UserWarning, match="fan_in_fan_out=true is ignored"):
        packed = pack_peft_adapter(f, compiled_config(spec))
    # q (64 + 64) and v (64 + 32) at rank 4: 896 elements, one page of 2 * 2 * 16 * 16 = 1024
    assert (plan.rank, plan.modules, plan.num_pages) == (4, ["q_proj", "v_proj"], 1) == (
        packed.rank, packed.modules, packed.pages.shape[1])
    assert plan.scales == packed.scales == {"q_proj": 1.5, "v_proj": 1.5}
    assert plan.lora_alpha == packed.lora_alpha == 6 and not plan.use_rslora and plan.name == "ok"
    with pytest.raises(LoraError, match="rank 16, above the compiled --max-lora-rank 8"):
        peft_adapter_plan(_write(tmp_path / "big", r=16), compiled_config(spec))
    with pytest.raises(LoraError, match="compiled without LoRA"):
        peft_adapter_plan(f, {"model_name": "base", "lora": None, "dtype": "float32"})
    with pytest.raises(LoraError, match="compiled by an older mlc-lora.*compile it again"):
        peft_adapter_plan(f, {k: v for k, v in compiled_config(spec).items() if k != "contract"})


def test_tensor_parallel_shards_pack_their_slices_with_the_planned_pages(tmp_path):
    """Under tensor parallelism every shard packs its slices (column-parallel q/v: B^T's output
    columns; row-parallel down: A's input columns) in the pages the plan announced."""
    f = _write(tmp_path / "tp", modules=("q_proj", "v_proj", "down_proj"))
    full = _load_packed(f, CFG)
    cfg2 = LlamaConfig(**TINY_CONFIGS["gqa"], tensor_parallel_shards=2)
    spec = make_spec(cfg2, 8, 16)
    plan = peft_adapter_plan(f, compiled_config(spec))
    for shard in range(2):
        packed = pack_peft_adapter(f, compiled_config(spec), shard=shard)
        assert packed.pages.shape[1] == plan.num_pages
        got = unpack(spec, packed)
        for layer in (0, 1):
            a, bt = full.weights[(layer, "q_proj")]  # q: 64 outputs, 32 per shard
            np.testing.assert_array_equal(got.weights[(layer, "q_proj")][0], a)
            np.testing.assert_array_equal(got.weights[(layer, "q_proj")][1], bt[:, 32 * shard:32 * (shard + 1)])
            a, bt = full.weights[(layer, "down_proj")]  # down: 128 inputs, 64 per shard
            np.testing.assert_array_equal(got.weights[(layer, "down_proj")][0], a[:, 64 * shard:64 * (shard + 1)])
            np.testing.assert_array_equal(got.weights[(layer, "down_proj")][1], bt)
    with pytest.raises(LoraError, match="shard 2 out of range for 2 shards"):
        pack_peft_adapter(f, compiled_config(spec), shard=2)


def _raw_safetensors(path, header: dict, nbytes: int) -> None:
    """A safetensors file with this header as written (no checks) and `nbytes` zero bytes of data."""
    import struct

    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(nbytes))


def test_non_finite_weights_and_overflowing_scales_are_refused(tmp_path):
    rng = np.random.default_rng(2)
    for i, bad in enumerate((np.nan, np.inf, -np.inf)):
        t = {}
        for l in (0, 1):
            for m, (shape_a, shape_b) in {"q_proj": ((4, 64), (64, 4)), "v_proj": ((4, 64), (32, 4))}.items():
                t[f"{PREFIX}.{l}.self_attn.{m}.lora_A.weight"] = rng.standard_normal(shape_a).astype(np.float32)
                t[f"{PREFIX}.{l}.self_attn.{m}.lora_B.weight"] = rng.standard_normal(shape_b).astype(np.float32)
        name = f"{PREFIX}.1.self_attn.v_proj.lora_{'AB'[i % 2]}.weight"
        t[name].flat[5] = bad
        with pytest.raises(LoraError, match=rf"{name}.*not finite"):
            _load_packed(_write(tmp_path / f"w{i}", tensors=t), CFG)
    # a scale alpha / r that overflows half precision: NaN logits, not an adapter
    with pytest.raises(LoraError, match=r"scale .* out of range"):
        _load_packed(_write(tmp_path / "alpha", config={"lora_alpha": 1e38}), CFG)
    with pytest.raises(LoraError, match=r"scale .* out of range"):
        _load_packed(_write(tmp_path / "alpha_pat", config={"alpha_pattern": {"v_proj": 1e30}}), CFG)
    _load_packed(_write(tmp_path / "alpha_ok", config={"lora_alpha": 4096}), CFG)  # large but finite: fine


@pytest.mark.parametrize("header, nbytes, match", [
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": {"dtype": "F32", "shape": [-4, -64], "data_offsets": [0, 1024]}},
     1024, "shape"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40],
                                                      "data_offsets": [0, 0]}}, 0, "shape"),
    ({f"{PREFIX}.99999999999999999999999.self_attn.q_proj.lora_A.weight":
      {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}}, 1024, "layer"),
])
def test_malformed_safetensors_are_lora_errors(tmp_path, header, nbytes, match):
    f = _write(tmp_path / "st")
    _raw_safetensors(f / "adapter_model.safetensors", header, nbytes)
    with pytest.raises(LoraError, match=match):
        _load_packed(f, CFG)
    with pytest.raises(LoraError, match=match):
        peft_adapter_plan(f, compiled_config(make_spec(CFG, 64, 16)))


_A = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("header, nbytes", [
    ([1, 2], 0),  # the header a list
    ({_A: [1, 2]}, 0),  # an entry not a dict
    ({_A: {"dtype": "F32", "shape": [4, 64]}}, 1024),  # no data_offsets
    ({_A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1023]}}, 1023),  # a byte count that does not match
    ({_A: {"dtype": "F32", "shape": ["4", 64], "data_offsets": [0, 1024]}}, 1024),  # a string in the shape
    ({_A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024], "x": {"y": {"z": 1}}}, "n": {"m": {}}}, 1024),
])
def test_every_malformed_header_is_a_lora_error(tmp_path, header, nbytes):
    f = _write(tmp_path / "hdr")
    _raw_safetensors(f / "adapter_model.safetensors", header, nbytes)
    with pytest.raises(LoraError):
        _load_packed(f, CFG)


@pytest.mark.parametrize("config, match", [
    ({"rank_pattern": {"q_proj(": 2}}, "not a valid regex"),
    ({"alpha_pattern": {"q_proj": "big"}}, "alpha_pattern"),
])
def test_bad_patterns_are_lora_errors(tmp_path, config, match):
    with pytest.raises(LoraError, match=match):
        _load_packed(_write(tmp_path / "pat", config=config), CFG)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_every_stored_dtype_packs_its_exact_values(tmp_path, dtype):
    """A/B stored as float16 (with subnormals, signed zeros and the largest half), bfloat16 or
    float64 pack to exactly what numpy's cast to float32 gives; a NaN/inf is found at its flat
    index in B (read column by column) too."""
    import ml_dtypes

    np_dtype = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, np.dtype(dtype))
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, 1.0], np.float32)
    t = {}
    for l in (0, 1):
        for m, (shape_a, shape_b) in {"q_proj": ((4, 64), (64, 4)), "v_proj": ((4, 64), (32, 4))}.items():
            a = rng.standard_normal(shape_a).astype(np.float32)
            b = rng.standard_normal(shape_b).astype(np.float32)
            a.flat[:8], b.flat[-8:] = special, special
            t[f"{PREFIX}.{l}.self_attn.{m}.lora_A.weight"] = a.astype(np_dtype)
            t[f"{PREFIX}.{l}.self_attn.{m}.lora_B.weight"] = b.astype(np_dtype)
    got = _load_packed(_write(tmp_path / dtype, tensors=t), CFG)
    for (l, m), (a, bt) in got.weights.items():
        part = f"{PREFIX}.{l}.self_attn.{m}"
        np.testing.assert_array_equal(a, t[f"{part}.lora_A.weight"].astype(np.float32))
        np.testing.assert_array_equal(bt, t[f"{part}.lora_B.weight"].astype(np.float32).T)
    name = f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"
    t[name] = t[name].copy()
    t[name].flat[9] = np.inf  # row 2, column 1 of B (32, 4)
    with pytest.raises(LoraError, match=rf"{name}.*not finite.*flat index 9\b"):
        _load_packed(_write(tmp_path / f"{dtype}-inf", tensors=t), CFG)


@pytest.mark.parametrize("pages", ["float16", "bfloat16"])
@pytest.mark.parametrize("stored", ["float16", "bfloat16", "float32"])
def test_16_bit_pages_hold_the_stored_values_rounded_once(tmp_path, pages, stored):
    """On a float16/bfloat16 model every stored dtype packs to numpy's cast of its values (a
    layer's B scaled by its alpha_pattern ratio first), whether the runtime copies the stored bits
    (float16 into float16 pages, bfloat16 into bfloat16, ratio 1) or widens and rounds; under tensor
    parallelism each shard gets its slice; a NaN or infinity anywhere in a row is found and named at
    its flat index, also where that row's shard slice is finite."""
    import ml_dtypes

    np_dt = {"bfloat16": ml_dtypes.bfloat16}
    src_dt, page_dt = np_dt.get(stored, np.dtype(stored)), np_dt.get(pages, np.dtype(pages))
    rng = np.random.default_rng(5)
    shapes = {"q_proj": ((4, 64), (64, 4)), "v_proj": ((4, 64), (32, 4)), "down_proj": ((4, 128), (64, 4))}
    t = {}
    for l in (0, 1):
        for m, (sa, sb) in shapes.items():
            part = "mlp" if m == "down_proj" else "self_attn"
            t[f"{PREFIX}.{l}.{part}.{m}.lora_A.weight"] = rng.standard_normal(sa).astype(np.float32).astype(src_dt)
            t[f"{PREFIX}.{l}.{part}.{m}.lora_B.weight"] = rng.standard_normal(sb).astype(np.float32).astype(src_dt)
    config = {"target_modules": list(shapes), "alpha_pattern": {"layers.1.self_attn.q_proj": 24}}  # ratio 3
    f = _write(tmp_path / "ok", config=config, tensors=t)

    def want(l, m, shard, shards):
        part = "mlp" if m == "down_proj" else "self_attn"
        a = t[f"{PREFIX}.{l}.{part}.{m}.lora_A.weight"].astype(np.float32)
        bt = t[f"{PREFIX}.{l}.{part}.{m}.lora_B.weight"].astype(np.float32).T * np.float32(3 if (l, m) == (1, "q_proj") else 1)
        if m == "down_proj":  # row-parallel: A's inputs split
            a = np.split(a, shards, axis=1)[shard]
        else:  # column-parallel: B^T's outputs split
            bt = np.split(bt, shards, axis=1)[shard]
        return a.astype(page_dt).astype(np.float32), bt.astype(page_dt).astype(np.float32)

    for shards in (1, 2):
        spec = make_spec(LlamaConfig(**TINY_CONFIGS["gqa"], tensor_parallel_shards=shards), 8, 16)
        for shard in range(shards):
            packed = pack_peft_adapter(f, compiled_config(spec, pages), shard=shard)
            assert packed.pages.dtype == page_dt
            got = unpack(spec, packed)
            for (l, m), (a, bt) in got.weights.items():
                wa, wbt = want(l, m, shard, shards)
                np.testing.assert_array_equal(a, wa)
                np.testing.assert_array_equal(bt, wbt)
    spec = make_spec(LlamaConfig(**TINY_CONFIGS["gqa"], tensor_parallel_shards=2), 8, 16)
    for tensor, flat in (("1.self_attn.v_proj.lora_B", 9), ("0.mlp.down_proj.lora_A", 130), ("1.self_attn.q_proj.lora_A", 3)):
        name = f"{PREFIX}.{tensor}.weight"
        bad = dict(t)
        bad[name] = t[name].copy()
        bad[name].flat[flat] = np.inf if flat != 3 else np.nan  # 130: down A row 1 input 2, outside shard 1's slice
        with pytest.raises(LoraError, match=rf"{name}.*not finite.*flat index {flat}\b"):
            pack_peft_adapter(_write(tmp_path / f"bad-{flat}", config=config, tensors=bad), compiled_config(spec, pages),
                              shard=1)
