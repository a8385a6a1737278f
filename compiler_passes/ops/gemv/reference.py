"""The numpy reference of the gemv op (gemv_cuda.py, gemv.cu)."""

from __future__ import annotations

import numpy as np


def gemv_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Semantics: y = x @ w.T in float32 (x (n, K), w (N, K))."""
    return x.astype(np.float32) @ w.astype(np.float32).T
