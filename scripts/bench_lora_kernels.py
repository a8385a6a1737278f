"""LoRA kernels on the GPU: ours and the peers' side by side, in one process, with one timing method.

For each sweep point (a linear of a Llama-2-7B layer; T tokens on uniformly random slots of N
adapters of rank r; fp16 or bf16) the base GEMM (torch.matmul = cuBLAS), every LoRA backend of
ours and the peers' (BACKENDS below: stage 2 `gather`, stage 3 `sgmv` as TIR kernels and as the CUDA
kernels of compiler_passes/ops/lora/sgmv.cu; vLLM 0.34's V1 Triton shrink/expand and SGLang
0.5.23's chunked SGMV) are first checked against a float64 reference (relative error printed),
then timed together by scripts/harness/timing.py: one CUDA graph per candidate over copies of
x, y and the adapters rotated past the L2 (>= 256 MB), the replays interleaved. Printed: us per
call, the best of ours / the best peer, and the memory-roofline share: the bytes that must move
(x read, y read + write, the A and B^T rows of the adapters the tokens use) at 4.2 TB/s.
`layer` does the same for all seven LoRA modules of one Llama-2-7B layer at once against the
layer's four base GEMMs (each candidate runs the GEMMs, then its LoRA; its cost is the difference).

  compile (here, no GPU):  python scripts/bench_lora_kernels.py compile --out lora_k.so
  plan (here):             python scripts/bench_lora_kernels.py plan [SELECTION] --parts 6
  run (the GPU machine):   python scripts/bench_lora_kernels.py run --lib lora_k.so --log-dir DIR [SELECTION] [--part 1/6]
  one Llama-2-7B layer:    python scripts/bench_lora_kernels.py layer --lib lora_k.so --log-dir DIR
  tile configurations:     ... run ... --triton-jit model,L5=32/8/128/4/4/3 (the Triton stage 3 JIT-compiled
                           on the GPU with each, beside the rest: how sgmv_triton.VARIANTS are picked)
  table + chart (here):    python scripts/bench_lora_kernels.py plot DIR/bench_lora_kernels*.json --out F.svg
  CPU dry run (tiny shapes, TIR kernels on llvm, the peers under Triton's interpreter if importable):
                           python scripts/bench_lora_kernels.py compile --target llvm --out k.so
                           python scripts/bench_lora_kernels.py run --lib k.so --dry-run [--log-dir DIR]

SELECTION: --shapes 4096x4096,... --tokens 1,16,... --adapters 1,4,... --ranks 8,16,64,mixed
--dtypes float16,bfloat16 [--grouped] (the default: all of SHAPES x TOKENS x ADAPTERS x RANKS x
DTYPES; the mixed ranks 8/16/32/64 run ours only). The peers (harness/peers.py): vLLM 0.34's and
SGLang 0.5.23's LoRA Triton kernels as their PyPI wheels ship them, imports patched to run alone,
with the call wrappers of `bench_peers_sgl.py`, in `.dev/peers` or --peers DIR (not part of this
repository; carry the folder to the GPU machine); --no-peers runs ours alone. They run fp16 and
bf16, as ours.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from harness import cli, peers as peers_mod, plot as charts
from harness.timing import PEAK_BW, compare, copies_for
from harness.workload import arena_tables, int8_arena_tables, lora_weights, mixed_ranks, token_slots

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]  # (in, out)
TOKENS = [1, 16, 64, 256, 1024, 4096]
ADAPTERS = [1, 4, 16, 64]
MIXED = "mixed"
RANKS = [8, 16, 64, MIXED]
DTYPES = ["float16", "bfloat16"]
COMPILED_RANKS = (8, 16, 64)  # max ranks the library is built for; a point runs the smallest >= its ranks
# A Llama-2-7B layer: fused linear -> (in, the parts' widths); the parts are modules 0..6 in order
# q, k, v, o, gate, up, down.
LAYER = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
         "down": (11008, (4096,))}
LAYER_TOKENS = [1, 16, 32, 64, 256, 1024]
LAYER_ADAPTERS = [(4, 8), (16, 16)]  # (N, r)
LAYER_CALLS = 4  # calls per graph in `layer`: each runs the layer's 1.1 GB of GEMMs, L2 is flushed anyway
# The CPU dry run: the same code on tiny shapes.
DRY = dict(shapes=[(64, 96), (96, 64)], tokens=[1, 5, 17], adapters=[1, 4], ranks=[8, 16, MIXED],
           dtypes=["float16"], layer={"qkv": (64, (64, 32, 32)), "o": (64, (64,)), "gate_up": (64, (96, 96)),
                                      "down": (96, (64,))}, layer_tokens=[3, 17])
TRITON_SLOTS = 256  # the tensor-core kernels are built for up to this many slots (a model: its max batch size)
SCALE = 0.5  # every adapter's LoRA scale (not 1: the check sees scaling)
TOL = 2e-2  # relative error of the delta against float64 (fp16 ~1e-3, bf16 ~4e-3 expected)
ELT = 2  # bytes per fp16 / bf16 element
DT = {"float16": "f16", "bfloat16": "bf16"}
PEERS_DIR = peers_mod.PEERS_DIR


# --- sweep ----------------------------------------------------------------------------------------


def compiled_rank(r: int) -> int:
    fits = [c for c in COMPILED_RANKS if c >= r]
    if not fits:
        raise ValueError(f"rank {r} is above the compiled ranks {COMPILED_RANKS}")
    return fits[0]


@dataclasses.dataclass(frozen=True)
class Point:
    """One sweep point: y (T, out) += scale * (x @ A[s]^T) @ B[s]^T, s = the token's adapter slot."""

    in_f: int
    out_f: int
    T: int
    N: int
    r: int | str  # a rank, or MIXED (8, 16, 32, 64 in turn)
    dtype: str
    grouped: bool = False

    @property
    def ranks(self) -> list[int]:
        return mixed_ranks(self.N) if self.r == MIXED else [self.r] * self.N

    @property
    def R(self) -> int:  # pylint: disable=invalid-name
        return compiled_rank(max(self.ranks))

    @property
    def shape(self) -> str:
        return f"{self.in_f}x{self.out_f}"

    @property
    def seed(self) -> int:
        return zlib.crc32(repr(dataclasses.astuple(self)).encode())

    def label(self) -> str:
        return (f"{self.shape} {DT[self.dtype]} T={self.T} N={self.N} r={self.r}"
                + (" grouped" if self.grouped else ""))


def sweep(shapes=None, tokens=None, adapters=None, ranks=None, dtypes=None, grouped=False) -> list[Point]:
    """The points of the selection, in run order (dtype, shape, rank, N, T: the Triton kernels of one
    configuration compile once). Mixed ranks need N >= 4 (one of each)."""
    return [Point(i, o, t, n, r, d, grouped)
            for d in dtypes or DTYPES for i, o in shapes or SHAPES for r in ranks or RANKS
            for n in adapters or ADAPTERS for t in tokens or TOKENS if r != MIXED or n >= 4]


