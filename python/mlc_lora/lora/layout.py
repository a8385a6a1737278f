"""Adapter rows in the unified page pool: what a model is compiled for (`LoraSpec`, `make_spec`)
and the Python face of the runtime's layout and packing (src/runtime/lora_layout.{h,cc}, the one
implementation, shared with the C++ API).

A page is `E = 2 * h_kv * PAGE_SIZE * head_dim` elements per layer (one KV page of one layer). An
adapter of rank r stores, for every module m it targets, `r` rows of A (length in_m) and `r` rows
of B^T (length out_m); a row never crosses a page and every layer uses the same layout. Rows are
placed best-fit-decreasing (longest rows first, each into the fullest page that still has room),
which lets short rows fill the tail of pages holding long ones. See docs/DESIGN.md.

Rows are stored in the model dtype, or (`LoraSpec.rows == "int8"`, `mlc_lora compile --lora-rows
int8`) as int8 values with a float32 scale per row, which halves an fp16 adapter's bytes (lossy:
`quantize_rows` is the reference of what the runtime packs, `dequantize_rows` of what the kernels
read; docs/SGMV.md "int8 adapter rows").
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

import numpy as np

from ..contract import (COLUMN_PARALLEL_MODULES, INT8_ROW_ALIGN, LORA_KERNELS, LORA_MODULES, PAGE_SIZE, ROW_FORMATS,
                        compiled_contract)
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
    # The limits of the _fused functions (contract.FUSED_FUNCTION_SUFFIX) where the library has them: a
    # batch over <= slot_columns adapters whose ranks sum to <= rank_columns runs them; rank_rows: the
    # targeted weights hold the rank rows route's reserved rows (passes/reserve_rank_rows.py);
    # spare_columns: the rank columns route's reserved columns (passes/reserve_rank_columns.py). None: none built.
    fused: dict[str, int] | None = None
    # How the pages store adapter rows: "model" (the model dtype) or "int8" (ROW_FORMATS).
    rows: str = "model"

    def fused_fits(self, num_slots: int, rank_total: int) -> bool:
        """Whether the _fused functions cover a batch over `num_slots` adapters of these ranks."""
        f = self.fused
        return f is not None and 0 < num_slots <= f["slot_columns"] and rank_total <= f["rank_columns"]

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
            "fused": self.fused, "rows": self.rows,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoraSpec":
        return cls(num_layers=d["num_layers"], page_elems=d["page_elems"],
                   modules=tuple(LoraModule(**m) for m in d["modules"]), max_rank=d["max_rank"],
                   pool_pages=d["pool_pages"], kernel=d["kernel"],
                   tensor_parallel_shards=d.get("tensor_parallel_shards", 1),
                   fused=_fused_limits(d), rows=d.get("rows", "model"))


def _fused_limits(d: dict[str, Any]) -> dict[str, int] | None:
    """The config's fused limits; a library compiled before prefill_fused names them "fused_decode"
    and has decode_fused only (its kernel covers any token count)."""
    f = d.get("fused", d.get("fused_decode"))
    if f is None:
        return None
    return {"rank_columns": f["rank_columns"], "slot_columns": f["slot_columns"],
            **({"rank_rows": True} if f.get("rank_rows") else {}),
            **({"spare_columns": True} if f.get("spare_columns") else {})}


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


def make_spec(cfg, max_rank: int, pool_pages: int, target_modules: Sequence[str] | None = None,
              kernel: str = "gather", rows: str = "model") -> LoraSpec:
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
    if rows not in ROW_FORMATS:
        raise LoraError(f"unknown adapter row format {rows!r}; choose one of {', '.join(ROW_FORMATS)}")
    if rows == "int8" and kernel != "sgmv":
        raise LoraError(f"int8 adapter rows need the sgmv kernel (--lora-kernel sgmv), not {kernel!r}")
    if pool_pages * E >= 2**31:
        raise LoraError(f"--lora-pool-pages {pool_pages} x page {E} elements exceeds 2^31 per layer")
    return LoraSpec(cfg.num_hidden_layers, E, mods, max_rank, pool_pages, kernel, _shards(cfg), rows=rows)


# ---------------------------------------------------------------------------------------------
# Row placement (the runtime's LayoutAdapter).


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


def layout_adapter(E: int, modules: Sequence[LoraModule], rank: int, rows: str = "model",
                   elem_bytes: int = 2) -> AdapterLayout:
    """Best-fit-decreasing placement of the A and B^T rows of `modules` at `rank`, rows stored as
    `rows` (ROW_FORMATS) on pages of `elem_bytes`-byte elements; offsets point at a row's first value."""
    from .. import _ffi_api  # pylint: disable=import-outside-toplevel  (loads the runtime)

    modules = list(modules)
    out = _ffi_api.adapter_layout(E, [m.name for m in modules], [m.in_features for m in modules],
                                  [m.out_features for m in modules], rank, rows, elem_bytes, INT8_ROW_ALIGN)
    a_off, b_off = list(out["a_off"]), list(out["b_off"])
    offsets = {}
    for i, m in enumerate(modules):
        for k in range(rank):
            offsets[(m.name, "A", k)] = int(a_off[i * rank + k])
            offsets[(m.name, "B", k)] = int(b_off[i * rank + k])
    return AdapterLayout(rank, E, int(out["num_pages"]), offsets, int(out["used_elems"]))


