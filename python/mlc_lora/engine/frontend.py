"""`MLCEngine`: OpenAI-style chat and completions over a continuously batched model.

One background thread (loop.py) owns the core (core.py); a create(...) call validates its request
(requests.py), submits its sequences and turns their outputs into OpenAI objects as they arrive
(responses.py). `Request` holds everything a create() call does but the waiting, so the async
front end (async_frontend.py) differs from this one only in how it waits.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..contract import CONFIG_FILE
from ..errors import RequestError
from ..tokenizer import Tokenizer
from . import protocol as P
from .core import LLMEngine, StepOutput
from .grammar import compile_grammar
from .loop import EngineLoop
from .requests import MAX_SEQUENCES, prompt_ids, sampling_params, split_prompts, validate
from .responses import ResponseBuilder


def compiled_folder(model: str | Path, device: str, **compile_options) -> Path:
    """`model` if it is a compiled folder; else its compiled copy in the cache (compiled now if
    missing, see mlc_lora.compile.resolve_compiled)."""
    if (Path(model) / CONFIG_FILE).is_file():
        return Path(model)
    # Only now the compiler: a runtime-only TVM (what a GPU server may have) serves compiled folders.
    from ..compile import resolve_compiled  # pylint: disable=import-outside-toplevel

    return resolve_compiled(model, device, **compile_options)


class Request:  # pylint: disable=too-many-instance-attributes
    """One create(...) call: its sequences (for each prompt, n choices; choice j samples with
    seed + j), submitted to the loop; `take` turns each (choice, output) that `put` received into
    the response. `unknown_ok`: unknown arguments are ignored (the server's way, as vLLM's) rather
    than refused. `put` runs on the engine thread; what it returns, if not None, the engine calls
    once after the step's outputs (LLMEngine._deliver). Whole responses gather their outputs on the
    engine thread and `put` only each choice's last one; `alive()` (raising once the waiting side
    is gone, as `put` would) is called for the others."""

    def __init__(self, owner: "MLCEngine", chat: bool, stream: bool, put: Callable[[tuple[int, StepOutput]], Any],
                 messages=None, prompt=None, adapter_id: Optional[str] = None, unknown_ok: bool = False,
                 alive: Optional[Callable[[], Any]] = None, **kw):
        fields = {**kw, "messages": messages} if chat else {**kw, "prompt": prompt}
        req = validate(P.ChatCompletionRequest if chat else P.CompletionRequest, fields, unknown_ok)
        tok = owner.tokenizer
        grammar = compile_grammar(tok, req.response_format, owner.engine.runner.vocab_size)
        params, n = sampling_params(req, grammar), req.n or 1
        prompts = [messages] if chat else split_prompts(prompt)
        if len(prompts) * n > MAX_SEQUENCES:
            raise RequestError(f"{len(prompts)} prompts x n={n} choices exceed {MAX_SEQUENCES} sequences", "n")
        ids = [prompt_ids(tok, chat, messages, p) for p in prompts]
        echo = None
        if not chat and req.echo:  # the prompts' texts, as given (token ids: decoded)
            echo = [p if isinstance(p, str) else tok.decode(p) if tok is not None else "" for p in prompts]
            echo = [t for t in echo for _ in range(n)]
        core = owner.engine
        self.seqs = [core.make_sequence(pid, dataclasses.replace(
                         params, seed=params.seed if params.seed is None else params.seed + j), adapter_id)
                     for pid in ids for j in range(n)]
        self.stream = stream
        self.builder = ResponseBuilder(chat, owner.model_name, tok, self.seqs, echo, n)
        self.outs: list[list[StepOutput]] = [[] for _ in self.seqs]  # (whole responses)
        for i, seq in enumerate(self.seqs):
            if stream:
                seq.sink = lambda out, i=i: put((i, out))
            else:  # whole responses: the waiting side wakes only for a choice's last output (or an error)
                seq.sink = functools.partial(self._gather, self.outs[i], put, alive, i)
        self.finished = 0
        self._loop = owner._loop  # pylint: disable=protected-access
        for seq in self.seqs:
            self._loop.submit(seq)

    @staticmethod
    def _gather(outs: list[StepOutput], put, alive, i: int, out: StepOutput):
        """A whole response's sink (engine thread): outputs gather in `outs`, the last one goes to `put`."""
        if out.finish_reason is not None or out.error is not None:
            return put((i, out))
        if alive is not None:
            alive()
        outs.append(out)
        return None

    @property
    def done(self) -> bool:
        return self.finished == len(self.seqs)

    def take(self, item: tuple[int, StepOutput]):
        """One output: the chunk it makes when streaming (or None); raises the request's error."""
        i, out = item
        if out.error is not None:
            raise out.error
        self.finished += out.finish_reason is not None
        if self.stream:
            return self.builder.chunk(i, out)
        self.outs[i].append(out)
        return None

    def response(self):
        return self.builder.response(self.outs)

    def abort_unfinished(self) -> None:
        """Whatever is left unfinished (an error, or the caller stopped reading) is aborted."""
        for seq in self.seqs:
            if seq.finish_reason is None:
                self._loop.abort(seq)


