"""scripts/harness/plot.py writes the charts it is asked for (SVG and PNG by suffix)."""

from __future__ import annotations

import pytest

from harness import plot

pytest.importorskip("matplotlib")


def test_bars_and_lines_write_svg_and_png(tmp_path):
    svg = plot.bars(["base", "lora4"], [2.0, 1.5], tmp_path / "b.svg", title="t", ylabel="req/s",
                    notes=["2.00", "1.50 (0.75x)"])
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 5000
    png = plot.lines({"4096x4096 fp16": {"N=16 r=16": ([1, 16, 256], [1.2, 0.9, 1.5])},
                      "4096x4096 bf16": {"N=16 r=16": ([1, 16, 256], [1.1, 1.0, 1.4])}},
                     tmp_path / "l.png", title="ours / peers", xlabel="T", ylabel="ratio", hline=1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