def lower_bound_pages(E: int, modules: Sequence[LoraModule], rank: int, rows: str = "model",
                      elem_bytes: int = 2) -> int:
    return math.ceil(sum(rank * (row_elems(m.in_features, rows, elem_bytes) + row_elems(m.out_features, rows, elem_bytes))
                         for m in modules) / E)


# ---------------------------------------------------------------------------------------------
# Row formats (contract.ROW_FORMATS; the runtime's RowFormat and QuantizeRow in lora_layout.h: these are
# their references).

def row_elems(n: int, rows: str = "model", elem_bytes: int = 2) -> int:
    """Page elements a row of n values takes (int8: its scale's lead, the values padded; contract.py)."""
    if rows == "model":
        return n
    return (INT8_ROW_ALIGN + -(-n // INT8_ROW_ALIGN) * INT8_ROW_ALIGN) // elem_bytes


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Semantics: per row, s = max |w| / 127 (float32) and q = round_half_even(w / s) in [-127, 127]
    (s = 0, q = 0 for a zero row). Returns (q int8 (..., n), s float32 (...))."""
    w = np.asarray(w, np.float32)
    s = (np.abs(w).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1))[..., None]
    q = np.where(s[..., None] > 0, np.clip(np.round(w / safe), -127, 127), 0).astype(np.int8)
    return q, s


def int8_row_bytes(w: np.ndarray) -> np.ndarray:
    """Rows w (..., n) as the pool stores int8 rows, byte for byte: per row its quantize_rows scale
    (float32), zeros to INT8_ROW_ALIGN bytes, its int8 values, zeros to a multiple of INT8_ROW_ALIGN.
    Returns uint8 (rows, row_elems(n, "int8", 1)); a row's values start INT8_ROW_ALIGN bytes in."""
    q, s = quantize_rows(w)
    n = q.shape[-1]
    out = np.zeros((q.size // max(n, 1), row_elems(n, "int8", 1)), np.uint8)
    out[:, :4] = s.reshape(-1, 1).view(np.uint8)
    out[:, INT8_ROW_ALIGN:INT8_ROW_ALIGN + n] = q.reshape(-1, n).view(np.uint8)
    return out


def dequantize_rows(q: np.ndarray, s: np.ndarray, dtype) -> np.ndarray:
    """What the kernels read of int8 rows: q * s in float32, rounded to the model `dtype`."""
    return (q.astype(np.float32) * np.asarray(s, np.float32)[..., None]).astype(dtype)


def as_int8_rows(adapter):
    """A copy of `adapter` (a `peft.LoraAdapter`) whose rows (of A and of B^T) are what int8 rows read
    of them (quantize_rows, then dequantize_rows in float32): the reference of an int8-row library
    serving `adapter` (unsharded: a tensor-parallel shard quantizes its slices of the rows)."""
    return dataclasses.replace(adapter, weights={
        key: tuple(dequantize_rows(*quantize_rows(np.asarray(w, np.float32)), np.float32) for w in pair)
        for key, pair in adapter.weights.items()})


# ---------------------------------------------------------------------------------------------
# Packing an adapter for the pool (the runtime's PackAdapter).


@dataclasses.dataclass
class PackedAdapter:  # pylint: disable=too-many-instance-attributes
    """Input of `mlc_lora.runtime.pool_load_adapter(kv, id, pages, a_off, b_off, rank, scale, pin)`,
    and what the engines show about the adapter."""

    pages: np.ndarray  # [L, n, E] model dtype
    a_off: np.ndarray  # [M, R] int32, local offsets (local_page * E + offset_in_page), -1 unused
    b_off: np.ndarray  # [M, R] int32
    rank: int
    scale: np.ndarray  # [M] float32, 0 for modules the adapter does not target
    name: str = ""
    modules: list[str] = dataclasses.field(default_factory=list)  # targeted, canonical order
    scales: dict[str, float] = dataclasses.field(default_factory=dict)  # module -> table scale
    lora_alpha: float = 8
    use_rslora: bool = False
    # The runtime's host tensor of `pages`: passed on by ffi_args without a copy.
    pages_tensor: Any = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_runtime(cls, out, **extra) -> "PackedAdapter":
        """From the map `mlc_lora.runtime.pack_adapter` / `pack_peft_adapter` return."""
        pages = out["pages"]
        try:
            pages_np = np.from_dlpack(pages)
        except (BufferError, TypeError, RuntimeError):  # bfloat16: numpy's DLPack has no code for it
            pages_np = pages.numpy()
        return cls(pages_np, np.from_dlpack(out["a_off"]), np.from_dlpack(out["b_off"]), int(out["rank"]),
                   np.from_dlpack(out["scale"]), str(out["name"]), [str(m) for m in out["modules"]],
                   {str(k): float(v) for k, v in out["scales"].items()}, pages_tensor=pages, **extra)

    def ffi_args(self) -> tuple:
        """(pages, a_off, b_off, rank, scale) as pool_load_adapter takes them. numpy's DLPack has no
        code for ml_dtypes' bfloat16, so bfloat16 pages go as a TVM host tensor."""
        pages = self.pages_tensor
        if pages is None:
            pages = self.pages
            if pages.dtype.name == "bfloat16":
                import tvm  # pylint: disable=import-outside-toplevel  (the runtime-only bundle has it too)

                pages = tvm.runtime.tensor(pages)
        return pages, self.a_off, self.b_off, self.rank, self.scale


def spec_json(spec: LoraSpec, dtype) -> str:
    """What the runtime's packing reads of a compiled config, for `spec` and the model `dtype`."""
    return json.dumps({"lora": spec.to_json(), "contract": compiled_contract(), "dtype": np.dtype(dtype).name})


def pack_adapter(spec: LoraSpec, adapter, dtype, shard: int = 0) -> PackedAdapter:
    """Put `adapter` (a `peft.LoraAdapter`: per (layer, module) A (rank, in) and B^T (rank, out))
    into page format for a model compiled with `spec` and pages of `dtype` (under tensor
    parallelism: shard `shard`'s slices; every shard gets the same layout)."""
    from .. import _ffi_api  # pylint: disable=import-outside-toplevel  (loads the runtime)

    entries = [(layer, module, np.ascontiguousarray(a, np.float32), np.ascontiguousarray(bt, np.float32))
               for (layer, module), (a, bt) in adapter.weights.items()]
    out = _ffi_api.pack_adapter(spec_json(spec, dtype), adapter.name, adapter.rank, list(adapter.modules),
                                {m: float(s) for m, s in adapter.scales.items()}, entries, shard)
    cfg = adapter.config or {}
    return PackedAdapter.from_runtime(out, lora_alpha=cfg.get("lora_alpha", 8),
                                      use_rslora=bool(cfg.get("use_rslora", False)))


# ---------------------------------------------------------------------------------------------
# The page tables of docs/POOL.md for two real models (fp16).

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
