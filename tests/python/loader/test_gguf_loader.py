"""GGUF loading against the Hugging Face original: tiny models written as llama.cpp writes them."""

import gguf
import numpy as np
import pytest
import torch
import transformers

from mlc_lora.errors import ModelConfigError, WeightError
from mlc_lora.loader import resolve_model
from mlc_lora.loader.gguf_loader import load_gguf

from ..conftest import make_tiny_hf_model
from .gguf_writer import write_llama_gguf

Q = gguf.GGMLQuantizationType


def _quant_plan(model, layer_types):
    """Quantize the linear weights of each layer with that layer's type; norms stay F32."""
    plan = {}
    for name, _ in model.named_parameters():
        if ".layers." in name and name.endswith("proj.weight"):
            plan[name] = layer_types[int(name.split(".")[2]) % len(layer_types)]
    plan["model.embed_tokens.weight"] = Q.F16
    plan["lm_head.weight"] = Q.Q8_0
    return plan


def _max_quant_error(ref: np.ndarray, qtype) -> np.ndarray:
    """Bound of each value's quantization error, from its 32-value block's scale."""
    if qtype == Q.F16:
        return np.abs(ref) * 2.0**-11 + 1e-7
    blocks = ref.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    if qtype == Q.Q8_0:  # d = amax / 127, round to nearest
        step_err = 0.5 * amax / 127
    elif qtype == Q.Q4_0:  # d = signed max / -8; the far side clamps at level 7: up to one step
        step_err = amax / 8
    else:  # Q4_1: d = (max - min) / 15, round to nearest
        step_err = 0.5 * (blocks.max(axis=1) - blocks.min(axis=1)) / 15
    # + fp16 rounding of the block scale (and of Q4_1's minimum)
    bound = step_err + amax * 2.0**-10 + 1e-7
    return np.repeat(bound, 32).reshape(ref.shape)


@pytest.mark.parametrize("name,layer_types", [("gqa", [Q.F32, Q.Q8_0]), ("llama3", [Q.Q4_1, Q.Q4_0])])
def test_gguf_weights_match_hf(tmp_path, name, layer_types):
    hf = make_tiny_hf_model(tmp_path / "hf", name)
    plan = _quant_plan(hf, layer_types)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, plan)
    src = load_gguf(path)

    hf_cfg = hf.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert src.config[key] == getattr(hf_cfg, key), key
    assert src.config["rms_norm_eps"] == pytest.approx(hf_cfg.rms_norm_eps)
    assert src.config["rope_theta"] == pytest.approx(hf_cfg.rope_parameters["rope_theta"])

    ref = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        ref.pop("lm_head.weight")
    got = dict(src.weights())
    assert sorted(got) == sorted(ref)
    assert src.num_weights == len(ref)
    for k, want in ref.items():
        assert got[k].dtype == np.float32 and got[k].shape == want.shape, k
        qtype = plan.get(k, Q.F32)
        if qtype == Q.F32:
            np.testing.assert_array_equal(got[k], want, err_msg=k)
        else:
            err = np.abs(got[k] - want)
            assert (err <= _max_quant_error(want, qtype)).all(), (k, qtype.name, err.max())
            # and a wrong row order (an un-undone permutation) would be far outside that bound
            assert err.max() < 0.5 * np.abs(want).max(), k


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    """llama.cpp keeps Llama-3 RoPE scaling only as per-frequency divisors; the HF model built
    from our config must reproduce the original inverse frequencies."""
    hf = make_tiny_hf_model(tmp_path / "hf", "llama3")
    src = load_gguf(write_llama_gguf(tmp_path / "tiny.gguf", hf))
    assert src.config["rope_scaling"]["rope_type"] == "llama3"
    assert src.config["head_dim"] == hf.config.head_dim
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig(**src.config))
    np.testing.assert_allclose(rebuilt.model.rotary_emb.inv_freq.numpy(),
                               hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-5)


def test_gguf_model_logits_match_hf(tmp_path):
    """The HF model rebuilt from load_gguf's config and weights computes what the original does."""
    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    src = load_gguf(write_llama_gguf(tmp_path / "tiny.gguf", hf))
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig(**src.config)).eval()
    rebuilt.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in src.weights()}, strict=True)
    ids = torch.tensor([[1, 5, 9, 33, 64, 2]])
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(ids).logits.numpy(), hf(ids).logits.numpy(), atol=1e-5, rtol=0)


