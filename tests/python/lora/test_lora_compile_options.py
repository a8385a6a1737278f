"""`mlc_lora compile` LoRA flags reach CompileOptions; half-given LoRA options are refused."""

import pytest

from mlc_lora.cli import compile as cli
from mlc_lora.compile import CompileOptions, lora_spec
from mlc_lora.errors import CompileError, LoraError
from mlc_lora.models.llama import LlamaConfig

from ..conftest import TINY_CONFIGS


def test_cli_flags(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "compile_model", lambda model, out, opts: seen.setdefault("opts", opts) and out)
    cli.main(["m", "-o", str(tmp_path), "--lora-pool-pages", "128", "--max-lora-rank", "32",
              "--lora-target-modules", "q_proj", "v_proj", "--lora-kernel", "single"])
    o = seen["opts"]
    assert (o.lora_pool_pages, o.max_lora_rank, o.lora_target_modules, o.lora_kernel) == (
        128, 32, ["q_proj", "v_proj"], "single")
    seen.clear()
    cli.main(["m", "-o", str(tmp_path)])
    assert seen["opts"].max_lora_rank == 0 and lora_spec(LlamaConfig(**TINY_CONFIGS["gqa"]), seen["opts"]) is None


def test_lora_options_checked():
    cfg = LlamaConfig(**TINY_CONFIGS["gqa"])
    with pytest.raises(CompileError, match="needs both --max-lora-rank and --lora-pool-pages"):
        lora_spec(cfg, CompileOptions(max_lora_rank=8))
    with pytest.raises(LoraError, match="unknown LoRA target module"):
        lora_spec(cfg, CompileOptions(max_lora_rank=8, lora_pool_pages=4, lora_target_modules=["qkv"]))
    spec = lora_spec(cfg, CompileOptions(max_lora_rank=8, lora_pool_pages=4))
    assert spec.module_names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_without_lora_flags_the_model_has_no_lora_inputs(tiny_models):
    import json

    from mlc_lora.runner import ModelRunner

    _, compiled = tiny_models["gqa"]
    assert json.loads((compiled / "mlc-lora-config.json").read_text())["lora"] is None
    r = ModelRunner(compiled)
    kv = r.create_pool(max_batch_size=2, max_total_seq_len=64, prefill_chunk_size=64)
    kv.add_sequence(0)
    with pytest.raises(Exception, match="compiled without LoRA"):
        r.prefill(kv, [0], [[1, 2]], lora={})
    from mlc_lora.lora import pack_peft_adapter

    with pytest.raises(LoraError, match="compiled without LoRA"):
        pack_peft_adapter(compiled, r.config)
