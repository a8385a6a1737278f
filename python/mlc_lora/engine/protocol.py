"""OpenAI-shaped objects: the request models (pydantic: types, bounds, the OpenAPI schema) and the
response objects (attribute access like the openai client's, `to_dict()` for JSON)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..contract import TOP_LOGPROBS_MAX


class _Obj:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    model_dump = to_dict  # the openai client's (pydantic) spelling


@dataclass
class CompletionUsage(_Obj):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class TopLogprob(_Obj):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


@dataclass
class ChatCompletionTokenLogprob(_Obj):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class ChoiceLogprobs(_Obj):
    content: list[ChatCompletionTokenLogprob] = field(default_factory=list)


@dataclass
class ChatCompletionMessage(_Obj):
    role: str
    content: str


@dataclass
class ChatCompletionChoice(_Obj):
    index: int
    message: ChatCompletionMessage
    finish_reason: Optional[str]
    logprobs: Optional[ChoiceLogprobs] = None
    token_ids: Optional[list[int]] = None  # extension (as vLLM's): the generated ids


@dataclass
class ChatCompletion(_Obj):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    object: str = "chat.completion"


@dataclass
class ChoiceDelta(_Obj):
    content: Optional[str] = None
    role: Optional[str] = None


@dataclass
class ChatCompletionChunkChoice(_Obj):
    index: int
    delta: ChoiceDelta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChoiceLogprobs] = None


@dataclass
class ChatCompletionChunk(_Obj):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Optional[CompletionUsage] = None
    object: str = "chat.completion.chunk"


@dataclass
class CompletionLogprobs(_Obj):
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[Optional[float]] = field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[Optional[dict[str, float]]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


@dataclass
class CompletionChoice(_Obj):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[CompletionLogprobs] = None
    token_ids: Optional[list[int]] = None  # extension (as vLLM's): the generated ids


@dataclass
class Completion(_Obj):
    """Also the type of each streamed chunk of a completion (as in OpenAI's API)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[CompletionUsage] = None
    object: str = "text_completion"


# --- requests ------------------------------------------------------------------------------------
# The one place where a request's fields are declared with their types and bounds: the HTTP server's
# OpenAPI schema and MLCEngine's create(...) checks both come from these models
# (engine/requests.py turns a validated model into SamplingParams).

INT32_MAX = 2**31 - 1  # top_k and token counts go to the device as int32
SEED_MAX = 2**63 - 1  # OpenAI's seed is an int64
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-6  # below (but above 0), logits / temperature overflows float32
MAX_CHOICES = 16  # `n` (and `best_of`) of one request: each choice is a sequence of its own
MAX_STOP = 16  # stop strings of one request
MAX_PROMPTS = 64  # prompts of one batched completion request
MAX_LOGIT_BIAS = 300  # entries of one logit_bias (OpenAI's limit)
PENALTY_MAX = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's bounds)
REPETITION_PENALTY_MAX = 10.0


def _bounds(field) -> tuple[Any, Any, bool]:
    """(lower, upper, lower is exclusive) of a field's annotated_types metadata."""
    lo = hi = None
    excl = False
    for m in field.metadata:
        lo = getattr(m, "ge", lo)
        if getattr(m, "gt", None) is not None:
            lo, excl = m.gt, True
        hi = getattr(m, "le", hi)
    return lo, hi, excl


def _kind(field) -> str:
    ann = str(field.annotation)
    for k in ("bool", "int", "float"):
        if ann in (k, f"typing.Optional[{k}]", f"Optional[{k}]", f"{k} | None"):
            return k
    return ""


class _Checked(BaseModel):
    """Scalar fields are checked before pydantic coerces them, with messages that name the field
    and its bounds (read from the field's own Field(ge=..., le=...), the one statement of them)."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _scalar(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        field = cls.model_fields[name]
        kind = _kind(field)
        if v is None or not kind:
            return v
        if kind == "bool":
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a boolean, got {v!r}")
            return v
        lo, hi, excl = _bounds(field)
        if kind == "int":
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v}")
            return v
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{name} must be a number, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
        if (lo is not None and (v <= lo if excl else v < lo)) or (hi is not None and v > hi):
            span = f"in ({lo}, {hi}]" if excl else f">= {lo} and <= {hi}"
            raise ValueError(f"{name} must be {span}, got {v}")
        return v


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


class SamplingRequest(_Checked):
    """The sampling fields that chat and completions share (OpenAI's, and vLLM's extensions)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=0, le=INT32_MAX, description="0: score the prompt only (echo)")
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX)
    temperature: Optional[float] = Field(None, ge=0, le=MAX_TEMPERATURE,
                                         description=f"0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0, le=INT32_MAX, description="0 or -1: off")
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = Field(None, description=f"at most {MAX_STOP} non-empty strings")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = False
    logprobs: Optional[Union[bool, int]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    n: Optional[int] = Field(1, ge=1, le=MAX_CHOICES)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_CHOICES, description="vLLM's: must equal n if given")
    frequency_penalty: Optional[float] = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    presence_penalty: Optional[float] = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    repetition_penalty: Optional[float] = Field(1.0, gt=0, le=REPETITION_PENALTY_MAX)
    logit_bias: Optional[dict[str, float]] = Field(
        None, description=f"token id -> bias in [-100, 100], at most {MAX_LOGIT_BIAS} entries")
    response_format: Optional[ResponseFormat] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            if v == -1:
                return 0  # vLLM's "off"
            raise ValueError(f"top_k must be >= 0 (0 or -1 = off), got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        stop = [v] if isinstance(v, str) else v if v is not None else []
        if not isinstance(stop, (list, tuple)) or any(not isinstance(x, str) or not x for x in stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        if len(stop) > MAX_STOP:
            raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP} are allowed")
        for x in stop:
            check_unicode("stop", x)
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, (list, tuple)) or any(not isinstance(t, int) or isinstance(t, bool) for t in v):
            raise ValueError(f"stop_token_ids must be a list of integers, got {v!r}")
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be a list of integers >= 0 (token ids)")
        return v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v: Any) -> Any:
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):  # completions: logprobs=k
            if not 0 <= v <= TOP_LOGPROBS_MAX:
                raise ValueError(f"logprobs must be an integer in [0, {TOP_LOGPROBS_MAX}], got {v}")
            return v
        raise ValueError(f"logprobs must be a boolean, got {v!r}")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, dict):
            raise ValueError("logit_bias must be an object mapping token ids to numbers")
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        out = {}
        for k, b in v.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if t < 0 or t > INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {k!r}")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
                raise ValueError(f"logit_bias[{k!r}] must be a finite number, got {b!r}")
            out[str(t)] = max(-100.0, min(100.0, float(b)))  # OpenAI clamps to [-100, 100]
        return out

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError(f"best_of must equal n ({self.n or 1}) if given: only the n choices are "
                             f"generated, got {self.best_of}")
        return self


def check_unicode(name: str, s: str) -> str:
    """`s` itself: a str that UTF-8 can encode (no lone surrogates); ValueError otherwise."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: {e.reason} at position {e.start}") from None
    return s


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a text, token ids, or a list of either (one choice set
    each, choices numbered prompt by prompt). `echo`: the prompt comes back before the text
    (with its logprobs when `logprobs` is asked)."""

    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description=f"at most {MAX_PROMPTS} prompts in a list")
    echo: Optional[bool] = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        prompt_list(v)
        return v


def _is_ids(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def prompt_list(prompt: Any) -> list:
    """A completion's `prompt` as a list of prompts (each a text or token ids): a text or one id
    list is one prompt; a list of texts or of id lists is a batch. ValueError otherwise."""
    if isinstance(prompt, str):
        check_unicode("prompt", prompt)
        return [prompt]
    if _is_ids(prompt) and prompt:
        return [list(prompt)]
    if isinstance(prompt, (list, tuple)) and prompt and (
            all(isinstance(p, str) for p in prompt) or all(_is_ids(p) and p for p in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed")
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                check_unicode(f"prompt[{i}]", p)
        return list(prompt)
    raise ValueError("prompt must be a string or a list of token ids (or a list of either)")


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(v):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        return v
