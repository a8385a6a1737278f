"""What the engine does for adapters off its step: worker threads that read adapter folders
(disk -> host tier) while the engine steps, and the histogram of prefetch lead times.

The engine thread submits reads and takes their results between steps (AdapterTable in
adapters.py); the workers touch no engine or pool state, only the folder and `read`.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
from typing import Any, Callable

# upper bounds (seconds) of the prefetch lead-time histogram's buckets; the last bucket is +Inf
LEAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# reader threads: a request whose adapter's host copy was dropped waits for its own read, not for
# every read queued ahead of it (reading and packing let go of the GIL). Half the cores, 4 to 16:
# with 1000 adapters a run reads hundreds of folders (~0.6 s each on one core for a rank-32 7B
# adapter); 4 threads leave most of a 16-core machine idle
READ_WORKERS = max(4, min(16, (os.cpu_count() or 8) // 2))


class AdapterReader:
    """`workers` daemon threads running `read(folder, name)` (which must be thread-safe) for each
    submitted (slot, folder, name); `take()` hands back the finished (slot, result or exception)
    pairs, in the order they finish. Started on first use."""

    def __init__(self, read: Callable[[str, str], Any], workers: int = READ_WORKERS):
        if workers < 1:
            raise ValueError(f"an adapter reader needs at least one worker, got {workers}")
        self._read = read
        self.workers = workers
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: list[tuple[int, Any]] = []
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self.pending = 0  # submitted, not yet taken

    def submit(self, slot: int, folder: str, name: str) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name=f"mlc_lora-adapter-reader-{i}", daemon=True)
                             for i in range(self.workers)]
            for t in self._threads:
                t.start()
        self.pending += 1
        self._todo.put((slot, folder, name))

    def take(self) -> list[tuple[int, Any]]:
        with self._cv:
            done, self._done = self._done, []
        self.pending -= len(done)
        return done

    def wait(self, timeout: float) -> None:
        """Until a read finishes or `timeout` seconds pass (when the engine has nothing else to do)."""
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    def _run(self) -> None:
        while True:
            slot, folder, name = self._todo.get()
            try:
                out: Any = self._read(folder, name)
            except Exception as e:  # pylint: disable=broad-except  (handed to the engine thread)
                out = e
            with self._cv:
                self._done.append((slot, out))
                self._cv.notify_all()


class LeadTimes:
    """A histogram of prefetch lead times: seconds from an adapter's prefetch page-in to the first
    step of the request it was prefetched for (cumulative bucket counts, as Prometheus keeps them)."""

    def __init__(self):
        self.counts = [0] * (len(LEAD_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LEAD_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """{"buckets": [[upper bound, cumulative count], ..., ["+Inf", count]], "sum", "count"}."""
        cum, buckets = 0, []
        for le, n in zip((*LEAD_BUCKETS, "+Inf"), self.counts):
            cum += n
            buckets.append([le, cum])
        return {"buckets": buckets, "sum": round(self.sum, 6), "count": self.count}
