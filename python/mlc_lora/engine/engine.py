"""MLCEngine / AsyncMLCEngine: OpenAI-style chat and completions over a continuously batched model.

One background thread owns the model: each step it schedules a batch (decodes + chunked prefills),
runs `prefill` or `decode`, samples on the device and hands each request its new text. Front ends
only validate requests, enqueue them and wait on their own output queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from ..errors import MLCLoraError, PoolExhaustedError, RequestError
from ..contract import CONFIG_FILE, PAGE_SIZE, TOP_LOGPROBS_MAX, cache_dir
from ..runner import open_runner
from ..tokenizer import Detokenizer, Tokenizer, check_messages
from . import protocol as P
from .sampler import Sampled, Sampler
from .adapters import AdapterTable
from .scheduler import Batch, SamplingParams, Scheduler, Sequence, Status

MAX_CHOICES = 16  # `n` of one request: each choice is a sequence of its own (the prompt prefilled n times)


def resolve_compiled(model: str | Path, device: str, progress: bool = True, dtype: Optional[str] = None,
                     max_lora_rank: int = 0, lora_pool_pages: int = 0) -> Path:
    """A compiled folder as is; anything else is compiled once into the user's cache directory
    (with LoRA when `max_lora_rank` and `lora_pool_pages` are given)."""
    path = Path(model)
    if (path / CONFIG_FILE).is_file():
        return path
    from ..compile import CompileOptions, compile_model  # pylint: disable=import-outside-toplevel

    target = "llvm" if device == "cpu" else "cuda"
    opts = CompileOptions(target=target, dtype=dtype, max_lora_rank=max_lora_rank, lora_pool_pages=lora_pool_pages)
    cache = cache_dir()
    lora = f"-lora{max_lora_rank}x{lora_pool_pages}" if max_lora_rank or lora_pool_pages else ""
    out = cache / f"{path.name if path.exists() else str(model)}-{target}-{opts.resolved_dtype()}{lora}"
    if not (out / CONFIG_FILE).is_file():
        compile_model(model, out, opts, progress=progress)
    return out


@dataclasses.dataclass
class _TextState:
    detok: Optional[Detokenizer]
    text: str = ""  # decoded so far (cut at a stop string)
    sent: int = 0  # characters already handed to the client
    holdback: int = 0  # a partial stop string may hide in the last characters


@dataclasses.dataclass
class _Out:
    """One step's news for one request."""

    text: str
    tokens: list[Sampled]
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None
    usage: Optional[tuple[int, int]] = None


