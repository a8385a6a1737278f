"""The LoRA op: what every stage computes, and the plain numpy reference of each kernel.

Adapter rows live in the unified page arena (docs/DESIGN.md): row `k` of `A[s, m]` in layer `l`
is `arena[l*P*E + a_off[s, m, k] : ... + in_m]`, row `k` of `B[s, m]^T` is
`arena[l*P*E + b_off[s, m, k] : ... + out_m]`; `P*E = arena.size // L`. Slot `s = slot[t]` is
token t's adapter (-1: the base model), `rank[s]` its rank (rows past it are never read),
`scale[s, m]` its alpha / r for module m (0: the adapter does not target m).

Semantics of every stage: y[t] += scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T for each part m of
the linear and every token t with s = slot[t] >= 0; other tokens keep the base output.
  single (stage 1): one adapter per batch (slot 0), as dense GEMMs over rows gathered per module;
  gather (stage 2): a per-token gather kernel per module;
  sgmv (stage 3): a shrink to fp32 partials v (per chunk of CHUNK inputs) and an expand, per module
                  (TIR) or per fused linear in place (CUDA).
Rows stored as int8 (contract.ROW_FORMATS "int8"; their format in lora/layout.py) stand for the
values q_i * s of the row's int8 values and float32 scale: the kernels multiply by q and apply s
to the product (the shrink's sums times s; the expand's h times s, rounded to the model dtype,
then times q), which equals those values up to the rounding of the products;
`int8_rows_as_model_ref` turns such an arena into the float32 arena of those values that the
references below read.
Every kernel of ops/lora/ is tested against the references below (tests/python/compiler/ops/lora/).
"""

from __future__ import annotations

import numpy as np

CHUNK = 512  # in_f elements per sgmv shrink block: the C axis of v (CHUNK in sgmv.cu)


