"""The scheduler against a page-exact model of the unified pool (no compiled model): every batch it
makes must fit the pool as the C++ pool would reserve it, no request that fits is rejected, and
stage 1 (`single`: one adapter per batch) does not thrash between adapters."""

from __future__ import annotations

import numpy as np
import pytest

from mlc_lora.contract import PAGE_SIZE
from mlc_lora.engine.scheduler import MAX_SKIPS, SamplingParams, Scheduler, Sequence, Status, new_pages


class FakePool:
    """The page accounting of src/runtime/page_pool.h: one free count for KV and adapters; an
    adapter is resident or evicted, referenced by the sequences bound to it; idle unpinned resident
    adapters are evicted least recently used first when a batch needs their pages."""

    def __init__(self, total: int, adapters: dict[int, int], pinned=()):
        self.total = total
        self.adapters = {a: dict(pages=n, resident=False, pinned=a in pinned, refs=0, last=0)
                         for a, n in adapters.items()}
        self.kv: dict[int, int] = {}  # seq -> pages
        self.len: dict[int, int] = {}
        self.seq_adapter: dict[int, int] = {}
        self.clock = 0
        self.admitted: list[int] = []  # sequence ids in the order the scheduler admitted them
        for a in pinned:
            self.adapters[a]["resident"] = True

    def free(self) -> int:
        used = sum(self.kv.values()) + sum(a["pages"] for a in self.adapters.values() if a["resident"])
        return self.total - used

    def evictable(self) -> int:
        return sum(a["pages"] for a in self.adapters.values()
                   if a["resident"] and not a["pinned"] and a["refs"] == 0)

    def available_pages(self) -> int:
        return self.free() + self.evictable()

    def pages_to_run(self, slots: list[int]) -> list[int]:
        return [0 if a["resident"] and (a["pinned"] or a["refs"] > 0) else a["pages"]
                for a in (self.adapters[s] for s in slots)]

    def add_sequence(self, seq: Sequence) -> None:
        self.admitted.append(seq.seq_id)
        self.kv[seq.seq_id], self.len[seq.seq_id] = 0, 0
        if seq.adapter_slot is not None:
            self.seq_adapter[seq.seq_id] = seq.adapter_slot
            self.adapters[seq.adapter_slot]["refs"] += 1

    def remove_sequence(self, seq_id: int) -> None:
        del self.kv[seq_id], self.len[seq_id]
        a = self.seq_adapter.pop(seq_id, None)
        if a is not None:
            self.adapters[a]["refs"] -= 1

    def _take(self, n: int, keep: set) -> None:
        """n free pages, evicting idle adapters (LRU) not in `keep`; AssertionError if impossible."""
        idle = sorted((a["last"], s) for s, a in self.adapters.items()
                      if a["resident"] and not a["pinned"] and a["refs"] == 0 and s not in keep)
        while self.free() < n:
            assert idle, f"the scheduler's batch needs {n} pages, the pool has {self.free()} + nothing to evict"
            self.adapters[idle.pop(0)[1]]["resident"] = False

    def run(self, seqs, chunks) -> None:
        """begin_forward's reservation: page in the batch's adapters, then append the KV."""
        self.clock += 1
        keep = {s.adapter_slot for s in seqs if s.adapter_slot is not None}
        for slot in keep:
            a = self.adapters[slot]
            if not a["resident"]:
                self._take(a["pages"], keep)
                a["resident"] = True
            a["last"] = self.clock
        for s, c in zip(seqs, chunks):
            need = new_pages(self.len[s.seq_id], len(c))
            self._take(need, keep)
            self.kv[s.seq_id] += need
            self.len[s.seq_id] += len(c)