class LLMEngine:  # pylint: disable=too-many-instance-attributes
    """The model, the scheduler and the sampler; `step()` runs one batch. Not thread-safe."""

    def __init__(self, model_dir: Path, device: str = "cpu", max_num_seqs: Optional[int] = None,
                 max_total_tokens: Optional[int] = None, prefill_chunk_size: Optional[int] = None,
                 params=None):
        # tensor-parallel models: one worker per shard
        self.runner = open_runner(model_dir, device, params=params)
        mc = self.runner.model_config
        self.context_window = mc["context_window_size"]
        self.max_num_seqs = max_num_seqs or mc.get("max_batch_size", 64)
        chunk = prefill_chunk_size or mc["prefill_chunk_size"]
        total = max_total_tokens or max(self.context_window, 8192)
        lora = self.runner.lora
        if lora and max_total_tokens is None:
            # the pool (KV and adapter pages) defaults to the compiled --lora-pool-pages
            total = (lora["pool_pages"] - 1) * PAGE_SIZE
        self.kv = self.runner.create_kv_cache(self.max_num_seqs, total, chunk)
        self.adapters = AdapterTable(self.runner, self.kv)
        self.sampler = Sampler(self.runner)
        try:
            self.tokenizer: Optional[Tokenizer] = Tokenizer(model_dir, self.runner.config.get("tokenizer", {}))
        except RequestError:
            self.tokenizer = None
        r = self.runner
        self.kv_pages_total = int(r.kv_available_pages(self.kv))
        # the longest sequence the engine can hold: the context window or the whole cache
        self.max_seq_len = min(self.context_window, (self.kv_pages_total - 1) * PAGE_SIZE)
        ad = self.adapters
        self.scheduler = Scheduler(ad.available_pages, ad.add_sequence, lambda s: r.kv_remove(self.kv, s),
                                   self.max_num_seqs, chunk, adapter_pages=ad.pages_to_run,
                                   one_adapter_per_batch=bool(lora) and lora["kernel"] == "single")
        self.counters = dict(num_steps=0, num_prefill_steps=0, num_decode_steps=0, max_running=0,
                             num_generated_tokens=0, num_finished=0, num_aborted=0)

    # --- requests ---------------------------------------------------------------------------

    def make_sequence(self, prompt_ids: list[int], params: SamplingParams, adapter_id=None, sink=None) -> Sequence:
        if adapter_id is not None:
            self.adapters.get(adapter_id)  # UnknownAdapterError naming it
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
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
        seq = Sequence(prompt_ids, params, adapter_id, sink)
        detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        seq.state = _TextState(detok, holdback=max((len(s) for s in params.stop), default=1) - 1)
        return seq

    def add(self, seq: Sequence) -> None:
        try:
            self.adapters.attach(seq)  # an adapter unloaded since the request was checked fails here
        except RequestError as e:
            seq.status = Status.FINISHED
            self._emit(seq, _Out("", [], "error", error=e))
            return
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status.name != "FINISHED":
            self.scheduler.finish(seq)
            self._release(seq)
            seq.finish_reason = "abort"
            self.counters["num_aborted"] += 1

    def _release(self, seq: Sequence) -> None:
        self.adapters.detach(seq)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self) -> dict[str, Any]:
        return dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    kv_pages_total=self.kv_pages_total,
                    kv_pages_free=int(self.runner.kv_available_pages(self.kv)),
                    num_preemptions=self.scheduler.num_preemptions, **self.counters,
                    **self.adapters.stats())

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        batch = self.scheduler.schedule()
        for seq in self.scheduler.rejected:
            self._emit(seq, _Out("", [], "error", error=self.adapters.exhausted(seq)))
            self._release(seq)
        self.scheduler.rejected.clear()
        if batch is None:
            return
        c = self.counters
        c["num_steps"] += 1
        c["max_running"] = max(c["max_running"], len(batch.seqs))
        try:
            rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
            logits = self._forward(batch)
            sampled = self.sampler.sample(logits, batch.seqs, rows) if rows else []
        except Exception as e:  # pylint: disable=broad-except
            # a failed forward fails only its own requests; the engine keeps serving
            cls = PoolExhaustedError if isinstance(e, PoolExhaustedError) else MLCLoraError
            for seq in batch.seqs:
                self.scheduler.finish(seq)
                self._release(seq)
                self._emit(seq, _Out("", [], "error", error=cls(f"engine step failed: {e}")))
            return
        for seq, chunk in zip(batch.seqs, batch.chunks):
            seq.num_cached += len(chunk)
        for i, s in zip(rows, sampled):
            try:
                self._append(batch.seqs[i], s)
            except Exception as e:  # pylint: disable=broad-except
                self.scheduler.finish(batch.seqs[i])
                self._release(batch.seqs[i])
                self._emit(batch.seqs[i], _Out("", [], "error", error=MLCLoraError(f"request failed: {e}")))

    def _forward(self, batch: Batch):
        ids = [s.seq_id for s in batch.seqs]
        lora = "pool" if self.runner.lora else None  # the pool's tables from each sequence's adapter
        if batch.is_decode:
            self.counters["num_decode_steps"] += 1
            return self.runner.decode(self.kv, ids, [c[0] for c in batch.chunks], lora=lora)
        self.counters["num_prefill_steps"] += 1
        return self.runner.prefill(self.kv, ids, batch.chunks, lora=lora)

    def _append(self, seq: Sequence, s: Sampled) -> None:
        p, st = seq.params, seq.state
        seq.output_ids.append(s.token)
        self.counters["num_generated_tokens"] += 1
        finish, cut = None, False
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        if (s.token in eos and not p.ignore_eos) or s.token in p.stop_token_ids:
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
            self._release(seq)
            self.counters["num_finished"] += 1
        end = len(st.text) if finish else max(st.sent, len(st.text) - st.holdback)
        delta, st.sent = st.text[st.sent:end], end
        usage = (len(seq.prompt_ids), len(seq.output_ids)) if finish else None
        self._emit(seq, _Out(delta, [s], finish, usage=usage))

    @staticmethod
    def _emit(seq: Sequence, out: _Out) -> None:
        if seq.sink is not None:
            seq.sink(out)


