"""Request validation of the front ends: create() arguments -> SamplingParams and n, and the
prompt (chat messages, text or token ids) -> prompt token ids."""

from __future__ import annotations

from typing import Any, Optional

from ..contract import TOP_LOGPROBS_MAX
from ..errors import RequestError
from ..tokenizer import Tokenizer, check_messages
from .scheduler import SamplingParams

MAX_CHOICES = 16  # `n` of one request: each choice is a sequence of its own (the prompt prefilled n times)
# OpenAI arguments that are accepted and have no effect here.
IGNORED_ARGUMENTS = ("model", "stream_options", "user")


def request_options(max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None, stop=None,
                    logprobs=None, top_logprobs=None, ignore_eos=False, stop_token_ids=None, n=1,
                    max_completion_tokens=None, **extra: Any) -> tuple[SamplingParams, int]:
    """The sampling parameters and the number of choices of a create(...) call."""
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    unknown = set(extra) - set(IGNORED_ARGUMENTS)
    if unknown:
        raise RequestError(f"unknown request arguments: {', '.join(sorted(unknown))}")
    if max_completion_tokens is not None and max_tokens is None:
        max_tokens = max_completion_tokens
    return sampling_params(max_tokens, temperature, top_p, top_k, seed, stop, logprobs, top_logprobs,
                           ignore_eos, stop_token_ids), n


def sampling_params(max_tokens, temperature, top_p, top_k, seed, stop, logprobs, top_logprobs,
                    ignore_eos, stop_token_ids) -> SamplingParams:
    """OpenAI's sampling arguments, checked; None means the default."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if temperature is None:
        temperature = 1.0
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if top_p is None:
        top_p = 1.0
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    top_k = top_k or 0
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0 (0 = off), got {top_k}")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(x, str) or not x for x in stop):
        raise RequestError("stop must be a non-empty string or a list of them")
    top_logprobs = top_logprobs or 0
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # completions: logprobs=k
        top_logprobs, logprobs = logprobs, True
    if not 0 <= top_logprobs <= TOP_LOGPROBS_MAX:
        raise RequestError(f"top_logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {top_logprobs}")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          top_k=int(top_k), seed=seed, stop=tuple(stop),
                          stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=bool(ignore_eos),
                          logprobs=bool(logprobs or top_logprobs), top_logprobs=int(top_logprobs))


def prompt_ids(tokenizer: Optional[Tokenizer], chat: bool, messages=None, prompt=None) -> list[int]:
    """The prompt's token ids: chat messages through the chat template, a text, or token ids."""
    if chat:
        msgs = check_messages(messages)
        if tokenizer is None:
            raise RequestError("chat needs a tokenizer; this model has none")
        return tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("text prompts need a tokenizer; pass token ids")
        return tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise RequestError("prompt must be a string or a list of token ids")