def simulate(pool: FakePool, requests, one_adapter: bool, max_num_seqs=16, max_step_tokens=128, **kw):
    """Run `requests` [(adapter slot or None, prompt length, max_tokens)] to the end; returns the
    scheduler (its rejected list and preemption count) and the finished sequences. `kw`: more of the
    Scheduler's arguments (adapter_ready, adapter_resident)."""
    sched = Scheduler(pool.available_pages, lambda sid: pool.add_sequence(by_id[sid]), pool.remove_sequence,
                      max_num_seqs, max_step_tokens, adapter_pages=pool.pages_to_run,
                      one_adapter_per_batch=one_adapter, **kw)
    by_id, done = {}, []
    for slot, n, m in requests:
        s = Sequence(list(range(n)), SamplingParams(max_tokens=m))
        s.adapter_slot = slot
        by_id[s.seq_id] = s
        sched.add(s)
    rejected = []
    for _ in range(100000):
        batch = sched.schedule()
        rejected += sched.rejected
        sched.rejected.clear()
        if batch is None:
            break
        if one_adapter:
            assert len({s.adapter_slot for s in batch.seqs} - {None}) <= 1, "stage 1: one adapter per batch"
        pool.run(batch.seqs, batch.chunks)
        for i, (s, c) in enumerate(zip(batch.seqs, batch.chunks)):
            sample = batch.samples(i)
            s.num_cached += len(c)
            if sample:
                s.output_ids.append(7)
                if len(s.output_ids) >= s.params.max_tokens:
                    sched.finish(s)
                    done.append(s)
    assert not sched.running and not sched.waiting
    assert all(s.status == Status.FINISHED for s in by_id.values())
    assert not pool.kv and all(a["refs"] == 0 for a in pool.adapters.values())
    return sched, done, rejected


def test_single_preempts_the_last_running_sequence_of_another_adapter_instead_of_rejecting():
    """A request of adapter B that fits the pool alone, while one sequence of adapter A holds most
    of the pages: stage 1 must preempt (or finish) A's sequence, never reject either of them."""
    pool = FakePool(total=12, adapters={0: 2, 1: 2})
    # A: 100 tokens + 20 new (8 pages); B: 90 + 10 (7 pages): together 15 + 4 adapter pages > 12
    reqs = [(0, 100, 20), (1, 90, 10)]
    sched, done, rejected = simulate(pool, reqs, one_adapter=True)
    assert rejected == [] and len(done) == 2


@pytest.mark.parametrize("max_num_seqs", [16, 3])
@pytest.mark.parametrize("one_adapter", [False, True])
def test_every_request_that_fits_alone_is_served(one_adapter, max_num_seqs):
    """Random mixes of adapters and base requests on a small pool: nothing that fits alone is
    rejected, and every batch fits the pool (FakePool.run asserts it)."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        pages = {a: int(rng.integers(1, 4)) for a in range(4)}
        total = 16
        pool = FakePool(total, pages, pinned=(3,) if trial % 3 == 0 else ())
        reqs = []
        for _ in range(int(rng.integers(2, 12))):
            slot = None if rng.random() < 0.2 else int(rng.integers(0, 4))
            n, m = int(rng.integers(1, 120)), int(rng.integers(1, 40))
            reqs.append((slot, n, m))
        pinned = pages[3] if trial % 3 == 0 else 0
        fits = [(-(-(n + m) // PAGE_SIZE) + (0 if s is None or (s == 3 and pinned) else pages[s])
                 <= total - pinned) for s, n, m in reqs]
        sched, done, rejected = simulate(pool, reqs, one_adapter, max_num_seqs=max_num_seqs)
        assert len(rejected) == fits.count(False), (trial, reqs, [r.seq_id for r in rejected])
        assert len(done) == fits.count(True)


def test_single_needs_few_preemptions_on_a_loaded_pool():
    """72 requests over 6 adapters on a pool that holds about a sixth of them: stage 1 may pause
    an adapter's sequences while another runs, but must not preempt far more than gather does."""
    rng = np.random.default_rng(1)
    reqs = [(int(rng.integers(0, 6)) if rng.random() > 0.1 else None, int(rng.integers(20, 80)),
             int(rng.integers(8, 40))) for _ in range(72)]
    adapters = {a: 2 for a in range(6)}
    gather, done_g, rej_g = simulate(FakePool(64, adapters), reqs, one_adapter=False)
    single, done_s, rej_s = simulate(FakePool(64, adapters), reqs, one_adapter=True)
    assert rej_g == rej_s == [] and len(done_g) == len(done_s) == 72
    assert gather.num_preemptions > 0  # the pool is tight
    assert single.num_preemptions <= 1.5 * gather.num_preemptions, (single.num_preemptions,
                                                                     gather.num_preemptions)


