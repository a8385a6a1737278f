"""`mlc_lora serve` logs what it loads (compiled folder, library, weights, LoRA, pool) at --log-level."""

from __future__ import annotations

import logging

import pytest

from mlc_lora.serve import run


@pytest.mark.slow
def test_serve_logs_what_it_loads(tiny_chat, monkeypatch, capfd):
    import uvicorn

    _, compiled = tiny_chat
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(kw))
    logging.getLogger("mlc_lora").handlers.clear()  # a fresh handler on this test's stderr
    run.serve(compiled, port=8123, log_level="info", max_num_seqs=3)
    err = capfd.readouterr().err
    assert served["port"] == 8123 and served["log_level"] == "info"
    for text in (f"loading {compiled} on cpu", f"compiled folder {compiled} (llvm, float32, 1 shard(s))",
                 f"compiled library {compiled}/lib.", f"weights {compiled}/", "LoRA: off",
                 "(KV cache), up to 3 sequences", "loading adapters through the API is off", "ready in"):
        assert text in err, f"{text!r} not in the log:\n{err}"
    assert " INFO mlc_lora.serve: " in err
    # a higher level silences them
    run.serve(compiled, log_level="warning")
    assert "mlc_lora.serve" not in capfd.readouterr().err
