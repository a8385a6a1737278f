"""scripts/bench_lora_throughput.py end to end on CPU: prepare -> compile --smoke --target llvm ->
run --smoke --device cpu (the LoRA library's logits checked against harness/torch_llama.py, then
base, 4 adapters, 64 adapters through AsyncMLCEngine), the merge of split runs, and
bench_lora_steps.py's step timing on the same libraries."""

from __future__ import annotations

import json

import pytest

import bench_lora_throughput as bench


def test_lora_bench_smoke_runs_end_to_end_on_cpu(tmp_path, capsys, monkeypatch):
    def conv(i):
        return {"conversations": [{"from": "human", "value": f"question {i} " + "word " * (5 + i)},
                                  {"from": "gpt", "value": "answer " * (4 + i)}]}

    (tmp_path / "sg.json").write_text(json.dumps([conv(i) for i in range(6)]))
    req = tmp_path / "req.npz"
    assert bench.main(["prepare", "--out", str(req), "--num-prompts", "5", "--sharegpt", str(tmp_path / "sg.json")]) == 0
    assert len(bench.load_requests(req)) == 5
    assert bench.main(["compile", "--smoke", "--target", "llvm", "--out", str(tmp_path / "libs")]) == 0
    out = tmp_path / "res.json"
    assert bench.main(["run", "--smoke", "--device", "cpu", "--lib-dir", str(tmp_path / "libs"), "--requests",
                       str(req), "--max-output-len", "6", "--warmup", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    worst = float(printed.split("worst rel err ")[1].split()[0])
    assert worst < 1e-4  # the logits check ran and passed (float32 llvm build vs float32 torch)
    doc = json.loads(out.read_text())
    assert doc["machine"]["python"] and doc["command"].startswith("python")
    res = doc["results"]
    want_out = sum(min(n, 6) for _, n in bench.load_requests(req))
    assert [r["config"] for r in res] == ["base", "lora4", "lora64"]
    assert [r["adapters"] for r in res] == [0, 4, 64]
    assert res[2]["ranks"] == [8, 16, 32, 64]
    for r in res:
        assert r["requests"] == 5 and r["output_tokens"] == want_out
        # one forward a step, on the functions the library has (llvm: no fused ones; the base
        # library's are prefill/decode, a LoRA one's batches with adapters run its LoRA stage)
        assert sum(r["forwards"].values()) == r["num_steps"], r["forwards"]
        assert set(r["forwards"]) <= {"prefill", "decode", "prefill_base", "decode_base"}
        assert r["forwards"].get("decode", 0) > 0 and r["forwards"].get("prefill", 0) > 0
        assert r["requests_per_s"] > 0 and r["ratio_vs_base"] > 0
        assert r["kv_pages"] == bench.SIZES["smoke"]["kv_pages"]
    assert res[0]["ratio_vs_base"] == 1.0

    # a config of a second library folder (the build before a change) beside the same config, in one run
    cmp_out = tmp_path / "cmp.json"
    assert bench.main(["run", "--smoke", "--device", "cpu", "--lib-dir", str(tmp_path / "libs"), "--compare-lib-dir",
                       str(tmp_path / "libs"), "--configs", "base,lora4@cmp,lora4", "--no-check", "--requests",
                       str(req), "--max-output-len", "6", "--warmup", "1", "--out", str(cmp_out)]) == 0
    cres = json.loads(cmp_out.read_text())["results"]
    assert [r["config"] for r in cres] == ["base", "lora4", "lora4@cmp"]
    assert cres[2]["lib_dir"] == str(tmp_path / "libs") and "lib_dir" not in cres[1]
    assert cres[2]["adapters"] == 4 and cres[2]["output_tokens"] == want_out and cres[2]["ratio_vs_base"] > 0
    assert doc["complete"] is True

    # int8 rows (named, not built by default): the check serves the rows they stand for, 64 adapters run
    assert not (tmp_path / "libs" / "lora-int8").exists()
    assert bench.main(["compile", "--smoke", "--target", "llvm", "--out", str(tmp_path / "libs"), "--libs",
                       "lora-int8"]) == 0
    capsys.readouterr()
    i8 = tmp_path / "int8.json"
    assert bench.main(["run", "--smoke", "--device", "cpu", "--lib-dir", str(tmp_path / "libs"), "--requests",
                       str(req), "--configs", "lora64-int8", "--max-output-len", "6", "--warmup", "1",
                       "--out", str(i8)]) == 0
    printed = capsys.readouterr().out
    assert "check libs/lora-int8" in printed and float(printed.split("worst rel err ")[1].split()[0]) < 1e-4
    r8 = json.loads(i8.read_text())["results"][0]
    assert r8["adapters"] == 64 and r8["output_tokens"] == want_out

    # a call cut short after its first config keeps that config's run (marked incomplete)
    run_config = bench.run_config
    calls = []

    def cut(*args, **kw):
        calls.append(args[0])
        if len(calls) > 1:
            raise KeyboardInterrupt  # what a time limit's signal leaves
        return run_config(*args, **kw)

    monkeypatch.setattr(bench, "run_config", cut)
    cut_out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["run", "--smoke", "--device", "cpu", "--lib-dir", str(tmp_path / "libs"), "--configs", "base,lora4",
                    "--no-check", "--requests", str(req), "--max-output-len", "6", "--warmup", "1", "--out", str(cut_out)])
    part = json.loads(cut_out.read_text())
    assert part["complete"] is False and [r["config"] for r in part["results"]] == ["base"]
    assert part["results"][0]["output_tokens"] == want_out

    # two split runs merged: one JSON with every config, ratios against the merged base, charts
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(dict(doc, results=res[:1])))
    b.write_text(json.dumps(dict(doc, results=res[1:])))
    merged = tmp_path / "merged.json"
    assert bench.main(["plot", str(a), str(b), "--out", str(merged)]) == 0
    m = json.loads(merged.read_text())
    assert [r["config"] for r in m["results"]] == ["base", "lora4", "lora64"]
    assert m["results"][1]["ratio_vs_base"] == res[1]["requests_per_s"] / res[0]["requests_per_s"]
    assert len(m["merged_from"]) == 2

    # bench_lora_steps on the same libraries: the base model and 64 adapters of ranks 8-64, one
    # decode and one prefill step each, one process (each config's pool freed before the next)
    import weakref  # pylint: disable=import-outside-toplevel

    import bench_lora_steps as steps  # pylint: disable=import-outside-toplevel
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    pools, freed = [], []
    create, release = ModelRunner.create_pool, steps.offline.release

    def recording_create(self, *args, **kw):
        pool = create(self, *args, **kw)
        pools.append(weakref.ref(pool))
        return pool

    def checking_release():
        release()
        freed.append(pools[-1]() is None)  # nothing keeps the config's pool once it is done

    monkeypatch.setattr(ModelRunner, "create_pool", recording_create)
    monkeypatch.setattr(steps.offline, "release", checking_release)
    assert steps.main(["run", "--lib-dir", str(tmp_path / "libs"), "--configs", "base,lora64", "--batches", "4",
                       "--prefill", "64", "--mixed", "32", "--ctx", "16", "--device", "cpu", "--bandwidth-tbs", "1e-6",
                       "--log-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_lora_steps.json").read_text())
    rows = doc["rows"]
    assert doc["complete"] is True
    assert [(r["config"], r["step"]) for r in rows] == [
        (c, s) for c in ("base", "lora64") for s in ("decode b=4", "mixed b=4+T=32", "prefill T=64")]
    # the rows floor: the distinct adapters' rank rows (ranks 8/16/32/64 in turn), from the compiled
    # config's modules, at 1 MB/s: decode b=4 uses adapters 0-3, prefill sequences 1000-1003 (mod 64:
    # 40-43), the mixed step adapters 0-3 and 2000 % 64 = 16 (rank 8)
    lcfg = json.loads((tmp_path / "libs" / "lora" / "mlc-lora-config.json").read_text())["lora"]
    per_rank = sum(m["in_features"] + m["out_features"] for m in lcfg["modules"]) * lcfg["num_layers"] * 4
    floor = {r["step"]: r["rows_ms"] for r in rows if r["config"] == "lora64"}
    want = {"decode b=4": 120 * per_rank / 1e3, "prefill T=64": 120 * per_rank / 1e3, "mixed b=4+T=32": 128 * per_rank / 1e3}
    assert floor.keys() == want.keys() and all(abs(floor[k] - want[k]) <= 1e-3 for k in want)
    assert all(r["rows_ms"] is None for r in rows if r["config"] == "base")
    assert all(r["ms"] > 0 for r in rows) and freed == [True, True]
    # NAME@cmp: the same config on --compare-lib-dir's library, in the same process; a config
    # named again runs again (NAME#2) and the comparison averages the repeats
    args = ["run", "--lib-dir", str(tmp_path / "libs"), "--configs", "base,base@cmp,base@cmp,base", "--batches", "2",
            "--prefill", "", "--ctx", "8", "--device", "cpu", "--log-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="needs --compare-lib-dir"):
        steps.main(args)
    assert steps.main(args + ["--compare-lib-dir", str(tmp_path / "libs")]) == 0
    rows = json.loads((tmp_path / "bench_lora_steps.json").read_text())["rows"]
    assert [(r["config"], r["step"]) for r in rows] == [
        ("base", "decode b=2"), ("base@cmp", "decode b=2"), ("base@cmp#2", "decode b=2"), ("base#2", "decode b=2")]
    ms = [r["ms"] for r in rows]
    assert steps.compare_rows(rows) == [("decode b=2", "base", (ms[0] + ms[3]) / 2, (ms[1] + ms[2]) / 2)]
    assert "| step | config | ms | @cmp ms | ratio |" in (tmp_path / "bench_lora_steps.log").read_text()
    assert merged.with_suffix(".svg").stat().st_size > 0 and merged.with_suffix(".png").stat().st_size > 0


def test_a_config_named_again_runs_again_and_base_is_the_mean_of_its_runs():
    """--configs base,lora4,lora64,lora4,base: the repeats are labelled by their run (the position
    in the process moves a result), each maps to its config, and the ratios are over base's mean."""
    names = ["base", "lora4", "lora64@cmp", "lora4", "base", "lora4"]
    labels = bench.run_labels(names)
    assert labels == ["base", "lora4", "lora64@cmp", "lora4#2", "base#2", "lora4#3"]
    assert [bench.config_of(x) for x in labels] == ["base", "lora4", "lora64", "lora4", "base", "lora4"]
    from harness import cli  # pylint: disable=import-outside-toplevel

    assert [cli.on_compare_dir(x) for x in labels + ["lora64@cmp#2"]] == [False, False, True, False, False, False, True]
    for bad, why in (("lora5", "unknown config"), ("lora4@old", "unknown config"), ("lora4@cmp", "needs --compare")):
        with pytest.raises(SystemExit, match=why):
            cli.check_run_names(["base", bad], bench.CONFIGS, None)
    cli.check_run_names(names, bench.CONFIGS, "OLD")
    res = bench.with_ratios([dict(config="base", requests_per_s=20.0), dict(config="base#2", requests_per_s=30.0),
                             dict(config="lora4#2", requests_per_s=20.0), dict(config="base@cmp", requests_per_s=1.0)])
    assert [r["ratio_vs_base"] for r in res] == [0.8, 1.2, 0.8, 0.04]


def test_the_gpu_monitor_summarizes_nvidia_smi_and_is_empty_without_it():
    """gpu_summary over nvidia-smi's CSV (a cut or N/A line skipped); no nvidia-smi: an empty
    summary, the run goes on."""
    from harness import cli

    lines = ["1980, 45, 300.5, 0x0000000000000000", "1755, 61, 690.0, 0x0000000000000004",
             "[N/A], 60, 650.0, 0x0000000000000000", "1830, 5"]
    got = cli.gpu_summary(lines)
    assert got == dict(samples=2, sm_clock_mhz_mean=1868, sm_clock_mhz_min=1755, temperature_c_max=61.0,
                       power_w_mean=495.2, power_w_max=690.0, throttle_reasons=["0x0000000000000004"])
    assert cli.gpu_summary([]) == {}
    import shutil

    if shutil.which("nvidia-smi") is None:
        with cli.GpuMonitor() as gpu:
            pass
        assert gpu.summary == {}


def test_step_sums_take_out_the_runs_mix_of_batch_sizes():
    """step_sums: per config (runs NAME, NAME#2 together, NAME@cmp apart) each bucket's mean step
    time times the bucket's mean step count over all runs; buckets some config never stepped in
    are left out."""
    def run(config, **buckets):
        return {"config": config, "step_times": {k.replace("le", "_<="): {"steps": n, "seconds": s}
                                                 for k, (n, s) in buckets.items()}}

    results = [run("base", decodele8=(10, 1.0), prefillle512=(4, 2.0)),
               run("lora4", decodele8=(12, 1.8), prefillle512=(2, 1.2), prefillle16=(1, 0.5)),
               run("lora4#2", decodele8=(8, 1.2), prefillle512=(6, 3.6)),
               run("lora4@cmp", decodele8=(10, 2.0), prefillle512=(4, 4.0))]
    sums = bench.step_sums(results)
    assert list(sums) == ["base", "lora4", "lora4@cmp"]
    # mean counts over the four runs: decode_<=8 10, prefill_<=512 4; prefill_<=16 only in one run
    assert sums["base"] == {"runs": 1, "prefill": 2.0, "decode": 1.0, "steps": 3.0,
                            "buckets": {"decode_<=8": 1.0, "prefill_<=512": 2.0}}
    # lora4: decode (1.8 + 1.2) / 20 = 0.15 s a step x 10; prefill (1.2 + 3.6) / 8 = 0.6 x 4
    assert sums["lora4"]["runs"] == 2
    assert abs(sums["lora4"]["decode"] - 1.5) < 1e-12 and abs(sums["lora4"]["prefill"] - 2.4) < 1e-12
    assert abs(sums["lora4@cmp"]["steps"] - (2.0 + 4.0)) < 1e-12
    assert abs(sums["lora4"]["buckets"]["decode_<=8"] - 1.5) < 1e-12 and "prefill_<=16" not in sums["lora4"]["buckets"]
