"""`mlc_lora serve --fair-share --max-loras N`: the flags reach the engine, and /metrics counts the
tokens served per model (the base model under its served name)."""

from __future__ import annotations

import httpx

from .conftest import run_server, scrape, tiny_chat, wait_idle  # noqa: F401  (tiny_chat: a fixture)


def test_fair_share_flag_and_tokens_served_per_model(tiny_chat):  # noqa: F811
    with run_server(tiny_chat[1], "--served-model-name", "tiny", "--fair-share", "--max-loras", "2") as url:
        for n in (3, 5):
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": n,
                                                           "ignore_eos": True, "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
        m = wait_idle(url)
    assert m["mlc_lora_fair_share"] == 1 and m["mlc_lora_max_loras"] == 2
    assert m['mlc_lora_model_tokens_served_total{kind="generated",model="tiny"}'] == 3 + 5
    assert m['mlc_lora_model_tokens_served_total{kind="prompt",model="tiny"}'] == 4 + 4
