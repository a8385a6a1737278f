"""Random traffic through the Pool: the runtime's accounting holds after every operation."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlc_lora.errors import PoolExhaustedError
from mlc_lora.runner import ModelRunner

from .test_lora_pool import R, geometry, make_adapter, new_pool


@pytest.fixture(scope="module")
def runner(tiny_models):
    return ModelRunner(tiny_models["gqa"][1])


def check_accounting(pool, seqs, adapters):
    """Recount pages from Python's view of the owners; no page has two owners."""
    pool.check_invariants()  # the C++ recount
    st_ = pool.stats()
    assert st_.free_pages + st_.kv_pages + st_.adapter_pages == st_.total_pages
    assert st_.free_pages == pool.available_pages()
    assert st_.free_pages + st_.evictable_pages == pool.admittable_pages()
    kv_pages = set()
    for s, n in seqs.items():
        pages = pool.sequence_pages(s)
        assert pool.sequence_length(s) == n and len(pages) == math.ceil(n / 16)
        kv_pages.update(pages)
    adapter_pages, resident = [], 0
    for a in adapters:
        info = pool.adapter_info(a)
        if info.resident:
            resident += 1
            adapter_pages += info.pages
    assert len(adapter_pages) == len(set(adapter_pages)) == st_.adapter_pages
    assert len(kv_pages) == st_.kv_pages
    assert not kv_pages & set(adapter_pages)
    assert resident == st_.resident_adapters and len(adapters) == st_.loaded_adapters


def resident_pages(pool, adapters):
    return {a: pool.adapter_info(a).num_pages for a in adapters if pool.adapter_info(a).resident}


OPS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5), st.integers(0, 5),
                         st.integers(0, 40)), min_size=40, max_size=120)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_operations_keep_the_accounting(runner, ops):
    L, E = geometry(runner)
    pool = new_pool(runner, tokens=160)  # 11 pages
    seqs: dict[int, int] = {}           # seq -> length, as Python tracks it
    adapters: set[int] = set()          # loaded (maybe evicted, maybe unloading)
    seq_adapter: dict[int, int] = {}
    unloading: set[int] = set()         # unloaded while sequences still use them
    for op, a, b, n in ops:
        before = pool.stats()
        res_before = resident_pages(pool, adapters)
        try:
            if op == 0:
                pool.add_sequence(a)
                seqs[a] = 0
            elif op == 1:
                pool.remove_sequence(a)
                del seqs[a]
                seq_adapter.pop(a, None)
            elif op == 2:
                pos = -1 if n % 3 else n
                pool.fork_sequence(a, b, pos)
                seqs[b] = seqs[a] if pos == -1 else pos
                if a in seq_adapter:
                    seq_adapter[b] = seq_adapter[a]
            elif op == 3:
                pool.popn(a, n % 20)
                seqs[a] -= n % 20
            elif op in (4, 5):
                ids = [a] if a == b or op == 5 else [a, b]
                lens = [1 + n % 20, 1][: len(ids)]
                pool.begin_forward(ids, lens)
                pool.end_forward()
                for s, k in zip(ids, lens):
                    seqs[s] += k
                for s in ids:  # the batch's adapters are resident
                    if s in seq_adapter:
                        assert pool.adapter_info(seq_adapter[s]).resident
            elif op == 6:
                n_pages = 1 + n % 4
                resident = pool.load_packed_adapter(a, make_adapter(a, L, E, n_pages, rank=1 + n % R),
                                                    pin=n % 5 == 0)
                adapters.add(a)
                res_after = resident_pages(pool, adapters)
                evicted = sum(p for x, p in res_before.items() if x not in res_after)
                # Loading lowers the pages available to KV by exactly its page count (less what
                # the eviction of idle adapters gave back); a busy pool registers it without pages
                # and changes nothing else.
                assert resident == pool.adapter_info(a).resident
                if resident:
                    assert pool.stats().free_pages == before.free_pages - n_pages + evicted
                else:
                    assert n_pages > before.free_pages + before.evictable_pages
                    assert pool.stats().free_pages == before.free_pages and evicted == 0
            elif op == 7:
                pool.unload_adapter(a)
                unloading.add(a)
                if a not in seq_adapter.values():
                    assert pool.stats().free_pages == before.free_pages + res_before.get(a, 0)
            elif op == 8 and n % 3 == 2:
                keep = [b]
                if pool.prefetch_adapter(a, keep):  # paged in ahead of a batch, evicting only idle ones
                    res_after = resident_pages(pool, adapters)
                    assert a in res_after and (b not in res_before or b in res_after)
                else:
                    assert pool.stats() == before
            elif op == 8:
                pool.pin_adapter(a, bool(n % 2))
            else:
                target = a if n % 4 else -1
                pool.set_sequence_adapter(b, target)
                seq_adapter.pop(b, None)
                if target >= 0:
                    seq_adapter[b] = target
        except (ValueError, PoolExhaustedError):
            assert pool.stats() == before  # a refused operation changes nothing
        for x in list(unloading):  # a deferred unload completes with the adapter's last user
            if x not in seq_adapter.values():
                unloading.discard(x)
                adapters.discard(x)
        check_accounting(pool, seqs, adapters)
    # Everything removed and unloaded: the whole pool is free again.
    for s in list(seqs):
        pool.remove_sequence(s)
    for x in adapters - unloading:
        pool.unload_adapter(x)
    assert pool.stats().free_pages == pool.stats().total_pages
    pool.check_invariants()
