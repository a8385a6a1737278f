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
