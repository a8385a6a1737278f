"""A `tokenizers` JSON and HF tokenizer_config built from a GGUF file's tokenizer.* metadata.

gpt2 (byte-level BPE): vocab, merges, and the pre-tokenizer split that llama.cpp applies for the
file's `tokenizer.ggml.pre`. llama (SentencePiece BPE with byte fallback): merges recovered from the
piece scores. Control tokens (token_type 3) become special added tokens, so "<|im_start|>" in text
encodes to its one id.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ModelConfigError

# token_type values of llama.cpp's vocab
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


# tokenizer.ggml.pre -> (pre-tokenizer steps, ignore_merges), following llama.cpp's llama-vocab.cpp.
_DIGITS_THEN_GPT2 = ([{"type": "Digits", "individual_digits": True}, _byte_level(True)], False)
_LLAMA3 = ([_split(_LLAMA3_SPLIT), _byte_level(False)], True)
_QWEN2 = ([_split(_QWEN2_SPLIT), _byte_level(False)], False)
_GPT2 = ([_byte_level(True)], False)
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2, "command-r": _DIGITS_THEN_GPT2, "exaone": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


def gguf_tokenizer(meta: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(tokenizer.json text or None, tokenizer_config) from GGUF metadata."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        return None, _tokenizer_config(meta, tokens or [])
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if model == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tok = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise ModelConfigError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")
    cfg = _tokenizer_config(meta, tokens)
    tok["added_tokens"] = _added_tokens(tokens, types, {cfg.get("unk_token_id")})
    tok["post_processor"] = _post_processor(cfg, tokens, tok["post_processor"])
    return json.dumps(tok, ensure_ascii=False), cfg


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated string keeps its first id, as llama.cpp's lookup does
    return vocab


def _byte_level_bpe(meta, tokens) -> dict[str, Any]:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelConfigError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    steps, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [m.split(" ", 1) for m in meta.get("tokenizer.ggml.merges") or []]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "pre_tokenizer": steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": _vocab(tokens), "merges": merges},
    }


def _sentencepiece_bpe(meta, tokens, types) -> dict[str, Any]:
    """SentencePiece BPE: merge priority is the merged piece's score (higher merges first)."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelConfigError("GGUF llama tokenizer lacks tokenizer.ggml.scores for every token")
    vocab = _vocab(tokens)
    mergeable = {t: i for t, i in vocab.items() if types[i] in (NORMAL, USER_DEFINED, UNUSED)}
    merges = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                merges.append((scores[i], i, mergeable[left], mergeable[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2], m[3]))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    normalizer = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    if add_prefix:
        normalizer.insert(0, {"type": "Prepend", "prepend": "\u2581"})
    decoder = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
               {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_prefix:
        decoder.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": {"type": "Sequence", "normalizers": normalizer},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoder},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": [[m[4], m[5]] for m in merges]},
    }


def _added_tokens(tokens, types, extra_special) -> list[dict[str, Any]]:
    out = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED) or (i in extra_special and ty == UNKNOWN):
            out.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": ty != USER_DEFINED})
    return out


def _post_processor(cfg, tokens, default):
    """Adds BOS (and EOS) where the GGUF asks for it, as llama.cpp's tokenizer does."""
    add_bos = cfg.get("add_bos_token") and cfg.get("bos_token_id") is not None
    add_eos = cfg.get("add_eos_token") and cfg.get("eos_token_id") is not None
    if not (add_bos or add_eos):
        return default
    single, pair, special = [], [], {}
    if add_bos:
        bos = tokens[cfg["bos_token_id"]]
        single.append({"SpecialToken": {"id": bos, "type_id": 0}})
        special[bos] = {"id": bos, "ids": [cfg["bos_token_id"]], "tokens": [bos]}
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    if add_eos:
        eos_id = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
        eos = tokens[eos_id]
        single = single + [{"SpecialToken": {"id": eos, "type_id": 0}}]
        pair = pair + [{"SpecialToken": {"id": eos, "type_id": 1}}]
        special[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


# Control tokens that end generation although the file names another EOS (llama.cpp does the same).
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")


def _tokenizer_config(meta: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for key, gkey in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        tid = meta.get(f"tokenizer.ggml.{gkey}")
        if tid is not None and 0 <= tid < len(tokens):
            cfg[f"{key}_token_id"] = int(tid)
            cfg[f"{key}_token"] = tokens[tid]
    types = meta.get("tokenizer.ggml.token_type") or []
    eog = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
    eog += [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
    eog += [i for i, t in enumerate(tokens) if t in END_OF_GENERATION and i < len(types) and types[i] == CONTROL]
    eog = list(dict.fromkeys(int(i) for i in eog if 0 <= i < len(tokens)))
    if len(eog) > 1:  # the first stays the file's EOS; HF generation_config also takes a list
        cfg["eos_token_id"] = eog
    model = meta.get("tokenizer.ggml.model")
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
    cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg
