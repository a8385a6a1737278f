"""scripts/bench_engine_host.py end to end on a few requests: it builds its tiny model, runs
whole and streamed requests (with and without adapters) and reports the host time per step by part."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_engine_host.py"


def test_bench_engine_host_runs_and_reports_each_part(tmp_path):
    out = {}
    for mode in ([], ["--stream"]):
        r = subprocess.run([sys.executable, str(SCRIPT), "--requests", "6", "--out-len", "3", "6", "--adapters", "1",
                            "--tokenizer", "none", "--repeat", "1", "--parts", "--workdir", str(tmp_path), *mode],
                           capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        out[bool(mode)] = r.stdout
    for stdout in out.values():
        m = re.search(r"6 requests \((\d+) output tokens, 1 adapters, tokenizer none, (\w+)\), best of 1: per step "
                      r"(-?[\d.]+) ms outside the forward \(wall\), host CPU ([\d.]+) ms engine thread \+ ([\d.]+) ms "
                      r"asyncio thread \((\d+) steps", stdout)
        assert m, stdout
        tokens, steps = int(m.group(1)), int(m.group(6))
        assert 18 <= tokens <= 36 and 3 <= steps <= tokens  # 3..6 tokens each; a step per token of the longest
        assert float(m.group(4)) > 0 and float(m.group(5)) > 0
        assert re.search(r"append [\d.]+ \(emit [\d.]+, detokenize 0\.00\)", stdout), stdout  # no tokenizer: no detok
    assert "whole)" in out[False] and "stream)" in out[True]


def test_bench_engine_host_base_model(tmp_path):
    """--base: the model compiled without LoRA serves the same requests (no adapter allowed)."""
    args = [sys.executable, str(SCRIPT), "--requests", "4", "--out-len", "3", "4", "--tokenizer", "none",
            "--repeat", "1", "--workdir", str(tmp_path), "--base"]
    r = subprocess.run(args + ["--adapters", "0"], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"4 requests \((1[2-6]) output tokens, 0 adapters", r.stdout), r.stdout
    assert (tmp_path / "none-base").is_dir() and not (tmp_path / "none").exists()
    bad = subprocess.run(args + ["--adapters", "1"], capture_output=True, text=True, timeout=600, check=False)
    assert bad.returncode != 0 and "--adapters 0" in bad.stderr


def test_bench_engine_host_tables(tmp_path):
    """--tables: begin_forward with the batch's LoRA tables, timed by distinct adapters."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--tables", "--tables-seqs", "8", "--max-rank", "16",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = re.findall(r"decode of 8 sequences over +(\d+) distinct adapters \(max rank 16\): begin_forward \+ "
                        r"tables (\d+) us", r.stdout)
    assert [int(c) for c, _ in counts] == [1, 4, 8] and all(int(us) > 0 for _, us in counts), r.stdout
