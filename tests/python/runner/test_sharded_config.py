"""Compile-time checks of --tensor-parallel-shards, weight/adapter slicing against numpy, and the
NCCL collectives' registration (their use needs GPUs; on CPU libnccl is absent: a clear error)."""

import json

import numpy as np
import pytest
import tvm_ffi

from mlc_lora import _ffi_api as rt
from mlc_lora.cli.main import main as cli_main
from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.errors import ModelConfigError
from mlc_lora.contract import COLUMN_PARALLEL_MODULES
from mlc_lora.lora.layout import make_spec, pack_adapter, shard_module_shapes
from mlc_lora.lora.peft import LoraAdapter
from mlc_lora.models.llama import LlamaConfig, fused_linear_parts
from mlc_lora.models.llama_loader import shard_param

from ..lora.reference import unpack

BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96,
            num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)


@pytest.mark.parametrize("shards, field, value", [
    (3, "num_attention_heads", 8),
    (4, "num_key_value_heads", 2),
    (5, "num_attention_heads", 8),
])
def test_bad_shard_count_names_the_numbers(shards, field, value):
    with pytest.raises(ModelConfigError, match=f"{shards} tensor-parallel shards: {field} {value} "
                                               f"is not divisible by {shards}"):
        LlamaConfig.from_dict(BASE, tensor_parallel_shards=shards)


def test_intermediate_size_must_divide():
    cfg = dict(BASE, intermediate_size=100, num_key_value_heads=8)
    with pytest.raises(ModelConfigError, match="intermediate_size 100 is not divisible by 8"):
        LlamaConfig.from_dict(cfg, tensor_parallel_shards=8)
    with pytest.raises(ModelConfigError, match="must be a positive integer, got 0"):
        LlamaConfig.from_dict(cfg, tensor_parallel_shards=0)


def test_compile_refuses_before_building(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(BASE, model_type="llama")))
    from safetensors.numpy import save_file

    save_file({"model.norm.weight": np.ones((64,), np.float32)}, str(hf / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="num_key_value_heads 2 is not divisible by 4"):
        compile_model(hf, tmp_path / "out", CompileOptions(tensor_parallel_shards=4), progress=False)
    assert not (tmp_path / "out" / "lib.llvm.so").exists()
    assert cli_main(["compile", str(hf), "-o", str(tmp_path / "out"), "--tensor-parallel-shards", "3"]) == 1
    assert "num_attention_heads 8 is not divisible by 3" in capsys.readouterr().err


def test_weight_shards_reassemble_the_linears():
    """Column-parallel shards stacked by rows / row-parallel ones by columns give back the weight,
    head blocks of q, k and v staying together (numpy reference: the HF q/k/v split by heads)."""
    cfg = LlamaConfig.from_dict(BASE, tensor_parallel_shards=2)
    d, K = cfg.head_dim, 2
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n * d, 64)).astype(np.float32) for n in (8, 2, 2))
    qkv = np.concatenate([q, k, v])
    for s in range(K):
        got = shard_param(cfg, "model.layers.0.self_attn.qkv_proj.weight", qkv, s)
        want = np.concatenate([q[s * 4 * d:(s + 1) * 4 * d], k[s * d:(s + 1) * d], v[s * d:(s + 1) * d]])
        np.testing.assert_array_equal(got, want)
        assert got.shape[0] == sum(hi - lo for _, lo, hi in fused_linear_parts(cfg)["qkv_proj"])
    o = rng.standard_normal((64, 8 * d)).astype(np.float32)
    np.testing.assert_array_equal(np.concatenate([shard_param(cfg, "x.o_proj.weight", o, s) for s in range(K)], 1), o)
    gu = rng.standard_normal((2 * 96, 64)).astype(np.float32)
    s1 = shard_param(cfg, "model.layers.0.mlp.gate_up_proj.weight", gu, 1)
    np.testing.assert_array_equal(s1, np.concatenate([gu[48:96], gu[96 + 48:]]))
    emb = rng.standard_normal((32, 64)).astype(np.float32)
    assert shard_param(cfg, "model.embed_tokens.weight", emb, 1) is emb  # replicated


def test_adapter_slices_sum_to_the_whole_delta():
    """For every module, the shards' LoRA deltas put together (column: concatenated outputs; row:
    summed partial outputs, what the base all-reduce does) equal the unsharded delta. The shards'
    slices are read back from their packed pages (pack_adapter(..., shard))."""
    cfg = LlamaConfig.from_dict(BASE, tensor_parallel_shards=2)
    full = {n: (i, o) for n, (i, o) in shard_module_shapes(LlamaConfig.from_dict(BASE)).items()}
    rng = np.random.default_rng(1)
    r = 4
    weights = {(0, n): (rng.standard_normal((r, i)).astype(np.float32), rng.standard_normal((r, o)).astype(np.float32))
               for n, (i, o) in full.items()}
    ad = LoraAdapter("a", r, list(full), {n: 1.0 for n in full}, weights, {})
    spec = make_spec(cfg, 8, 16)
    shards = [unpack(spec, pack_adapter(spec, ad, np.float32, shard=s)) for s in range(2)]
    per = shard_module_shapes(cfg)
    for n, (i, o) in full.items():
        a, bt = (w.astype(np.float64) for w in weights[(0, n)])
        x = rng.standard_normal((3, i))
        want = x @ a.T @ bt
        if n in COLUMN_PARALLEL_MODULES:
            got = np.concatenate([x @ s.weights[(0, n)][0].T @ s.weights[(0, n)][1] for s in shards], 1)
        else:
            xs = np.split(x, 2, axis=1)
            got = sum(xs[k] @ s.weights[(0, n)][0].T @ s.weights[(0, n)][1] for k, s in enumerate(shards))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert shards[0].weights[(0, n)][0].shape[1] == per[n][0]
        assert shards[0].weights[(0, n)][1].shape[1] == per[n][1]
    assert spec.tensor_parallel_shards == 2
    assert spec.page_elems == 2 * 1 * 16 * cfg.head_dim


NCCL_NAMES = ["init_ccl", "init_ccl_per_worker", "allreduce", "allgather", "broadcast_from_worker0",
              "scatter_from_worker0", "gather_to_worker0", "recv_from_worker0", "send_to_worker",
              "recv_from_worker", "sync_worker"]


def test_nccl_collectives_are_registered_for_disco():
    for name in NCCL_NAMES:
        assert tvm_ffi.get_global_func(f"runtime.disco.nccl.{name}", allow_missing=True) is not None, name


def test_nccl_absent_gives_a_clear_error():
    import ctypes

    try:
        ctypes.CDLL("libnccl.so.2")
        pytest.skip("libnccl.so.2 is installed here")
    except OSError:
        pass
    with pytest.raises(RuntimeError, match=r"cannot open libnccl.so.2 .*pip install 'mlc-lora\[cuda\]'"):
        rt.nccl_version()
