"""scripts/bench_lora_kernels.py without a GPU: the sweep and its parts, the roofline bytes, the
tables and charts of a result set, and the whole GPU path as a CPU dry run (a `compile --target
llvm` library of tiny shapes: every TIR kernel of ours checked against float64 and timed the same
way; a wrong kernel is caught before it is timed)."""

from __future__ import annotations

import json

import pytest

import bench_lora_kernels as bench


def test_the_sweep_covers_the_asked_points():
    pts = bench.sweep()
    # 2 dtypes x 3 shapes x 6 token counts x (4 adapter counts x ranks 8/16/64 + mixed at N = 4, 16, 64)
    assert len(pts) == 2 * 3 * 6 * (4 * 3 + 3) == 540
    assert len(set(pts)) == len(pts)
    assert {p.dtype for p in pts} == {"float16", "bfloat16"} and {p.T for p in pts} == set(bench.TOKENS)
    assert not [p for p in pts if p.r == bench.MIXED and p.N < 4]
    assert [p.R for p in bench.sweep(adapters=[4], tokens=[1], shapes=[(4096, 4096)], dtypes=["float16"])] == [8, 16, 64, 64]
    mixed = bench.Point(4096, 4096, 16, 16, bench.MIXED, "float16")
    assert mixed.ranks == [8, 16, 32, 64] * 4 and mixed.R == 64
    assert pts[0].seed == bench.Point(*[getattr(pts[0], f) for f in ("in_f", "out_f", "T", "N", "r", "dtype")]).seed


def test_parts_split_the_selection_in_order_by_time():
    pts = bench.sweep()
    parts = bench.split_parts(pts, 6)
    assert [p for part in parts for p in part] == pts
    est = [sum(bench.estimate_s(p) for p in part) for part in parts]
    assert max(est) < 1.5 * min(est)


def test_roofline_bytes():
    p = bench.Point(4096, 11008, 64, 4, bench.MIXED, "bfloat16")
    # x read, y read + write, A and B^T rows of the adapters used (slots 0 and 3: ranks 8 and 64)
    assert bench.min_bytes(p, [0, 3]) == 2 * (64 * 4096 + 2 * 64 * 11008 + (8 + 64) * (4096 + 11008))


def fake_rows():
    lin = dict(mode="linear", shape="4096x4096", in_f=4096, out_f=4096, T=64, N=16, r=16, R=16, dtype="float16",
               grouped=False, roof_us=10.0, us={"base": 12.0, "gather": 30.0, "sgmv-tir": 20.0, "sgmv-cuda": 16.0,
                                                 "vllm": 8.0, "sglang": 10.0},
               err={"gather": 1e-3, "sgmv-tir": 1e-3, "sgmv-cuda": 2e-3, "vllm": 3e-3, "sglang": 3e-3},
               status={n: "ok" for n in bench.BACKENDS})
    lin2 = dict(lin, T=256, us=dict(lin["us"], **{"sgmv-cuda": 9.0}))
    mixed = dict(lin, r="mixed", R=64, us={"base": 12.0, "gather": 30.0, "sgmv-tir": 25.0, "sgmv-cuda": 18.0},
                 status=dict(lin["status"], vllm="skip: mixed ranks: ours only", sglang="skip: mixed ranks: ours only"),
                 err={"gather": 1e-3, "sgmv-tir": 1e-3, "sgmv-cuda": 1e-3})
    lay = dict(mode="layer", dtype="bfloat16", T=16, N=4, r=8, R=8,
               us={"base": 100.0, "sgmv-tir": 190.0, "sgmv-cuda": 150.0, "vllm": 140.0, "sglang": 160.0},
               err={"sgmv-tir": 4e-3, "sgmv-cuda": 4e-3, "vllm": 5e-3, "sglang": 5e-3},
               status={n: "ok" for n in bench.BACKENDS})
    return [lin, lin2, mixed, lay]


