"""scripts/bench_serving.py: adapter popularity and arrival laws against their closed forms, and
vLLM's metric definitions on hand-timed requests."""

from __future__ import annotations

import numpy as np
import pytest

import bench_serving as bench  # scripts/ is on pytest's pythonpath (pyproject.toml)


def load_bench():
    """scripts/bench_serving.py as a module (test_server drives the server with it)."""
    return bench


N = 200_000


def _freq(ids, n):
    return np.bincount(ids, minlength=n) / len(ids)


def test_uniform_and_zipf_popularity():
    rng = np.random.default_rng(0)
    f = _freq(bench.adapter_ids(N, 8, "uniform", rng), 8)
    np.testing.assert_allclose(f, 1 / 8, atol=0.005)
    f = _freq(bench.adapter_ids(N, 5, "zipf", rng, zipf_s=1.2), 5)
    p = np.array([1 / k ** 1.2 for k in range(1, 6)])
    np.testing.assert_allclose(f, p / p.sum(), atol=0.005)


@pytest.mark.parametrize("alpha", [0.3, 1.0, 2.0])
def test_slora_power_law_popularity(alpha):
    """id = floor(n X), X ~ power(alpha): P(id < k) = (k / n)^alpha."""
    n = 10
    ids = bench.adapter_ids(N, n, "power", np.random.default_rng(1), alpha=alpha)
    assert ids.min() >= 0 and ids.max() < n
    cdf = np.cumsum(_freq(ids, n))
    np.testing.assert_allclose(cdf, (np.arange(1, n + 1) / n) ** alpha, atol=0.005)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_arrivals_have_the_asked_rate_and_burstiness(burstiness):
    """Gamma(k, 1/(r k)): mean 1/r, squared coefficient of variation 1/k (1 = Poisson)."""
    gaps = bench.arrival_gaps(N, 4.0, burstiness, np.random.default_rng(2))
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.05)
    assert not bench.arrival_gaps(5, float("inf"), 1.0, np.random.default_rng(0)).any()


def test_metrics_follow_vllm_definitions():
    R = bench.Result
    results = [R("a", 10, True, 5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
               R("b", 20, True, 1, ttft=0.3, latency=0.3, itl=[]),
               R("c", 7, False, error="boom")]
    m = bench.summarize(results, duration=2.0)
    assert (m["completed"], m["failed"], m["total_input"], m["total_output"]) == (2, 1, 30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; one-token requests have none
    assert m["mean_itl_ms"] == pytest.approx(100.0) and m["p99_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(400.0)
    text = bench.report(m)
    lines = text.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert "Successful requests:                     2" in text
    assert any(line.startswith("Mean TPOT (ms):") and "100.00" in line for line in lines)
    assert all(len(line.rstrip()) <= 51 for line in lines)
