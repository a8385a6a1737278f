"""`Runner`: what the engine needs of a compiled model, whether it runs on one device
(`ModelRunner`) or over one disco worker per tensor-parallel shard (`ShardedModelRunner`)."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..errors import MLCLoraError
from ..lora.layout import LoraSpec
from .config import CompiledConfig
from .pool import Pool

# The LoRA inputs of a forward pass: "pool" (the tables the pool builds from each sequence's
# adapter), None (every row on the base model) or, on one device, a dict of tables keyed by
# contract.LORA_TABLE_INPUTS (tests and benchmarks).
LoraInputs = Union[str, dict, None]


class Runner(abc.ABC):
    """A compiled model ready to run. `prefill`/`decode` return the batch's logits (b, V) on
    `device`, where the compiled sampling functions of `vm` run on them."""

    def __init__(self, compiled: CompiledConfig):
        self.compiled = compiled

    # --- the compiled folder --------------------------------------------------------------------

    @property
    def model_dir(self) -> Path:
        return self.compiled.model_dir

    @property
    def config(self) -> dict[str, Any]:
        """mlc-lora-config.json as written (what the adapter packers take)."""
        return self.compiled.raw

    @property
    def model_config(self) -> dict[str, Any]:
        return self.compiled.model_config

    @property
    def lora(self) -> Optional[LoraSpec]:
        """The LoRA spec the model was compiled for; None without LoRA."""
        return self.compiled.lora

    @property
    def dtype(self) -> str:
        return self.compiled.dtype

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def num_shards(self) -> int:
        return self.compiled.tensor_parallel_shards

    # --- running it -----------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def device(self):
        """The TVM device the logits are on."""

    @property
    @abc.abstractmethod
    def vm(self):
        """The compiled module on `device` (its sampling functions run on the logits)."""

    @abc.abstractmethod
    def create_pool(self, max_batch_size: int, max_total_seq_len: int,
                    prefill_chunk_size: Optional[int] = None) -> Pool:
        """A unified pool for `max_batch_size` sequences of `max_total_seq_len` tokens in all
        (the page count is ceil(tokens / PAGE_SIZE) + 1), configured for the compiled LoRA."""

    @abc.abstractmethod
    def prefill(self, pool: Pool, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]],
                lora: LoraInputs = None, positions: Optional[Sequence[Sequence[int]]] = None):
        """One ragged prefill over several sequences; the last-token logits (b, V). `positions`:
        for each sequence, the indices inside its tokens whose logits to return instead (in that
        order, sequence after sequence); the rows are then (sum of their counts, V)."""

    @abc.abstractmethod
    def decode(self, pool: Pool, seq_ids: Sequence[int], tokens: Sequence[int], lora: LoraInputs = None):
        """One decode step, one token per sequence; the logits (b, V)."""

    def capture_decode_graphs(self, pool: Pool, progress=None) -> int:  # pylint: disable=unused-argument
        """Capture the decode's CUDA graphs before serving (libraries compiled with them); the
        batch sizes captured (0: none to capture)."""
        return 0


def logit_rows(lengths: Sequence[int], positions: Optional[Sequence[Sequence[int]]] = None) -> np.ndarray:
    """`prefill`'s logit_positions: each sequence's last token, or the given `positions` inside
    each sequence's tokens, as indices into the concatenated tokens."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    if positions is None:
        return (starts + np.asarray(lengths) - 1).astype(np.int32)
    if len(positions) != len(lengths) or any(not 0 <= p < n for ps, n in zip(positions, lengths) for p in ps):
        raise MLCLoraError("prefill positions must lie inside each sequence's tokens")
    rows = [s + p for s, ps in zip(starts, positions) for p in ps]
    if not rows:
        raise MLCLoraError("prefill positions name no token")
    return np.asarray(rows, np.int32)