def estimate_s(p: Point, n_backends: int = 6) -> float:
    """Rough device seconds of one point: weights made, each candidate's calls made once eagerly and
    captured (host-bound, ~120 us a call for the peers' Python wrappers), 20 replays of its calls
    (bytes at 2.5 TB/s + launches), the float64 check, the base GEMM alike, and 1 s for the peers'
    Triton kernels of new configurations (compiled on first use) and the host's bookkeeping."""
    per_copy = ELT * (p.T * (p.in_f + p.out_f) + p.N * p.R * (p.in_f + p.out_f))
    n = copies_for(per_copy)
    used = min(p.N, p.T)
    call_us = 10 + 1e6 * ELT * (p.T * (p.in_f + 2 * p.out_f) + used * max(p.ranks) * (p.in_f + p.out_f)) / 2.5e12
    lora = n * 120e-6 + 21 * n * call_us * 1e-6
    w_bytes = ELT * p.in_f * p.out_f
    nw = copies_for(w_bytes + ELT * p.T * (p.in_f + p.out_f))
    gemm_us = 8 + max(1e6 * w_bytes / 3.5e12, 1e6 * 2 * p.T * p.in_f * p.out_f / 600e12)
    base = nw * 60e-6 + 21 * nw * gemm_us * 1e-6
    setup = 3 * n * per_copy / 50e9 + used * 2e-3  # weights, layouts, the per-adapter reference
    return 1.0 + setup + base + n_backends * lora


def split_parts(points: list[Point], parts: int) -> list[list[Point]]:
    """`parts` consecutive runs of points of about equal estimated time."""
    total = sum(estimate_s(p) for p in points)
    out, acc = [[] for _ in range(parts)], 0.0
    for p in points:
        k = min(parts - 1, int(acc / total * parts)) if total else 0
        out[k].append(p)
        acc += estimate_s(p)
    return out


def min_bytes(p: Point, used) -> int:
    """Bytes that must move: x read, y read + write, the A and B^T rows of the adapters used."""
    return ELT * (p.T * p.in_f + 2 * p.T * p.out_f + sum(p.ranks[s] for s in used) * (p.in_f + p.out_f))


# --- ours: the library --------------------------------------------------------------------------


TILES_FN = "ttiles"  # the library's Triton tile-table function


def _tile_table(pb_env, order, start):
    """The tile table of the batch (order, start) from the library's function: the model lays it
    out once per step for every linear, so the timed calls read it as they do there."""
    t = pb_env.torch
    tiles = t.empty((_triton().tile_table_len(order.numel()),), dtype=t.int32, device=pb_env.device)
    _fn(pb_env.lib, TILES_FN)(order, start, tiles)
    return tiles


def fname(kind: str, dtype: str, R: int, i: int, o: int) -> str:  # pylint: disable=invalid-name
    return f"{kind}_{DT[dtype]}_r{R}_{i}x{o}"


def lname(kind: str, name: str, dtype: str, R: int) -> str:  # pylint: disable=invalid-name
    return f"l{kind}_{name}_{DT[dtype]}_r{R}"


def compile_lib(out: Path, target: str, dry: bool, ranks=None) -> None:
    """Every kernel of ours the sweep and `layer` call, both dtypes, every compiled rank, in one
    library: TIR stage 2 and stage 3 per (in, out) shape; on CUDA also the CUDA stage 3 per shape and
    per fused linear of the layer (the nvcc-built kernels imported into the library)."""
    from harness import compiler as C  # pylint: disable=import-outside-toplevel

    tgt = C.target(target)
    shapes = DRY["shapes"] if dry else SHAPES
    layer = DRY["layer"] if dry else LAYER
    dtypes = DRY["dtypes"] if dry else DTYPES
    pairs = sorted(set(shapes) | {(i, w) for i, ws in layer.values() for w in ws})
    funcs, imports = {}, []
    if target == "cuda":  # the tile table the Triton kernels read (laid out once per batch)
        funcs[TILES_FN], ms = C.sgmv_triton.tiles_wrapper(TRITON_SLOTS, C.ARCH)
        imports += ms
    for dtype in dtypes:
        for R in ranks or COMPILED_RANKS:
            for i, o in pairs:
                funcs[fname("gather", dtype, R, i, o)] = C.gather_tir.lora_gather_kernel(i, o, 0, 1, R, 1, dtype, tgt)
                funcs[fname("shrink", dtype, R, i, o)] = C.sgmv_tir.lora_sgmv_shrink_kernel(i, 0, 1, R, 1, dtype, tgt)
                funcs[fname("expand", dtype, R, i, o)] = C.sgmv_tir.lora_sgmv_expand_kernel(i, o, 0, 1, R, 1, dtype, tgt)
                if target == "cuda":
                    funcs[fname("cshrink", dtype, R, i, o)] = C.sgmv_cuda.shrink_wrapper(i, (0,), 1, R, 1, dtype)
                    funcs[fname("cexpand", dtype, R, i, o)] = C.sgmv_cuda.expand_wrapper(i, (o,), (0,), 1, R, 1, dtype)
                    sh, ms = C.sgmv_triton.shrink_wrapper(i, (0,), 1, R, 1, dtype, TRITON_SLOTS, 8, C.ARCH)
                    ex, me = C.sgmv_triton.expand_wrapper(i, (o,), (0,), 1, R, 1, dtype, TRITON_SLOTS, 8, C.ARCH)
                    funcs[fname("tshrink", dtype, R, i, o)], funcs[fname("texpand", dtype, R, i, o)] = sh, ex
                    imports += ms + me
            if target != "cuda":
                continue
            first = 0
            for name, (i, widths) in layer.items():
                mods = tuple(range(first, first + len(widths)))
                first += len(widths)
                funcs[lname("shrink", name, dtype, R)] = C.sgmv_cuda.shrink_wrapper(i, mods, 1, R, 7, dtype)
                funcs[lname("expand", name, dtype, R)] = C.sgmv_cuda.expand_wrapper(i, widths, mods, 1, R, 7, dtype)
                sh, ms = C.sgmv_triton.shrink_wrapper(i, mods, 1, R, 7, dtype, TRITON_SLOTS, 8, C.ARCH)
                ex, me = C.sgmv_triton.expand_wrapper(i, widths, mods, 1, R, 7, dtype, TRITON_SLOTS, 8, C.ARCH)
                funcs[lname("tshrink", name, dtype, R)], funcs[lname("texpand", name, dtype, R)] = sh, ex
                imports += ms + me
            # a TIR-only build ignores the IRModule's external_mods (relax.build links them): import
            imports.append(C.sgmv_cuda.build_module(dtype, R, C.ARCH))
    C.build_library(funcs, out, tgt, imports)
    print(f"built {out}: {len(funcs)} functions")


def _fn(lib, name: str):
    """The library's function `name`, or a KeyError naming it (an older library, another target)."""
    try:
        return lib[name]
    except Exception as e:  # pylint: disable=broad-except  (tvm raises its own error kinds)
        raise KeyError(f"the library has no {name} (rebuild it with `compile`)") from e


# --- the problems on the device ------------------------------------------------------------------


class Env:
    """What the backends run with: torch, the device, our library, the peers' module."""

    def __init__(self, torch, device, lib, peers, max_copies, reps):
        self.torch, self.device, self.lib, self.peers = torch, device, lib, peers
        self.max_copies, self.reps = max_copies, reps

    def sync(self):
        if self.device != "cpu":
            self.torch.cuda.synchronize()


def rel_err(got, ref) -> float:
    den = ref.norm().item()
    return (got.double() - ref).norm().item() / den if den else float("inf")