def test_unpermute_inverts_llama_cpp_permutation():
    from mlc_lora.loader.gguf_loader import unpermute_qk

    from .gguf_writer import llama_cpp_permute

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    for n_head in (1, 2, 4):
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_gguf_tokenizer_of_tiny_file(tmp_path):
    from tokenizers import Tokenizer

    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    src = resolve_model(write_llama_gguf(tmp_path / "tiny.gguf", hf))
    tok = Tokenizer.from_str(src.tokenizer_json)
    # merges: Ġ t, h e, Ġt he, ..., a t, Ġc at, Ġs at; there is no "t he" merge.
    enc = tok.encode("<|im_start|>the cat sat")
    assert enc.tokens == ["<|im_start|>", "t", "he", "Ġcat", "Ġsat"]
    assert enc.ids[0] == 1
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>the cat sat"
    assert tok.encode(" the cats").tokens == ["Ġthe", "Ġcat", "s"]
    assert src.tokenizer_config["bos_token"] == "<|im_start|>"
    assert src.tokenizer_config["eos_token"] == "<|endoftext|>"
    assert src.tokenizer_config["add_bos_token"] is False
    assert "messages" in src.tokenizer_config["chat_template"]


# --- bad input --------------------------------------------------------------------------------


def test_gguf_of_other_architecture_is_refused(tmp_path):
    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, arch="qwen2")
    with pytest.raises(ModelConfigError, match="architecture 'qwen2'"):
        load_gguf(path)


def test_gguf_tensor_with_wrong_shape_is_named(tmp_path):
    """A GGUF whose q_proj is too short: compile's conversion names the weight."""
    from mlc_lora.models import llama, llama_loader

    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    with torch.no_grad():
        hf.model.layers[1].self_attn.q_proj.weight = torch.nn.Parameter(torch.zeros(32, 64))
    src = load_gguf(write_llama_gguf(tmp_path / "tiny.gguf", hf))
    cfg = llama.LlamaConfig.from_dict(src.config)
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*\(32, 64\)"):
        list(llama_loader.convert_hf_weights(cfg, src.weights(), "float32"))


def test_gguf_q_proj_that_is_not_whole_heads_is_named(tmp_path):
    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    with torch.no_grad():  # 6 rows are not 2 kv heads of an even head_dim
        hf.model.layers[0].self_attn.k_proj.weight = torch.nn.Parameter(torch.zeros(6, 64))
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, permute=False)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*blk\.0\.attn_k"):
        list(load_gguf(path).weights())


def test_truncated_or_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 10)
    with pytest.raises(ModelConfigError, match="not a readable GGUF file: no GGUF magic"):
        resolve_model(bad)
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelConfigError, match="GGUF version 0 is not supported"):
        resolve_model(bad)


def test_header_parser_matches_gguf_py_reader(tmp_path):
    """read_gguf (our one-pass parser) against gguf-py's GGUFReader on every GGUF value type."""
    from mlc_lora.loader.gguf_file import read_gguf

    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.empty", [])
    w.add_tensor("a", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b", gguf.quants.quantize(np.ones((3, 64), np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("c", np.arange(96, dtype=np.float16).reshape(96))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, write_llama_gguf(tmp_path / "tiny.gguf", hf, {"lm_head.weight": Q.Q4_1})):
        ours = read_gguf(p)
        ref = gguf.GGUFReader(str(p))
        want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata.keys() == want.keys()
        for k, v in want.items():
            if isinstance(v, float):
                assert ours.metadata[k] == pytest.approx(v, rel=1e-7), k
            else:
                assert ours.metadata[k] == v, k
        assert list(ours.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            mine = ours.tensors[t.name]
            assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
            np.testing.assert_array_equal(mine.data.view(np.uint8).ravel(), t.data.view(np.uint8).ravel())


def test_truncated_gguf_is_refused(tmp_path):
    hf = make_tiny_hf_model(tmp_path / "hf", "gqa")
    data = write_llama_gguf(tmp_path / "tiny.gguf", hf).read_bytes()
    for cut in (len(data) - 100, 2000, 30):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelConfigError, match="truncated"):
            load_gguf(bad)
