"""AdapterReader: the worker threads that read adapter folders (disk -> host) off the engine's step.
Reads run side by side on its workers, every submitted slot comes back once (its result or its
exception), and `pending` counts what was submitted and not yet taken."""

import threading
import time

import pytest

from mlc_lora.engine.prefetch import READ_WORKERS, AdapterReader


def take_all(reader: AdapterReader, count: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        reader.wait(0.05)
        got += reader.take()
    return got


@pytest.mark.parametrize("workers", [READ_WORKERS, 2])
def test_reads_run_side_by_side_and_each_comes_back_once(workers):
    # each read waits at a barrier for `workers` reads at once: reads one at a time would break it
    barrier = threading.Barrier(workers, timeout=5.0)
    threads = set()

    def read(folder, name):
        threads.add(threading.current_thread().name)
        barrier.wait()
        if name == "bad":
            raise ValueError(folder)
        return folder

    reader = AdapterReader(read, workers)
    n = 3 * workers
    for slot in range(n):
        reader.submit(slot, f"dir{slot}", "bad" if slot == 1 else f"a{slot}")
    assert reader.pending == n
    got = take_all(reader, n)
    assert sorted(slot for slot, _ in got) == list(range(n))  # each slot once, in any order
    for slot, out in got:
        if slot == 1:
            assert isinstance(out, ValueError) and str(out) == "dir1"
        else:
            assert out == f"dir{slot}"  # not a BrokenBarrierError: the reads met at the barrier
    assert reader.pending == 0 and reader.take() == []
    assert len(threads) == workers


def test_started_on_first_use_and_one_worker_reads_in_order():
    order = []
    reader = AdapterReader(lambda folder, name: order.append(folder) or folder, 1)
    time.sleep(0.05)
    assert reader.take() == [] and not order  # nothing submitted: no thread, nothing read
    for slot in range(5):
        reader.submit(slot, f"dir{slot}", f"a{slot}")
    got = take_all(reader, 5)
    assert got == [(s, f"dir{s}") for s in range(5)] and reader.pending == 0


def test_needs_a_worker():
    with pytest.raises(ValueError):
        AdapterReader(lambda folder, name: None, 0)
