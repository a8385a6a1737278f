"""The streaming detokenizer: its pieces concatenate to decode(all ids), byte-fallback characters
split over several tokens included, and it never emits a piece with an incomplete character."""

from __future__ import annotations

import pytest

from mlc_lora.tokenizer import Detokenizer, Tokenizer

TEXTS = ["Hello world, streaming text!", " leading space and  double  spaces",
         "Ünïcödé tëxt and emoji 🙂🙂 then 漢字 and more", "line one\nline two\n\ttabbed"]


@pytest.fixture(scope="module")
def tokenizer(tiny_chat):
    _, compiled = tiny_chat
    return Tokenizer(compiled)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    tail = detok.flush()
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert not any("\\ufffd" in p for p in pieces)
    assert detok.flush() == ""


def test_a_cut_character_is_held_back_then_flushed(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    held = 0
    for cut in range(1, len(ids) + 1):
        detok = Detokenizer(tokenizer)
        text = "".join(detok.push(i) for i in ids[:cut])
        assert "\\ufffd" not in text
        tail = detok.flush()
        assert text + tail == tokenizer.decode(ids[:cut])
        held += tail != ""
    assert held > 0, "the emoji should span several byte tokens of this tokenizer"
    assert tokenizer.decode(ids).endswith("🙂")
