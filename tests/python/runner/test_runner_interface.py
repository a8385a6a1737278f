"""One Runner interface: ModelRunner and ShardedModelRunner implement it, open_runner picks one by
the compiled config, and a caller that uses only the interface gets the same tokens from both
(greedy decoding of an adapter request beside a base one, checked against HF + PEFT)."""

import numpy as np
import pytest
import torch

from mlc_lora.runner import ModelRunner, Pool, Runner, ShardedModelRunner, open_runner

from .conftest import POOL_PAGES

RUNNER_CONTRACT = {"device", "vm", "create_pool", "prefill", "decode"}
POOL_CONTRACT = {"num_shards", "_run", "_values", "lora_tables", "read_adapter", "_add_adapter", "set_adapter_host"}


def test_both_runners_implement_the_interface():
    assert Runner.__abstractmethods__ == frozenset(RUNNER_CONTRACT)
    assert Pool.__abstractmethods__ == frozenset(POOL_CONTRACT)
    for cls in (ModelRunner, ShardedModelRunner):
        assert issubclass(cls, Runner) and not cls.__abstractmethods__, cls


def greedy(runner: Runner, root, steps: int = 4):
    """Only the interface: a pool, an adapter, two sequences, prefill then decode; argmax tokens."""
    pool = runner.create_pool(8, (POOL_PAGES - 1) * 16, 64)
    assert isinstance(pool, Pool) and pool.num_shards == runner.num_shards
    pool.load_adapter(0, root / "qv8")
    prompts = {0: [5, 9, 2, 31, 7], 1: [3, 3, 8]}
    for s, slot in ((0, 0), (1, None)):
        pool.add_sequence(s)
        pool.set_sequence_adapter(s, slot)
    out = {s: [] for s in prompts}
    logits = runner.prefill(pool, [0, 1], list(prompts.values()), lora="pool").numpy()
    for _ in range(steps):
        nxt = [int(np.argmax(row)) for row in logits]
        for s, t in zip(prompts, nxt):
            out[s].append(t)
        logits = runner.decode(pool, [0, 1], nxt, lora="pool").numpy()
    return out


def hf_greedy(model, prompt, steps):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_open_runner_and_the_same_code_path_on_both(qv_models):
    root, compiled, refs = qv_models
    single = open_runner(compiled[1], "cpu")
    assert type(single) is ModelRunner and single.num_shards == 1
    sharded = open_runner(compiled[2], "cpu")
    try:
        assert type(sharded) is ShardedModelRunner and sharded.num_shards == 2
        with pytest.raises(Exception, match="params= is not supported for a tensor-parallel model"):
            open_runner(compiled[2], "cpu", params=[])
        got = {k: greedy(r, root) for k, r in ((1, single), (2, sharded))}
    finally:
        sharded.sess.shutdown()
    assert got[1] == got[2]
    assert got[1][0] == hf_greedy(refs["qv8"], [5, 9, 2, 31, 7], 4)
    assert got[1][1] == hf_greedy(refs[None], [3, 3, 8], 4)
