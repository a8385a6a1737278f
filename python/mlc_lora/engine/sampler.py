"""Calls the compiled sampling functions (compiler_passes/ops/sampler/) on a batch's logits.

The logits stay on the device; only the token ids (and the logprobs asked for) come back. The
uniforms for random draws come from each sequence's own seeded numpy Generator, so a seed gives
the same text whatever else shares the batch. A row whose own sampling fails (its parameters do
not fit the device's types, its logprobs are not numbers) comes back as that row's exception; the
rest of the batch is sampled as if it were not there.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..contract import SAMPLER_FUNCTIONS
from ..errors import MLCLoraError
from .scheduler import Sequence



@dataclasses.dataclass
class Sampled:
    token: int
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None


class Sampler:
    def __init__(self, runner):
        try:
            self.fn = {name: runner.vm[name] for name in SAMPLER_FUNCTIONS}
        except Exception as e:  # pylint: disable=broad-except
            raise MLCLoraError(f"{runner.model_dir} has no sampling functions (compiled by an older "
                               "mlc-lora); compile it again") from e
        self.device = runner.device

    def _t(self, a: np.ndarray):
        import tvm  # pylint: disable=import-outside-toplevel

        return tvm.runtime.tensor(np.ascontiguousarray(a), self.device)

    def sample(self, logits, seqs: list[Sequence], rows: list[int]) -> list[Sampled | Exception]:
        """Sample a token for each of `rows` of `logits` (b, V) on device; seqs[i] owns row i.
        Returns one item per row: its Sampled, or the exception its own sampling raised."""
        b = len(seqs)
        failed: dict[int, Exception] = {}
        tokens = np.zeros(b, np.int32)
        if any(seqs[i].greedy for i in rows):
            tokens = self.fn["sample_argmax"](logits).numpy()
        drawn = [i for i in rows if not seqs[i].greedy]
        if drawn:
            temp, top_p = np.ones(b, np.float32), np.ones(b, np.float32)
            top_k, u = np.zeros(b, np.int32), np.zeros(b, np.float32)
            for i in drawn:
                p = seqs[i].params
                try:
                    temp[i], top_p[i], top_k[i] = p.temperature, p.top_p, p.top_k
                    u[i] = seqs[i].rng.random()
                except Exception as e:  # pylint: disable=broad-except
                    failed[i] = e
                    temp[i], top_p[i], top_k[i] = 1.0, 1.0, 0  # the row is sampled, then dropped
            out = self.fn["sample_top_p"](logits, self._t(temp), self._t(top_p), self._t(top_k),
                                          self._t(u)).numpy()
            tokens = np.where([not s.greedy for s in seqs], out, tokens).astype(np.int32)
        result = [Sampled(int(tokens[i])) for i in range(b)]
        if any(seqs[i].params.logprobs for i in rows):
            lp = self.fn["chosen_logprobs"](logits, self._t(tokens)).numpy()
            for i in rows:
                result[i].logprob = float(lp[i])
        if any(seqs[i].params.top_logprobs > 0 for i in rows):
            ids, lps = (x.numpy() for x in self.fn["top_logprobs"](logits))
            for i in rows:
                k = seqs[i].params.top_logprobs
                result[i].top = [(int(ids[i, j]), float(lps[i, j])) for j in range(k)]
        return [failed.get(i, result[i]) for i in rows]
