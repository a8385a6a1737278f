"""The fused LoRA linear of prefill_fused/decode_fused against the base GEMM alone and the base GEMM +
each peer's LoRA kernels, on the GPU, in one process, with one timing method (harness/timing.py: a
CUDA graph of n calls over rotated copies of every input, the median replay / n).

  python scripts/bench_lora_fused.py run [--tokens 1,16,64,128,256,1024,4096] [--adapters 4x8,2x16] \
      [--dtypes bfloat16,float16] [--out bench_lora_fused.json]          # the GPU
  python scripts/bench_lora_fused.py tune | routes | producers [--tokens ...] [--linears ...]  # the GPU
  python scripts/bench_lora_fused.py plot bench_lora_fused.json          # here

Ours is compiler_passes/ops/lora/linear_triton.py as its TIR wrapper runs it, with the constants the
compiler builds it with (Triton JIT here, the same source and constants as the cubins in a library):
up to FUSED_MAX_TOKENS tokens the one-kernel linear, above cuBLAS + the shrink/expand pair. The linears of one
Llama-2-7B layer: qkv (4096 -> 3 x 4096), o (4096 -> 4096), gate_up (4096 -> 2 x 11008) and down
(11008 -> 4096), every part with its own adapter module (ours); the peers get ONE module of the
fused width per linear (one A instead of two or three: in their favour). Candidates per point:
`cublas` (torch.matmul), `fused` (ours: base + delta), `cublas+vllm`, `cublas+sgl`
(the base GEMM, then the peer's shrink + expand adding into its output). Every output is checked
against float64. Ratios: fused / (cublas + the faster peer) and the LoRA cost fused / cublas - 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import cli, peers as peers_mod, plot as charts
from harness.timing import compare, copies_for
from harness.workload import arena_tables, lora_weights, token_slots

LINEARS = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
           "down": (11008, (4096,))}
SCALE = 0.5
TOL = 2e-2  # relative error of the output's LoRA delta against float64
CANDIDATES = ("cublas", "fused", "cublas+vllm", "cublas+sgl", "fused(rows)")  # (rows: past FUSED_MAX_TOKENS)


class Point:  # pylint: disable=too-many-instance-attributes,too-few-public-methods
    """One linear and batch on the device: rotated copies of x, W and the adapters' arena rows, the
    tables, two outputs, the pair's scratch; `launch_*` run our kernels with given constants."""

    def __init__(self, torch, LT, name, T, N, r, dtype_name, seed):
        dev, dtype = "cuda", getattr(torch, dtype_name)
        self.torch, self.LT, self.T, self.N, self.r = torch, LT, T, N, r
        self.in_f, self.widths = LINEARS[name]
        self.out_f, P = sum(self.widths), len(self.widths)
        ranks = [r] * N
        nbytes = self.out_f * self.in_f * 2 + N * r * (self.in_f + self.out_f) * 2 * P
        self.copies = copies_for(nbytes, max_copies=64)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.w = [(torch.randn((self.out_f, self.in_f), generator=g, device=dev) * self.in_f ** -0.5).to(dtype)
                  for _ in range(self.copies)]
        self.x = [torch.randn((T, self.in_f), generator=g, device=dev).to(dtype) for _ in range(self.copies)]
        self.mods = [lora_weights(torch, self.copies, ranks, self.in_f, wp, dtype, dev, seed + 1 + p)
                     for p, wp in enumerate(self.widths)]
        self.arena, self.a_off, self.b_off = arena_tables(torch, self.mods, dev)
        self.slot = torch.from_numpy(token_slots(T, N, seed)).to(dev)
        self.rank = torch.full((N,), r, dtype=torch.int32, device=dev)
        self.scale = torch.full((N, P), SCALE, dtype=torch.float32, device=dev)
        self.y = [torch.empty((T, self.out_f), device=dev, dtype=dtype) for _ in range(2)]
        self.v = torch.empty((LT.scratch_elems(T, self.widths),), device=dev, dtype=torch.float32)
        # the split one-kernel linear's partial sums, for any tile shape the tuner tries, and its counters
        self.ws = torch.empty((-(-T // 16) * (self.out_f // 16) * 8 * 64 * (64 + LT.RANK_COLUMNS),),
                              device=dev, dtype=torch.float32) if T <= LT.FUSED_MAX_TOKENS else self.v
        self.cnt = torch.zeros((LT.COUNTER_SLOTS * 4,), device=dev, dtype=torch.int32)
        self.mod_ids = list(range(P))

    def launch_gemm(self, c):
        """cuBLAS (torch.matmul): y = x @ W.T, the base linear alone."""
        self.torch.matmul(self.x[c], self.w[c].t(), out=self.y[c % 2])

    def launch_pair(self, c, go):
        """The route past FUSED_MAX_TOKENS: cuBLAS, then the shrink and the in-place expand."""
        self.launch_gemm(c)
        self.launch_shrink(c, go)
        self.launch_expand(c, go)

    def launch_linear(self, c, consts, warps, slots=None):
        grid = (-(-self.T // consts["BM"]) * consts["SPLIT"], self.out_f // consts["BN"])
        self.LT.lora_linear_kernel[grid](self.x[c], self.w[c], self.arena, self.slot, self.rank, self.scale,
                                         self.a_off[c], self.b_off[c], self.y[c % 2], self.ws, self.cnt, self.T,
                                         self.N if slots is None else slots, 0, **consts, num_warps=warps)

    def error(self):
        """The relative error of y[0] (copy 0's output) in its LoRA delta against float64."""
        x, w, slot = self.x[0].double(), self.w[0].double(), self.slot
        ref = x @ w.t()
        base = ref.clone()
        o = 0
        for p, wp in enumerate(self.widths):
            a, b = self.mods[p][0][0].double(), self.mods[p][1][0].double()  # (N, r, in), (N, out, r)
            for s in range(self.N):
                rows = (slot == s).nonzero().flatten()
                ref[rows, o:o + wp] += SCALE * (x[rows] @ a[s].t()) @ b[s].t()
            o += wp
        return ((self.y[0].double() - ref).norm() / (ref - base).norm()).item()

    def rows_setup(self):
        """The rank rows route's buffers: each copy of W with rank_rows(P) rows below it (random:
        the fill must overwrite them), e; returns its launch plan."""
        torch, LT = self.torch, self.LT
        go = LT.rows_launch(self.T, self.in_f, self.widths, self.mod_ids, len(self.widths), self.r, 8)
        self.w_rows = []
        for c in range(self.copies):
            w = torch.randn((go["rows"], self.in_f), device="cuda").to(self.w[c].dtype)
            w[:self.out_f].copy_(self.w[c])
            self.w_rows.append(w)
        self.e = torch.empty((self.T, go["rows"]), device="cuda", dtype=self.w[0].dtype)
        return go

    def launch_gemm_rows(self, c):
        """cuBLAS over W's rows and the rank rows: e = x @ [W; A rows].T."""
        self.torch.matmul(self.x[c], self.w_rows[c].t(), out=self.e)

    def launch_fill_rows(self, c, go):
        """The rank rows route's fill alone: the batch's A rows into W's spare rows."""
        self.LT.lora_fill_rows_kernel[go["fill_grid"]](self.arena, self.rank, self.scale, self.a_off[c],
                                                       self.w_rows[c], self.N, 0, **go["fill"],
                                                       num_warps=go["fill_warps"])

    def launch_rows(self, c, go):
        """The rank rows route past FUSED_MAX_TOKENS (`--lora-rank-rows`): the fill, cuBLAS over both,
        the expand from e into y."""
        self.launch_fill_rows(c, go)
        self.launch_gemm_rows(c)
        self.LT.lora_expand_rows_kernel[go["expand_grid"]](self.e, self.arena, self.slot, self.rank, self.scale,
                                                           self.b_off[c], self.y[c % 2], self.T, self.N, 0,
                                                           **go["expand"], num_warps=go["expand_warps"])

    def launch_shrink(self, c, go):
        self.LT.lora_shrink_cols_kernel[go["shrink_grid"]](self.x[c], self.arena, self.rank, self.scale, self.a_off[c],
                                                           self.v, self.T, self.N, 0, go["chunk"], **go["shrink"],
                                                           num_warps=go["shrink_warps"])

    def launch_expand(self, c, go):
        self.LT.lora_expand_cols_kernel[go["expand_grid"]](self.v, self.arena, self.slot, self.rank, self.scale,
                                                           self.b_off[c], self.y[c % 2], self.T, self.N, 0,
                                                           go["split"], **go["expand"],
                                                           num_warps=go["expand_warps"])


def run_point(torch, peers, LT, name, T, N, r, dtype_name, seed):  # pylint: disable=too-many-locals
    """us per call of every candidate, and the fused kernel's error, for one linear and batch."""
    pt = Point(torch, LT, name, T, N, r, dtype_name, seed)
    dev, in_f, widths, out_f, copies = "cuda", pt.in_f, pt.widths, pt.out_f, pt.copies
    x, mods, slot, y = pt.x, pt.mods, pt.slot, pt.y
    consts, warps = LT.constants(in_f, widths, pt.mod_ids, len(widths), r,
                                 LT.token_tier(min(T, LT.FUSED_MAX_TOKENS)), 8)
    go = LT.cols_launch(T, in_f, widths, pt.mod_ids, len(widths), r, 8)
    go_rows = pt.rows_setup() if T > LT.FUSED_MAX_TOKENS else None

    def fused(c):
        if T <= LT.FUSED_MAX_TOKENS:  # the one-kernel linear
            pt.launch_linear(c, consts, warps)
            return
        pt.launch_pair(c, go)  # above it, as the wrapper

    fused(0)
    err = pt.error()
    cands = {"cublas": (pt.launch_gemm, copies),
             "fused": (fused, copies)}
    err_rows = None
    if go_rows is not None:  # --lora-rank-rows' route past the one-kernel linear
        pt.launch_rows(0, go_rows)
        err_rows = pt.error()
        cands["fused(rows)"] = (lambda c: pt.launch_rows(c, go_rows), copies)
    if peers is not None:
        pa = mods[0][0]  # peers: one module of the fused width
        pb = torch.cat([m[1] for m in mods], dim=2)  # (copies, N, out_f, r)
        a4, b4 = pa.unsqueeze(2), pb.unsqueeze(2)  # vLLM's stacked layout (slice axis)
        meta = peers.LoRAKernelMeta.make(N, T, dev)
        meta.prepare_tensors(slot.long())
        peers.clear_vllm_ptr_caches()
        sgl = peers.ChunkedSgmvLoRABackend(N, dev, None)
        peers.sgl_prepare(sgl, T, N, r, SCALE, slot.long().tolist())
        offs = torch.tensor([0, out_f], dtype=torch.int32, device=dev)
        offs_cpu = torch.tensor([0, out_f], dtype=torch.int32)

        def vllm(c):
            pt.launch_gemm(c)
            peers.vllm_lora_linear(y[c % 2], x[c], a4[c], b4[c], meta, SCALE)

        def sglang(c):
            pt.launch_gemm(c)
            peers.sgl_lora_linear(y[c % 2], x[c], pa[c], pb[c], sgl, offs, offs_cpu)

        cands.update({"cublas+vllm": (vllm, copies), "cublas+sgl": (sglang, copies)})
    us = compare(cands)
    return dict(linear=name, T=T, N=N, r=r, dtype=dtype_name, err=err, err_rows=err_rows, config=consts,
                num_warps=warps, copies=copies, **us)


def _linear_configs(LT, pt):
    """Tile shapes for the one-kernel linear at pt.T tokens, the compiled one (its token tier's)
    first; past SMALL_MAX_TOKENS also at blocks of 16 (up to 32 tokens), 32 and 64 tokens, and the
    products transposed with 4 or 8 warps (more blocks, and input splits, for 17-64 tokens)."""
    in_f, widths = pt.in_f, pt.widths
    cur, warps = LT.constants(in_f, widths, pt.mod_ids, len(widths), pt.r, LT.token_tier(pt.T), 8)
    out = [(cur, warps)]
    narrow = sum(widths) < 8192
    # narrow linears: input splits (the counters and partial sums); wide ones do not split
    shapes = ([(bn, bk, 4, 4, sp) for bn in (16, 32) for bk in (128, 256) for sp in (1, 2, 3, 4, 8)] if narrow else
              [(bn, bk, st, w, 1) for bn in (64, 128) for bk in (64, 128)
               for st, w in ((4, 4), (6, 4), (8, 4), (4, 8), (6, 8))])
    # the products transposed (the outputs on the warpgroup MMA's 64 rows, the tokens its columns)
    shapes = [(bn, bk, st, w, sp, 0) for bn, bk, st, w, sp in shapes] + [
        (bn, bk, st, w, sp, 1) for bn in (64, 128) for bk in (64, 128) for st, w in ((4, 4), (3, 4), (4, 8))
        for sp in ((1, 2, 4) if narrow else (1,))]
    if pt.T <= LT.SMALL_MAX_TOKENS:
        heights = (cur["BM"],)
    else:
        heights = (16, 32, 64) if pt.T <= 32 else (32, 64)
    for bm_ in heights:
        for bn, bk, stages, w, split, swap in shapes:
            if any(x % bn for x in widths) or in_f % bk or in_f // bk < split:
                continue
            c = dict(cur, BM=bm_, BN=bn, BK=bk, STAGES=stages, SPLIT=split, SWAP=swap)
            if (c, w) not in out:
                out.append((c, w))
    return out


def _memory_splits(tiles: int, steps: int) -> list[int]:
    """The input splits (of whole steps, at least 4 a split) giving `tiles` output tiles about one
    and about two blocks an SM (132 SMs), at most 16."""
    return sorted({next((s for s in range(1, 17) if tiles * s >= want or steps // (s + 1) < 4), 16)
                   for want in (132, 264)})


def _splitk_configs(LT, pt):
    """Tile shapes for the one-kernel linear at pt.T tokens aimed at the memory: every linear's
    products transposed (the outputs on the warpgroup MMA's rows, the batch's token tier its
    columns), BN 64-256 outputs, BK 64/128 inputs, 3-6 stages, and per shape _memory_splits; the
    compiled shape first."""
    in_f, widths = pt.in_f, pt.widths
    cur, warps = LT.constants(in_f, widths, pt.mod_ids, len(widths), pt.r, LT.token_tier(pt.T), 8)
    out = [(cur, warps)]
    bm = max(16, LT.token_tier(pt.T))
    for bn in (64, 128, 256):
        if any(x % bn for x in widths):
            continue
        tiles = sum(widths) // bn
        for bk in (64, 128):
            if in_f % bk:  # (the splits end on whole steps; the last at K)
                continue
            for split in _memory_splits(tiles, in_f // bk):
                for stages in (3, 4, 6):
                    c = dict(cur, BM=bm, BN=bn, BK=bk, STAGES=stages, SPLIT=split, SWAP=1)
                    w = 8 if bn == 256 else 4
                    if (c, w) not in out:
                        out.append((c, w))
    return out


_TMA = {}


def tma_gemm_kernel():
    """A candidate for the one-kernel linear's GEMM at a few tokens: the products transposed (the
    outputs on the warpgroup MMA's rows) with x's and W's tiles loaded by the tensor memory
    accelerator (Triton's device-side tensor descriptors, which take its global scratch: the
    allocator set in `_tma_group`)."""
    if "k" in _TMA:
        return _TMA["k"]
    import triton  # pylint: disable=import-outside-toplevel
    import triton.language as tl  # pylint: disable=import-outside-toplevel

    @triton.jit
    def tma_gemm(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, n, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr):
        """Semantics: y (n, N) = x (n, K) @ w (N, K).T, n <= BM, the products summed in fp32 and
        rounded once (reference: torch.matmul, which the benchmark checks it against). Grid
        (N / BN, SPLIT): split k sums inputs [k * PER, (k + 1) * PER) (PER a multiple of BK); with
        SPLIT > 1 each split stores its partial in ws and counts itself in cnt[tile], and the
        block that counts last sums the SPLIT partials in split order, stores y and sets cnt[tile]
        back to 0 (cnt holds zeros when the kernel starts). x's rows past n load as zeros (TMA)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n, K], strides=[K, 1], block_shape=[BM, BK])
        PER: tl.constexpr = (K // BK + SPLIT - 1) // SPLIT * BK
        k_lo = pid_k * PER
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in tl.range(k_lo, tl.minimum(K, k_lo + PER), BK, num_stages=STAGES):
            acc = tl.dot(w_desc.load([pid_n * BN, k0]), tl.trans(x_desc.load([0, k0])), acc)
        rows = tl.arange(0, BM)
        y_ptrs = y_ptr + rows[None, :].to(tl.int64) * N + (pid_n * BN + tl.arange(0, BN))[:, None]
        ymask = (rows < n)[None, :]
        if SPLIT == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:
            at = tl.arange(0, BN)[:, None] * BM + rows[None, :]
            tl.store(ws_ptr + (pid_n * SPLIT + pid_k).to(tl.int64) * (BN * BM) + at, acc)
            tl.debug_barrier()  # every thread's partial stored before the count (released by it)
            if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tot = tl.zeros((BN, BM), dtype=tl.float32)
                for k in tl.static_range(SPLIT):
                    tot += tl.load(ws_ptr + (pid_n * SPLIT + k).to(tl.int64) * (BN * BM) + at, cache_modifier=".cg")
                tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=ymask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    _TMA["k"] = tma_gemm
    return tma_gemm


def _tma_configs(LT, pt):
    """Launches of tma_gemm_kernel at pt.T tokens: BN 64/128 outputs, BK 64/128 inputs, 3-6 stages,
    _memory_splits."""
    bm = max(16, LT.token_tier(pt.T))
    out = []
    for bn in (64, 128):
        if any(x % bn for x in pt.widths):
            continue
        tiles = sum(pt.widths) // bn
        for bk in (64, 128):
            if pt.in_f % bk:  # (the splits end on whole steps; the last at K)
                continue
            out += [dict(BM=bm, BN=bn, BK=bk, STAGES=st, SPLIT=sp) for sp in _memory_splits(tiles, pt.in_f // bk)
                    for st in (3, 4, 6)]
    return out


def _tma_group(torch, LT, pt):
    """The GEMM alone at pt.T tokens: tma_gemm_kernel per launch of _tma_configs (each checked
    against cuBLAS's y), cuBLAS, and the compiled one-kernel linear with no adapter in the batch."""
    import triton  # pylint: disable=import-outside-toplevel

    # the descriptors' global scratch (a torch allocation per launch; inside a captured graph, from its pool)
    triton.set_allocator(lambda size, align, stream: torch.empty((size,), dtype=torch.int8, device="cuda"))
    kernel = tma_gemm_kernel()
    out_f, in_f, T = sum(pt.widths), pt.in_f, pt.T
    ys = [torch.empty_like(pt.y[0]) for _ in range(2)]
    pt.launch_gemm(0)
    torch.cuda.synchronize()
    want = pt.y[0].float()
    group = {"cublas": pt.launch_gemm}  # first: the line tune prints is each candidate against it
    for c in _tma_configs(LT, pt):
        label = f"tma BN{c['BN']} BK{c['BK']} S{c['STAGES']} split{c['SPLIT']}"

        def launch(i, c=c):
            kernel[(out_f // c["BN"], c["SPLIT"])](pt.x[i], pt.w[i], ys[i % 2], pt.ws, pt.cnt, T, K=in_f, N=out_f,
                                                   **c, num_warps=4)
        try:
            launch(0)
            torch.cuda.synchronize()
        except Exception as e:  # pylint: disable=broad-except  (e.g. out of shared memory)
            print(f"  {pt.T} tokens {label}: {type(e).__name__}: {str(e)[:80]}")
            continue
        if not torch.allclose(ys[0].float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            print(f"  {pt.T} tokens {label}: y differs from cuBLAS's: left out")
            continue
        group[label] = launch
    cur, warps = LT.constants(in_f, pt.widths, pt.mod_ids, len(pt.widths), pt.r, LT.token_tier(T), 8)
    group["compiled linear, no adapter"] = lambda i: pt.launch_linear(i, cur, warps, 0)
    return group


def _pair_configs(LT, pt):
    """(shrink launches, expand launches) for the pair at pt.T tokens: the compiled ones first."""
    T, in_f, widths = pt.T, pt.in_f, pt.widths
    go = LT.cols_launch(T, in_f, widths, pt.mod_ids, len(widths), pt.r, 8)
    shrinks, expands = [go], [go]
    for bm in (16, 32, 64):
        for bk in (64, 128):
            for target in ((132, 264) if bm == 16 else (132,)):
                cs = dict(go["shrink"], BM=bm, BK=bk)
                tiles, per, split = LT.shrink_split(T, in_f // bk, bm, target=target)
                g = dict(go, shrink=cs, split=split, chunk=per * bk, shrink_grid=(tiles, split))
                if all(g["shrink"] != x["shrink"] or g["split"] != x["split"] for x in shrinks):
                    shrinks.append(g)
    for bm in (32, 64):
        for bn in (128, 256):
            for w in (4, 8):
                if any(x % bn for x in widths):
                    continue
                ce = dict(go["expand"], BM=bm, BN=bn)
                g = dict(go, expand=ce, expand_grid=(-(-T // bm), sum(widths) // bn), expand_warps=w)
                if all(g["expand"] != x["expand"] or w != x["expand_warps"] for x in expands):
                    expands.append(g)
    return shrinks, expands


def _xs_configs(LT, pt):
    """Launches of the rank columns route's shrink adding s beside x in [x | s] at pt.T tokens, the
    compiled one first: token tiles of 16-64, input steps of 64-128, splits aimed at 1-4 blocks an SM
    (up to 16), 4 or 8 warps."""
    T, in_f, widths = pt.T, pt.in_f, pt.widths
    go = LT.xs_launch(T, in_f, widths, pt.mod_ids, len(widths), pt.r, 8)
    out = [dict(go, warps=go["shrink_warps"])]
    for bm in (16, 32, 64):
        for bk in (64, 128):
            for target in (132, 264, 528):
                for warps in (4, 8):
                    tiles, per, split = LT.shrink_split(T, in_f // bk, bm, target=target, most=16)
                    cs = dict(go["shrink"], BM=bm, BK=bk, SPLIT_MAX=16 if split > LT.SPLIT_MAX else LT.SPLIT_MAX)
                    g = dict(go, shrink=cs, split=split, chunk=per * bk, shrink_grid=(tiles, split), warps=warps)
                    if all((g["shrink"], g["split"], warps) != (x["shrink"], x["split"], x["warps"]) for x in out):
                        out.append(g)
    return out


def _xs_group(torch, LT, pt, name):
    """The route's shrink into [x | s] (x where its producer wrote it) per launch of _xs_configs,
    each checked against the compiled one's [x | s], beside the pair's shrink."""
    cfgs = _xs_configs(LT, pt)
    T = pt.T
    xe = [torch.empty((T, cfgs[0]["cols"]), device="cuda", dtype=pt.x[0].dtype) for _ in range(pt.copies)]
    for i in range(pt.copies):
        xe[i][:, :pt.in_f].copy_(pt.x[i])
    v = torch.empty((LT.scratch_elems(T, pt.widths),), device="cuda", dtype=torch.float32)

    def launch(i, g):
        LT.lora_shrink_xs_kernel[g["shrink_grid"]](
            pt.arena, pt.slot, pt.rank, pt.scale, pt.a_off[i], xe[i], v, pt.cnt, T, pt.N, 0, g["chunk"], g["split"],
            **g["shrink"], num_warps=g["warps"])

    launch(0, cfgs[0])
    torch.cuda.synchronize()
    want = xe[0].clone()
    group = {}
    for g in cfgs:
        c = g["shrink"]
        label = f"BM{c['BM']} BK{c['BK']} split{g['split']} w{g['warps']}"
        launch(0, g)
        torch.cuda.synchronize()
        if not torch.allclose(xe[0].float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.float().abs().max())):
            print(f"  {name} T={T} shrink·xs {label}: [x | s] differs from the compiled launch's: left out")
            continue
        group[label] = lambda i, g=g: launch(i, g)
    go = LT.cols_launch(T, pt.in_f, pt.widths, pt.mod_ids, len(pt.widths), pt.r, 8)
    group["the pair's shrink"] = lambda i: pt.launch_shrink(i, go)
    return group


def _norm_group(torch, pt):
    """ops/norm_triton.py's RMSNorm of rows (the rank columns route's x up to FUSED_MAX_TOKENS, a
    row per block), alone and with the residual add before it, beside torch's, checked against it."""
    from mlc_lora.compiler_passes.ops import norm_triton as NORM  # pylint: disable=import-outside-toplevel

    K, T = pt.in_f, pt.T
    h = [torch.randn((T, K), device="cuda").to(pt.x[0].dtype) for _ in range(pt.copies)]
    r = [torch.randn((T, K), device="cuda").to(pt.x[0].dtype) for _ in range(pt.copies)]
    gain = (torch.rand((K,), device="cuda") + 0.5).to(pt.x[0].dtype)
    x, h1 = torch.empty_like(h[0]), torch.empty_like(h[0])
    nl, nla = NORM.launch(K), NORM.launch(K, residual=True)

    def rows(i):
        NORM.rms_norm_kernel[(T,)](h[i], h[i], gain, x, x, 1e-5, **nl["consts"], num_warps=nl["warps"])

    def add_rows(i):
        NORM.rms_norm_kernel[(T,)](h[i], r[i], gain, x, h1, 1e-5, **nla["consts"], num_warps=nla["warps"])

    def torch_add(i):
        s = h[i] + r[i]
        return torch.nn.functional.rms_norm(s, (K,), gain, 1e-5)

    rows(0)
    want = torch.nn.functional.rms_norm(h[0].float(), (K,), gain.float(), 1e-5)
    add_rows(0)
    want_add = torch.nn.functional.rms_norm((h[0] + r[0]).float(), (K,), gain.float(), 1e-5)
    if not torch.allclose(want_add, x.float(), rtol=1e-2, atol=1e-2) or not torch.equal(h1, h[0] + r[0]):
        raise RuntimeError(f"rms_norm_kernel with the add at T={T}: differs from torch's add + RMSNorm")
    rows(0)
    if not torch.allclose(x.float(), want, rtol=1e-2, atol=1e-2):
        raise RuntimeError(f"rms_norm_kernel at T={T}: x differs from torch's RMSNorm")
    return {"rms_norm_kernel": rows, "torch rms_norm": lambda i: torch.nn.functional.rms_norm(h[i], (K,), gain, 1e-5),
            "rms_norm_kernel + add": add_rows, "torch add + rms_norm": torch_add}


def tune(a) -> int:  # pylint: disable=too-many-locals
    """Every tile shape of `_linear_configs` / `_pair_configs` per linear and token count, timed
    together (harness.timing.compare); prints the compiled one against the best. Also: the rank
    columns route's shrink into [x | s] (`_xs_group`, past FUSED_MAX_TOKENS, x where its producer
    wrote it) beside the pair's shrink, and its RMSNorm of rows (`_norm_group`, up to it) beside
    torch's."""
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT  # pylint: disable=import-outside-toplevel

    out = []
    for name in a.linears.split(","):
        for T in map(int, a.tokens.split(",")):
            pt = Point(torch, LT, name, T, 4, 8, a.dtype, seed=T * 131 + 29)
            groups = {}
            if T <= LT.FUSED_MAX_TOKENS and a.shapes == "tma":  # the GEMM alone, its tiles loaded by TMA
                groups["gemm"] = _tma_group(torch, LT, pt)
            elif T <= LT.FUSED_MAX_TOKENS:
                cfgs = (_splitk_configs if a.shapes == "splitk" else _linear_configs)(LT, pt)
                groups["linear"] = {f"BM{c['BM']} BN{c['BN']} BK{c['BK']} S{c['STAGES']} w{w} split{c['SPLIT']}"
                                    f"{' swap' if c['SWAP'] else ''}": (
                    lambda i, c=c, w=w: pt.launch_linear(i, c, w)) for c, w in cfgs}
                # the compiled shape with no adapter in the batch: the kernel's GEMM alone
                groups["linear"]["compiled, no adapter"] = (lambda i, c=cfgs[0]: pt.launch_linear(i, c[0], c[1], 0))
                groups["linear"]["cublas"] = pt.launch_gemm
                # the route past FUSED_MAX_TOKENS at this token count (which route wins where)
                pair = _pair_configs(LT, pt)[0][0]
                pt.launch_shrink(0, pair)
                groups["linear"]["cublas + pair"] = lambda i, g=pair: pt.launch_pair(i, g)
                if name in ("qkv", "gate_up"):  # the route's x up to FUSED_MAX_TOKENS: its RMSNorm of rows
                    groups["norm"] = _norm_group(torch, pt)
            else:
                shrinks, expands = _pair_configs(LT, pt)
                pt.launch_shrink(0, shrinks[0])
                groups["shrink"] = {f"BM{g['shrink']['BM']} BK{g['shrink']['BK']} split{g['split']}": (
                    lambda i, g=g: pt.launch_shrink(i, g)) for g in shrinks}
                groups["expand"] = {f"BM{g['expand']['BM']} BN{g['expand']['BN']} w{g['expand_warps']}": (
                    lambda i, g=g: pt.launch_expand(i, g)) for g in expands}
                # the whole linear: cuBLAS, then the pair adding into y, against cuBLAS alone
                groups["linear"] = {"cublas + pair": lambda i, g=shrinks[0]: pt.launch_pair(i, g),
                                    "cublas": pt.launch_gemm}
                if name != "o":  # the rank columns route's shrink (x's producer writes x into [x | s])
                    groups["shrink·xs"] = _xs_group(torch, LT, pt, name)
            for kind, fns in groups.items():
                ok = {}
                for label, fn in fns.items():
                    try:
                        fn(0)
                        torch.cuda.synchronize()
                        if kind == "linear" and label != "cublas" and "no adapter" not in label:
                            fn(0)  # twice: the split tiles' counters were left at zero
                            if not pt.error() < TOL:
                                raise RuntimeError(f"its LoRA delta is off: error {pt.error():.3g}")
                        ok[label] = (fn, pt.copies)
                    except Exception as e:  # pylint: disable=broad-except  (e.g. out of shared memory)
                        print(f"  {name} T={T} {kind} {label}: {type(e).__name__}: {str(e)[:80]}")
                us = compare(ok)
                cur = next(iter(ok))
                best = min(us, key=us.get)
                print(f"{name} T={T} {kind}: compiled [{cur}] {us[cur]:.1f} us, best [{best}] {us[best]:.1f} us "
                      f"({us[best] / us[cur]:.2f}x); " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(us.items(), key=lambda kv: kv[1])[:4]),
                      flush=True)
                out.append(dict(linear=name, T=T, kind=kind, compiled=cur, best=best, us=us))
                cli.write_results(Path(a.out), {"tune": out, "complete": False})  # (a run cut short keeps these)
    cli.write_results(Path(a.out), {"tune": out, "complete": True})
    return 0


def _check_deltas(torch, pt, name, cands, labels):
    """Each labelled candidate's output (copy 0's, run twice: the split tiles' counters were left at
    zero) against float64; stops the benchmark on one that is off."""
    for label in labels:
        cands[label](0)
        cands[label](0)
        torch.cuda.synchronize()
        if not pt.error() < TOL:
            raise SystemExit(f"{name} T={pt.T} {label}: its LoRA delta is off: error {pt.error():.3g}")


def routes(a) -> int:  # pylint: disable=too-many-locals
    """The routes a linear could take with its LoRA delta, timed together per linear and token count
    (4 x r8): the compiled ones (the one-kernel linear up to FUSED_MAX_TOKENS, cuBLAS + the pair in
    sequence above), the shrink on a second stream beside cuBLAS (joined before the expand; both
    streams inside the captured graph), and the rank columns inside the GEMM: cuBLAS over K + P x
    RANK_COLUMNS inputs (the batch's B rows appended to W's rows, each token's scaled shrink appended
    to x), alone and after a copy of x and the shrink (its cost without a kernel written for it);
    the rank rows inside the GEMM (`--lora-rank-rows`): cuBLAS over N + P x RANK_COLUMNS outputs
    (the batch's A rows below W's: the shrink inside the GEMM), alone and with the fill and the
    expand from its output (the compiled route); and the pair's shrink, its expand and the rows
    route's fill alone (what a route that folds one of them into the GEMM saves or adds); and the
    rank columns route (`lora_spare_columns`) without x's producer: its shrink adding s beside x in
    [x | s], then cuBLAS over both (its fill, which runs when the pool's kept columns change, timed
    alone as `fill(cols)`). With x's producer writing x into [x | s]: `producers`."""
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT  # pylint: disable=import-outside-toplevel

    out = []
    side = torch.cuda.Stream()
    for name in a.linears.split(","):
        for T in map(int, a.tokens.split(",")):
            pt = Point(torch, LT, name, T, 4, 8, a.dtype, seed=T * 131 + 29)
            go = LT.cols_launch(T, pt.in_f, pt.widths, pt.mod_ids, len(pt.widths), pt.r, 8)
            consts, warps = LT.constants(pt.in_f, pt.widths, pt.mod_ids, len(pt.widths), pt.r,
                                         LT.token_tier(min(T, LT.FUSED_MAX_TOKENS)), 8)
            k_ext = pt.in_f + LT.spare_columns(pt.in_f, len(pt.widths))
            w_ext = [torch.empty((pt.out_f, k_ext), device="cuda", dtype=pt.w[0].dtype) for _ in range(pt.copies)]
            x_ext = [torch.zeros((T, k_ext), device="cuda", dtype=pt.x[0].dtype) for _ in range(pt.copies)]
            go_xs = LT.xs_launch(T, pt.in_f, pt.widths, pt.mod_ids, len(pt.widths), pt.r, 8)

            def fill_cols(i):  # the compiled route's fill (when the kept columns change)
                LT.lora_fill_cols_kernel[go_xs["fill_grid"]](pt.arena, pt.rank, pt.scale, pt.b_off[i], w_ext[i], pt.N,
                                                             0, **go_xs["fill"], num_warps=go_xs["fill_warps"])

            def shrink_xs(i):  # the compiled route's shrink, adding s beside x (its producer's) in [x | s]
                LT.lora_shrink_xs_kernel[go_xs["shrink_grid"]](
                    pt.arena, pt.slot, pt.rank, pt.scale, pt.a_off[i], x_ext[i], pt.v, pt.cnt, T, pt.N, 0,
                    go_xs["chunk"], go_xs["split"], **go_xs["shrink"], num_warps=go_xs["shrink_warps"])

            for c in range(pt.copies):
                w_ext[c].zero_()
                w_ext[c][:, :pt.in_f].copy_(pt.w[c])
                fill_cols(c)
                x_ext[c][:, :pt.in_f].copy_(pt.x[c])  # (as x's producer would leave it)

            def overlap(i):
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    pt.launch_shrink(i, go)
                pt.launch_gemm(i)
                cur.wait_stream(side)
                pt.launch_expand(i, go)

            def gemm_ext(i):
                torch.matmul(x_ext[i], w_ext[i].t(), out=pt.y[i % 2])

            def ext(i):
                pt.launch_shrink(i, go)
                x_ext[i][:, :pt.in_f].copy_(pt.x[i])
                gemm_ext(i)

            go_rows = pt.rows_setup()
            cands = {"cublas": pt.launch_gemm, "cublas + pair": lambda i: pt.launch_pair(i, go),
                     "cublas || shrink, expand": overlap,
                     "cublas(K+cols)": gemm_ext, "shrink + copy + cublas(K+cols)": ext,
                     "cublas(N+rows)": pt.launch_gemm_rows,
                     "fill + cublas(N+rows) + expand": lambda i: pt.launch_rows(i, go_rows),
                     # the pair's parts alone: what a route that folds one of them away saves
                     "shrink": lambda i: pt.launch_shrink(i, go), "expand": lambda i: pt.launch_expand(i, go),
                     "fill(rows)": lambda i: pt.launch_fill_rows(i, go_rows),
                     "fill(cols)": fill_cols,
                     # the rank columns route (spare columns) after x's producer, its fill kept out (it
                     # runs when the pool's kept columns change)
                     "shrink·xs": shrink_xs, "shrink·xs + cublas(K+cols)": lambda i: (shrink_xs(i), gemm_ext(i))}
            if T <= LT.FUSED_MAX_TOKENS:
                cands["one-kernel linear"] = lambda i: pt.launch_linear(i, consts, warps)
            _check_deltas(torch, pt, name, cands, ("cublas + pair", "cublas || shrink, expand",
                                                   "fill + cublas(N+rows) + expand", "shrink·xs + cublas(K+cols)") + (
                ("one-kernel linear",) if T <= LT.FUSED_MAX_TOKENS else ()))
            us = compare({k: (fn, pt.copies) for k, fn in cands.items()})
            print(f"{name} T={T}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()), flush=True)
            out.append(dict(linear=name, T=T, us=us))
            cli.write_results(Path(a.out), {"routes": out, "complete": False})
            del w_ext, x_ext, pt
            torch.cuda.empty_cache()
    print("\nOne layer (the four linears), us:")
    labels = list(out[0]["us"])
    print("| T | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for T in sorted({r["T"] for r in out}):
        rows = [r["us"] for r in out if r["T"] == T]
        print(f"| {T} | " + " | ".join(f"{sum(r.get(k, float('nan')) for r in rows):.1f}" for k in labels) + " |")
    cli.write_results(Path(a.out), {"routes": out, "complete": True})
    return 0


def producers(a) -> int:  # pylint: disable=too-many-locals,too-many-statements
    """The rank columns route with x written by its producer straight into [x | s] (as compiled),
    against x copied there by the shrink and the pair, per linear and token count (4 x r8), timed
    together. x's producer: the RMSNorm before q|k|v and gate|up (ops/norm_triton.py),
    silu(gate) * up before down (ops/activation_triton.py), the attention before o (not ours to
    change here: x given, in [x | s] already for the in-place route). Candidates: `base` (the
    producer into x, cuBLAS), `pair` (the same, then the shrink and the in-place expand),
    `route·copy` (the producer into x, x copied into [x | s] by torch, the shrink, cuBLAS over both:
    what a linear whose x comes from elsewhere would pay, o's case), `route·in place` (the producer
    into [x | s]'s first columns, the shrink adding s there, cuBLAS over both); and the parts: the
    producer into x and into [x | s], the pair's shrink and expand, cuBLAS over [x | s], x's copy,
    the shrink per launch plan (the compiled one first)."""
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.compiler_passes.ops import activation_triton as AT  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes.ops import norm_triton as NORM  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT  # pylint: disable=import-outside-toplevel

    out = []
    for name in a.linears.split(","):
        for T in map(int, a.tokens.split(",")):
            pt = Point(torch, LT, name, T, 4, 8, a.dtype, seed=T * 131 + 29)
            K, P = pt.in_f, len(pt.widths)
            ke = K + LT.spare_columns(K, P)
            dt = pt.x[0].dtype
            go = LT.cols_launch(T, K, pt.widths, pt.mod_ids, P, pt.r, 8)
            w_ext = [torch.zeros((pt.out_f, ke), device="cuda", dtype=dt) for _ in range(pt.copies)]
            xe = [torch.zeros((T, ke), device="cuda", dtype=dt) for _ in range(pt.copies)]
            norm = name in ("qkv", "gate_up")
            h = [torch.randn((T, 2 * K if name == "down" else K), device="cuda").to(dt) for _ in range(pt.copies)]
            gain = (torch.rand((K,), device="cuda") + 0.5).to(dt)
            nl = {K: NORM.launch(K), ke: NORM.launch(K, ke)}
            bn = AT.block_cols(K)

            def before(i, out, ld):  # x's producer into out (rows ld apart); o: x is given
                if norm:
                    NORM.rms_norm_kernel[(T,)](h[i], h[i], gain, out, out, 1e-5, **nl[ld]["consts"],
                                               num_warps=nl[ld]["warps"])
                elif name == "down":
                    AT.silu_mul_kernel[(-(-T // AT.BM), K // bn)](h[i], out, T, I=K, BM=AT.BM, BN=bn, LDH=ld,
                                                                   num_warps=AT.WARPS)

            def xs(i, g):
                LT.lora_shrink_xs_kernel[g["shrink_grid"]](
                    pt.arena, pt.slot, pt.rank, pt.scale, pt.a_off[i], xe[i], pt.v, pt.cnt, T, pt.N, 0,
                    g["chunk"], g["split"], **g["shrink"], num_warps=g["shrink_warps"])

            def copy_x(i):
                xe[i][:, :K].copy_(pt.x[i])

            def gemm_ext(i):
                torch.matmul(xe[i], w_ext[i].t(), out=pt.y[i % 2])

            go_ip = LT.xs_launch(T, K, pt.widths, pt.mod_ids, P, pt.r, 8)
            for c in range(pt.copies):
                w_ext[c][:, :K].copy_(pt.w[c])
                LT.lora_fill_cols_kernel[go_ip["fill_grid"]](pt.arena, pt.rank, pt.scale, pt.b_off[c], w_ext[c], pt.N,
                                                             0, **go_ip["fill"], num_warps=go_ip["fill_warps"])
                before(c, pt.x[c], K)  # x = the producer's output: what every route reads, and the reference
                xe[c][:, :K].copy_(pt.x[c])  # (o: the attention would write x there)

            def in_place(i, g=go_ip):
                before(i, xe[i], ke)
                xs(i, g)
                gemm_ext(i)

            # the shrink as a cuBLAS GEMM over the batch's A rows kept side by side (x @ A_cat.T), each
            # token's own slot's columns kept and scaled by one elementwise pass into [x | s]: timed only
            # (random A_cat and multipliers: the cost does not depend on the values)
            a_cat = torch.randn((LT.rank_rows(P), K), device="cuda").to(dt) * 0.01
            s_raw = [torch.empty((T, LT.rank_rows(P)), device="cuda", dtype=dt) for _ in range(pt.copies)]
            keep = (torch.rand((T, LT.rank_rows(P)), device="cuda") < 0.25).to(dt)

            def shrink_cublas(i):
                torch.matmul(xe[i][:, :K], a_cat.t(), out=s_raw[i])
                torch.mul(s_raw[i], keep, out=xe[i][:, K:K + LT.rank_rows(P)])

            cands = {"base": lambda i: (before(i, pt.x[i], K), pt.launch_gemm(i)),
                     "route·cublas shrink": lambda i: (before(i, xe[i], ke), shrink_cublas(i), gemm_ext(i)),
                     "shrink·cublas+keep": shrink_cublas,
                     "shrink·cublas alone": lambda i: torch.matmul(xe[i][:, :K], a_cat.t(), out=s_raw[i]),
                     "pair": lambda i: (before(i, pt.x[i], K), pt.launch_pair(i, go)),
                     "route·copy": lambda i: (before(i, pt.x[i], K), copy_x(i), xs(i, go_ip), gemm_ext(i)),
                     "route·in place": in_place,
                     "producer": lambda i: before(i, pt.x[i], K), "producer·xe": lambda i: before(i, xe[i], ke),
                     "pair's shrink": lambda i: pt.launch_shrink(i, go), "expand": lambda i: pt.launch_expand(i, go),
                     "cublas(K+cols)": gemm_ext, "copy of x": copy_x}
            plans = [(go_ip["shrink"]["BM"], go_ip["shrink"]["BK"], go_ip["split"])]
            cands[f"shrink·in place BM{plans[0][0]} BK{plans[0][1]} split{plans[0][2]} (compiled)"] = (
                lambda i: xs(i, go_ip))
            for bm in (16, 32, 64):
                for bk in (64, 128):
                    for target in (132, 264, 528):
                        tiles, per, split = LT.shrink_split(T, K // bk, bm, target=target, most=16)
                        g = dict(go_ip, shrink=dict(go_ip["shrink"], BM=bm, BK=bk, SPLIT_MAX=16), split=split,
                                 chunk=per * bk, shrink_grid=(tiles, split))
                        if (bm, bk, split) not in plans:
                            plans.append((bm, bk, split))
                            cands[f"shrink·in place BM{bm} BK{bk} split{split}"] = lambda i, g=g: xs(i, g)
            _check_deltas(torch, pt, name, cands, ("pair", "route·copy", "route·in place"))
            us = compare({k: (fn, pt.copies) for k, fn in cands.items()})
            shr = {k: v for k, v in us.items() if k.startswith("shrink·in place")}
            best = min(shr, key=shr.get)
            print(f"{name} T={T}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items() if k not in shr) +
                  f"; in-place shrink: compiled {shr[next(iter(shr))]:.1f}, best [{best}] {shr[best]:.1f}", flush=True)
            out.append(dict(linear=name, T=T, us=us))
            cli.write_results(Path(a.out), {"producers": out, "complete": False})
            del w_ext, xe, h, pt, s_raw
            torch.cuda.empty_cache()
    print("\nOne layer (the four linears), us:")
    labels = ["base", "pair", "route·copy", "route·in place", "route·cublas shrink"]
    print("| T | " + " | ".join(labels) + " | pair - base | copy - base | in place - base | cublas shrink - base |")
    print("|---|" + "---|" * (len(labels) + 4))
    for T in sorted({r["T"] for r in out}):
        rows = [r["us"] for r in out if r["T"] == T]
        tot = {k: sum(r[k] for r in rows) for k in labels}
        print(f"| {T} | " + " | ".join(f"{tot[k]:.1f}" for k in labels) +
              f" | {tot['pair'] - tot['base']:.1f} | {tot['route·copy'] - tot['base']:.1f} | "
              f"{tot['route·in place'] - tot['base']:.1f} | {tot['route·cublas shrink'] - tot['base']:.1f} |")
    cli.write_results(Path(a.out), {"producers": out, "complete": True})
    return 0


def summarize(rows, log=print):
    """Per point and per layer (the four linears summed): fused vs cuBLAS + the faster peer."""
    log("| dtype | adapters | T | linear | cublas us | fused us | cublas+vllm | cublas+sgl | fused / (cublas+peer) "
        "| LoRA cost fused | LoRA cost peer | err |")
    log("|" + "---|" * 12)
    layers = {}
    for r in rows:
        peer = min((r[k] for k in ("cublas+vllm", "cublas+sgl") if k in r), default=float("nan"))
        log(f"| {r['dtype']} | {r['N']} x r{r['r']} | {r['T']} | {r['linear']} | {r['cublas']:.1f} | {r['fused']:.1f} "
            f"| {r.get('cublas+vllm', float('nan')):.1f} | {r.get('cublas+sgl', float('nan')):.1f} "
            f"| {r['fused'] / peer:.2f} | {r['fused'] / r['cublas'] - 1:+.2f} | {peer / r['cublas'] - 1:+.2f} "
            f"| {r['err']:.1e} |")
        key = (r["dtype"], r["N"], r["r"], r["T"])
        acc = layers.setdefault(key, {k: 0.0 for k in CANDIDATES})
        for k in CANDIDATES:
            acc[k] += r.get(k, float("nan"))
    log("\nOne layer (qkv + o + gate_up + down):")
    log("| dtype | adapters | T | cublas us | fused us | min(cublas+peer) us | fused / (cublas+peer) | LoRA cost fused "
        "| LoRA cost peer |")
    log("|" + "---|" * 9)
    out = []
    for (dt, N, rk, T), s in layers.items():
        peer = min(s["cublas+vllm"], s["cublas+sgl"])
        rows = (f" (rank rows route: {s['fused(rows)']:.1f} us, {s['fused(rows)'] / peer:.2f}, "
                f"{s['fused(rows)'] / s['cublas'] - 1:+.3f})") if s["fused(rows)"] == s["fused(rows)"] else ""
        log(f"| {dt} | {N} x r{rk} | {T} | {s['cublas']:.1f} | {s['fused']:.1f} | {peer:.1f} | {s['fused'] / peer:.2f} "
            f"| {s['fused'] / s['cublas'] - 1:+.3f} | {peer / s['cublas'] - 1:+.3f} |{rows}")
        out.append(dict(dtype=dt, N=N, r=rk, T=T, **s))
    return out


def draw(layers, path):
    panels = {}
    for lay in layers:
        key = f"{lay['dtype']} {lay['N']} x r{lay['r']}"
        series = panels.setdefault(key, {"fused / cuBLAS": ([], []), "(cuBLAS + faster peer) / cuBLAS": ([], [])})
        series["fused / cuBLAS"][0].append(lay["T"])
        series["fused / cuBLAS"][1].append(lay["fused"] / lay["cublas"])
        series["(cuBLAS + faster peer) / cuBLAS"][0].append(lay["T"])
        series["(cuBLAS + faster peer) / cuBLAS"][1].append(min(lay["cublas+vllm"], lay["cublas+sgl"]) / lay["cublas"])
        if lay.get("fused(rows)", float("nan")) == lay.get("fused(rows)"):  # measured past FUSED_MAX_TOKENS
            rows = series.setdefault("fused, rank rows route / cuBLAS", ([], []))
            rows[0].append(lay["T"])
            rows[1].append(lay["fused(rows)"] / lay["cublas"])
    return charts.lines(panels, path, title="One Llama-2-7B layer's linears with LoRA, time / the base GEMMs (H200)",
                        xlabel="tokens", ylabel="x base GEMMs", hline=1.0)


def run(a) -> int:
    import torch  # pylint: disable=import-outside-toplevel

    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT  # pylint: disable=import-outside-toplevel

    peers, why = peers_mod.load_peers(Path(a.peers), False)
    if peers is None:
        print(f"peers: {why}")
    rows = []
    for dt in a.dtypes.split(","):
        for ad in a.adapters.split(","):
            N, r = map(int, ad.split("x"))
            if N * r > LT.RANK_COLUMNS:
                raise SystemExit(f"{ad}: ranks sum to {N * r} > {LT.RANK_COLUMNS}, the fused kernel's rank columns")
            for T in map(int, a.tokens.split(",")):
                for name in a.linears.split(","):
                    row = run_point(torch, peers, LT, name, T, N, r, dt, seed=T * 131 + N * 7 + r)
                    print(f"{dt} {N}x r{r} T={T} {name}: " + " ".join(
                        f"{k} {row[k]:.1f}" for k in CANDIDATES if k in row) + f" err {row['err']:.1e}", flush=True)
                    if not row["err"] < TOL or not (row["err_rows"] is None or row["err_rows"] < TOL):
                        raise SystemExit(f"the fused kernel's output is off: {row['err']:.2e} (rank rows route: "
                                         f"{row['err_rows']})")
                    rows.append(row)
    layers = summarize(rows)
    out = cli.write_results(Path(a.out), {"rows": rows, "layers": layers})
    draw(layers, out.with_suffix(".png"))
    print(f"results: {out}")
    return 0


def plot(a) -> int:
    doc = cli.read_results([a.results])[0]
    layers = summarize(doc["rows"])
    draw(layers, Path(a.results).with_suffix(".png"))
    return 0


def main(argv=None) -> int:
    ap, sub = cli.parser(__doc__, __file__)
    r = sub.add_parser("run", help="time the candidates (the GPU)")
    r.add_argument("--tokens", default="1,16,64,128,256,1024,4096")
    r.add_argument("--adapters", default="4x8,2x16", help="NxR, comma-separated (ranks summing to <= 32)")
    r.add_argument("--dtypes", default="bfloat16,float16")
    r.add_argument("--linears", default=",".join(LINEARS))
    r.add_argument("--peers", default=str(peers_mod.PEERS_DIR), help="the peer kernels' folder")
    r.add_argument("--out", default="bench_lora_fused.json")
    t = sub.add_parser("tune", help="time tile shapes of our kernels per linear and token count (the GPU)")
    t.add_argument("--tokens", default="1,16,64,128,256,1024,4096")
    t.add_argument("--linears", default=",".join(LINEARS))
    t.add_argument("--dtype", default="float16")
    t.add_argument("--shapes", default="default", choices=("default", "splitk", "tma"),
                   help="the one-kernel linear's shapes to try: the tuned set, or splits aimed at the memory; "
                        "tma: the GEMM alone with its tiles loaded by TMA (tma_gemm_kernel) against cuBLAS")
    t.add_argument("--out", default="bench_lora_fused_tune.json")
    o = sub.add_parser("routes", help="time the routes a linear could take with its delta (the GPU)")
    o.add_argument("--tokens", default="16,64,128,256,512,1024,2048")
    o.add_argument("--linears", default=",".join(LINEARS))
    o.add_argument("--dtype", default="float16")
    o.add_argument("--out", default="bench_lora_fused_routes.json")
    q = sub.add_parser("producers", help="the rank columns route with x's producer writing into [x | s] (the GPU)")
    q.add_argument("--tokens", default="128,256,512,1024")
    q.add_argument("--linears", default=",".join(LINEARS))
    q.add_argument("--dtype", default="float16")
    q.add_argument("--out", default="bench_lora_fused_producers.json")
    p = sub.add_parser("plot", help="tables and chart of a results file (here)")
    p.add_argument("results")
    a = cli.parse(ap, argv)
    return {"run": run, "tune": tune, "routes": routes, "producers": producers, "plot": plot}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
