"""`mlc_lora serve --enable-prefix-caching`: a repeated prompt hits the prefix cache with the same
greedy output, and /metrics reports the queries, hits, hit rate, cached pages and evictions."""

from __future__ import annotations

import httpx

from mlc_lora.contract import PAGE_SIZE

from .conftest import run_server, scrape


def test_prefix_cache_metrics(tiny_chat):
    prompt = [(5 * i + 7) % 300 for i in range(3 * PAGE_SIZE + 4)]  # 3 full pages + 4 tokens
    with run_server(tiny_chat[1], "--enable-prefix-caching") as url:
        outs = []
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["text"])
        m = scrape(url)
    assert outs[0] == outs[1]
    assert m["mlc_lora_prefix_cache_queries_total"] == 2 * len(prompt)
    assert m["mlc_lora_prefix_cache_hits_total"] == 3 * PAGE_SIZE
    assert m["mlc_lora_prefix_cache_hit_rate"] == (3 * PAGE_SIZE) / (2 * len(prompt))
    assert m["mlc_lora_prefix_cache_pages"] == 3 and m["mlc_lora_prefix_cache_evictions_total"] == 0
    # the cached pages no request holds are a kind of their own; the kinds add up to the pool
    kinds = {k: m[f'mlc_lora_pool_pages{{kind="{k}"}}'] for k in ("kv", "adapter", "cached", "free")}
    assert kinds == {"kv": 0, "adapter": 0, "cached": 3, "free": m["mlc_lora_engine_kv_pages_total"] - 3}
    # the engine's forwards by compiled function (a model without LoRA): one prefill a request (its prompt
    # fits one chunk), then a decode for each of its 3 tokens after the first
    assert m['mlc_lora_forwards_total{function="prefill"}'] == 2
    assert m['mlc_lora_forwards_total{function="decode"}'] == 2 * 3
    # the same steps by kind and size (the prompt's 52 tokens, then its 4 past the cached pages;
    # decodes of one sequence), timed; the host time outside the forwards by part; no decode
    # steps with adapters (no LoRA)
    assert m['mlc_lora_steps_total{bucket="prefill_<=64"}'] == 1 == m['mlc_lora_steps_total{bucket="prefill_<=4"}']
    assert m['mlc_lora_steps_total{bucket="decode_<=1"}'] == 6
    assert m['mlc_lora_step_seconds_total{bucket="prefill_<=64"}'] > 0 < m['mlc_lora_step_seconds_total{bucket="decode_<=1"}']
    assert m['mlc_lora_step_host_seconds_total{part="schedule"}'] > 0
    assert {k for k in m if k.startswith("mlc_lora_step_host_seconds_total")} == {
        f'mlc_lora_step_host_seconds_total{{part="{p}"}}' for p in ("adapters", "schedule", "outputs", "wait_reads")}
    assert not any(k.startswith("mlc_lora_decode_adapter_steps") for k in m)