def test_resident_adapters_go_first_and_a_passed_over_request_waits_at_most_max_skips():
    """One request whose adapter must be paged in, then twenty on a resident adapter, one running
    at a time: the resident ones go first, but the first request is passed over MAX_SKIPS times at
    most. Without the residency callback admission stays first come, first served."""
    reqs = [(0, 20, 2)] + [(1, 20, 2)] * 20
    pool = FakePool(total=64, adapters={0: 2, 1: 2}, pinned=(1,))
    sched, done, rejected = simulate(pool, reqs, False, max_num_seqs=1,
                                     adapter_resident=lambda a: pool.adapters[a]["resident"])
    assert rejected == [] and len(done) == 21
    first = min(pool.admitted)  # seq ids grow with arrival
    assert pool.admitted.index(first) == MAX_SKIPS
    assert pool.admitted[:MAX_SKIPS] == sorted(pool.admitted[:MAX_SKIPS])  # the others in arrival order
    fifo = FakePool(total=64, adapters={0: 2, 1: 2}, pinned=(1,))
    simulate(fifo, reqs, False, max_num_seqs=1)
    assert fifo.admitted == sorted(fifo.admitted)


def test_a_request_whose_adapter_is_not_ready_waits_without_holding_up_the_others():
    """Adapter 0 is being read from disk for two scheduling rounds: its request waits at the head of
    the queue while the requests behind it are admitted; then it runs too."""
    calls = []

    def ready(slot):
        calls.append(slot)
        return slot != 0 or calls.count(0) > 2

    pool = FakePool(total=64, adapters={0: 2, 1: 1})
    reqs = [(0, 20, 3), (None, 20, 3), (1, 20, 3)]
    sched, done, rejected = simulate(pool, reqs, False, max_num_seqs=4, adapter_ready=ready)
    assert rejected == [] and len(done) == 3
    first = min(pool.admitted)
    assert pool.admitted.index(first) == 2 and calls.count(0) == 3


# --- fair share (the virtual token counter) -------------------------------------------------------


def _fair_scheduler(pool: FakePool, max_num_seqs: int, fair: bool = True, one_adapter: bool = False, **kw):
    by_id: dict = {}
    sched = Scheduler(pool.available_pages, lambda sid: pool.add_sequence(by_id[sid]), pool.remove_sequence,
                      max_num_seqs, 128, adapter_pages=pool.pages_to_run, fair_share=fair,
                      one_adapter_per_batch=one_adapter, **kw)
    return sched, by_id


def _submit(sched, by_id, name, slot, n, prompt_len=8, max_tokens=4):
    seqs = []
    for _ in range(n):
        s = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), adapter_name=name)
        s.adapter_slot = slot
        by_id[s.seq_id] = s
        sched.add(s)
        seqs.append(s)
    return seqs


def _flood_then_ask(sched, pool, by_id, flood, then) -> list:
    """`flood` = (client, slot, n) requests, one step, then `then`'s, stepped until done; the
    sequences in the order they were admitted."""
    _submit(sched, by_id, *flood)
    admitted: list = []
    _step(sched, pool, admitted)
    _submit(sched, by_id, *then)
    while _step(sched, pool, admitted):
        pass
    return admitted


def _step(sched, pool, admitted: list, one_adapter: bool = False) -> bool:
    """One step as the engine takes it: schedule, run on the fake pool, count generated tokens."""
    before = {s.seq_id for s in sched.running}
    batch = sched.schedule()
    if batch is None:
        return False
    if one_adapter:
        assert len({s.adapter_slot for s in batch.seqs} - {None}) <= 1, "stage 1: one adapter per batch"
    admitted += [s for s in batch.seqs if s.seq_id not in before]
    pool.run(batch.seqs, batch.chunks)
    for i, (s, c) in enumerate(zip(batch.seqs, batch.chunks)):
        sample = batch.samples(i)
        s.num_cached += len(c)
        if sample:
            s.output_ids.append(7)
            sched.generated(s)
            if len(s.output_ids) >= s.params.max_tokens:
                sched.finish(s)
    return True


