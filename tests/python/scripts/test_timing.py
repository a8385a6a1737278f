"""scripts/harness/timing.py on CPU callables: wall_time's samples, warm-up, setup and statistics;
the replay method's CPU path (interleaving with the order rotated, us per call); copies_for."""

from __future__ import annotations

import time

import pytest

from harness import timing


def test_wall_time_is_the_median_of_the_timed_samples():
    calls, setups = [], []
    durations = iter([0.2, 0.01, 0.03, 0.02])  # the first sample is the warm-up

    def fn(state):
        calls.append(state)
        time.sleep(next(durations))

    def setup():
        setups.append(len(setups))
        return len(setups) - 1

    t = timing.wall_time(fn, repeat=3, warmup=1, setup=setup)
    assert calls == [0, 1, 2, 3] and setups == [0, 1, 2, 3]  # every sample gets a fresh state
    assert 0.018 <= t < 0.03  # the median of 0.01, 0.03, 0.02; the 0.2 s warm-up dropped


def test_wall_time_min_number_and_sync():
    syncs = []
    t = timing.wall_time(lambda: time.sleep(0.005), repeat=3, warmup=0, number=4, stat="min",
                         sync=lambda: syncs.append(1))
    assert 0.004 <= t < 0.02  # per call, not per sample of 4 calls
    assert len(syncs) == 6  # before and after each sample
    with pytest.raises(ValueError, match="stat"):
        timing.wall_time(lambda: None, stat="mean")


def test_replays_interleave_with_the_order_rotated():
    order = []

    def cand(name, seconds):
        def fn(c):
            order.append((name, c))
            time.sleep(seconds)
        return fn

    t = timing.compare({"a": (cand("a", 0.002), 2), "b": (cand("b", 0.004), 3)}, device="cpu", reps=4)
    # us per call: a sleep never ends early, and a loaded host may add to it (not a factor of 5)
    assert 1950 <= t["a"] < 10000 and 3950 <= t["b"] < 20000 and t["b"] > t["a"]
    warm = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]  # each call once, before any timing
    assert order[:5] == warm
    firsts = [name for name, c in order[5:] if c == 0]
    assert firsts == ["a", "b", "b", "a", "a", "b", "b", "a"]  # rep i starts with candidate i % 2


def test_copies_reach_the_rotation_size():
    assert timing.copies_for(64 << 20) == 4
    assert timing.copies_for(300 << 20) == 2  # at least two
    assert timing.copies_for(300 << 20, min_copies=3) == 3
    assert timing.copies_for(1000) == timing.MAX_CALLS
    assert timing.copies_for(128 << 10) * (128 << 10) >= timing.ROTATE_BYTES
    with pytest.raises(ValueError):
        timing.Replay(lambda c: None, 0, "cpu")
