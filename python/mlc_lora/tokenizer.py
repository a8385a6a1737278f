"""The compiled folder's tokenizer: encode/decode, the chat template, streaming detokenisation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .contract import CONFIG_FILE
from .errors import RequestError

ROLES = ("system", "user", "assistant", "tool")


def _token_str(v: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """`tokenizers` JSON + the chat template and special tokens from mlc-lora-config.json."""

    def __init__(self, model_dir: str | Path, info: dict[str, Any] | None = None):
        from tokenizers import Tokenizer as HFTokenizer  # pylint: disable=import-outside-toplevel

        model_dir = Path(model_dir)
        if info is None:
            info = json.loads((model_dir / CONFIG_FILE).read_text()).get("tokenizer", {})
        if "file" not in info or not (model_dir / info["file"]).is_file():
            raise RequestError(f"{model_dir} has no tokenizer.json; text requests need one "
                               "(token-id prompts still work)")
        self.info = info
        self.tok = HFTokenizer.from_file(str(model_dir / info["file"]))
        self.bos_token = _token_str(info.get("bos_token"))
        self.eos_token = _token_str(info.get("eos_token"))
        self.chat_template = info.get("chat_template")
        eos = info.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            ids.add(self.tok.token_to_id(self.eos_token))
        self.eos_token_ids = sorted(int(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works: a long prompt encoded in a worker thread
        # does not stall the server's event loop
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_text(self, i: int) -> str:
        """One token's text (what OpenAI's logprobs call `token`)."""
        return self.tok.decode([i], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` the way transformers does (sandboxed jinja2, trim/lstrip blocks)."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; use completions.create instead")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str):
    if source not in _TEMPLATES:
        import jinja2.ext  # pylint: disable=import-outside-toplevel
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

        def raise_exception(message):
            raise RequestError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


class Detokenizer:
    """Streams text of a growing id list; the pieces concatenate to decode(all ids).

    tokenizers' `DecodeStream` does the work: it decodes a small window so that tokenizers that drop
    a leading space on the first token still give the right text, and holds back a piece ending in
    an incomplete UTF-8 character until the next token completes it; `flush` returns what it still
    holds at the end (that incomplete character, as U+FFFD, the way decode() writes it).
    """

    def __init__(self, tokenizer: Tokenizer):
        from tokenizers.decoders import DecodeStream  # pylint: disable=import-outside-toplevel

        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters returned so far
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._stream.step(self.tok.tok, token_id) or ""
        self.emitted += len(piece)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end)."""
        rest = self.tok.decode(self.ids)[self.emitted:]
        self.emitted += len(rest)
        return rest
