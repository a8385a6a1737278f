"""The engine's LoRA adapters: names -> pool slots, validation against the compiled library,
each sequence bound to its adapter, and the page counts the scheduler admits requests by.

Lifetimes: an adapter counts the engine's sequences on it (waiting or running). `unload` forgets
the name at once (new requests get UnknownAdapterError) but hands the pages back to the pool only
when its last sequence ends; a preempted sequence keeps its adapter because the engine holds it,
not only the pool's per-sequence refcount.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import LoraError, PoolExhaustedError, UnknownAdapterError
from ..lora.peft import LoraAdapter
from ..runner import Pool, Runner
from .scheduler import Sequence


MAX_NAME_LEN = 256


def check_adapter_name(name) -> str:
    """`name` itself: a non-empty string of at most 256 characters, valid Unicode, with no control
    character and no '/' (it is the `model` of requests, and appears in logs and metrics)."""
    if not isinstance(name, str) or not name.strip():
        raise LoraError(f"an adapter name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LEN:
        raise LoraError(f"an adapter name has at most {MAX_NAME_LEN} characters; this one has {len(name)}")
    bad = next((c for c in name if c == "/" or ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) < 0xE000), None)
    if bad is not None:
        raise LoraError(f"adapter name {name!r} holds {bad!r}; control characters, lone surrogates and '/' "
                        "are not allowed")
    return name


@dataclasses.dataclass
class Adapter:  # pylint: disable=too-many-instance-attributes
    name: str
    slot: int  # its id in the pool, never reused
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


class AdapterTable:
    """Adapters of one engine's pool. Used from the engine thread only."""

    def __init__(self, runner: Runner, pool: Pool):
        self.runner, self.pool = runner, pool
        self.by_name: dict[str, Adapter] = {}
        self.by_slot: dict[int, Adapter] = {}  # also adapters unloading while sequences finish
        self._next_slot = 0  # slots are never reused: a sequence's stays its adapter's
        self._of_seq: dict[int, Adapter] = {}  # seq_id -> its adapter

    # --- loading ------------------------------------------------------------------------------

    def load(self, name: str, path: str | Path | LoraAdapter, pin: bool = False) -> dict[str, Any]:
        """Check and load the PEFT adapter at `path` (or one in memory) into the pool as `name`."""
        if self.runner.lora is None:
            raise LoraError(f"{self.runner.model_dir} was compiled without LoRA: recompile it with "
                            "--max-lora-rank R --lora-pool-pages P to load adapters")
        check_adapter_name(name)
        if name in self.by_name:
            raise LoraError(f"adapter {name!r} is already loaded (from {self.by_name[name].path}); "
                            "unload it first")
        slot = self._next_slot
        plan = self.pool.load_adapter(slot, path, bool(pin), name=name)
        self._next_slot += 1
        if isinstance(path, LoraAdapter):  # made in memory (e.g. on the device by a benchmark)
            path = f"<in memory: {path.name}>"
        a = Adapter(name, slot, str(path), plan.rank, plan.lora_alpha, plan.use_rslora, dict(plan.scales),
                    list(plan.modules), bool(pin), plan.num_pages)
        self.by_name[name] = self.by_slot[slot] = a
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
            self.pool.pin_adapter(a.slot, pin)
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
        pool = self.pool.adapter_info(a.slot)
        return dict(name=a.name, id=a.slot, path=a.path, rank=a.rank, lora_alpha=a.lora_alpha,
                    use_rslora=a.use_rslora, scales=dict(a.scales), target_modules=list(a.target_modules),
                    pinned=pool.pinned, resident=pool.resident, pages=a.num_pages, active_requests=a.users)

    def list(self) -> list[dict[str, Any]]:
        return [self.info(a) for a in self.by_name.values()]

    # --- sequences ----------------------------------------------------------------------------

    def attach(self, seq: Sequence) -> None:
        """Take the sequence's adapter (by its name): `seq.adapter_slot` is its pool slot from now on."""
        if seq.adapter_name is None:
            return
        a = self.get(seq.adapter_name)
        a.users += 1
        self._of_seq[seq.seq_id] = a
        seq.adapter_slot = a.slot

    def detach(self, seq: Sequence) -> None:
        a = self._of_seq.pop(seq.seq_id, None)
        if a is not None:
            a.users -= 1
            self._free_if_unused(a)

    def add_sequence(self, seq_id: int) -> None:
        """The scheduler's add_sequence: a place in the pool, bound to its adapter (refcounted)."""
        self.pool.add_sequence(seq_id)
        a = self._of_seq.get(seq_id)
        if a is not None:
            self.pool.set_sequence_adapter(seq_id, a.slot)

    def _free_if_unused(self, a: Adapter) -> None:
        if a.unloading and a.users == 0:
            self.pool.unload_adapter(a.slot)
            del self.by_slot[a.slot]

    # --- pages --------------------------------------------------------------------------------

    def available_pages(self) -> int:
        """Pages a batch can take: free ones plus those of idle unpinned adapters and of cached
        prefixes no sequence holds (evicted LRU)."""
        free = self.pool.available_pages()
        return free + (self.pool.stats().evictable_pages if self.runner.lora is not None else 0)

    def pages_to_run(self, slot: int) -> int:
        """Pages a batch must find for adapter `slot`: all of them unless it is resident and kept
        (pinned, or held by a running sequence); an idle resident one stops being evictable."""
        info = self.pool.adapter_info(slot)
        kept = info.resident and (info.pinned or info.refs > 0)
        return 0 if kept else info.num_pages

    def exhausted(self, seq: Sequence) -> PoolExhaustedError:
        s = self.pool.stats()
        busy = s.adapter_pages - (s.evictable_pages - s.cached_idle_pages)  # pinned or in-use adapters' pages
        what = "its KV"
        if seq.adapter_slot is not None:
            a = self.by_slot[seq.adapter_slot]
            what = f"adapter {a.name!r} ({a.num_pages} pages) and its KV"
        return PoolExhaustedError(
            f"request cannot run: {what} need more pages than the pool can give with nothing else "
            f"running ({s.free_pages} free, {s.evictable_pages} held by idle adapters and cached prefixes, "
            f"{busy} by pinned or busy adapters, {s.total_pages} "
            "in total); unpin or unload adapters, or compile with more --lora-pool-pages")

    def stats(self) -> dict[str, Any]:
        s = self.pool.stats()
        return dict(pool_pages_total=s.total_pages, pool_pages_free=s.free_pages,
                    pool_pages_kv=s.kv_pages, pool_pages_adapter=s.adapter_pages,
                    pool_pages_evictable=s.evictable_pages,
                    adapter_evictions=s.adapter_evictions, adapter_page_ins=s.adapter_page_ins,
                    adapters_loaded=sorted(self.by_name),
                    adapters_resident=sorted(a.name for a in self.by_slot.values()
                                             if self.pool.adapter_info(a.slot).resident))
