"""The unified page pool of a runner, as one typed object.

One arena of pages holds the paged KV cache of every sequence and the pages of every loaded LoRA
adapter (src/runtime/unified_kv_cache.cc; docs/DESIGN.md). `Pool` names everything the engine,
the server and the tests do with it; its two implementations differ only in where the runtime's
functions run: `DevicePool` (this module) calls them on the runner's device, `ShardedPool`
(runner/sharded.py) on every tensor-parallel shard's pool, in step.

The names of the runtime functions live here (and in runner/sharded.py for the worker-side ones);
nothing above the runner package calls them by name.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import LoraError
from ..lora.layout import LoraSpec, PackedAdapter, pack_adapter
from ..lora.peft import AdapterPlan, LoraAdapter, pack_peft_adapter
from .config import CompiledConfig
from .device import _tvm, keep_gil

# TVM's KV-state builtins (any paged KV cache).
PAD_SEQUENCE_IDS = 1 << 62  # the first id of the padding sequences (`Pool.padding_sequences`)
KV_ADD = "vm.builtin.kv_state_add_sequence"
KV_REMOVE = "vm.builtin.kv_state_remove_sequence"
KV_FORK = "vm.builtin.kv_state_fork_sequence"
KV_POPN = "vm.builtin.kv_state_popn"
KV_BEGIN = "vm.builtin.kv_state_begin_forward"
KV_END = "vm.builtin.kv_state_end_forward"
KV_AVAILABLE_PAGES = "vm.builtin.attention_kv_cache_get_num_available_pages"
KV_SEQUENCE_LENGTH = "vm.builtin.attention_kv_cache_get_sequence_length"
# mlc-lora's pool (mlc_lora.runtime.*, listed in mlc_lora/_ffi_api.py).
POOL_CONFIGURE_LORA = "mlc_lora.runtime.pool_configure_lora"
POOL_KEEP_LORA_COLUMNS = "mlc_lora.runtime.pool_keep_lora_columns"
POOL_LORA_COLUMNS_GENERATION = "mlc_lora.runtime.pool_lora_columns_generation"
POOL_LOAD_ADAPTER = "mlc_lora.runtime.pool_load_adapter"
POOL_UNLOAD_ADAPTER = "mlc_lora.runtime.pool_unload_adapter"
POOL_PIN_ADAPTER = "mlc_lora.runtime.pool_pin_adapter"
POOL_SET_ADAPTER_HOST = "mlc_lora.runtime.pool_set_adapter_host"
POOL_DROP_ADAPTER_HOST = "mlc_lora.runtime.pool_drop_adapter_host"
POOL_PREFETCH_ADAPTER = "mlc_lora.runtime.pool_prefetch_adapter"
POOL_RESIDENT_ADAPTERS = "mlc_lora.runtime.pool_resident_adapters"
POOL_SET_SEQUENCE_ADAPTER = "mlc_lora.runtime.pool_set_sequence_adapter"
POOL_LORA_TABLES = "mlc_lora.runtime.pool_lora_tables"
POOL_LORA_GRAPH_TABLES = "mlc_lora.runtime.pool_lora_graph_tables"
POOL_LORA_NUM_SLOTS = "mlc_lora.runtime.pool_lora_num_slots"
POOL_LORA_RANK_TOTAL = "mlc_lora.runtime.pool_lora_rank_total"
POOL_STATS = "mlc_lora.runtime.pool_stats"
POOL_ADMITTABLE_PAGES = "mlc_lora.runtime.pool_admittable_pages"
POOL_ADAPTER_INFO = "mlc_lora.runtime.pool_adapter_info"
POOL_ADAPTER_PAGES_TO_RUN = "mlc_lora.runtime.pool_adapter_pages_to_run"
POOL_SEQUENCE_PAGES = "mlc_lora.runtime.pool_sequence_pages"
POOL_CHECK_INVARIANTS = "mlc_lora.runtime.pool_check_invariants"
POOL_POISON_FREE_PAGES = "mlc_lora.runtime.pool_poison_free_pages"
POOL_PREFIX_LOOKUP = "mlc_lora.runtime.pool_prefix_lookup"
POOL_PREFIX_ATTACH = "mlc_lora.runtime.pool_prefix_attach"
POOL_PREFIX_INSERT = "mlc_lora.runtime.pool_prefix_insert"


@dataclasses.dataclass(frozen=True)
class PoolStats:  # pylint: disable=too-many-instance-attributes
    """Pages of the pool by use, and its adapter counters."""

    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int  # resident adapters' pages
    # pages evicted when needed, least recently used first: those of idle, unpinned resident
    # adapters and the cached prefix pages no sequence holds
    evictable_pages: int
    resident_adapters: int
    loaded_adapters: int  # resident or not (their host copies wait), or unloading
    adapter_evictions: int
    adapter_page_ins: int  # adapters given pages after their load (paged back in, or loaded while busy)
    pinned_pages: int  # pages of pinned adapters, resident or not
    page_elems: int  # elements of one page of one layer (of one shard)
    kv_tokens: int  # tokens of every sequence
    # the prefix cache: keyed KV pages (held or idle); those no sequence holds (free + kv +
    # adapter + cached_idle = total); prefix_attach calls, the tokens they offered and matched;
    # keyed pages evicted for room
    cached_pages: int
    cached_idle_pages: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cached_page_evictions: int

    @classmethod
    def from_runtime(cls, m) -> "PoolStats":
        return cls(**{f.name: int(m[f.name]) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter in the pool."""

    num_pages: int
    resident: bool  # its pages are in the arena (else evicted: a host copy waits)
    pinned: bool  # never evicted
    refs: int  # sequences bound to it
    pages: tuple[int, ...]  # its page ids while resident
    host: bool = True  # its host copy is kept (else dropped: hand it back before a page-in)
    host_bytes: int = 0  # bytes of that host copy (per shard)

    @classmethod
    def from_runtime(cls, m) -> "AdapterInfo":
        return cls(num_pages=int(m["num_pages"]), resident=bool(m["resident"]), pinned=bool(m["pinned"]),
                   refs=int(m["refs"]), pages=tuple(int(p) for p in m["pages"]), host=bool(m["host"]),
                   host_bytes=int(m["host_bytes"]))


