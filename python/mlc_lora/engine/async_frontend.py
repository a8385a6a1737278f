"""`AsyncMLCEngine`: MLCEngine for asyncio. The same core, loop and `Request`; only the waiting
is asynchronous (an asyncio.Queue per request fed from the engine thread through the event loop's
`Mailbox`, engine calls in a worker thread)."""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

from .frontend import Chat, MLCEngine, Request


class Mailbox:
    """The engine thread's outputs for the requests of one event loop. `put` (engine thread) queues
    an item for a request's asyncio.Queue and returns `wake` when the loop must be woken for it
    (nothing was queued since the last hand-over): the engine calls it once after the step's
    outputs (LLMEngine._deliver), so the loop wakes once a step, not once per item, and hands
    each item to its queue in the order put. `put` raises once the loop is closed (the engine then
    drops that request), as `call_soon_threadsafe` does."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # (the engine's mailboxes are keyed by their loop, weakly)
        self._lock = threading.Lock()
        self._items: list = []

    def alive(self) -> asyncio.AbstractEventLoop:
        """The loop; RuntimeError once it is closed."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            raise RuntimeError("Event loop is closed")
        return loop

    def put(self, q: asyncio.Queue, item) -> Optional[Callable[[], None]]:
        self.alive()
        with self._lock:
            self._items.append((q, item))
            first = len(self._items) == 1  # the first since the last hand-over: the loop must wake
        return self.wake if first else None

    def wake(self) -> None:
        self.alive().call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for q, item in items:
            q.put_nowait(item)


async def _achunks(req: Request, q: asyncio.Queue) -> AsyncIterator:
    try:
        while not req.done:
            chunk = req.take(await q.get())
            if chunk is not None:
                yield chunk
    finally:
        req.abort_unfinished()


class AsyncCompletions:
    """`await .create(...)`: the response, or with stream=True an async iterator of chunks.
    Cancelling the caller (or closing the iterator) aborts what is left of the request."""

    def __init__(self, owner: "AsyncMLCEngine", chat: bool):
        self.owner, self.chat = owner, chat

    async def create(self, *, messages=None, prompt=None, stream: bool = False, adapter_id=None, **kw):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        # validation, the chat template and tokenization run in a worker thread: a long prompt
        # never stalls the event loop (other streams, health checks)
        box = self.owner.mailbox(loop)
        fut = loop.run_in_executor(None, functools.partial(
            Request, self.owner, self.chat, stream, functools.partial(box.put, q), messages, prompt, adapter_id,
            alive=box.alive, **kw))
        try:
            req = await asyncio.shield(fut)
        except asyncio.CancelledError:  # the caller left while its request was being prepared
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().abort_unfinished())
            raise
        chunks = _achunks(req, q)
        if stream:
            return chunks
        try:
            async for _ in chunks:
                pass
        finally:
            await chunks.aclose()
        return req.response()


class AsyncMLCEngine(MLCEngine):
    """The same engine for asyncio: `await engine.chat.completions.create(...)`; streams are async
    iterators; the adapter calls and `stats` are coroutines."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.chat = Chat(AsyncCompletions(self, chat=True))
        self.completions = AsyncCompletions(self, chat=False)
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The mailbox of `loop`'s requests (one per event loop the engine serves)."""
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = Mailbox(loop)
        return box

    async def _in_thread(self, fn, *args):
        """MLCEngine's `fn(self, *args)` (it waits for the engine thread) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, self, *args))

    async def stats(self) -> dict[str, Any]:  # type: ignore[override]
        return await self._in_thread(MLCEngine.stats)

    async def load_adapter(self, name: str, path: str | Path,  # type: ignore[override]
                           pin: bool = False) -> dict[str, Any]:
        return await self._in_thread(MLCEngine.load_adapter, name, path, pin)

    async def pin_adapter(self, name: str, pin: bool = True) -> dict[str, Any]:  # type: ignore[override]
        return await self._in_thread(MLCEngine.pin_adapter, name, pin)

    async def unload_adapter(self, name: str) -> None:  # type: ignore[override]
        await self._in_thread(MLCEngine.unload_adapter, name)

    async def list_adapters(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return await self._in_thread(MLCEngine.list_adapters)
