"""The serving engine: continuous batching, on-device sampling, OpenAI-style front ends."""

from .engine import AsyncMLCEngine, LLMEngine, MLCEngine
from .scheduler import SamplingParams

__all__ = ["AsyncMLCEngine", "LLMEngine", "MLCEngine", "SamplingParams"]
