"""Errors that name the problem; every user-facing failure of mlc-lora raises one of these."""

from __future__ import annotations


class MLCLoraError(Exception):
    """Base class of mlc-lora's errors."""


class ModelConfigError(MLCLoraError, ValueError):
    """config.json (or GGUF metadata) is missing, malformed, or describes an unsupported model."""


class WeightError(MLCLoraError, ValueError):
    """A weight is missing, unexpected, or has the wrong shape."""


class CompileError(MLCLoraError, RuntimeError):
    """The model could not be compiled for the requested target."""


class LoraError(MLCLoraError, ValueError):
    """A LoRA adapter or LoRA compile option is malformed, unsupported, or does not fit the model."""


class PoolExhaustedError(MLCLoraError, RuntimeError):
    """The unified page pool has no page left for KV or an adapter, even after evicting idle ones."""


class RequestError(MLCLoraError, ValueError):
    """A request is malformed: messages, sampling parameters, lengths or an unknown adapter.
    `param` names the request field at fault (OpenAI's error "param"), when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownAdapterError(RequestError):
    """A request names a LoRA adapter that is not loaded (HTTP servers answer 404)."""