def _chunks(req: Request, q: queue.Queue) -> Iterator:
    try:
        while not req.done:
            chunk = req.take(q.get())
            if chunk is not None:
                yield chunk
    finally:
        req.abort_unfinished()


class Completions:
    """`.create(...)` of `chat.completions` / `completions`: the response, or with stream=True an
    iterator of chunks. `adapter_id=NAME`: a loaded LoRA adapter (None: the base model)."""

    def __init__(self, owner: "MLCEngine", chat: bool):
        self.owner, self.chat = owner, chat

    def create(self, *, messages=None, prompt=None, stream: bool = False, adapter_id=None, **kw):
        q: queue.Queue = queue.Queue()
        req = Request(self.owner, self.chat, stream, q.put, messages, prompt, adapter_id, **kw)
        chunks = _chunks(req, q)
        if stream:
            return chunks
        for _ in chunks:
            pass
        return req.response()


class Chat:
    """`engine.chat.completions`."""

    def __init__(self, completions):
        self.completions = completions


class MLCEngine:
    """`MLCEngine(model, device)`: `engine.chat.completions.create(...)`, `engine.completions.create(...)`.

    `model` is a compiled folder, or an embedded name / HF folder / .gguf compiled once into
    ~/.cache/mlc_lora (with LoRA when `max_lora_rank` and `lora_pool_pages` are given). Requests
    from several threads (or an AsyncMLCEngine's tasks) batch together; `adapter_id=NAME` picks a
    LoRA adapter loaded with `load_adapter` per request (None: the base model). `params`: the
    weights already on the device, in the config's `param_names` order (ModelRunner's `params`).
    `fair_share`: under overload, admit requests of the adapter (or base model) served least so
    far, by the virtual token counter (engine/scheduler.py), instead of first come first served.
    `enable_prefix_caching`: keep full KV pages of finished prompts in the pool, per adapter, and
    start later requests with the same prefix after them (engine/core.py).
    `adapter_host_bytes`: the budget of the adapters' host copies (None: unlimited; a dropped copy is
    read again from its folder); `prefetch_adapters`: read and page in the adapters of waiting
    requests ahead of scheduling (docs/DESIGN.md, "Adapter tiers"). `max_loras`: the most adapters
    the running sequences span at once, as vLLM's `--max-loras` (None: no bound): fewer adapter rows
    read per step, requests on other adapters wait (engine/scheduler.py).
    """

    def __init__(self, model: str | Path = "smollm2-135m", device: str = "cpu", *,
                 max_num_seqs: Optional[int] = None, max_total_tokens: Optional[int] = None,
                 prefill_chunk_size: Optional[int] = None, dtype: Optional[str] = None, progress: bool = True,
                 max_lora_rank: int = 0, lora_pool_pages: int = 0, params=None,
                 fair_share: bool = False, enable_prefix_caching: bool = False,
                 adapter_host_bytes: Optional[int] = None, prefetch_adapters: bool = True,
                 max_loras: Optional[int] = None):
        model_dir = compiled_folder(model, device, progress=progress, dtype=dtype,
                                    max_lora_rank=max_lora_rank, lora_pool_pages=lora_pool_pages)
        self.engine = LLMEngine(model_dir, device, max_num_seqs, max_total_tokens, prefill_chunk_size, params,
                                fair_share=fair_share, enable_prefix_caching=enable_prefix_caching,
                                adapter_host_bytes=adapter_host_bytes, prefetch_adapters=prefetch_adapters,
                                max_loras=max_loras)
        self.model_name = self.engine.model_name or str(model)
        self._loop = EngineLoop(self.engine)
        self.chat = Chat(Completions(self, chat=True))
        self.completions = Completions(self, chat=False)

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        return self.engine.tokenizer

    def is_alive(self) -> bool:
        """The engine thread still runs (it stops only when closed)."""
        return self._loop.is_alive()

    def stats(self) -> dict[str, Any]:
        return self._loop.call(self.engine.stats)

    # --- LoRA adapters (between steps, on the engine thread) ----------------------------------

    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> dict[str, Any]:
        """Validate a PEFT folder (or an already read `lora.peft.LoraAdapter`) against the compiled
        library and load it into the unified pool; `pin` keeps it resident (never evicted for KV).
        The folder is read and packed on the calling thread, the engine's steps go on meanwhile; the
        adapter takes pool pages now if there is room, else when its first request runs (a busy
        pool never refuses a load). Returns its list_adapters() entry."""
        host = self.engine.adapters.read(path, name)
        return self._loop.call(lambda: self.engine.adapters.load(name, host, pin))

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
