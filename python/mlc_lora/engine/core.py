"""`LLMEngine`: the runner, its pool, the scheduler and the sampler; `step()` runs one batch.

Each step schedules a batch (decodes + chunked prefills), runs `prefill` or `decode`, samples on
the device and hands each sequence its `StepOutput` (new text, tokens, finish) through its sink,
all of them together once the step's work is done (`_deliver`).
The front ends (frontend.py) own the thread that steps it (loop.py).

Fair share (`fair_share`, off by default): admission by the virtual token counter, per adapter
(scheduler.py); the tokens served per adapter are in stats() either way.

Prefix caching (`enable_prefix_caching`, off by default): every full KV page a sequence computes is
keyed in the pool by (its adapter, its token chain) and kept after the sequence ends; a request of
the same adapter (or of the base model) whose prompt starts with those tokens takes the pages and
prefills only the rest. KV of one adapter is never reused for another, nor for an adapter loaded
again (keys name the pool slot, which is never reused, and unloading drops them). Cached pages no
request holds are evicted with idle adapters, least recently used first. Requests that ask for
prompt logprobs compute their whole prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..contract import PAGE_SIZE
from ..errors import MLCLoraError, PoolExhaustedError, RequestError
from ..runner import open_runner
from ..tokenizer import Detokenizer, Tokenizer
from .adapters import AdapterTable
from .sampler import Sampled, Sampler

log = logging.getLogger(__name__)
from .scheduler import Batch, SamplingParams, Scheduler, Sequence, Served, Status


@dataclasses.dataclass
class TextState:
    """A sequence's text so far, as the front end receives it."""

    detok: Optional[Detokenizer]
    text: str = ""  # decoded so far (cut at a stop string)
    sent: int = 0  # characters already handed to the client
    holdback: int = 0  # a partial stop string may hide in the last characters
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # Sampled per prompt token (1st: None)
    matcher: Any = None  # the grammar's state (`response_format`), advanced by each token


@dataclasses.dataclass
class StepOutput:
    """One step's news for one sequence."""

    text: str
    tokens: list[Sampled]
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None
    usage: Optional[tuple[int, int]] = None  # (prompt, completion) tokens, on the last output
    prompt_logprobs: Optional[list[Sampled]] = None  # on the first output, when asked