class Linear:
    """One point's data, in both layouts, rotated over `copies`: x[c] (T, in), y[c] (T, out), A[c]
    (N, R, in), B[c] (N, out, R) for the peers; the same rows in one arena with offset tables
    a_off[c], b_off[c] (N, 1, R) for ours; the float64 delta of copy 0 (`ref`)."""

    def __init__(self, env: Env, p: Point):
        t, dev = env.torch, env.device
        dtype = getattr(t, p.dtype)
        self.p, self.env = p, env
        per_copy = ELT * (p.T * (p.in_f + p.out_f) + p.N * p.R * (p.in_f + p.out_f))
        self.copies = copies_for(per_copy, max_copies=env.max_copies)
        self.A, self.B = lora_weights(t, self.copies, p.ranks, p.in_f, p.out_f, dtype, dev, p.seed, p.R)
        self.arena, a_off, b_off = arena_tables(t, [(self.A, self.B)], dev)
        self.a_off, self.b_off = list(a_off), list(b_off)  # per copy (N, 1, R), contiguous
        g = t.Generator(device=dev).manual_seed(p.seed + 1)
        self.x = t.randn((self.copies, p.T, p.in_f), generator=g, device=dev, dtype=t.float32).to(dtype)
        self.y = t.zeros((self.copies, p.T, p.out_f), device=dev, dtype=dtype)
        slot = token_slots(p.T, p.N, p.seed, p.grouped)
        self.used = sorted(set(slot.tolist()))
        self.slot = t.from_numpy(slot).to(dev)
        self.slot64 = self.slot.long()
        self.rank = t.tensor(p.ranks, dtype=t.int32, device=dev)
        self.scale = t.full((p.N, 1), SCALE, dtype=t.float32, device=dev)
        nw = copies_for(ELT * (p.in_f * p.out_f + p.T * (p.in_f + p.out_f)), max_copies=env.max_copies)
        self.W = t.randn((nw, p.out_f, p.in_f), generator=g, device=dev, dtype=t.float32).to(dtype) * p.in_f ** -0.5
        self.ref = t.zeros((p.T, p.out_f), dtype=t.float64, device=dev)
        x0 = self.x[0].double()
        for s in self.used:
            idx = t.nonzero(self.slot64 == s).squeeze(1)
            r = p.ranks[s]
            self.ref[idx] = SCALE * (x0[idx] @ self.A[0, s, :r].double().T) @ self.B[0, s, :, :r].double().T

    def int8_tables(self):
        """(arena, a_off per copy, b_off per copy) of the same rows as int8 rows, made on first use."""
        if not hasattr(self, "_int8"):
            arena, a_off, b_off = int8_arena_tables(self.env.torch, [(self.A, self.B)], self.env.device,
                                                    self.arena.dtype)
            self._int8 = (arena, list(a_off), list(b_off))  # pylint: disable=attribute-defined-outside-init
        return self._int8

    def base(self):
        t, nw = self.env.torch, self.W.shape[0]
        return lambda c: t.matmul(self.x[c % self.copies], self.W[c % nw].T)

    def check(self, call) -> float:
        """y[0] zeroed, one call: its delta against the float64 reference."""
        self.y[0].zero_()
        call(0)
        self.env.sync()
        return rel_err(self.y[0], self.ref)


def _gather(pb: Linear):
    p = pb.p
    f = _fn(pb.env.lib, fname("gather", p.dtype, p.R, p.in_f, p.out_f))
    return lambda c: f(pb.x[c], pb.arena, pb.slot, pb.rank, pb.scale, pb.a_off[c], pb.b_off[c], 0, pb.y[c])


