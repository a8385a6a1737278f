"""The adapter side of the unified page pool (src/runtime, through the runner's Pool): pages,
tables, pins, refcounts, eviction, errors."""

import dataclasses

import numpy as np
import pytest
import torch
import tvm

from mlc_lora.errors import PoolExhaustedError
from mlc_lora.lora.layout import PackedAdapter
from mlc_lora.runner import HostCopy, ModelRunner

S = tvm.runtime.ShapeTuple
begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
M, R, ROW = 3, 4, 64  # modules, max rank, row length of the test adapters


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
    return PackedAdapter(pages, a, b, rank, scale)


@pytest.fixture(scope="module")
def runner(tiny_models):
    return ModelRunner(tiny_models["gqa"][1])


def geometry(runner):
    c = runner.model_config
    return c["num_hidden_layers"], 2 * c["num_key_value_heads"] * 16 * c["head_dim"]


def new_pool(runner, tokens=512, batch=8):
    """A pool of the (LoRA-less) tiny model with tables for M modules at rank R."""
    pool = runner.create_pool(max_batch_size=batch, max_total_seq_len=tokens, prefill_chunk_size=64)
    pool.configure_lora(M, R)
    return pool


def check_tables(pool, slot_adapters, token_slot, L, E):
    """Tables of the current batch against the host buffers (independent arithmetic)."""
    arena, slot, rank, scale, a_off, b_off, order, start = [t.numpy() for t in pool.lora_tables()]
    assert pool.lora_num_slots() == len(slot_adapters)
    assert pool.lora_rank_total() == sum(h.rank for _, h in slot_adapters)  # decode_fused's batch test
    # the tokens sorted by slot (stable, base-model tokens last); slot_start describes the batch's
    # slots here, every slot of the capacity (8: new_pool's) in the graph tables
    token_slot = np.asarray(token_slot)
    key = np.where(token_slot >= 0, token_slot, len(token_slot) + 1)
    np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))
    counts = [int((token_slot == s).sum()) for s in range(8)]
    full = np.concatenate([[0], np.cumsum(counts)])
    assert start.size == max(1, len(slot_adapters)) + 1
    np.testing.assert_array_equal(start, full[:start.size])
    graph_start = pool.lora_graph_tables()[7].numpy()
    np.testing.assert_array_equal(graph_start, full)
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
        pages = pool.adapter_info(aid).pages
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
    pool = new_pool(runner)
    avail = pool.available_pages()
    total = pool.stats().total_pages
    assert total == 512 // 16 + 1 and avail == total
    a, b = make_adapter(1, L, E, 2, rank=3), make_adapter(2, L, E, 3, rank=4, targets=(1,))
    pool.load_packed_adapter(10, a)
    assert pool.available_pages() == avail - 2
    pool.load_packed_adapter(11, b, pin=True)
    assert pool.available_pages() == avail - 5
    st = pool.stats()
    assert (st.adapter_pages, st.resident_adapters, st.free_pages) == (5, 2, avail - 5)
    for s in range(4):
        pool.add_sequence(s)
    pool.set_sequence_adapter(0, 11)
    pool.set_sequence_adapter(2, 10)
    pool.set_sequence_adapter(3, 11)
    pool.begin_forward([1, 0, 2, 3], [2, 3, 1, 2])
    check_tables(pool, [(11, b), (10, a)], [-1, -1, 0, 0, 0, 1, 0, 0], L, E)
    ptrs = [t.data_ptr() for t in pool.lora_tables()]
    pool.end_forward()
    # A forked child inherits its parent's adapter; a base-only batch has one inert slot.
    pool.fork_sequence(2, 4, -1)
    pool.begin_forward([4], [1])
    check_tables(pool, [(10, a)], [0], L, E)
    assert [t.data_ptr() for t in pool.lora_tables()] == ptrs  # fixed addresses
    pool.end_forward()
    pool.begin_forward([1], [5])
    # (a batch without adapters builds its tables when asked: graph tables first here)
    assert pool.lora_num_slots() == 0 and pool.lora_rank_total() == 0
    graph = [t.numpy() for t in pool.lora_graph_tables()]
    assert (graph[1] == -1).all() and graph[1].shape == (5,) and graph[2].shape == (8,)
    check_tables(pool, [], [-1] * 5, L, E)
    pool.end_forward()
    pool.begin_forward([4, 1], [1, 1])  # adapters again: built at begin_forward, as before
    check_tables(pool, [(10, a)], [0, -1], L, E)
    pool.end_forward()
    # Unload and the pages come back.
    for s in range(5):
        pool.remove_sequence(s)
    pool.unload_adapter(10)
    pool.unload_adapter(11)
    assert pool.available_pages() == avail
    assert pool.stats().loaded_adapters == 0
    pool.check_invariants()


