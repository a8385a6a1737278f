"""Calls the compiled sampling functions (compiler_passes/ops/sampler/) on a batch's logits.

The logits stay on the device; only the token ids (and the logprobs asked for) come back. The
uniforms for random draws come from each sequence's own seeded numpy Generator, so a seed gives
the same text whatever else shares the batch. A row whose own sampling fails (its parameters do
not fit the device's types, its logprobs are not numbers) comes back as that row's exception; the
rest of the batch is sampled as if it were not there.

Penalties, `logit_bias` and a grammar's token mask change the logits before sampling, on the
device: the host lists the (row, token) entries each request touches with their bias, repetition
factor and subtraction (`logit_pairs`), and the compiled `process_logits` applies them and the
grammar masks to a copy of the logits. Libraries compiled before `process_logits` existed process
those rows on the host instead (`process_logits` below, the same semantics). Log-probabilities are
always those of the model's own logits (vLLM's default, "raw_logprobs"). Prompt log-probabilities
(`score`) use the same functions.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Optional, Sequence as Seq

import numpy as np

from ..contract import SAMPLER_FUNCTIONS
from ..errors import MLCLoraError
from ..runner import keep_gil_on_device
from .scheduler import SamplingParams, Sequence

LOGIT_BIAS_MAX = 100.0  # OpenAI's bound on a logit_bias value


@dataclasses.dataclass
class Sampled:
    token: int
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None


def logit_pairs(params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int],
                vocab: int) -> dict[int, tuple[float, float, float]]:
    """token -> (bias, repetition factor, subtraction) for the entries a request's processing
    touches (the pairs of the compiled `process_logits`, whose semantics are `process_logits`'s
    below); MLCLoraError for a token past the vocabulary."""
    out: dict[int, list[float]] = {}
    for t, bias in params.logit_bias:
        if not 0 <= t < vocab:
            raise MLCLoraError(f"logit_bias names token {t}, outside the vocabulary [0, {vocab})")
        out[t] = [bias, 1.0, 0.0]
    if params.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(output_ids):
            out.setdefault(t, [0.0, 1.0, 0.0])[1] = params.repetition_penalty
    if params.frequency_penalty or params.presence_penalty:
        for t, n in Counter(output_ids).items():
            out.setdefault(t, [0.0, 1.0, 0.0])[2] = params.frequency_penalty * n + params.presence_penalty
    return {t: tuple(v) for t, v in out.items()}


def process_logits(row: np.ndarray, params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int],
                   mask: Optional[np.ndarray] = None) -> None:
    """Apply a request's logit processing to its logits `row` (V,) float32, in place.

    Semantics (vLLM's order and formulas):
        row[t] += logit_bias[t]                                    for each (t, bias) given
        seen = set(prompt_ids) | set(output_ids)
        row[t] = row[t] / rp if row[t] > 0 else row[t] * rp         for t in seen  (rp = repetition_penalty)
        row[t] -= frequency_penalty * count(t in output_ids)
                  + presence_penalty * (t in output_ids)
        row[t] = -3.4e38                                            where mask bit t is clear (grammar)
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
    if mask is not None:  # (ceil(vocab / 32),) int32 words, bit t of word t // 32
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
        row[bits == 0] = np.float32(-3.4e38)


class Sampler:
    def __init__(self, runner):
        self.fn = {}
        for name in SAMPLER_FUNCTIONS:
            try:
                self.fn[name] = runner.vm[name]
            except Exception as e:  # pylint: disable=broad-except
                if name == "process_logits":  # older libraries: that processing runs on the host
                    continue
                raise MLCLoraError(f"{runner.model_dir} has no sampling functions (compiled by an older "
                                   "mlc-lora); compile it again") from e
        self.device = runner.device
        keep_gil_on_device(self.device, *self.fn.values())  # (reading the results back lets it go)

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
        if processed and "process_logits" in self.fn:
            logits = self._process_on_device(logits, seqs, processed, row_of, masks or {}, failed)
        elif processed:
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
        ids = tokens.tolist()  # (python ints at once: indexing the array makes a numpy scalar per row)
        result = [Sampled(ids[r]) for r in row_of]
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

    def _process_on_device(self, logits, seqs, processed, row_of, masks, failed):
        """The compiled process_logits over the processed rows' pairs and masks (a copy)."""
        n_rows, vocab = int(logits.shape[0]), int(logits.shape[1])
        rows, tokens, vals = [], [], []
        mask = np.full((n_rows, (vocab + 31) // 32), -1, np.int32)
        for i in processed:
            s = seqs[i]
            try:
                pairs = logit_pairs(s.params, s.prompt_ids, s.output_ids, vocab)
            except Exception as e:  # pylint: disable=broad-except
                failed[i] = e
                continue
            rows += [row_of[i]] * len(pairs)
            tokens += list(pairs)
            vals += list(pairs.values())
            if i in masks:
                mask[row_of[i]] = masks[i]
        if not rows:  # the kernel takes at least one pair: an identity one
            rows, tokens, vals = [0], [0], [(0.0, 1.0, 0.0)]
        v = np.asarray(vals, np.float32).reshape(-1, 3)
        return self.fn["process_logits"](logits, self._t(np.asarray(rows, np.int32)),
                                         self._t(np.asarray(tokens, np.int32)), self._t(v[:, 0]),
                                         self._t(v[:, 1]), self._t(v[:, 2]), self._t(mask))

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
