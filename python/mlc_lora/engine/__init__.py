"""The serving engine: continuous batching, on-device sampling, OpenAI-style front ends.

Modules: core (LLMEngine: scheduler, sampler, one step), scheduler (Sequence, Batch, Scheduler),
sampler (the compiled sampling functions), adapters (LoRA adapters by name -> pool slots),
requests (request validation), responses (the OpenAI objects), loop (the engine thread),
frontend (MLCEngine), async_frontend (AsyncMLCEngine), protocol (the OpenAI object types).
"""

from .async_frontend import AsyncMLCEngine
from .core import LLMEngine
from .frontend import MLCEngine
from .scheduler import SamplingParams

__all__ = ["AsyncMLCEngine", "LLMEngine", "MLCEngine", "SamplingParams"]