def test_fair_share_counts_weighted_tokens_and_lifts_an_idle_client():
    """Prompt tokens count 1 when admitted, generated tokens 2; a client arriving with nothing
    waiting is lifted to the last admitted client's counter (nothing waits) or to the least counter
    of the waiting clients, so the credit of idling is not banked."""
    pool = FakePool(256, {0: 1, 1: 1})
    sched, by_id = _fair_scheduler(pool, max_num_seqs=4)
    svc = sched.service
    _submit(sched, by_id, "A", 0, 3, prompt_len=10, max_tokens=5)
    admitted: list = []
    while _step(sched, pool, admitted):
        pass
    a = svc.of("A")
    assert (a.prompt_tokens, a.generated_tokens, a.counter) == (30, 15, 30 + 2 * 15)
    # B idled while A was served: its first request starts from A's counter (nothing waits)
    _submit(sched, by_id, "B", 1, 1)
    assert svc.of("B").counter == a.counter == 60
    # A arrives with nothing waiting of its own: lifted to B's (the least waiting), here a no-op
    _submit(sched, by_id, "A", 0, 1)
    assert a.counter == 60
    while _step(sched, pool, admitted):
        pass
    assert svc.of("B").counter == 60 + 8 + 2 * 4
    # the base model is a client of its own
    _submit(sched, by_id, None, None, 1, prompt_len=3, max_tokens=2)
    while _step(sched, pool, admitted):
        pass
    assert (svc.of(None).prompt_tokens, svc.of(None).generated_tokens) == (3, 2)


def test_fair_share_admits_the_least_served_client_and_fifo_does_not():
    """A floods the queue, then B asks: with fair share B's requests go in as soon as places free up
    (they alternate with A's), first come first served makes them wait for all of A's."""
    def admissions(fair):
        pool = FakePool(1024, {0: 1, 1: 1})
        sched, by_id = _fair_scheduler(pool, max_num_seqs=2, fair=fair)
        return [s.adapter_name for s in _flood_then_ask(sched, pool, by_id, ("A", 0, 12), ("B", 1, 3))]

    fair, fifo = admissions(True), admissions(False)
    assert sorted(fair) == sorted(fifo) == ["A"] * 12 + ["B"] * 3
    assert fifo.index("B") == 12  # behind every request of A
    # fair share, counter by counter: A1, A2 admitted (A: 16 + 4 for their first tokens); B arrives
    # and is lifted to A's 20 (not left at 0); A1, A2 finish (A: 32); B1, B2 take both places (B: 36,
    # then 52 with their tokens); A3, A4 (A: 48, 64 with theirs); then B3 (52 < 64)
    assert [i for i, c in enumerate(fair) if c == "B"] == [2, 3, 6], fair


def test_fair_share_preview_is_the_order_admission_takes():
    """Prefetch looks ahead in queue_order(preview=True): with nothing admitted between its picks it
    raises a copy of the counters as each admission would, so it sees the clients alternate as
    admission then makes them (without that it would see all of the least-served client's requests
    first), and it changes no counter; first come first served is the queue either way."""
    pool = FakePool(4096, {0: 1, 1: 1})
    sched, by_id = _fair_scheduler(pool, max_num_seqs=16)
    _submit(sched, by_id, "A", 0, 4, prompt_len=10)
    _submit(sched, by_id, "B", 1, 4, prompt_len=10)
    sched.service.of("B").counter = 15.0  # B was served more than A so far
    before = {c: (s.counter, s.prompt_tokens) for c, s in sched.service.clients.items()}
    preview = [s.adapter_name for s in sched.queue_order(preview=True)]
    # A 0 -> 10 -> 20 (B's 15 is less) -> B 25 -> A 30 -> B 35 -> ...
    assert preview == ["A", "A", "B", "A", "B", "A", "B", "B"]
    assert {c: (s.counter, s.prompt_tokens) for c, s in sched.service.clients.items()} == before
    assert [s.adapter_name for s in sched.queue_order()][:4] == ["A"] * 4  # no admission: A stays least
    admitted: list = []
    _step(sched, pool, admitted)  # every request fits: admission in one step, in the preview's order
    assert [s.adapter_name for s in admitted] == preview
    fifo, fb = _fair_scheduler(FakePool(4096, {0: 1, 1: 1}), max_num_seqs=16, fair=False)
    _submit(fifo, fb, "B", 1, 2)
    _submit(fifo, fb, "A", 0, 2)
    assert [s.adapter_name for s in fifo.queue_order(preview=True)] == ["B", "B", "A", "A"]


