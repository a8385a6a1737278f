"""The engine's LoRA adapters: names -> pool slots, validation against the compiled library,
each sequence bound to its adapter, the page counts the scheduler admits requests by, and the
adapters' tiers.

Lifetimes: an adapter counts the engine's sequences on it (waiting or running). `unload` forgets
the name at once (new requests get UnknownAdapterError) but hands the pages back to the pool only
when its last sequence ends; a preempted sequence keeps its adapter because the engine holds it,
not only the pool's per-sequence refcount.

Tiers: a loaded adapter lives on up to three. Device: its pages in the pool (resident); the pool
evicts idle unpinned ones LRU and pages them back in. Host: its packed copy, kept by the pool for
those page-ins; `host_bytes` budgets them (LRU among adapters without pages, no request and no pin),
and a dropped copy is read again from its folder on next use. Disk: the folder. Loading reads the
folder and keeps the host copy; it takes pages at once only where the pool has room, else when a
request needs them, so a busy pool never refuses a load. With `prefetch`, the adapters of waiting
requests are read by reader threads (disk -> host) and paged in between steps (host -> device)
before their requests are scheduled; without it, both happen on the step that admits the request.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import LoraError, MLCLoraError, PoolExhaustedError, UnknownAdapterError
from ..lora.peft import LoraAdapter
from ..runner import HostCopy, Pool, Runner
from .prefetch import AdapterReader, LeadTimes
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
    folder: Optional[str]  # where a dropped host copy is read again (None: made in memory: never dropped)
    host_bytes: int  # bytes of its host copy
    users: int = 0  # engine sequences on it
    unloading: bool = False
    on_host: bool = True  # the pool keeps its host copy
    reading: bool = False  # a reader thread is reading its folder
    read_error: Optional[MLCLoraError] = None  # its folder could not be read again
    last_use: int = 0  # host tier LRU clock


class AdapterTable:  # pylint: disable=too-many-instance-attributes
    """Adapters of one engine's pool. Used from the engine thread only, but `read`."""

    # waiting requests (in arrival order) whose adapters are prefetched ahead of scheduling
    PREFETCH_WINDOW = 64

    def __init__(self, runner: Runner, pool: Pool, host_bytes: Optional[int] = None, prefetch: bool = True):
        """`host_bytes`: the host tier's budget (None: unlimited); `prefetch`: read and page in the
        adapters of waiting requests ahead of scheduling."""
        if host_bytes is not None and (isinstance(host_bytes, bool) or not isinstance(host_bytes, int)
                                       or host_bytes < 0):
            raise LoraError(f"adapter_host_bytes must be an integer >= 0 or None, got {host_bytes!r}")
        self.runner, self.pool = runner, pool
        self.host_budget, self.prefetch = host_bytes, bool(prefetch)
        self.by_name: dict[str, Adapter] = {}
        self.by_slot: dict[int, Adapter] = {}  # also adapters unloading while sequences finish
        self._next_slot = 0  # slots are never reused: a sequence's stays its adapter's
        self._of_seq: dict[int, Adapter] = {}  # seq_id -> its adapter
        self._clock = itertools.count(1)
        self._resident: set[int] = set()  # slots resident at the start of this step
        self._prefetched: dict[int, float] = {}  # slot -> perf_counter() of its prefetch page-in, until it runs
        self._reader = AdapterReader(self.pool.read_adapter)
        self.prefix_caching = False  # (set by the engine) prefetch keeps the window's cached prefixes
        self.lead = LeadTimes()
        self.counters = dict(adapter_device_hits=0, adapter_host_hits=0, adapter_disk_hits=0,
                             adapter_disk_reads=0, adapter_host_drops=0, adapter_prefetch_page_ins=0,
                             adapter_prefetch_unused=0)

    # --- loading ------------------------------------------------------------------------------

    def read(self, path: str | Path | LoraAdapter, name: Optional[str] = None) -> HostCopy:
        """Read, check and pack an adapter (disk -> host) without touching the pool: safe from any
        thread, so a load does its disk work off the engine thread."""
        if self.runner.lora is None:
            raise LoraError(f"{self.runner.model_dir} was compiled without LoRA: recompile it with "
                            "--max-lora-rank R --lora-pool-pages P to load adapters")
        if name is not None:
            check_adapter_name(name)
        return self.pool.read_adapter(path, name)

    def load(self, name: str, path: str | Path | LoraAdapter | HostCopy, pin: bool = False) -> dict[str, Any]:
        """Load the PEFT adapter at `path` (or one in memory, or one `read` already) as `name`. It
        takes pool pages now if the pool has room, else when a request needs them."""
        if self.runner.lora is None:
            raise LoraError(f"{self.runner.model_dir} was compiled without LoRA: recompile it with "
                            "--max-lora-rank R --lora-pool-pages P to load adapters")
        check_adapter_name(name)
        if name in self.by_name:
            raise LoraError(f"adapter {name!r} is already loaded (from {self.by_name[name].path}); "
                            "unload it first")
        host = path if isinstance(path, HostCopy) else self.read(path, name)
        slot = self._next_slot
        self.pool.add_adapter(slot, host, bool(pin))
        self._next_slot += 1
        plan = host.plan
        shown = host.source if host.source is not None else f"<in memory: {plan.name}>"
        a = Adapter(name, slot, shown, plan.rank, plan.lora_alpha, plan.use_rslora, dict(plan.scales),
                    list(plan.modules), bool(pin), plan.num_pages, host.source, host.nbytes,
                    last_use=next(self._clock))
        self.by_name[name] = self.by_slot[slot] = a
        self._trim_host()
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
        if pin and not a.on_host:
            self._read_now(a)
            if a.read_error is not None:
                err, a.read_error = a.read_error, None
                raise err
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
        tier = "device" if pool.resident else "host" if a.on_host else "disk"
        return dict(name=a.name, id=a.slot, path=a.path, rank=a.rank, lora_alpha=a.lora_alpha,
                    use_rslora=a.use_rslora, scales=dict(a.scales), target_modules=list(a.target_modules),
                    pinned=pool.pinned, resident=pool.resident, tier=tier, pages=a.num_pages,
                    active_requests=a.users)

    def list(self) -> list[dict[str, Any]]:
        return [self.info(a) for a in self.by_name.values()]

    # --- sequences ----------------------------------------------------------------------------

    def attach(self, seq: Sequence) -> None:
        """Take the sequence's adapter (by its name): `seq.adapter_slot` is its pool slot from now on.
        Counts the tier the adapter was found in; one only on disk is read (prefetch: now, by a
        reader thread)."""
        if seq.adapter_name is None:
            return
        a = self.get(seq.adapter_name)
        a.users += 1
        a.last_use = next(self._clock)
        self._of_seq[seq.seq_id] = a
        seq.adapter_slot = a.slot
        if self.pool.adapter_info(a.slot).resident:
            self.counters["adapter_device_hits"] += 1
        elif a.on_host:
            self.counters["adapter_host_hits"] += 1
        else:
            self.counters["adapter_disk_hits"] += 1
            if self.prefetch:
                self._submit_read(a)

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
            self._prefetched.pop(a.slot, None)

    # --- tiers, between steps ------------------------------------------------------------------

    def prepare_step(self, waiting: Iterable[Sequence], num_running: int, free_slots: int) -> None:
        """Before a step is scheduled: take the reader's finished reads, note which adapters are
        resident, keep the host tier in its budget and (prefetch) read the adapters of the waiting
        requests (`waiting`: in the scheduler's queue order) and page in those of the next
        `free_slots` to be admitted."""
        for slot, out in self._reader.take():
            a = self.by_slot.get(slot)
            if a is None:
                continue  # unloaded meanwhile
            a.reading = False
            if isinstance(out, Exception):
                a.read_error = self._read_failed(a, out)
            elif not a.on_host:
                self._set_host(a, out)
        if not self.by_slot:  # no adapter loaded: none to note, trim, read or page in
            self._resident = set()
            return
        self._resident = self.pool.resident_adapters()
        self._trim_host()
        if self.prefetch:
            self._prefetch(waiting, num_running, free_slots)

    def ready(self, slot: int) -> bool:
        """The scheduler's check before admitting a request: its adapter's host copy is there (a
        request whose adapter is being read waits without holding up the others). Without prefetch
        a missing copy is read now, on the step."""
        a = self.by_slot[slot]
        if a.on_host:
            return True
        if a.read_error is None:
            if self.prefetch:
                self._submit_read(a)
            else:
                self._read_now(a)
        return a.on_host

    def resident(self, slot: int) -> bool:
        """Whether adapter `slot` held its pages when this step began (the scheduler prefers them)."""
        return slot in self._resident

    def unreadable(self, waiting: Iterable[Sequence]) -> list[tuple[Sequence, MLCLoraError]]:
        """Waiting requests whose adapter folder could not be read again, with the error (the engine
        fails them; a later request tries the folder again)."""
        bad = [a for a in self.by_slot.values() if a.read_error is not None]
        if not bad:
            return []
        out = [(s, self.by_slot[s.adapter_slot].read_error) for s in waiting
               if s.adapter_slot is not None and self.by_slot[s.adapter_slot].read_error is not None]
        for a in bad:
            a.read_error = None
        return out

    def first_steps(self, seqs: Iterable[Sequence]) -> None:
        """A batch about to run: the lead time of each prefetch page-in whose adapter runs now for
        the first time since (prefetch pages in only adapters no running sequence uses, for the
        requests about to be admitted)."""
        if not self._prefetched:
            return
        now = time.perf_counter()
        for seq in seqs:
            at = self._prefetched.pop(seq.adapter_slot, None)
            if at is None:
                continue
            if seq.adapter_slot in self._resident:
                self.lead.observe(now - at)
            else:  # evicted again before its request ran
                self.counters["adapter_prefetch_unused"] += 1

    def reads_pending(self) -> bool:
        return self._reader.pending > 0

    def wait_for_reads(self, timeout: float = 0.05) -> None:
        """Nothing could be scheduled: wait a little for the reader instead of spinning."""
        self._reader.wait(timeout)

    def _submit_read(self, a: Adapter) -> None:
        if not a.reading:
            a.reading = True
            self._reader.submit(a.slot, a.folder, a.name)

    def _read_now(self, a: Adapter) -> None:
        try:
            host = self.pool.read_adapter(a.folder, a.name)
        except Exception as e:  # pylint: disable=broad-except  (any failure fails its requests alone)
            a.read_error = self._read_failed(a, e)
            return
        self._set_host(a, host)

    def _read_failed(self, a: Adapter, e: Exception) -> MLCLoraError:
        return LoraError(f"adapter {a.name!r}: its host copy was dropped and its folder {a.folder} cannot be "
                         f"read again: {e}")

    def _set_host(self, a: Adapter, host: HostCopy) -> None:
        try:
            self.pool.set_adapter_host(a.slot, host)
        except ValueError as e:  # packed differently from its load: the folder changed
            a.read_error = self._read_failed(a, e)
            return
        a.on_host, a.read_error = True, None
        self.counters["adapter_disk_reads"] += 1

    def _prefetch(self, waiting: Iterable[Sequence], num_running: int, free_slots: int) -> None:
        """Read the adapters of the first PREFETCH_WINDOW waiting requests that are only on disk (the
        reader threads), and page in pinned adapters without pages and those of the next `free_slots`
        requests to be admitted, while the pool keeps a page for each running sequence's next token
        and one for the request's own KV; never evicting an adapter the window wants. Requests that
        cannot be admitted yet get no pages: KV growth would evict them again before they run.
        With the prefix cache, no page-in evicts a cached prefix a request of the window would hit."""
        seqs = list(itertools.islice(waiting, self.PREFETCH_WINDOW))
        window = [s.adapter_slot for s in seqs]
        wanted = list(dict.fromkeys(slot for slot in window if slot is not None))
        for slot in wanted:
            a = self.by_slot[slot]
            if not a.on_host and a.read_error is None:
                self._submit_read(a)
        page_in = [a.slot for a in self.by_name.values() if a.pinned and a.slot not in self._resident]
        page_in += [slot for slot in window[:max(0, free_slots)] if slot is not None]
        page_in = [slot for slot in dict.fromkeys(page_in) if slot not in self._resident
                   and self.by_slot[slot].on_host]
        if not page_in:
            return
        s = self.pool.stats()
        room = s.free_pages + s.evictable_pages - num_running
        keep = wanted + page_in
        protect = [(q.adapter_slot, q.tokens) for q in seqs if not q.params.prompt_logprobs] \
            if self.prefix_caching else []
        for slot in page_in:
            a = self.by_slot[slot]
            if a.num_pages + 1 > room:
                continue
            if self.pool.prefetch_adapter(slot, keep, protect):
                self._prefetched[slot] = time.perf_counter()
                self.counters["adapter_prefetch_page_ins"] += 1
                room -= a.num_pages
                self._resident.add(slot)
        self._resident = self.pool.resident_adapters()

    def host_bytes(self) -> int:
        return sum(a.host_bytes for a in self.by_slot.values() if a.on_host)

    def _trim_host(self) -> None:
        """Over the budget: drop the host copies of adapters without pages, pins or requests that
        can be read again, least recently used first."""
        if self.host_budget is None:
            return
        total = self.host_bytes()
        if total <= self.host_budget:
            return
        resident = self.pool.resident_adapters()
        idle = sorted((a for a in self.by_slot.values() if a.on_host and a.folder is not None and not a.pinned
                       and a.users == 0 and a.slot not in resident), key=lambda a: a.last_use)
        for a in idle:
            if total <= self.host_budget:
                break
            self.pool.drop_adapter_host(a.slot)
            a.on_host = False
            total -= a.host_bytes
            self.counters["adapter_host_drops"] += 1

    # --- pages --------------------------------------------------------------------------------

    def available_pages(self) -> int:
        """Pages a batch can take: free ones plus those of idle unpinned adapters and of cached
        prefixes no sequence holds (evicted LRU)."""
        return self.pool.admittable_pages()

    def pages_to_run(self, slots: list[int]) -> list[int]:
        """Pages a batch must find for each adapter of `slots`: all of them unless it is resident
        and kept (pinned, or held by a running sequence); an idle resident one stops being
        evictable. One pool call for all (each step asks it for every running adapter)."""
        return self.pool.adapter_pages_to_run(slots) if slots else []

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
                                             if self.pool.adapter_info(a.slot).resident),
                    adapters_on_host=sum(a.on_host for a in self.by_slot.values()),
                    adapter_host_bytes=self.host_bytes(), adapter_host_budget_bytes=self.host_budget,
                    adapter_prefetch=self.prefetch, **self.counters,
                    adapter_prefetch_lead_seconds=self.lead.to_dict())
