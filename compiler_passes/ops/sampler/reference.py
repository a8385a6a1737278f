"""The numpy references of the sampling kernels (sampler_tir.py; semantics in its docstring)."""

from __future__ import annotations

import numpy as np

from mlc_lora.contract import TOP_LOGPROBS_MAX


def sample_argmax_ref(logits: np.ndarray) -> np.ndarray:
    return np.argmax(logits, axis=-1).astype(np.int32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def chosen_logprobs_ref(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return _log_softmax(logits)[np.arange(len(tokens)), tokens].astype(np.float32)


def top_logprobs_ref(logits: np.ndarray, k: int = TOP_LOGPROBS_MAX):
    order = np.lexsort((np.arange(logits.shape[-1])[None].repeat(len(logits), 0), -logits), axis=-1)
    ids = order[:, :k].astype(np.int32)
    return ids, np.take_along_axis(_log_softmax(logits), ids, -1).astype(np.float32)


def sample_top_p_ref(logits, temperature, top_p, top_k, uniform) -> np.ndarray:
    out = np.zeros(len(logits), np.int32)
    for b, row in enumerate(logits):
        x = row.astype(np.float32) * (np.float32(1) / np.float32(temperature[b]))
        p = np.exp(x.astype(np.float64) - x.max())
        keep = np.ones(len(x), bool)
        if 0 < top_k[b] < len(x):
            keep = x >= np.sort(x)[::-1][top_k[b] - 1]
        if top_p[b] < 1:
            target = top_p[b] * p[keep].sum()
            cand = np.unique(x[keep])[::-1]  # distinct values, largest first
            for t in cand:
                if p[keep & (x >= t)].sum() >= target:
                    keep = keep & (x >= t)
                    break
        q = np.where(keep, p, 0.0)
        cdf = np.cumsum(q)
        i = int(np.searchsorted(cdf, uniform[b] * cdf[-1], side="right"))
        out[b] = min(i, int(np.flatnonzero(keep)[-1]))
    return out


def process_logits_ref(logits, rows, tokens, bias, rep, sub, mask) -> np.ndarray:
    """process_logits (sampler_tir.py): mask (b, ceil(V/32)) int32 bits, then the listed pairs."""
    b, v = logits.shape
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")[:, :v]
    out = np.where(bits == 1, logits, np.float32(-3.4e38)).astype(np.float32)
    for r, t, bs, rp, sb in zip(rows, tokens, bias, rep, sub):
        if bits[r, t]:
            x = np.float32(logits[r, t] + bs)
            out[r, t] = (x / rp if x > 0 else x * rp) - sb
    return out
