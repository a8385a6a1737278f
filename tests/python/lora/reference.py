"""numpy references of what the runtime does with packed adapters, independent of its code.

- `NumpyArena` / `batch_tables`: an arena of L layer regions of P pages that loads packed adapters
  like the unified pool, and the per-batch tables of docs/DESIGN.md the pool must build.
- `unpack`: a packed adapter's rows read back through its offsets, as a `LoraAdapter` (what the
  packing put where).
- `compiled_config`: the part of mlc-lora-config.json the runtime's packing reads, for a spec.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mlc_lora.contract import compiled_contract
from mlc_lora.errors import LoraError
from mlc_lora.lora.layout import LoraSpec, PackedAdapter
from mlc_lora.lora.peft import LoraAdapter
from mlc_lora.compiler_passes.ops.lora.reference import sort_tokens_ref


def compiled_config(spec: LoraSpec, dtype: str = "float32", model_name: str = "tiny") -> dict:
    """{"lora", "contract", "dtype", "model_name"} of a model compiled with `spec`."""
    return {"model_name": model_name, "lora": spec.to_json(), "contract": compiled_contract(), "dtype": dtype}


def unpack(spec: LoraSpec, packed: PackedAdapter) -> LoraAdapter:
    """Every layer's A (rank, in) and B^T (rank, out) rows of the targeted modules, read from the
    packed pages at `a_off` / `b_off` (in float32); modules with scale 0 are not targeted."""
    L, n, E = packed.pages.shape
    assert L == spec.num_layers and E == spec.page_elems
    pages = packed.pages.astype(np.float32).reshape(L, n * E)
    modules, scales, weights = [], {}, {}
    for mi, m in enumerate(spec.modules):
        if packed.scale[mi] == 0:
            assert (packed.a_off[mi] == -1).all() and (packed.b_off[mi] == -1).all()
            continue
        modules.append(m.name)
        scales[m.name] = float(packed.scale[mi])
        a_rows, b_rows = packed.a_off[mi, :packed.rank], packed.b_off[mi, :packed.rank]
        assert (a_rows >= 0).all() and (b_rows >= 0).all() and (packed.a_off[mi, packed.rank:] == -1).all()
        for layer in range(L):
            a = np.stack([pages[layer, o:o + m.in_features] for o in a_rows])
            bt = np.stack([pages[layer, o:o + m.out_features] for o in b_rows])
            weights[(layer, m.name)] = (a, bt)
    return LoraAdapter(packed.name, packed.rank, modules, scales, weights, {})


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
    numbered in order of first appearance; the tokens sorted by slot as the kernels over sorted
    tokens read them (compiler_passes/ops/lora/reference.py: sort_tokens_ref)."""
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
    order, start = sort_tokens_ref(token_slot, S)
    return {"lora_token_slot": token_slot, "lora_rank": rank, "lora_scale": scale,
            "lora_a_off": a_off, "lora_b_off": b_off, "lora_token_order": order, "lora_slot_start": start}
