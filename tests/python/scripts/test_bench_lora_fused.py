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


@pytest.mark.parametrize("mode,tokens,linears,extra", [("producers", "70", "qkv,o,down", []),
                                                       ("routes", "16,70", "o,down", []),
                                                       ("tune", "70", "down", []),
                                                       ("tune", "40", "down", ["--shapes", "tma"])])
def test_gpu_modes_run_their_checks_on_cpu(tmp_path, mode, tokens, linears, extra):
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.python.scripts.gpu_bench_on_cpu", mode, "--tokens", tokens,
                           "--linears", linears, "--dtype", "float16", "--out", str(out), *extra], cwd=ROOT,
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
    if extra:  # the TMA GEMM's launches that matched cuBLAS's y, beside it and the compiled linear
        assert all(r["kind"] == "gemm" and r["compiled"] == "cublas" and "compiled linear, no adapter" in r["us"]
                   and sum(k.startswith("tma ") for k in r["us"]) >= 3 for r in rows)


@pytest.mark.parametrize("T", [16, 32, 64])
def test_tune_shapes_start_with_the_compiled_tier_and_fit_the_linear(T):
    """tune's one-kernel linear shapes (no kernel run): the library's own shape for T's token tier
    first, no shape twice, every shape fits the Llama-2-7B linear, the block heights past 16 tokens
    and the transposed products among them."""
    import types

    import bench_lora_fused as bench
    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT

    for in_f, widths in ((4096, (4096,)), (11008, (4096,)), (4096, (4096,) * 3), (4096, (11008,) * 2)):
        pt = types.SimpleNamespace(in_f=in_f, widths=widths, mod_ids=tuple(range(len(widths))), r=8, T=T)
        cfgs = bench._linear_configs(LT, pt)  # pylint: disable=protected-access
        assert cfgs[0] == LT.constants(in_f, widths, pt.mod_ids, len(widths), 8, LT.token_tier(T), 8)
        assert len({(tuple(sorted(c.items())), w) for c, w in cfgs}) == len(cfgs)
        for c, _ in cfgs:
            assert all(x % c["BN"] == 0 for x in widths) and in_f % c["BK"] == 0 and in_f // c["BK"] >= c["SPLIT"]
        assert {c["BM"] for c, _ in cfgs[1:]} == ({16} if T <= 16 else {16, 32, 64} if T <= 32 else {32, 64})
        assert any(c["SWAP"] for c, _ in cfgs) and any(not c["SWAP"] for c, _ in cfgs)
