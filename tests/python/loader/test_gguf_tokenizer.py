"""Tokenizers built from GGUF metadata against transformers' own GGUF tokenizer conversion."""

import gguf
import pytest
from tokenizers import Tokenizer

from mlc_lora.errors import ModelConfigError
from mlc_lora.loader.gguf_file import read_gguf
from mlc_lora.loader.gguf_tokenizer import gguf_tokenizer

TEXTS = ["the cat sat", "the  cat   sat on the mat  ", "théâtre ✓ 😀", "a\nb\n\n c", "that"]


def _write_spm_gguf(path):
    """A tiny SentencePiece (llama) vocabulary: specials, 256 byte tokens, scored pieces."""
    pieces = ["▁", "t", "h", "e", "c", "a", "s", "o", "n", "m", "▁t", "he", "▁the", "at", "▁c", "▁cat",
              "▁s", "▁sat", "▁o", "▁on", "▁m", "▁mat", "th", "▁a"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    path = _write_spm_gguf(tmp_path / "spm.gguf")
    tok_json, cfg = gguf_tokenizer(read_gguf(path).metadata)
    ours = Tokenizer.from_str(tok_json)
    ref = _transformers_tokenizer(path)
    assert cfg["bos_token"] == "<s>" and cfg["add_bos_token"] is True
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ids[:1] == [1]  # BOS added, as llama.cpp does for SentencePiece vocabularies
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    # A leading space: llama.cpp (like SentencePiece's add_dummy_prefix and HF's Llama-2
    # tokenizer.json) always prepends "▁"; transformers' GGUF conversion (Metaspace) skips it then.
    # The same after a special token (llama.cpp's is_prev_special).
    assert ours.encode("  the").tokens == ["<s>", "▁", "▁", "▁the"]
    assert ours.encode("<s>the").tokens == ["<s>", "<s>", "▁the"]
    # byte fallback: a character outside the vocabulary becomes its UTF-8 bytes
    assert ours.encode("é", add_special_tokens=False).tokens[-2:] == ["<0xC3>", "<0xA9>"]


def test_unknown_pre_tokenizer_is_refused():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": []}
    with pytest.raises(ModelConfigError, match="pre-tokenizer 'no-such-pre'"):
        gguf_tokenizer(meta)


def test_unknown_tokenizer_model_is_refused():
    with pytest.raises(ModelConfigError, match="tokenizer model 'rwkv'"):
        gguf_tokenizer({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