def num_chunks(in_f: int) -> int:
    """C, the chunks of the sgmv partials v (n, C, R) for a linear of `in_f` inputs."""
    return -(-in_f // CHUNK)


def int8_rows_as_model_ref(arena, rows, lead_bytes, dtype=np.float32):
    """The arena of `dtype` (NaN outside the rows) of the values that `arena` (the model dtype, int8
    rows inside) stands for: each (element offset, length) of `rows` dequantized in place, its
    scale the float32 `lead_bytes` before its first value. The rows must not overlap at their length
    in the model dtype."""
    raw = np.ascontiguousarray(arena).view(np.uint8)
    eb = arena.dtype.itemsize
    out = np.full(arena.shape, np.nan, dtype)
    for off, n in rows:
        at = int(off) * eb
        q = raw[at:at + n].view(np.int8).astype(np.float32)
        sc = raw[at - lead_bytes:at - lead_bytes + 4].view(np.float32)[0]
        out[off:off + n] = (q * sc).astype(dtype)
    return out


def lora_gather_ref(x, arena, layer, num_layers, slot, rank, scale, a_off, b_off, m, out_f):
    """Semantics: delta[t] = scale[s, m] * (x[t] @ A[s, m].T) @ B[s, m].T for s = slot[t] >= 0,
    else 0; x (n, in_m) -> delta (n, out_m); A, B read from the arena rows of layer `layer`."""
    n, in_f = x.shape
    base = layer * (arena.size // num_layers)
    delta = np.zeros((n, out_f), np.float32)
    for t in range(n):
        s = slot[t]
        if s < 0 or scale[s, m] == 0:  # (not targeted: no rows)
            continue
        for k in range(rank[s]):
            a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + in_f].astype(np.float32)
            b = arena[base + b_off[s, m, k]: base + b_off[s, m, k] + out_f].astype(np.float32)
            delta[t] += scale[s, m] * float(x[t].astype(np.float32) @ a) * b
    return delta.astype(x.dtype)


def lora_dense_rows_ref(arena, layer, num_layers, rank, scale, a_off, b_off, m, in_f, out_f, max_rank):
    """Semantics: A[k] = A[0, m] row k, Bs[k] = scale[0, m] * B[0, m]^T row k for k < rank[0];
    zero rows for k >= rank[0], when there is no slot (S == 0) or the adapter does not target m
    (scale[0, m] == 0: no rows). A (R, in_m), Bs (R, out_m)."""
    base = layer * (arena.size // num_layers)
    a = np.zeros((max_rank, in_f), arena.dtype)
    b = np.zeros((max_rank, out_f), arena.dtype)
    if len(rank) == 0 or scale[0, m] == 0:
        return a, b
    for k in range(rank[0]):
        a[k] = arena[base + a_off[0, m, k]: base + a_off[0, m, k] + in_f]
        b[k] = (scale[0, m] * arena[base + b_off[0, m, k]: base + b_off[0, m, k] + out_f]
                .astype(np.float32)).astype(arena.dtype)
    return a, b


def lora_sgmv_shrink_ref(x, arena, layer, num_layers, slot, rank, scale, a_off, m, max_rank):
    """Semantics: v[t, c, k] = scale[s, m] * sum_{i in chunk c} x[t, i] * A[s, m][k, i] for
    s = slot[t] >= 0 and k < rank[s], else 0; x (n, in_m) -> v (n, C, R) float32."""
    n, in_f = x.shape
    base = layer * (arena.size // num_layers)
    C = num_chunks(in_f)
    v = np.zeros((n, C, max_rank), np.float32)
    for t in range(n):
        s = slot[t]
        if s < 0 or scale[s, m] == 0:  # (not targeted: no rows)
            continue
        for k in range(rank[s]):
            a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + in_f].astype(np.float32)
            prod = x[t].astype(np.float32) * a
            for c in range(C):
                v[t, c, k] = scale[s, m] * prod[c * CHUNK:(c + 1) * CHUNK].sum()
    return v


def lora_sgmv_expand_ref(v, arena, layer, num_layers, slot, rank, b_off, m, out_f, dtype):
    """Semantics: delta[t] = sum_k (sum_c v[t, c, k]) * B[s, m].T[k] over k < rank[s] for
    s = slot[t] >= 0 whose adapter has rows for m (b_off[s, m, 0] >= 0; a module it does not
    target has offsets -1 and no rows: nothing is read for it), else 0; v (n, C, R) -> delta (n, out_m)."""
    n = v.shape[0]
    base = layer * (arena.size // num_layers)
    delta = np.zeros((n, out_f), np.float32)
    for t in range(n):
        s = slot[t]
        if s < 0 or b_off[s, m, 0] < 0:
            continue
        h = v[t].sum(0)
        for k in range(rank[s]):
            delta[t] += h[k] * arena[base + b_off[s, m, k]: base + b_off[s, m, k] + out_f].astype(np.float32)
    return delta.astype(dtype)


def sgmv_parts_shrink_ref(x, arena, layer, num_layers, slot, rank, scale, a_off, mods, max_rank):
    """Semantics: v[t, p] = lora_sgmv_shrink_ref(x, ..., m=mods[p])[t] for mods[p] >= 0, else 0;
    x (n, in) -> v (n, P, C, R) float32 (the shrink of one fused linear's parts at once)."""
    n, in_f = x.shape
    v = np.zeros((n, len(mods), num_chunks(in_f), max_rank), np.float32)
    for p, m in enumerate(mods):
        if m >= 0:
            v[:, p] = lora_sgmv_shrink_ref(x, arena, layer, num_layers, slot, rank, scale, a_off, m, max_rank)
    return v


def sgmv_parts_expand_ref(y, v, arena, layer, num_layers, slot, rank, scale, b_off, mods, widths):
    """Semantics: y[:, o_p:o_p + w_p] += lora_sgmv_expand_ref(v[:, p], ..., m=mods[p]) for the
    tokens whose adapter targets mods[p] >= 0 (scale != 0); y (n, sum(widths)), returned in float32."""
    out = y.astype(np.float32)
    o = 0
    for p, (m, w) in enumerate(zip(mods, widths)):
        if m >= 0:
            on = (slot >= 0) & (scale[np.maximum(slot, 0), m] != 0)
            d = lora_sgmv_expand_ref(v[:, p], arena, layer, num_layers, np.where(on, slot, -1), rank, b_off, m,
                                     w, np.float32)
            out[:, o:o + w] += d
        o += w
    return out


def sort_tokens_ref(slot: np.ndarray, num_slots: int):
    """(order, slot_start) as the pool builds them: tokens sorted by slot (stable), base-model
    tokens (-1) last; slot_start (num_slots + 1,) prefix sums of the slots' token counts."""
    key = np.where(slot >= 0, slot, np.iinfo(np.int32).max)
    order = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(slot[slot >= 0], minlength=num_slots)[:num_slots]
    return order, np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
