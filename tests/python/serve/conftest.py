"""A real `mlc_lora serve` process on a free loopback port, and the references the tests compare to."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ..engine.conftest import make_chat_model, tiny_chat, tiny_chat_hf  # noqa: F401  (the tiny chat model, reused)

API_KEY = "sk-test-mlc-lora"
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(model_dir, *args: str):
    """Start `mlc_lora serve MODEL_DIR ARGS` and wait for /health; yields the base URL."""
    with start_server(model_dir, *args) as (url, _):
        yield url


@contextlib.contextmanager
def start_server(model_dir, *args: str):
    """As run_server, yielding (base URL, the server's Popen)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlc_lora.cli.main", "serve", str(model_dir), "--port", str(port),
           "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s")
            time.sleep(0.3)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{label="v"}': value} (parsed with prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(url: str, timeout_s: float = 60) -> dict[str, float]:
    """Metrics once no request is queued or running (aborts are processed between engine steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        if m["mlc_lora_num_requests_running"] == 0 and m["mlc_lora_num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"requests still running after {timeout_s} s: {m}")
        time.sleep(0.2)


def greedy_reference(model, prompt_ids: list[int], n: int, eos: set[int] = frozenset()):
    """Greedy tokens and their logprobs from a torch causal LM, one full forward per step."""
    import torch

    ids, lps = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(lp.argmax())
            ids.append(t)
            lps.append(float(lp[t]))
            if t in eos:
                break
    return ids[len(prompt_ids):], lps
