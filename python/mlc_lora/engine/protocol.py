"""OpenAI-shaped response objects: attribute access like the openai client's, `to_dict()` for JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


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
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
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
