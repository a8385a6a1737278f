"""scripts/bench_adapters.py end to end on CPU at its smallest scale: prepare -> compile --smoke
--target llvm -> run --smoke --device cpu (every section: adapters written to disk as PEFT folders
and read back by the engine, Poisson arrivals, the on/off comparisons), then the charts and the
table from the JSON. No thresholds: the JSON must hold every section, each with its runs or the
reason it was skipped (an engine option this build lacks), and every request must be served."""

from __future__ import annotations

import json

import pytest

import bench_adapters as bench

# the option each section compares, where the engine must have it for the section to run
NEEDS = {"prefetch": "prefetch_adapters", "prefix": "enable_prefix_caching", "fairness": "fair_share"}


def test_adapters_bench_smoke_runs_every_section_on_cpu(tmp_path, capsys):
    def conv(i):
        return {"conversations": [{"from": "human", "value": f"question {i} " + "word " * (5 + i)},
                                  {"from": "gpt", "value": "answer " * (4 + i)}]}

    (tmp_path / "sg.json").write_text(json.dumps([conv(i) for i in range(14)]))
    req = tmp_path / "req.npz"
    assert bench.main(["prepare", "--out", str(req), "--num-prompts", "12",
                       "--sharegpt", str(tmp_path / "sg.json")]) == 0
    assert bench.main(["compile", "--smoke", "--target", "llvm", "--out", str(tmp_path / "libs")]) == 0
    out = tmp_path / "res.json"
    adapters = tmp_path / "adapters"
    assert bench.main(["run", "--smoke", "--device", "cpu", "--lib-dir", str(tmp_path / "libs"), "--requests",
                       str(req), "--adapter-dir", str(adapters), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # the table comes last: its rows, the throughput ratios and what was skipped
    tail = printed[printed.rindex("| section | run | req/s |"):].rstrip().splitlines()
    assert all(line.startswith(("|",) + bench.SECTIONS) for line in tail), tail
    assert any(line.startswith("| scale | 8 adapters, uniform |") for line in tail)

    doc = json.loads(out.read_text())
    assert doc["machine"]["python"] and doc["command"].startswith("python")
    secs = doc["sections"]
    assert list(secs) == list(bench.SECTIONS)
    options = set(doc["engine_options"])
    assert options == bench.engine_options()
    for name, option in NEEDS.items():
        if option in options:
            assert [r[option] for r in secs[name]["runs"]] == [False, True], name
        else:
            assert option in secs[name]["skipped"] and "runs" not in secs[name], name
    n = len(bench.load_requests(req))
    scale = secs["scale"]
    assert scale["adapter_counts"] == [2, 4, 8] and scale["skipped_counts"] == []
    assert [(r["adapters"], r["popularity"]) for r in scale["runs"]] == [
        (c, p) for c in (2, 4, 8) for p in ("uniform", "zipf")]
    assert [r["throughput_vs_fewest"] for r in scale["runs"][:2]] == [1.0, 1.0]
    assert scale["runs"][-1]["ranks"] == [8, 16, 32, 64]
    # the 8 adapters (130 pages) do not fit the 128-page pool beside their KV: they were paged in turn
    assert sum(r["engine"]["adapter_page_ins"] for r in scale["runs"][-2:]) > 0
    runs = [r for s in secs.values() for r in s.get("runs", [])]
    for r in runs:
        m = r["metrics"]
        assert m["completed"] == r["requests"] and m["failed"] == 0, r["label"]
        assert m["request_throughput"] > 0 and m["p99_ttft_ms"] >= m["p50_ttft_ms"] > 0
    assert all(r["requests"] == n for r in scale["runs"])
    # where each run's time went: the engine's parts lie inside the run's wall time; the decode
    # steps with adapters (all of a scale run's requests have one) read some adapter pages
    for r in runs:
        sec = r["time"]["seconds"]
        assert set(sec) == {"prefill", "decode", "adapters", "schedule", "outputs", "wait_reads", "other"}
        assert sec["prefill"] > 0 and sec["decode"] > 0 and min(sec.values()) > -0.05 * r["metrics"]["duration"], r["label"]
    for r in scale["runs"]:
        by = r["time"]["decode_by_adapters"]
        assert by and all(v["steps"] > 0 and v["sequences_per_step"] >= 1 and v["adapter_gb_per_step"] > 0
                          for v in by.values()), r["label"]
        assert max(int(k[2:]) for k in by) <= 2 * r["adapters"]
    assert "decode steps with <=" in printed
    if "fair_share" in options:
        fair = secs["fairness"]
        for r in fair["runs"]:
            assert r["tenants"]["light"]["completed"] == fair["light_requests"] >= 4
            assert r["tenants"]["heavy"]["completed"] == fair["heavy_requests"] == n
            served = r["tokens_served"]["adapters"]
            assert served["tenant-light"]["generated_tokens"] >= r["tenants"]["light"]["total_output"]
    # each adapter's folder holds hard links to one of the weight sets written per rank
    folders = sorted(p.name for p in (adapters / "adapters").iterdir())
    assert len(folders) >= 8 and len(list((adapters / "weights").iterdir())) == 2 * len(bench.RANKS)
    assert (tmp_path / "res-throughput.png").stat().st_size > 0
    assert (tmp_path / "res-time.png").stat().st_size > 0

    # `plot` redraws the charts and prints the table from the JSON; `--append` keeps other sections
    (tmp_path / "res-throughput.png").unlink()
    assert bench.main(["plot", str(out)]) == 0
    assert (tmp_path / "res-throughput.png").stat().st_size > 0
    assert "| scale | 8 adapters, zipf |" in capsys.readouterr().out
    assert bench.main(["run", "--smoke", "--device", "cpu", "--lib-dir", str(tmp_path / "libs"), "--requests",
                       str(req), "--sections", "prefix", "--out", str(out), "--append"]) == 0
    again = json.loads(out.read_text())["sections"]
    assert list(again) == list(bench.SECTIONS) and again["scale"] == scale


def test_time_split_against_hand_made_stats():
    """time_split's arithmetic on two engine stats written by hand (the differences over the run)."""
    before = dict(step_times={"prefill_<=512": dict(steps=2, seconds=1.0), "decode_<=4": dict(steps=5, seconds=0.5)},
                  host_times=dict(adapters=0.1, schedule=0.2, outputs=0.3, wait_reads=0.0),
                  decode_adapter_steps={"<=2": dict(steps=5, seconds=0.5, sequences=15, adapter_bytes=10 ** 9)})
    after = dict(step_times={"prefill_<=512": dict(steps=4, seconds=3.0), "prefill_<=64": dict(steps=1, seconds=0.25),
                             "decode_<=4": dict(steps=9, seconds=1.5), "decode_<=16": dict(steps=2, seconds=1.0)},
                 host_times=dict(adapters=0.6, schedule=0.7, outputs=0.8, wait_reads=0.25),
                 decode_adapter_steps={"<=2": dict(steps=9, seconds=1.5, sequences=27, adapter_bytes=3 * 10 ** 9),
                                       "<=16": dict(steps=2, seconds=1.0, sequences=24, adapter_bytes=4 * 10 ** 9)})
    split = bench.time_split(before, after, 10.0)
    assert split["seconds"] == pytest.approx(dict(prefill=2.25, decode=2.0, adapters=0.5, schedule=0.5, outputs=0.5,
                                                  wait_reads=0.25, other=4.0))
    by = split["decode_by_adapters"]
    assert list(by) == ["<=2", "<=16"]
    assert by["<=2"] == pytest.approx(dict(steps=4, ms_per_step=250.0, sequences_per_step=3.0,
                                           adapter_gb_per_step=0.5, adapter_gb_per_s=2.0))
    assert by["<=16"] == pytest.approx(dict(steps=2, ms_per_step=500.0, sequences_per_step=12.0,
                                            adapter_gb_per_step=2.0, adapter_gb_per_s=4.0))
    assert bench.time_split({}, dict(step_times={}), 1.0) is None  # an engine without these stats
    lines = bench.time_lines("run", split)
    assert lines[0].startswith("run: time prefill 2.2 s, decode 2.0 s") and "other 4.0 s" in lines[0]
    assert "decode steps with <=16 adapters: 2, 500.0 ms, 12 sequences, 2.00 GB" in lines[2]
