"""The typed Pool API over the C++ unified pool (CPU): sequences, adapters, stats and errors, on one
device (DevicePool) and on 2 tensor-parallel shards in step (ShardedPool).

Page counts are checked against the row arithmetic: every row length here (64, 32, 16) divides the
page, so the best-fit layout wastes nothing and an adapter takes ceil(rank * sum(in + out) / E)."""

import math

import numpy as np
import pytest

from mlc_lora.errors import LoraError, PoolExhaustedError
from mlc_lora.lora import LoraAdapter, pack_peft_adapter, peft_adapter_plan
from mlc_lora.runner import AdapterInfo, DevicePool, ModelRunner, PoolStats, ShardedModelRunner, ShardedPool

from .conftest import ADAPTERS, POOL_PAGES


def expected_pages(runner, name: str) -> int:
    spec = runner.lora
    rank = ADAPTERS[name][1]
    return math.ceil(rank * sum(m.in_features + m.out_features for m in spec.modules) / spec.page_elems)


def new_pool(runner):
    return runner.create_pool(max_batch_size=8, max_total_seq_len=(POOL_PAGES - 1) * 16, prefill_chunk_size=64)


def grow(pool, seq_id: int, tokens: int) -> None:
    """Append `tokens` to a sequence's KV, a prefill chunk (64) at a time."""
    while tokens > 0:
        n = min(tokens, 64)
        pool.begin_forward([seq_id], [n])
        pool.end_forward()
        tokens -= n


@pytest.fixture(scope="module")
def runner(qv_models):
    return ModelRunner(qv_models[1][1])


@pytest.fixture(scope="module")
def sharded(qv_models):
    r = ShardedModelRunner(qv_models[1][2])
    yield r
    r.sess.shutdown()


def test_stats_and_adapter_info_follow_load_pin_and_unload(runner, qv_models):
    root = qv_models[0]
    pool = new_pool(runner)
    assert isinstance(pool, DevicePool) and pool.num_shards == 1
    empty = pool.stats()
    assert isinstance(empty, PoolStats)
    assert (empty.total_pages, empty.free_pages, empty.kv_pages, empty.adapter_pages, empty.loaded_adapters) == \
        (POOL_PAGES, POOL_PAGES, 0, 0, 0)
    assert empty.page_elems == runner.lora.page_elems
    # load: the plan says what went in (and what peft_adapter_plan announces, without packing)
    plan = pool.load_adapter(7, root / "qv8")
    n8 = expected_pages(runner, "qv8")
    assert (plan.name, plan.rank, plan.modules, plan.num_pages) == ("qv8", 8, ["q_proj", "v_proj"], n8)
    assert plan.scales == {"q_proj": 16 / 8, "v_proj": 16 / 8} and not plan.use_rslora
    assert peft_adapter_plan(root / "qv8", runner.config).num_pages == n8
    s = pool.stats()
    assert (s.adapter_pages, s.free_pages, s.evictable_pages, s.resident_adapters, s.loaded_adapters) == \
        (n8, POOL_PAGES - n8, n8, 1, 1)
    info = pool.adapter_info(7)
    assert isinstance(info, AdapterInfo)
    assert (info.num_pages, info.resident, info.pinned, info.refs, len(info.pages)) == (n8, True, False, 0, n8)
    # pinned: never evictable; rsLoRA scale alpha / sqrt(r); `name` names it
    plan4 = pool.load_adapter(9, root / "qv4", pin=True, name="four")
    n4 = expected_pages(runner, "qv4")
    assert (plan4.name, plan4.num_pages, plan4.use_rslora, plan4.scales["q_proj"]) == ("four", n4, True, 4 / 2)
    s = pool.stats()
    assert (s.adapter_pages, s.evictable_pages) == (n8 + n4, n8)
    # what a batch can take: the free pages and the idle unpinned adapter's (not the pinned one's)
    assert pool.admittable_pages() == POOL_PAGES - n8 - n4 + n8
    assert not set(pool.adapter_info(9).pages) & set(pool.adapter_info(7).pages)
    pool.pin_adapter(7, True)
    assert pool.stats().evictable_pages == 0 and pool.adapter_info(7).pinned
    assert pool.admittable_pages() == POOL_PAGES - n8 - n4
    pool.pin_adapter(7, False)
    assert pool.stats().evictable_pages == n8
    # a sequence on the adapter: one more user, not evictable while it holds it
    pool.add_sequence(0)
    pool.set_sequence_adapter(0, 7)
    assert pool.adapter_info(7).refs == 1 and pool.stats().evictable_pages == 0
    assert pool.admittable_pages() == POOL_PAGES - n8 - n4
    pool.unload_adapter(7)  # deferred: sequence 0 still uses it
    assert pool.stats().loaded_adapters == 2
    pool.remove_sequence(0)
    s = pool.stats()
    assert (s.loaded_adapters, s.adapter_pages, s.free_pages) == (1, n4, POOL_PAGES - n4)
    pool.check_invariants()