def test_eviction_page_in_and_deferred_unload(runner):
    L, E = geometry(runner)
    pool = new_pool(runner, tokens=96)  # 7 pages
    assert pool.stats().total_pages == 7
    a, b, c = (make_adapter(i, L, E, 2, rank=2) for i in range(3))
    pool.load_packed_adapter(0, a)
    pool.load_packed_adapter(1, b, pin=True)
    pool.load_packed_adapter(2, c)
    # a batch on adapter 0 first: its tables placed on the pages it holds now; then one on
    # adapter 2 (0 stays the least recently used)
    for seq, (adapter, h) in enumerate(((0, a), (2, c)), start=8):
        pool.add_sequence(seq)
        pool.set_sequence_adapter(seq, adapter)
        pool.begin_forward([seq], [1])
        check_tables(pool, [(adapter, h)], [0], L, E)
        pool.end_forward()
        pool.remove_sequence(seq)
    first_pages = pool.adapter_info(0).pages
    pool.add_sequence(0)
    pool.begin_forward([0], [32])  # 2 KV pages: evicts the least recently used idle adapter (0)
    pool.end_forward()
    info = {i: pool.adapter_info(i) for i in range(3)}
    assert [info[i].resident for i in range(3)] == [False, True, True]
    st = pool.stats()
    assert (st.kv_pages, st.adapter_pages, st.free_pages) == (2, 4, 1)
    # A sequence on the evicted adapter enters a batch: paged back in (its host copy was kept),
    # evicting adapter 2, the only idle unpinned one.
    pool.add_sequence(1)
    pool.set_sequence_adapter(1, 0)
    pool.begin_forward([1], [1])
    assert [pool.adapter_info(i).resident for i in range(3)] == [True, True, False]
    assert pool.adapter_info(0).pages != first_pages  # on other pages: its tables placed again
    check_tables(pool, [(0, a)], [0], L, E)
    pool.end_forward()
    # Unloading adapter 0 while sequence 1 uses it is deferred.
    pool.unload_adapter(0)
    assert pool.stats().loaded_adapters == 3
    pool.begin_forward([1], [1])
    check_tables(pool, [(0, a)], [0], L, E)
    pool.end_forward()
    with pytest.raises(ValueError, match="being unloaded"):
        pool.set_sequence_adapter(0, 0)
    before = pool.stats().free_pages
    pool.remove_sequence(1)  # last user: adapter 0's 2 pages and seq 1's KV page come back
    assert pool.stats().free_pages == before + 3
    assert pool.stats().loaded_adapters == 2
    with pytest.raises(ValueError, match="unknown adapter 0"):
        pool.adapter_info(0)
    pool.check_invariants()


