"""The background thread that owns an LLMEngine: it takes requests, aborts and calls from any
thread and steps the engine while it has work (the engine itself is not thread-safe)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from ..errors import MLCLoraError
from .core import LLMEngine
from .scheduler import Sequence


class EngineLoop:
    """Steps `engine` on its own thread; `submit`, `abort` and `call` are safe from any thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.cv = threading.Condition()
        self.incoming: list[Any] = []  # sequences to add, and calls to run, in arrival order
        self.aborts: list[Sequence] = []
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="mlc_lora-engine", daemon=True)
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

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

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() between steps, on the engine thread; its result or its exception."""
        done: queue.Queue = queue.Queue()

        def run():
            try:
                done.put((fn(), None))
            except Exception as e:  # pylint: disable=broad-except
                done.put((None, e))

        with self.cv:
            if self.closed:
                raise MLCLoraError("the engine is closed")
            self.incoming.append(run)
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