def test_sequences_fork_popn_and_pages(runner):
    pool = new_pool(runner)
    pool.add_sequence(0)
    pool.begin_forward([0], [20])
    pool.end_forward()
    assert pool.sequence_length(0) == 20 and len(pool.sequence_pages(0)) == 2
    pool.fork_sequence(0, 1)
    assert pool.sequence_pages(1) == pool.sequence_pages(0)  # shared, not copied
    assert pool.available_pages() == POOL_PAGES - 2 == pool.stats().free_pages
    pool.popn(1, 5)
    assert pool.sequence_length(1) == 15 and pool.sequence_pages(1) == pool.sequence_pages(0)[:1]
    assert pool.stats().kv_tokens == 35
    pool.fork_sequence(0, 2, 16)  # at a page boundary
    assert pool.sequence_length(2) == 16
    for s in (0, 1, 2):
        pool.remove_sequence(s)
    assert pool.available_pages() == POOL_PAGES
    pool.check_invariants()


def test_errors_name_the_problem_and_change_nothing(runner, qv_models, tiny_models):
    root = qv_models[0]
    pool = new_pool(runner)
    pool.load_adapter(0, root / "qv8", pin=True)
    before = pool.stats()
    with pytest.raises(LoraError, match=r"adapter qv64 \(rank 64, q_proj, v_proj\) needs 14 pages, but the whole "
                                        f"pool has {POOL_PAGES}"):
        pool.load_adapter(1, root / "qv64")
    for call in (lambda: pool.unload_adapter(5), lambda: pool.pin_adapter(5, True), lambda: pool.adapter_info(5)):
        with pytest.raises(ValueError, match="unknown adapter 5"):
            call()
    pool.add_sequence(3)
    with pytest.raises(ValueError, match="unknown adapter 5"):
        pool.set_sequence_adapter(3, 5)
    pool.remove_sequence(3)
    assert pool.stats() == before
    # KV takes every page the pinned adapter leaves: the next adapter loads without pages and is
    # paged in by the first batch that needs it
    pool.add_sequence(0)
    grow(pool, 0, (POOL_PAGES - before.adapter_pages) * 16)
    assert pool.stats().free_pages == 0
    assert pool.load_adapter(2, root / "qv4").num_pages == 1
    info = pool.adapter_info(2)
    assert (info.resident, info.host) == (False, True)
    # pinned adapters (resident or waiting for pages) may hold the whole pool; then nothing else
    # can ever run, and a load says so
    for slot in range(3, 8):
        pool.load_adapter(slot, root / "qv8", pin=True)
    assert pool.stats().pinned_pages == POOL_PAGES
    with pytest.raises(LoraError, match=r"adapter qv4 \(rank 4, q_proj, v_proj\) needs 1 pages, but pinned "
                                        r"adapters hold 12 of the pool's 12 pages; unpin some to load it"):
        pool.load_adapter(8, root / "qv4")
    pool.remove_sequence(0)
    pool.add_sequence(1)
    pool.set_sequence_adapter(1, 2)
    grow(pool, 1, 1)
    assert pool.adapter_info(2).resident and pool.stats().adapter_page_ins == 1
    pool.check_invariants()
    # a model compiled without LoRA
    plain = ModelRunner(tiny_models["gqa"][1])
    with pytest.raises(LoraError, match="compiled without LoRA: recompile it with --max-lora-rank"):
        plain.create_pool(4, 64).load_adapter(0, root / "qv8")


