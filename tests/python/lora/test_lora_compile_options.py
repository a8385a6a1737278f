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
    # the rank rows route is the fused functions': asked for where they are not built, it is refused
    with pytest.raises(CompileError, match="--lora-rank-rows is a route of the fused functions"):
        lora_spec(cfg, CompileOptions(max_lora_rank=8, lora_pool_pages=4, lora_rank_rows=True))


def test_rank_rows_flag_and_spec(monkeypatch, tmp_path):
    """--lora-rank-rows reaches CompileOptions; a CUDA sgmv fp16 spec then records it in its fused
    limits (the config's lora.fused.rank_rows), which LoraSpec reads back; the weights to widen
    are the targeted linears' (compile.weight_reserved, 32 rows per part); the spare columns
    alike, beside the weights."""
    pytest.importorskip("triton")
    from mlc_lora.compile import weight_reserved
    from mlc_lora.lora.layout import LoraSpec
    from mlc_lora.models import llama

    seen = {}
    monkeypatch.setattr(cli, "compile_model", lambda model, out, opts: seen.setdefault("opts", opts) and out)
    cli.main(["m", "-o", str(tmp_path), "--lora-pool-pages", "64", "--max-lora-rank", "16", "--lora-kernel", "sgmv",
              "--target", "cuda", "--lora-rank-rows"])
    opts = seen["opts"]
    assert opts.lora_rank_rows and opts.lora_fused
    cfg = LlamaConfig(**TINY_CONFIGS["gqa"])
    spec = lora_spec(cfg, opts)
    assert spec.fused["rank_rows"] is True and LoraSpec.from_json(spec.to_json()) == spec
    rows = weight_reserved(spec, llama, cfg)
    assert rows("model.layers.1.self_attn.qkv_proj.weight") == (96, 0)
    assert rows("model.layers.0.mlp.down_proj.weight") == (32, 0)
    assert rows("lm_head.weight") == (0, 0) and rows("model.embed_tokens.weight") == (0, 0)
    assert "spare_columns" not in spec.fused  # the rank rows route asked for: no spare columns by default
    pair = lora_spec(cfg, CompileOptions(**{**opts.__dict__, "lora_rank_rows": False, "lora_spare_columns": False}))
    assert "rank_rows" not in pair.fused and "spare_columns" not in pair.fused and weight_reserved(pair, llama, cfg)(
        "model.layers.1.self_attn.qkv_proj.weight") == (0, 0)
    # by default the fused functions take the rank columns route past 64 tokens (with --gemm cublas)
    cols = lora_spec(cfg, CompileOptions(**{**opts.__dict__, "lora_rank_rows": False}))
    assert cols.fused["spare_columns"] is True and LoraSpec.from_json(cols.to_json()) == cols
    assert cols == lora_spec(cfg, CompileOptions(**{**opts.__dict__, "lora_rank_rows": False,
                                                    "lora_spare_columns": True}))
    assert "spare_columns" not in lora_spec(cfg, CompileOptions(**{**opts.__dict__, "lora_rank_rows": False,
                                                                   "gemm": "tvm"})).fused
    reserved = weight_reserved(cols, llama, cfg)  # the rank columns, then zeros to rows of a multiple of 64
    assert reserved("model.layers.1.self_attn.qkv_proj.weight") == (0, 128)  # 64 + 96 -> 192
    assert reserved("model.layers.0.mlp.down_proj.weight") == (0, 64)  # 128 + 32 -> 192
    assert reserved("model.layers.0.mlp.gate_up_proj.weight") == (0, 64)  # 64 + 64 -> 128
    for bad, why in (({"lora_rank_rows": True, "lora_spare_columns": True}, "alternatives"),
                     ({"lora_spare_columns": True, "gemm": "tvm"}, "--gemm cublas"),
                     ({"lora_spare_columns": True, "lora_fused": False}, "route of the fused functions")):
        with pytest.raises(CompileError, match=why):
            lora_spec(cfg, CompileOptions(**{**opts.__dict__, "lora_rank_rows": False, **bad}))


def test_no_spare_columns_flag(monkeypatch, tmp_path):
    """--no-lora-spare-columns reaches CompileOptions as False (the pair past 64 tokens); without it
    the option is None: the route where the fused functions are built."""
    seen = []
    monkeypatch.setattr(cli, "compile_model", lambda model, out, opts: seen.append(opts) or out)
    args = ["m", "-o", str(tmp_path), "--lora-pool-pages", "64", "--max-lora-rank", "16", "--lora-kernel", "sgmv",
            "--target", "cuda"]
    cli.main(args)
    cli.main(args + ["--no-lora-spare-columns"])
    assert [o.lora_spare_columns for o in seen] == [None, False]


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


def test_int8_rows_flag_and_spec(monkeypatch, tmp_path):
    """--lora-rows int8 reaches CompileOptions and the spec (the config's lora.rows, read back); a
    CUDA sgmv fp16 spec with int8 rows has no fused functions (they read model-dtype rows), and
    their routes asked for are refused; an unknown format is refused by the CLI."""
    pytest.importorskip("triton")
    from mlc_lora.lora.layout import LoraSpec

    seen = {}
    monkeypatch.setattr(cli, "compile_model", lambda model, out, opts: seen.setdefault("opts", opts) and out)
    cli.main(["m", "-o", str(tmp_path), "--lora-pool-pages", "64", "--max-lora-rank", "16", "--lora-kernel", "sgmv",
              "--target", "cuda", "--lora-rows", "int8"])
    opts = seen["opts"]
    cfg = LlamaConfig(**TINY_CONFIGS["gqa"])
    spec = lora_spec(cfg, opts)
    assert opts.lora_rows == spec.rows == "int8" and spec.fused is None
    assert LoraSpec.from_json(spec.to_json()) == spec
    assert lora_spec(cfg, CompileOptions(**{**opts.__dict__, "lora_rows": "model"})).fused is not None
    for bad in ({"lora_rank_rows": True}, {"lora_spare_columns": True}):
        with pytest.raises(CompileError, match="int8 adapter rows: the fused functions' routes"):
            lora_spec(cfg, CompileOptions(**{**opts.__dict__, **bad}))
    with pytest.raises(SystemExit):
        cli.main(["m", "-o", str(tmp_path), "--lora-rows", "fp8"])