def test_bad_input_is_refused_and_other_sequences_keep_running(tiny_models, runner):
    hf, _ = tiny_models["gqa"]
    L, E = geometry(runner)
    pool = new_pool(runner, tokens=96)  # 7 pages
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    pool.add_sequence(0)
    runner.prefill(pool, [0], [prompt])
    before = pool.stats()
    with pytest.raises(ValueError, match="whole pool has only 7"):
        pool.load_packed_adapter(5, make_adapter(0, L, E, 8, rank=1))
    with pytest.raises(ValueError, match="rank 5, outside \\[1, 4\\]"):
        h = make_adapter(0, L, E, 1, rank=1)
        pool.load_packed_adapter(5, dataclasses.replace(h, rank=5))
    with pytest.raises(ValueError, match="unknown adapter 9"):
        pool.set_sequence_adapter(0, 9)
    with pytest.raises(ValueError, match="unknown adapter 9"):
        pool.unload_adapter(9)
    with pytest.raises(ValueError, match="unknown adapter 9"):
        pool.pin_adapter(9, True)
    with pytest.raises(ValueError, match="model dtype"):
        h = make_adapter(0, L, E, 1, rank=1)
        pool.load_packed_adapter(5, dataclasses.replace(h, pages=h.pages.astype(np.float16)))
    with pytest.raises(ValueError, match="pages must be"):
        h = make_adapter(0, L, E, 1, rank=1)
        pool.load_packed_adapter(5, dataclasses.replace(h, pages=h.pages[:, :, :10].copy()))
    with pytest.raises(ValueError, match="outside its 1024 elements"):
        h = make_adapter(0, L, E, 1, rank=1)
        h.a_off[0, 0] = 5000
        pool.load_packed_adapter(5, h)
    with pytest.raises(ValueError, match="no offset"):
        h = make_adapter(0, L, E, 1, rank=1)
        h.a_off[0, 0] = -1
        pool.load_packed_adapter(5, h)
    assert pool.stats() == before
    # Fill the pool with pinned adapters; then KV growth is refused and another adapter loads
    # without pages (it waits on the host for room).
    pool.load_packed_adapter(1, make_adapter(1, L, E, 2, rank=2), pin=True)
    pool.load_packed_adapter(2, make_adapter(2, L, E, 2, rank=2), pin=True)
    pool.load_packed_adapter(3, make_adapter(3, L, E, 2, rank=2), pin=True)
    assert pool.stats().free_pages == 0
    before = pool.stats()
    assert not pool.load_packed_adapter(4, make_adapter(4, L, E, 1, rank=1))
    info = pool.adapter_info(4)
    assert (info.resident, info.host, info.host_bytes) == (False, True, L * E * 4)
    assert dataclasses.replace(pool.stats(), loaded_adapters=before.loaded_adapters) == before
    assert not pool.prefetch_adapter(4)  # no room: nothing changes
    pool.add_sequence(1)
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        runner.prefill(pool, [1], [[1, 2, 3]])
    pool.check_invariants()
    # Sequence 0 (its page partly filled) keeps decoding correctly next to the adapters' pages.
    toks = list(prompt)
    for t in (7, 8, 9):
        out = runner.decode(pool, [0], [t]).numpy()[0]
        toks.append(t)
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0, -1].numpy()
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)
    # Unpinning one lets the waiting sequence run (the idle adapter is evicted); the page left
    # over takes adapter 4 ahead of any batch.
    pool.pin_adapter(2, False)
    runner.prefill(pool, [1], [[1, 2, 3]])
    assert not pool.adapter_info(2).resident
    assert pool.stats().free_pages == 1
    assert pool.prefetch_adapter(4) and pool.adapter_info(4).resident
    pool.check_invariants()


def test_prefetch_keeps_the_cached_prefixes_of_waiting_requests(runner):
    """A prefetch (a page-in ahead of its batch) evicts by the one least-recently-used order, but
    never a cached prefix that a waiting request would hit (`protect`): it takes a chain nobody
    waits for instead, though that one was used more recently; with only protected pages to take
    it changes nothing."""
    L, E = geometry(runner)
    pool = new_pool(runner, tokens=112)  # 8 pages
    pool.load_packed_adapter(1, make_adapter(1, L, E, 2, rank=2), pin=True)
    x = list(range(1, 34))  # 33 tokens: 2 full pages to key and one more
    y = list(range(100, 133))
    for seq, toks in ((0, x), (1, y)):
        pool.add_sequence(seq)
        pool.begin_forward([seq], [len(toks)])
        pool.end_forward()
    assert pool.stats().free_pages == 0
    assert not pool.load_packed_adapter(2, make_adapter(2, L, E, 2, rank=2))  # both wait without pages
    assert not pool.load_packed_adapter(4, make_adapter(4, L, E, 1, rank=1))
    for seq, toks in ((0, x), (1, y)):  # x's chain idles first: the colder one
        assert pool.prefix_insert(seq, 0, toks) == 2
        pool.remove_sequence(seq)
    pool.add_sequence(3)
    pool.begin_forward([3], [32])  # two pages held: none free, 4 cached idle
    pool.end_forward()
    before = pool.stats()
    assert (before.free_pages, before.cached_idle_pages) == (0, 4)
    assert pool.admittable_pages() == 4  # the idle cached pages (the adapters wait without pages)
    assert not pool.prefetch_adapter(4, [], [(None, x), (None, y)])  # only protected pages: no change
    assert pool.stats() == before
    # x is what a waiting request would hit: y's chain goes, though x's is older
    assert pool.prefetch_adapter(2, [], [(None, x)]) and pool.adapter_info(2).resident
    assert pool.prefix_lookup(None, x)[0] == 32 and pool.prefix_lookup(None, y)[0] == 0
    assert pool.stats().cached_page_evictions == 2
    # nothing protected: the least recently used page goes, x's tail
    assert pool.prefetch_adapter(4) and pool.prefix_lookup(None, x)[0] == 16
    pool.check_invariants()
    with pytest.raises(ValueError, match="cut short"):  # the raw call's encoding is checked
        pool._value("mlc_lora.runtime.pool_prefetch_adapter", 4,  # pylint: disable=protected-access
                    tvm.runtime.ShapeTuple([]), tvm.runtime.ShapeTuple([-1, 5, 1, 2]))


