"""Prometheus metrics: the engine's state at scrape time plus the server's request counters."""

from __future__ import annotations

import collections
import time
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "mlc_lora"
# window over which the tokens/s gauge is averaged
RATE_WINDOW_S = 10.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Per-model series (tokens served) are kept for the base model and the loaded adapters only (the
# engine reports no others), and for at most this many adapters: those served most tokens. A
# server with thousands of adapters loaded thus exports a bounded number of series.
MODEL_SERIES_MAX = 256


def pool_pages(stats: dict[str, Any]) -> dict[str, int]:
    """Pages of the unified pool by kind (kv / adapter / cached / free) from an engine stats()
    snapshot; `cached`: prefix-cache pages no request holds (those requests hold count as kv).

    A LoRA engine reports its pool (`pool_pages_kv`, `pool_pages_adapter`, `pool_pages_free`); an
    engine without adapters only its KV cache (`kv_pages_total`, `kv_pages_free`).
    """
    cached = int(stats.get("prefix_cache_idle_pages", 0))
    if "pool_pages_kv" in stats:
        return {kind: int(stats[f"pool_pages_{kind}"]) for kind in ("kv", "adapter", "free")} | {"cached": cached}
    total, free = int(stats["kv_pages_total"]), int(stats["kv_pages_free"])
    return {"kv": total - free - cached, "adapter": 0, "cached": cached, "free": free}


def tokens_served(stats: dict[str, Any], base_name: str, limit: int = MODEL_SERIES_MAX):
    """[(model, prompt tokens, generated tokens)] from an engine stats() snapshot: the base model
    under `base_name`, then the `limit` loaded adapters served most tokens (ties by name)."""
    served = stats.get("tokens_served")
    if not served:
        return []
    adapters = sorted(served["adapters"].items(),
                      key=lambda kv: (-(kv[1]["prompt_tokens"] + kv[1]["generated_tokens"]), kv[0]))
    rows = [(base_name, served["base"])] + adapters[:limit]
    return [(name, int(t["prompt_tokens"]), int(t["generated_tokens"])) for name, t in rows]


class Metrics:
    """Counters updated by the request handlers; engine gauges filled from a stats() snapshot.
    `model_name`: the base model's name in the API (its label in the per-model series)."""

    def __init__(self, model_name: str = "base"):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.adapter_loads = Counter(f"{PREFIX}_adapter_loads", "Adapters loaded (startup and API)", registry=r)
        self.adapter_unloads = Counter(f"{PREFIX}_adapter_unloads", "Adapters unloaded through the API",
                                       registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to the first streamed token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.snapshot: dict[str, Any] = {}
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        r.register(_EngineCollector(self))

    def observe_engine(self, stats: dict[str, Any], now: Optional[float] = None) -> None:
        """Record a stats() snapshot (the tokens/s gauge averages over the last RATE_WINDOW_S)."""
        now = time.monotonic() if now is None else now
        self.snapshot = stats
        self._samples.append((now, int(stats.get("num_generated_tokens", 0))))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()

    def tokens_per_second(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the last engine snapshot (a custom collector: no state to keep in sync)."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        s = self.m.snapshot
        if not s:
            return
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_waiting", "Requests queued, not yet admitted",
                                value=s.get("waiting", 0))
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_running", "Requests admitted (prefilling or decoding)",
                                value=s.get("running", 0))
        pages = GaugeMetricFamily(f"{PREFIX}_pool_pages", "Pages of the unified KV/adapter pool by use",
                                  labels=["kind"])
        for kind, n in pool_pages(s).items():
            pages.add_metric([kind], n)
        yield pages
        yield GaugeMetricFamily(f"{PREFIX}_generation_tokens_per_second",
                                f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s",
                                value=self.m.tokens_per_second())
        adapters = GaugeMetricFamily(f"{PREFIX}_adapters", "LoRA adapters loaded / resident in the pool",
                                     labels=["state"])
        for state in ("loaded", "resident"):
            adapters.add_metric([state], len(s.get(f"adapters_{state}", ())))
        yield adapters
        if "adapter_evictions" in s:  # engines with LoRA
            yield CounterMetricFamily(f"{PREFIX}_adapter_evictions", "Idle adapters evicted from the pool for KV "
                                      "or other adapters", value=s["adapter_evictions"])
            yield CounterMetricFamily(f"{PREFIX}_adapter_page_ins", "Adapters copied into pool pages from their "
                                      "host copies after their load (paged back in, or loaded while the pool "
                                      "was busy)", value=s["adapter_page_ins"])
            yield from adapter_tier_metrics(s)
        rows = tokens_served(s, self.m.model_name)
        if rows:
            yield GaugeMetricFamily(f"{PREFIX}_fair_share", "1 when requests are admitted by fair share across "
                                    "adapters (virtual token counter), 0 first come first served",
                                    value=int(bool(s.get("fair_share"))))
            yield GaugeMetricFamily(f"{PREFIX}_max_loras", "The most adapters the running requests span at once "
                                    "(--max-loras; 0: no bound)", value=s.get("max_loras") or 0)
            served = CounterMetricFamily(
                f"{PREFIX}_model_tokens_served", "Tokens served per model (the base model and each loaded "
                f"adapter, at most {MODEL_SERIES_MAX} adapters: those served most), prompt tokens of admitted "
                "requests and generated tokens", labels=["model", "kind"])
            for name, prompt, generated in rows:
                served.add_metric([name, "prompt"], prompt)
                served.add_metric([name, "generated"], generated)
            yield served
        if s.get("forwards"):
            forwards = CounterMetricFamily(f"{PREFIX}_forwards", "Model forwards (engine steps) by compiled "
                                           "function: prefill / decode, _base for a LoRA model's batch without "
                                           "adapters, _fused where the batch's adapters fit the fused linears",
                                           labels=["function"])
            for name, n in sorted(s["forwards"].items()):
                forwards.add_metric([name], n)
            yield forwards
        yield from step_metrics(s)
        if s.get("prefix_caching"):
            yield from _scalars(s, (
                (CounterMetricFamily, "prefix_cache_queries", "prefix_cache_query_tokens",
                 "Prompt tokens looked up in the prefix cache"),
                (CounterMetricFamily, "prefix_cache_hits", "prefix_cache_hit_tokens",
                 "Prompt tokens found in the prefix cache (not computed)"),
                (GaugeMetricFamily, "prefix_cache_hit_rate", "prefix_cache_hit_rate",
                 "Prefix cache hit tokens / query tokens since start"),
                (GaugeMetricFamily, "prefix_cache_pages", "prefix_cache_pages",
                 "Pool pages keyed in the prefix cache (held by requests or idle)"),
                (CounterMetricFamily, "prefix_cache_evictions", "prefix_cache_evictions",
                 "Prefix cache pages evicted for room")))
        # everything else the engine reports, under its own name
        for k, v in sorted(s.items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield GaugeMetricFamily(f"{PREFIX}_engine_{k}", f"engine stats()['{k}']", value=v)


def _scalars(s: dict[str, Any], specs):
    """One unlabelled metric per (family, metric name, stats() key, help)."""
    for family, name, key, help_ in specs:
        yield family(f"{PREFIX}_{name}", help_, value=s[key])


def step_metrics(s: dict[str, Any]):
    """Where the engine's time goes, from a stats() snapshot: steps and their forward seconds by
    kind and size bucket (`decode_<=N`: N sequences, `prefill_<=N`: N tokens), the host seconds of
    the steps outside the forwards by part, and (LoRA engines) decode steps by the distinct
    adapters they hold, with the bytes of those adapters' pool pages they read."""
    times = s.get("step_times")
    if times is None:
        return
    steps = CounterMetricFamily(f"{PREFIX}_steps", "Engine steps by kind and size (decode: sequences, "
                                "prefill: tokens, up to the bucket's bound)", labels=["bucket"])
    seconds = CounterMetricFamily(f"{PREFIX}_step_seconds", "Seconds of the engine steps' forwards (with "
                                  "sampling) by kind and size", labels=["bucket"])
    for k, v in sorted(times.items()):
        steps.add_metric([k], v["steps"])
        seconds.add_metric([k], v["seconds"])
    yield steps
    yield seconds
    if "host_times" in s:
        host = CounterMetricFamily(f"{PREFIX}_step_host_seconds", "Seconds of the engine steps outside the "
                                   "forwards: adapters (their tiers before scheduling), schedule (with the "
                                   "page-ins it makes), outputs, wait_reads (waiting for adapter reads)",
                                   labels=["part"])
        for k, v in s["host_times"].items():
            host.add_metric([k], v)
        yield host
    by = s.get("decode_adapter_steps")
    if by:
        labels = ["adapters"]
        fams = (CounterMetricFamily(f"{PREFIX}_decode_adapter_steps", "Decode steps with adapters by the "
                                    "distinct adapters they hold (up to the bucket's bound)", labels=labels),
                CounterMetricFamily(f"{PREFIX}_decode_adapter_step_seconds", "Seconds of those decode steps",
                                    labels=labels),
                CounterMetricFamily(f"{PREFIX}_decode_adapter_step_bytes", "Bytes of the pool pages of those "
                                    "steps' adapters (what their LoRA kernels read)", labels=labels))
        for k, v in by.items():  # (fewest adapters first, as the engine lists them)
            for fam, key in zip(fams, ("steps", "seconds", "adapter_bytes")):
                fam.add_metric([k], v[key])
        yield from fams


def adapter_tier_metrics(s: dict[str, Any]):
    """The adapter tiers of an engine stats() snapshot (engine/adapters.py): where each request found
    its adapter, page-ins by prefetch, the host tier's bytes and the prefetch lead-time histogram."""
    hits = CounterMetricFamily(f"{PREFIX}_adapter_tier_hits", "Requests by the tier their adapter was found "
                               "in when they arrived (device: resident in the pool; host: its host copy, "
                               "paged in; disk: read again from its folder)", labels=["tier"])
    misses = CounterMetricFamily(f"{PREFIX}_adapter_tier_misses", "Requests whose adapter was not in this "
                                 "tier when they arrived (found in a lower one)", labels=["tier"])
    n = {tier: s[f"adapter_{tier}_hits"] for tier in ("device", "host", "disk")}
    for tier in n:
        hits.add_metric([tier], n[tier])
    misses.add_metric(["device"], n["host"] + n["disk"])
    misses.add_metric(["host"], n["disk"])
    yield hits
    yield misses
    yield from _scalars(s, (
        (CounterMetricFamily, "adapter_prefetch_page_ins", "adapter_prefetch_page_ins",
         "Adapters paged in ahead of their requests by prefetch"),
        (CounterMetricFamily, "adapter_disk_reads", "adapter_disk_reads",
         "Adapter folders read again after their host copy was dropped"),
        (CounterMetricFamily, "adapter_host_drops", "adapter_host_drops",
         "Adapter host copies dropped for the host tier's budget"),
        (GaugeMetricFamily, "adapter_host_bytes", "adapter_host_bytes", "Bytes of the adapters' host copies")))
    lead = s["adapter_prefetch_lead_seconds"]
    yield HistogramMetricFamily(f"{PREFIX}_adapter_prefetch_lead_seconds", "Seconds from an adapter's prefetch "
                                "page-in to the first step of the request it was prefetched for",
                                buckets=[(str(le), n) for le, n in lead["buckets"]], sum_value=lead["sum"])
