"""The adapter side of the unified page pool: pages, tables, pins, refcounts, eviction, errors."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import tvm

from mlc_lora import _ffi_api as rt
from mlc_lora.errors import PoolExhaustedError
from mlc_lora.runner import ModelRunner

S = tvm.runtime.ShapeTuple
begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
end = tvm.get_global_func("vm.builtin.kv_state_end_forward")
M, R, ROW = 3, 4, 64  # modules, max rank, row length of the test adapters


@dataclass
class HostAdapter:
    pages: np.ndarray  # [L, n, E]
    a_off: np.ndarray  # [M, R] int32, local
    b_off: np.ndarray
    rank: int
    scale: np.ndarray  # [M] float32

    def load(self, kv, adapter_id, pin=False):
        rt.pool_load_adapter(kv, adapter_id, self.pages, self.a_off, self.b_off, self.rank,
                             self.scale, pin)


def make_adapter(seed, L, E, n_pages, rank, targets=(0, 2)):
    """Rows of ROW elements packed in order (A then B^T per module and rank row); -1 elsewhere."""
    rng = np.random.default_rng(seed)
    a, b = np.full((M, R), -1, np.int32), np.full((M, R), -1, np.int32)
    slot = 0
    for m in targets:
        for k in range(rank):
            a[m, k], b[m, k] = slot * ROW, (slot + 1) * ROW
            slot += 2
    assert slot * ROW <= n_pages * E
    scale = np.zeros(M, np.float32)
    scale[list(targets)] = 2.0 / rank
    pages = rng.standard_normal((L, n_pages, E)).astype(np.float32)
    return HostAdapter(pages, a, b, rank, scale)


@pytest.fixture(scope="module")
def runner(tiny_models):
    return ModelRunner(tiny_models["gqa"][1])


def geometry(runner):
    c = runner.model_config
    return c["num_hidden_layers"], 2 * c["num_key_value_heads"] * 16 * c["head_dim"]


def new_cache(runner, tokens=512, batch=8):
    kv = runner.create_kv_cache(max_batch_size=batch, max_total_seq_len=tokens, prefill_chunk_size=64)
    rt.pool_configure_lora(kv, M, R)
    return kv


def stats(kv):
    return {k: int(v) for k, v in rt.pool_stats(kv).items()}


def check_tables(kv, slot_adapters, token_slot, L, E):
    """Tables of the current batch against the host buffers (independent arithmetic)."""
    arena, slot, rank, scale, a_off, b_off, order, start = [t.numpy() for t in rt.pool_lora_tables(kv)]
    assert int(rt.pool_lora_num_slots(kv)) == len(slot_adapters)
    # the tokens sorted by slot (stable, base-model tokens last), every slot of the capacity described
    token_slot = np.asarray(token_slot)
    key = np.where(token_slot >= 0, token_slot, len(token_slot) + 1)
    np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))
    counts = [int((token_slot == s).sum()) for s in range(start.size - 1)]
    np.testing.assert_array_equal(start, np.concatenate([[0], np.cumsum(counts)]))
    assert start.size == 8 + 1  # new_cache's batch capacity
    P = arena.size // (L * E)
    assert arena.shape == (L * P * E,)
    np.testing.assert_array_equal(slot, token_slot)
    n = max(1, len(slot_adapters))
    assert rank.shape == (n,) and scale.shape == (n, M) and a_off.shape == b_off.shape == (n, M, R)
    if not slot_adapters:
        assert rank[0] == 0 and not scale.any()
    for s, (aid, h) in enumerate(slot_adapters):
        assert rank[s] == h.rank
        np.testing.assert_array_equal(scale[s], h.scale)
        pages = [int(p) for p in rt.pool_adapter_info(kv, aid)["pages"]]
        for m in range(M):
            for k in range(h.rank):
                for glob, loc in ((a_off[s, m, k], h.a_off[m, k]), (b_off[s, m, k], h.b_off[m, k])):
                    if loc < 0:
                        continue
                    assert glob == pages[loc // E] * E + loc % E
                    for layer in range(L):
                        got = arena[layer * P * E + glob: layer * P * E + glob + ROW]
                        np.testing.assert_array_equal(got, h.pages[layer].reshape(-1)[loc: loc + ROW])


def test_load_lowers_available_pages_and_tables_point_at_rows(runner):
    L, E = geometry(runner)
    kv = new_cache(runner)
    avail = runner.kv_available_pages(kv)
    total = stats(kv)["total_pages"]
    assert total == 512 // 16 + 1 and avail == total
    a, b = make_adapter(1, L, E, 2, rank=3), make_adapter(2, L, E, 3, rank=4, targets=(1,))
    a.load(kv, 10)
    assert runner.kv_available_pages(kv) == avail - 2
    b.load(kv, 11, pin=True)
    assert runner.kv_available_pages(kv) == avail - 5
    st = stats(kv)
    assert (st["adapter_pages"], st["resident_adapters"], st["free_pages"]) == (5, 2, avail - 5)
    for s in range(4):
        runner.kv_add(kv, s)
    rt.pool_set_sequence_adapter(kv, 0, 11)
    rt.pool_set_sequence_adapter(kv, 2, 10)
    rt.pool_set_sequence_adapter(kv, 3, 11)
    begin(kv, S([1, 0, 2, 3]), S([2, 3, 1, 2]))
    check_tables(kv, [(11, b), (10, a)], [-1, -1, 0, 0, 0, 1, 0, 0], L, E)
    ptrs = [t.data_ptr() for t in rt.pool_lora_tables(kv)]
    end(kv)
    # A forked child inherits its parent's adapter; a base-only batch has one inert slot.
    runner.kv_fork(kv, 2, 4, -1)
    begin(kv, S([4]), S([1]))
    check_tables(kv, [(10, a)], [0], L, E)
    assert [t.data_ptr() for t in rt.pool_lora_tables(kv)] == ptrs  # fixed addresses
    end(kv)
    begin(kv, S([1]), S([5]))
    check_tables(kv, [], [-1] * 5, L, E)
    end(kv)
    # Unload and the pages come back.
    for s in range(5):
        runner.kv_remove(kv, s)
    rt.pool_unload_adapter(kv, 10)
    rt.pool_unload_adapter(kv, 11)
    assert runner.kv_available_pages(kv) == avail
    assert stats(kv)["loaded_adapters"] == 0
    rt.pool_check_invariants(kv)


def test_eviction_page_in_and_deferred_unload(runner):
    L, E = geometry(runner)
    kv = new_cache(runner, tokens=96)  # 7 pages
    assert stats(kv)["total_pages"] == 7
    a, b, c = (make_adapter(i, L, E, 2, rank=2) for i in range(3))
    a.load(kv, 0)
    b.load(kv, 1, pin=True)
    c.load(kv, 2)
    runner.kv_add(kv, 0)
    begin(kv, S([0]), S([32]))  # 2 KV pages: evicts the least recently used idle adapter (0)
    end(kv)
    info = {i: rt.pool_adapter_info(kv, i) for i in range(3)}
    assert [bool(info[i]["resident"]) for i in range(3)] == [False, True, True]
    st = stats(kv)
    assert (st["kv_pages"], st["adapter_pages"], st["free_pages"]) == (2, 4, 1)
    # A sequence on the evicted adapter enters a batch: paged back in (its host copy was kept),
    # evicting adapter 2, the only idle unpinned one.
    runner.kv_add(kv, 1)
    rt.pool_set_sequence_adapter(kv, 1, 0)
    begin(kv, S([1]), S([1]))
    assert [bool(rt.pool_adapter_info(kv, i)["resident"]) for i in range(3)] == [True, True, False]
    check_tables(kv, [(0, a)], [0], L, E)
    end(kv)
    # Unloading adapter 0 while sequence 1 uses it is deferred.
    rt.pool_unload_adapter(kv, 0)
    assert stats(kv)["loaded_adapters"] == 3
    begin(kv, S([1]), S([1]))
    check_tables(kv, [(0, a)], [0], L, E)
    end(kv)
    with pytest.raises(ValueError, match="being unloaded"):
        rt.pool_set_sequence_adapter(kv, 0, 0)
    before = stats(kv)["free_pages"]
    runner.kv_remove(kv, 1)  # last user: adapter 0's 2 pages and seq 1's KV page come back
    assert stats(kv)["free_pages"] == before + 3
    assert stats(kv)["loaded_adapters"] == 2
    with pytest.raises(ValueError, match="unknown adapter 0"):
        rt.pool_adapter_info(kv, 0)
    rt.pool_check_invariants(kv)


def test_bad_input_is_refused_and_other_sequences_keep_running(tiny_models, runner):
    hf, _ = tiny_models["gqa"]
    L, E = geometry(runner)
    kv = new_cache(runner, tokens=96)  # 7 pages
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runner.kv_add(kv, 0)
    runner.prefill(kv, [0], [prompt])
    before = stats(kv)
    with pytest.raises(ValueError, match="whole pool has only 7"):
        make_adapter(0, L, E, 8, rank=1).load(kv, 5)
    with pytest.raises(ValueError, match="rank 5, outside \\[1, 4\\]"):
        h = make_adapter(0, L, E, 1, rank=1)
        rt.pool_load_adapter(kv, 5, h.pages, h.a_off, h.b_off, 5, h.scale, False)
    with pytest.raises(ValueError, match="unknown adapter 9"):
        rt.pool_set_sequence_adapter(kv, 0, 9)
    with pytest.raises(ValueError, match="unknown adapter 9"):
        rt.pool_unload_adapter(kv, 9)
    with pytest.raises(ValueError, match="unknown adapter 9"):
        rt.pool_pin_adapter(kv, 9, True)
    with pytest.raises(ValueError, match="model dtype"):
        h = make_adapter(0, L, E, 1, rank=1)
        rt.pool_load_adapter(kv, 5, h.pages.astype(np.float16), h.a_off, h.b_off, 1, h.scale, False)
    with pytest.raises(ValueError, match="pages must be"):
        h = make_adapter(0, L, E, 1, rank=1)
        rt.pool_load_adapter(kv, 5, h.pages[:, :, :10].copy(), h.a_off, h.b_off, 1, h.scale, False)
    with pytest.raises(ValueError, match="outside its 1024 elements"):
        h = make_adapter(0, L, E, 1, rank=1)
        h.a_off[0, 0] = 5000
        h.load(kv, 5)
    with pytest.raises(ValueError, match="no offset"):
        h = make_adapter(0, L, E, 1, rank=1)
        h.a_off[0, 0] = -1
        h.load(kv, 5)
    assert stats(kv) == before
    # Fill the pool with pinned adapters; then KV growth and another adapter are refused.
    make_adapter(1, L, E, 2, rank=2).load(kv, 1, pin=True)
    make_adapter(2, L, E, 2, rank=2).load(kv, 2, pin=True)
    make_adapter(3, L, E, 2, rank=2).load(kv, 3, pin=True)
    assert stats(kv)["free_pages"] == 0
    with pytest.raises(PoolExhaustedError, match="exhausted.*loading adapter 4 needs 1 pages"):
        make_adapter(4, L, E, 1, rank=1).load(kv, 4)
    runner.kv_add(kv, 1)
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        runner.prefill(kv, [1], [[1, 2, 3]])
    rt.pool_check_invariants(kv)
    # Sequence 0 (its page partly filled) keeps decoding correctly next to the adapters' pages.
    toks = list(prompt)
    for t in (7, 8, 9):
        out = runner.decode(kv, [0], [t]).numpy()[0]
        toks.append(t)
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0, -1].numpy()
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)
    # Unpinning one lets the waiting sequence run (the idle adapter is evicted).
    rt.pool_pin_adapter(kv, 2, False)
    runner.prefill(kv, [1], [[1, 2, 3]])
    assert not bool(rt.pool_adapter_info(kv, 2)["resident"])
    rt.pool_check_invariants(kv)


def test_unsupported_features_and_foreign_cache(runner, stock_twins):
    kv = runner.create_kv_cache(max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=64)
    with pytest.raises(ValueError, match="pool_configure_lora"):
        rt.pool_set_sequence_adapter(kv, 0, 1)
    with pytest.raises(ValueError, match="sliding-window"):
        runner.vm["create_paged_kv_cache"](S([4]), S([64]), S([64]), S([16]), S([1]))
    runner.kv_add(kv, 0)
    with pytest.raises(ValueError, match="tree attention"):
        begin(kv, S([0]), S([2]), S([-1, 0]))
    with pytest.raises(ValueError, match="exceeds"):
        begin(kv, S([0]), S([65]))
    stock = ModelRunner(stock_twins("gqa"))
    skv = stock.create_kv_cache(max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=64)
    with pytest.raises(ValueError, match="not an mlc-lora KV cache"):
        rt.pool_stats(skv)
