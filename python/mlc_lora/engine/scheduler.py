"""Sequences and the continuous-batching scheduler (decodes first, then chunked prefills, bounded
by free KV pages; preemption by recompute when the pages run out). With the prefix cache, a request
is admitted after its cached prefix (whole pages of its adapter's KV kept from earlier requests) and
prefills only the rest.

LoRA: KV and adapters share the unified pool's pages. A batch counts, beside its KV pages, the
pages of every adapter it must page in or keep from eviction; a request that cannot fit even with
nothing else running is rejected (PoolExhaustedError), never retried forever. Stage-1 (`single`)
libraries get one adapter per batch (plus base-model rows): that of the oldest request on an adapter.

Admission order (`Scheduler._admission_order`, the one place it is decided): first come first
served, or with `fair_share` the virtual token counter (VTC) of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024). Every client (an adapter name; the base model is a client of its
own) has a counter of the service it got, prompt tokens weighted 1 when its request is admitted and
generated tokens weighted 2 as they come (the paper's defaults); the scheduler admits the oldest
request of the client with the smallest counter among those with waiting requests. A client that
had nothing waiting is lifted, when its request arrives, to the smallest counter among the clients
with waiting requests (to the counter of the last admitted client when none waits), so an idle
client banks no credit. Running sequences are never preempted for fairness, and preempted ones
resume first. The tokens served per client are counted either way (`ServiceCounters`).
In that order, requests whose adapter holds its pages (or that have none) are tried before those
whose adapter must be paged in; a deferred request is passed over (another admitted in its stead)
at most MAX_SKIPS times, then it is deferred no more. A request whose adapter is still being read
from disk waits without holding up the others. With `max_loras` (vLLM's `--max-loras`, SGLang's
`--max-loras-per-batch`) the running sequences span at most that many adapters: a request on
another adapter waits, without holding up the others, until one of them has no running sequence
left (every step reads the rows of every adapter its sequences use: fewer adapters per step, fewer
bytes)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import heapq
import itertools
from collections import Counter, deque
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..contract import PAGE_SIZE

# times a waiting request may be passed over for others while its adapter waits to be paged in
MAX_SKIPS = 8


@dataclasses.dataclass
class SamplingParams:  # pylint: disable=too-many-instance-attributes
    max_tokens: Optional[int]  # 0: score the prompt only (prompt_logprobs)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # also score the prompt's tokens (completions' `echo` with logprobs)
    # logit processing (engine/sampler.py `process_logits`), as vLLM's
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Any = None  # a compiled grammar the output must follow (`response_format`)

    @property
    def processes_logits(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.grammar is not None)


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


_seq_ids = itertools.count()


class Sequence:  # pylint: disable=too-many-instance-attributes
    """One request's tokens, its place in the KV cache, and its sampling state."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, adapter_name: Optional[str] = None,
                 sink: Optional[Callable[[Any], Any]] = None):
        self.seq_id = next(_seq_ids)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.adapter_name = adapter_name  # the LoRA adapter the request asked for (None: base model)
        self.adapter_slot: Optional[int] = None  # its id in the pool, once the engine takes it
        self.status = Status.WAITING
        self.num_cached = 0  # tokens whose KV is in the cache
        self.prefix_pages: Optional[int] = 0  # leading pages keyed in the prefix cache (None: no more)
        self.finish_reason: Optional[str] = None
        self.rng = np.random.default_rng(params.seed)
        # receives this sequence's outputs (set by the engine front end); what it returns, if not
        # None, is called once after the step's outputs (LLMEngine._deliver)
        self.sink = sink
        self.state: Any = None  # the engine's per-request text state (detokeniser, stop strings)
        self.skipped = 0  # admissions while it was deferred for its adapter's page-in (<= MAX_SKIPS)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0