def test_host_copies_are_dropped_and_handed_back(runner):
    """The host tier's side of the pool: a copy is dropped only without pages, a batch that would
    page in an adapter without its copy is refused and changes nothing, and the copy handed back
    (the same packing) is what gets paged in."""
    L, E = geometry(runner)
    pool = new_pool(runner, tokens=96)  # 7 pages
    a, b = make_adapter(0, L, E, 2, rank=2), make_adapter(1, L, E, 3, rank=3)
    assert pool.load_packed_adapter(0, a) and pool.load_packed_adapter(1, b)
    assert pool.resident_adapters() == {0, 1}
    with pytest.raises(ValueError, match="adapter 0 holds pool pages: its host copy stays"):
        pool.drop_adapter_host(0)
    pool.add_sequence(0)
    pool.begin_forward([0], [48])  # 3 KV pages: adapter 0 (least recently used) is evicted
    pool.end_forward()
    assert pool.resident_adapters() == {1}
    pool.drop_adapter_host(0)
    info = pool.adapter_info(0)
    assert (info.resident, info.host, info.host_bytes) == (False, False, 0)
    pool.add_sequence(1)
    pool.set_sequence_adapter(1, 0)
    before = pool.stats()
    with pytest.raises(ValueError, match="adapter 0 has no host copy .* a batch needs it"):
        pool.begin_forward([1], [1])
    for call in (lambda: pool.prefetch_adapter(0), lambda: pool.pin_adapter(0, True)):
        with pytest.raises(ValueError, match="adapter 0 has no host copy"):
            call()
    assert pool.stats() == before and pool.sequence_length(1) == 0
    with pytest.raises(ValueError, match="not packed as those it was loaded with"):
        pool.set_adapter_host(0, HostCopy(None, 0, packed=make_adapter(0, L, E, 2, rank=1)))
    pool.set_adapter_host(0, HostCopy(None, 0, packed=a))
    with pytest.raises(ValueError, match="adapter 0 has its host pages"):
        pool.set_adapter_host(0, HostCopy(None, 0, packed=a))
    assert pool.adapter_info(0).host
    pool.begin_forward([1], [1])  # paged in from the copy handed back (evicting adapter 1)
    check_tables(pool, [(0, a)], [0], L, E)
    pool.end_forward()
    assert pool.resident_adapters() == {0}
    pool.check_invariants()


def test_unsupported_features_and_foreign_cache(runner, stock_twins):
    pool = runner.create_pool(max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=64)
    with pytest.raises(ValueError, match="pool_configure_lora"):
        pool.set_sequence_adapter(0, 1)
    with pytest.raises(ValueError, match="sliding-window"):
        runner.vm["create_paged_kv_cache"](S([4]), S([64]), S([64]), S([16]), S([1]))
    pool.add_sequence(0)
    with pytest.raises(ValueError, match="tree attention"):
        begin(pool.handle, S([0]), S([2]), S([-1, 0]))
    with pytest.raises(ValueError, match="exceeds"):
        pool.begin_forward([0], [65])
    stock = ModelRunner(stock_twins("gqa"))
    stock_pool = stock.create_pool(max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=64)
    with pytest.raises(ValueError, match="not an mlc-lora KV cache"):
        stock_pool.stats()


def test_poison_fills_the_free_pages_only(runner):
    """pool.poison_free_pages: NaN in every layer of every free page; an adapter's pages and a
    sequence's KV pages keep what they hold."""
    L, E = geometry(runner)
    pool = new_pool(runner)
    a = make_adapter(3, L, E, 2, rank=2)
    pool.load_packed_adapter(10, a)
    pool.add_sequence(0)
    pool.set_sequence_adapter(0, 10)
    pool.begin_forward([0], [20])  # 2 KV pages
    arena = pool.lora_tables()[0]
    kv_pages = pool.sequence_pages(0)
    before = arena.numpy()
    pool.poison_free_pages()
    after = arena.numpy()
    pool.end_forward()
    P = before.size // (L * E)
    owned = set(pool.adapter_info(10).pages) | set(kv_pages)
    assert len(owned) == 4 and pool.stats().free_pages == P - 4
    for layer in range(L):
        for p in range(P):
            page = slice((layer * P + p) * E, (layer * P + p + 1) * E)
            if p in owned:
                np.testing.assert_array_equal(after[page], before[page])
            else:
                assert np.isnan(after[page]).all(), (layer, p)


