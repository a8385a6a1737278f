"""`random_model.write_adapter`: a random adapter written as a PEFT folder reads back (through the
runtime's PEFT reader, as any trained adapter) into the same pages as the adapter in memory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.contract import CONFIG_FILE
from mlc_lora.lora import pack_peft_adapter
from mlc_lora.lora.layout import LoraSpec, pack_adapter
from mlc_lora.models.random_model import random_adapter, write_adapter

from ..conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def compiled_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-model")
    make_tiny_hf_model(root / "hf", "gqa")
    lib = compile_model(root / "hf", root / "lib", CompileOptions(
        prefill_chunk_size=32, max_batch_size=4, lora_pool_pages=32, max_lora_rank=16,
        lora_target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]), progress=False)
    return json.loads((lib / CONFIG_FILE).read_text())


@pytest.mark.parametrize("dtype, tol", [("float32", 0.0), ("float16", 2e-3)])
def test_written_adapter_packs_like_the_one_in_memory(compiled_config, tmp_path, dtype, tol):
    cfg = compiled_config
    spec = LoraSpec.from_json(cfg["lora"])
    ad = random_adapter("r", cfg["model_config"], ["q_proj", "v_proj", "down_proj"], 8, torch, "cpu", seed=3)
    folder = write_adapter(ad, tmp_path / "adapter", dtype)
    got = pack_peft_adapter(folder, cfg)
    want = pack_adapter(spec, ad, np.float32)
    assert (got.rank, got.modules, got.scales) == (8, ["q_proj", "v_proj", "down_proj"], want.scales)
    assert got.scales["q_proj"] == 2.0  # alpha 2r / r
    np.testing.assert_array_equal(got.a_off, want.a_off)
    np.testing.assert_array_equal(got.b_off, want.b_off)
    assert np.abs(want.pages).max() > 0.01
    np.testing.assert_allclose(got.pages, want.pages, rtol=0, atol=tol)


def test_one_set_of_weights_serves_libraries_of_different_row_counts():
    """make_params with `others`: each weight at the largest shape any library asks (a rank-rows
    library's targeted weights are taller); lib_params gives each library views of the rows it
    expects, the same memory, the same values in the shared rows."""
    from mlc_lora.models.random_model import lib_params, make_params

    base = {"model_name": "m", "dtype": "float32", "param_names": ["w", "norm"],
            "param_shapes": {"w": [4, 3], "norm": [3]}}
    rows = dict(base, param_shapes={"w": [4 + 32, 3], "norm": [3]})
    weights = make_params(base, torch, "cpu", seed=1, others=[rows])
    assert tuple(weights["w"].shape) == (36, 3) and tuple(weights["norm"].shape) == (3,)
    pb, pr = lib_params(weights, base), lib_params(weights, rows)
    assert pb[0].shape == (4, 3) and pr[0].shape == (36, 3)
    assert pb[0].data_ptr() == pr[0].data_ptr() == weights["w"].data_ptr()
    np.testing.assert_array_equal(pb[0].numpy(), weights["w"][:4].numpy())
    with pytest.raises(ValueError, match="different models"):
        make_params(base, torch, "cpu", others=[dict(base, param_names=["v", "norm"])])
