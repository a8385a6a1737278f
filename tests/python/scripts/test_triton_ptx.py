"""scripts/triton_ptx.py: the stage-3 kernels' PTX instruction counts, built here for sm_90a."""

import pytest

import triton_ptx


def test_prints_a_row_per_kernel_variant_and_format(capsys):
    pytest.importorskip("triton")
    assert triton_ptx.main(["--variants", "small", "--rows", "model,int8"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| shrink") or l.startswith("| expand")]
    assert [l.split(" | ")[:3] for l in lines] == [["| shrink", "small", "model"], ["| shrink", "small", "int8"],
                                                   ["| expand", "small", "model"], ["| expand", "small", "int8"]]
    mma = list(triton_ptx.COUNTS).index("mma") + 3
    assert all(int(l.strip("| ").split(" | ")[mma]) > 0 for l in lines)  # every kernel multiplies on tensor cores