class LLMEngine:  # pylint: disable=too-many-instance-attributes
    """The model, the scheduler and the sampler; `step()` runs one batch. Not thread-safe."""

    def __init__(self, model_dir: Path, device: str = "cpu", max_num_seqs: Optional[int] = None,
                 max_total_tokens: Optional[int] = None, prefill_chunk_size: Optional[int] = None,
                 params=None, fair_share: bool = False, enable_prefix_caching: bool = False,
                 adapter_host_bytes: Optional[int] = None, prefetch_adapters: bool = True,
                 max_loras: Optional[int] = None):
        """`fair_share`, `enable_prefix_caching`: the module doc; `adapter_host_bytes`: the budget of
        the adapters' host copies (None: unlimited; engine/adapters.py); `prefetch_adapters`: read and
        page in the adapters of waiting requests ahead of scheduling (False: on the step that admits
        the request); `max_loras`: the most adapters the running sequences span (None: no bound;
        engine/scheduler.py)."""
        # tensor-parallel models: one worker per shard
        self.runner = open_runner(model_dir, device, params=params)
        compiled = self.runner.compiled
        self.context_window = compiled.context_window_size
        self.max_num_seqs = max_num_seqs or compiled.max_batch_size
        chunk = prefill_chunk_size or compiled.prefill_chunk_size
        total = max_total_tokens or max(self.context_window, 8192)
        lora = self.runner.lora
        if lora is not None and max_total_tokens is None:
            # the pool (KV and adapter pages) defaults to the compiled --lora-pool-pages
            total = (lora.pool_pages - 1) * PAGE_SIZE
        self.pool = self.runner.create_pool(self.max_num_seqs, total, chunk)
        self._capture_graphs()
        self.adapters = AdapterTable(self.runner, self.pool, adapter_host_bytes, prefetch_adapters)
        self.sampler = Sampler(self.runner)
        try:
            self.tokenizer: Optional[Tokenizer] = Tokenizer(model_dir, compiled.tokenizer)
        except RequestError:
            self.tokenizer = None
        self.kv_pages_total = self.pool.available_pages()
        # the longest sequence the engine can hold: the context window or the whole pool
        self.max_seq_len = min(self.context_window, (self.kv_pages_total - 1) * PAGE_SIZE)
        ad = self.adapters
        self.prefix_caching = bool(enable_prefix_caching)
        ad.prefix_caching = self.prefix_caching
        prefix = {}
        if self.prefix_caching:
            prefix = dict(prefix_lookup=self._prefix_lookup, prefix_attach=self._prefix_attach)
        self.scheduler = Scheduler(ad.available_pages, ad.add_sequence, self.pool.remove_sequence,
                                   self.max_num_seqs, chunk, adapter_pages=ad.pages_to_run,
                                   one_adapter_per_batch=lora is not None and lora.kernel == "single",
                                   fair_share=fair_share, adapter_ready=ad.ready, adapter_resident=ad.resident,
                                   max_loras=max_loras, **prefix)
        self.counters = dict(num_steps=0, num_prefill_steps=0, num_decode_steps=0, max_running=0,
                             num_generated_tokens=0, num_finished=0, num_aborted=0)
        self._orphans: list[Sequence] = []  # requests whose sink raised, aborted after the step
        self._outbox: list[tuple[Sequence, StepOutput]] = []  # the step's outputs, delivered as it ends
        self.step_times: dict[str, list] = {}  # "decode_<=64" -> [steps, seconds]
        # decode steps with adapters by the distinct adapters they hold, up to N (a power of two):
        # N -> [steps, seconds, sequences, bytes of those adapters' pages (what the step's LoRA
        # kernels read)]; stats() names them "<=N", fewest first
        self.decode_adapter_steps: dict[int, list] = {}
        # seconds of the steps outside the forward: the adapters' tiers before scheduling (reads
        # taken, host tier trimmed, prefetch page-ins), scheduling (with the page-ins and evictions
        # of what it admits), the outputs after it, waiting for adapter reads when nothing could run
        self.host_times = dict(adapters=0.0, schedule=0.0, outputs=0.0, wait_reads=0.0)

    @property
    def model_name(self) -> Optional[str]:
        return self.runner.compiled.model_name

    # --- requests ---------------------------------------------------------------------------

    def make_sequence(self, prompt_ids: list[int], params: SamplingParams, adapter_name: Optional[str] = None,
                      sink=None) -> Sequence:
        """A sequence for a prompt, checked against this model (adapter, vocabulary, context)."""
        if adapter_name is not None:
            self.adapters.get(adapter_name)  # UnknownAdapterError naming it
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must lie in [0, {vocab})", "stop_token_ids")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must lie in [0, {vocab})", "logit_bias")
        n = len(prompt_ids)
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens; this model's context holds {self.max_seq_len} "
                               "(prompt plus at least one new token)")
        if params.max_tokens is None:
            params.max_tokens = self.max_seq_len - n
        if n + params.max_tokens > self.max_seq_len:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                               f"of {self.max_seq_len} tokens")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none")
        seq = Sequence(prompt_ids, params, adapter_name, sink)
        detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        seq.state = TextState(detok, holdback=max((len(s) for s in params.stop), default=1) - 1)
        if params.grammar is not None:
            seq.state.matcher = params.grammar.matcher()
        return seq

    def add(self, seq: Sequence) -> None:
        try:
            self.adapters.attach(seq)  # an adapter unloaded since the request was checked fails here
        except RequestError as e:
            seq.status = Status.FINISHED
            self._emit(seq, StepOutput("", [], "error", error=e))
            self._deliver()
            return
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status != Status.FINISHED:
            self.scheduler.finish(seq)
            self.adapters.detach(seq)
            seq.finish_reason = "abort"
            self.counters["num_aborted"] += 1

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self) -> dict[str, Any]:
        return dict(fair_share=self.scheduler.fair_share, max_loras=self.scheduler.max_loras,
                    tokens_served=self.tokens_served(),
                    running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    kv_pages_total=self.kv_pages_total, kv_pages_free=self.pool.available_pages(),
                    num_preemptions=self.scheduler.num_preemptions, **self.counters,
                    step_times={k: dict(steps=n, seconds=round(t, 6)) for k, (n, t) in self.step_times.items()},
                    decode_adapter_steps={f"<={k}": dict(steps=n, seconds=round(t, 6), sequences=q, adapter_bytes=b)
                                          for k, (n, t, q, b) in sorted(self.decode_adapter_steps.items())},
                    host_times={k: round(t, 6) for k, t in self.host_times.items()},
                    # the runner's forwards by compiled function (a single-device runner's count)
                    forwards=dict(getattr(self.runner, "forwards", {})),
                    **self.adapters.stats(), **self._prefix_stats())

    # --- the prefix cache ---------------------------------------------------------------------

    def _prefix_stats(self) -> dict[str, Any]:
        s = self.pool.stats()
        return dict(prefix_caching=self.prefix_caching, prefix_cache_queries=s.prefix_queries,
                    prefix_cache_query_tokens=s.prefix_query_tokens, prefix_cache_hit_tokens=s.prefix_hit_tokens,
                    prefix_cache_hit_rate=s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0,
                    prefix_cache_pages=s.cached_pages, prefix_cache_idle_pages=s.cached_idle_pages,
                    prefix_cache_evictions=s.cached_page_evictions)

    def _prefix_lookup(self, seq: Sequence) -> tuple[int, int]:
        """The scheduler's lookup: cached tokens a waiting sequence would start after, idle pages."""
        if seq.params.prompt_logprobs:  # every prompt position needs its logits
            return 0, 0
        return self.pool.prefix_lookup(seq.adapter_slot, seq.tokens)

    def _prefix_attach(self, seq: Sequence) -> int:
        """The scheduler's attach, once the sequence has its place in the pool (bound to its adapter)."""
        n = 0 if seq.params.prompt_logprobs else self.pool.prefix_attach(seq.seq_id, seq.tokens)
        seq.prefix_pages = n // PAGE_SIZE
        return n

    def _prefix_insert(self, seq: Sequence) -> None:
        """Key the full pages the sequence's KV gained this step."""
        full = seq.num_cached // PAGE_SIZE
        if seq.prefix_pages is None or full <= seq.prefix_pages:
            return
        start = seq.prefix_pages * PAGE_SIZE
        n = self.pool.prefix_insert(seq.seq_id, start, seq.tokens[start:full * PAGE_SIZE])
        seq.prefix_pages = None if n < 0 else n

    def tokens_served(self) -> dict[str, Any]:
        """Prompt and generated tokens served (and the fair-share counter `service`) of the base
        model and of each loaded adapter, by name (adapters no longer loaded are left out)."""
        clients = self.scheduler.service.clients
        zero = Served()
        return dict(base=clients.get(None, zero).as_dict(),
                    adapters={name: clients.get(name, zero).as_dict() for name in self.adapters.by_name})

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        try:
            self._step()
        finally:
            t = time.perf_counter()
            self._deliver()
            orphans, self._orphans = self._orphans, []
            for seq in orphans:
                self.abort(seq)
            self._host("outputs", t)

    def _host(self, part: str, since: float) -> float:
        """Add the seconds since `since` to host_times[part]; now."""
        now = time.perf_counter()
        self.host_times[part] += now - since
        return now

    def _step(self) -> None:
        lora = self.runner.lora is not None
        t = time.perf_counter()
        if lora:
            sched = self.scheduler
            self.adapters.prepare_step(sched.queue_order(preview=True), len(sched.running),
                                       self.max_num_seqs - len(sched.running))
            t = self._host("adapters", t)
        batch = self.scheduler.schedule()
        for seq in self.scheduler.rejected:
            self._emit(seq, StepOutput("", [], "error", error=self.adapters.exhausted(seq)))
            self.adapters.detach(seq)
        self.scheduler.rejected.clear()
        if lora:
            for seq, err in self.adapters.unreadable(self.scheduler.waiting):
                self._fail(seq, err)
        if batch is None:
            t = self._host("schedule", t)
            if lora and self.adapters.reads_pending():
                self.adapters.wait_for_reads()  # every waiting request waits for its adapter's folder
                self._host("wait_reads", t)
            return
        if lora:
            self.adapters.first_steps(batch.seqs)
        c = self.counters
        c["num_steps"] += 1
        c["max_running"] = max(c["max_running"], len(batch.seqs))
        t0 = self._host("schedule", t)
        try:
            rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
            scored = None if batch.is_decode else self._prompt_rows(batch)
            logits = self._forward(batch, None if scored is None else [p for p, _ in scored])
            row_of = None
            if scored is not None:
                row_of = self._score_prompts(logits, batch, scored)
            masks = {i: batch.seqs[i].state.matcher.allowed() for i in rows
                     if batch.seqs[i].state.matcher is not None}
            sampled = self.sampler.sample(logits, batch.seqs, rows, row_of, masks) if rows else []
        except Exception as e:  # pylint: disable=broad-except
            # a failed forward fails only its own requests; the engine keeps serving
            cls = PoolExhaustedError if isinstance(e, PoolExhaustedError) else MLCLoraError
            for seq in batch.seqs:
                self._fail(seq, cls(f"engine step failed: {e}"))
            return
        t = time.perf_counter()
        self._time_step(batch, t - t0)
        for seq, chunk in zip(batch.seqs, batch.chunks):
            seq.num_cached += len(chunk)
            if self.prefix_caching:
                self._prefix_insert(seq)
        for i, s in zip(rows, sampled):
            if isinstance(s, Exception):  # this row's sampling failed; the others go on
                self._fail(batch.seqs[i], MLCLoraError(f"sampling failed: {s}"))
                continue
            try:
                self._append(batch.seqs[i], s)
            except Exception as e:  # pylint: disable=broad-except
                self._fail(batch.seqs[i], MLCLoraError(f"request failed: {e}"))
        self._host("outputs", t)

    def _capture_graphs(self) -> None:
        """A library compiled with CUDA graphs: its decode graphs captured now, one per padded
        batch size (the runner pads decode batches to them), not during the first requests."""
        t0 = time.perf_counter()

        def progress(done: int, total: int) -> None:
            if done == 1 or done == total or done % 10 == 0:
                log.info("decode CUDA graphs: %d of %d batch sizes captured (%.1f s)", done, total,
                         time.perf_counter() - t0)

        self.runner.capture_decode_graphs(self.pool, progress)

    def _time_step(self, batch: Batch, seconds: float) -> None:
        """Steps and seconds (forward + sampling, which waits for the device) per kind and size:
        `decode_<=N` by sequences, `prefill_<=N` by tokens, N the next power of two; decode steps
        with adapters also by their distinct adapters (decode_adapter_steps), with the sequences
        and the bytes of those adapters' pages (a host copy holds exactly its pool pages)."""
        n = len(batch.seqs) if batch.is_decode else sum(len(c) for c in batch.chunks)
        key = f"{'decode' if batch.is_decode else 'prefill'}_<={1 << max(0, n - 1).bit_length()}"
        entry = self.step_times.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        by_slot = self.adapters.by_slot
        slots = {s.adapter_slot for s in batch.seqs if s.adapter_slot is not None} \
            if by_slot and batch.is_decode else ()
        if slots:
            entry = self.decode_adapter_steps.setdefault(1 << (len(slots) - 1).bit_length(), [0, 0.0, 0, 0])
            entry[0] += 1
            entry[1] += seconds
            entry[2] += len(batch.seqs)
            entry[3] += sum(by_slot[k].host_bytes for k in slots if k in by_slot)

    def _fail(self, seq: Sequence, error: MLCLoraError) -> None:
        self.scheduler.finish(seq)
        self.adapters.detach(seq)
        self._emit(seq, StepOutput("", [], "error", error=error))

    def _prompt_rows(self, batch: Batch):
        """For a prefill in which some sequence still needs prompt logprobs: each sequence's
        logit positions inside its chunk and the prompt tokens they score (the chunk's last
        position always comes last: the row sampled from); None when nobody needs any."""
        out, any_needed = [], False
        for seq, chunk in zip(batch.seqs, batch.chunks):
            want: list[int] = []
            if seq.params.prompt_logprobs:
                have = len(seq.state.prompt_logprobs)  # prompt tokens scored so far (the 1st needs none)
                lo = max(seq.num_cached, have - 1)
                hi = min(seq.num_cached + len(chunk), len(seq.prompt_ids) - 1)
                want = list(range(lo, hi))  # position q scores prompt token q + 1
            any_needed = any_needed or bool(want)
            pos = [q - seq.num_cached for q in want]
            targets = [seq.prompt_ids[q + 1] for q in want]
            if not pos or pos[-1] != len(chunk) - 1:
                pos.append(len(chunk) - 1)
            out.append((pos, targets))
        return out if any_needed else None

    def _score_prompts(self, logits, batch: Batch, scored) -> list[int]:
        """Append each sequence's new prompt logprobs; returns the logits row of each sequence's
        chunk end (what it samples from)."""
        row_of, targets, start = [], np.zeros(int(logits.shape[0]), np.int32), 0
        for pos, tgt in scored:
            targets[start:start + len(tgt)] = tgt
            start += len(pos)
            row_of.append(start - 1)
        top = any(s.params.top_logprobs > 0 for s in batch.seqs if s.params.prompt_logprobs)
        lps = self.sampler.score(logits, targets, top)
        start = 0
        for seq, (pos, tgt) in zip(batch.seqs, scored):
            st = seq.state
            if tgt and not st.prompt_logprobs:
                st.prompt_logprobs.append(Sampled(seq.prompt_ids[0]))
            for r in range(start, start + len(tgt)):
                s = lps[r]
                k = seq.params.top_logprobs
                s.top = s.top[:k] if s.top is not None and k else None
                st.prompt_logprobs.append(s)
            start += len(pos)
        return row_of

    def _forward(self, batch: Batch, positions=None):
        ids = [s.seq_id for s in batch.seqs]
        lora = "pool" if self.runner.lora is not None else None  # tables from each sequence's adapter
        if batch.is_decode:
            self.counters["num_decode_steps"] += 1
            return self.runner.decode(self.pool, ids, [c[0] for c in batch.chunks], lora=lora)
        self.counters["num_prefill_steps"] += 1
        if positions is None:
            return self.runner.prefill(self.pool, ids, batch.chunks, lora=lora)
        return self.runner.prefill(self.pool, ids, batch.chunks, lora=lora, positions=positions)

    def _append(self, seq: Sequence, s: Sampled) -> None:
        p, st = seq.params, seq.state
        first = not seq.output_ids
        prompt_lps = (st.prompt_logprobs or [Sampled(seq.prompt_ids[0])]) if p.prompt_logprobs and first else None
        if p.max_tokens == 0:  # the prompt scored, nothing generated
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            self.adapters.detach(seq)
            self.counters["num_finished"] += 1
            self._emit(seq, StepOutput("", [], "length", usage=(len(seq.prompt_ids), 0),
                                       prompt_logprobs=prompt_lps))
            return
        if st.matcher is not None:
            st.matcher.accept(s.token)
        seq.output_ids.append(s.token)
        self.counters["num_generated_tokens"] += 1
        self.scheduler.generated(seq)
        finish, cut = None, False
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        if (s.token in eos and not p.ignore_eos) or s.token in p.stop_token_ids:
            finish = "stop"
        if st.matcher is not None and st.matcher.is_terminated():
            finish = "stop"
        prev = len(st.text)
        if finish is None and st.detok is not None:
            st.text += st.detok.push(s.token)
        if finish is None and p.stop:
            # only a stop string that ends in the new text can be new
            start = max(0, prev - st.holdback)
            hits = [i for i in (st.text.find(x, start) for x in p.stop) if i >= 0]
            if hits:
                st.text, finish, cut = st.text[:min(hits)], "stop", True
        if finish is None and len(seq.output_ids) >= p.max_tokens:
            finish = "length"
        if finish is not None:
            if st.detok is not None and not cut:
                st.text += st.detok.flush()  # an incomplete character held back at the end
            seq.finish_reason = finish
            self.scheduler.finish(seq)
            self.adapters.detach(seq)
            self.counters["num_finished"] += 1
        end = len(st.text) if finish else max(st.sent, len(st.text) - st.holdback)
        delta, st.sent = st.text[st.sent:end], end
        usage = (len(seq.prompt_ids), len(seq.output_ids)) if finish else None
        self._emit(seq, StepOutput(delta, [s], finish, usage=usage, prompt_logprobs=prompt_lps))

    def _emit(self, seq: Sequence, out: StepOutput) -> None:
        """Queue `out` for the request's sink; `_deliver` hands the step's outputs over together
        when the step ends (the callers wake once, not during the step's work)."""
        if seq.sink is not None:
            self._outbox.append((seq, out))

    def _deliver(self) -> None:
        """Hand each queued output to its request's sink, in order. A sink may return a callable
        (AsyncMLCEngine's: wake my event loop), called once after all of them (each reader wakes
        once a step). A sink that raises (its caller gone, e.g. its event loop closed) ends that
        request alone: it is aborted after the step, the others go on."""
        outbox, self._outbox = self._outbox, []
        wakes: dict = {}
        for seq, out in outbox:
            if seq.sink is None:  # (raised at an earlier output)
                continue
            try:
                wake = seq.sink(out)
            except Exception as e:  # pylint: disable=broad-except
                seq.sink = None
                log.warning("dropping a request whose output callback raised: %s: %s", type(e).__name__, e)
                if out.finish_reason is None:
                    self._orphans.append(seq)
                continue
            if wake is not None:
                wakes[wake] = None
        for wake in wakes:
            try:
                wake()
            except Exception as e:  # pylint: disable=broad-except
                log.warning("an output callback's wake-up raised: %s: %s", type(e).__name__, e)
