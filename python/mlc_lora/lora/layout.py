"""Adapter rows in the unified page pool: the one place for the page arithmetic.

A page is `E = 2 * h_kv * 16 * head_dim` elements per layer (one KV page of one layer). An adapter
of rank r stores, for every module m it targets, `r` rows of A (length in_m) and `r` rows of B^T
(length out_m); a row never crosses a page and every layer uses the same layout. Rows are placed
best-fit-decreasing (longest rows first, each into the fullest page that still has room), which
lets short rows fill the tail of pages holding long ones. See docs/DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from ..contract import COLUMN_PARALLEL_MODULES, LORA_KERNELS, LORA_MODULES, PAGE_SIZE
from ..errors import LoraError



@dataclasses.dataclass(frozen=True)
class LoraModule:
    name: str
    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the model was compiled for: module list, max rank, page size, pool pages, kernel."""

    num_layers: int
    page_elems: int  # E
    modules: tuple[LoraModule, ...]
    max_rank: int
    pool_pages: int  # default pool size (KV + adapter pages); the compiled model takes any size
    kernel: str = "gather"
    # Tensor parallelism: `modules` and `page_elems` are one shard's; every shard's pool holds its
    # slices of each adapter (column-parallel modules: all of A, B split by output; row-parallel
    # ones: A split by input, all of B). See docs/TP.md.
    tensor_parallel_shards: int = 1

    @property
    def module_names(self) -> list[str]:
        return [m.name for m in self.modules]

    def index(self, name: str) -> int:
        return self.module_names.index(name)

    @property
    def arena_elems(self) -> int:
        return self.num_layers * self.pool_pages * self.page_elems

    def to_json(self) -> dict[str, Any]:
        return {
            "modules": [dataclasses.asdict(m) for m in self.modules],
            "max_rank": self.max_rank, "kernel": self.kernel, "pool_pages": self.pool_pages,
            "page_elems": self.page_elems, "num_layers": self.num_layers,
            "tensor_parallel_shards": self.tensor_parallel_shards,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoraSpec":
        return cls(num_layers=d["num_layers"], page_elems=d["page_elems"],
                   modules=tuple(LoraModule(**m) for m in d["modules"]), max_rank=d["max_rank"],
                   pool_pages=d["pool_pages"], kernel=d["kernel"],
                   tensor_parallel_shards=d.get("tensor_parallel_shards", 1))




def _shards(cfg) -> int:
    return getattr(cfg, "tensor_parallel_shards", 1)


def page_elems(cfg) -> int:
    """E: elements of one KV page of one layer (of one tensor-parallel shard)."""
    return 2 * (cfg.num_key_value_heads // _shards(cfg)) * PAGE_SIZE * cfg.head_dim


def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every Llama linear LoRA can target."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def shard_module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every module on one tensor-parallel shard."""
    k = _shards(cfg)
    return {n: (i, o // k) if n in COLUMN_PARALLEL_MODULES else (i // k, o)
            for n, (i, o) in module_shapes(cfg).items()}


def shard_adapter(adapter, shards: int, shard: int):
    """`adapter` (a `peft.LoraAdapter`) as shard `shard` of `shards` holds it: column-parallel
    modules keep A and take their output columns of B^T; row-parallel ones take their input
    columns of A and keep B^T (their partial products are summed by the base all-reduce)."""
    if shards == 1:
        return adapter
    weights = {}
    for (l, m), (a, bt) in adapter.weights.items():
        if m in COLUMN_PARALLEL_MODULES:
            bt = np.ascontiguousarray(np.split(bt, shards, axis=1)[shard])
        else:
            a = np.ascontiguousarray(np.split(a, shards, axis=1)[shard])
        weights[(l, m)] = (a, bt)
    return dataclasses.replace(adapter, weights=weights)


def make_spec(cfg, max_rank: int, pool_pages: int, target_modules: Sequence[str] | None = None,
              kernel: str = "gather") -> LoraSpec:
    """The LoRA part of a compile: validates the options against the model config."""
    names = list(target_modules or LORA_MODULES)
    bad = [n for n in names if n not in LORA_MODULES]
    if bad:
        raise LoraError(f"unknown LoRA target module(s) {bad}; choose from {', '.join(LORA_MODULES)}")
    if len(set(names)) != len(names):
        raise LoraError(f"duplicate LoRA target modules in {names}")
    if kernel not in LORA_KERNELS:
        raise LoraError(f"unknown LoRA kernel {kernel!r}; choose one of {', '.join(LORA_KERNELS)}")
    if max_rank < 1:
        raise LoraError(f"--max-lora-rank must be >= 1, got {max_rank}")
    if pool_pages < 1:
        raise LoraError(f"--lora-pool-pages must be >= 1, got {pool_pages}")
    shapes = shard_module_shapes(cfg)
    E = page_elems(cfg)
    mods = tuple(LoraModule(n, *shapes[n]) for n in LORA_MODULES if n in names)
    too_long = [m.name for m in mods if max(m.in_features, m.out_features) > E]
    if too_long:
        raise LoraError(f"rows of {too_long} are longer than a page ({E} elements); cannot page them")
    if pool_pages * E >= 2**31:
        raise LoraError(f"--lora-pool-pages {pool_pages} x page {E} elements exceeds 2^31 per layer")
    return LoraSpec(cfg.num_hidden_layers, E, mods, max_rank, pool_pages, kernel, _shards(cfg))


# ---------------------------------------------------------------------------------------------
# Row placement.


@dataclasses.dataclass
class AdapterLayout:
    """Where every row of one adapter lives: local page j and element offset inside the page."""

    rank: int
    page_elems: int
    num_pages: int
    # (module name, "A" | "B", k) -> local element offset = local_page * E + offset_in_page
    offsets: dict[tuple[str, str, int], int]
    used_elems: int

    @property
    def waste(self) -> int:
        """Elements per layer of the adapter's pages that hold no row."""
        return self.num_pages * self.page_elems - self.used_elems


def rows_per_page(E: int, row_len: int) -> int:
    return E // row_len


def layout_adapter(E: int, modules: Sequence[LoraModule], rank: int) -> AdapterLayout:
    """Best-fit-decreasing placement of the A and B^T rows of `modules` at `rank`."""
    rows = []
    for m in modules:
        if max(m.in_features, m.out_features) > E:
            raise LoraError(f"rows of {m.name} ({m.in_features}/{m.out_features}) exceed a page of {E}")
        rows += [(m.in_features, m.name, "A", k) for k in range(rank)]
        rows += [(m.out_features, m.name, "B", k) for k in range(rank)]
    # Stable: longest rows first, then module order, A before B, k ascending.
    rows.sort(key=lambda r: -r[0])
    free: list[int] = []  # free elements left in each local page
    offsets = {}
    for length, name, ab, k in rows:
        best = -1
        for j, f in enumerate(free):
            if f >= length and (best < 0 or f < free[best]):
                best = j
        if best < 0:
            free.append(E)
            best = len(free) - 1
        offsets[(name, ab, k)] = best * E + (E - free[best])
        free[best] -= length
    used = sum(r[0] for r in rows)
    return AdapterLayout(rank, E, len(free), offsets, used)


def lower_bound_pages(E: int, modules: Sequence[LoraModule], rank: int) -> int:
    return math.ceil(sum(rank * (m.in_features + m.out_features) for m in modules) / E)


# ---------------------------------------------------------------------------------------------
# Packing an adapter for the pool.


@dataclasses.dataclass
class PackedAdapter:
    """Input of `mlc_lora.runtime.pool_load_adapter(kv, id, pages, a_off, b_off, rank, scale, pin)`."""

    pages: np.ndarray  # [L, n, E] model dtype
    a_off: np.ndarray  # [M, R] int32, local offsets (local_page * E + offset_in_page), -1 unused
    b_off: np.ndarray  # [M, R] int32
    rank: int
    scale: np.ndarray  # [M] float32, 0 for modules the adapter does not target

    def ffi_args(self) -> tuple:
        """(pages, a_off, b_off, rank, scale) as pool_load_adapter takes them. numpy's DLPack has no
        code for ml_dtypes' bfloat16, so bfloat16 pages go as a TVM host tensor."""
        pages = self.pages
        if pages.dtype.name == "bfloat16":
            import tvm  # pylint: disable=import-outside-toplevel  (the runtime-only bundle has it too)

            pages = tvm.runtime.tensor(pages)
        return pages, self.a_off, self.b_off, self.rank, self.scale


def pack_adapter(spec: LoraSpec, adapter, dtype, shard: int = 0) -> PackedAdapter:
    """Put `adapter` (a `peft.LoraAdapter`) into page format for a model compiled with `spec`
    (under tensor parallelism: shard `shard`'s slices; every shard gets the same layout)."""
    if not 0 <= shard < spec.tensor_parallel_shards:
        raise LoraError(f"shard {shard} out of range for {spec.tensor_parallel_shards} shards")
    if adapter.rank > spec.max_rank:
        raise LoraError(f"adapter {adapter.name} has rank {adapter.rank}, above the compiled "
                        f"--max-lora-rank {spec.max_rank}")
    missing = [n for n in adapter.modules if n not in spec.module_names]
    if missing:
        raise LoraError(f"adapter {adapter.name} targets {missing}, which the model was not compiled "
                        f"for (compiled LoRA modules: {', '.join(spec.module_names)})")
    adapter = shard_adapter(adapter, spec.tensor_parallel_shards, shard)
    mods = [m for m in spec.modules if m.name in adapter.modules]
    lay = layout_adapter(spec.page_elems, mods, adapter.rank)
    L, E, M, R = spec.num_layers, spec.page_elems, len(spec.modules), spec.max_rank
    pages = np.zeros((L, lay.num_pages * E), dtype)
    a_off = np.full((M, R), -1, np.int32)
    b_off = np.full((M, R), -1, np.int32)
    scale = np.zeros((M,), np.float32)
    for mi, m in enumerate(spec.modules):
        if m.name not in adapter.modules:
            continue
        scale[mi] = adapter.scales[m.name]
        for k in range(adapter.rank):
            a_off[mi, k] = lay.offsets[(m.name, "A", k)]
            b_off[mi, k] = lay.offsets[(m.name, "B", k)]
        for l in range(L):
            w = adapter.weights.get((l, m.name))
            if w is None:  # layer not transformed: zero rows
                continue
            a, bt = w  # (r, in) and (r, out), already padded to adapter.rank and folded
            for k in range(adapter.rank):
                pages[l, a_off[mi, k]: a_off[mi, k] + m.in_features] = a[k]
                pages[l, b_off[mi, k]: b_off[mi, k] + m.out_features] = bt[k]
    return PackedAdapter(pages.reshape(L, lay.num_pages, E), a_off, b_off, adapter.rank, scale)


# ---------------------------------------------------------------------------------------------
# Reference of what the pool does: an arena in numpy and the per-batch tables.


class NumpyArena:
    """A flat `(L*P*E,)` arena with a free list of page ids; loads packed adapters like the pool."""

    def __init__(self, spec: LoraSpec, dtype):
        self.spec = spec
        L, P, E = spec.num_layers, spec.pool_pages, spec.page_elems
        self.data = np.zeros((L * P * E,), dtype)
        self.free = list(range(P))
        self.adapters: dict[int, tuple[PackedAdapter, list[int]]] = {}

    def load(self, adapter_id: int, packed: PackedAdapter, page_ids: Sequence[int] | None = None) -> list[int]:
        L, P, E = self.spec.num_layers, self.spec.pool_pages, self.spec.page_elems
        n = packed.pages.shape[1]
        if page_ids is None:
            if n > len(self.free):
                raise LoraError(f"arena has {len(self.free)} free pages, adapter needs {n}")
            page_ids = [self.free.pop(0) for _ in range(n)]
        else:
            page_ids = list(page_ids)
            for p in page_ids:
                self.free.remove(p)
        view = self.data.reshape(L, P, E)
        for j, p in enumerate(page_ids):
            view[:, p] = packed.pages[:, j]
        self.adapters[adapter_id] = (packed, page_ids)
        return page_ids

    def tables(self, token_adapter: Sequence[int | None]) -> dict[str, np.ndarray]:
        return batch_tables(self.spec, {a: v for a, v in self.adapters.items()}, token_adapter)


def global_offsets(local: np.ndarray, page_ids: Sequence[int], E: int) -> np.ndarray:
    """Local row offsets (local_page*E + in_page) -> offsets inside a layer (page_id*E + in_page)."""
    ids = np.asarray(page_ids, np.int64)
    out = np.where(local >= 0, ids[np.maximum(local, 0) // E] * E + np.maximum(local, 0) % E, -1)
    return out.astype(np.int32)


def batch_tables(spec: LoraSpec, loaded: dict[int, tuple[PackedAdapter, Sequence[int]]],
                 token_adapter: Sequence[int | None]) -> dict[str, np.ndarray]:
    """The per-batch tables of docs/DESIGN.md, in the order the compiled functions take them
    (without the arena). `token_adapter[t]` is an adapter id or None (base model); slots are
    numbered in order of first appearance."""
    M, R, E = len(spec.modules), spec.max_rank, spec.page_elems
    slots: dict[int, int] = {}
    token_slot = np.empty((len(token_adapter),), np.int32)
    for t, a in enumerate(token_adapter):
        if a is None:
            token_slot[t] = -1
            continue
        if a not in loaded:
            raise LoraError(f"adapter {a} is not loaded in the arena")
        token_slot[t] = slots.setdefault(a, len(slots))
    S = len(slots)
    rank = np.zeros((S,), np.int32)
    scale = np.zeros((S, M), np.float32)
    a_off = np.full((S, M, R), -1, np.int32)
    b_off = np.full((S, M, R), -1, np.int32)
    for a, s in slots.items():
        packed, page_ids = loaded[a]
        rank[s] = packed.rank
        scale[s] = packed.scale
        a_off[s] = global_offsets(packed.a_off, page_ids, E)
        b_off[s] = global_offsets(packed.b_off, page_ids, E)
    return {"lora_token_slot": token_slot, "lora_rank": rank, "lora_scale": scale,
            "lora_a_off": a_off, "lora_b_off": b_off}


# ---------------------------------------------------------------------------------------------
# The tables of research/kv-cache-facts.md §8 for two real models (fp16).

REFERENCE_MODELS = {
    # name: (layers, h_kv, head_dim, hidden, intermediate, heads)
    "Llama-2-7B": (32, 32, 128, 4096, 11008, 32),
    "Llama-3-8B": (32, 8, 128, 4096, 14336, 32),
}


def reference_page_table(name: str, ranks=(8, 16, 32, 64)) -> list[dict[str, Any]]:
    """Pages per adapter for attention-only and all-7 targets, with the lower bound."""
    L, hkv, d, h, i, nh = REFERENCE_MODELS[name]

    class _Cfg:  # the fields page_elems/module_shapes read
        num_key_value_heads, head_dim, hidden_size, intermediate_size = hkv, d, h, i
        num_attention_heads, num_hidden_layers = nh, L

    E = page_elems(_Cfg)
    shapes = module_shapes(_Cfg)
    attn = [LoraModule(n, *shapes[n]) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    full = [LoraModule(n, *shapes[n]) for n in LORA_MODULES]
    page_mib = L * E * 2 / 2**20
    rows = []
    for r in ranks:
        la, lf = layout_adapter(E, attn, r), layout_adapter(E, full, r)
        rows.append({"rank": r, "attn_pages": la.num_pages, "all_pages": lf.num_pages,
                     "all_lower_bound": lower_bound_pages(E, full, r),
                     "attn_mib": la.num_pages * page_mib, "all_mib": lf.num_pages * page_mib,
                     "all_waste_elems": lf.waste})
    return rows


def print_reference_page_tables() -> None:
    for name in REFERENCE_MODELS:
        L, hkv, d = REFERENCE_MODELS[name][:3]
        E = 2 * hkv * PAGE_SIZE * d
        print(f"{name}: E = {E} elements per layer, one page id = {L * E * 2 / 2**20:g} MiB (fp16)")
        print("rank | q,k,v,o pages (MiB) | all 7 pages (MiB) | lower bound | waste/layer")
        for row in reference_page_table(name):
            print(f"{row['rank']:4d} | {row['attn_pages']:5d} ({row['attn_mib']:g}) | "
                  f"{row['all_pages']:5d} ({row['all_mib']:g}) | {row['all_lower_bound']:5d} | "
                  f"{row['all_waste_elems']}")


if __name__ == "__main__":
    print_reference_page_tables()