@pytest.mark.parametrize("fair", [False, True])
def test_max_loras_bounds_the_adapters_of_the_running_sequences(fair):
    """max_loras=2 over four adapters, requests round-robin: at no step do the running sequences
    span more than two adapters, though places are free; base-model requests do not count; every
    request is served, each adapter in turn; without the bound all four run at once."""
    def run(max_loras):
        pool = FakePool(4096, {a: 1 for a in range(4)})
        sched, by_id = _fair_scheduler(pool, max_num_seqs=32, fair=fair, max_loras=max_loras)
        for i in range(16):
            a = i % 5
            _submit(sched, by_id, None if a == 4 else f"a{a}", None if a == 4 else a, 1, max_tokens=3 + i % 3)
        admitted, spans = [], []
        while _step(sched, pool, admitted):
            spans.append({s.adapter_slot for s in sched.running} - {None})
        assert len(admitted) == 16 and not sched.waiting and not sched.running
        return spans, admitted

    spans, admitted = run(2)
    assert max(len(s) for s in spans) == 2
    assert {s.adapter_slot for s in admitted} == {0, 1, 2, 3, None}
    # the first step admits the requests of the first two adapters and every base-model one (which
    # never waits for the bound); the others' wait, in turn
    assert [s.adapter_slot for s in admitted[:9]] == [0, 1, None, 0, 1, None, 0, 1, None]
    spans, _ = run(None)
    assert max(len(s) for s in spans) == 4
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_loras must be a positive integer"):
            _fair_scheduler(FakePool(64, {}), max_num_seqs=4, max_loras=bad)


@pytest.mark.parametrize("one_adapter", [False, True])
def test_fair_share_serves_every_request_that_fits_and_preempted_ones_resume(one_adapter):
    """The random mixes of test_every_request_that_fits_alone_is_served with fair share: nothing
    that fits is rejected, every batch fits the pool (and holds one adapter in stage 1), preempted
    sequences finish, and the counters add up to what was served (a preempted prompt counts once)."""
    rng = np.random.default_rng(3)
    preemptions = 0
    for trial in range(20):
        pages = {a: int(rng.integers(1, 4)) for a in range(4)}
        pool = FakePool(16, pages)
        sched, by_id = _fair_scheduler(pool, max_num_seqs=int(rng.integers(2, 8)), one_adapter=one_adapter)
        want: dict = {}
        for _ in range(int(rng.integers(2, 14))):
            slot = None if rng.random() < 0.2 else int(rng.integers(0, 4))
            n, m = int(rng.integers(1, 90)), int(rng.integers(1, 30))
            if -(-(n + m) // PAGE_SIZE) + (0 if slot is None else pages[slot]) > 16:
                continue
            name = None if slot is None else f"a{slot}"
            _submit(sched, by_id, name, slot, 1, prompt_len=n, max_tokens=m)
            p, g = want.get(name, (0, 0))
            want[name] = (p + n, g + m)
        admitted: list = []
        while _step(sched, pool, admitted, one_adapter):
            assert not sched.rejected, trial
        assert not sched.running and not sched.waiting and not sched.service.queued
        got = {c: (s.prompt_tokens, s.generated_tokens) for c, s in sched.service.clients.items()}
        assert got == want, trial
        preemptions += sched.num_preemptions
    assert preemptions > 0  # the pool is tight: preempted sequences were resumed and counted once


@pytest.mark.parametrize("fair", [True, False])
def test_the_resident_preference_within_fair_share_and_fifo(fair):
    """B (adapter 1, pinned) floods the queue; A (adapter 0, not resident) then asks for three, one
    request running at a time. Without the residency callback fair share admits A at once (its
    counter is lifted to B's, then B's grows) and FIFO behind all of B. With it, A is deferred while
    its adapter is not resident, MAX_SKIPS admissions at most; once it ran, its adapter is resident
    and fair share gives A the places its counter earns (FIFO: A's requests keep their places)."""
    def admissions(resident: bool) -> list:
        pool = FakePool(1024, {0: 2, 1: 2}, pinned=(1,))
        kw = dict(adapter_resident=lambda a: pool.adapters[a]["resident"]) if resident else {}
        sched, by_id = _fair_scheduler(pool, max_num_seqs=1, fair=fair, **kw)
        admitted = _flood_then_ask(sched, pool, by_id, ("B", 1, 20), ("A", 0, 3))
        assert not sched.waiting and len(admitted) == 23
        return [i for i, s in enumerate(admitted) if s.adapter_name == "A"]

    plain, preferring = admissions(False), admissions(True)
    if fair:
        assert plain[0] == 1 and preferring == [1 + MAX_SKIPS, 2 + MAX_SKIPS, 3 + MAX_SKIPS], (plain, preferring)
    else:  # FIFO: A is last either way, its adapter paged in when nothing else waits
        assert plain == preferring == [20, 21, 22]