# --- front ends ----------------------------------------------------------------------------------


def _sampling_params(max_tokens, temperature, top_p, top_k, seed, stop, logprobs, top_logprobs,
                     ignore_eos, stop_token_ids) -> SamplingParams:
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if temperature is None:
        temperature = 1.0
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if top_p is None:
        top_p = 1.0
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    top_k = top_k or 0
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0 (0 = off), got {top_k}")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(x, str) or not x for x in stop):
        raise RequestError("stop must be a non-empty string or a list of them")
    top_logprobs = top_logprobs or 0
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # completions: logprobs=k
        top_logprobs, logprobs = logprobs, True
    if not 0 <= top_logprobs <= TOP_LOGPROBS_MAX:
        raise RequestError(f"top_logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {top_logprobs}")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          top_k=int(top_k), seed=seed, stop=tuple(stop),
                          stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=bool(ignore_eos),
                          logprobs=bool(logprobs or top_logprobs), top_logprobs=int(top_logprobs))


class _Loop:
    """The background thread that steps the engine while it has work."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.cv = threading.Condition()
        self.incoming: list[Sequence] = []
        self.aborts: list[Sequence] = []
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="mlc_lora-engine", daemon=True)
        self.thread.start()

    def submit(self, seq: Sequence) -> None:
        with self.cv:
            if self.closed:
                raise MLCLoraError("the engine is closed")
            self.incoming.append(seq)
            self.cv.notify()

    def abort(self, seq: Sequence) -> None:
        with self.cv:
            self.aborts.append(seq)
            self.cv.notify()

    def call(self, fn):
        """Run fn() between steps (the engine is not thread-safe)."""
        done: queue.Queue = queue.Queue()

        def run():
            try:
                done.put((fn(), None))
            except Exception as e:  # pylint: disable=broad-except
                done.put((None, e))

        with self.cv:
            if self.closed:
                raise MLCLoraError("the engine is closed")
            self.incoming.append(run)  # type: ignore[arg-type]
            self.cv.notify()
        out, err = done.get()
        if err is not None:
            raise err
        return out

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self.cv:
                while not (self.incoming or self.aborts or eng.has_work() or self.closed):
                    self.cv.wait()
                if self.closed:
                    return
                incoming, self.incoming = self.incoming, []
                aborts, self.aborts = self.aborts, []
            for item in incoming:
                if callable(item):
                    item()
                else:
                    eng.add(item)
            for seq in aborts:
                eng.abort(seq)
            eng.step()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=30)


class _Request:
    """What a front end needs to turn one sequence's outputs into OpenAI objects."""

    def __init__(self, engine: "MLCEngine", chat: bool, stream: bool):
        self.engine, self.chat, self.stream = engine, chat, stream
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _logprobs(self, tokens: list[Sampled], seq: Sequence, offset: int):
        if not seq.params.logprobs:
            return None
        tok = self.engine.engine.tokenizer
        name = (lambda i: tok.token_text(i)) if tok is not None else str  # noqa: E731
        if self.chat:
            return P.ChoiceLogprobs([P.ChatCompletionTokenLogprob(
                name(s.token), s.logprob, top_logprobs=[P.TopLogprob(name(i), lp) for i, lp in (s.top or [])])
                for s in tokens])
        return P.CompletionLogprobs(
            tokens=[name(s.token) for s in tokens], token_logprobs=[s.logprob for s in tokens],
            top_logprobs=[{name(i): lp for i, lp in (s.top or [])} for s in tokens],
            text_offset=[offset] * len(tokens))

    def chunk(self, out: _Out, seq: Sequence, first: bool, offset: int, index: int = 0,
              usage: Optional[tuple[int, int]] = None):
        """Choice `index`'s piece `out`; `usage` (prompt, completion tokens) goes on the last one."""
        usage_obj = P.CompletionUsage(usage[0], usage[1], sum(usage)) if usage else None
        lp = self._logprobs(out.tokens, seq, offset)
        model = self.engine.model_name
        if self.chat:
            delta = P.ChoiceDelta(content=out.text, role="assistant" if first else None)
            return P.ChatCompletionChunk(self.id, self.created, model,
                                         [P.ChatCompletionChunkChoice(index, delta, out.finish_reason, lp)],
                                         usage_obj)
        return P.Completion(self.id, self.created, model,
                            [P.CompletionChoice(index, out.text, out.finish_reason, lp)], usage_obj)

    def whole(self, outs: list[list[_Out]], seqs: list[Sequence]):
        """The response: choice i from the outputs outs[i] of seqs[i]; the prompt counted once."""
        choices, completion = [], 0
        for i, (seq_outs, seq) in enumerate(zip(outs, seqs)):
            text = "".join(o.text for o in seq_outs)
            tokens = [s for o in seq_outs for s in o.tokens]
            last = seq_outs[-1]
            completion += last.usage[1]
            lp = self._logprobs(tokens, seq, 0)
            ids = [s.token for s in tokens]
            if self.chat:
                choices.append(P.ChatCompletionChoice(i, P.ChatCompletionMessage("assistant", text),
                                                      last.finish_reason, lp, ids))
                continue
            if lp is not None:  # text offsets of each token in the returned text
                pos, offs = 0, []
                for o in seq_outs:
                    offs += [pos] * len(o.tokens)
                    pos += len(o.text)
                lp.text_offset = offs
            choices.append(P.CompletionChoice(i, text, last.finish_reason, lp, ids))
        prompt = outs[0][-1].usage[0]
        usage = P.CompletionUsage(prompt, completion, prompt + completion)
        model = self.engine.model_name
        if self.chat:
            return P.ChatCompletion(self.id, self.created, model, choices, usage)
        return P.Completion(self.id, self.created, model, choices, usage)