def test_summary_table_and_chart_of_a_result_set(tmp_path, capsys):
    lin, lin2, mixed, lay = fake_rows()
    s = bench.summary(lin)
    assert s["ours"] == ("sgmv-cuda", 16.0) and s["peers"] == ("vllm", 8.0)
    assert s["ours_over_peers"] == 2.0 and s["ours_over_base"] == pytest.approx(16 / 12)
    assert s["ours_roof"] == pytest.approx(10 / 16) and s["peers_roof"] == pytest.approx(10 / 8)
    assert bench.summary(mixed)["peers"][0] is None
    sl = bench.summary(lay)  # layer rows: the LoRA's cost is the time over the base GEMMs
    assert sl["lora_us"] == {"sgmv-tir": 90.0, "sgmv-cuda": 50.0, "vllm": 40.0, "sglang": 60.0}
    assert sl["ours_over_peers"] == 50 / 40
    text = bench.table([lin, lin2, mixed, lay])
    rows = text.splitlines()
    # sgmv-triton: not in these results ("-")
    assert rows[2].startswith("| 4096x4096 | f16 | 64 | 16 | 16 | 16 | 12.0 | 30.0 | 20.0 | 16.0 | - | 8.0 | 10.0 | 2.00 | 1.33 "
                              "| 62 | 125 |")
    assert "| 4096x4096 | f16 | 64 | 16 | mixed | 64 |" in text and "| - | - | - | - | 1.50 |" in text
    assert "| bf16 | 16 | 4 | 8 | 8 | 100.0 | 90.0 (0.90) | 50.0 (0.50) | - | 40.0 (0.40) | 60.0 (0.60) | 1.25 |" in text
    assert "ours sgmv-cuda / best peer vllm = 2.00" in bench.line(lin)

    res = tmp_path / "res.json"
    res.write_text(json.dumps({"mode": "mixed", "rows": [lin, lin2, mixed, lay]}))
    assert bench.main(["plot", str(res), "--out", str(tmp_path / "k.svg")]) == 0
    assert "| 4096x4096 | f16 | 256 |" in capsys.readouterr().out
    assert (tmp_path / "k.svg").stat().st_size > 5000 and (tmp_path / "k_layer.svg").stat().st_size > 5000


@pytest.fixture(scope="module")
def dry_lib(tmp_path_factory):
    lib = tmp_path_factory.mktemp("lora_k") / "k.so"
    assert bench.main(["compile", "--target", "llvm", "--out", str(lib)]) == 0
    return lib


def test_dry_run_checks_and_times_every_cpu_backend(dry_lib, tmp_path):
    assert bench.main(["run", "--lib", str(dry_lib), "--dry-run", "--no-peers", "--log-dir", str(tmp_path),
                       "--tokens", "1,17", "--adapters", "4", "--ranks", "8,mixed"]) == 0
    doc = json.loads((tmp_path / "bench_lora_kernels.json").read_text())
    assert doc["complete"] and doc["machine"]["python"] and "--dry-run" in doc["command"]
    rows = doc["rows"]
    assert [(r["shape"], r["T"], r["r"]) for r in rows] == [
        (s, t, r) for s in ("64x96", "96x64") for r in (8, "mixed") for t in (1, 17)]
    for r in rows:
        assert r["status"]["gather"] == r["status"]["sgmv-tir"] == "ok"
        assert r["status"]["sgmv-cuda"] == r["status"]["sgmv-triton"] == "skip: CUDA only"
        assert r["status"]["vllm"] == r["status"]["sglang"] == "skip: no peers"
        assert max(r["err"].values()) < 1e-3  # fp16 kernels against float64
        assert set(r["us"]) == {"base", "gather", "sgmv-tir"} and min(r["us"].values()) > 0
        assert 1 <= r["touched"] <= min(4, r["T"]) and r["roof_us"] == pytest.approx(r["bytes"] / bench.PEAK_BW * 1e6)
    assert (tmp_path / "bench_lora_kernels.log").read_text().count("; rel err ") == len(rows)


def test_dry_run_of_the_layer(dry_lib, tmp_path):
    assert bench.main(["layer", "--lib", str(dry_lib), "--dry-run", "--no-peers", "--log-dir", str(tmp_path),
                       "--tokens", "5"]) == 0
    rows = json.loads((tmp_path / "bench_lora_layer.json").read_text())["rows"]
    assert [(r["N"], r["r"]) for r in rows] == bench.LAYER_ADAPTERS
    for r in rows:
        assert r["status"]["sgmv-tir"] == "ok" and r["err"]["sgmv-tir"] < 2e-3
        assert "gather" not in r["us"] and r["status"]["gather"] == "skip: not in this mode"


def test_a_wrong_kernel_is_caught_before_timing(dry_lib, tmp_path, monkeypatch):
    def doubled(pb):  # the TIR sgmv with its delta doubled: scale applied twice
        call = bench._sgmv_tir(pb)  # pylint: disable=protected-access

        def wrong(c):
            call(c)
            pb.y[c].mul_(2)
        return wrong

    backends = dict(bench.BACKENDS, **{"twice": bench.Backend("ours", doubled)})
    monkeypatch.setattr(bench, "BACKENDS", backends)
    assert bench.main(["run", "--lib", str(dry_lib), "--dry-run", "--no-peers", "--log-dir", str(tmp_path),
                       "--shapes", "64x96", "--tokens", "5", "--adapters", "4", "--ranks", "16"]) == 0
    (row,) = json.loads((tmp_path / "bench_lora_kernels.json").read_text())["rows"]
    assert row["status"]["twice"] == "FAIL" and row["err"]["twice"] == pytest.approx(1.0, rel=1e-2)
    assert "twice" not in row["us"] and row["status"]["sgmv-tir"] == "ok"


