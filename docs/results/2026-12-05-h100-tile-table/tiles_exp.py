"""Experiment: stage 3's Triton kernels reading a tile table built once per step (slot, p0, p1
per tile, total first) instead of finding their tile from slot_start in every block. Registers a
backend `tiles` (and `tiles-sbw2`) in bench_lora_kernels and runs its CLI: same process, same method."""
import sys

import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, "scripts")
import bench_lora_kernels as B  # noqa: E402

ST = B._triton()


@triton.jit
def shrink_t(x_ptr, arena_ptr, order_ptr, tiles_ptr, rank_ptr, scale_ptr, aoff_ptr, v_ptr,
             n, S, base, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr,
             C: tl.constexpr, P: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
             BK: tl.constexpr, RB: tl.constexpr, RS: tl.constexpr, SP: tl.constexpr, ALIGN: tl.constexpr):
    RBS: tl.constexpr = RB // RS
    rb = tl.program_id(1) % RS
    pid_c = (tl.program_id(1) // RS) % C
    part = tl.program_id(1) // (RS * C)
    m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
    if m < 0:
        return
    total = tl.load(tiles_ptr)
    steps: tl.constexpr = (K + BK - 1) // BK
    per: tl.constexpr = (steps + C - 1) // C
    st0 = pid_c * per
    st1 = tl.minimum(st0 + per, steps)
    kk = rb * RBS + tl.arange(0, RBS)
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        s = tl.load(tiles_ptr + 1 + 3 * t)
        p0 = tl.load(tiles_ptr + 2 + 3 * t)
        p1 = tl.load(tiles_ptr + 3 + 3 * t)
        sc = tl.load(scale_ptr + s * M + m)
        r_s = tl.load(rank_ptr + s)
        if (sc != 0.0) & (rb * RBS < r_s):
            pos = p0 + tl.arange(0, BM)
            rmask = pos < p1
            tok = tl.load(order_ptr + pos, mask=rmask, other=0).to(tl.int64)
            kmask = kk < r_s
            aoff = tl.multiple_of(tl.load(aoff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
            xp = x_ptr + tok[:, None] * K + tl.arange(0, BK)[None, :]
            ap = arena_ptr + base + aoff.to(tl.int64)[None, :] + tl.arange(0, BK)[:, None]
            acc = tl.zeros((BM, RBS), dtype=tl.float32)
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
            vptr = v_ptr + ((pos[:, None].to(tl.int64) * P + part) * C + pid_c) * R + kk[None, :]
            tl.store(vptr, acc * sc, mask=rmask[:, None] & kmask[None, :])


@triton.jit
def expand_t(v_ptr, arena_ptr, order_ptr, tiles_ptr, rank_ptr, scale_ptr, boff_ptr, y_ptr,
             n, S, base, C: tl.constexpr, M: tl.constexpr, m0: tl.constexpr, m1: tl.constexpr,
             m2: tl.constexpr, w0: tl.constexpr, w1: tl.constexpr, w2: tl.constexpr, P: tl.constexpr,
             W: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
             RB: tl.constexpr, SP: tl.constexpr, ALIGN: tl.constexpr):
    pid_o = tl.program_id(1)
    g0: tl.constexpr = ((w0 + BN - 1) // BN + G - 1) // G
    g1: tl.constexpr = ((w1 + BN - 1) // BN + G - 1) // G
    part = tl.where(pid_o < g0, 0, tl.where(pid_o < g0 + g1, 1, 2))
    m = tl.where(part == 0, m0, tl.where(part == 1, m1, m2))
    if m < 0:
        return
    total = tl.load(tiles_ptr)
    width = tl.where(part == 0, w0, tl.where(part == 1, w1, w2))
    o_p = tl.where(part == 0, 0, tl.where(part == 1, w0, w0 + w1))
    grp = pid_o - tl.where(part == 0, 0, tl.where(part == 1, g0, g0 + g1))
    kk = tl.arange(0, RB)
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        s = tl.load(tiles_ptr + 1 + 3 * t)
        p0 = tl.load(tiles_ptr + 2 + 3 * t)
        p1 = tl.load(tiles_ptr + 3 + 3 * t)
        sc = tl.load(scale_ptr + s * M + m)
        if sc != 0.0:
            r_s = tl.load(rank_ptr + s)
            pos = p0 + tl.arange(0, BM)
            rmask = pos < p1
            tok = tl.load(order_ptr + pos, mask=rmask, other=0).to(tl.int64)
            kmask = kk < r_s
            vptr = v_ptr + (pos[:, None].to(tl.int64) * P + part) * (C * R) + kk[None, :]
            h = tl.zeros((BM, RB), dtype=tl.float32)
            for c in tl.static_range(C):
                h += tl.load(vptr + c * R, mask=rmask[:, None] & kmask[None, :], other=0.0)
            hh = h.to(arena_ptr.dtype.element_ty)
            boff = tl.multiple_of(tl.load(boff_ptr + (s * M + m) * R + kk, mask=kmask, other=0), ALIGN)
            bp = arena_ptr + base + boff.to(tl.int64)[:, None]
            yp = y_ptr + tok[:, None] * W + o_p
            for g in range(G):
                cols = (grp * G + g) * BN + tl.arange(0, BN)
                cmask = cols < width
                bt = tl.load(bp + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(hh, bt)
                ymask = rmask[:, None] & cmask[None, :]
                yv = tl.load(yp + cols[None, :], mask=ymask, other=0.0)
                tl.store(yp + cols[None, :], (yv.to(tl.float32) + acc).to(yv.dtype), mask=ymask)


def tile_table(start: np.ndarray, bm: int) -> np.ndarray:
    out = []
    for s in range(len(start) - 1):
        for p0 in range(int(start[s]), int(start[s + 1]), bm):
            out += [s, p0, int(start[s + 1])]
    return np.array([len(out) // 3] + out, np.int32)


def maker(cfg, bk=None):
    def make(pb):
        p, t = pb.p, pb.env.torch
        var = ST.variant_for(p.T)
        c = cfg or ST.VARIANTS[var]
        order, start = B._sorted_tables(t, pb.slot, p.N, pb.env.device, B.TRITON_SLOTS)
        slots = len(start) - 1
        tiles = t.from_numpy(tile_table(start.cpu().numpy(), c["BM"])).to(pb.env.device)
        sc, sy = ST.constants("shrink", var, p.in_f, (0,), None, p.R, 1, B.TRITON_SLOTS, 8, c)
        ec, ey = ST.constants("expand", var, p.in_f, (0,), (p.out_f,), p.R, 1, B.TRITON_SLOTS, 8, c)
        ec = dict(ec, C=sc["C"])
        if bk:  # the shrink's input elements per dot step (the splits stay as the model's)
            sc = dict(sc, BK=bk)
        v = t.empty((p.T, 1, sc["C"], p.R), dtype=t.float32, device=pb.env.device)
        gx, kw = ST.grid_x(p.T, slots, c["BM"]), dict(num_warps=c["num_warps"], num_stages=c["num_stages"])

        def call(k):
            shrink_t[(gx, sy)](pb.x[k], pb.arena, order, tiles, pb.rank, pb.scale, pb.a_off[k], v, p.T, slots, 0,
                               **sc, **kw)
            expand_t[(gx, ey)](v, pb.arena, order, tiles, pb.rank, pb.scale, pb.b_off[k], pb.y[k], p.T, slots, 0,
                               **ec, **kw)
        return call
    return make


import os  # noqa: E402
B.BACKENDS["tiles"] = B.Backend("ours", maker(None), cuda_only=not os.environ.get("TRITON_INTERPRET"))
B.BACKENDS["tiles-bk128"] = B.Backend("ours", maker(None, 128), cuda_only=not os.environ.get("TRITON_INTERPRET"))
for _name, _cfg in B.parse_triton_jit(os.environ.get("TILES_CFGS", "")).items():  # tiles with other tile configs
    B.BACKENDS[_name.replace("triton-jit-", "tiles-")] = B.Backend("ours", maker(_cfg),
                                                                cuda_only=not os.environ.get("TRITON_INTERPRET"))
sys.exit(B.main(sys.argv[1:]))
