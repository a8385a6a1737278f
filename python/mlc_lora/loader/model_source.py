"""`ModelSource`: what every loader (hf.py, gguf_loader.py) returns."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np


@dataclasses.dataclass
class ModelSource:
    """A model before conversion: an HF-style config and HF-named weights in HF layout."""

    name: str
    config: dict[str, Any]
    # Yields (hf_name, array); arrays are float32, float16 or bfloat16 as stored (dequantized for GGUF).
    weights: Callable[[], Iterator[tuple[str, np.ndarray]]]
    num_weights: int
    # tokenizers-library JSON (tokenizer.json) as a string, or None when the source has none.
    tokenizer_json: str | None = None
    # bos/eos/pad token ids and strings, add_bos_token, chat_template: HF tokenizer_config.json keys.
    tokenizer_config: dict[str, Any] = dataclasses.field(default_factory=dict)