class _Choices:
    """The streaming side of a request's n sequences: each output becomes a chunk of its choice;
    the usage (prompt once, every choice's tokens) rides on the chunk that finishes the last one."""

    def __init__(self, req: _Request, seqs: list[Sequence]):
        self.req, self.seqs = req, seqs
        self.first, self.offset = [True] * len(seqs), [0] * len(seqs)
        self.done, self.completion = 0, 0

    def chunk(self, i: int, out: _Out):
        """The chunk for output `out` of choice `i`, or None when it carries nothing."""
        seq, usage = self.seqs[i], None
        if out.finish_reason is not None:
            self.done += 1
            self.completion += out.usage[1]
            if self.done == len(self.seqs):
                usage = (out.usage[0], self.completion)
        if not (out.text or out.finish_reason is not None or (out.tokens and seq.params.logprobs)):
            return None
        c = self.req.chunk(out, seq, self.first[i], self.offset[i], i, usage)
        self.first[i], self.offset[i] = False, self.offset[i] + len(out.text)
        return c


class MLCEngine:
    """`MLCEngine(model, device)`: `engine.chat.completions.create(...)`, `engine.completions.create(...)`.

    `model` is a compiled folder, or an embedded name / HF folder / .gguf compiled once into
    ~/.cache/mlc_lora (with LoRA when `max_lora_rank` and `lora_pool_pages` are given). Requests
    from several threads (or an AsyncMLCEngine's tasks) batch together; `adapter_id=NAME` picks a
    LoRA adapter loaded with `load_adapter` per request (None: the base model). `params`: the
    weights already on the device, in the config's `param_names` order (ModelRunner's `params`).
    """

    def __init__(self, model: str | Path = "smollm2-135m", device: str = "cpu", *,
                 max_num_seqs: Optional[int] = None, max_total_tokens: Optional[int] = None,
                 prefill_chunk_size: Optional[int] = None, dtype: Optional[str] = None, progress: bool = True,
                 max_lora_rank: int = 0, lora_pool_pages: int = 0, params=None):
        model_dir = resolve_compiled(model, device, progress=progress, dtype=dtype,
                                     max_lora_rank=max_lora_rank, lora_pool_pages=lora_pool_pages)
        self.engine = LLMEngine(model_dir, device, max_num_seqs, max_total_tokens, prefill_chunk_size, params)
        self.model_name = self.engine.runner.config.get("model_name", str(model))
        self._loop = _Loop(self.engine)
        self.chat = _Namespace(completions=_Creator(self, chat=True))
        self.completions = _Creator(self, chat=False)

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self._loop.call(self.engine.stats)

    # --- LoRA adapters (between steps, on the engine thread) ----------------------------------

    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> dict[str, Any]:
        """Validate a PEFT folder (or an already read `lora.peft.LoraAdapter`) against the compiled
        library and load it into the unified pool; `pin` keeps it resident (never evicted for KV).
        Returns its list_adapters() entry."""
        return self._loop.call(lambda: self.engine.adapters.load(name, path, pin))

    def pin_adapter(self, name: str, pin: bool = True) -> dict[str, Any]:
        """Pin a loaded adapter (paged back in now if it was evicted; never evicted for KV) or unpin
        it (evictable again once idle). Returns its list_adapters() entry."""
        return self._loop.call(lambda: self.engine.adapters.pin(name, pin))

    def unload_adapter(self, name: str) -> None:
        """Forget `name` now; its pages go back to the pool when its running requests end."""
        self._loop.call(lambda: self.engine.adapters.unload(name))

    def list_adapters(self) -> list[dict[str, Any]]:
        """name, path, rank, lora_alpha, use_rslora, scales, target_modules, pinned, resident, pages."""
        return self._loop.call(self.engine.adapters.list)

    def close(self) -> None:
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- request plumbing shared by the sync and async front ends ---------------------------

    def _prepare(self, chat: bool, messages=None, prompt=None, adapter_id=None, n: int = 1,
                 **kw) -> list[Sequence]:
        """The request's n sequences (with a seed, choice i samples with seed + i)."""
        params = _sampling_params(**kw)
        tok = self.engine.tokenizer
        if chat:
            msgs = check_messages(messages)
            if tok is None:
                raise RequestError("chat needs a tokenizer; this model has none")
            ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
        elif isinstance(prompt, str):
            if tok is None:
                raise RequestError("text prompts need a tokenizer; pass token ids")
            ids = tok.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        return [self.engine.make_sequence(ids, params if params.seed is None or i == 0 else
                                          dataclasses.replace(params, seed=params.seed + i), adapter_id)
                for i in range(n)]


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _kwargs(max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None, stop=None,
            logprobs=None, top_logprobs=None, ignore_eos=False, stop_token_ids=None, n=1, **extra):
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    unknown = set(extra) - {"model", "stream_options", "user", "max_completion_tokens"}
    if unknown:
        raise RequestError(f"unknown request arguments: {', '.join(sorted(unknown))}")
    if extra.get("max_completion_tokens") is not None and max_tokens is None:
        max_tokens = extra["max_completion_tokens"]
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                stop=stop, logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=ignore_eos,
                stop_token_ids=stop_token_ids, n=n)


