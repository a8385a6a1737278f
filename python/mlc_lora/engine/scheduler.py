"""Sequences and the continuous-batching scheduler (decodes first, then chunked prefills, bounded
by free KV pages; preemption by recompute when the pages run out).

LoRA: KV and adapters share the unified pool's pages. A batch counts, beside its KV pages, the
pages of every adapter it must page in or keep from eviction; a request that cannot fit even with
nothing else running is rejected (PoolExhaustedError), never retried forever. Stage-1 (`single`)
libraries get one adapter per batch (plus base-model rows): that of the oldest request on an adapter.
Waiting requests whose adapter is resident are admitted before those whose adapter must be paged in;
a request is passed over so at most MAX_SKIPS times, then it keeps its place in arrival order. A
request whose adapter is still being read from disk waits without holding up the others."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from ..contract import PAGE_SIZE

# times a waiting request may be passed over for later ones whose adapters are resident
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
                 sink: Optional[Callable[[Any], None]] = None):
        self.seq_id = next(_seq_ids)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.adapter_name = adapter_name  # the LoRA adapter the request asked for (None: base model)
        self.adapter_slot: Optional[int] = None  # its id in the pool, once the engine takes it
        self.status = Status.WAITING
        self.num_cached = 0  # tokens whose KV is in the cache
        self.finish_reason: Optional[str] = None
        self.rng = np.random.default_rng(params.seed)
        self.sink = sink  # receives this sequence's outputs (set by the engine front end)
        self.state: Any = None  # the engine's per-request text state (detokeniser, stop strings)
        self.skipped = 0  # admissions of later requests while it waited (bounded by MAX_SKIPS)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

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

    @property
    def is_decode(self) -> bool:
        return all(len(c) == 1 and s.num_cached == s.num_tokens - 1 for s, c in zip(self.seqs, self.chunks))

    def samples(self, i: int) -> bool:
        """Row `i` completes its sequence's known tokens: its logits give the next token."""
        return self.seqs[i].num_cached + len(self.chunks[i]) == self.seqs[i].num_tokens


class Scheduler:
    """FIFO admission; running decodes first; pages checked before every step."""

    def __init__(self, free_pages: Callable[[], int], add_sequence: Callable[[int], None],
                 remove_sequence: Callable[[int], None], max_num_seqs: int, max_step_tokens: int,
                 adapter_pages: Optional[Callable[[int], int]] = None, one_adapter_per_batch: bool = False,
                 adapter_ready: Optional[Callable[[int], bool]] = None,
                 adapter_resident: Optional[Callable[[int], bool]] = None):
        """The pool's side: `free_pages()` counts the pages a batch can take (LoRA: with those idle
        adapters would give back), `add_sequence` / `remove_sequence` take and drop a sequence's
        place in it, `adapter_pages(slot)` is what a batch must find for an adapter (its pages
        unless resident and held by a running sequence); `one_adapter_per_batch` for stage-1
        (`single`) libraries; `adapter_ready(slot)`: a request on the adapter may be admitted (its
        weights are on the host); `adapter_resident(slot)`: its pages are in the pool now."""
        self.free_pages = free_pages
        self.adapter_pages = adapter_pages or (lambda a: 0)
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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.status == Status.RUNNING:
            self.remove_sequence(seq.seq_id)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
        self.num_preemptions += 1

    def _pick_adapter(self) -> Optional[int]:
        """Stage 1: the adapter of this batch, that of the oldest request on an adapter (base-model
        rows ride along). It stays the batch's adapter until that request finishes, so batches
        change adapter once per finished request at most, and every adapter gets its turn."""
        first = min((s for s in itertools.chain(self.running, self.waiting) if s.adapter_slot is not None),
                    key=lambda s: s.seq_id, default=None)
        return None if first is None else first.adapter_slot

    def _admission_order(self) -> list[Sequence]:
        """The waiting requests in the order admission tries them: arrival order, but those whose
        adapter must be paged in go after the rest until they have been passed over MAX_SKIPS times."""
        warm, cold = [], []
        for s in self.waiting:
            a = s.adapter_slot
            (warm if a is None or s.skipped >= MAX_SKIPS or self.adapter_resident(a) else cold).append(s)
        return warm + cold

    def _count_skips(self, waiting: list[Sequence], admitted: list[Sequence]) -> None:
        """Every request still waiting that arrived before one admitted now was passed over."""
        if admitted:
            ids = {id(s) for s in admitted}
            last = max(i for i, s in enumerate(waiting) if id(s) in ids)
            for s in waiting[:last]:
                if s.status == Status.WAITING:
                    s.skipped += 1

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

        def cost(seq: Sequence) -> int:
            a = seq.adapter_slot
            return 0 if a is None or a in charged else self.adapter_pages(a)

        used = 0  # pages this batch takes (KV and adapters paged in or kept from eviction)
        free = self.free_pages()
        budget = self.max_step_tokens
        rows: list[tuple[Sequence, list[int]]] = []
        # 1. decodes, oldest first; when pages run out, preempt the newest sequence not in the batch
        for seq in [s for s in self.running if s.num_cached == s.num_tokens - 1 and fits(s)]:
            if seq.status != Status.RUNNING:
                continue  # preempted for an older one
            need = new_pages(seq.num_cached, 1) + cost(seq)
            while need > free:
                victim = self._victim(rows, fits)
                if victim is seq and len(self.running) == 1:  # alone and out of pages: it can never finish
                    self.reject(seq)
                    break
                self.preempt(victim)
                if victim is seq:
                    break
                free = self.free_pages() - used
            if seq.status != Status.RUNNING:
                continue
            free -= need
            used += need
            budget -= 1
            charged.add(seq.adapter_slot)
            rows.append((seq, seq.tokens[-1:]))
        # 2. chunked prefill: running sequences still prefilling, then waiting ones (_admission_order)
        prefilling = [s for s in self.running if s.num_cached < s.num_tokens - 1]
        stuck = None  # the first sequence that found no pages
        arrived, admitted = list(self.waiting), []
        for seq in prefilling + self._admission_order():
            if budget <= 0:
                break
            if not fits(seq):
                continue
            if seq.status == Status.WAITING and seq.adapter_slot is not None and not self.adapter_ready(
                    seq.adapter_slot):
                continue  # its adapter is being read from disk
            if seq.status == Status.WAITING and len(self.running) >= self.max_num_seqs:
                stuck = seq  # (stage 1: the running ones may all be paused for another adapter)
                break
            n = min(seq.num_tokens - seq.num_cached, budget)
            # as many tokens as the free pages (and the last page's slack) can hold
            c = cost(seq)
            slack = -seq.num_cached % PAGE_SIZE
            n = min(n, slack + (free - c) * PAGE_SIZE)
            if n <= 0:
                stuck = seq
                break
            if seq.status == Status.WAITING:
                self.waiting.remove(seq)
                self.add_sequence(seq.seq_id)
                seq.status = Status.RUNNING
                self.running.append(seq)
                admitted.append(seq)
            need = new_pages(seq.num_cached, n) + c
            free -= need
            used += need
            budget -= n
            charged.add(seq.adapter_slot)
            rows.append((seq, seq.tokens[seq.num_cached:seq.num_cached + n]))
        self._count_skips(arrived, admitted)
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
