"""Calls the compiled sampling functions (compiler_passes/ops/sampler/) on a batch's logits.

The logits stay on the device; only the token ids (and the logprobs asked for) come back. The
uniforms for random draws come from each sequence's own seeded numpy Generator, so a seed gives
the same text whatever else shares the batch. A row whose own sampling fails (its parameters do
not fit the device's types, its logprobs are not numbers) comes back as that row's exception; the
rest of the batch is sampled as if it were not there.

Penalties, `logit_bias` and a grammar's token mask (`process_logits`) change the logits before
sampling: in a step where some row asks for them, the batch's logits are copied to the host, those
rows are processed there, and the copy goes back to the device for the same compiled sampling
functions. Log-probabilities are always those of the model's own logits (vLLM's default,
"raw_logprobs"). Prompt log-probabilities (`score_prompt`) use the same functions.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Optional, Sequence as Seq

import numpy as np

from ..contract import SAMPLER_FUNCTIONS
from ..errors import MLCLoraError
from .scheduler import SamplingParams, Sequence

LOGIT_BIAS_MAX = 100.0  # OpenAI's bound on a logit_bias value


@dataclasses.dataclass
class Sampled:
    token: int
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None


def process_logits(row: np.ndarray, params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int],
                   mask: Optional[np.ndarray] = None) -> None:
    """Apply a request's logit processing to its logits `row` (V,) float32, in place.

    Semantics (vLLM's order and formulas):
        row[t] += logit_bias[t]                                    for each (t, bias) given
        seen = set(prompt_ids) | set(output_ids)
        row[t] = row[t] / rp if row[t] > 0 else row[t] * rp         for t in seen  (rp = repetition_penalty)
        row[t] -= frequency_penalty * count(t in output_ids)
                  + presence_penalty * (t in output_ids)
        row[t] = -inf                                               where mask[t] is False (grammar)
    Token ids outside the vocabulary are refused (a RequestError-worthy mistake of this row alone).
    """
    vocab = row.shape[0]
    for t, bias in params.logit_bias:
        if not 0 <= t < vocab:
            raise MLCLoraError(f"logit_bias names token {t}, outside the vocabulary [0, {vocab})")
        row[t] += bias
    if params.repetition_penalty != 1.0:
        seen = np.fromiter(set(prompt_ids) | set(output_ids), np.int64)
        v = row[seen]
        row[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = Counter(output_ids)
        ids = np.fromiter(counts, np.int64)
        n = np.fromiter(counts.values(), np.float32)
        row[ids] -= params.frequency_penalty * n + params.presence_penalty
    if mask is not None:
        row[~mask[:vocab]] = -np.inf


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

    def sample(self, logits, seqs: list[Sequence], rows: list[int], row_of: Optional[list[int]] = None,
               masks: Optional[dict[int, np.ndarray]] = None) -> list[Sampled | Exception]:
        """Sample a token for each of `rows` of `seqs` from `logits` (R, V) on device; seqs[i]
        owns logits row row_of[i] (default i). `masks[i]`: the tokens seqs[i]'s grammar allows.
        Returns one item per row: its Sampled, or the exception its own sampling raised."""
        b = len(seqs)
        row_of = list(range(b)) if row_of is None else row_of
        n_rows = int(logits.shape[0])
        failed: dict[int, Exception] = {}
        raw = logits
        processed = [i for i in rows if seqs[i].params.processes_logits]
        if processed:
            host = logits.numpy()
            for i in processed:
                s = seqs[i]
                try:
                    process_logits(host[row_of[i]], s.params, s.prompt_ids, s.output_ids, (masks or {}).get(i))
                except Exception as e:  # pylint: disable=broad-except
                    failed[i] = e
            logits = self._t(host)
        tokens = np.zeros(n_rows, np.int32)
        if any(seqs[i].greedy for i in rows):
            tokens = self.fn["sample_argmax"](logits).numpy()
        drawn = [i for i in rows if not seqs[i].greedy]
        if drawn:
            temp, top_p = np.ones(n_rows, np.float32), np.ones(n_rows, np.float32)
            top_k, u = np.zeros(n_rows, np.int32), np.zeros(n_rows, np.float32)
            for i in drawn:
                p, r = seqs[i].params, row_of[i]
                try:
                    temp[r], top_p[r], top_k[r] = p.temperature, p.top_p, p.top_k
                    u[r] = seqs[i].rng.random()
                except Exception as e:  # pylint: disable=broad-except
                    failed[i] = e
                    temp[r], top_p[r], top_k[r] = 1.0, 1.0, 0  # the row is sampled, then dropped
            out = self.fn["sample_top_p"](logits, self._t(temp), self._t(top_p), self._t(top_k),
                                          self._t(u)).numpy()
            is_drawn = np.zeros(n_rows, bool)
            is_drawn[[row_of[i] for i in drawn]] = True
            tokens = np.where(is_drawn, out, tokens).astype(np.int32)
        result = [Sampled(int(tokens[row_of[i]])) for i in range(b)]
        if any(seqs[i].params.logprobs for i in rows):
            lp = self.fn["chosen_logprobs"](raw, self._t(tokens)).numpy()
            for i in rows:
                result[i].logprob = float(lp[row_of[i]])
        if any(seqs[i].params.top_logprobs > 0 for i in rows):
            ids, lps = (x.numpy() for x in self.fn["top_logprobs"](raw))
            for i in rows:
                k, r = seqs[i].params.top_logprobs, row_of[i]
                result[i].top = [(int(ids[r, j]), float(lps[r, j])) for j in range(k)]
        return [failed.get(i, result[i]) for i in rows]

    def score(self, logits, targets: np.ndarray, top: bool) -> list[Sampled]:
        """The logprob of targets[r] under logits row r (and the top 20 of the row when `top`):
        prompt log-probabilities, row r being the logits just before token targets[r]."""
        lp = self.fn["chosen_logprobs"](logits, self._t(targets.astype(np.int32))).numpy()
        out = [Sampled(int(t), float(x)) for t, x in zip(targets, lp)]
        if top:
            ids, lps = (x.numpy() for x in self.fn["top_logprobs"](logits))
            for r, s in enumerate(out):
                s.top = [(int(ids[r, j]), float(lps[r, j])) for j in range(ids.shape[1])]
        return out