class _Creator:
    """`.create(...)` of chat.completions / completions, blocking or streaming."""

    def __init__(self, owner: MLCEngine, chat: bool):
        self.owner, self.chat = owner, chat

    def create(self, *, messages=None, prompt=None, stream: bool = False, adapter_id=None, **kw):
        owner = self.owner
        seqs = owner._prepare(self.chat, messages=messages, prompt=prompt,  # pylint: disable=protected-access
                              adapter_id=adapter_id, **_kwargs(**kw))
        q: queue.Queue = queue.Queue()
        for i, seq in enumerate(seqs):
            seq.sink = lambda out, i=i: q.put((i, out))
        req = _Request(owner, self.chat, stream)
        for seq in seqs:
            owner._loop.submit(seq)  # pylint: disable=protected-access
        outputs = self._outputs(q, seqs)
        if stream:
            return self._stream(_Choices(req, seqs), outputs)
        outs: list[list[_Out]] = [[] for _ in seqs]
        for i, out in outputs:
            outs[i].append(out)
        return req.whole(outs, seqs)

    def _abort_unfinished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.finish_reason is None:
                self.owner._loop.abort(seq)  # pylint: disable=protected-access

    def _outputs(self, q: queue.Queue, seqs: list[Sequence]):
        """(choice, output) until every sequence finished; an error raises, and whatever is left
        unfinished (an error, or the caller stopped reading) is aborted."""
        done = 0
        try:
            while done < len(seqs):
                i, out = q.get()
                if out.error is not None:
                    raise out.error
                done += out.finish_reason is not None
                yield i, out
        finally:
            self._abort_unfinished(seqs)

    @staticmethod
    def _stream(choices: _Choices, outputs):
        try:
            for i, out in outputs:
                chunk = choices.chunk(i, out)
                if chunk is not None:
                    yield chunk
        finally:
            outputs.close()


