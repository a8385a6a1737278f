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
