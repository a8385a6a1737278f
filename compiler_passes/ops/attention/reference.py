"""The numpy reference of the paged attention op (attention_cuda.py, attention.cu).

Semantics: o[i, h] = softmax_j(sm_scale * q[i, h] . K[j, kvh]) @ V[j, kvh] over the keys j that
query i may see (j <= i + kv_len - q_len: causal, aligned bottom-right), kvh = h // (h_q // h_kv);
lse in base 2.
"""

from __future__ import annotations

import numpy as np

from mlc_lora.contract import PAGE_SIZE

_LOG2E = 1.4426950408889634


def attention_ref(q, qo_indptr, pages, page_indptr, page_indices, last_page_len, sm_scale):
    """Semantics: see the module docstring. q (n, h_q, d); pages (P, 2, h_kv, 16, d);
    returns o (n, h_q, d) float32 and lse (n, h_q) float32 (base 2)."""
    n, hq, d = q.shape
    hkv = pages.shape[2]
    o = np.zeros((n, hq, d), np.float32)
    lse = np.full((n, hq), -np.inf, np.float32)
    for s in range(len(qo_indptr) - 1):
        q0, q1 = qo_indptr[s], qo_indptr[s + 1]
        pg = page_indices[page_indptr[s]:page_indptr[s + 1]]
        kv_len = 0 if len(pg) == 0 else (len(pg) - 1) * PAGE_SIZE + last_page_len[s]
        k = pages[pg, 0].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :kv_len].astype(np.float32)
        v = pages[pg, 1].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :kv_len].astype(np.float32)
        diag = kv_len - (q1 - q0)
        for i in range(q1 - q0):
            seen = i + diag + 1
            if seen <= 0:
                continue
            for h in range(hq):
                kvh = h // (hq // hkv)
                sc = (k[kvh, :seen] @ q[q0 + i, h].astype(np.float32)) * sm_scale * _LOG2E
                mx = sc.max()
                p = np.exp2(sc - mx)
                o[q0 + i, h] = p @ v[kvh, :seen] / p.sum()
                lse[q0 + i, h] = mx + np.log2(p.sum())
    return o, lse