class AsyncMLCEngine(MLCEngine):
    """The same engine for asyncio: `await engine.chat.completions.create(...)`; streams are async iterators."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.chat = _Namespace(completions=_AsyncCreator(self, chat=True))
        self.completions = _AsyncCreator(self, chat=False)

    async def stats(self) -> dict[str, Any]:  # type: ignore[override]
        return await asyncio.get_running_loop().run_in_executor(None, self._loop.call, self.engine.stats)

    async def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> dict[str, Any]:  # type: ignore[override]
        return await asyncio.get_running_loop().run_in_executor(None, MLCEngine.load_adapter, self, name, path, pin)

    async def pin_adapter(self, name: str, pin: bool = True) -> dict[str, Any]:  # type: ignore[override]
        return await asyncio.get_running_loop().run_in_executor(None, MLCEngine.pin_adapter, self, name, pin)

    async def unload_adapter(self, name: str) -> None:  # type: ignore[override]
        await asyncio.get_running_loop().run_in_executor(None, MLCEngine.unload_adapter, self, name)

    async def list_adapters(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return await asyncio.get_running_loop().run_in_executor(None, MLCEngine.list_adapters, self)


class _AsyncCreator(_Creator):
    async def create(self, *, messages=None, prompt=None, stream: bool = False, adapter_id=None, **kw):
        owner = self.owner
        seqs = owner._prepare(self.chat, messages=messages, prompt=prompt,  # pylint: disable=protected-access
                              adapter_id=adapter_id, **_kwargs(**kw))
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        for i, seq in enumerate(seqs):
            seq.sink = lambda out, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, out))
        req = _Request(owner, self.chat, stream)
        for seq in seqs:
            owner._loop.submit(seq)  # pylint: disable=protected-access
        outputs = self._aoutputs(q, seqs)
        if stream:
            return self._astream(_Choices(req, seqs), outputs)
        outs: list[list[_Out]] = [[] for _ in seqs]
        try:
            async for i, out in outputs:
                outs[i].append(out)
        finally:
            await outputs.aclose()
        return req.whole(outs, seqs)

    async def _aoutputs(self, q: asyncio.Queue, seqs: list[Sequence]):
        """_outputs for asyncio."""
        done = 0
        try:
            while done < len(seqs):
                i, out = await q.get()
                if out.error is not None:
                    raise out.error
                done += out.finish_reason is not None
                yield i, out
        finally:
            self._abort_unfinished(seqs)

    @staticmethod
    async def _astream(choices: _Choices, outputs):
        try:
            async for i, out in outputs:
                chunk = choices.chunk(i, out)
                if chunk is not None:
                    yield chunk
        finally:
            await outputs.aclose()
