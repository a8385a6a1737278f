"""`response_format` through xgrammar (the grammar engine MLC-LLM uses): a JSON schema (or any
JSON object) compiled once per request against the tokenizer's vocabulary; each sequence walks
it with its own matcher, whose mask of allowed tokens the sampler applies before sampling
(engine/sampler.py `process_logits`). The output then parses as JSON and follows the schema."""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

import numpy as np

from ..errors import RequestError

_compilers: dict[tuple[int, int], Any] = {}  # (id(tokenizer), vocab) -> xgrammar.GrammarCompiler
_lock = threading.Lock()


def _compiler(tokenizer, vocab_size: int):
    import xgrammar as xgr  # pylint: disable=import-outside-toplevel

    key = (id(tokenizer), vocab_size)
    with _lock:
        if key not in _compilers:
            tok = tokenizer.tok
            vocab = tok.get_vocab(with_added_tokens=True)
            encoded = [""] * max(vocab_size, len(vocab))
            for text, i in vocab.items():
                encoded[i] = text
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())  # pylint: disable=protected-access
            info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                     stop_token_ids=tokenizer.eos_token_ids, add_prefix_space=meta["add_prefix_space"])
            _compilers[key] = xgr.GrammarCompiler(info, cache_enabled=True)
        return _compilers[key]


class Matcher:
    """One sequence's place in the grammar."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr  # pylint: disable=import-outside-toplevel

        self.m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = np.zeros((1, (vocab_size + 31) // 32), np.int32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next: bit i of word i // 32 (ceil(vocab / 32),) int32."""
        self.m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0].copy()

    def accept(self, token: int) -> None:
        if not self.m.accept_token(int(token)):
            raise RequestError(f"token {token} does not follow the response_format grammar")

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class Grammar:
    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size

    def matcher(self) -> Matcher:
        return Matcher(self.compiled, self.vocab_size)


def compile_grammar(tokenizer, response_format, vocab_size: int) -> Optional[Grammar]:
    """The grammar of a request's `response_format` (protocol.ResponseFormat): None for text."""
    if response_format is None or response_format.type == "text":
        return None
    if tokenizer is None:
        raise RequestError("response_format needs a tokenizer; this model has none", "response_format")
    compiler = _compiler(tokenizer, vocab_size)
    if response_format.type == "json_object":
        return Grammar(compiler.compile_json_schema('{"type": "object"}', any_whitespace=False), vocab_size)
    js = response_format.json_schema
    if js is None or js.schema_ is None:
        raise RequestError("response_format of type json_schema needs json_schema.schema", "response_format")
    try:
        compiled = compiler.compile_json_schema(json.dumps(js.schema_), any_whitespace=False,
                                                strict_mode=bool(js.strict))
    except Exception as e:  # pylint: disable=broad-except
        raise RequestError(f"response_format.json_schema.schema is not a usable JSON schema: {e}",
                           "response_format") from None
    return Grammar(compiled, vocab_size)