def test_pages_to_run_in_one_call(runner):
    """pool.adapter_pages_to_run: 0 for a resident adapter that is pinned or held by a sequence,
    else all its pages (idle resident: a batch keeps it from eviction); an unknown id is refused."""
    L, E = geometry(runner)
    pool = new_pool(runner)
    for aid, n, pin in ((1, 2, True), (2, 3, False), (3, 1, False)):
        pool.load_packed_adapter(aid, make_adapter(aid, L, E, n, rank=2), pin)
    pool.add_sequence(0)
    pool.set_sequence_adapter(0, 3)
    assert pool.adapter_pages_to_run([1, 2, 3]) == [0, 3, 0]
    pool.set_sequence_adapter(0, None)
    assert pool.adapter_pages_to_run([3, 2, 1]) == [1, 3, 0]
    assert [pool.adapter_pages_to_run([a])[0] for a in (1, 2, 3)] == [
        0 if (i := pool.adapter_info(a)).resident and (i.pinned or i.refs) else i.num_pages for a in (1, 2, 3)]
    with pytest.raises(ValueError):
        pool.adapter_pages_to_run([99])


def test_kept_columns_keep_each_adapters_slot_until_the_kept_set_changes(runner):
    """keep_lora_columns (the rank columns route): batches within the limits get the kept adapters
    as slots, in the order they were kept, absent ones included, so an adapter's rank columns stay
    put; the generation moves only when the kept set changes: an adapter appended while the ranks
    fit, the set rebuilt from the batch when they do not (its kept ones first, in order), an
    adapter unloaded or no longer resident. A batch past the limits gets its own slots (first use)
    and leaves the kept set alone."""
    L, E = geometry(runner)
    pool = new_pool(runner, tokens=1024)
    ad = {i: make_adapter(i, L, E, 2, rank=r) for i, r in ((1, 3), (2, 4), (3, 4), (4, 2))}
    for i, h in ad.items():
        pool.load_packed_adapter(10 + i, h)
    for s in range(5):
        pool.add_sequence(s)
    for s, a in enumerate((12, 11, 12, 13, -1)):
        pool.set_sequence_adapter(s, a)
    pool.keep_lora_columns(10, 3)  # rank columns, slot columns
    g0 = pool.lora_columns_generation()

    def batch(seqs, want_slots, want_token_slot):
        pool.begin_forward(seqs, [1] * len(seqs))
        check_tables(pool, [(a, ad[a - 10]) for a in want_slots], want_token_slot, L, E)
        pool.end_forward()
        for s in seqs:
            pool.popn(s, 1)
        return pool.lora_columns_generation()

    # 12 then 11 (ranks 4 + 3 <= 10): kept in the order of first use
    g1 = batch([0, 1, 4], [12, 11], [0, 1, -1])
    assert g1 == g0 + 1
    # the same adapters in the other order, and one of them alone: the same slots, no change
    assert batch([1, 0], [12, 11], [1, 0]) == g1
    assert batch([1], [12, 11], [1]) == g1
    # 13 (rank 4) does not fit beside both (4 + 3 + 4 > 10): the batch's own, its kept one first
    g2 = batch([3, 2], [12, 13], [1, 0])
    assert g2 == g1 + 1
    # a batch past the limits (ranks 4 + 3 + 4 > 10): slots in order of first use, kept set untouched
    assert batch([1, 3, 0], [11, 13, 12], [0, 1, 2]) == g2
    assert batch([0], [12, 13], [0]) == g2
    # 14 (rank 2) fits beside 12 and 13 (4 + 4 + 2, 3 slots): appended, the others' columns stay
    pool.set_sequence_adapter(4, 14)
    g3 = batch([4, 3], [12, 13, 14], [2, 1])
    assert g3 == g2 + 1
    # an unloaded adapter leaves the kept set (its columns must be filled again)
    pool.unload_adapter(14)
    assert pool.lora_columns_generation() == g3 + 1
    assert batch([2], [12, 13], [0]) == g3 + 1
    with pytest.raises(ValueError, match="both > 0"):
        pool.keep_lora_columns(10, 0)
    pool.keep_lora_columns(0, 0)  # off: slots in order of first use again
    assert batch([3, 2], [13, 12], [0, 1]) == g3 + 2
