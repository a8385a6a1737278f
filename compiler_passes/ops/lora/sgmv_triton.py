"""Stage 3 (`sgmv`) on tensor cores: Triton shrink/expand kernels over the pool's arena, built to
cubin at compile time (no GPU needed) and launched from TIR wrappers like the CUDA C++ stage.

Tokens are taken in the order the pool sorted them by slot (`lora_token_order`; slot s owns the
sorted positions `lora_slot_start[s] .. lora_slot_start[s + 1]`), so one thread block works on
one slot and up to BM of its tokens with every rank row of the adapter at once (RB = the compiled
max rank rounded up to a power of two >= 16; rows past the slot's rank are masked, never read).
The shrink splits the input into splits of whole BK steps: each work item multiplies its x tile by
the A rows of its split on tensor cores (`tl.dot`) and stores fp32 partial sums; the expand sums
the partials of its tile once and adds h @ B^T into a group of output tiles of BN columns in turn.
A batch takes C = num_chunks splits and groups of G output tiles, or, when its tiles are too few to
fill the GPU, more splits (up to most_chunks) and smaller groups (down to GMIN): both kernels derive
the batch's split count from the tile table alike (`splits_for`, `groups_for`), so the grid stays
static. One shrink and one in-place expand cover every part of a fused linear (q|k|v, gate|up).

Semantics (p a sorted position, t = order[p], s its slot, m = mods[part] >= 0, k < rank[s],
scale[s, m] != 0; C = splits_for(the batch's tiles, ..) splits of CHUNK = ceil(steps / C) x BK
input elements):
  shrink: v[p, part, c, k] = scale[s, m] * sum_{i in split c} x[t, i] * A[s, m][k, i]
          (A[s, m][k] = arena[base + a_off[s, m, k] : + in]); entries of other positions are
          never read.
  expand: y[t, o_part + j] += sum_k (sum_c v[p, part, c, k]) * B^T[s, m][k, j]   in place
          (B^T[s, m][k] = arena[base + b_off[s, m, k] : + w_part], o_part = sum of earlier widths;
          the sum over c is rounded to the model dtype before the product, as PEFT rounds lora_A's
          output); rows of base-model tokens and parts no adapter module covers are left alone.
  tiles: the batch's tiles of BM sorted positions, each of one slot, slot after slot:
          [total, (slot, first position, end position) per tile] (BM of the tile variant for n).
References: `shrink_ref` / `expand_ref` / `tiles_ref` below.

The tile table is laid out once per function call (per batch) by `lora_tiles_kernel`, before the
first linear, and read by every shrink and expand (a block loads its tile's three ints instead of
finding it in the slot table with a prefix sum and three reductions over it).

Grid (static for CUDA graphs; a function of the token count and the table sizes only): x =
ceil(n / BM) + min(n, S, GRID_SLOTS) blocks over the batch's tiles (every slot's tokens in tiles of
BM; there are at most ceil(n / BM) + min(n, S) of them), y = num_chunks x parts (shrink) or groups
of G output tiles over all parts (expand); the batch's work items (tile, split) per part, or (tile,
group), are dealt over the blocks in turn (so a table sized for many slots launches no idle blocks
when few are used, many used slots are still all covered, and few tiles take more blocks). Three tile variants are built (VARIANTS): BM = 16 with 16 or 8 splits for n <=
TINY_MAX_TOKENS and n <= SMALL_MAX_TOKENS (decode batches: many slots of few tokens), BM = 64 above
(prefill) unless the batch's slots average fewer than SMALL_SLOT_TOKENS tokens (then BM = 16:
outside CUDA graphs the slot table is the batch's own, so its length counts the adapters); the
launch wrappers branch on n and the slot table's length alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from mlc_lora.contract import INT8_ROW_ALIGN

from .. import triton_build
from ..kernel_attrs import kernel_attrs
from .reference import sort_tokens_ref  # noqa: F401  (the pool's token order)
from .stage import MAX_PARTS, LoraContext, LoraStage, Part, layer_arg, tokens

try:  # the kernels are written in Triton; compiling them needs it, nothing else in mlc-lora does
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

TINY_MAX_TOKENS, SMALL_MAX_TOKENS = 16, 256
# past SMALL_MAX_TOKENS, `small` still where the batch's slots average fewer tokens than this: 64-row
# tiles of few tokens each waste their rows (1024 tokens over 64 adapters: 16-row tiles 10-20% faster)
SMALL_SLOT_TOKENS = 32
GRID_SLOTS = 64  # blocks for the slots' partial tiles (past ceil(n / BM)); more tiles loop over them
TILE_BLOCK = 64  # tiles the tile kernel lays out per block
# tile configurations, by token count (tiny: n <= TINY_MAX_TOKENS, small: n <= SMALL_MAX_TOKENS,
# large above): tokens per block, input splits (at most), output columns per tile, output tiles per
# expand block, warps and pipeline stages of both kernels; RSPLIT (default 1) splits the shrink's
# rank rows over that many blocks (more blocks without more partial sums for the expand to read);
# BK (default BK below) the shrink's input elements per dot step; MIN_STEPS and GMIN: below.
# Picked by measurement against each other and the peers (docs/SGMV.md): few tokens need more
# splits to spread the A rows over the SMs.
VARIANTS = {
    "tiny": dict(BM=16, SPLITS=16, BN=64, G=2, num_warps=4, num_stages=3, MIN_STEPS=8, GMIN=1),
    "small": dict(BM=16, SPLITS=8, BN=128, G=4, num_warps=4, num_stages=3, BK=128, MIN_STEPS=4, GMIN=1),
    "large": dict(BM=64, SPLITS=4, BN=128, G=4, num_warps=4, num_stages=3, BK=128),
}
BK = 64  # the shrink's input elements per dot step, where a variant does not set its own
# A batch of few tiles (few tokens over few adapters) leaves most of the static grid idle: while its
# work items (tiles x splits x parts of the shrink, tiles x output groups of the expand) number fewer
# than FILL_BLOCKS, the kernels take more splits (down to MIN_STEPS dot steps each; a variant
# without MIN_STEPS keeps SPLITS) and smaller output groups (down to GMIN tiles; default G). Both
# kernels derive the batch's split count from the tile table's total alike (splits_for).
FILL_BLOCKS = 264  # two blocks on each of the 132 SMs of an H100 / H200
DTYPES = {"float16": "fp16", "bfloat16": "bf16"}
MAX_RANK = 128


def step_elems(variant: str, cfg: dict | None = None) -> int:
    """The shrink's input elements per dot step in tile variant `variant` (cfg as num_chunks')."""
    return (cfg or VARIANTS[variant]).get("BK", BK)


def _evened(steps: int, want: int) -> int:
    """The split count of at most `want` (>= 1) splits of whole steps, none empty."""
    return -(-steps // -(-steps // min(want, steps)))


def num_chunks(in_f: int, variant: str, cfg: dict | None = None) -> int:
    """C: the input's splits (of whole dot steps, none empty) in tile variant `variant` (cfg: its
    VARIANTS entry, or another configuration)."""
    return _evened(-(-in_f // step_elems(variant, cfg)), (cfg or VARIANTS[variant])["SPLITS"])


def _groups_per_tile(widths, bn: int, g: int) -> int:
    """The expand's work items per tile over all parts: groups of g output tiles of bn columns."""
    return sum(-(-(-(-w // bn)) // g) for w in widths)


def most_chunks(in_f: int, variant: str, cfg: dict | None = None) -> int:
    """CMAX: the most splits a batch of few tiles takes in tile variant `variant` (splits of at least
    MIN_STEPS dot steps, never fewer than num_chunks); the stride of the scratch v's split axis."""
    cfg = cfg or VARIANTS[variant]
    steps = -(-in_f // step_elems(variant, cfg))
    most = steps // cfg["MIN_STEPS"] if cfg.get("MIN_STEPS") else 0
    return max(num_chunks(in_f, variant, cfg), _evened(steps, max(most, 1)))


def splits_for(total: int, in_f: int, variant: str, units: int, cfg: dict | None = None) -> int:
    """The splits both kernels take for a batch of `total` tiles (the device code's rule,
    `_splits`): num_chunks, raised while total x splits x units (the shrink's blocks per tile and
    split: active parts x rank blocks) falls short of FILL_BLOCKS, at most most_chunks, evened."""
    steps = -(-in_f // step_elems(variant, cfg))
    c, cmax = num_chunks(in_f, variant, cfg), most_chunks(in_f, variant, cfg)
    want = min(max(-(-FILL_BLOCKS // (max(total, 1) * units)), c), cmax)
    return _evened(steps, want)


def groups_for(total: int, widths, variant: str, cfg: dict | None = None) -> int:
    """The output tiles per expand work item for a batch of `total` tiles (the device code's rule):
    G, halved while total x groups over all parts falls short of FILL_BLOCKS, at least GMIN."""
    cfg = cfg or VARIANTS[variant]
    g, bn = cfg["G"], cfg["BN"]
    while g > cfg.get("GMIN", cfg["G"]) and total * _groups_per_tile(widths, bn, g) < FILL_BLOCKS:
        g //= 2
    return g


def max_chunks(in_f: int) -> int:
    """The splits the scratch v is sized for: the most of any tile variant."""
    return max(most_chunks(in_f, var) for var in VARIANTS)


def chunk_elems(in_f: int, variant: str, cfg: dict | None = None) -> int:
    """Input elements per split (the last split may be shorter)."""
    bk = step_elems(variant, cfg)
    steps = -(-in_f // bk)
    return -(-steps // num_chunks(in_f, variant, cfg)) * bk


def rank_block(max_rank: int) -> int:
    """RB: the rank rows every block multiplies at once (tl.dot needs >= 16)."""
    return max(16, 1 << (max_rank - 1).bit_length())


def supported(dtype: str, max_rank: int, num_parts: int = 1) -> str | None:
    """None when these kernels can run stage 3 of a model, else why not."""
    if triton is None:
        return "triton is not installed (pip install triton==3.6.0, as mlc-lora's cuda extra does)"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if not 1 <= max_rank <= MAX_RANK:
        return f"max rank {max_rank} (the kernels are built for 1..{MAX_RANK})"
    if not 1 <= num_parts <= MAX_PARTS:
        return f"a linear of {num_parts} parts (the kernels take 1..{MAX_PARTS})"
    return None


# ---------------------------------------------------------------------------------------------
# numpy references


def tiles_ref(slot_start, bm: int) -> np.ndarray:
    """Semantics of the tile table: [total, then (slot, first position, end position) per tile],
    each slot's sorted positions in tiles of bm, slot after slot (entries past them unwritten)."""
    out = []
    for s in range(len(slot_start) - 1):
        for p0 in range(int(slot_start[s]), int(slot_start[s + 1]), bm):
            out += [s, p0, int(slot_start[s + 1])]
    return np.array([len(out) // 3] + out, np.int32)


def shrink_ref(x, arena, base, order, slot_start, rank, scale, a_off, mods, max_rank, chunk):
    """Semantics of the shrink; returns v (n, P, C, R) float32 (zeros where nothing is written)."""
    n, in_f = x.shape
    C = -(-in_f // chunk)
    v = np.zeros((n, len(mods), C, max_rank), np.float32)
    for s in range(len(slot_start) - 1):
        for p in range(slot_start[s], slot_start[s + 1]):
            t = order[p]
            for part, m in enumerate(mods):
                if m < 0 or scale[s, m] == 0:
                    continue
                for k in range(rank[s]):
                    a = arena[base + a_off[s, m, k]: base + a_off[s, m, k] + in_f].astype(np.float64)
                    prod = x[t].astype(np.float64) * a
                    for c in range(C):
                        v[p, part, c, k] = scale[s, m] * prod[c * chunk:(c + 1) * chunk].sum()
    return v


def expand_ref(y, v, arena, base, order, slot_start, rank, scale, b_off, mods, widths):
    """Semantics of the expand; returns the updated y in float64."""
    out = y.astype(np.float64)
    for s in range(len(slot_start) - 1):
        for p in range(slot_start[s], slot_start[s + 1]):
            t = order[p]
            o = 0
            for part, (m, w) in enumerate(zip(mods, widths)):
                if m >= 0 and scale[s, m] != 0:
                    h = v[p, part].astype(np.float64).sum(0)
                    for k in range(rank[s]):
                        b = arena[base + b_off[s, m, k]: base + b_off[s, m, k] + w].astype(np.float64)
                        out[t, o:o + w] += h[k] * b
                o += w
    return out


# ---------------------------------------------------------------------------------------------
# the kernels

def _kernel_name(kind: str):
    return triton_build.kernel_namer(f"mlc_lora_triton_{kind}", "arena_ptr")


if triton is not None:

    @triton.jit
    def _slot_tiles(start_ptr, S, BM: tl.constexpr, SP: tl.constexpr):
        """The batch's tiles of BM sorted positions, each of one slot: per slot (padded to SP) its
        first and end position, its number of tiles and the end of its tile numbers; and the total."""
        ss = tl.arange(0, SP)
        lo = tl.load(start_ptr + ss, mask=ss < S, other=0)
        hi = tl.load(start_ptr + ss + 1, mask=ss < S, other=0)
        ntiles = (hi - lo + BM - 1) // BM
        tend = tl.cumsum(ntiles, axis=0)
        return lo, hi, ntiles, tend, tl.sum(ntiles, axis=0)

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_tiles", "start_ptr"))
    def lora_tiles_kernel(start_ptr, tiles_ptr, S, BM: tl.constexpr, SP: tl.constexpr, TB: tl.constexpr):
        """Block b: tiles b * TB .. b * TB + TB - 1 of the batch (each slot's sorted positions in
        tiles of BM, slot after slot): tiles[1 + 3 t ..] = (slot, first position, end position)
        for t < the total, which block 0 stores in tiles[0]."""
        triton_build.wait_for_producers()
        lo, hi, ntiles, tend, total = _slot_tiles(start_ptr, S, BM, SP)
        if tl.program_id(0) == 0:
            tl.store(tiles_ptr, total)
        t = tl.program_id(0) * TB + tl.arange(0, TB)
        s = tl.sum((tend[None, :] <= t[:, None]).to(tl.int32), axis=1)
        pick = tl.arange(0, SP)[None, :] == s[:, None]
        tstart = tl.sum(tl.where(pick, (tend - ntiles)[None, :], 0), axis=1)
        p0 = tl.sum(tl.where(pick, lo[None, :], 0), axis=1) + (t - tstart) * BM
        p1 = tl.sum(tl.where(pick, hi[None, :], 0), axis=1)
        ok = t < total
        tl.store(tiles_ptr + 1 + 3 * t, s, mask=ok)
        tl.store(tiles_ptr + 2 + 3 * t, p0, mask=ok)
        tl.store(tiles_ptr + 3 + 3 * t, p1, mask=ok)

    @triton.jit
    def _tile_at(tiles_ptr, t):
        """(slot, first sorted position, end position) of tile t of the table."""
        return tl.load(tiles_ptr + 1 + 3 * t), tl.load(tiles_ptr + 2 + 3 * t), tl.load(tiles_ptr + 3 + 3 * t)

    @triton.jit
    def _splits(total, C: tl.constexpr, CMAX: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr,
                FILL: tl.constexpr):
        """The batch's input splits (splits_for): C, raised while the shrink's work items (total
        tiles x splits x UNITS) fall short of FILL, at most CMAX, evened so that none is empty."""
        want = tl.minimum(tl.maximum((FILL + tl.maximum(total, 1) * UNITS - 1) // (tl.maximum(total, 1) * UNITS), C),
                          CMAX)
        per = (STEPS + want - 1) // want
        return (STEPS + per - 1) // per

    @triton.jit
    def _groups(w0: tl.constexpr, w1: tl.constexpr, w2: tl.constexpr, g, BN: tl.constexpr):
        """Work items per tile of each part for groups of g output tiles of BN columns."""
        return ((w0 + BN - 1) // BN + g - 1) // g, ((w1 + BN - 1) // BN + g - 1) // g, ((w2 + BN - 1) // BN + g - 1) // g

    @triton.jit
    def _row_ptrs(arena_ptr, base, off, kmask, Q8: tl.constexpr, LEAD: tl.constexpr):
        """(pointers to the first values of the rows at element offsets `off` of the layer at `base`,
        their scales): the model-dtype rows and scales of 1, or (Q8) int8 rows and their float32
        scales, LEAD bytes before the values (contract.INT8_ROW_ALIGN)."""
        elem = base + off.to(tl.int64)
        if Q8:  # (a constexpr branch: one return, of either type)
            eb: tl.constexpr = arena_ptr.dtype.element_ty.primitive_bitwidth // 8
            at = tl.multiple_of(elem * eb, LEAD)
            rows = arena_ptr.to(tl.pointer_type(tl.int8)) + at
            sc = tl.load((rows - LEAD).to(tl.pointer_type(tl.float32)), mask=kmask, other=0.0)
        else:
            rows = arena_ptr + elem
            sc = tl.full(off.shape, 1.0, tl.float32)
        return rows, sc

    @triton.jit
    def _int8_values(q, dtype: tl.constexpr):
        """int8 values q as `dtype`, exactly. float16 without an int-to-float conversion (a quarter-rate
        instruction a value, which bounded the first int8 kernels): q + 128 (the byte with its top
        bit flipped) in the mantissa of 1024.0 (0x6400: the float16 of 1024 + n for n < 1024), less
        1152.0; bfloat16 (7 mantissa bits) by conversion."""
        if dtype == tl.float16:
            u = (q.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16) | 0x6400
            out = u.to(tl.float16, bitcast=True) - 1152.0
        else:
            out = q.to(dtype)
        return out

    @triton.jit(repr=_kernel_name("shrink"))
    def lora_shrink_kernel(x_ptr, arena_ptr, order_ptr, tiles_ptr, rank_ptr, scale_ptr, aoff_ptr, v_ptr,
                           n, base, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr,
                           C: tl.constexpr, CMAX: tl.constexpr, UNITS: tl.constexpr, FILL: tl.constexpr,
                           P: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                           RB: tl.constexpr, RS: tl.constexpr, ALIGN: tl.constexpr, Q8: tl.constexpr,
                           LEAD: tl.constexpr):
        """Work item (tile of BM sorted positions of one slot, split c of the input's BK steps) of
        (part, rank block rb of RS): v[tile, part, c, rank rows of rb] = scale * x[tile] @ A[those
        rows, split].T (RS = 1: every rank row at once). The batch's splits (_splits) are spread
        with its tiles over the C x grid-x blocks of each (part, rb). Q8: the rows are int8 with
        their float32 scales LEAD bytes before them (_row_ptrs): x[tile] @ q.T, then times the
        rows' scales."""
        triton_build.wait_for_producers()
        RBS: tl.constexpr = RB // RS  # rank rows per block: the rank block rb of RS
        rb = tl.program_id(1) % RS
        pid_c = (tl.program_id(1) // RS) % C
        part = tl.program_id(1) // (RS * C)
        m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
        if m < 0:
            return
        total = tl.load(tiles_ptr)
        steps: tl.constexpr = (K + BK - 1) // BK
        cd = _splits(total, C, CMAX, steps, UNITS, FILL)
        per = (steps + cd - 1) // cd
        kk = rb * RBS + tl.arange(0, RBS)
        gx = tl.num_programs(0)
        for w in range(pid_c * gx + tl.program_id(0), total * cd, C * gx):
            t = w % total
            c = w // total
            s, p0, p1 = _tile_at(tiles_ptr, t)
            sc = tl.load(scale_ptr + s * M + m)
            r_s = tl.load(rank_ptr + s)
            if (sc != 0.0) & (rb * RBS < r_s):
                pos = p0 + tl.arange(0, BM)
                rmask = pos < p1
                tok = tl.load(order_ptr + pos, mask=rmask, other=0).to(tl.int64)
                kmask = kk < r_s
                aoff = tl.multiple_of(tl.load(aoff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
                xp = x_ptr + tok[:, None] * K + tl.arange(0, BK)[None, :]
                ap, asc = _row_ptrs(arena_ptr, base, aoff, kmask, Q8, LEAD)
                ap = ap[None, :] + tl.arange(0, BK)[:, None]
                acc = tl.zeros((BM, RBS), dtype=tl.float32)
                st0 = c * per
                for st in range(st0, tl.minimum(st0 + per, steps)):
                    i0 = st * BK
                    if K % BK == 0:
                        xt = tl.load(xp + i0, mask=rmask[:, None], other=0.0)
                        at = tl.load(ap + i0, mask=kmask[None, :], other=0.0)
                    else:
                        imask = i0 + tl.arange(0, BK) < K
                        xt = tl.load(xp + i0, mask=rmask[:, None] & imask[None, :], other=0.0)
                        at = tl.load(ap + i0, mask=kmask[None, :] & imask[:, None], other=0.0)
                    if Q8:  # int8 -> the model dtype, exact (|q| <= 127); the rows' scales after the loop
                        at = _int8_values(at, x_ptr.dtype.element_ty)
                    acc += tl.dot(xt, at)
                vptr = v_ptr + ((pos[:, None].to(tl.int64) * P + part) * CMAX + c) * R + kk[None, :]
                if Q8:
                    acc = acc * asc[None, :]
                tl.store(vptr, acc * sc, mask=rmask[:, None] & kmask[None, :])

    @triton.jit(repr=_kernel_name("expand"))
    def lora_expand_kernel(v_ptr, arena_ptr, order_ptr, tiles_ptr, rank_ptr, scale_ptr, boff_ptr, y_ptr,
                           n, base, C: tl.constexpr, CMAX: tl.constexpr, UNITS: tl.constexpr, STEPS: tl.constexpr,
                           FILL: tl.constexpr, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr,
                           m2: tl.constexpr, w0: tl.constexpr, w1: tl.constexpr, w2: tl.constexpr, P: tl.constexpr,
                           W: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                           GMIN: tl.constexpr, RB: tl.constexpr, ALIGN: tl.constexpr, Q8: tl.constexpr,
                           LEAD: tl.constexpr):
        """Work item (tile of BM sorted positions of one slot, group of gd output tiles of BN of a
        part): h = sum_c v[tile, part, c] once, then y[tile, cols] += h @ B^T[:rank, cols] per
        output tile. gd = G, halved down to GMIN while the batch's items (total tiles x groups)
        fall short of FILL (groups_for); the items are spread over all blocks of the grid. Q8: the
        rows are int8 with their float32 scales LEAD bytes before them (_row_ptrs): h times the
        rows' scales, rounded, @ q."""
        triton_build.wait_for_producers()
        total = tl.load(tiles_ptr)
        cd = _splits(total, C, CMAX, STEPS, UNITS, FILL)  # the shrink's splits of this batch
        gd = G
        a0, a1, a2 = _groups(w0, w1, w2, gd, BN)
        while (gd > GMIN) & (total * (a0 + a1 + a2) < FILL):
            gd = gd // 2
            a0, a1, a2 = _groups(w0, w1, w2, gd, BN)
        ng = a0 + a1 + a2
        gx = tl.num_programs(0)
        kk = tl.arange(0, RB)
        for w in range(tl.program_id(1) * gx + tl.program_id(0), total * ng, gx * tl.num_programs(1)):
            t = w % total
            q = w // total
            part = tl.where(q < a0, 0, tl.where(q < a0 + a1, 1, 2))
            m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
            s, p0, p1 = _tile_at(tiles_ptr, t)
            sc = tl.load(scale_ptr + s * M + tl.maximum(m, 0))
            if (m >= 0) & (sc != 0.0):
                width = tl.where(part == 0, w0, tl.where(part == 1, w1, w2))
                o_p = tl.where(part == 0, 0, tl.where(part == 1, w0, w0 + w1))
                grp = q - tl.where(part == 0, 0, tl.where(part == 1, a0, a0 + a1))
                r_s = tl.load(rank_ptr + s)
                pos = p0 + tl.arange(0, BM)
                rmask = pos < p1
                tok = tl.load(order_ptr + pos, mask=rmask, other=0).to(tl.int64)
                kmask = kk < r_s
                vptr = v_ptr + (pos[:, None].to(tl.int64) * P + part) * (CMAX * R) + kk[None, :]
                h = tl.zeros((BM, RB), dtype=tl.float32)
                for c in tl.static_range(CMAX):  # unrolled: the loads go out together
                    h += tl.load(vptr + c * R, mask=rmask[:, None] & kmask[None, :] & (c < cd), other=0.0)
                if not Q8:
                    hh = h.to(arena_ptr.dtype.element_ty)  # rounded once, as PEFT rounds lora_A's output
                boff = tl.multiple_of(tl.load(boff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
                bp, bsc = _row_ptrs(arena_ptr, base, boff, kmask, Q8, LEAD)
                bp = bp[:, None]
                if Q8:  # the B rows' scales on h's rank columns, then rounded (the rows' int8 values in the dot)
                    hh = (h * bsc[None, :]).to(arena_ptr.dtype.element_ty)
                yp = y_ptr + tok[:, None] * W + o_p
                for g in range(gd):
                    cols = (grp * gd + g) * BN + tl.arange(0, BN)
                    cmask = cols < width
                    bt = tl.load(bp + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
                    if Q8:
                        bt = _int8_values(bt, hh.dtype)
                    acc = tl.dot(hh, bt)
                    ymask = rmask[:, None] & cmask[None, :]
                    yv = tl.load(yp + cols[None, :], mask=ymask, other=0.0)
                    tl.store(yp + cols[None, :], (yv.to(tl.float32) + acc).to(yv.dtype), mask=ymask)


# ---------------------------------------------------------------------------------------------
# building the kernels (cubin for the target's arch, no GPU needed) and launching them from TIR

def _signature(kind: str, dtype: str) -> dict:
    if kind == "tiles":
        return {"start_ptr": "*i32", "tiles_ptr": "*i32", "S": "i32", "BM": "constexpr", "SP": "constexpr",
                "TB": "constexpr"}
    e = triton_build.PTR[dtype]
    if kind == "shrink":
        ptrs = dict(x_ptr=e, arena_ptr=e, order_ptr="*i32", tiles_ptr="*i32", rank_ptr="*i32",
                    scale_ptr="*fp32", aoff_ptr="*i32", v_ptr="*fp32")
        consts = ["M", "m0", "m1", "m2", "C", "CMAX", "UNITS", "FILL", "P", "K", "R", "BM", "BK", "RB", "RS",
                  "ALIGN", "Q8", "LEAD"]
    else:
        ptrs = dict(v_ptr="*fp32", arena_ptr=e, order_ptr="*i32", tiles_ptr="*i32", rank_ptr="*i32",
                    scale_ptr="*fp32", boff_ptr="*i32", y_ptr=e)
        consts = ["C", "CMAX", "UNITS", "STEPS", "FILL", "M", "m0", "m1", "m2", "w0", "w1", "w2", "P", "W", "R",
                  "BM", "BN", "G", "GMIN", "RB", "ALIGN", "Q8", "LEAD"]
    sig = dict(ptrs)
    sig.update({"n": "i32", "base": "i64"})
    sig.update({k: "constexpr" for k in consts})
    return sig


def _module(kind: str, dtype: str, consts: dict, cfg: dict, arch: str):
    """(name, launch threads, dynamic shared bytes, TVM CUDA module) of one kernel variant."""
    fn = lora_shrink_kernel if kind == "shrink" else lora_expand_kernel
    return triton_build.cuda_module(fn, _signature(kind, dtype), consts, cfg["num_warps"], arch, Path(__file__),
                                    num_stages=cfg["num_stages"])


def _slot_pad(max_slots: int) -> int:
    return 1 << max(4, (max_slots - 1).bit_length())


def constants(kind: str, var: str, in_f: int, mods, widths, max_rank: int, num_modules: int, max_slots: int,
              align: int, cfg: dict | None = None, rows: str = "model") -> tuple[dict, int]:
    """(the compile-time constants, blocks along y) of the shrink or expand kernel of tile variant
    `var` (cfg: its VARIANTS entry, or another configuration to try) for a linear of parts `mods`
    (widths: the parts' widths, for the expand) over rows stored as `rows` (contract.ROW_FORMATS)."""
    cfg = cfg or VARIANTS[var]
    q8 = dict(Q8=int(rows == "int8"), LEAD=INT8_ROW_ALIGN)
    M, R, P, RB = num_modules, max_rank, len(mods), rank_block(max_rank)
    m0, m1, m2 = (list(mods) + [-1] * MAX_PARTS)[:MAX_PARTS]
    c, bk = num_chunks(in_f, var, cfg), step_elems(var, cfg)
    rs = max(1, min(cfg.get("RSPLIT", 1), RB // 16))  # rank blocks of >= 16 rows (tl.dot), a power of 2
    rs = 1 << (rs.bit_length() - 1)
    # what both kernels need to derive the batch's splits alike (splits_for)
    dyn = dict(C=c, CMAX=most_chunks(in_f, var, cfg), UNITS=rs * max(1, sum(m >= 0 for m in mods)), FILL=FILL_BLOCKS)
    if kind == "shrink":
        return dict(M=M, m0=m0, m1=m1, m2=m2, **dyn, P=P, K=in_f, R=R, BM=cfg["BM"], BK=bk, RB=RB, RS=rs,
                    ALIGN=align, **q8), c * P * rs
    w0, w1, w2 = (list(widths) + [0] * MAX_PARTS)[:MAX_PARTS]
    consts = dict(**dyn, STEPS=-(-in_f // bk), M=M, m0=m0, m1=m1, m2=m2, w0=w0, w1=w1, w2=w2, P=P, W=sum(widths),
                  R=R, BM=cfg["BM"], BN=cfg["BN"], G=cfg["G"], GMIN=min(cfg.get("GMIN", cfg["G"]), cfg["G"]), RB=RB,
                  ALIGN=align, **q8)
    return consts, _groups_per_tile(widths, cfg["BN"], cfg["G"])


def variant_kernel(kind: str, var: str, in_f: int, mods, widths, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str, rows: str = "model"):
    """(name, launch threads, dynamic shared bytes, TVM CUDA module, blocks along y) of the shrink
    or expand kernel of tile variant `var` for a linear (widths: the parts' widths, for the expand)."""
    consts, grid_y = constants(kind, var, in_f, mods, widths, max_rank, num_modules, max_slots, align, rows=rows)
    return (*_module(kind, dtype, consts, VARIANTS[var], arch), grid_y)


def tile_table_len(n):
    """The tile table's length for n tokens: the total and 3 ints per tile, of which a batch has at
    most 2n (ceil(n / BM) + min(n, slots)); a function of n alone, so that a captured CUDA graph's
    buffers depend on the batch size only (n: an int or a TIR/Relax expression)."""
    return 1 + 6 * n


def tiles_constants(var: str, max_slots: int, cfg: dict | None = None) -> dict:
    """The tile kernel's constants for tile variant `var` (cfg: another configuration to try)."""
    return dict(BM=(cfg or VARIANTS[var])["BM"], SP=_slot_pad(max_slots), TB=TILE_BLOCK)


def tiles_grid(n, slots, bm: int, minimum=min):
    """The tile kernel's blocks: the batch's tiles (at most ceil(n / bm) + min(n, slots)) in blocks
    of TILE_BLOCK (minimum: min, or T.min for TIR expressions)."""
    return ((n + bm - 1) // bm + minimum(n, slots) + TILE_BLOCK - 1) // TILE_BLOCK


def variant_for(n: int, slots: int | None = None) -> str:
    """The tile variant the launch wrappers run for n tokens over a slot table of `slots` slots
    (the batch's own outside CUDA graphs; None: as many as tokens)."""
    if n <= TINY_MAX_TOKENS:
        return "tiny"
    return "small" if n <= SMALL_MAX_TOKENS or _small_past(n, (n if slots is None else slots) + 1) else "large"


def _small_past(n, cap1):
    """The condition under which `small` runs past SMALL_MAX_TOKENS (cap1: the slot table's entries,
    its slots + 1), for Python ints (variant_for) and TIR expressions (the three wrappers) alike."""
    return n < SMALL_SLOT_TOKENS * (cap1 - 1)


def grid_x(n, slots, bm: int, minimum=min):
    """Blocks along x for n tokens over a slot table of `slots` slots, tiles of bm tokens: a block
    per bm tokens plus one per slot up to GRID_SLOTS (minimum: min, or T.min for TIR expressions)."""
    return (n + bm - 1) // bm + minimum(minimum(n, slots), GRID_SLOTS)


def launch(var: str, kernel: tuple, n, cap1, base) -> tuple:
    """The arguments after the pointers (n, base) and the launch (grid x, y, z, threads, shared
    bytes) of `kernel` (variant_kernel's tuple for tile variant `var`) over n tokens sorted by slot,
    slot_start of cap1 entries and the layer's arena offset `base` (TIR expressions): x = a block per
    BM tokens plus one per slot up to GRID_SLOTS (a slot's last tile may be partial)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    _, threads, shared, _, grid_y = kernel
    bm = VARIANTS[var]["BM"]
    return (T.Cast("int32", n), base, T.int64(0), T.int64(0), T.Cast("int32", grid_x(n, cap1 - 1, bm, T.min)),
            grid_y, threads, shared)


def shrink_wrapper(in_f: int, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str, rows: str = "model"):
    """(TIR wrapper, CUDA modules). Signature: (x (n, in_f), arena (size,), order (n,) int32,
    slot_start (cap + 1,) int32, tiles (>= tile_table_len(n),) int32 (tiles_wrapper's),
    rank (S,), scale (S, M), a_off (S, M, R), layer: int64, v (n, P, C, R) float32 [out]); part p
    is module mods[p] (-1: none), C >= max_chunks(in_f) (each variant uses the first
    most_chunks(in_f, variant) x R floats of a position's part)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    R, M, L, P, SP = max_rank, num_modules, num_layers, len(mods), _slot_pad(max_slots)
    C = max_chunks(in_f)  # the least the scratch holds
    built = {var: variant_kernel("shrink", var, in_f, mods, None, R, M, dtype, max_slots, align, arch, rows)
             for var in VARIANTS}
    tn, sn, ln = built["tiny"][0], built["small"][0], built["large"][0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def lora_shrink_triton(x_h: T.handle, arena_h: T.handle, order_h: T.handle, start_h: T.handle,
                           tiles_h: T.handle, rank_h: T.handle, scale_h: T.handle, aoff_h: T.handle, layer: T.int64,
                           v_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, cap1, cs, nt = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, in_f), dtype)
        arena = T.match_buffer(arena_h, (size,), dtype)
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        tiles = T.match_buffer(tiles_h, (nt,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        a_off = T.match_buffer(aoff_h, (S, M, R), "int32")
        v = T.match_buffer(v_h, (n, P, cs, R), "float32")
        assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
        assert nt >= tile_table_len(n), "the LoRA tile table is too short for the batch"
        assert cs >= C, "the LoRA scratch v holds fewer splits than the kernels write"
        if n > 0:
            if n <= TINY_MAX_TOKENS:
                T.call_packed(tn, x.data, arena.data, order.data, tiles.data, rank.data, scale.data, a_off.data,
                              v.data, *launch("tiny", built["tiny"], n, cap1, layer * (size // L)))
            elif n <= SMALL_MAX_TOKENS or _small_past(n, cap1):
                T.call_packed(sn, x.data, arena.data, order.data, tiles.data, rank.data, scale.data, a_off.data,
                              v.data, *launch("small", built["small"], n, cap1, layer * (size // L)))
            else:
                T.call_packed(ln, x.data, arena.data, order.data, tiles.data, rank.data, scale.data, a_off.data,
                              v.data, *launch("large", built["large"], n, cap1, layer * (size // L)))

    return lora_shrink_triton, [b[3] for b in built.values()]


def expand_wrapper(in_f: int, widths, mods, num_layers: int, max_rank: int, num_modules: int, dtype: str,
                   max_slots: int, align: int, arch: str, rows: str = "model"):
    """(TIR wrapper, CUDA modules). Signature: (v (n, P, C, R) float32, arena (size,), order (n,),
    slot_start (cap + 1,), tiles (as the shrink's), rank (S,), scale (S, M), b_off (S, M, R),
    layer: int64, y (n, W) [in place]); W = sum(widths), part p = module mods[p], C >=
    max_chunks(in_f) as the shrink's."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    R, M, L, P, SP, W = max_rank, num_modules, num_layers, len(mods), _slot_pad(max_slots), sum(widths)
    C = max_chunks(in_f)  # the least the scratch holds
    built = {var: variant_kernel("expand", var, in_f, mods, widths, R, M, dtype, max_slots, align, arch, rows)
             for var in VARIANTS}
    tn, sn, ln = built["tiny"][0], built["small"][0], built["large"][0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def lora_expand_triton(v_h: T.handle, arena_h: T.handle, order_h: T.handle, start_h: T.handle,
                           tiles_h: T.handle, rank_h: T.handle, scale_h: T.handle, boff_h: T.handle, layer: T.int64,
                           y_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, S, size, cap1, cs, nt = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        v = T.match_buffer(v_h, (n, P, cs, R), "float32")
        arena = T.match_buffer(arena_h, (size,), dtype)
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        tiles = T.match_buffer(tiles_h, (nt,), "int32")
        rank = T.match_buffer(rank_h, (S,), "int32")
        scale = T.match_buffer(scale_h, (S, M), "float32")
        b_off = T.match_buffer(boff_h, (S, M, R), "int32")
        y = T.match_buffer(y_h, (n, W), dtype)
        assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
        assert nt >= tile_table_len(n), "the LoRA tile table is too short for the batch"
        assert cs >= C, "the LoRA scratch v holds fewer splits than the kernels write"
        if n > 0:
            if n <= TINY_MAX_TOKENS:
                T.call_packed(tn, v.data, arena.data, order.data, tiles.data, rank.data, scale.data, b_off.data,
                              y.data, *launch("tiny", built["tiny"], n, cap1, layer * (size // L)))
            elif n <= SMALL_MAX_TOKENS or _small_past(n, cap1):
                T.call_packed(sn, v.data, arena.data, order.data, tiles.data, rank.data, scale.data, b_off.data,
                              y.data, *launch("small", built["small"], n, cap1, layer * (size // L)))
            else:
                T.call_packed(ln, v.data, arena.data, order.data, tiles.data, rank.data, scale.data, b_off.data,
                              y.data, *launch("large", built["large"], n, cap1, layer * (size // L)))

    return lora_expand_triton, [b[3] for b in built.values()]


def tiles_wrapper(max_slots: int, arch: str):
    """(TIR wrapper, CUDA modules). Signature: (order (n,) int32, slot_start (cap + 1,) int32,
    tiles (>= tile_table_len(n),) int32 [out]): the batch's tiles in the tile variant's BM
    for n (the shrink and expand of every linear of the batch read them)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    SP = _slot_pad(max_slots)
    built = {var: triton_build.cuda_module(lora_tiles_kernel, _signature("tiles", ""), tiles_constants(var, max_slots),
                                           4, arch, Path(__file__), num_stages=1) for var in VARIANTS}

    def args(var, n, cap1):  # after the pointers: S, the launch (grid x, y, threads, shared bytes)
        _, threads, shared, _ = built[var]
        return (T.Cast("int32", cap1 - 1), T.int64(0), T.int64(0),
                T.Cast("int32", tiles_grid(n, cap1 - 1, VARIANTS[var]["BM"], T.min)), 1, threads, shared)

    tn, sn, ln = built["tiny"][0], built["small"][0], built["large"][0]

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def lora_tiles_triton(order_h: T.handle, start_h: T.handle, tiles_h: T.handle):
        T.func_attr(kernel_attrs(True))
        n, cap1, nt = T.int64(), T.int64(), T.int64()
        order = T.match_buffer(order_h, (n,), "int32")
        start = T.match_buffer(start_h, (cap1,), "int32")
        tiles = T.match_buffer(tiles_h, (nt,), "int32")
        # a root block: relax's reshape detection reads the body of a function whose buffers
        # share one dtype (here all int32) and expects one
        with T.sblock("root"):
            T.reads(start[0:cap1])
            T.writes(tiles[0:nt])
            assert cap1 - 1 <= SP, "more LoRA slots than the kernels were built for"
            assert nt >= tile_table_len(n), "the LoRA tile table is too short for the batch"
            if n > 0:
                if n <= TINY_MAX_TOKENS:
                    T.call_packed(tn, start.data, tiles.data, *args("tiny", n, cap1))
                elif n <= SMALL_MAX_TOKENS or _small_past(n, cap1):
                    T.call_packed(sn, start.data, tiles.data, *args("small", n, cap1))
                else:
                    T.call_packed(ln, start.data, tiles.data, *args("large", n, cap1))

    return lora_tiles_triton, [b[3] for b in built.values()]


class SgmvTriton(LoraStage):
    """Stage 3 on tensor cores: the Triton shrink and in-place expand per fused linear."""

    stage, backend = "sgmv", "triton"

    def supported(self, target, dtype, max_rank, num_parts, rows="model"):
        if target.kind.name != "cuda":
            return f"target {target.kind.name} (the kernels are CUDA)"
        return supported(dtype, max_rank, num_parts)  # (rows: both formats)

    def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        """y + the deltas of all parts: one shrink (v, before the GEMM) and one expand adding into y
        in place."""
        from tvm import relax  # pylint: disable=import-outside-toplevel  (this module imports with TVM's runtime)

        bb, t, n, R = ctx.builder, tables, tokens(x), ctx.max_rank
        in_f, dtype, L, M = int(x.ty.shape.values[-1]), str(base.ty.dtype), ctx.num_layers, ctx.num_modules
        arch = str(ctx.target.arch)
        mods = tuple(p.module for p in parts)
        widths = tuple(p.width for p in parts)
        key = ("sgmv_triton", in_f, mods, widths, dtype, ctx.rows)
        tag = "_".join(str(m) if m >= 0 else "x" for m in mods)
        align = ctx.row_align if all(w % ctx.row_align == 0 for w in (in_f, *widths)) else 1
        built = {}

        def make(kind):
            if kind not in built:
                built["shrink"] = shrink_wrapper(in_f, mods, L, R, M, dtype, ctx.max_slots, align, arch, ctx.rows)
                built["expand"] = expand_wrapper(in_f, widths, mods, L, R, M, dtype, ctx.max_slots, align, arch,
                                                 ctx.rows)
                for i, m in enumerate(built["shrink"][1] + built["expand"][1]):
                    ctx.external(key + ("module", i), lambda m=m: m)
            return built[kind][0]

        shrink = ctx.kernel(key + ("shrink",), f"lora_sgmv_triton_shrink_m{tag}_{in_f}", lambda: make("shrink"))
        expand = ctx.kernel(key + ("expand",), f"lora_sgmv_triton_expand_m{tag}_{in_f}x{sum(widths)}",
                            lambda: make("expand"))
        order, start = t["lora_token_order"], t["lora_slot_start"]

        def make_tiles():  # the batch's tiles, laid out once per function for all its linears
            func, mods_ = tiles_wrapper(ctx.max_slots, arch)
            for i, m in enumerate(mods_):
                ctx.external(("sgmv_triton_tiles", "module", i), lambda m=m: m)
            return func

        tiles_fn = ctx.kernel(("sgmv_triton_tiles",), "lora_sgmv_triton_tiles", make_tiles)
        tiles = ctx.per_function(("sgmv_triton_tiles",), lambda: bb.emit(relax.call_tir(
            tiles_fn, [order, start], relax.TensorType([tile_table_len(n)], "int32"))))
        common = [t["lora_arena"], order, start, tiles, t["lora_rank"], t["lora_scale"]]
        v = bb.emit(relax.call_tir(shrink, [x, *common, t["lora_a_off"], layer_arg(layer)],
                                   relax.TensorType([n, len(parts), max_chunks(in_f), R], "float32")))
        y = bb.emit(base)
        y2 = bb.emit(relax.op.reshape(y, relax.ShapeExpr([n, sum(widths)])))
        # in place: the GEMM's output takes the deltas (no delta tensor, no add, no concat)
        y2 = bb.emit(relax.call_tir_inplace(expand, [v, *common, t["lora_b_off"], layer_arg(layer), y2], [9],
                                            relax.TensorType([n, sum(widths)], dtype)))
        return relax.op.reshape(y2, y.ty.shape)


STAGE = SgmvTriton()