def _sgmv_tir(pb: Linear):
    p, t = pb.p, pb.env.torch
    shrink = _fn(pb.env.lib, fname("shrink", p.dtype, p.R, p.in_f, p.out_f))
    expand = _fn(pb.env.lib, fname("expand", p.dtype, p.R, p.in_f, p.out_f))
    v = t.empty((p.T, -(-p.in_f // 512), p.R), dtype=t.float32, device=pb.env.device)

    def call(c):
        shrink(pb.x[c], pb.arena, pb.slot, pb.rank, pb.scale, pb.a_off[c], 0, v)
        expand(v, pb.arena, pb.slot, pb.rank, pb.b_off[c], 0, pb.y[c])
    return call


def _sgmv_cuda(pb: Linear):
    p, t = pb.p, pb.env.torch
    shrink = _fn(pb.env.lib, fname("cshrink", p.dtype, p.R, p.in_f, p.out_f))
    expand = _fn(pb.env.lib, fname("cexpand", p.dtype, p.R, p.in_f, p.out_f))
    v = t.empty((p.T, 1, -(-p.in_f // 512), p.R), dtype=t.float32, device=pb.env.device)
    order, _ = _sorted_tables(t, pb.slot, p.N, pb.env.device)  # the tiling order, as the pool gives it

    def call(c):
        shrink(pb.x[c], pb.arena, pb.slot, order, pb.rank, pb.scale, pb.a_off[c], 0, v)
        expand(v, pb.arena, pb.slot, order, pb.rank, pb.scale, pb.b_off[c], 0, pb.y[c])  # y += delta
    return call


def _model_capacity(T: int) -> int:
    """The slot table's slots a model passes for T tokens: its max batch size in decode's CUDA
    graphs (T <= SMALL_MAX_TOKENS), the batch's own slots above (prefill; 0 here: N)."""
    return TRITON_SLOTS if T <= _triton().SMALL_MAX_TOKENS else 0


def _sorted_tables(t, slot, n_slots: int, dev, capacity: int = 0):
    """lora_token_order and lora_slot_start of a batch, as the pool builds them (contract.py): the
    tokens sorted by slot, stable, and each slot's first position (every slot here has a token or
    none; no base-model tokens), slot_start padded to `capacity` slots as a model's table is (its
    max batch size). numpy here: the GPU machine's TVM has no compiler to import."""
    s = slot.cpu().numpy()
    order = np.argsort(s, kind="stable").astype(np.int32)
    start = np.concatenate([[0], np.cumsum(np.bincount(s, minlength=max(n_slots, capacity)))]).astype(np.int32)
    return t.from_numpy(order).to(dev), t.from_numpy(start).to(dev)


def _triton():
    """compiler_passes/ops/lora/sgmv_triton.py (it imports with TVM's runtime alone)."""
    from mlc_lora.compiler_passes.ops.lora import sgmv_triton  # pylint: disable=import-outside-toplevel

    return sgmv_triton


def _sgmv_triton(pb: Linear):
    """The tensor-core stage 3 (Triton) as the model runs it: tokens sorted by slot on the host, the
    slot table as large as a model's."""
    p, t = pb.p, pb.env.torch
    shrink = _fn(pb.env.lib, fname("tshrink", p.dtype, p.R, p.in_f, p.out_f))
    expand = _fn(pb.env.lib, fname("texpand", p.dtype, p.R, p.in_f, p.out_f))
    order, start = _sorted_tables(t, pb.slot, p.N, pb.env.device, _model_capacity(p.T))
    tiles = _tile_table(pb.env, order, start)
    v = t.empty((p.T, 1, _triton().max_chunks(p.in_f), p.R), dtype=t.float32, device=pb.env.device)

    def call(c):
        shrink(pb.x[c], pb.arena, order, start, tiles, pb.rank, pb.scale, pb.a_off[c], 0, v)
        expand(v, pb.arena, order, start, tiles, pb.rank, pb.scale, pb.b_off[c], 0, pb.y[c])  # y += delta
    return call


def triton_jit(cfg: dict | None, rows: str = "model"):
    """A backend maker: the Triton stage 3 of compiler_passes/ops/lora/sgmv_triton.py JIT-compiled
    here with tile configuration `cfg` (VARIANTS' keys; None: the variant the model runs for the
    point's token count), launched as its TIR wrapper launches it (grid_x, constants) over a
    model-sized slot table: tile configurations timed beside the library and the peers. `rows`
    "int8": the same adapters' rows as int8 rows (--lora-rows int8) in an arena of their own."""

    def make(pb: Linear):
        ST = _triton()  # pylint: disable=invalid-name
        p, t = pb.p, pb.env.torch
        order, start = _sorted_tables(t, pb.slot, p.N, pb.env.device, _model_capacity(p.T))
        slots = len(start) - 1
        var = ST.variant_for(p.T, slots)
        c = cfg or ST.VARIANTS[var]
        sc, sy = ST.constants("shrink", var, p.in_f, (0,), None, p.R, 1, TRITON_SLOTS, 8, c, rows)
        ec, ey = ST.constants("expand", var, p.in_f, (0,), (p.out_f,), p.R, 1, TRITON_SLOTS, 8, c, rows)
        arena, a_off, b_off = pb.int8_tables() if rows == "int8" else (pb.arena, pb.a_off, pb.b_off)
        v = t.empty((p.T, 1, sc["CMAX"], p.R), dtype=t.float32, device=pb.env.device)
        tiles = t.empty((ST.tile_table_len(p.T),), dtype=t.int32, device=pb.env.device)  # once per batch
        ST.lora_tiles_kernel[(ST.tiles_grid(p.T, slots, c["BM"]),)](start, tiles, slots,
                                                                   **ST.tiles_constants(var, TRITON_SLOTS, c))
        gx, kw = ST.grid_x(p.T, slots, c["BM"]), dict(num_warps=c["num_warps"], num_stages=c["num_stages"])

        def call(k):
            ST.lora_shrink_kernel[(gx, sy)](pb.x[k], arena, order, tiles, pb.rank, pb.scale, a_off[k], v,
                                            p.T, 0, **sc, **kw)
            ST.lora_expand_kernel[(gx, ey)](v, arena, order, tiles, pb.rank, pb.scale, b_off[k], pb.y[k],
                                            p.T, 0, **ec, **kw)
        return call
    return make


def parse_triton_jit(spec: str) -> dict:
    """--triton-jit NAME=BM/SPLITS/BN/G/WARPS/STAGES[/RSPLIT[/BK[/MIN_STEPS[/GMIN]]]],... ("model": the
    model's variants; "int8": the model's variants over int8 rows) -> {backend: cfg}."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, vals = item.partition("=")
        if name == "model" and not vals:
            out["triton-jit-model"] = None
            continue
        if name == "int8" and not vals:  # the model's variants over int8 rows (triton_jit's rows)
            out["triton-jit-int8"] = None
            continue
        try:
            bm, splits, bn, g, warps, stages, *rest = (int(v) for v in vals.split("/"))
            if len(rest) > 4:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--triton-jit {item!r}: NAME=BM/SPLITS/BN/G/WARPS/STAGES[/RSPLIT[/BK[/MIN_STEPS[/GMIN]]]], "
                             "or model") from None
        cfg = dict(BM=bm, SPLITS=splits, BN=bn, G=g, num_warps=warps, num_stages=stages, RSPLIT=rest[0] if rest else 1)
        for key, val in zip(("BK", "MIN_STEPS", "GMIN"), rest[1:]):
            if val or key == "BK":  # MIN_STEPS / GMIN 0: not set (no more splits / groups of G for few tiles)
                cfg[key] = val
        out[f"triton-jit-{name}"] = cfg
    return out


def _vllm(pb: Linear):
    """vLLM's add_lora_linear for one slice (the peers' vllm_lora_linear), its token metadata made
    once per batch as vLLM does, outside the timed calls."""
    peers, p = pb.env.peers, pb.p
    meta = peers.LoRAKernelMeta.make(p.N, p.T, pb.env.device)
    meta.prepare_tensors(pb.slot64)
    a4 = [pb.A[c].unsqueeze(1) for c in range(pb.copies)]  # (N, 1, R, in): lora_a_stacked
    b4 = [pb.B[c].unsqueeze(1) for c in range(pb.copies)]  # (N, 1, out, R): lora_b_stacked
    return lambda c: peers.vllm_lora_linear(pb.y[c], pb.x[c], a4[c], b4[c], meta, SCALE)


def _sglang(pb: Linear):
    """SGLang's csgmv backend as RowParallelLinearWithLoRA calls it (the peers' sgl_lora_linear),
    its batch info prepared once per batch, outside the timed calls."""
    peers, p, t = pb.env.peers, pb.p, pb.env.torch
    backend = peers.ChunkedSgmvLoRABackend(p.N, pb.env.device, None)
    peers.sgl_prepare(backend, p.T, p.N, p.R, SCALE, pb.slot64.tolist())
    offsets = t.tensor([0, p.out_f], dtype=t.int32, device=pb.env.device)
    offsets_cpu = t.tensor([0, p.out_f], dtype=t.int32)
    return lambda c: peers.sgl_lora_linear(pb.y[c], pb.x[c], pb.A[c], pb.B[c], backend, offsets, offsets_cpu)


# --- the layer ------------------------------------------------------------------------------------


class Layer:
    """All seven LoRA modules of a layer (`layer`: {fused name: (in, widths)}) for T tokens on N
    adapters of rank r: per module m, A_m[c] (N, R, in), B_m[c] (N, w, R); one arena and tables
    (N, 7, R) per copy for ours; per fused linear x[name][c], y[name][c] and the base weights
    W[name][c % 2]; the float64 deltas of copy 0 per fused linear (`ref`)."""

    def __init__(self, env: Env, layer: dict, T: int, N: int, r: int, dtype: str):  # pylint: disable=invalid-name
        t, dev = env.torch, env.device
        tdt = getattr(t, dtype)
        self.env, self.layer, self.T, self.N, self.r, self.dtype, self.R = env, layer, T, N, r, dtype, compiled_rank(r)
        self.copies = LAYER_CALLS
        seed = zlib.crc32(repr((T, N, r, dtype)).encode())
        self.mods, first = {}, 0  # fused name -> [(module index, width)]
        for name, (_, widths) in layer.items():
            self.mods[name] = [(first + k, w) for k, w in enumerate(widths)]
            first += len(widths)
        ins = [layer[name][0] for name in layer for _ in layer[name][1]]
        widths = [w for _, ws in layer.values() for w in ws]
        self.ab = [lora_weights(t, self.copies, [r] * N, i, w, tdt, dev, seed + m, self.R)
                   for m, (i, w) in enumerate(zip(ins, widths))]
        self.arena, a_off, b_off = arena_tables(t, self.ab, dev)
        self.t7 = [(a_off[c], b_off[c]) for c in range(self.copies)]
        self.t1 = [[(a_off[c][:, m:m + 1].contiguous(), b_off[c][:, m:m + 1].contiguous()) for m in range(len(ins))]
                   for c in range(self.copies)]
        g = t.Generator(device=dev).manual_seed(seed + 99)
        self.x = {n: t.randn((self.copies, T, i), generator=g, device=dev, dtype=t.float32).to(tdt)
                  for n, (i, _) in layer.items()}
        self.y = {n: t.zeros((self.copies, T, sum(ws)), device=dev, dtype=tdt) for n, (_, ws) in layer.items()}
        self.W = [{n: t.randn((sum(ws), i), generator=g, device=dev, dtype=t.float32).to(tdt) * i ** -0.5
                   for n, (i, ws) in layer.items()} for _ in range(2)]
        slot = token_slots(T, N, seed)
        self.slot = t.from_numpy(slot).to(dev)
        self.slot64 = self.slot.long()
        self.rank = t.full((N,), r, dtype=t.int32, device=dev)
        self.scale7 = t.full((N, len(ins)), SCALE, dtype=t.float32, device=dev)
        self.scale1 = t.full((N, 1), SCALE, dtype=t.float32, device=dev)
        self.ref = {}
        for name, parts in self.mods.items():
            x0 = self.x[name][0].double()
            d = t.zeros((T, sum(w for _, w in parts)), dtype=t.float64, device=dev)
            o = 0
            for m, w in parts:
                a, b = self.ab[m]
                for s in sorted(set(slot.tolist())):
                    idx = t.nonzero(self.slot64 == s).squeeze(1)
                    d[idx, o:o + w] = SCALE * (x0[idx] @ a[0, s].double().T) @ b[0, s].double().T
                o += w
            self.ref[name] = d

    def base(self, c):
        t = self.env.torch
        for name in self.layer:
            t.matmul(self.x[name][c], self.W[c % 2][name].T, out=self.y[name][c])

    def check(self, call) -> float:
        """One call (the GEMMs, then the LoRA) on copy 0: the largest relative error of a fused
        linear's delta against float64."""
        self.base(0)
        self.env.sync()
        y0 = {n: v[0].double() for n, v in self.y.items()}
        call(0)
        self.env.sync()
        return max(rel_err(self.y[n][0].double() - y0[n], self.ref[n]) for n in self.layer)


def _layer_tir(lp: Layer):
    """The TIR stage 3 as the model ran it: per module a shrink and an expand into its own delta,
    then torch.cat of a fused linear's parts and the add into the GEMM's output."""
    t, lib, dt, R = lp.env.torch, lp.env.lib, lp.dtype, lp.R
    fns, bufs = {}, {}
    for name, parts in lp.mods.items():
        i = lp.layer[name][0]
        fns[name] = [(m, _fn(lib, fname("shrink", dt, R, i, w)), _fn(lib, fname("expand", dt, R, i, w))) for m, w in parts]
        bufs[name] = (t.empty((lp.T, -(-i // 512), R), dtype=t.float32, device=lp.env.device),
                      [t.empty((lp.T, w), dtype=getattr(t, dt), device=lp.env.device) for _, w in parts])

    def call(c):
        lp.base(c)
        for name, parts in fns.items():
            v, deltas = bufs[name]
            for (m, shrink, expand), d in zip(parts, deltas):
                a, b = lp.t1[c][m]
                shrink(lp.x[name][c], lp.arena, lp.slot, lp.rank, lp.scale1, a, 0, v)
                expand(v, lp.arena, lp.slot, lp.rank, b, 0, d)
            lp.y[name][c].add_(t.cat(deltas, 1) if len(deltas) > 1 else deltas[0])
    return call


def _layer_cuda(lp: Layer):
    """The CUDA stage 3 as the model runs it: per fused linear one shrink and one in-place expand."""
    t, lib = lp.env.torch, lp.env.lib
    fns = {name: (_fn(lib, lname("shrink", name, lp.dtype, lp.R)), _fn(lib, lname("expand", name, lp.dtype, lp.R)),
                  t.empty((lp.T, len(parts), -(-lp.layer[name][0] // 512), lp.R), dtype=t.float32, device=lp.env.device))
           for name, parts in lp.mods.items()}
    order, _ = _sorted_tables(t, lp.slot, lp.N, lp.env.device)  # the tiling order, as the pool gives it

    def call(c):
        lp.base(c)
        a, b = lp.t7[c]
        for name, (shrink, expand, v) in fns.items():
            shrink(lp.x[name][c], lp.arena, lp.slot, order, lp.rank, lp.scale7, a, 0, v)
            expand(v, lp.arena, lp.slot, order, lp.rank, lp.scale7, b, 0, lp.y[name][c])
    return call


def _layer_triton(lp: Layer):
    """The tensor-core stage 3 (Triton) as the model runs it: per fused linear one shrink and one
    in-place expand over the tokens sorted by slot."""
    t, lib = lp.env.torch, lp.env.lib
    order, start = _sorted_tables(t, lp.slot, lp.N, lp.env.device, _model_capacity(lp.T))
    tiles = _tile_table(lp.env, order, start)
    fns = {name: (_fn(lib, lname("tshrink", name, lp.dtype, lp.R)), _fn(lib, lname("texpand", name, lp.dtype, lp.R)),
                  t.empty((lp.T, len(parts), _triton().max_chunks(lp.layer[name][0]), lp.R), dtype=t.float32,
                          device=lp.env.device))
           for name, parts in lp.mods.items()}

    def call(c):
        lp.base(c)
        a, b = lp.t7[c]
        for name, (shrink, expand, v) in fns.items():
            shrink(lp.x[name][c], lp.arena, order, start, tiles, lp.rank, lp.scale7, a, 0, v)
            expand(v, lp.arena, order, start, tiles, lp.rank, lp.scale7, b, 0, lp.y[name][c])
    return call


def vllm_fused(peers, torch, y, x, a_slices, b_slices, meta, scale):
    """vLLM 0.34's PunicaWrapperGPU.add_lora_linear for all slices of a fused linear (the peers'
    vllm_lora_linear is its one-slice case): one shrink into an fp32 buffer, one expand adding each
    slice into its columns of y."""
    t, r = x.size(0), b_slices[0].size(-1)
    buffer = torch.empty((len(a_slices), t, r), dtype=torch.float32, device=x.device)
    peers.lora_shrink(x, a_slices, buffer, *meta.meta_args(t, False), scale)
    peers.lora_expand(buffer, b_slices, y, *meta.meta_args(t, False), offset_start=0, add_inputs=True)


def _layer_vllm(lp: Layer):
    peers, t = lp.env.peers, lp.env.torch
    meta = peers.LoRAKernelMeta.make(lp.N, lp.T, lp.env.device)
    meta.prepare_tensors(lp.slot64)
    sl = [{name: (tuple(lp.ab[m][0][c].unsqueeze(1) for m, _ in parts), tuple(lp.ab[m][1][c].unsqueeze(1) for m, _ in parts))
           for name, parts in lp.mods.items()} for c in range(lp.copies)]

    def call(c):
        lp.base(c)
        for name, (a, b) in sl[c].items():
            vllm_fused(peers, t, lp.y[name][c], lp.x[name][c], a, b, meta, SCALE)
    return call


def _layer_sglang(lp: Layer):
    """SGLang's csgmv backend as its LoRA layers call it: run_qkv_lora (q|k|v), run_gate_up_lora
    (gate|up), and the one-slice form for o and down; A stacked along the rank, B along the output."""
    peers, t, dev = lp.env.peers, lp.env.torch, lp.env.device
    backend = peers.ChunkedSgmvLoRABackend(lp.N, dev, None)
    peers.sgl_prepare(backend, lp.T, lp.N, lp.R, SCALE, lp.slot64.tolist())
    offs = {}
    for name, parts in lp.mods.items():
        o = [0]
        for _, w in parts:
            o.append(o[-1] + w)
        offs[name] = (t.tensor(o, dtype=t.int32, device=dev), t.tensor(o, dtype=t.int32), max(w for _, w in parts))
    ab = [{name: (t.cat([lp.ab[m][0][c] for m, _ in parts], 1).contiguous(),
                  t.cat([lp.ab[m][1][c] for m, _ in parts], 1).contiguous()) for name, parts in lp.mods.items()}
          for c in range(lp.copies)]

    def call(c):
        lp.base(c)
        for name, (a, b) in ab[c].items():
            off, off_cpu, max_w = offs[name]
            y, x, parts = lp.y[name][c], lp.x[name][c], len(lp.mods[name])
            if parts == 3:
                backend.run_qkv_lora(x, a, b, off, max_w, base_output=y, n_slices=3, output_offset_cpu=off_cpu)
            elif parts == 2:
                backend.run_gate_up_lora(x, a, b, off, base_output=y, output_offset_cpu=off_cpu)
            else:
                peers.sgl_lora_linear(y, x, a, b, backend, off, off_cpu)
    return call


# --- the backends: adding one is one entry ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Backend:
    """family: "ours" or "peer"; linear(Linear) / layer(Layer) -> call(c), adding copy c's delta into
    y[c] (or writing it: gather and the TIR sgmv write the delta, as the model's TIR path did);
    cuda_only: no CPU version; mixed: takes adapters of mixed ranks."""

    family: str
    linear: object
    layer: object = None
    cuda_only: bool = False
    mixed: bool = True


BACKENDS = {
    "gather": Backend("ours", _gather),
    "sgmv-tir": Backend("ours", _sgmv_tir, _layer_tir),
    "sgmv-cuda": Backend("ours", _sgmv_cuda, _layer_cuda, cuda_only=True),
    "sgmv-triton": Backend("ours", _sgmv_triton, _layer_triton, cuda_only=True),
    "vllm": Backend("peer", _vllm, _layer_vllm, mixed=False),
    "sglang": Backend("peer", _sglang, _layer_sglang, mixed=False),
}


def why_not(b: Backend, env: Env, mixed: bool) -> str | None:
    """None when backend `b` can run here, else why not."""
    if b.family == "peer" and env.peers is None:
        return "no peers"
    if b.cuda_only and env.device == "cpu":
        return "CUDA only"
    if mixed and not b.mixed:
        return "mixed ranks: ours only"
    return None


def run_candidates(env: Env, problem, maker: str, mixed: bool, base, n_calls: int, say) -> dict:
    """Check every backend against the reference, then time the base (`n_calls` calls a graph) and the
    backends that passed (problem.copies calls) together. Returns {"us": {name: us per call},
    "err": {name: rel err}, "status": {name: "ok" | "FAIL" | "ERR: ..." | "skip: why"}}."""
    row = {"us": {}, "err": {}, "status": {}}
    cands = {"base": (base, n_calls)}
    for name, b in BACKENDS.items():
        make = getattr(b, maker)
        why = "not in this mode" if make is None else why_not(b, env, mixed)
        if why:
            row["status"][name] = f"skip: {why}"
            continue
        try:
            call = make(problem)
        except KeyError as e:  # a library built without this backend
            row["status"][name] = f"skip: {e.args[0]}"
            continue
        try:
            err = problem.check(call)
        except Exception as e:  # pylint: disable=broad-except  (one backend's failure never stops the sweep)
            row["status"][name] = f"ERR: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            say(f"  !! {name}: {row['status'][name]}")
            if "illegal" in str(e) or "unspecified launch failure" in str(e):
                raise
            continue
        row["err"][name] = err
        row["status"][name] = "ok" if err <= TOL else "FAIL"
        if err <= TOL:
            cands[name] = (call, problem.copies)
    row["us"] = compare(cands, env.device, env.reps)
    return row


def summary(row: dict) -> dict:
    """The figures of a row: the best of ours and of the peers (name, us), ours / peers, ours / base,
    and the roofline share of each best (linear rows)."""
    us = row["us"]
    fam = {n: BACKENDS[n].family for n in us if n in BACKENDS}
    lora = {n: (us[n] - us["base"] if row.get("mode") == "layer" else us[n]) for n in fam}
    best = {}
    for f in ("ours", "peer"):
        got = {n: v for n, v in lora.items() if fam[n] == f}
        best[f] = min(got.items(), key=lambda kv: kv[1]) if got else (None, math.nan)
    out = {"lora_us": lora, "ours": best["ours"], "peers": best["peer"],
           "ours_over_peers": best["ours"][1] / best["peer"][1] if best["peer"][0] and best["ours"][0] else math.nan,
           "ours_over_base": best["ours"][1] / us["base"] if best["ours"][0] else math.nan}
    if row.get("roof_us"):
        out["ours_roof"] = row["roof_us"] / best["ours"][1] if best["ours"][0] else math.nan
        out["peers_roof"] = row["roof_us"] / best["peer"][1] if best["peer"][0] else math.nan
    return out


def _f(v, fmt="{:.1f}"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def table(rows: list[dict]) -> str:
    """The markdown tables of kernel-sweep rows (mode "linear") and of layer rows (mode "layer")."""
    sections = []
    lin = [r for r in rows if r["mode"] == "linear"]
    if lin:
        names = list(BACKENDS)
        out = ["| shape | dtype | T | N | r | R | base us | " + " | ".join(f"{n} us" for n in names)
               + " | ours / peers | ours / base | ours % roof | peers % roof | worst rel err |",
               "|" + "---|" * (12 + len(names))]
        for r in lin:
            s = summary(r)
            out.append(f"| {r['shape']}{' grouped' if r.get('grouped') else ''} | {DT[r['dtype']]} | {r['T']} | {r['N']} "
                       f"| {r['r']} | {r['R']} | {_f(r['us'].get('base'))} | "
                       + " | ".join(_f(r["us"][n]) if n in r["us"] else _cell(r, n) for n in names)
                       + f" | {_f(s['ours_over_peers'], '{:.2f}')} | {_f(s['ours_over_base'], '{:.2f}')} "
                       f"| {_f(100 * s['ours_roof'], '{:.0f}')} | {_f(100 * s['peers_roof'], '{:.0f}')} "
                       f"| {_f(max(r['err'].values(), default=None), '{:.1e}')} |")
        sections.append("\n".join(out))
    lay = [r for r in rows if r["mode"] == "layer"]
    if lay:
        names = [n for n, b in BACKENDS.items() if b.layer is not None]
        out = ["| dtype | T | N | r | R | base GEMMs us | " + " | ".join(f"{n} LoRA us (x base)" for n in names)
               + " | ours / peers | worst rel err |", "|" + "---|" * (8 + len(names))]
        for r in lay:
            s = summary(r)
            cells = [f"{s['lora_us'][n]:.1f} ({s['lora_us'][n] / r['us']['base']:.2f})" if n in s["lora_us"]
                     else _cell(r, n) for n in names]
            out.append(f"| {DT[r['dtype']]} | {r['T']} | {r['N']} | {r['r']} | {r['R']} | {r['us']['base']:.1f} | "
                       + " | ".join(cells) + f" | {_f(s['ours_over_peers'], '{:.2f}')} "
                       f"| {_f(max(r['err'].values(), default=None), '{:.1e}')} |")
        sections.append("\n".join(out))
    return "\n\n".join(sections)


def _cell(row, name):
    st = row["status"].get(name, "")
    return "FAIL" if st == "FAIL" else "err" if st.startswith("ERR") else "-"


def line(row: dict) -> str:
    """One progress line of a row."""
    s = summary(row)
    times = ", ".join(f"{n} {v:.1f}" for n, v in row["us"].items())
    errs = ", ".join(f"{n} {v:.1e}" for n, v in row["err"].items())
    head = (f"{row['shape']} {DT[row['dtype']]} T={row['T']} N={row['N']} r={row['r']} (R={row['R']})"
            if row["mode"] == "linear" else f"layer {DT[row['dtype']]} T={row['T']} N={row['N']} r={row['r']} (R={row['R']})")
    roof = (f"; roofline {row['roof_us']:.1f} us: ours {_f(100 * s['ours_roof'], '{:.0f}')}%, peers "
            f"{_f(100 * s['peers_roof'], '{:.0f}')}%" if row.get("roof_us") else "")
    return (f"{head}: us {times}; best ours {s['ours'][0]} / best peer {s['peers'][0]} = "
            f"{_f(s['ours_over_peers'], '{:.2f}')}{roof}; rel err {errs}")


# --- run / layer / plan / plot ----------------------------------------------------------------------


def open_env(a, log) -> Env:
    import torch  # pylint: disable=import-outside-toplevel  (before TVM: its libcublas first)

    if a.dry_run:
        import tvm  # pylint: disable=import-outside-toplevel

        device, lib = "cpu", tvm.runtime.load_module(str(a.lib))
    else:
        tvm = cli.gpu_runtime()
        device, lib = "cuda", tvm.runtime.load_module(str(a.lib))
    peers, why = (None, "--no-peers") if a.no_peers else peers_mod.load_peers(Path(a.peers), a.dry_run)
    log.say(f"peers: {'vLLM ' + peers.VLLM_SOURCE['version'] + ', SGLang ' + peers.SGLANG_SOURCE['version'] if peers else why}")
    if peers is None and not a.no_peers and not a.dry_run:
        raise SystemExit(why)
    torch.manual_seed(0)
    return Env(torch, device, lib, peers, max_copies=2 if a.dry_run else 2048, reps=3 if a.dry_run else 20)


def _selection(a, dry: bool) -> list[Point]:
    def ints(v):
        return [int(x) for x in v.split(",")] if v else None

    if a.quick:
        return sweep([(4096, 4096)], None, [16], [16], ["float16"]) + sweep([(4096, 4096)], [64, 1024, 4096], [16], [16],
                                                                              ["float16"], grouped=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")] if a.shapes else None
    ranks = [r if r == MIXED else int(r) for r in a.ranks.split(",")] if a.ranks else None
    dtypes = a.dtypes.split(",") if a.dtypes else None
    if dry:
        shapes, ranks, dtypes = shapes or DRY["shapes"], ranks or DRY["ranks"], dtypes or DRY["dtypes"]
    points = sweep(shapes, ints(a.tokens) or (DRY["tokens"] if dry else None),
                   ints(a.adapters) or (DRY["adapters"] if dry else None), ranks, dtypes, a.grouped)
    bad = [d for d in dtypes or [] if d not in DT]
    if bad:
        raise SystemExit(f"unknown dtype {bad[0]!r}: float16 or bfloat16")
    return points


def _part(points, spec: str | None):
    if not spec:
        return points, ""
    k, n = (int(v) for v in spec.split("/"))
    if not 1 <= k <= n:
        raise SystemExit(f"--part {spec}: K/P with 1 <= K <= P")
    return split_parts(points, n)[k - 1], f"_part{k}of{n}"


def run(a) -> int:
    for name, cfg in parse_triton_jit(a.triton_jit or "").items():
        BACKENDS[name] = Backend("ours", triton_jit(cfg, "int8" if name == "triton-jit-int8" else "model"),
                                 cuda_only=not os.environ.get("TRITON_INTERPRET"))
    points, suffix = _part(_selection(a, a.dry_run), a.part)
    log = cli.Log(a.log_dir, "bench_lora_kernels" + suffix)
    env = open_env(a, log)
    est = sum(estimate_s(p) for p in points)
    log.say(f"{len(points)} points, estimated {est / 60:.1f} min of device time (+ the peers' Triton compiles); "
            f"stops after --budget-s {a.budget_s:.0f} s with the rows so far")
    rows, t0 = [], time.perf_counter()
    for k, p in enumerate(points):
        if a.budget_s and time.perf_counter() - t0 > a.budget_s:
            log.say(f"!! budget of {a.budget_s:.0f} s reached: {len(points) - k} points left out")
            break
        t1 = time.perf_counter()
        pb = Linear(env, p)
        row = dict(mode="linear", shape=p.shape, in_f=p.in_f, out_f=p.out_f, T=p.T, N=p.N, r=p.r, R=p.R,
                   dtype=p.dtype, grouped=p.grouped, copies=pb.copies, touched=len(pb.used),
                   bytes=min_bytes(p, pb.used), roof_us=min_bytes(p, pb.used) / PEAK_BW * 1e6)
        row.update(run_candidates(env, pb, "linear", p.r == MIXED, pb.base(), pb.W.shape[0], log.say))
        row["seconds"] = time.perf_counter() - t1
        rows.append(row)
        done = time.perf_counter() - t0
        left = sum(estimate_s(q) for q in points[k + 1:]) * (done / max(1e-9, sum(estimate_s(q) for q in points[:k + 1])))
        log.say(f"[{k + 1}/{len(points)} {row['seconds']:.1f} s, ~{left / 60:.1f} min left] {line(row)}")
        cli.write_results(log.json, {"mode": "linear", "rows": rows, "complete": False})
        del pb
        _release(env)
    log.say(table(rows))
    cli.write_results(log.json, {"mode": "linear", "rows": rows, "complete": len(rows) == len(points)})
    return 0


def run_layer(a) -> int:
    layer = DRY["layer"] if a.dry_run else LAYER
    tokens = [int(x) for x in a.tokens.split(",")] if a.tokens else (DRY["layer_tokens"] if a.dry_run else LAYER_TOKENS)
    dtypes = a.dtypes.split(",") if a.dtypes else (DRY["dtypes"] if a.dry_run else DTYPES)
    log = cli.Log(a.log_dir, "bench_lora_layer")
    env = open_env(a, log)
    rows = []
    for dtype in dtypes:
        for N, r in LAYER_ADAPTERS:
            for T in tokens:
                t1 = time.perf_counter()
                lp = Layer(env, layer, T, N, r, dtype)
                row = dict(mode="layer", dtype=dtype, T=T, N=N, r=r, R=lp.R)
                row.update(run_candidates(env, lp, "layer", False, lp.base, LAYER_CALLS, log.say))
                row["seconds"] = time.perf_counter() - t1
                rows.append(row)
                log.say(f"[{len(rows)}/{len(dtypes) * len(LAYER_ADAPTERS) * len(tokens)} {row['seconds']:.1f} s] {line(row)}")
                cli.write_results(log.json, {"mode": "layer", "rows": rows, "complete": False})
                del lp
                _release(env)
    log.say(table(rows))
    cli.write_results(log.json, {"mode": "layer", "rows": rows, "complete": True})
    return 0


def _release(env: Env) -> None:
    """After a point's data is dropped: the peers' caches keyed by tensor addresses, the allocator."""
    if env.peers is not None:
        env.peers.clear_vllm_ptr_caches()  # keyed by data_ptr: the next point's tensors may reuse them
        env.peers.sglang_lora.clear_kernel_caches()  # keyed without the rank
    if env.device != "cpu":
        env.torch.cuda.empty_cache()


def plan(a) -> int:
    points = _selection(a, False)
    total = sum(estimate_s(p) for p in points)
    print(f"{len(points)} points, estimated {total / 60:.1f} min of device time")
    for k, part in enumerate(split_parts(points, a.parts), 1):
        kinds = sorted({f"{p.shape} {DT[p.dtype]}" for p in part})
        print(f"  --part {k}/{a.parts}: {len(part)} points, ~{sum(estimate_s(p) for p in part) / 60:.1f} min "
              f"({', '.join(kinds)})")
    return 0


def plot(a) -> int:
    """The table of result files (kernel sweep and/or layer) and a chart of ours / peers per point."""
    rows = [r for doc in cli.read_results(a.results) for r in doc["rows"]]
    print(table(rows))
    lin = [r for r in rows if r["mode"] == "linear" and not r.get("grouped")]
    lay = [r for r in rows if r["mode"] == "layer"]
    out = Path(a.out)
    if lin:
        panels = {}
        for r in lin:
            s = summary(r)
            if math.isnan(s["ours_over_peers"]):
                continue
            xs, ys = panels.setdefault(f"{r['shape']} {DT[r['dtype']]}", {}).setdefault(f"N={r['N']} r={r['r']}", ([], []))
            xs.append(r["T"])
            ys.append(s["ours_over_peers"])
        charts.lines(panels, out, title="LoRA kernels: best of ours / best peer (< 1: ours faster)",
                     xlabel="tokens T", ylabel="ours / min(peers)", hline=1.0)
    if lay:
        panels = {}
        for r in lay:
            s = summary(r)
            for n, v in s["lora_us"].items():
                xs, ys = panels.setdefault(f"{DT[r['dtype']]}, {r['N']} x r{r['r']}", {}).setdefault(n, ([], []))
                xs.append(r["T"])
                ys.append(v / r["us"]["base"])
        charts.lines(panels, out.with_name(out.stem + "_layer" + out.suffix) if lin else out,
                     title="LoRA of a Llama-2-7B layer / its base GEMMs", xlabel="tokens T", ylabel="LoRA / base GEMMs")
    return 0


def main(argv=None) -> int:
    global COMPILED_RANKS  # pylint: disable=global-statement  (run --compiled-ranks: compiled_rank reads it)
    ap, sub = cli.parser(__doc__, __file__)
    c = cli.add_compile(sub, "the library of our kernels (here)", "the library (.so)")
    c.add_argument("--compiled-ranks", default=",".join(map(str, COMPILED_RANKS)),
                   help="max ranks to build the kernels for (a smaller library for a subset of the sweep)")
    c.add_argument("--target", choices=["cuda", "llvm"], default="cuda", help="llvm: the CPU dry run's (tiny shapes)")

    def selection(p):
        p.add_argument("--shapes", help="comma-separated INxOUT (default: 4096x4096,4096x11008,11008x4096)")
        p.add_argument("--tokens", help=f"comma-separated T (default: {','.join(map(str, TOKENS))})")
        p.add_argument("--adapters", help=f"comma-separated N (default: {','.join(map(str, ADAPTERS))})")
        p.add_argument("--ranks", help="comma-separated r, `mixed` for 8/16/32/64 in turn (default: 8,16,64,mixed)")
        p.add_argument("--dtypes", help="comma-separated (default: float16,bfloat16)")
        p.add_argument("--grouped", action="store_true", help="tokens sorted by slot (a prefill batch)")
        p.add_argument("--quick", action="store_true",
                       help="only 4096x4096 fp16, N=16, r=16 over T (random, and grouped at 64/1024/4096)")

    def device_args(p):
        p.add_argument("--lib", required=True, type=Path, help="the library of `compile`")
        p.add_argument("--peers", default=str(PEERS_DIR), help="the peer kernels' folder")
        p.add_argument("--no-peers", action="store_true", help="time ours alone")
        p.add_argument("--dry-run", action="store_true", help="on CPU, a `compile --target llvm` library, tiny shapes")
        p.add_argument("--compiled-ranks", help="the max ranks --lib was built for (compile's --compiled-ranks; "
                       f"default {','.join(map(str, COMPILED_RANKS))}): a point runs the smallest >= its ranks")

    r = cli.add_run(sub, "the kernel sweep (the GPU machine)", log_dir=".")
    device_args(r)
    selection(r)
    r.add_argument("--part", help="K/P: the K-th of P parts of the selection, of about equal estimated time")
    r.add_argument("--budget-s", type=float, default=540.0, help="stop after this many seconds (0: never)")
    r.add_argument("--triton-jit", help="also time the Triton stage 3 JIT-compiled here with these tile "
                   "configurations: NAME=BM/SPLITS/BN/G/WARPS/STAGES[/RSPLIT[/BK[/MIN_STEPS[/GMIN]]]],... or "
                   "`model` (the model's variant for each point's token count); how sgmv_triton.VARIANTS were picked")
    lay = cli.add_run(sub, "all seven modules of a Llama-2-7B layer vs its base GEMMs (the GPU machine)",
                      name="layer", log_dir=".")
    device_args(lay)
    lay.add_argument("--tokens", help=f"comma-separated T (default: {','.join(map(str, LAYER_TOKENS))})")
    lay.add_argument("--dtypes", help="comma-separated (default: float16,bfloat16)")
    pl = sub.add_parser("plan", help="the selection's points and estimated device time, split in parts (here)")
    selection(pl)
    pl.add_argument("--parts", type=int, default=1)
    pt = sub.add_parser("plot", help="the table and chart of result JSON files (here)")
    pt.add_argument("results", nargs="+")
    pt.add_argument("--out", required=True, help="the chart (.svg or .png)")
    a = cli.parse(ap, argv)
    if a.cmd in ("run", "layer") and a.compiled_ranks:
        COMPILED_RANKS = tuple(sorted(int(r) for r in a.compiled_ranks.split(",")))
    if a.cmd == "compile":
        compile_lib(a.out, a.target, a.target == "llvm", [int(r) for r in a.compiled_ranks.split(",")])
        return 0
    return {"run": run, "layer": run_layer, "plan": plan, "plot": plot}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
