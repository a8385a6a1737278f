"""Random traffic through the FFI: the pool's accounting holds after every operation."""

import math

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlc_lora import _ffi_api as rt
from mlc_lora.errors import PoolExhaustedError
from mlc_lora.runner import ModelRunner

from .test_lora_pool import M, R, geometry, make_adapter, new_cache, stats

S = tvm.runtime.ShapeTuple
begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
end = tvm.get_global_func("vm.builtin.kv_state_end_forward")
seq_length = tvm.get_global_func("vm.builtin.attention_kv_cache_get_sequence_length")


@pytest.fixture(scope="module")
def runner(tiny_models):
    return ModelRunner(tiny_models["gqa"][1])


def check_accounting(runner, kv, seqs, adapters):
    """Recount pages from Python's view of the owners; no page has two owners."""
    rt.pool_check_invariants(kv)  # the C++ recount
    st_ = stats(kv)
    assert st_["free_pages"] + st_["kv_pages"] + st_["adapter_pages"] == st_["total_pages"]
    assert st_["free_pages"] == runner.kv_available_pages(kv)
    kv_pages = set()
    for s, n in seqs.items():
        pages = [int(p) for p in rt.pool_sequence_pages(kv, s)]
        assert seq_length(kv, s) == n and len(pages) == math.ceil(n / 16)
        kv_pages.update(pages)
    adapter_pages, resident = [], 0
    for a in adapters:
        info = rt.pool_adapter_info(kv, a)
        if bool(info["resident"]):
            resident += 1
            adapter_pages += [int(p) for p in info["pages"]]
    assert len(adapter_pages) == len(set(adapter_pages)) == st_["adapter_pages"]
    assert len(kv_pages) == st_["kv_pages"]
    assert not kv_pages & set(adapter_pages)
    assert resident == st_["resident_adapters"] and len(adapters) == st_["loaded_adapters"]


def resident_pages(kv, adapters):
    return {a: int(rt.pool_adapter_info(kv, a)["num_pages"]) for a in adapters
            if bool(rt.pool_adapter_info(kv, a)["resident"])}


OPS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5), st.integers(0, 5),
                         st.integers(0, 40)), min_size=40, max_size=120)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_operations_keep_the_accounting(runner, ops):
    L, E = geometry(runner)
    kv = new_cache(runner, tokens=160)  # 11 pages
    seqs: dict[int, int] = {}           # seq -> length, as Python tracks it
    adapters: set[int] = set()          # loaded (maybe evicted, maybe unloading)
    seq_adapter: dict[int, int] = {}
    unloading: set[int] = set()         # unloaded while sequences still use them
    for op, a, b, n in ops:
        before = stats(kv)
        res_before = resident_pages(kv, adapters)
        try:
            if op == 0:
                runner.kv_add(kv, a)
                seqs[a] = 0
            elif op == 1:
                runner.kv_remove(kv, a)
                del seqs[a]
                seq_adapter.pop(a, None)
            elif op == 2:
                pos = -1 if n % 3 else n
                runner.kv_fork(kv, a, b, pos)
                seqs[b] = seqs[a] if pos == -1 else pos
                if a in seq_adapter:
                    seq_adapter[b] = seq_adapter[a]
            elif op == 3:
                runner.kv_popn(kv, a, n % 20)
                seqs[a] -= n % 20
            elif op in (4, 5):
                ids = [a] if a == b or op == 5 else [a, b]
                lens = [1 + n % 20, 1][: len(ids)]
                begin(kv, S(ids), S(lens))
                end(kv)
                for s, k in zip(ids, lens):
                    seqs[s] += k
                for s in ids:  # the batch's adapters are resident
                    if s in seq_adapter:
                        assert bool(rt.pool_adapter_info(kv, seq_adapter[s])["resident"])
            elif op == 6:
                n_pages = 1 + n % 4
                make_adapter(a, L, E, n_pages, rank=1 + n % R).load(kv, a, pin=n % 5 == 0)
                adapters.add(a)
                res_after = resident_pages(kv, adapters)
                evicted = sum(p for x, p in res_before.items() if x not in res_after)
                # Loading lowers the pages available to KV by exactly its page count (less what
                # the eviction of idle adapters gave back).
                assert stats(kv)["free_pages"] == before["free_pages"] - n_pages + evicted
            elif op == 7:
                rt.pool_unload_adapter(kv, a)
                unloading.add(a)
                if a not in seq_adapter.values():
                    assert stats(kv)["free_pages"] == before["free_pages"] + res_before.get(a, 0)
            elif op == 8:
                rt.pool_pin_adapter(kv, a, bool(n % 2))
            else:
                target = a if n % 4 else -1
                rt.pool_set_sequence_adapter(kv, b, target)
                seq_adapter.pop(b, None)
                if target >= 0:
                    seq_adapter[b] = target
        except (ValueError, PoolExhaustedError):
            assert stats(kv) == before  # a refused operation changes nothing
        for x in list(unloading):  # a deferred unload completes with the adapter's last user
            if x not in seq_adapter.values():
                unloading.discard(x)
                adapters.discard(x)
        check_accounting(runner, kv, seqs, adapters)
    # Everything removed and unloaded: the whole pool is free again.
    for s in list(seqs):
        runner.kv_remove(kv, s)
    for x in adapters - unloading:
        rt.pool_unload_adapter(kv, x)
    assert stats(kv)["free_pages"] == stats(kv)["total_pages"]
    rt.pool_check_invariants(kv)
