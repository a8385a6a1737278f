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


def test_stacked_bars_hold_each_part(tmp_path):
    """A part adds one bar per label (and its legend entry); its name is in the legend."""
    labels = ["5\nuniform", "1000\nuniform"]
    parts = {"prefill": [1.0, 2.0], "decode": [3.0, 9.0], "other": [0.5, 0.25]}

    def patches(ps, name):
        text = plot.stacked(labels, ps, tmp_path / name, title="t", ylabel="seconds").read_text()
        assert "<svg" in text and all(p in text for p in ps)
        return text.count('<g id="patch_')

    three, two = patches(parts, "s3.svg"), patches(dict(list(parts.items())[:2]), "s2.svg")
    assert three - two == len(labels) + 1
