"""Experiment: stage 3 (tile-table kernels of main) with the work flattened over the launched grid and
its split count / expand groups chosen on the device from the batch's tile count. Few tiles (few
adapters, few tokens) leave most of the static grid idle today: the shrink runs C splits per tile
whatever the tile count, the expand G output tiles per block. Here each shrink block takes work
items (tile, split) of C_dyn splits, C_dyn = as many as the launched blocks can hold (at least the
variant's C, at most CMAX, whole steps, none empty), and each expand block takes items (tile, group
of G_dyn output tiles), G_dyn in G, G/2, .., 1 the largest that still gives every launched block an
item. The grid is the model's (unchanged); both kernels derive C_dyn from the same numbers.
Registers backends `dyn` (the model's variants) and `dyn-CFG` (TILES_CFGS, as tiles_exp.py) in
bench_lora_kernels and runs its CLI: same process, same method."""
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, "scripts")
import bench_lora_kernels as B  # noqa: E402

ST = B._triton()


@triton.jit
def _c_dyn(total, GX, C: tl.constexpr, CMAX: tl.constexpr, STEPS: tl.constexpr):
    """The splits of this batch: the launched shrink blocks per part (GX * C) over its tiles, at
    least C, at most CMAX and STEPS, then evened so that no split is empty."""
    want = tl.maximum(tl.minimum((GX * C) // tl.maximum(total, 1), CMAX), C)
    want = tl.minimum(want, STEPS)
    per = (STEPS + want - 1) // want
    return (STEPS + per - 1) // per


@triton.jit
def shrink_d(x_ptr, arena_ptr, order_ptr, tiles_ptr, rank_ptr, scale_ptr, aoff_ptr, v_ptr,
             n, base, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr,
             C: tl.constexpr, CMAX: tl.constexpr, P: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
             BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr, ALIGN: tl.constexpr):
    part = tl.program_id(1) // C
    m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
    if m < 0:
        return
    total = tl.load(tiles_ptr)
    GX = tl.num_programs(0)
    steps: tl.constexpr = (K + BK - 1) // BK
    cd = _c_dyn(total, GX, C, CMAX, steps)
    per = (steps + cd - 1) // cd
    b = (tl.program_id(1) % C) * GX + tl.program_id(0)
    kk = tl.arange(0, RB)
    for w in range(b, total * cd, GX * C):
        t = w // cd
        c = w % cd
        s = tl.load(tiles_ptr + 1 + 3 * t)
        p0 = tl.load(tiles_ptr + 2 + 3 * t)
        p1 = tl.load(tiles_ptr + 3 + 3 * t)
        sc = tl.load(scale_ptr + s * M + m)
        r_s = tl.load(rank_ptr + s)
        if sc != 0.0:
            pos = p0 + tl.arange(0, BM)
            rmask = pos < p1
            tok = tl.load(order_ptr + pos, mask=rmask, other=0).to(tl.int64)
            kmask = kk < r_s
            aoff = tl.multiple_of(tl.load(aoff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
            xp = x_ptr + tok[:, None] * K + tl.arange(0, BK)[None, :]
            ap = arena_ptr + base + aoff.to(tl.int64)[None, :] + tl.arange(0, BK)[:, None]
            acc = tl.zeros((BM, RB), dtype=tl.float32)
            st0 = c * per
            st1 = tl.minimum(st0 + per, steps)
            for st in range(st0, st1):
                i0 = st * BK
                if K % BK == 0:
                    xt = tl.load(xp + i0, mask=rmask[:, None], other=0.0)
                    at = tl.load(ap + i0, mask=kmask[None, :], other=0.0)
                else:
                    imask = i0 + tl.arange(0, BK) < K
                    xt = tl.load(xp + i0, mask=rmask[:, None] & imask[None, :], other=0.0)
                    at = tl.load(ap + i0, mask=kmask[None, :] & imask[:, None], other=0.0)
                acc += tl.dot(xt, at)
            vptr = v_ptr + ((pos[:, None].to(tl.int64) * P + part) * CMAX + c) * R + kk[None, :]
            tl.store(vptr, acc * sc, mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _groups(w0, w1, w2, g, BN: tl.constexpr):
    n0 = ((w0 + BN - 1) // BN + g - 1) // g
    n1 = ((w1 + BN - 1) // BN + g - 1) // g
    n2 = ((w2 + BN - 1) // BN + g - 1) // g
    return n0, n1, n2


@triton.jit
def expand_d(v_ptr, arena_ptr, order_ptr, tiles_ptr, rank_ptr, scale_ptr, boff_ptr, y_ptr,
             n, base, C: tl.constexpr, CMAX: tl.constexpr, STEPS: tl.constexpr, SGX: tl.constexpr,
             M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, w0: tl.constexpr,
             w1: tl.constexpr, w2: tl.constexpr, P: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, RB: tl.constexpr, ALIGN: tl.constexpr,
             GMIN: tl.constexpr):
    total = tl.load(tiles_ptr)
    GX = tl.num_programs(0)
    NB = GX * tl.num_programs(1)
    cd = _c_dyn(total, GX, C, CMAX, STEPS)  # the shrink's grid x is this grid x (same BM)
    # groups of gd output tiles: the largest of G, G/2, .., 1 that still gives every block an item
    gd = G
    a0, a1, a2 = _groups(w0, w1, w2, gd, BN)
    while (gd > GMIN) & (total * (a0 + a1 + a2) < NB):
        gd = gd // 2
        a0, a1, a2 = _groups(w0, w1, w2, gd, BN)
    ng = a0 + a1 + a2
    b = tl.program_id(1) * GX + tl.program_id(0)
    kk = tl.arange(0, RB)
    for w in range(b, total * ng, NB):
        t = w // ng
        q = w % ng
        part = tl.where(q < a0, 0, tl.where(q < a0 + a1, 1, 2))
        m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
        s = tl.load(tiles_ptr + 1 + 3 * t)
        p0 = tl.load(tiles_ptr + 2 + 3 * t)
        p1 = tl.load(tiles_ptr + 3 + 3 * t)
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
            for c in range(cd):
                h += tl.load(vptr + c * R, mask=rmask[:, None] & kmask[None, :], other=0.0)
            hh = h.to(arena_ptr.dtype.element_ty)
            boff = tl.multiple_of(tl.load(boff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
            bp = arena_ptr + base + boff.to(tl.int64)[:, None]
            yp = y_ptr + tok[:, None] * W + o_p
            for g in range(gd):
                cols = (grp * gd + g) * BN + tl.arange(0, BN)
                cmask = cols < width
                bt = tl.load(bp + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(hh, bt)
                ymask = rmask[:, None] & cmask[None, :]
                yv = tl.load(yp + cols[None, :], mask=ymask, other=0.0)
                tl.store(yp + cols[None, :], (yv.to(tl.float32) + acc).to(yv.dtype), mask=ymask)


def maker(cfg, cmax_splits=16, gmin=1):
    def make(pb):
        p, t = pb.p, pb.env.torch
        var = ST.variant_for(p.T)
        c = cfg or ST.VARIANTS[var]
        order, start = B._sorted_tables(t, pb.slot, p.N, pb.env.device, B.TRITON_SLOTS)
        slots = len(start) - 1
        sc, sy = ST.constants("shrink", var, p.in_f, (0,), None, p.R, 1, B.TRITON_SLOTS, 8, c)
        ec, ey = ST.constants("expand", var, p.in_f, (0,), (p.out_f,), p.R, 1, B.TRITON_SLOTS, 8, c)
        assert sc["RS"] == 1
        sc = {k: v for k, v in sc.items() if k != "RS"}
        cmax = max(cmax_splits, sc["C"])
        sc["CMAX"] = cmax
        steps = -(-p.in_f // sc["BK"])
        ec = dict(ec, C=sc["C"], CMAX=cmax, STEPS=steps, SGX=0, GMIN=min(gmin, ec["G"]))
        v = t.empty((p.T, 1, cmax, p.R), dtype=t.float32, device=pb.env.device)
        tiles = t.empty((ST.tile_table_len(p.T),), dtype=t.int32, device=pb.env.device)
        ST.lora_tiles_kernel[(ST.tiles_grid(p.T, slots, c["BM"]),)](start, tiles, slots,
                                                                   **ST.tiles_constants(var, B.TRITON_SLOTS, c))
        gx, kw = ST.grid_x(p.T, slots, c["BM"]), dict(num_warps=c["num_warps"], num_stages=c["num_stages"])

        def call(k):
            shrink_d[(gx, sy)](pb.x[k], pb.arena, order, tiles, pb.rank, pb.scale, pb.a_off[k], v, p.T, 0, **sc, **kw)
            expand_d[(gx, ey)](v, pb.arena, order, tiles, pb.rank, pb.scale, pb.b_off[k], pb.y[k], p.T, 0, **ec, **kw)
        return call
    return make


CUDA_ONLY = not os.environ.get("TRITON_INTERPRET")
# the splits' partial sums are re-read by every expand item: bound the splits (CMAX) or keep the groups (GMIN)
B.BACKENDS["dyn"] = B.Backend("ours", maker(None), cuda_only=CUDA_ONLY)
B.BACKENDS["dyn-c8"] = B.Backend("ours", maker(None, 8), cuda_only=CUDA_ONLY)
B.BACKENDS["dyn-c8g2"] = B.Backend("ours", maker(None, 8, 2), cuda_only=CUDA_ONLY)
for _name, _cfg in B.parse_triton_jit(os.environ.get("TILES_CFGS", "")).items():
    B.BACKENDS[_name.replace("triton-jit-", "dyn-")] = B.Backend("ours", maker(_cfg), cuda_only=CUDA_ONLY)
sys.exit(B.main(sys.argv[1:]))
