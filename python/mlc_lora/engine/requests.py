"""Request validation of the front ends: create() arguments -> the request model (protocol.py:
types and bounds) -> SamplingParams and n, and the prompt (chat messages, text or token ids, or a
list of prompts) -> prompt token ids.

The request models are the one place where a request's fields are declared with their types and
bounds, for MLCEngine and the HTTP server alike: a bad field is a `RequestError` naming it (its
`param`), never a TypeError from deeper down or a failure inside an engine step that other
requests share. MLCEngine refuses unknown arguments (a typo); the server ignores unknown fields,
as vLLM does. Checks that need the model (token ids below the vocabulary size, lengths within the
context, the adapter) are `LLMEngine.make_sequence`'s.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from ..errors import RequestError
from ..tokenizer import ROLES, Tokenizer
from . import protocol as P
from .protocol import MAX_CHOICES, MAX_PROMPTS, MAX_STOP, SEED_MAX, INT32_MAX  # noqa: F401  (re-exported)
from .scheduler import SamplingParams

# OpenAI arguments that are accepted and have no effect here.
IGNORED_ARGUMENTS = ("model", "stream_options", "user", "stream", "best_of")
MAX_SEQUENCES = 256  # prompts x n of one request


def validate(model_cls: type[BaseModel], fields: dict[str, Any], unknown_ok: bool = False):
    """`fields` as a `model_cls` (protocol.py); RequestError naming the first bad field. Unknown
    fields are a RequestError unless `unknown_ok` (then they stay in `model_extra`)."""
    try:
        req = model_cls.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        param = loc[0] if loc else None
        msg = err["msg"]
        if err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif err["type"] == "missing":
            msg = f"{'.'.join(loc)} is required"
        else:
            msg = f"{'.'.join(loc)}: {msg}"
        raise RequestError(msg, param) from None
    unknown = sorted(set(req.model_extra or {}) - set(IGNORED_ARGUMENTS))
    if unknown and not unknown_ok:
        raise RequestError(f"unknown request arguments: {', '.join(unknown)}", unknown[0])
    return req


def request_options(**kw: Any) -> tuple[SamplingParams, int]:
    """The sampling parameters and the number of choices of a create(...) call's arguments."""
    req = validate(P.SamplingRequest, kw)
    return sampling_params(req), req.n or 1


def sampling_params(req: P.SamplingRequest, grammar: Any = None) -> SamplingParams:
    """A validated request's SamplingParams (None fields: the defaults). `grammar`: the compiled
    `response_format`, if any (engine/grammar.py)."""
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    echo = bool(getattr(req, "echo", False))
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens must be an integer >= 1 (0 only with echo: the prompt's logprobs), "
                           "got 0", "max_tokens")
    top_logprobs = req.top_logprobs or 0
    logprobs = req.logprobs
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # completions: logprobs=k
        top_logprobs, logprobs = logprobs, True
    logprobs = bool(logprobs or top_logprobs)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
        stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=echo and logprobs,
        frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple((int(t), b) for t, b in (req.logit_bias or {}).items()), grammar=grammar)


def check_text(name: str, s: str, param: Optional[str] = None) -> str:
    """`s` itself: a str that UTF-8 can encode (no lone surrogates)."""
    try:
        return P.check_unicode(name, s)
    except ValueError as e:
        raise RequestError(str(e), param or name) from None


def check_messages(messages) -> list[dict]:
    """OpenAI-style chat messages, checked; returns them as plain dicts with string contents."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content'", "messages")
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            raise RequestError(f"messages[{i}] has unknown role {m['role']!r}; use one of {', '.join(ROLES)}",
                               "messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
            for j, p in enumerate(content):
                if not isinstance(p.get("text"), str):
                    raise RequestError(f"messages[{i}].content[{j}].text must be a string", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", "messages")
        check_text(f"messages[{i}].content", content, "messages")
        for k, v in m.items():  # name, tool_call_id...: the template may print them
            if isinstance(v, str):
                check_text(f"messages[{i}].{k}", v, "messages")
        out.append({**m, "content": content})
    return out


def split_prompts(prompt) -> list:
    """A completion's `prompt` as a list of prompts (protocol.prompt_list), RequestError if bad."""
    try:
        return P.prompt_list(prompt)
    except ValueError as e:
        raise RequestError(str(e), "prompt") from None


def prompt_ids(tokenizer: Optional[Tokenizer], chat: bool, messages=None, prompt=None) -> list[int]:
    """The prompt's token ids: chat messages through the chat template, a text, or token ids."""
    if chat:
        msgs = check_messages(messages)
        if tokenizer is None:
            raise RequestError("chat needs a tokenizer; this model has none", "messages")
        return tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    if isinstance(prompt, str):
        check_text("prompt", prompt)
        if tokenizer is None:
            raise RequestError("text prompts need a tokenizer; pass token ids", "prompt")
        return tokenizer.encode(prompt)
    if P._is_ids(prompt):  # pylint: disable=protected-access
        return list(prompt)
    raise RequestError("prompt must be a string or a list of token ids", "prompt")
