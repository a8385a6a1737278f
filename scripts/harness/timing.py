"""Timing for every benchmark: one method per kind of work.

Kernels (`Replay`, `replay_times`, `compare`): each candidate is one CUDA graph of n calls, call c
working on copy c of its inputs and weights; the copies together span >= ROTATE_BYTES (`copies_for`)
so every call reads from HBM as in a real forward (the H200's L2 holds 50 MB). The graphs' replays
are interleaved and their order rotated every repetition, so that clock drift and the position in
the sequence hit all candidates alike; the figure is the median replay time / n, in us per call.
On "cpu" the same interface runs the n calls as a loop timed by the host clock (the dry runs).

Host-side work (`wall_time`): perf_counter around `number` back-to-back calls after `warmup`
untimed samples; the median (or the minimum: the least-disturbed sample on a loaded host) of
`repeat` samples, in seconds per call. A GPU step's own work (`queued_time`): its launches queued
behind a sleep kernel, CUDA events around them, so a slow host leaves no gaps in it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

ROTATE_BYTES = 256 << 20  # the working set every candidate's calls rotate over
# Memory bandwidth the benchmarks' floors and roofline shares divide by: PEAK_BW, the H200's
# measured device-to-device copy rate (bytes/s); HBM_TBS, the data-sheet rate by GPU name (TB/s).
PEAK_BW = 4.2e12
HBM_TBS = {"H200": 4.8, "H100": 3.35}
MAX_CALLS = 2048  # the most calls one graph holds (256 MB of the smallest sweep point's 128 KB)


def copies_for(nbytes: int, min_copies: int = 2, max_copies: int = MAX_CALLS) -> int:
    """How many copies of an `nbytes` working set reach ROTATE_BYTES together (within the bounds)."""
    return max(min_copies, min(max_copies, -(-ROTATE_BYTES // max(1, int(nbytes)))))


def _capturing(torch, graph):
    """torch's capture context; with tvm_ffi present, TVM kernels launch on the capturing stream too."""
    ctx = torch.cuda.graph(graph, capture_error_mode="relaxed")
    try:
        import tvm_ffi  # pylint: disable=import-outside-toplevel
    except ImportError:
        return ctx
    return tvm_ffi.use_torch_stream(ctx)


class Replay:
    """fn(0) .. fn(n - 1) as one unit. Every call is made once eagerly first (kernels compiled, caches
    keyed by tensor addresses filled, allocator pools warm: a capture can do none of these); then on
    "cuda" the n calls are captured in a CUDA graph, on "cpu" they stay a Python loop. The values the
    captured calls return live as long as the replay (outputs allocated inside the capture)."""

    def __init__(self, fn: Callable[[int], Any], n: int, device: str = "cuda"):
        if n < 1:
            raise ValueError(f"a replay needs at least one call, got n={n}")
        self.fn, self.n, self.device, self.graph, self._keep = fn, n, device, None, None
        for c in range(n):
            fn(c)
        if device == "cpu":
            return
        import torch  # pylint: disable=import-outside-toplevel

        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with _capturing(torch, self.graph):
            self._keep = [fn(c) for c in range(n)]
        self.graph.replay()
        torch.cuda.synchronize()

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            for c in range(self.n):
                self.fn(c)


def replay_times(replays: list[Replay], reps: int = 20) -> list[float]:
    """Median us per call of each replay; replays interleaved, the order rotated every repetition."""
    k = len(replays)
    order = [[(i + j) % k for j in range(k)] for i in range(reps)]
    if replays[0].device == "cpu":
        samples = [[] for _ in replays]
        for row in order:
            for m in row:
                t0 = time.perf_counter()
                replays[m].replay()
                samples[m].append((time.perf_counter() - t0) * 1e6)
        return [statistics.median(s) / r.n for s, r in zip(samples, replays)]
    import torch  # pylint: disable=import-outside-toplevel

    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
          for _ in replays]
    for i, row in enumerate(order):
        for m in row:
            ev[m][i][0].record()
            replays[m].replay()
            ev[m][i][1].record()
    torch.cuda.synchronize()
    return [statistics.median(a.elapsed_time(b) for a, b in e) * 1e3 / r.n for e, r in zip(ev, replays)]


def compare(candidates: dict[str, tuple[Callable[[int], Any], int]], device: str = "cuda",
            reps: int = 20) -> dict[str, float]:
    """{name: (fn, n)} -> {name: median us per call}, all candidates timed in one interleaved run."""
    replays = {name: Replay(fn, n, device) for name, (fn, n) in candidates.items()}
    times = replay_times(list(replays.values()), reps)
    return dict(zip(replays, times))


def wall_time(fn: Callable[..., Any], *, repeat: int = 5, warmup: int = 1, number: int = 1,
              setup: Callable[[], Any] | None = None, sync: Callable[[], None] | None = None,
              stat: str = "median") -> float:
    """Seconds per call of `fn` by the host clock. A sample: setup() (untimed; its value, when not
    None, is passed to fn), sync(), `number` calls of fn, sync(); `warmup` samples are dropped, and
    `stat` ("median" or "min") of the other `repeat` samples is returned. sync: e.g.
    torch.cuda.synchronize, so that GPU work is inside the clock."""
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    if repeat < 1 or number < 1:
        raise ValueError("repeat and number must be >= 1")
    samples = []
    for i in range(warmup + repeat):
        args = ()  # the previous sample's state goes before setup() makes the next
        if setup is not None:
            arg = setup()
            args = () if arg is None else (arg,)
            del arg
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn(*args)
        if sync is not None:
            sync()
        if i >= warmup:
            samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples) if stat == "median" else min(samples)


def queued_time(fn: Callable[[], Any], *, setup: Callable[[], Any] | None = None, repeat: int = 5,
                sleep_cycles: int = 120_000_000) -> tuple[float, float] | tuple[None, None]:
    """(host ms, GPU ms) of one call of fn, medians of `repeat` samples after one warm-up: each
    call's launches queued behind a sleep kernel of `sleep_cycles` (~60 ms on an H200, so the host
    never waits on the GPU), CUDA events around its work. The GPU ms is the call's work without the
    gaps a slow host leaves. A call that waits on the GPU inside (its host time over half the
    sleep's: e.g. TVM's copies of host arrays to the device synchronize) gets (None, None): its host
    time is the sleep's and its GPU time has the launches' gaps. CUDA only; fn must launch on the
    default stream, as the sleep does."""
    import torch  # pylint: disable=import-outside-toplevel

    hs, gs, ss = [], [], []
    for _ in range(repeat + 1):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        es, e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        es.record()
        torch.cuda._sleep(sleep_cycles)  # pylint: disable=protected-access
        e0.record()
        t0 = time.perf_counter()
        fn()
        hs.append((time.perf_counter() - t0) * 1e3)
        e1.record()
        torch.cuda.synchronize()
        gs.append(e0.elapsed_time(e1))
        ss.append(es.elapsed_time(e0))
    if statistics.median(hs[1:]) > 0.5 * statistics.median(ss[1:]):
        return None, None
    return round(statistics.median(hs[1:]), 3), round(statistics.median(gs[1:]), 3)
