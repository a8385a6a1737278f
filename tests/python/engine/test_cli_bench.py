"""`mlc_lora chat` on the tiny model, and the benchmark's ShareGPT sampling rules."""

import importlib.util
import json
from pathlib import Path

from mlc_lora.cli.main import main

ROOT = Path(__file__).resolve().parents[3]


def test_chat_one_shot_prints_the_greedy_reply(tiny_chat, engine, capsys):
    want = engine.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0).choices[0].message.content
    assert main(["chat", str(tiny_chat[1]), "--prompt", "Hi", "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_chat_bad_arguments_give_a_clear_error(tiny_chat, capsys):
    assert main(["chat", str(tiny_chat[1]), "--prompt", "Hi", "--max-tokens", "0"]) == 1
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err


def test_bench_sampling_follows_vllm_rules(tmp_path):
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class WordTok:  # one token per word
        @staticmethod
        def encode(text):
            return list(range(len(text.split())))

    def conv(h, g):
        return {"conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}

    recs = [conv("a b c", "w x y z"),  # prompt under 4 tokens: dropped
            conv("a b c d", "w x y"),  # output under 4: dropped
            conv("p " * 1025, "w x y z"),  # prompt over 1024: dropped
            conv("p " * 1000, "o " * 1100),  # total over 2048: dropped
            {"conversations": [{"from": "human", "value": "only one turn"}]},  # no reply: dropped
            conv("a b c d e", "o " * 50), conv("a b c d", "w x y z v")]
    text = json.dumps(recs)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-40])  # cut mid-record, like the shipped file
    got = bench.sample_requests(WordTok(), 10, seed=0, max_output_len=20, path=path)
    assert sorted((len(p), n) for p, n in got) == [(5, 20)]  # the last record was cut off
    path.write_text(text)
    got = bench.sample_requests(WordTok(), 10, seed=0, max_output_len=20, path=path)
    assert sorted((len(p), n) for p, n in got) == [(4, 5), (5, 20)]


def test_lora_bench_smoke_runs_end_to_end_on_cpu(tmp_path):
    """prepare -> compile --smoke --target llvm -> run --smoke --device cpu: the three configs
    (base, 4 adapters, 64 adapters) through MLCEngine, results in the JSON."""
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

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
    res = json.loads(out.read_text())["results"]
    want_out = sum(min(n, 6) for _, n in bench.load_requests(req))
    assert [r["config"] for r in res] == ["base", "lora4", "lora64"]
    assert [r["adapters"] for r in res] == [0, 4, 64]
    assert res[2]["ranks"] == [8, 16, 32, 64]
    for r in res:
        assert r["requests"] == 5 and r["output_tokens"] == want_out
        assert r["requests_per_s"] > 0 and r["ratio_vs_base"] > 0
        assert r["kv_pages"] == bench.SIZES["smoke"]["kv_pages"]
