"""Request validation of the front ends: create() arguments -> SamplingParams and n, and the
prompt (chat messages, text or token ids) -> prompt token ids.

This is the one place where a request's fields are checked, with their types and bounds, for
MLCEngine and the HTTP server alike: a bad field is a `RequestError` naming it (its `param`), never
a TypeError from deeper down or a failure inside an engine step that other requests share. Checks
that need the model (token ids below the vocabulary size, lengths within the context, the
adapter) are `LLMEngine.make_sequence`'s.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..contract import TOP_LOGPROBS_MAX
from ..errors import RequestError
from ..tokenizer import ROLES, Tokenizer
from .scheduler import SamplingParams

MAX_CHOICES = 16  # `n` of one request: each choice is a sequence of its own (the prompt prefilled n times)
# OpenAI arguments that are accepted and have no effect here.
IGNORED_ARGUMENTS = ("model", "stream_options", "user")
INT32_MAX = 2**31 - 1  # top_k and token counts go to the device as int32
SEED_MAX = 2**63 - 1  # OpenAI's seed is an int64
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-6  # below (but above 0), logits / temperature overflows float32
MAX_STOP = 16  # stop strings of one request


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    if not lo <= v <= hi:
        raise RequestError(f"{name} must be an integer in [{lo}, {hi}], got {v}", name)
    return v


def _number(name: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise RequestError(f"{name} must be a number, got {v!r}", name)
    if not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v}", name)
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", name)
    return v


def check_text(name: str, s: str, param: Optional[str] = None) -> str:
    """`s` itself: a str that UTF-8 can encode (no lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} is not valid Unicode: {e.reason} at position {e.start}",
                           param or name) from None
    return s


def request_options(max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None, stop=None,
                    logprobs=None, top_logprobs=None, ignore_eos=False, stop_token_ids=None, n=1,
                    max_completion_tokens=None, **extra: Any) -> tuple[SamplingParams, int]:
    """The sampling parameters and the number of choices of a create(...) call."""
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    unknown = set(extra) - set(IGNORED_ARGUMENTS)
    if unknown:
        raise RequestError(f"unknown request arguments: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    if max_completion_tokens is not None:
        _int("max_completion_tokens", max_completion_tokens, 1, INT32_MAX)
        if max_tokens is None:
            max_tokens = max_completion_tokens
    return sampling_params(max_tokens, temperature, top_p, top_k, seed, stop, logprobs, top_logprobs,
                           ignore_eos, stop_token_ids), n


def sampling_params(max_tokens, temperature, top_p, top_k, seed, stop, logprobs, top_logprobs,
                    ignore_eos, stop_token_ids) -> SamplingParams:
    """OpenAI's sampling arguments, checked; None means the default."""
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        _int("max_tokens", max_tokens, 1, INT32_MAX)
    temperature = 1.0 if temperature is None else _number("temperature", temperature)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}", "temperature")
    if temperature > MAX_TEMPERATURE or 0 < temperature < MIN_TEMPERATURE:
        raise RequestError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                           f"got {temperature}", "temperature")
    top_p = 1.0 if top_p is None else _number("top_p", top_p)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if top_k is None else top_k
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 0:
        raise RequestError(f"top_k must be >= 0 (0 = off), got {top_k}", "top_k")
    top_k = _int("top_k", top_k, 0, INT32_MAX)
    if seed is not None:
        _int("seed", seed, 0, SEED_MAX)
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, (list, tuple)) or any(not isinstance(x, str) or not x for x in stop):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"stop holds {len(stop)} strings; at most {MAX_STOP} are allowed", "stop")
    for x in stop:
        check_text("stop", x)
    if stop_token_ids is None:
        stop_token_ids = []
    if not isinstance(stop_token_ids, (list, tuple)) or any(
            not isinstance(t, int) or isinstance(t, bool) for t in stop_token_ids):
        raise RequestError(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}", "stop_token_ids")
    if any(t < 0 for t in stop_token_ids):
        raise RequestError("stop_token_ids must be a list of integers >= 0 (token ids)", "stop_token_ids")
    ignore_eos = _bool("ignore_eos", False if ignore_eos is None else ignore_eos)
    if top_logprobs is not None:
        _int("top_logprobs", top_logprobs, 0, TOP_LOGPROBS_MAX)
    top_logprobs = top_logprobs or 0
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # completions: logprobs=k
        top_logprobs, logprobs = _int("logprobs", logprobs, 0, TOP_LOGPROBS_MAX), True
    logprobs = _bool("logprobs", False if logprobs is None else logprobs)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=tuple(stop), stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                          logprobs=bool(logprobs or top_logprobs), top_logprobs=top_logprobs)


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
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError("prompt must be a string or a list of token ids", "prompt")
