"""The engine's LoRA adapters: names -> unified-pool ids, validation against the compiled library,
each sequence bound to its adapter, and the page counts the scheduler admits requests by.

Lifetimes: an adapter counts the engine's sequences on it (waiting or running). `unload` forgets
the name at once (new requests get UnknownAdapterError) but hands the pages back to the pool only
when its last sequence ends; a preempted sequence keeps its adapter because the engine holds it,
not only the pool's per-sequence refcount.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import LoraError, PoolExhaustedError, UnknownAdapterError
from ..lora.layout import LoraSpec, pack_adapter
from ..lora.peft import LoraAdapter, pack_peft_adapter


@dataclasses.dataclass
class Adapter:  # pylint: disable=too-many-instance-attributes
    name: str
    id: int  # pool id, never reused
    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scales: dict[str, float]  # module -> alpha/r (or alpha/sqrt(r)), as in the tables
    target_modules: list[str]
    pinned: bool
    num_pages: int
    users: int = 0  # engine sequences on it
    unloading: bool = False


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


class AdapterTable:
    """Adapters of one engine's KV cache (the unified pool). Used from the engine thread only."""

    def __init__(self, runner, kv):
        self.runner, self.kv = runner, kv
        # (runner.create_kv_cache configured the pool for LoRA)
        self.spec: Optional[LoraSpec] = LoraSpec.from_json(runner.lora) if runner.lora else None
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}  # also adapters unloading while sequences finish
        self._next_id = itertools.count()
        self._of_seq: dict[int, Adapter] = {}  # seq_id -> its adapter

    # --- loading ------------------------------------------------------------------------------

    def load(self, name: str, path: str | Path, pin: bool = False) -> dict[str, Any]:
        if self.spec is None:
            raise LoraError(f"{self.runner.model_dir} was compiled without LoRA: recompile it with "
                            "--max-lora-rank R --lora-pool-pages P to load adapters")
        if not isinstance(name, str) or not name:
            raise LoraError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self.by_name:
            raise LoraError(f"adapter {name!r} is already loaded (from {self.by_name[name].path}); "
                            "unload it first")
        spec = self.spec
        if isinstance(path, LoraAdapter):  # read already (e.g. made on the device by a benchmark)
            packed, path = pack_adapter(spec, path, _numpy_dtype(self.runner.dtype)), f"<in memory: {path.name}>"
        else:
            packed = pack_peft_adapter(path, self.runner.config, name)
        n, total = int(packed.pages.shape[1]), self.pool_stats()["total_pages"]
        if n > total:
            raise LoraError(f"adapter {name} (rank {packed.rank}, {', '.join(packed.modules)}) needs {n} "
                            f"pages, but the whole pool has {total}")
        aid = next(self._next_id)
        try:
            if getattr(self.runner, "num_shards", 1) > 1:  # every shard packs its own slices
                self.runner.load_adapter(self.kv, aid, path, bool(pin))
            else:
                self.runner.pool("pool_load_adapter")(self.kv, aid, *packed.ffi_args(), bool(pin))
        except PoolExhaustedError as e:
            raise PoolExhaustedError(f"cannot load adapter {name!r} ({n} pages): {e}") from None
        a = Adapter(name, aid, str(path), packed.rank, packed.lora_alpha, packed.use_rslora,
                    dict(packed.scales), list(packed.modules), bool(pin), n)
        self.by_name[name] = self.by_id[aid] = a
        return self.info(a)

    def unload(self, name: str) -> None:
        a = self.get(name)
        del self.by_name[name]
        a.unloading = True
        self._free_if_unused(a)

    def pin(self, name: str, pin: bool) -> dict[str, Any]:
        """Pin (page in now if evicted, never evict for KV) or unpin a loaded adapter."""
        if not isinstance(pin, bool):
            raise LoraError(f"pin must be true or false, got {pin!r}")
        a = self.get(name)
        try:
            self.runner.pool("pool_pin_adapter")(self.kv, a.id, pin)
        except PoolExhaustedError as e:
            raise PoolExhaustedError(f"cannot pin adapter {name!r} ({a.num_pages} pages): {e}") from None
        a.pinned = pin
        return self.info(a)

    def get(self, name) -> Adapter:
        a = self.by_name.get(name) if isinstance(name, str) else None
        if a is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise UnknownAdapterError(f"adapter_id={name!r} is not a loaded LoRA adapter (loaded: {loaded})")
        return a

    def info(self, a: Adapter) -> dict[str, Any]:
        pool = self.runner.pool("pool_adapter_info")(self.kv, a.id)
        return dict(name=a.name, id=a.id, path=a.path, rank=a.rank, lora_alpha=a.lora_alpha,
                    use_rslora=a.use_rslora, scales=dict(a.scales), target_modules=list(a.target_modules),
                    pinned=bool(pool["pinned"]), resident=bool(pool["resident"]), pages=a.num_pages,
                    active_requests=a.users)

    def list(self) -> list[dict[str, Any]]:
        return [self.info(a) for a in self.by_name.values()]

    # --- sequences ----------------------------------------------------------------------------

    def attach(self, seq) -> None:
        """Take the sequence's adapter by name; from now on `seq.adapter_id` is its pool id."""
        if seq.adapter_id is None:
            return
        a = self.get(seq.adapter_id)
        a.users += 1
        self._of_seq[seq.seq_id] = a
        seq.adapter_name, seq.adapter_id = a.name, a.id

    def detach(self, seq) -> None:
        a = self._of_seq.pop(seq.seq_id, None)
        if a is not None:
            a.users -= 1
            self._free_if_unused(a)

    def add_sequence(self, seq_id: int) -> None:
        """The scheduler's kv_add: a KV sequence, bound to its adapter in the pool (refcounted)."""
        self.runner.kv_add(self.kv, seq_id)
        a = self._of_seq.get(seq_id)
        if a is not None:
            self.runner.pool("pool_set_sequence_adapter")(self.kv, seq_id, a.id)

    def _free_if_unused(self, a: Adapter) -> None:
        if a.unloading and a.users == 0:
            self.runner.pool("pool_unload_adapter")(self.kv, a.id)
            del self.by_id[a.id]

    # --- pages --------------------------------------------------------------------------------

    def pool_stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.runner.pool("pool_stats")(self.kv).items()}

    def available_pages(self) -> int:
        """Pages a batch can take: free ones plus those of idle unpinned adapters (evicted LRU)."""
        free = int(self.runner.kv_available_pages(self.kv))
        return free + (self.pool_stats()["evictable_pages"] if self.spec is not None else 0)

    def pages_to_run(self, aid: int) -> int:
        """Pages a batch must find for adapter `aid`: all of them unless it is resident and kept
        (pinned, or held by a running sequence); an idle resident one stops being evictable."""
        info = self.runner.pool("pool_adapter_info")(self.kv, aid)
        kept = bool(info["resident"]) and (bool(info["pinned"]) or int(info["refs"]) > 0)
        return 0 if kept else int(info["num_pages"])

    def exhausted(self, seq) -> PoolExhaustedError:
        s = self.pool_stats()
        what = "its KV"
        if seq.adapter_id is not None:
            a = self.by_id[seq.adapter_id]
            what = f"adapter {a.name!r} ({a.num_pages} pages) and its KV"
        return PoolExhaustedError(
            f"request cannot run: {what} need more pages than the pool can give with nothing else "
            f"running ({s['free_pages']} free, {s['evictable_pages']} held by idle adapters, "
            f"{s['adapter_pages'] - s['evictable_pages']} by pinned or busy adapters, {s['total_pages']} "
            "in total); unpin or unload adapters, or compile with more --lora-pool-pages")

    def stats(self) -> dict[str, Any]:
        s = self.pool_stats()
        return dict(pool_pages_total=s["total_pages"], pool_pages_free=s["free_pages"],
                    pool_pages_kv=s["kv_pages"], pool_pages_adapter=s["adapter_pages"],
                    pool_pages_evictable=s["evictable_pages"],
                    adapter_evictions=s["adapter_evictions"], adapter_page_ins=s["adapter_page_ins"],
                    adapters_loaded=sorted(self.by_name),
                    adapters_resident=sorted(a.name for a in self.by_id.values()
                                             if bool(self.runner.pool("pool_adapter_info")(self.kv, a.id)["resident"])))