def test_packed_and_in_memory_adapters_load_the_same_pages(runner, qv_models):
    """load_packed_adapter takes what pack_peft_adapter makes; load_adapter packs a folder itself."""
    root = qv_models[0]
    a, b = new_pool(runner), new_pool(runner)
    a.load_adapter(0, root / "qv8")
    packed = pack_peft_adapter(root / "qv8", runner.config)
    b.load_packed_adapter(0, packed)
    assert a.stats() == b.stats() and a.adapter_info(0) == b.adapter_info(0)
    for pool in (a, b):
        pool.add_sequence(0)
        pool.set_sequence_adapter(0, 0)
    logits = [runner.prefill(p, [0], [[1, 2, 3, 4]], lora="pool").numpy() for p in (a, b)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_sharded_pool_acts_on_every_shard_in_step(sharded, qv_models):
    root = qv_models[0]
    pool = new_pool(sharded)
    assert isinstance(pool, ShardedPool) and pool.num_shards == 2
    n8, n4 = expected_pages(sharded, "qv8"), expected_pages(sharded, "qv4")
    assert sharded.lora.page_elems * 2 == ModelRunner(qv_models[1][1]).lora.page_elems  # half the KV heads
    assert pool.load_adapter(0, root / "qv8").num_pages == n8
    assert pool.load_adapter(1, root / "qv4", pin=True).num_pages == n4
    stats = pool.shard_stats()
    assert stats[0] == stats[1] and stats[0].adapter_pages == n8 + n4 == pool.stats().adapter_pages
    infos = pool.shard_adapter_info(0)
    assert infos[0] == infos[1] and infos[0].num_pages == n8
    # KV pressure evicts the idle adapter on both shards
    pool.add_sequence(0)
    grow(pool, 0, (POOL_PAGES - n4 - 1) * 16)
    assert [i.resident for i in pool.shard_adapter_info(0)] == [False, False]
    # the host tier on both shards: adapter 0's copy dropped, then packed again by every worker
    with pytest.raises(ValueError, match="adapter 1 holds pool pages"):
        pool.drop_adapter_host(1)
    pool.drop_adapter_host(0)
    assert [(i.host, i.host_bytes) for i in pool.shard_adapter_info(0)] == [(False, 0), (False, 0)]
    for call in (lambda: pool.prefetch_adapter(0), lambda: pool.pin_adapter(0, True)):
        with pytest.raises(ValueError, match="adapter 0 has no host copy"):
            call()
    host = pool.read_adapter(root / "qv8")
    pool.set_adapter_host(0, host)
    assert [(i.host, i.host_bytes) for i in pool.shard_adapter_info(0)] == [(True, host.nbytes)] * 2
    # what would make a worker throw (and end the process) is refused here, on the controller
    with pytest.raises(PoolExhaustedError, match=f"pinning adapter 0 needs {n8} pages per shard; 1 are free"):
        pool.pin_adapter(0, True)
    with pytest.raises(LoraError, match="needs 22 pages, but the whole pool has 12"):
        pool.load_adapter(2, root / "qv64")
    with pytest.raises(LoraError, match="loads adapters from their PEFT folders"):
        pool.load_adapter(2, LoraAdapter("mem", 4, ["q_proj"], {"q_proj": 1.0}, {}, {}))
    stats = pool.shard_stats()
    assert stats[0] == stats[1] and stats[0].loaded_adapters == 2
    pool.remove_sequence(0)
    pool.pin_adapter(0, True)  # now it fits: paged back in on both shards
    assert [i.resident and i.pinned for i in pool.shard_adapter_info(0)] == [True, True]
    pool.check_invariants()


def test_pool_calls_keep_the_gil_and_model_calls_keep_it_only_off_the_cpu(runner):
    """Calls that let the GIL go must win it back from whichever thread took it meanwhile (up to the
    interpreter's switch interval): the pool's bookkeeping keeps it; a model function lets it go on
    the CPU (the call is the computation) and keeps it on a GPU (it only queues work)."""
    import tvm

    from mlc_lora.runner import keep_gil_on_device

    pool = new_pool(runner)
    pool.stats()
    pool.available_pages()
    assert pool._funcs and all(not f.release_gil for f in pool._funcs.values())  # pylint: disable=protected-access
    decode = runner.vm["decode"]
    keep_gil_on_device(tvm.cpu(0), decode)
    assert decode.release_gil
    keep_gil_on_device(tvm.cuda(0), decode, None)  # (a device object needs no GPU)
    assert not decode.release_gil
    assert runner._decode.release_gil  # pylint: disable=protected-access  (this runner is on the CPU)
    # reading the Arrays and Maps the runtime returns (stats, adapter infos, LoRA tables)
    import tvm_ffi._ffi_api as api

    from mlc_lora.runner.device import CONTAINER_ACCESSORS

    assert all(not getattr(api, n).release_gil for n in CONTAINER_ACCESSORS if hasattr(api, n))
    assert {"ArrayGetItem", "MapGetItem"} <= {n for n in CONTAINER_ACCESSORS if hasattr(api, n)}
