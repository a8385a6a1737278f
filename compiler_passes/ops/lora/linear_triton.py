"""The base linear and its multi-LoRA delta over the batch's "rank columns", for the _fused functions.

Separate LoRA launches cost more than the adapters' bytes: at 4 adapters of rank 8 a Llama-2-7B
layer moves ~1.3 MB of adapter rows against ~400 MB of weights, but each shrink/expand pair is a
launch of its own. This kernel is the base GEMM `x @ W.T` of a fused linear (q|k|v, gate|up, ...)
that also multiplies, while it streams x, by the active adapters' A rows, and adds their B rows in
its epilogue: no LoRA launch at all. Above FUSED_MAX_TOKENS tokens (where that kernel's GEMM loses
to cuBLAS) the same wrapper runs cuBLAS, then `lora_shrink_cols_kernel` (xa over the rank columns,
the inputs split over blocks) and `lora_expand_cols_kernel` (the epilogue's maths, in place on y).
With the rank rows route (`--lora-rank-rows`: passes/reserve_rank_rows.py stores each targeted
weight with rank_rows(P) spare rows below its own) the batches past FUSED_MAX_TOKENS run instead
`lora_fill_rows_kernel` (the batch's A rows into those rows), ONE cuBLAS GEMM over [W; A rows]
(e = x @ W.T beside xa = x @ A_cat.T, the shrink at the GEMM's cost of 32 x P more outputs) and
`lora_expand_rows_kernel` (y = e's first N columns + the delta from its xa columns).
With the rank columns route (weights stored with 32 spare columns per part, ReserveRankColumns)
and x's producer handed to the linear by LoraRewrite (PRODUCERS: the RMSNorm before q|k|v and
gate|up, silu(gate) * up before down), the wrapper runs the producer's kernel itself
(ops/norm_triton.py's, activation_triton's): into x up to FUSED_MAX_TOKENS; past it into
[x | s]'s first columns, then `lora_shrink_xs_kernel` adds s beside x and one cuBLAS GEMM over
[x | s] and [W | B columns] gives y (`lora_fill_cols_kernel` fills those columns when the pool's
kept adapters change). A linear whose x has no producer of ours (o: the attention's output) keeps
the pair over its weight's first columns.
LoraRewrite builds the wrapper into `prefill_fused` and `decode_fused` (contract.FUSED_FUNCTION_SUFFIX),
which the runner picks for a batch whose adapters' ranks sum to at most RANK_COLUMNS over at most
SLOT_COLUMNS slots; other batches run `prefill`/`decode` (cuBLAS + the sgmv stage).

Semantics (x (n, K); W (N, K) as the model stores it, its rows KW >= K apart (a weight stored with
columns beside its own); parts p of widths w_p are modules m_p of the tables, -1 none; token t
has slot s = slot[t], -1 = base model; o_p = the widths before p):
  y[t, o] = sum_i x[t, i] W[o, i]
          + [s >= 0, m = m_p(o) >= 0, scale[s, m] != 0]
            scale[s, m] * sum_{k < rank[s]} (sum_i x[t, i] A[s, m][k, i]) * B^T[s, m][k, o - o_p]
  A[s, m][k] = arena[base + a_off[s, m, k] : + K],  B^T[s, m][k] = arena[base + b_off[s, m, k] : + w_p]
How: the slots' rank rows sit side by side as "rank columns" c (slot j owns columns
start_j .. start_j + rank[j], start_j = the ranks of the slots before it). A block of BM tokens x
BN outputs accumulates x @ W.T and xa = x @ A_cat.T (BM x RANK_COLUMNS) in the same K loop, keeps of
xa only each token's own slot's columns, scales them, and adds xa @ B_cat.T over its outputs in
fp32 before the one store. Narrow linears (few output tiles) split the K loop over SPLIT blocks per
tile: each stores its fp32 partial x @ W.T and xa, and the block that finishes last sums them in
split order and runs the epilogue. The LoRA product rounds xa to the model dtype (as PEFT's lora_A output).
The pair adds the delta in fp32 to cuBLAS's rounded y (PEFT's order: base output, then delta);
the rank rows route's xa is cuBLAS's, rounded to the dtype before the scale.
Reference (every route): `linear_ref` below; of the fill alone, `fill_rows_ref`; of the producers,
`producer_ref`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence  # noqa: F401

import numpy as np

from .. import triton_build
from .. import activation_triton as ACT
from .. import norm_triton as NORM
from ..activation_triton import silu_mul_ref
from .stage import MAX_PARTS

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

FUSED_MAX_TOKENS = 64  # the one-kernel linear up to this many tokens (at 128 it measured slower than cuBLAS + the peers)
SMALL_MAX_TOKENS = 16  # up to here blocks of 16 tokens
# The one-kernel linear's tiers: a batch takes the first tier at or above its token count, each
# tier its own tile shape (tile_config; tiers of one shape share a kernel)
TOKEN_TIERS = (SMALL_MAX_TOKENS, 32, FUSED_MAX_TOKENS)
SWAP_LONG_INPUTS = 8192  # narrow linears with at least these inputs (down) swap at up to 64 tokens too
RANK_COLUMNS = 32  # the adapters' ranks of a batch sum to at most this (4 x r8, 2 x r16, 1 x r32)
SLOT_COLUMNS = 16  # the batch's adapters (slots) number at most this
DTYPES = ("float16", "bfloat16")
# (splits, at least this many input steps of BK): the one-kernel linear's splits of a narrow linear
# at blocks of 16 tokens, the first that fits (H200, Llama-2-7B: o 32 steps -> 2, down 86 -> 3)
SPLIT_STEPS = ((3, 64), (2, 16))
COUNTER_SLOTS = 1024  # the split tiles' counters of one forward (zeros; each kernel leaves them so)


def padded_parts(mods: Sequence[int], widths: Sequence[int]) -> tuple[list[int], list[int]]:
    """(m0, m1, m2), (W0, W1): the kernels' module of each part (-1 past the linear's) and the
    widths of the first two parts (0 past it), as they take them as constants or arguments."""
    return (list(mods) + [-1] * MAX_PARTS)[:MAX_PARTS], (list(widths) + [0] * MAX_PARTS)[:2]


def linear_ref(x, w, arena, base, slot, rank, scale, a_off, b_off, mods, widths):
    """Semantics of the kernel in float64: y (n, N)."""
    y = x.astype(np.float64) @ w.astype(np.float64).T
    o = 0
    for m, wp in zip(mods, widths):
        for t in range(x.shape[0]):
            s = int(slot[t])
            if s < 0 or m < 0 or scale[s, m] == 0:
                continue
            for k in range(int(rank[s])):
                a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + x.shape[1]].astype(np.float64)
                b = arena[base + b_off[s, m, k]: base + b_off[s, m, k] + wp].astype(np.float64)
                y[t, o:o + wp] += scale[s, m] * (x[t].astype(np.float64) @ a) * b
        o += wp
    return y


def producer_ref(producer: str, h, g=None, eps: float = 0.0, r=None):
    """Semantics of PRODUCERS in float64: x (n, K) of h ((n, K); (n, 2K) for "silu_mul"; r (n, K):
    the residual add's other operand for "add_rms_norm", whose sum norm_triton.rms_norm_ref gives too)."""
    if producer in ("rms_norm", "add_rms_norm"):
        return NORM.rms_norm_ref(h, g, eps, r if producer == "add_rms_norm" else None)[1]
    if producer == "silu_mul":
        return silu_mul_ref(h)
    return h.astype(np.float64)


def token_tier(n: int) -> int:
    """The tier of TOKEN_TIERS that a batch of 1 <= n <= FUSED_MAX_TOKENS tokens runs at."""
    return next(t for t in TOKEN_TIERS if n <= t)


def tile_config(in_f: int, widths: Sequence[int], tier: int) -> dict:
    """Block shape for a linear of `in_f` inputs and these part widths at the token tier `tier`
    (TOKEN_TIERS): the best measured on the H200 for the Llama-2-7B linears (docs/SGMV.md).
    Up to SMALL_MAX_TOKENS blocks of 16 tokens, 32 output columns for narrow linears (enough
    blocks to keep the memory busy; their inputs split over 2 or 3 blocks per output tile,
    SPLIT_STEPS), 128 for wide ones. Past it narrow linears take the products transposed (SWAP:
    the outputs on the warpgroup MMA's rows) over 4 input splits at up to 32 tokens, and those
    with long inputs (down) at up to 64 too; other linears blocks of 64 tokens."""
    n_out = sum(widths)
    bm = 16 if tier <= SMALL_MAX_TOKENS else 64
    narrow = n_out < 8192
    if narrow and tier > SMALL_MAX_TOKENS and (tier <= 32 or in_f >= SWAP_LONG_INPUTS):
        bm, bn, bk, split, warps = (32, 128, 64, 4, 4) if tier <= 32 else (64, 128, 128, 4, 8)
        bn = next((b for b in (bn, 64, 32, 16) if b <= bn and all(w % b == 0 for w in widths)), None)
        bk = next((b for b in (bk, 64, 32, 16) if b <= bk and in_f % b == 0), None)
        if bn and bk:  # (else the plain shape below)
            split = next(s for s in (split, 2, 1) if s == 1 or (s <= split and in_f // bk >= 4 * s))
            return dict(BM=bm, BN=bn, BK=bk, STAGES=4, SPLIT=split, SWAP=1, num_warps=warps)
    wide = (64, 32, 16) if (n_out >= 16384 and bm == 16) else (128, 64, 32, 16)  # gate|up: 0.93x at 1-16 tokens
    bn = next(b for b in (wide if n_out >= 8192 else (32, 16)) if all(w % b == 0 for w in widths))
    split = 1
    if narrow and bm == 16 and in_f % 128 == 0:  # (the splits were measured with BK = 128)
        split = next((s for s, steps in SPLIT_STEPS if in_f // 128 >= steps), 1)
    prefer = 128 if split > 1 else 256 if (bn == 32 and bm == 16) else (64 if n_out >= 16384 else 128)
    bk = next((b for b in (256, 128, 64, 32, 16) if b <= prefer and in_f % b == 0), None)
    warps = 8 if (bn == 128 and bk == 128) else 4
    return dict(BM=bm, BN=bn, BK=bk, STAGES=4, SPLIT=split, SWAP=0, num_warps=warps)


def split_scratch_elems(in_f: int, widths: Sequence[int]) -> int:
    """fp32 elements of the split one-kernel linear's partial sums (0 when it does not split): a
    slot of BM x (BN + RANK_COLUMNS) per split of each output tile, for the most tokens of a tier."""
    out = 0
    for tier in TOKEN_TIERS:
        cfg = tile_config(in_f, widths, tier)
        if cfg["SPLIT"] > 1:
            tiles = -(-tier // cfg["BM"]) * (sum(widths) // cfg["BN"])
            assert tiles <= COUNTER_SLOTS, (tiles, COUNTER_SLOTS)
            out = max(out, tiles * cfg["SPLIT"] * cfg["BM"] * (cfg["BN"] + RANK_COLUMNS))
    return out


def supported(dtype: str, weight_dtype: str, in_f: int, widths: Sequence[int]) -> str | None:
    """None when the kernel can run this linear, else why not."""
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES or weight_dtype != dtype:
        return f"dtype {dtype} / weights {weight_dtype} (the kernel is float16/bfloat16, unquantized)"
    if not 1 <= len(widths) <= MAX_PARTS:
        return f"a linear of {len(widths)} parts (1..{MAX_PARTS})"
    if any(w % 16 for w in widths) or in_f % 16:
        return f"in {in_f} / widths {tuple(widths)} (multiples of 16)"
    return None


if triton is not None:

    @triton.jit
    def _rank_columns(rank_ptr, S, R: tl.constexpr, RS: tl.constexpr, SC: tl.constexpr):
        """Rank column c -> (its slot jc, its row kc in that slot, jc clamped to a table row)."""
        jj = tl.arange(0, SC)
        # clamped: a captured graph's fixed tables hold whatever rows past the batch's slots
        rk = tl.minimum(tl.maximum(tl.load(rank_ptr + jj, mask=jj < S, other=0), 0), R)
        end = tl.cumsum(rk, axis=0)
        start = end - rk
        c = tl.arange(0, RS)
        jc = tl.sum((end[None, :] <= c[:, None]).to(tl.int32), axis=1)
        kc = c - tl.sum(tl.where(jj[None, :] == jc[:, None], start[None, :], 0), axis=1)
        return jc, kc, tl.minimum(jc, SC - 1)

    @triton.jit
    def _module_columns(m, jc, kc, js, scale_ptr, M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr):
        """Of module m (< 0: none): each rank column's scale, whether it is live, its table index."""
        mm = tl.maximum(m, 0)
        scale_c = tl.load(scale_ptr + js * M + mm, mask=(jc < SC) & (m >= 0), other=0.0)
        valid = (jc < SC) & (m >= 0) & (scale_c != 0.0)
        return scale_c, valid, (js * M + mm) * R + tl.minimum(kc, R - 1)

    @triton.jit
    def _delta(xa, jc, valid, scale_c, slot_ptr, rows, rmask, boff_ptr, tab, arena_ptr, base, cols, o_p,
               dtype: tl.constexpr, ALIGN: tl.constexpr):
        """The epilogue: of xa (BM x RS, fp32) each token's own slot's columns, scaled and rounded
        to the model dtype, times those columns' B rows over `cols`: (BM x BN) fp32."""
        ts = tl.load(slot_ptr + rows, mask=rmask, other=-1)
        keep = (ts[:, None] == jc[None, :]) & valid[None, :]
        xa16 = tl.where(keep, xa * scale_c[None, :], 0.0).to(dtype)
        # B rows only of the slots these tokens use: rows of other slots (a captured graph's tables
        # keep stale slots past the batch's) may point at pages holding anything, and 0 * NaN
        # would reach y through the dot
        used = tl.max(keep.to(tl.int32), axis=0) > 0
        b_row = tl.multiple_of(tl.load(boff_ptr + tab, mask=used, other=0).to(tl.int64) + base, ALIGN)
        bt = tl.load(arena_ptr + b_row[:, None] + (cols - o_p)[None, :], mask=used[:, None], other=0.0)
        return tl.dot(xa16, bt), ts

    @triton.jit
    def _present(slot_ptr, rows, rmask, jc):
        """Per rank column: whether its slot is the slot of any token of `rows` (where rmask)."""
        ts = tl.load(slot_ptr + rows, mask=rmask, other=-1)
        return tl.max((ts[:, None] == jc[None, :]).to(tl.int32), axis=0) > 0

    @triton.jit
    def _part(n0, m0, m1, m2, W0: tl.constexpr, W1: tl.constexpr):
        """The part holding output column n0 (BN divides every part width): (index, module, offset)."""
        in1 = (n0 >= W0).to(tl.int32)
        in2 = (n0 >= W0 + W1).to(tl.int32)
        return in1 + in2, m0 + in1 * (m1 - m0) + in2 * (m2 - m1), in1 * W0 + in2 * W1

    @triton.jit
    def _k_loop(x_ptr, w_ptr, arena_ptr, rows, rmask, cols, a_row, valid, k_lo, k_hi, K: tl.constexpr,
                KW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RS: tl.constexpr,
                STAGES: tl.constexpr, SWAP: tl.constexpr):
        """(x @ W.T, x @ A_cat.T) over inputs [k_lo, k_hi), W's rows KW apart: (BM x BN, BM x RS)
        fp32. SWAP: the
        products taken transposed (W @ x.T: the outputs are the MMA's rows, the tokens its columns,
        so a block of few tokens still fills Hopper's 64-row warpgroup MMA), then transposed back."""
        kk = tl.arange(0, BK)
        if SWAP:
            x_ptrs = x_ptr + rows[None, :].to(tl.int64) * K + kk[:, None]  # (BK, BM)
            w_ptrs = w_ptr + cols[:, None].to(tl.int64) * KW + kk[None, :]  # (BN, BK)
            a_ptrs = arena_ptr + a_row[:, None] + kk[None, :]  # (RS, BK)
            acc_t = tl.zeros((BN, BM), dtype=tl.float32)
            xa_t = tl.zeros((RS, BM), dtype=tl.float32)
            for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
                xt = tl.load(x_ptrs + k0, mask=rmask[None, :], other=0.0)
                acc_t = tl.dot(tl.load(w_ptrs + k0), xt, acc_t)
                xa_t = tl.dot(tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0), xt, xa_t)
            return tl.trans(acc_t), tl.trans(xa_t)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * KW + kk[:, None]
        a_ptrs = arena_ptr + a_row[None, :] + kk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        xa = tl.zeros((BM, RS), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
            xt = tl.load(x_ptrs + k0, mask=rmask[:, None], other=0.0)
            acc = tl.dot(xt, tl.load(w_ptrs + k0), acc)
            xa = tl.dot(xt, tl.load(a_ptrs + k0, mask=valid[None, :], other=0.0), xa)
        return acc, xa

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_linear", "x_ptr"))
    def lora_linear_kernel(x_ptr, w_ptr, arena_ptr, slot_ptr, rank_ptr, scale_ptr, aoff_ptr, boff_ptr, y_ptr,
                           ws_ptr, cnt_ptr, n, S, base,
                           K: tl.constexpr, KW: tl.constexpr, N: tl.constexpr, M: tl.constexpr,
                           R: tl.constexpr,
                           m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, W0: tl.constexpr,
                           W1: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           RS: tl.constexpr, SC: tl.constexpr, STAGES: tl.constexpr, ALIGN: tl.constexpr,
                           SPLIT: tl.constexpr, SWAP: tl.constexpr):
        """Grid (token tiles x SPLIT, N / BN); a block reads the A rows of the slots its tile's tokens
        use (at one token, one adapter's of the batch's). SPLIT > 1 (narrow linears: too few output tiles to
        keep the memory busy): split k of a tile sums inputs [k * PER, (k + 1) * PER) into its slot
        of ws (fp32 x @ W.T and xa) and counts itself in cnt[tile]; the block that counts last sums
        the SPLIT slots in split order (the same bits whichever block is last), adds the delta,
        stores y and sets cnt[tile] back to 0 (cnt holds zeros when the kernel starts)."""
        triton_build.wait_for_producers()
        pid_m = tl.program_id(0) // SPLIT
        pid_k = tl.program_id(0) % SPLIT
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < n
        cols = pid_n * BN + tl.arange(0, BN)
        _, m, o_p = _part(pid_n * BN, m0, m1, m2, W0, W1)
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        scale_c, valid, tab = _module_columns(m, jc, kc, js, scale_ptr, M, R, SC)
        a_row = tl.multiple_of(tl.load(aoff_ptr + tab, mask=valid, other=0).to(tl.int64) + base, ALIGN)
        # A rows only of the slots this tile's tokens use (every output tile's block reads them)
        read = valid & _present(slot_ptr, rows, rmask, jc)
        if SPLIT == 1:
            acc, xa = _k_loop(x_ptr, w_ptr, arena_ptr, rows, rmask, cols, a_row, read, 0, K, K, KW, BM, BN, BK,
                              RS, STAGES, SWAP)
            delta, _ = _delta(xa, jc, valid, scale_c, slot_ptr, rows, rmask, boff_ptr, tab, arena_ptr, base, cols,
                              o_p, x_ptr.dtype.element_ty, ALIGN)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                     (acc + delta).to(y_ptr.dtype.element_ty), mask=rmask[:, None])
        else:
            PER: tl.constexpr = (K // BK + SPLIT - 1) // SPLIT * BK  # inputs per split, a multiple of BK
            k_lo = tl.multiple_of(pid_k * PER, BK)
            # no mask along the inputs (a varying one makes scalar loads): the last split ends at K
            acc, xa = _k_loop(x_ptr, w_ptr, arena_ptr, rows, rmask, cols, a_row, read, k_lo,
                              tl.minimum(K, k_lo + PER), K, KW, BM, BN, BK, RS, STAGES, SWAP)
            TILE: tl.constexpr = BM * (BN + RS)
            tile = pid_m * (N // BN) + pid_n
            r = tl.arange(0, BM)
            acc_at = r[:, None] * BN + tl.arange(0, BN)[None, :]
            xa_at = BM * BN + r[:, None] * RS + tl.arange(0, RS)[None, :]
            mine = ws_ptr + (tile * SPLIT + pid_k).to(tl.int64) * TILE
            tl.store(mine + acc_at, acc)
            tl.store(mine + xa_at, xa)
            tl.debug_barrier()  # every thread's partial stored before the count (released by it)
            if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tot = tl.zeros((BM, BN), dtype=tl.float32)
                xs = tl.zeros((BM, RS), dtype=tl.float32)
                for k in tl.static_range(SPLIT):
                    part = ws_ptr + (tile * SPLIT + k).to(tl.int64) * TILE
                    tot += tl.load(part + acc_at, cache_modifier=".cg")
                    xs += tl.load(part + xa_at, cache_modifier=".cg")
                dt, _ts = _delta(xs, jc, valid, scale_c, slot_ptr, rows, rmask, boff_ptr, tab, arena_ptr, base,
                                 cols, o_p, x_ptr.dtype.element_ty, ALIGN)
                tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                         (tot + dt).to(y_ptr.dtype.element_ty), mask=rmask[:, None])
                tl.atomic_xchg(cnt_ptr + tile, 0)

    @triton.jit
    def _a_rows(m, jc, kc, js, scale_ptr, aoff_ptr, base, M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr,
                ALIGN: tl.constexpr):
        _, valid, tab = _module_columns(m, jc, kc, js, scale_ptr, M, R, SC)
        return tl.multiple_of(tl.load(aoff_ptr + tab, mask=valid, other=0).to(tl.int64) + base, ALIGN), valid

    @triton.jit
    def _shrink_steps(x_rows, kk, end, rmask, arena_ptr, a0, v0, a1, v1, a2, v2, BM: tl.constexpr,
                      RS: tl.constexpr, P: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
        """Of x's rows (x_rows: BM row pointers) over inputs kk + [0, end): acc_p = x @ A_p.T (BM x RS,
        fp32; A_p the rank columns' rows of part p at a_p, live where v_p). BK divides K and the
        split's inputs: the last split ends at K, and no load is masked along the inputs (a mask that
        varies along the contiguous axis makes scalar loads)."""
        acc0 = tl.zeros((BM, RS), dtype=tl.float32)
        acc1 = tl.zeros((BM, RS), dtype=tl.float32)
        acc2 = tl.zeros((BM, RS), dtype=tl.float32)
        for k0 in tl.range(0, end, BK, num_stages=STAGES):
            xt = tl.load(x_rows + (kk + k0)[None, :], mask=rmask[:, None], other=0.0)
            ka = (kk + k0)[:, None]
            acc0 = tl.dot(xt, tl.load(arena_ptr + a0[None, :] + ka, mask=v0[None, :], other=0.0), acc0)
            if P > 1:
                acc1 = tl.dot(xt, tl.load(arena_ptr + a1[None, :] + ka, mask=v1[None, :], other=0.0), acc1)
            if P > 2:
                acc2 = tl.dot(xt, tl.load(arena_ptr + a2[None, :] + ka, mask=v2[None, :], other=0.0), acc2)
        return acc0, acc1, acc2

    @triton.jit
    def _store_parts(out, rmask, acc0, acc1, acc2, RS: tl.constexpr, P: tl.constexpr):
        """A split's partial sums of the P parts side by side at out (BM row pointers, RS apart)."""
        tl.store(out, acc0, mask=rmask[:, None])
        if P > 1:
            tl.store(out + RS, acc1, mask=rmask[:, None])
        if P > 2:
            tl.store(out + 2 * RS, acc2, mask=rmask[:, None])

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_shrink_cols", "x_ptr"))
    def lora_shrink_cols_kernel(x_ptr, arena_ptr, rank_ptr, scale_ptr, aoff_ptr, v_ptr, n, S, base, chunk,
                                K: tl.constexpr, M: tl.constexpr, R: tl.constexpr, m0: tl.constexpr,
                                m1: tl.constexpr, m2: tl.constexpr, P: tl.constexpr, BM: tl.constexpr,
                                BK: tl.constexpr, RS: tl.constexpr, SC: tl.constexpr,
                                STAGES: tl.constexpr, ALIGN: tl.constexpr):
        """v[k, t, p, c] = sum over inputs i of split k (`chunk` of them) of x[t, i] * A(column c
        of part p)[i]."""
        triton_build.wait_for_producers()
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < n
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        a0, v0 = _a_rows(m0, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        a1, v1 = _a_rows(m1, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        a2, v2 = _a_rows(m2, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        k_start = tl.multiple_of(pid_k * chunk, BK)  # chunk is a multiple of BK (its alignment)
        kk = k_start + tl.arange(0, BK)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * K
        acc0, acc1, acc2 = _shrink_steps(x_rows, kk, tl.minimum(chunk, K - k_start), rmask, arena_ptr, a0, v0, a1,
                                         v1, a2, v2, BM, RS, P, BK, STAGES)
        c = tl.arange(0, RS)
        _store_parts(v_ptr + ((pid_k * n + rows[:, None]).to(tl.int64) * P) * RS + c[None, :], rmask, acc0, acc1,
                     acc2, RS, P)

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_expand_cols", "y_ptr"))
    def lora_expand_cols_kernel(v_ptr, arena_ptr, slot_ptr, rank_ptr, scale_ptr, boff_ptr, y_ptr, n, S, base, split,
                                N: tl.constexpr, M: tl.constexpr, R: tl.constexpr, m0: tl.constexpr,
                                m1: tl.constexpr, m2: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                                P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT_MAX: tl.constexpr,
                                RS: tl.constexpr, SC: tl.constexpr, ALIGN: tl.constexpr):
        """y[t, cols] += the delta of its slot, from the shrink's `split` partial sums; rows of
        base-model tokens are neither read nor written."""
        triton_build.wait_for_producers()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < n
        cols = pid_n * BN + tl.arange(0, BN)
        p, m, o_p = _part(pid_n * BN, m0, m1, m2, W0, W1)
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        scale_c, valid, tab = _module_columns(m, jc, kc, js, scale_ptr, M, R, SC)
        c = tl.arange(0, RS)
        v_ptrs = v_ptr + ((rows[:, None].to(tl.int64) * P) + p) * RS + c[None, :]
        xa = tl.zeros((BM, RS), dtype=tl.float32)
        for k in tl.static_range(SPLIT_MAX):  # unrolled: the loads are all in flight at once
            xa += tl.load(v_ptrs + k * n * P * RS, mask=rmask[:, None] & (k < split), other=0.0)
        delta, ts = _delta(xa, jc, valid, scale_c, slot_ptr, rows, rmask, boff_ptr, tab, arena_ptr, base, cols,
                           o_p, y_ptr.dtype.element_ty, ALIGN)
        wmask = (rmask & (ts >= 0))[:, None]
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        y = tl.load(y_ptrs, mask=wmask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=wmask)

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_fill_rows", "w_ptr"))
    def lora_fill_rows_kernel(arena_ptr, rank_ptr, scale_ptr, aoff_ptr, w_ptr, S, base,
                              K: tl.constexpr, N: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                              m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, BK: tl.constexpr,
                              RS: tl.constexpr, SC: tl.constexpr, ALIGN: tl.constexpr):
        """Grid (parts, K / BK): block (p, k) writes inputs [k * BK, (k + 1) * BK) of part p's RS
        rank rows below the weight's N rows: w[N + p * RS + c] = A(column c of part p), zeros
        where the column is not live (past the batch's ranks, a module its adapter leaves alone)."""
        triton_build.wait_for_producers()
        p = tl.program_id(0)
        m = m0 + (p >= 1).to(tl.int32) * (m1 - m0) + (p >= 2).to(tl.int32) * (m2 - m1)
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        a_row, valid = _a_rows(m, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        kk = tl.program_id(1) * BK + tl.arange(0, BK)
        a = tl.load(arena_ptr + a_row[:, None] + kk[None, :], mask=valid[:, None], other=0.0)
        rows = N + p * RS + tl.arange(0, RS)
        tl.store(w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], a)

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_expand_rows", "y_ptr"))
    def lora_expand_rows_kernel(e_ptr, arena_ptr, slot_ptr, rank_ptr, scale_ptr, boff_ptr, y_ptr, n, S, base,
                                N: tl.constexpr, M: tl.constexpr, R: tl.constexpr, m0: tl.constexpr,
                                m1: tl.constexpr, m2: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                                P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RS: tl.constexpr,
                                SC: tl.constexpr, ALIGN: tl.constexpr):
        """y[t, cols] = e[t, cols] + the delta of t's slot, where e = x @ [W; rank rows].T (N + P * RS
        columns: the base output, then each part's products with its rank rows, xa)."""
        triton_build.wait_for_producers()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < n
        cols = pid_n * BN + tl.arange(0, BN)
        p, m, o_p = _part(pid_n * BN, m0, m1, m2, W0, W1)
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        scale_c, valid, tab = _module_columns(m, jc, kc, js, scale_ptr, M, R, SC)
        E: tl.constexpr = N + P * RS
        e_rows = e_ptr + rows[:, None].to(tl.int64) * E
        xa = tl.load(e_rows + N + p * RS + tl.arange(0, RS)[None, :], mask=rmask[:, None], other=0.0)
        delta, _ = _delta(xa.to(tl.float32), jc, valid, scale_c, slot_ptr, rows, rmask, boff_ptr, tab, arena_ptr,
                          base, cols, o_p, y_ptr.dtype.element_ty, ALIGN)
        yb = tl.load(e_rows + cols[None, :], mask=rmask[:, None], other=0.0)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                 (yb.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=rmask[:, None])

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_fill_cols", "w_ptr"))
    def lora_fill_cols_kernel(arena_ptr, rank_ptr, scale_ptr, boff_ptr, w_ptr, S, base,
                              K: tl.constexpr, KE: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                              m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, W0: tl.constexpr,
                              W1: tl.constexpr, BN: tl.constexpr, RS: tl.constexpr, SC: tl.constexpr,
                              ALIGN: tl.constexpr):
        """Grid (N / BN,): the slots' B rows into the spare columns beside W (w (N, KE), KE = K +
        spare_columns(K, P)): w[o, K + p x RS + c] = B^T(column c of part p)[o - o_p] for the
        outputs o of part p where rank column c is live, else 0. The slots are the pool's kept
        adapters (every one resident: its rows are its own), S of them exactly (not a captured
        graph's tables, whose rows past the batch's may point at anything). The other parts' columns of these outputs
        are never written (zeros from the compile)."""
        triton_build.wait_for_producers()
        p, m, o_p = _part(tl.program_id(0) * BN, m0, m1, m2, W0, W1)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        _, valid, tab = _module_columns(m, jc, kc, js, scale_ptr, M, R, SC)
        b_row = tl.multiple_of(tl.load(boff_ptr + tab, mask=valid, other=0).to(tl.int64) + base, ALIGN)
        bt = tl.load(arena_ptr + b_row[:, None] + (cols - o_p)[None, :], mask=valid[:, None], other=0.0)  # (RS, BN)
        c = tl.arange(0, RS)
        tl.store(w_ptr + cols[None, :].to(tl.int64) * KE + K + p * RS + c[:, None], bt)

    @triton.jit
    def _own_columns(acc, m, ts, jc, kc, js, scale_ptr, M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr):
        """Of acc (BM x RS, fp32) each token's own slot's live columns, scaled; zeros elsewhere."""
        scale_c, valid, _ = _module_columns(m, jc, kc, js, scale_ptr, M, R, SC)
        keep = (ts[:, None] == jc[None, :]) & valid[None, :]
        return tl.where(keep, acc * scale_c[None, :], 0.0)

    @triton.jit
    def _store_shrinks(xe_rows, rows, rmask, acc0, acc1, acc2, m0, m1, m2, slot_ptr, jc, kc, js, scale_ptr,
                       K: tl.constexpr, M: tl.constexpr, R: tl.constexpr, P: tl.constexpr, RS: tl.constexpr,
                       SC: tl.constexpr):
        """s beside x: xe_rows[:, K + p x RS + c] = each token's own slot's live columns of part p's
        shrink acc_p (BM x RS, fp32), scaled and rounded to xe's dtype; zeros elsewhere."""
        ts = tl.load(slot_ptr + rows, mask=rmask, other=-1)
        out = xe_rows + K + tl.arange(0, RS)[None, :]
        dt = xe_rows.dtype.element_ty
        tl.store(out, _own_columns(acc0, m0, ts, jc, kc, js, scale_ptr, M, R, SC).to(dt), mask=rmask[:, None])
        if P > 1:
            tl.store(out + RS, _own_columns(acc1, m1, ts, jc, kc, js, scale_ptr, M, R, SC).to(dt),
                     mask=rmask[:, None])
        if P > 2:
            tl.store(out + 2 * RS, _own_columns(acc2, m2, ts, jc, kc, js, scale_ptr, M, R, SC).to(dt),
                     mask=rmask[:, None])

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_shrink_xs", "xe_ptr"))
    def lora_shrink_xs_kernel(arena_ptr, slot_ptr, rank_ptr, scale_ptr, aoff_ptr, xe_ptr, v_ptr, cnt_ptr, n, S, base,
                              chunk, split, K: tl.constexpr, KE: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                              m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, P: tl.constexpr,
                              BM: tl.constexpr, BK: tl.constexpr, RS: tl.constexpr, SC: tl.constexpr,
                              SPLIT_MAX: tl.constexpr, STAGES: tl.constexpr, ALIGN: tl.constexpr):
        """Grid (token tiles, split): xe (n, KE) = [x | s], x in its first K columns (its producer
        wrote it there), s[t, p x RS + c] = round(scale[s, m_p] * (x[t] . A(column c of part p)))
        for token t's own slot's live columns, else 0, and s[t, P x RS:] = 0 (the padding up to KE,
        COLUMN_ALIGN). A block reads the A rows of the slots its tokens use. Split k takes its
        `chunk` inputs of x and sums its part of the products into v; with split > 1 the block of a
        tile that counts last in cnt[tile] sums the splits in order (the same bits whichever block
        is last), writes s and sets cnt[tile] back to 0."""
        triton_build.wait_for_producers()
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < n
        jc, kc, js = _rank_columns(rank_ptr, S, R, RS, SC)
        a0, v0 = _a_rows(m0, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        a1, v1 = _a_rows(m1, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        a2, v2 = _a_rows(m2, jc, kc, js, scale_ptr, aoff_ptr, base, M, R, SC, ALIGN)
        k_start = tl.multiple_of(pid_k * chunk, BK)  # chunk is a multiple of BK
        kk = k_start + tl.arange(0, BK)
        xe_rows = xe_ptr + rows[:, None].to(tl.int64) * KE
        here = _present(slot_ptr, rows, rmask, jc)  # A rows only of the slots the tile's tokens use
        acc0, acc1, acc2 = _shrink_steps(xe_rows, kk, tl.minimum(chunk, K - k_start), rmask, arena_ptr, a0,
                                         v0 & here, a1, v1 & here, a2, v2 & here, BM, RS, P, BK, STAGES)
        c = tl.arange(0, RS)
        last = split == 1
        if split > 1:
            _store_parts(v_ptr + ((pid_k * n + rows[:, None]).to(tl.int64) * P) * RS + c[None, :], rmask, acc0, acc1,
                         acc2, RS, P)
            tl.debug_barrier()  # every thread's partial stored before the count (released by it)
            last = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel", scope="gpu") == split - 1
            if last:
                acc0 = tl.zeros((BM, RS), dtype=tl.float32)
                acc1 = tl.zeros((BM, RS), dtype=tl.float32)
                acc2 = tl.zeros((BM, RS), dtype=tl.float32)
                for k in tl.static_range(SPLIT_MAX):
                    part = v_ptr + ((k * n + rows[:, None]).to(tl.int64) * P) * RS + c[None, :]
                    on = rmask[:, None] & (k < split)
                    acc0 += tl.load(part, mask=on, other=0.0, cache_modifier=".cg")
                    if P > 1:
                        acc1 += tl.load(part + RS, mask=on, other=0.0, cache_modifier=".cg")
                    if P > 2:
                        acc2 += tl.load(part + 2 * RS, mask=on, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid_m, 0)
        if last:
            _store_shrinks(xe_rows, rows, rmask, acc0, acc1, acc2, m0, m1, m2, slot_ptr, jc, kc, js, scale_ptr,
                           K, M, R, P, RS, SC)
            for j in tl.static_range(K + P * RS, KE, RS):  # s's padding to the row's length (COLUMN_ALIGN): zeros
                pad = j + c
                tl.store(xe_rows + pad[None, :], tl.zeros((BM, RS), dtype=xe_ptr.dtype.element_ty),
                         mask=rmask[:, None] & (pad < KE)[None, :])


def _signature(dtype: str) -> dict:
    e = triton_build.PTR[dtype]
    sig = dict(x_ptr=e, w_ptr=e, arena_ptr=e, slot_ptr="*i32", rank_ptr="*i32", scale_ptr="*fp32",
               aoff_ptr="*i32", boff_ptr="*i32", y_ptr=e, ws_ptr="*fp32", cnt_ptr="*i32", n="i32", S="i32",
               base="i64")
    sig.update({k: "constexpr" for k in ("K", "KW", "N", "M", "R", "m0", "m1", "m2", "W0", "W1", "BM", "BN", "BK",
                                          "RS", "SC", "STAGES", "ALIGN", "SPLIT", "SWAP")})
    return sig


def constants(in_f: int, widths: Sequence[int], mods: Sequence[int], num_modules: int, max_rank: int,
              tier: int, align: int, w_cols: int | None = None) -> tuple[dict, int]:
    """(compile-time constants, num_warps) of the kernel for one linear and token tier; `w_cols`:
    the weight's row length where it holds columns beside its own in_f (its first in_f are read)."""
    cfg = tile_config(in_f, widths, tier)
    m, w = padded_parts(mods, widths)
    consts = dict(K=in_f, KW=in_f if w_cols is None else w_cols, N=sum(widths), M=num_modules, R=max_rank,
                  m0=m[0], m1=m[1], m2=m[2], W0=w[0], W1=w[1], BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], RS=RANK_COLUMNS, SC=SLOT_COLUMNS,
                  STAGES=cfg["STAGES"], ALIGN=align, SPLIT=cfg["SPLIT"], SWAP=cfg["SWAP"])
    return consts, cfg["num_warps"]


SHRINK_BM = {"small": 16, "large": 64}  # tokens per shrink block
SHRINK_SMALL_MAX_TOKENS = 512  # "small" up to here
# x's producer, which the rank columns route's wrapper runs itself in place of the kernel before the
# linear (LoraRewrite hands it the producer's input): none ("copy": the linear takes x and keeps the
# pair); the RMSNorm of the model's hidden state h (gain g, eps), or of the residual sum h = a + b,
# which the wrapper then hands on too (ops/norm_triton.py); silu(gate) * up of the gate|up output
# (ops/activation_triton.py).
PRODUCERS = ("copy", "rms_norm", "add_rms_norm", "silu_mul")
# The shrink splits the inputs over blocks until it has about TARGET_BLOCKS of them (one per SM of an
# H200), at most SPLIT_MAX splits of at least MIN_STEPS input steps each.
TARGET_BLOCKS, SPLIT_MAX, MIN_STEPS = 132, 8, 4
EXPAND_BM, EXPAND_WARPS = 32, 4
# The rank columns route's shrink into [x | s] by the width of its inputs (wide: more than
# XS_WIDE_INPUTS): tokens per block, the input step (at most), the blocks it aims at and the most
# input splits (shrink_split), warps. Timed on an H100 (`bench_lora_fused.py producers`, the shrink
# in place, Llama-2-7B's four linears at 256 and 1024 tokens, every plan of BM 16/32/64, BK 64/128
# and 132/264/528 blocks; docs/results/2026-12-06-h100-inplace): blocks of 16 tokens and 128-input
# steps are the best or within 3% of it at every point (0.55-0.92x the plans before at 1024 tokens),
# the wide inputs (down) with twice the blocks.
XS_WIDE_INPUTS = 4096
XS_PLAN = {False: dict(BM=16, BK=128, target=264, most=16, warps=4),
           True: dict(BM=16, BK=128, target=528, most=16, warps=4)}


def _cols_signatures(dtype: str) -> tuple[dict, dict]:
    e = triton_build.PTR[dtype]
    shrink = dict(x_ptr=e, arena_ptr=e, rank_ptr="*i32", scale_ptr="*fp32", aoff_ptr="*i32", v_ptr="*fp32",
                  n="i32", S="i32", base="i64", chunk="i32")
    shrink.update({k: "constexpr" for k in ("K", "M", "R", "m0", "m1", "m2", "P", "BM", "BK", "RS", "SC",
                                             "STAGES", "ALIGN")})
    expand = dict(v_ptr="*fp32", arena_ptr=e, slot_ptr="*i32", rank_ptr="*i32", scale_ptr="*fp32", boff_ptr="*i32",
                  y_ptr=e, n="i32", S="i32", base="i64", split="i32")
    expand.update({k: "constexpr" for k in ("N", "M", "R", "m0", "m1", "m2", "W0", "W1", "P", "BM", "BN",
                                             "SPLIT_MAX", "RS", "SC", "ALIGN")})
    return shrink, expand


def cols_constants(in_f: int, widths: Sequence[int], mods: Sequence[int], num_modules: int, max_rank: int,
                   variant: str, align: int) -> tuple[dict, dict]:
    """(shrink constants, expand constants) of the separate pair for one linear."""
    m, w = padded_parts(mods, widths)
    bk = next(b for b in (128, 64, 32, 16) if in_f % b == 0)
    shrink = dict(K=in_f, M=num_modules, R=max_rank, m0=m[0], m1=m[1], m2=m[2], P=len(widths),
                  BM=SHRINK_BM[variant], BK=bk, RS=RANK_COLUMNS, SC=SLOT_COLUMNS, STAGES=3, ALIGN=align)
    # 256 outputs per block (every block re-reads its tokens' partial sums)
    bn = next(b for b in (256, 128, 64, 32, 16) if all(x % b == 0 for x in widths))
    expand = dict(N=sum(widths), M=num_modules, R=max_rank, m0=m[0], m1=m[1], m2=m[2], W0=w[0], W1=w[1],
                  P=len(widths), BM=EXPAND_BM, BN=bn, SPLIT_MAX=SPLIT_MAX, RS=RANK_COLUMNS, SC=SLOT_COLUMNS,
                  ALIGN=align)
    return shrink, expand


def shrink_split(n, steps: int, bm: int, lo=max, hi=min, target: int = TARGET_BLOCKS, most: int = SPLIT_MAX):
    """(blocks of tokens, input steps per split, splits) of the shrink for n tokens; `steps` = the
    inputs / BK; at most `most` splits. Python ints, or TIR expressions with lo/hi =
    tvm.tirx.max/min (the wrapper)."""
    tiles = (n + bm - 1) // bm
    split = hi(hi(most, lo(1, (target + tiles - 1) // tiles)), max(1, steps // MIN_STEPS))
    per = (steps + split - 1) // split
    return tiles, per, (steps + per - 1) // per


def cols_launch(n: int, in_f: int, widths: Sequence[int], mods: Sequence[int], num_modules: int, max_rank: int,
                align: int, variant: str | None = None) -> dict:
    """How the TIR wrapper launches the pair for n tokens (for launches from Python: the tests'
    interpreter runs, the benchmarks): constants, split, grids."""
    variant = variant or ("small" if n <= SHRINK_SMALL_MAX_TOKENS else "large")
    cs, ce = cols_constants(in_f, widths, mods, num_modules, max_rank, variant, align)
    tiles, per, split = shrink_split(n, in_f // cs["BK"], cs["BM"])
    return dict(shrink=cs, expand=ce, split=split, chunk=per * cs["BK"], shrink_grid=(tiles, split),
                expand_grid=(-(-n // ce["BM"]), sum(widths) // ce["BN"]), shrink_warps=4,
                expand_warps=EXPAND_WARPS)


# The rank columns route's spare columns end each weight row (and each row of [x | s]) on a multiple
# of COLUMN_ALIGN elements (128 bytes in fp16/bf16). Measured on the H200 (bench_lora_fused.py
# producers, docs/results/2026-12-06-h200-aligned-columns): cuBLAS over rows K + 96 and K + 32
# apart (q|k|v, o, down) took 2-8% more than over K beyond the extra inputs' share; gate|up's K + 64
# did not.
COLUMN_ALIGN = 64


def spare_columns(in_f: int, num_parts: int) -> int:
    """Columns a weight of `num_parts` parts and in_f inputs holds beside its own for the rank columns
    route (passes/reserve_rank_columns.py reserves them, the compile writes them as zeros): its
    P x RANK_COLUMNS rank columns, then zeros up to a row length that is a multiple of COLUMN_ALIGN
    (the shrink writes [x | s]'s padding as zeros too)."""
    return -(-(in_f + num_parts * RANK_COLUMNS) // COLUMN_ALIGN) * COLUMN_ALIGN - in_f


def rank_rows(num_parts: int) -> int:
    """Rows a weight of `num_parts` parts holds below its own for the batch's A rows (the rank
    rows route; passes/reserve_rank_rows.py reserves them, the compile writes them as zeros)."""
    return num_parts * RANK_COLUMNS


def fill_rows_ref(arena, base, rank, scale, a_off, mods, in_f):
    """Semantics of the fill: the (P * RANK_COLUMNS, in_f) rank rows of a linear whose parts are
    modules `mods`: row p * RANK_COLUMNS + c is A[s, m_p][k] for rank column c = (slot s, row k)
    (slot s owns the columns after the ranks of the slots before it) where s < SLOT_COLUMNS,
    m_p >= 0 and scale[s, m_p] != 0; zeros elsewhere."""
    out = np.zeros((len(mods) * RANK_COLUMNS, in_f), arena.dtype)
    R = a_off.shape[2]  # (ranks clamped to 0..R, as the kernels read them)
    cols = [(s, k) for s in range(min(len(rank), SLOT_COLUMNS)) for k in range(min(max(int(rank[s]), 0), R))]
    for p, m in enumerate(mods):
        for c, (s, k) in enumerate(cols[:RANK_COLUMNS]):
            if m >= 0 and scale[s, m] != 0:
                out[p * RANK_COLUMNS + c] = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + in_f]
    return out


def _rows_signatures(dtype: str) -> tuple[dict, dict]:
    e = triton_build.PTR[dtype]
    fill = dict(arena_ptr=e, rank_ptr="*i32", scale_ptr="*fp32", aoff_ptr="*i32", w_ptr=e, S="i32", base="i64")
    fill.update({k: "constexpr" for k in ("K", "N", "M", "R", "m0", "m1", "m2", "BK", "RS", "SC", "ALIGN")})
    expand = dict(e_ptr=e, arena_ptr=e, slot_ptr="*i32", rank_ptr="*i32", scale_ptr="*fp32", boff_ptr="*i32",
                  y_ptr=e, n="i32", S="i32", base="i64")
    expand.update({k: "constexpr" for k in ("N", "M", "R", "m0", "m1", "m2", "W0", "W1", "P", "BM", "BN", "RS",
                                             "SC", "ALIGN")})
    return fill, expand


def rows_launch(n: int, in_f: int, widths: Sequence[int], mods: Sequence[int], num_modules: int, max_rank: int,
                align: int) -> dict:
    """How the TIR wrapper launches the rank rows route for n tokens (the fill, cuBLAS over the
    N + P * RANK_COLUMNS rows, the expand): constants, grids, warps."""
    m, w = padded_parts(mods, widths)
    N, P = sum(widths), len(widths)
    bk = next(b for b in (256, 128, 64, 32, 16) if in_f % b == 0)
    fill = dict(K=in_f, N=N, M=num_modules, R=max_rank, m0=m[0], m1=m[1], m2=m[2], BK=bk, RS=RANK_COLUMNS,
                SC=SLOT_COLUMNS, ALIGN=align)
    bn = next(b for b in (256, 128, 64, 32, 16) if all(x % b == 0 for x in widths))
    expand = dict(N=N, M=num_modules, R=max_rank, m0=m[0], m1=m[1], m2=m[2], W0=w[0], W1=w[1], P=P, BM=EXPAND_BM,
                  BN=bn, RS=RANK_COLUMNS, SC=SLOT_COLUMNS, ALIGN=align)
    return dict(fill=fill, expand=expand, fill_grid=(P, in_f // bk), fill_warps=4,
                expand_grid=(-(-n // EXPAND_BM), N // bn), expand_warps=EXPAND_WARPS, rows=N + rank_rows(P))


def _cols_route_signatures(dtype: str) -> tuple[dict, dict]:
    e = triton_build.PTR[dtype]
    fill = dict(arena_ptr=e, rank_ptr="*i32", scale_ptr="*fp32", boff_ptr="*i32", w_ptr=e, S="i32", base="i64")
    fill.update({k: "constexpr" for k in ("K", "KE", "M", "R", "m0", "m1", "m2", "W0", "W1", "BN", "RS", "SC",
                                           "ALIGN")})
    shrink = dict(arena_ptr=e, slot_ptr="*i32", rank_ptr="*i32", scale_ptr="*fp32", aoff_ptr="*i32", xe_ptr=e,
                  v_ptr="*fp32", cnt_ptr="*i32", n="i32", S="i32", base="i64", chunk="i32", split="i32")
    shrink.update({k: "constexpr" for k in ("K", "KE", "M", "R", "m0", "m1", "m2", "P", "BM", "BK", "RS", "SC",
                                             "SPLIT_MAX", "STAGES", "ALIGN")})
    return fill, shrink


def xs_launch(n: int, in_f: int, widths: Sequence[int], mods: Sequence[int], num_modules: int, max_rank: int,
              align: int) -> dict:
    """How the rank columns route launches for n tokens (the fill of the spare columns, by
    fill_wrapper when the kept columns change; after x's producer, the shrink into [x | s] and
    cuBLAS over K + P * RANK_COLUMNS inputs, by the linear's TIR wrapper): constants, split, grids,
    warps; `plan`, the shrink's (BM, BK, input steps, target, most) for the wrapper's split
    (XS_PLAN)."""
    plan = XS_PLAN[in_f > XS_WIDE_INPUTS]
    cs, _ = cols_constants(in_f, widths, mods, num_modules, max_rank, "small", align)
    bk = next(b for b in (128, 64, 32, 16) if b <= plan["BK"] and in_f % b == 0)
    tiles, per, split = shrink_split(n, in_f // bk, plan["BM"], target=plan["target"], most=plan["most"])
    m, w = padded_parts(mods, widths)
    P = len(widths)
    ke = in_f + spare_columns(in_f, P)
    bn = next(b for b in (128, 64, 32, 16) if all(x % b == 0 for x in widths))
    fill = dict(K=in_f, KE=ke, M=num_modules, R=max_rank, m0=m[0], m1=m[1], m2=m[2], W0=w[0], W1=w[1], BN=bn,
                RS=RANK_COLUMNS, SC=SLOT_COLUMNS, ALIGN=align)
    consts = dict(cs, BM=plan["BM"], BK=bk, KE=ke, SPLIT_MAX=plan["most"])
    return dict(fill=fill, shrink=consts, split=split, chunk=per * bk, fill_grid=(sum(widths) // bn,),
                shrink_grid=(tiles, split), fill_warps=4, shrink_warps=plan["warps"], cols=ke,
                plan=(plan["BM"], bk, in_f // bk, plan["target"], plan["most"]))


def scratch_elems(n, widths: Sequence[int]):
    """fp32 elements of the shrink's partial sums for n tokens (the most any variant writes: the
    pair's SPLIT_MAX splits, the rank columns route's XS_PLAN ones)."""
    return max(SPLIT_MAX, *(p["most"] for p in XS_PLAN.values())) * n * len(widths) * RANK_COLUMNS


def producer_module(producer: str, in_f: int, ld: int, dtype: str, arch: str):
    """(kernel name, threads, shared bytes, CUDA module) of x's producer (PRODUCERS: the RMSNorm of
    rows, silu(gate) * up of ops/activation_triton.py) writing x's rows `ld` apart (in_f: x alone;
    the width of [x | s]: its first columns)."""
    if producer in ("rms_norm", "add_rms_norm"):
        return NORM.build(in_f, dtype, arch, ldo=ld, residual=producer == "add_rms_norm")
    return ACT.build(in_f, dtype, arch, ld)


def linear_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   align: int, arch: str, rows: bool = False, w_cols: int | None = None, producer: str = "copy",
                   eps: float = 0.0):
    """(TIR wrapper, CUDA modules). Signature: (x (n, in_f), w (W, w_cols or in_f: a weight's
    columns beside its own are not read), arena (size,), slot (n,),
    rank (S,), scale (S, M), a_off (S, M, R), b_off (S, M, R), layer: int64, y (n, W) [out],
    v (scratch_elems,) float32 [out, scratch]). Up to FUSED_MAX_TOKENS tokens the fused kernel;
    above, cuBLAS for x @ W.T, then the shrink into v and the in-place expand. `rows` (the rank
    rows route): w is (W + rank_rows(P), in_f), its last rows reserved; above FUSED_MAX_TOKENS the
    batch's A rows are filled into them, cuBLAS computes e = x @ w.T (W + rank_rows(P) columns) and
    the expand writes y from e; one more output, e (n, W + rank_rows(P)) [scratch]. A weight with
    spare columns and a `producer` other than "copy" (PRODUCERS) takes the rank columns route: the
    wrapper takes the producer's input instead of x (h (n, in_f) and the gain g (in_f,) for
    "rms_norm" with `eps`; h, r (n, in_f) and g for "add_rms_norm", which writes h + r to one more
    output after x, h1 (n, in_f); y = [gate | up] (n, 2 in_f) for "silu_mul") and runs the producer's
    kernel itself, into xe (n, w_cols) [scratch]'s first columns past FUSED_MAX_TOKENS (the
    shrink adds s beside it), else into one more output, x (n, in_f) [scratch], which the
    one-kernel linear reads. With "copy" a weight's spare columns are not read (the pair)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    from ..gemv.gemv_cuda import CUBLAS_GEMM  # pylint: disable=import-outside-toplevel
    from ..kernel_attrs import kernel_attrs  # pylint: disable=import-outside-toplevel

    R, M, L, W, P = max_rank, num_modules, num_layers, sum(widths), len(widths)
    KW = in_f if w_cols is None else w_cols
    if KW not in (in_f, in_f + spare_columns(in_f, P)) or (rows and KW != in_f):
        raise ValueError(f"a weight of {KW} columns for {in_f} inputs (in_f, or in_f + "
                         f"{spare_columns(in_f, P)} spare columns for the rank columns route; not with the "
                         "rank rows route)")
    # the rank columns route past FUSED_MAX_TOKENS: a weight with spare columns and x's producer to
    # write x into [x | s] (without one, the pair over the weight's first columns: copying x there
    # cost more than the pair's expand)
    cols = KW != in_f and producer != "copy"
    if producer not in PRODUCERS or (producer != "copy" and KW == in_f):
        raise ValueError(f"producer {producer!r}: one of {PRODUCERS}, other than 'copy' only for a weight with "
                         "spare columns")
    built, kernels, mods_out = {}, {}, []
    for tier in TOKEN_TIERS:  # (tiers of one shape share a kernel)
        consts, warps = constants(in_f, widths, mods, M, R, tier, align, KW)
        key = (tuple(sorted(consts.items())), warps)
        if key not in kernels:
            name, threads, shared, mod = triton_build.cuda_module(lora_linear_kernel, _signature(dtype), consts,
                                                                  warps, arch, Path(__file__))
            kernels[key] = (name, threads, shared)
            mods_out.append(mod)
        built[tier] = kernels[key] + (consts["BM"], W // consts["BN"], consts["SPLIT"])
    WR = W + rank_rows(P) if rows else W  # the weight's rows
    if rows:  # past FUSED_MAX_TOKENS: the fill, cuBLAS over W's rows and the rank rows, the expand
        go = rows_launch(1, in_f, widths, mods, M, R, align)
        sig_f, sig_x = _rows_signatures(dtype)
        fn_, fth, fsh, fmod = triton_build.cuda_module(lora_fill_rows_kernel, sig_f, go["fill"], go["fill_warps"],
                                                       arch, Path(__file__))
        xn, xth, xsh, xmod = triton_build.cuda_module(lora_expand_rows_kernel, sig_x, go["expand"],
                                                      go["expand_warps"], arch, Path(__file__))
        mods_out += [fmod, xmod]
        f_grid, x_nt = go["fill_grid"], go["expand_grid"][1]
    elif cols:  # past FUSED_MAX_TOKENS: the shrink into [x | s], cuBLAS over [x | s] and [W | B columns]
        _, sig_s = _cols_route_signatures(dtype)
        gv = xs_launch(1, in_f, widths, mods, M, R, align)  # (x's producer writes x into xe, the shrink adds s)
        qn, qth, qsh, mod = triton_build.cuda_module(lora_shrink_xs_kernel, sig_s, gv["shrink"], gv["shrink_warps"],
                                                     arch, Path(__file__))
        q_plan = gv["plan"]
        mods_out.append(mod)
        # x's producer: into x up to FUSED_MAX_TOKENS (the one-kernel linear reads it), into xe's first
        # columns past it
        (rn, rth, rsh, mod), (cn, cth, csh, cmod) = (producer_module(producer, in_f, ld, dtype, arch)
                                                     for ld in (in_f, KW))
        mods_out += [mod, cmod]
    else:  # past FUSED_MAX_TOKENS: cuBLAS, then the shrink (two variants) and the in-place expand
        sig_s, sig_e = _cols_signatures(dtype)
        shrinks = {}
        for variant in SHRINK_BM:
            cs, ce = cols_constants(in_f, widths, mods, M, R, variant, align)
            name, threads, shared, mod = triton_build.cuda_module(lora_shrink_cols_kernel, sig_s, cs, 4, arch,
                                                                  Path(__file__))
            shrinks[variant] = (name, threads, shared, cs["BM"])
            mods_out.append(mod)
        en, eth, esh, emod = triton_build.cuda_module(lora_expand_cols_kernel, sig_e, ce, EXPAND_WARPS, arch,
                                                      Path(__file__))
        mods_out.append(emod)
        e_nt, bk = W // ce["BN"], cs["BK"]
        steps = in_f // bk
        qn, qth, qsh, q_bm = shrinks["small"]
        gn, gth, gsh, g_bm = shrinks["large"]
    (sn, sth, ssh, s_bm, s_nt, s_split), (mn, mth, msh, m_bm, m_nt, m_split), (ln, lth, lsh, l_bm, l_nt, l_split) = (
        built[t] for t in TOKEN_TIERS)

    def lo(a, b):
        return T.max(T.int64(a), b) if isinstance(a, int) else T.max(a, b)

    def hi(a, b):
        return T.min(T.int64(a), b) if isinstance(a, int) else T.min(a, b)

    def xs_split(n, plan):
        return shrink_split(n, plan[2], plan[0], lo, hi, plan[3], plan[4])

    # The split is computed inline in the launches: a local variable in this host function would
    # be a scalar buffer, which the lowering allocates in device memory.

    @T.macro
    def shrink_expand(name, bm, threads, shared, n, S, size, layer, x, arena, slot, rank, scale, a_off, b_off, y, v):
        """The shrink variant `name` (blocks of bm tokens) into v, then the expand into y."""
        T.call_packed(name, x.data, arena.data, rank.data, scale.data, a_off.data, v.data,
                      T.Cast("int32", n), T.Cast("int32", S), layer * (size // L),
                      T.Cast("int32", shrink_split(n, steps, bm, lo, hi)[1] * bk), T.int64(0), T.int64(0),
                      T.Cast("int32", shrink_split(n, steps, bm, lo, hi)[0]),
                      T.Cast("int32", shrink_split(n, steps, bm, lo, hi)[2]), threads, shared)
        T.call_packed(en, v.data, arena.data, slot.data, rank.data, scale.data, b_off.data, y.data,
                      T.Cast("int32", n), T.Cast("int32", S), layer * (size // L),
                      T.Cast("int32", shrink_split(n, steps, bm, lo, hi)[2]), T.int64(0), T.int64(0),
                      T.Cast("int32", (n + EXPAND_BM - 1) // EXPAND_BM), e_nt, eth, esh)

    @T.macro
    def shrink_xs(name, plan, threads, shared, n, S, size, layer, arena, slot, rank, scale, a_off, xe, v, cnt):
        """The shrink `name` adding s to xe = [x | s] (x written by its producer); plan: its (BM, BK,
        input steps, target, most) (xs_launch)."""
        T.call_packed(name, arena.data, slot.data, rank.data, scale.data, a_off.data, xe.data, v.data,
                      cnt.data, T.Cast("int32", n), T.Cast("int32", S), layer * (size // L),
                      T.Cast("int32", xs_split(n, plan)[1] * plan[1]), T.Cast("int32", xs_split(n, plan)[2]),
                      T.int64(0), T.int64(0), T.Cast("int32", xs_split(n, plan)[0]),
                      T.Cast("int32", xs_split(n, plan)[2]), threads, shared)

    @T.macro
    def tier_kernel(name, bm, nt, split, threads, shared, n, S, size, layer, x, w, arena, slot, rank, scale, a_off,
                    b_off, y, v, cnt):
        """The one-kernel linear `name` (blocks of bm tokens, nt output tiles, split inputs)."""
        T.call_packed(name, x.data, w.data, arena.data, slot.data, rank.data, scale.data, a_off.data, b_off.data,
                      y.data, v.data, cnt.data, T.Cast("int32", n), T.Cast("int32", S), layer * (size // L),
                      T.int64(0), T.int64(0), T.Cast("int32", (n + bm - 1) // bm * split), nt, threads, shared)

    @T.macro
    def one_kernel(n, S, size, layer, x, w, arena, slot, rank, scale, a_off, b_off, y, v, cnt):
        """The one-kernel linear at its token tier's shape (it reads W's first W rows)."""
        if n <= TOKEN_TIERS[0]:
            tier_kernel(sn, s_bm, s_nt, s_split, sth, ssh, n, S, size, layer, x, w, arena, slot, rank, scale, a_off,
                        b_off, y, v, cnt)
        elif n <= TOKEN_TIERS[1]:
            tier_kernel(mn, m_bm, m_nt, m_split, mth, msh, n, S, size, layer, x, w, arena, slot, rank, scale, a_off,
                        b_off, y, v, cnt)
        else:
            tier_kernel(ln, l_bm, l_nt, l_split, lth, lsh, n, S, size, layer, x, w, arena, slot, rank, scale, a_off,
                        b_off, y, v, cnt)

    # pylint: disable=unused-variable
    if rows:
        @T.prim_func(s_tir=True)
        def lora_linear_rows(x_h: T.handle, w_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                             scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle, layer: T.int64, cnt_h: T.handle,
                             y_h: T.handle, v_h: T.handle, e_h: T.handle):
            T.func_attr(kernel_attrs(True))
            n, S, size, nv = T.int64(), T.int64(), T.int64(), T.int64()
            x = T.match_buffer(x_h, (n, in_f), dtype)
            w = T.match_buffer(w_h, (WR, in_f), dtype)
            arena = T.match_buffer(arena_h, (size,), dtype)
            slot = T.match_buffer(slot_h, (n,), "int32")
            rank = T.match_buffer(rank_h, (S,), "int32")
            scale = T.match_buffer(scale_h, (S, M), "float32")
            a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
            b_off = T.match_buffer(boff_h, (S, M, R), "int32")
            cnt = T.match_buffer(cnt_h, (COUNTER_SLOTS,), "int32")
            y = T.match_buffer(y_h, (n, W), dtype)
            v = T.match_buffer(v_h, (nv,), "float32")
            e = T.match_buffer(e_h, (n, WR), dtype)
            if n > 0:
                if n <= FUSED_MAX_TOKENS:
                    one_kernel(n, S, size, layer, x, w, arena, slot, rank, scale, a_off, b_off, y, v, cnt)
                else:
                    T.call_packed(fn_, arena.data, rank.data, scale.data, a_off.data, w.data, T.Cast("int32", S),
                                  layer * (size // L), T.int64(0), T.int64(0), f_grid[0], f_grid[1], fth, fsh)
                    T.call_packed(CUBLAS_GEMM, x, w, e)
                    T.call_packed(xn, e.data, arena.data, slot.data, rank.data, scale.data, b_off.data, y.data,
                                  T.Cast("int32", n), T.Cast("int32", S), layer * (size // L), T.int64(0),
                                  T.int64(0), T.Cast("int32", (n + EXPAND_BM - 1) // EXPAND_BM), x_nt, xth, xsh)

        return lora_linear_rows, mods_out

    if cols:
        KE = KW

        @T.macro
        def produce(name, threads, shared, n, h, r, g, out, h1):
            """x's producer of h (r: the residual add's other operand, h1 its sum; g: the RMSNorm's
            gain) into out (x, or xe's first columns)."""
            if producer != "silu_mul":  # a row per block
                T.call_packed(name, h.data, r.data, g.data, out.data, h1.data, T.float32(eps), T.int64(0), T.int64(0),
                              n, 1, threads, shared)
            else:
                T.call_packed(name, h.data, out.data, T.Cast("int32", n), T.int64(0), T.int64(0),
                              T.Cast("int32", (n + ACT.BM - 1) // ACT.BM), in_f // ACT.block_cols(in_f), threads,
                              shared)

        @T.macro
        def produced(n, S, size, layer, h, r, g, w, arena, slot, rank, scale, a_off, b_off, cnt, y, v, xe, x, h1):
            """The producer into x and the one-kernel linear, or the producer into xe, the shrink adding
            s in place and cuBLAS."""
            if n > 0:
                if n <= FUSED_MAX_TOKENS:
                    produce(rn, rth, rsh, n, h, r, g, x, h1)
                    one_kernel(n, S, size, layer, x, w, arena, slot, rank, scale, a_off, b_off, y, v, cnt)
                else:
                    produce(cn, cth, csh, n, h, r, g, xe, h1)
                    shrink_xs(qn, q_plan, qth, qsh, n, S, size, layer, arena, slot, rank, scale, a_off, xe, v, cnt)
                    T.call_packed(CUBLAS_GEMM, xe, w, y)

        @T.prim_func(s_tir=True)
        def lora_linear_norm(h_h: T.handle, g_h: T.handle, w_h: T.handle, arena_h: T.handle, slot_h: T.handle,
                             rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle,
                             layer: T.int64, cnt_h: T.handle, y_h: T.handle, v_h: T.handle, xe_h: T.handle,
                             x_h: T.handle):
            T.func_attr(kernel_attrs(True))
            n, S, size, nv = T.int64(), T.int64(), T.int64(), T.int64()
            h = T.match_buffer(h_h, (n, in_f), dtype)
            g = T.match_buffer(g_h, (in_f,), dtype)
            w = T.match_buffer(w_h, (W, KE), dtype)
            arena = T.match_buffer(arena_h, (size,), dtype)
            slot = T.match_buffer(slot_h, (n,), "int32")
            rank = T.match_buffer(rank_h, (S,), "int32")
            scale = T.match_buffer(scale_h, (S, M), "float32")
            a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
            b_off = T.match_buffer(boff_h, (S, M, R), "int32")
            cnt = T.match_buffer(cnt_h, (COUNTER_SLOTS,), "int32")
            y = T.match_buffer(y_h, (n, W), dtype)
            v = T.match_buffer(v_h, (nv,), "float32")
            xe = T.match_buffer(xe_h, (n, KE), dtype)
            x = T.match_buffer(x_h, (n, in_f), dtype)
            produced(n, S, size, layer, h, h, g, w, arena, slot, rank, scale, a_off, b_off, cnt, y, v, xe, x, x)

        @T.prim_func(s_tir=True)
        def lora_linear_add_norm(h_h: T.handle, r_h: T.handle, g_h: T.handle, w_h: T.handle, arena_h: T.handle,
                                 slot_h: T.handle, rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle,
                                 boff_h: T.handle, layer: T.int64, cnt_h: T.handle, y_h: T.handle, v_h: T.handle,
                                 xe_h: T.handle, x_h: T.handle, h1_h: T.handle):
            T.func_attr(kernel_attrs(True))
            n, S, size, nv = T.int64(), T.int64(), T.int64(), T.int64()
            h = T.match_buffer(h_h, (n, in_f), dtype)
            r = T.match_buffer(r_h, (n, in_f), dtype)
            g = T.match_buffer(g_h, (in_f,), dtype)
            w = T.match_buffer(w_h, (W, KE), dtype)
            arena = T.match_buffer(arena_h, (size,), dtype)
            slot = T.match_buffer(slot_h, (n,), "int32")
            rank = T.match_buffer(rank_h, (S,), "int32")
            scale = T.match_buffer(scale_h, (S, M), "float32")
            a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
            b_off = T.match_buffer(boff_h, (S, M, R), "int32")
            cnt = T.match_buffer(cnt_h, (COUNTER_SLOTS,), "int32")
            y = T.match_buffer(y_h, (n, W), dtype)
            v = T.match_buffer(v_h, (nv,), "float32")
            xe = T.match_buffer(xe_h, (n, KE), dtype)
            x = T.match_buffer(x_h, (n, in_f), dtype)
            h1 = T.match_buffer(h1_h, (n, in_f), dtype)
            produced(n, S, size, layer, h, r, g, w, arena, slot, rank, scale, a_off, b_off, cnt, y, v, xe, x, h1)

        @T.prim_func(s_tir=True)
        def lora_linear_silu(h_h: T.handle, w_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                             scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle, layer: T.int64, cnt_h: T.handle,
                             y_h: T.handle, v_h: T.handle, xe_h: T.handle, x_h: T.handle):
            T.func_attr(kernel_attrs(True))
            n, S, size, nv = T.int64(), T.int64(), T.int64(), T.int64()
            h = T.match_buffer(h_h, (n, 2 * in_f), dtype)
            w = T.match_buffer(w_h, (W, KE), dtype)
            arena = T.match_buffer(arena_h, (size,), dtype)
            slot = T.match_buffer(slot_h, (n,), "int32")
            rank = T.match_buffer(rank_h, (S,), "int32")
            scale = T.match_buffer(scale_h, (S, M), "float32")
            a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
            b_off = T.match_buffer(boff_h, (S, M, R), "int32")
            cnt = T.match_buffer(cnt_h, (COUNTER_SLOTS,), "int32")
            y = T.match_buffer(y_h, (n, W), dtype)
            v = T.match_buffer(v_h, (nv,), "float32")
            xe = T.match_buffer(xe_h, (n, KE), dtype)
            x = T.match_buffer(x_h, (n, in_f), dtype)
            produced(n, S, size, layer, h, h, h, w, arena, slot, rank, scale, a_off, b_off, cnt, y, v, xe, x, x)

        return {"rms_norm": lora_linear_norm, "add_rms_norm": lora_linear_add_norm,
                "silu_mul": lora_linear_silu}[producer], mods_out

    @T.prim_func(s_tir=True)
    def lora_linear_triton(x_h: T.handle, w_h: T.handle, arena_h: T.handle, slot_h: T.handle, rank_h: T.handle,
                           scale_h: T.handle, aoff_h: T.handle, boff_h: T.handle, layer: T.int64, cnt_h: T.handle,
                           y_h: T.handle, v_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, nv = T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        w = T.match_buffer(w_h, (W, KW), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        slot = T.match_buffer(slot_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        cnt = T.match_buffer(cnt_h, (COUNTER_SLOTS,), "int32")
        y = T.match_buffer(y_h, (n, W), dtype)
        v = T.match_buffer(v_h, (nv,), "float32")
        if n > 0:
            if n <= FUSED_MAX_TOKENS:
                one_kernel(n, S, size, layer, x, w, arena, slot, rank, scale, a_off, b_off, y, v, cnt)
            else:
                T.call_packed(CUBLAS_GEMM, x, w, y)
                if n <= SHRINK_SMALL_MAX_TOKENS:
                    shrink_expand(qn, q_bm, qth, qsh, n, S, size, layer, x, arena, slot, rank, scale, a_off, b_off,
                                  y, v)
                else:
                    shrink_expand(gn, g_bm, gth, gsh, n, S, size, layer, x, arena, slot, rank, scale, a_off, b_off,
                                  y, v)

    return lora_linear_triton, mods_out


def fill_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str, align: int,
                 arch: str):
    """(TIR wrapper, CUDA modules) of the fill of a weight's spare columns (the rank columns route).
    Signature: (arena (size,), rank (S,), scale (S, M), b_off (S, M, R), layer: int64, w (W, in_f +
    spare_columns(in_f, P)) [in place]): the kept adapters' B rows (the pool's tables of a batch
    within the kept columns) into w's spare columns, `lora_fill_cols_kernel` over layer `layer`'s arena region."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    from ..kernel_attrs import kernel_attrs  # pylint: disable=import-outside-toplevel

    R, M, L, W = max_rank, num_modules, num_layers, sum(widths)
    go = xs_launch(1, in_f, widths, mods, M, R, align)
    KE = go["cols"]
    sig_f, _ = _cols_route_signatures(dtype)
    fn_, fth, fsh, fmod = triton_build.cuda_module(lora_fill_cols_kernel, sig_f, go["fill"], go["fill_warps"], arch,
                                                   Path(__file__))
    grid = go["fill_grid"][0]

    @T.prim_func(s_tir=True)
    def lora_fill_columns(arena_h: T.handle, rank_h: T.handle, scale_h: T.handle, boff_h: T.handle, layer: T.int64,
                          w_h: T.handle):
        T.func_attr(kernel_attrs(True))
        S, size = T.int64(), T.int64()
        arena = T.match_buffer(arena_h, (size,), dtype)
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        w = T.match_buffer(w_h, (W, KE), dtype)
        T.call_packed(fn_, arena.data, rank.data, scale.data, b_off.data, w.data, T.Cast("int32", S),
                      layer * (size // L), T.int64(0), T.int64(0), grid, 1, fth, fsh)

    return lora_fill_columns, [fmod]


class FusedLinear:
    """The fused linear of the _fused functions: LoraRewrite replaces `x @ W.T` + the stage's update by one
    call of this kernel where `supported` is None (other linears keep the stage's update)."""

    def supported(self, target, dtype: str, weight_dtype: str, in_f: int, widths: Sequence[int]) -> str | None:
        if target.kind.name != "cuda":
            return f"target {target.kind.name} (the kernel is CUDA)"
        return supported(dtype, weight_dtype, in_f, widths)

    def emit(self, ctx, x, w, layer: int, parts: Sequence, tables: Mapping, counters, out_shape,
             producer: tuple | None = None):
        """(y, h1): y = x @ W.T + every token's delta, (n, W) reshaped to `out_shape` (not yet
        emitted); h1 the residual sum (n, in) the wrapper hands on with the "add_rms_norm" producer, else None.
        ctx: the rewrite's LoraContext; x (n, in) and w (W, in) relax Vars (w of W + rank_rows(P)
        rows: the weight reserves the rank rows route's rows, which it then takes above
        FUSED_MAX_TOKENS; of in + spare_columns(in, P) columns: the rank columns route's); parts:
        ops/lora Parts; counters: the function's (COUNTER_SLOTS,) int32 zeros (`counters()`), shared by its
        linears; producer (a weight with spare columns only): x's producer for the wrapper to run
        instead of reading x, (kind, its inputs, eps): ("rms_norm", [h, g], eps), ("add_rms_norm",
        [a, b, g], eps) or ("silu_mul", [y], 0.0) (linear_wrapper)."""
        from tvm import relax  # pylint: disable=import-outside-toplevel

        from .stage import layer_arg, tokens  # pylint: disable=import-outside-toplevel

        bb, t, n = ctx.builder, tables, tokens(x)
        in_f, dtype = int(x.ty.shape.values[-1]), str(x.ty.dtype)
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        align = ctx.row_align if all(v % ctx.row_align == 0 for v in (in_f, *widths)) else 1
        w_rows, w_cols, W = int(w.ty.shape.values[0]), int(w.ty.shape.values[1]), sum(widths)
        if w_rows not in (W, W + rank_rows(len(widths))):
            raise ValueError(f"weight of {w_rows} rows for a linear of {W} outputs (or {W} + "
                             f"{rank_rows(len(widths))} reserved rank rows)")
        rows, cols = w_rows != W, w_cols != in_f and producer is not None  # (cols: the rank columns route)
        kind, head, eps = producer or ("copy", [x], 0.0)
        key = ("linear_triton", in_f, mods, widths, dtype, rows, w_cols, kind, eps)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)

        def make():
            func, mods_ = linear_wrapper(in_f, widths, mods, ctx.num_layers, ctx.max_rank, ctx.num_modules, dtype,
                                         align, str(ctx.target.arch), rows=rows, w_cols=w_cols, producer=kind,
                                         eps=eps)
            for i, mod in enumerate(mods_):
                ctx.external(key + ("module", i), lambda mod=mod: mod)
            return func

        name = f"lora_linear_{'rows' if rows else 'cols' if cols else 'triton'}_m{tag}_{in_f}x{W}" + (
            f"_of{w_cols}" if w_cols != in_f else "") + {"copy": "", "rms_norm": "_norm", "add_rms_norm": "_addnorm",
                                                         "silu_mul": "_silu"}[kind]
        fn = ctx.kernel(key, name, make)
        outs = [relax.TensorType([n, W], dtype)]
        if rows:  # no shrink partials; e = x @ [W; rank rows].T
            outs += [relax.TensorType([max(1, split_scratch_elems(in_f, widths))], "float32"),
                     relax.TensorType([n, w_rows], dtype)]
        elif cols:  # the shrink's partial sums; xe = [x | s]; x, which the wrapper makes
            outs += [relax.TensorType([scratch_elems(n, widths) + split_scratch_elems(in_f, widths)], "float32"),
                     relax.TensorType([n, w_cols], dtype), relax.TensorType([n, in_f], dtype)]
            if kind == "add_rms_norm":  # the residual sum, handed on
                outs.append(relax.TensorType([n, in_f], dtype))
        else:
            outs += [relax.TensorType([scratch_elems(n, widths) + split_scratch_elems(in_f, widths)], "float32")]
        out = bb.emit(relax.call_tir(fn, head + [w, t["lora_arena"], t["lora_token_slot"], t["lora_rank"],
                                                 t["lora_scale"], t["lora_a_off"], t["lora_b_off"], layer_arg(layer),
                                                 counters], outs))
        y = bb.emit(relax.TupleGetItem(out, 0))
        h1 = bb.emit(relax.TupleGetItem(out, len(outs) - 1)) if kind == "add_rms_norm" else None
        return relax.op.reshape(y, out_shape), h1

    def fill(self, ctx, parts: Sequence, in_f: int, w_ty, dtype: str):
        """The fill of the spare columns of a weight of type `w_ty` (the GlobalVar of its PrimFunc,
        for the module's `lora_fill_columns`: LoraRewrite), or None where the weight has none."""
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        if int(w_ty.shape.values[1]) == in_f:
            return None
        align = ctx.row_align if all(v % ctx.row_align == 0 for v in (in_f, *widths)) else 1
        key = ("fill_columns", in_f, mods, widths, dtype)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)

        def make():
            func, mods_ = fill_wrapper(in_f, widths, mods, ctx.num_layers, ctx.max_rank, ctx.num_modules, dtype,
                                       align, str(ctx.target.arch))
            for i, mod in enumerate(mods_):
                ctx.external(key + ("module", i), lambda mod=mod: mod)
            return func

        return ctx.kernel(key, f"lora_fill_columns_m{tag}_{in_f}x{sum(widths)}", make)

    @staticmethod
    def counters():
        """The split tiles' counters of one function (emit it once, before its first linear)."""
        from tvm import relax  # pylint: disable=import-outside-toplevel

        return relax.op.zeros(relax.ShapeExpr([COUNTER_SLOTS]), "int32")


FUSED = FusedLinear()