def new_pages(num_cached: int, n: int) -> int:
    """Pages a sequence must take to append `n` tokens after `num_cached`."""
    return -(-(num_cached + n) // PAGE_SIZE) - -(-num_cached // PAGE_SIZE)


@dataclasses.dataclass
class Batch:
    seqs: list[Sequence]
    chunks: list[list[int]]  # tokens each sequence appends this step

    @functools.cached_property
    def is_decode(self) -> bool:  # (asked several times a step: computed once, before the step runs)
        return all(len(c) == 1 and s.num_cached == s.num_tokens - 1 for s, c in zip(self.seqs, self.chunks))

    def samples(self, i: int) -> bool:
        """Row `i` completes its sequence's known tokens: its logits give the next token."""
        return self.seqs[i].num_cached + len(self.chunks[i]) == self.seqs[i].num_tokens


# VTC's weights of a prompt token and a generated token (the paper's w_p, w_q)
PROMPT_TOKEN_WEIGHT = 1.0
GENERATED_TOKEN_WEIGHT = 2.0


@dataclasses.dataclass
class Served:
    """What one client (an adapter name, None: the base model) got."""

    prompt_tokens: int = 0  # prompts of its admitted requests (a preempted one counts once)
    generated_tokens: int = 0
    counter: float = 0.0  # the virtual token counter: weighted tokens, lifted after idling

    def as_dict(self) -> dict[str, Any]:
        return dict(prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                    service=self.counter)


class ServiceCounters:
    """The VTC bookkeeping: per client its `Served`, how many of its requests wait, and which
    client's request left the queue last."""

    def __init__(self):
        self.clients: dict[Optional[str], Served] = {}
        self.queued: Counter = Counter()  # client -> its waiting sequences
        self.last_admitted: Optional[Served] = None

    def of(self, client: Optional[str]) -> Served:
        served = self.clients.get(client)
        if served is None:
            served = self.clients[client] = Served()
        return served

    def arrive(self, client: Optional[str]) -> None:
        """A new request of `client` joins the queue: a client with nothing waiting is lifted to the
        least counter of the waiting clients (or the last admitted one's), never lowered."""
        served = self.of(client)
        if not self.queued[client]:
            waiting = [self.clients[c].counter for c in self.queued]
            floor = min(waiting) if waiting else (self.last_admitted.counter if self.last_admitted else 0.0)
            served.counter = max(served.counter, floor)
        self.queued[client] += 1

    def requeue(self, client: Optional[str]) -> None:
        """A preempted sequence waits again (not a new request: no lift)."""
        self.queued[client] += 1

    def leave(self, client: Optional[str]) -> None:
        self.queued[client] -= 1
        if not self.queued[client]:
            del self.queued[client]

    def admit(self, client: Optional[str], prompt_tokens: int) -> None:
        served = self.of(client)
        served.prompt_tokens += prompt_tokens
        served.counter += PROMPT_TOKEN_WEIGHT * prompt_tokens
        self.last_admitted = served

    def generated(self, client: Optional[str], n: int = 1) -> None:
        served = self.of(client)
        served.generated_tokens += n
        served.counter += GENERATED_TOKEN_WEIGHT * n


class Scheduler:
    """FIFO or fair-share admission; running decodes first; pages checked before every step."""

    def __init__(self, free_pages: Callable[[], int], add_sequence: Callable[[int], None],
                 remove_sequence: Callable[[int], None], max_num_seqs: int, max_step_tokens: int,
                 adapter_pages: Optional[Callable[[list], list]] = None, one_adapter_per_batch: bool = False,
                 fair_share: bool = False,
                 prefix_lookup: Optional[Callable[[Sequence], tuple[int, int]]] = None,
                 prefix_attach: Optional[Callable[[Sequence], int]] = None,
                 adapter_ready: Optional[Callable[[int], bool]] = None,
                 adapter_resident: Optional[Callable[[int], bool]] = None,
                 max_loras: Optional[int] = None):
        """The pool's side: `free_pages()` counts the pages a batch can take (LoRA: with those idle
        adapters and cached prefixes would give back), `add_sequence` / `remove_sequence` take and
        drop a sequence's place in it, `adapter_pages(slots)` is what a batch must find for each
        adapter (its pages unless resident and held by a running sequence; one call for the
        running adapters of a step); `one_adapter_per_batch`
        for stage-1 (`single`) libraries; `fair_share`: admission by the virtual token counter
        (module doc). The prefix cache: `prefix_lookup(seq)` gives the cached tokens a waiting
        sequence would start after and how many of their pages are idle (taking them costs free
        pages), `prefix_attach(seq)`, once it has its place, gives it those tokens (returns them).
        The adapter tiers: `adapter_ready(slot)`: a request on the adapter may be admitted (its
        weights are on the host); `adapter_resident(slot)`: its pages are in the pool now.
        `max_loras`: the most adapters the running sequences span (None: no bound; module doc)."""
        if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)
                                      or max_loras < 1):
            raise ValueError(f"max_loras must be a positive integer or None, not {max_loras!r}")
        self.max_loras = max_loras
        self.free_pages = free_pages
        self.adapter_pages = adapter_pages or (lambda slots: [0] * len(slots))
        self.prefix_lookup = prefix_lookup
        self.prefix_attach = prefix_attach
        self.adapter_ready = adapter_ready or (lambda a: True)
        self.adapter_resident = adapter_resident or (lambda a: True)
        self.one_adapter = one_adapter_per_batch
        self.rejected: list[Sequence] = []  # waiting requests that can never fit; the engine fails them
        self.add_sequence = add_sequence
        self.remove_sequence = remove_sequence
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.fair_share = bool(fair_share)
        self.service = ServiceCounters()
        self._resumed: set[int] = set()  # preempted sequences waiting again (their prompt is counted)

    def add(self, seq: Sequence) -> None:
        self.service.arrive(seq.adapter_name)
        self.waiting.append(seq)

    def generated(self, seq: Sequence, n: int = 1) -> None:
        """The engine appended `n` generated tokens to `seq`: its client's service grows."""
        self.service.generated(seq.adapter_name, n)

    def finish(self, seq: Sequence) -> None:
        if seq.status == Status.RUNNING:
            self.remove_sequence(seq.seq_id)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.service.leave(seq.adapter_name)
            self._resumed.discard(seq.seq_id)
        seq.status = Status.FINISHED

    def reject(self, seq: Sequence) -> None:
        """Drop a request that cannot fit the pool; the engine fails it with PoolExhaustedError."""
        self.finish(seq)
        self.rejected.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Recompute: drop the KV, keep the tokens; the sequence prefills them again later."""
        self.remove_sequence(seq.seq_id)
        self.running.remove(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.service.requeue(seq.adapter_name)
        self._resumed.add(seq.seq_id)
        self.num_preemptions += 1

    def _count_admission(self, seq: Sequence) -> None:
        """A waiting sequence leaves the queue for the pool; a new request's prompt counts as served."""
        self.service.leave(seq.adapter_name)
        if seq.seq_id in self._resumed:
            self._resumed.discard(seq.seq_id)
        else:
            self.service.admit(seq.adapter_name, len(seq.prompt_ids))

    def _admission_order(self) -> Iterator[Sequence]:
        """The waiting sequences in the order admission tries them (consumed while it admits): the
        queue's order (`queue_order`), where a request whose adapter must be paged in is deferred
        after the others until it has been passed over MAX_SKIPS times (each admission while it is
        deferred counts once; then it is tried next)."""
        deferred: list[Sequence] = []
        due: list[Sequence] = []  # deferred ones passed over MAX_SKIPS times
        queue = self.queue_order()
        while True:
            if due:
                seq = due.pop(0)
            else:
                seq = next(queue, None)
                if seq is None:
                    break
                if seq.adapter_slot is not None and seq.skipped < MAX_SKIPS and not self.adapter_resident(
                        seq.adapter_slot):
                    deferred.append(seq)
                    continue
            yield seq
            if seq.status == Status.RUNNING:  # admitted: the deferred ones were passed over
                for d in deferred:
                    d.skipped += 1
                due += [d for d in deferred if d.skipped >= MAX_SKIPS]
                deferred = [d for d in deferred if d.skipped < MAX_SKIPS]
        yield from deferred

    def queue_order(self, preview: bool = False) -> Iterator[Sequence]:
        """The waiting sequences by the queue's policy: the order admission works from, and (with
        `preview`) the one prefetch looks ahead in. First come first served: the queue's order
        (preempted sequences were put in front). Fair share: preempted sequences first, then, one
        at a time, the oldest request of the client with the least service (VTC; ties: the client
        whose oldest request is older), each pick seeing the counter the previous admission
        raised; a preview admits nothing, so it raises a copy of the counters as each pick's
        admission would (its prompt's weight), and sees the order admission would take if every
        request fitted."""
        if not self.fair_share:  # (a preview's reader takes its window before anything changes the queue)
            yield from (self.waiting if preview else list(self.waiting))
            return
        resumed, queues = [], {}
        for s in self.waiting:
            if s.seq_id in self._resumed:
                resumed.append(s)
            else:
                queues.setdefault(s.adapter_name, deque()).append(s)
        yield from resumed
        raised: dict = {}  # preview: what the picks so far would have added to their clients' counters

        def counter(c):
            return self.service.of(c).counter + raised.get(c, 0.0)

        # only the client just picked changes its counter before the next pick: a heap suffices
        heap = [(counter(c), q[0].seq_id, c) for c, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, _, client = heapq.heappop(heap)
            q = queues[client]
            seq = q.popleft()
            yield seq
            if preview:
                raised[client] = raised.get(client, 0.0) + PROMPT_TOKEN_WEIGHT * len(seq.prompt_ids)
            if q:
                heapq.heappush(heap, (counter(client), q[0].seq_id, client))

    def _pick_adapter(self) -> Optional[int]:
        """Stage 1: the adapter of this batch, that of the oldest request on an adapter (base-model
        rows ride along). It stays the batch's adapter until that request finishes, so batches
        change adapter once per finished request at most, and every adapter gets its turn."""
        first = min((s for s in itertools.chain(self.running, self.waiting) if s.adapter_slot is not None),
                    key=lambda s: s.seq_id, default=None)
        return None if first is None else first.adapter_slot

    def _victim(self, rows: list, fits: Callable[[Sequence], bool]) -> Optional[Sequence]:
        """The running sequence to preempt for pages: one this batch does not serve, those paused
        for another adapter (stage 1) first, then the most recently admitted."""
        taken = {id(s) for s, _ in rows}
        idle = [s for s in self.running if id(s) not in taken]
        paused = [s for s in idle if not fits(s)]
        return (paused or idle or [None])[-1]

    def schedule(self) -> Optional[Batch]:
        only = self._pick_adapter() if self.one_adapter else None
        fits = lambda s: not self.one_adapter or s.adapter_slot in (None, only)  # noqa: E731
        charged: set = set()  # adapters whose pages this batch already counts
        decodes = [s for s in self.running if s.num_cached == s.num_tokens - 1 and fits(s)]
        slots = list(dict.fromkeys(s.adapter_slot for s in decodes if s.adapter_slot is not None))
        known = dict(zip(slots, self.adapter_pages(slots)))  # one pool call for the running adapters

        def cost(seq: Sequence) -> int:
            a = seq.adapter_slot
            if a is None or a in charged:
                return 0
            if a not in known:
                known[a] = self.adapter_pages([a])[0]
            return known[a]

        used = 0  # pages this batch takes (KV and adapters paged in or kept from eviction)
        free = self.free_pages()
        budget = self.max_step_tokens
        rows: list[tuple[Sequence, list[int]]] = []
        # 1. decodes, oldest first; when pages run out, preempt the newest sequence not in the batch
        for seq in decodes:
            if seq.status != Status.RUNNING:
                continue  # preempted for an older one
            need = new_pages(seq.num_cached, 1) + cost(seq)
            while need > free:
                victim = self._victim(rows, fits)
                if victim is seq and len(self.running) == 1:  # alone and out of pages: it can never finish
                    self.reject(seq)
                    break
                self.preempt(victim)
                known.clear()  # its adapter may have lost its last running sequence (no longer kept)
                if victim is seq:
                    break
                free = self.free_pages() - used
            if seq.status != Status.RUNNING:
                continue
            free -= need
            used += need
            budget -= 1
            charged.add(seq.adapter_slot)
            rows.append((seq, [seq.last_token]))
        # 2. chunked prefill: running sequences still prefilling, then waiting ones (_admission_order)
        prefilling = [s for s in self.running if s.num_cached < s.num_tokens - 1]
        stuck = None  # the first sequence that found no pages
        spanned = {s.adapter_slot for s in self.running} - {None}  # (max_loras)
        for seq in itertools.chain(prefilling, self._admission_order()):
            if budget <= 0:
                break
            if not fits(seq):
                continue
            if (self.max_loras is not None and seq.status == Status.WAITING and seq.adapter_slot is not None
                    and seq.adapter_slot not in spanned and len(spanned) >= self.max_loras):
                continue  # its adapter waits for one of the running ones to go
            if seq.status == Status.WAITING and seq.adapter_slot is not None and not self.adapter_ready(
                    seq.adapter_slot):
                continue  # its adapter is being read from disk
            if seq.status == Status.WAITING and len(self.running) >= self.max_num_seqs:
                stuck = seq  # (stage 1: the running ones may all be paused for another adapter)
                break
            hit, held = 0, 0  # cached prefix tokens; its idle pages, which the sequence takes
            if seq.status == Status.WAITING and self.prefix_lookup is not None:
                hit, held = self.prefix_lookup(seq)
            start = seq.num_cached + hit
            n = min(seq.num_tokens - start, budget)
            # as many tokens as the free pages (and the last page's slack) can hold
            c = cost(seq) + held
            slack = -start % PAGE_SIZE
            n = min(n, slack + (free - c) * PAGE_SIZE)
            if n <= 0:
                stuck = seq
                break
            if seq.status == Status.WAITING:
                self._count_admission(seq)
                self.waiting.remove(seq)
                self.add_sequence(seq.seq_id)
                seq.status = Status.RUNNING
                self.running.append(seq)
                if seq.adapter_slot is not None:
                    spanned.add(seq.adapter_slot)
                if self.prefix_attach is not None:
                    seq.num_cached = self.prefix_attach(seq)
                    assert seq.num_cached == start, "the cached prefix changed between lookup and attach"
            need = new_pages(seq.num_cached, n) + c
            free -= need
            used += need
            budget -= n
            charged.add(seq.adapter_slot)
            rows.append((seq, seq.tokens[seq.num_cached:seq.num_cached + n]))
        if not rows and stuck is not None:
            victim = next((s for s in reversed(self.running) if s is not stuck and not fits(s)), None) or next(
                (s for s in reversed(self.running) if s is not stuck), None)
            if victim is not None:
                # others hold the pages it needs (mid-prefill, or paused for another adapter)
                self.preempt(victim)
            else:
                # nothing else holds pages and it still does not fit (pinned adapters hold the
                # rest, or its adapter plus KV exceed the pool): it can never run
                self.reject(stuck)
            return self.schedule()
        if not rows:
            return None
        return Batch([s for s, _ in rows], [c for _, c in rows])