def test_the_triton_stage_gets_the_pools_token_order():
    import numpy as np
    import torch

    from mlc_lora.compiler_passes.ops.lora.reference import sort_tokens_ref

    slot = np.array([3, 0, 3, 1, 0, 3, 2], np.int32)
    order, start = bench._sorted_tables(torch, torch.from_numpy(slot), 5, "cpu")  # pylint: disable=protected-access
    want = sort_tokens_ref(slot, 5)
    assert order.tolist() == want[0].tolist() == [1, 4, 3, 6, 0, 2, 5]
    assert start.tolist() == want[1].tolist() == [0, 2, 3, 4, 7, 7]


def test_run_takes_the_ranks_the_library_was_built_for(tmp_path, monkeypatch):
    """A library of `compile --compiled-ranks 8,64` runs a rank-16 point on its rank-64 kernels, and
    the run says so (R = 64), rather than looking for rank-16 kernels it does not have."""
    lib = tmp_path / "k.so"
    assert bench.main(["compile", "--target", "llvm", "--out", str(lib), "--compiled-ranks", "8,64"]) == 0
    monkeypatch.setattr(bench, "COMPILED_RANKS", bench.COMPILED_RANKS)  # main sets it; restored after the test
    assert bench.main(["run", "--lib", str(lib), "--dry-run", "--no-peers", "--log-dir", str(tmp_path),
                       "--tokens", "1", "--adapters", "4", "--ranks", "16", "--compiled-ranks", "8,64"]) == 0
    rows = json.loads((tmp_path / "bench_lora_kernels.json").read_text())["rows"]
    assert rows and all(r["R"] == 64 and r["status"]["sgmv-tir"] == "ok" and r["err"]["sgmv-tir"] < 1e-3 for r in rows)


def test_triton_jit_configurations_are_checked_and_timed(dry_lib, tmp_path):
    """--triton-jit: the Triton stage 3 JIT-compiled with the model's variants, with a given tile
    configuration and over int8 rows, here under Triton's interpreter (set before triton is imported: a process of its
    own), each checked against float64 before it is timed beside the library's kernels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    code = ("import sys\n"
            "from tests.python.compiler.ops.lora.triton_interp import _interpreter_scalars\n"
            "_interpreter_scalars()\n"
            "import bench_lora_kernels as bench\n"
            f"sys.exit(bench.main(['run', '--lib', {str(dry_lib)!r}, '--dry-run', '--no-peers', '--log-dir', "
            f"{str(tmp_path)!r}, '--shapes', '64x96', '--tokens', '5,17', '--adapters', '4', '--ranks', 'mixed', "
            "'--triton-jit', 'model,few=16/2/32/2/4/2/2,int8']))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "scripts"), str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_lora_kernels.json").read_text())["rows"]
    assert [r["T"] for r in rows] == [5, 17]
    for r in rows:
        for name in ("triton-jit-model", "triton-jit-few"):
            assert r["status"][name] == "ok" and r["err"][name] < 2e-3 and r["us"][name] > 0
        # int8 rows: the rows' rounding (1/254 of a row's largest value a step), well inside the check
        assert r["status"]["triton-jit-int8"] == "ok" and 1e-4 < r["err"]["triton-jit-int8"] < 2e-2
    with pytest.raises(SystemExit, match="BM/SPLITS/BN/G/WARPS/STAGES"):
        bench.parse_triton_jit("bad=16/2")
    assert bench.parse_triton_jit("a=16/8/64/4/4/3,model") == {
        "triton-jit-a": dict(BM=16, SPLITS=8, BN=64, G=4, num_warps=4, num_stages=3, RSPLIT=1),
        "triton-jit-model": None}
    assert bench.parse_triton_jit("b=16/8/128/4/4/3/1/128") == {
        "triton-jit-b": dict(BM=16, SPLITS=8, BN=128, G=4, num_warps=4, num_stages=3, RSPLIT=1, BK=128)}
    assert bench.parse_triton_jit("c=16/8/128/4/4/3/1/128/8/1,d=16/8/128/4/4/3/1/64/0/2") == {
        "triton-jit-c": dict(BM=16, SPLITS=8, BN=128, G=4, num_warps=4, num_stages=3, RSPLIT=1, BK=128, MIN_STEPS=8,
                             GMIN=1),
        "triton-jit-d": dict(BM=16, SPLITS=8, BN=128, G=4, num_warps=4, num_stages=3, RSPLIT=1, BK=64, GMIN=2)}
    with pytest.raises(SystemExit, match="RSPLIT"):
        bench.parse_triton_jit("e=16/8/128/4/4/3/1/128/8/1/9")