@dataclasses.dataclass
class HostCopy:
    """An adapter read and packed for a pool, not yet in it (`Pool.read_adapter`): what the pool
    keeps as its host copy. `source`: the PEFT folder it was read from (None: made in memory)."""

    plan: AdapterPlan
    nbytes: int  # bytes of the packed pages (per shard)
    source: Optional[str] = None
    packed: Optional[PackedAdapter] = None  # the pages (DevicePool); None: every shard packs `source`


class Pool(abc.ABC):
    """The unified page pool (paged KV cache and adapter store) made by `Runner.create_pool`.

    `handle` is the runtime object the compiled prefill/decode take. Sequence and adapter ids are
    the caller's integers; an adapter's id is its "slot" (never reused by the engine)."""

    _serials = itertools.count()

    def __init__(self, handle: Any, compiled: CompiledConfig):
        self.handle = handle
        self.compiled = compiled  # the model's config (adapters are checked and packed for it)
        # Unique in the process (id() of a freed pool comes back for the next): what a runner
        # keys per-pool device state by (the spare columns it filled for this pool's kept adapters).
        self.serial = next(Pool._serials)
        self._pads: list[int] = []  # padding_sequences

    @property
    def lora(self) -> Optional[LoraSpec]:
        """The compiled LoRA spec; None: compiled without LoRA (no adapters)."""
        return self.compiled.lora

    # --- how the runtime's functions are called -------------------------------------------------

    @property
    @abc.abstractmethod
    def num_shards(self) -> int:
        """Pools in step: 1, or one per tensor-parallel shard."""

    @abc.abstractmethod
    def _run(self, name: str, *args) -> None:
        """`name(handle, *args)` on every shard."""

    @abc.abstractmethod
    def _values(self, name: str, *args) -> list:
        """`name(handle, *args)` on every shard; every shard's result, in shard order."""

    def _value(self, name: str, *args):
        """`name(handle, *args)` on every shard; shard 0's result (the shards are in step)."""
        return self._values(name, *args)[0]

    # --- sequences ------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        self._run(KV_ADD, seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop the sequence's KV (pages shared with forks stay theirs) and its adapter binding."""
        self._run(KV_REMOVE, seq_id)

    def fork_sequence(self, parent: int, child: int, fork_pos: int = -1) -> None:
        """`child` shares `parent`'s first `fork_pos` tokens (-1: all) and its adapter."""
        self._run(KV_FORK, parent, child, fork_pos)

    def popn(self, seq_id: int, n: int) -> None:
        """Take the last `n` tokens off a sequence."""
        self._run(KV_POPN, seq_id, n)

    def sequence_length(self, seq_id: int) -> int:
        return int(self._value(KV_SEQUENCE_LENGTH, seq_id))

    def padding_sequences(self, k: int) -> list[int]:
        """`k` sequences of no request (ids from PAD_SEQUENCE_IDS, no adapter), empty between
        steps, that pad a decode batch to the size of a captured CUDA graph: each takes one page
        for its step's token, which `clear_padding` gives back. Added on first use, then kept."""
        pads = self._pads
        while len(pads) < k:
            self.add_sequence(PAD_SEQUENCE_IDS + len(pads))
            pads.append(PAD_SEQUENCE_IDS + len(pads))
        return pads[:k]

    def clear_padding(self, pads: Sequence[int]) -> None:
        """Take the step's token off each padding sequence of a step that began (its page back
        to the free list)."""
        for s in pads:
            self.popn(s, 1)

    def reset_padding(self, pads: Sequence[int]) -> None:
        """Empty the padding sequences whatever they hold (after a step that failed)."""
        for s in pads:
            n = self.sequence_length(s)
            if n:
                self.popn(s, n)

    def sequence_pages(self, seq_id: int) -> list[int]:
        return [int(p) for p in self._value(POOL_SEQUENCE_PAGES, seq_id)]

    def available_pages(self) -> int:
        """Free pages (not counting those idle adapters and cached prefixes would give back: see
        `admittable_pages`)."""
        return int(self._value(KV_AVAILABLE_PAGES))

    def admittable_pages(self) -> int:
        """Pages a batch can take: the free ones plus those idle resident adapters and idle cached
        prefixes would give back (evicted on demand): stats()'s free + evictable pages, in one
        small call (the scheduler asks every step)."""
        return int(self._value(POOL_ADMITTABLE_PAGES))

    # --- the prefix cache: full KV pages keyed by (adapter, token chain) -------------------------

    def prefix_lookup(self, slot: Optional[int], tokens: Sequence[int]) -> tuple[int, int]:
        """The tokens of the longest cached prefix of `tokens` for adapter `slot` (None: the base
        model), in whole pages, the last token always left out; and how many of those pages no
        sequence holds (attaching takes them from the evictable ones). Changes nothing."""
        shape = _tvm().runtime.ShapeTuple
        hit = self._value(POOL_PREFIX_LOOKUP, -1 if slot is None else slot, shape(list(tokens)))
        return int(hit[0]), int(hit[1])

    def prefix_attach(self, seq_id: int, tokens: Sequence[int]) -> int:
        """An empty sequence (bound to its adapter) takes the cached prefix of `tokens`: its length
        becomes the matched tokens, returned. Counts one query."""
        return int(self._value(POOL_PREFIX_ATTACH, seq_id, _tvm().runtime.ShapeTuple(list(tokens))))

    def prefix_insert(self, seq_id: int, start: int, tokens: Sequence[int]) -> int:
        """Key the sequence's full pages after those keyed already; `tokens` are its tokens from
        position `start` (a multiple of the page size). Returns its keyed pages, or -1 once its
        chain has ended (the same prefix was keyed on other pages, or its adapter changed)."""
        return int(self._value(POOL_PREFIX_INSERT, seq_id, start, _tvm().runtime.ShapeTuple(list(tokens))))

    # --- one forward pass (the runner's prefill/decode) ------------------------------------------

    def begin_forward(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        """Reserve the batch's KV (evicting idle adapters as needed) and build its LoRA tables."""
        # tvm-ffi's Shape constructor itself: ShapeTuple(...) first checks each element in Python
        # (isinstance Integral, ~0.5 us each: every sequence, every step); this one refuses a
        # non-integer as well
        shape = _tvm().get_global_func("ffi.Shape")
        self._run(KV_BEGIN, shape(*seq_ids), shape(*lengths))

    def end_forward(self) -> None:
        self._run(KV_END)

    @abc.abstractmethod
    def lora_tables(self) -> list:
        """The batch's LoRA inputs (LORA_TABLE_INPUTS order), between begin and end_forward."""

    def lora_num_slots(self) -> int:
        """The batch's distinct adapters, between begin and end_forward (0: base model only)."""
        return int(self._value(POOL_LORA_NUM_SLOTS))

    def lora_rank_total(self) -> int:
        """The sum of the ranks of the batch's adapters, between begin and end_forward."""
        return int(self._value(POOL_LORA_RANK_TOTAL))

    # --- adapters -------------------------------------------------------------------------------

    def configure_lora(self, num_modules: Optional[int] = None, max_rank: Optional[int] = None) -> None:
        """Size the per-batch tables (once, before loading adapters): by default for the compiled
        LoRA modules and rank (create_pool does it for LoRA models)."""
        self._run(POOL_CONFIGURE_LORA, len(self.lora.modules) if num_modules is None else num_modules,
                  self.lora.max_rank if max_rank is None else max_rank)

    def keep_lora_columns(self, rank_columns: int, slot_columns: int) -> None:
        """Batches within `rank_columns` over `slot_columns` adapters keep their slots in a fixed
        column order (a library with spare columns: the rank columns route); 0, 0: off."""
        self._run(POOL_KEEP_LORA_COLUMNS, rank_columns, slot_columns)

    def lora_columns_generation(self) -> int:
        """Counts the changes of the kept columns (keep_lora_columns)."""
        return int(self._value(POOL_LORA_COLUMNS_GENERATION))

    def load_adapter(self, slot: int, adapter: str | Path | LoraAdapter, pin: bool = False,
                     name: Optional[str] = None) -> AdapterPlan:
        """Check the PEFT folder `adapter` (or an adapter in memory) against the compiled model,
        pack it and load it into this pool as `slot` (`read_adapter`, then `add_adapter`); `pin`
        keeps it resident; `name` (default: the folder's) names it in errors. Returns what was
        loaded (rank, modules, scales, pages per shard...)."""
        host = self.read_adapter(adapter, name)
        self.add_adapter(slot, host, pin)
        return host.plan

    @abc.abstractmethod
    def read_adapter(self, adapter: str | Path | LoraAdapter, name: Optional[str] = None) -> HostCopy:
        """Read and check the PEFT folder `adapter` (or an adapter in memory) against the compiled
        model and pack it: disk -> host, nothing in the pool changes (any thread may call it).
        LoraError when the model cannot serve it."""

    def add_adapter(self, slot: int, host: HostCopy, pin: bool = False) -> bool:
        """Load a read adapter as `slot`, keeping its host copy. It takes pages now if free pages and
        idle adapters allow, else when a batch, a pin or `prefetch_adapter` needs it: a busy pool
        never refuses a load. Returns whether it is resident. LoraError when it can never fit (more
        pages than the pool has beside its pinned adapters)."""
        self._check_lora()
        self._check_fits(host.plan, pin)
        return self._add_adapter(slot, host, bool(pin))

    @abc.abstractmethod
    def _add_adapter(self, slot: int, host: HostCopy, pin: bool) -> bool:
        """add_adapter once checked."""

    @abc.abstractmethod
    def set_adapter_host(self, slot: int, host: HostCopy) -> None:
        """Hand back the host copy of a loaded adapter whose copy was dropped (`host` read again
        from its folder; ValueError if it is not packed as at its load)."""

    def drop_adapter_host(self, slot: int) -> None:
        """Free the host copy of a loaded adapter that holds no pages (the host tier's budget);
        `set_adapter_host` must hand it back before it is paged in again."""
        self._run(POOL_DROP_ADAPTER_HOST, slot)

    def prefetch_adapter(self, slot: int, keep: Sequence[int] = (),
                         protect: Sequence[tuple[Optional[int], Sequence[int]]] = ()) -> bool:
        """Page in a loaded adapter ahead of its batch if free pages, idle adapters not in `keep`
        and idle cached prefix pages allow (least recently used evicted first), never evicting the
        cached prefixes of `protect` ((adapter slot or None, tokens) of waiting requests, which would
        hit them); whether it is resident afterwards."""
        shape = _tvm().runtime.ShapeTuple
        flat = []  # (adapter or -1, token count, tokens...) per request: one Shape (any session passes it)
        for a, toks in protect:
            flat += [-1 if a is None else int(a), len(toks), *map(int, toks)]
        return bool(self._value(POOL_PREFETCH_ADAPTER, slot, shape([int(k) for k in keep]), shape(flat)))

    def resident_adapters(self) -> set[int]:
        """The slots of the adapters that hold their pages now."""
        return {int(i) for i in self._value(POOL_RESIDENT_ADAPTERS)}

    def unload_adapter(self, slot: int) -> None:
        """Forget the adapter; its pages come back when its last sequence is removed."""
        self._run(POOL_UNLOAD_ADAPTER, slot)

    def pin_adapter(self, slot: int, pin: bool) -> None:
        """Pin (paged back in now if evicted; never evicted) or unpin (evictable once idle)."""
        self._run(POOL_PIN_ADAPTER, slot, pin)

    def set_sequence_adapter(self, seq_id: int, slot: Optional[int]) -> None:
        """Bind a sequence to an adapter (None: the base model); the pool counts its users."""
        self._run(POOL_SET_SEQUENCE_ADAPTER, seq_id, -1 if slot is None else slot)

    def adapter_info(self, slot: int) -> AdapterInfo:
        return AdapterInfo.from_runtime(self._value(POOL_ADAPTER_INFO, slot))

    def adapter_pages_to_run(self, slots: Sequence[int]) -> list[int]:
        """For each adapter, the pages a batch must find for it: 0 if it is resident and kept (pinned
        or held by a sequence), else all of its pages. One runtime call for all of them."""
        return list(self._value(POOL_ADAPTER_PAGES_TO_RUN, _tvm().get_global_func("ffi.Shape")(*slots)))

    def stats(self) -> PoolStats:
        return PoolStats.from_runtime(self._value(POOL_STATS))

    def shard_adapter_info(self, slot: int) -> list[AdapterInfo]:
        """adapter_info of every shard's pool (they are in step: all equal)."""
        return [AdapterInfo.from_runtime(m) for m in self._values(POOL_ADAPTER_INFO, slot)]

    def shard_stats(self) -> list[PoolStats]:
        """stats of every shard's pool (they are in step: all equal)."""
        return [PoolStats.from_runtime(m) for m in self._values(POOL_STATS)]

    def check_invariants(self) -> None:
        """Recount every page's owner in the runtime; raises when the bookkeeping is off."""
        self._values(POOL_CHECK_INVARIANTS)

    def poison_free_pages(self) -> None:
        """Fill the free pages with NaN (every layer, KV and adapter rows alike): a kernel that reads
        a page its batch does not own then shows NaN in its output instead of passing by chance
        (the tests make every pool so)."""
        self._run(POOL_POISON_FREE_PAGES)

    def _check_lora(self) -> None:
        if self.lora is None:
            raise LoraError(f"{self.compiled.model_dir} was compiled without LoRA: recompile it with "
                            "--max-lora-rank R --lora-pool-pages P to load adapters")

    def _check_fits(self, plan: AdapterPlan, pin: bool = False) -> None:
        s = self.stats()
        what = f"adapter {plan.name} (rank {plan.rank}, {', '.join(plan.modules)}) needs {plan.num_pages} pages"
        if plan.num_pages > s.total_pages:
            raise LoraError(f"{what}, but the whole pool has {s.total_pages}")
        if plan.num_pages > s.total_pages - s.pinned_pages:
            raise LoraError(f"{what}, but pinned adapters hold {s.pinned_pages} of the pool's {s.total_pages} "
                            f"pages; unpin some {'before pinning another' if pin else 'to load it'}")


class DevicePool(Pool):
    """The pool of a single-device runner: the runtime's functions called here, on its device."""

    def __init__(self, handle: Any, compiled: CompiledConfig, max_batch_size: Optional[int] = None):
        super().__init__(handle, compiled)
        self._funcs: dict[str, Any] = {}
        self.max_batch_size = max_batch_size or compiled.max_batch_size  # sequences a forward may hold

    @property
    def num_shards(self) -> int:
        return 1

    def _f(self, name: str):
        f = self._funcs.get(name)
        if f is None:
            f = self._funcs[name] = _tvm().get_global_func(name)
            keep_gil(f)  # bookkeeping of microseconds
        return f

    def _run(self, name: str, *args) -> None:
        self._f(name)(self.handle, *args)

    def _values(self, name: str, *args) -> list:
        return [self._f(name)(self.handle, *args)]

    def lora_tables(self) -> list:
        return list(self._f(POOL_LORA_TABLES)(self.handle))

    def lora_graph_tables(self) -> list:
        """The batch's LoRA inputs with the slot tables at the pool's slot capacity: the same
        device addresses and shapes at every batch (decode captured in CUDA graphs)."""
        return list(self._f(POOL_LORA_GRAPH_TABLES)(self.handle))

    def load_packed_adapter(self, slot: int, packed: PackedAdapter, pin: bool = False) -> bool:
        """Load pages packed already (`mlc_lora.lora.pack_adapter`) as `slot`; whether it is resident."""
        return bool(self._value(POOL_LOAD_ADAPTER, slot, *packed.ffi_args(), bool(pin)))

    def read_adapter(self, adapter: str | Path | LoraAdapter, name: Optional[str] = None) -> HostCopy:
        self._check_lora()
        source = None
        if isinstance(adapter, LoraAdapter):
            packed = pack_adapter(self.lora, dataclasses.replace(adapter, name=name or adapter.name),
                                  self.compiled.numpy_dtype)
        else:
            packed = pack_peft_adapter(adapter, self.compiled.raw, name)
            source = str(adapter)
        plan = AdapterPlan(packed.name, packed.rank, list(packed.modules), dict(packed.scales),
                           int(packed.pages.shape[1]), packed.lora_alpha, packed.use_rslora)
        return HostCopy(plan, int(packed.pages.nbytes), source, packed)

    def _add_adapter(self, slot: int, host: HostCopy, pin: bool) -> bool:
        return self.load_packed_adapter(slot, host.packed, pin)

    def set_adapter_host(self, slot: int, host: HostCopy) -> None:
        self._run(POOL_SET_ADAPTER_HOST, slot, *host.packed.ffi_args())
