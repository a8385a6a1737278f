"""scripts/bench_lora_fused.py's GPU modes run on the CPU (gpu_bench_on_cpu.py: the kernels under
Triton's interpreter, small linears, no timing): every candidate's LoRA delta passes the
benchmark's own check against float64, and the results file holds every linear and token count
(marked complete)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("mode,tokens,linears", [("producers", "70", "qkv,o,down"), ("routes", "16,70", "o,down"),
                                                 ("tune", "70", "down")])
def test_gpu_modes_run_their_checks_on_cpu(tmp_path, mode, tokens, linears):
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.python.scripts.gpu_bench_on_cpu", mode, "--tokens", tokens,
                           "--linears", linears, "--dtype", "float16", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc[mode]
    assert doc["complete"] is True  # (written after every point with False, so that a run cut short keeps them)
    want = {(n, int(t)) for n in linears.split(",") for t in tokens.split(",")}
    assert {(r["linear"], r["T"]) for r in rows} == want
    if mode == "producers":  # the route with x in place, the pair and base, per linear
        assert all({"base", "pair", "route·in place", "route·copy"} <= set(r["us"]) for r in rows)
