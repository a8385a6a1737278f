"""Decode batches padded to the CUDA-graph sizes (ModelRunner.decode_sizes, on by default for
libraries compiled with CUDA graphs): padding rows change no real row's logits and leave the pool
as it was; capture_decode_graphs runs every decode function at every size and gives every page
back. On the CPU (no graphs) the sizes are set by hand."""

import numpy as np
import pytest

from mlc_lora.runner import ModelRunner
from mlc_lora.runner.pool import PAD_SEQUENCE_IDS
from mlc_lora.runner.single import decode_sizes

from .conftest import POOL_PAGES


def test_decode_sizes_follow_the_capture_sizes():
    assert decode_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and decode_sizes(256)[-2:] == [248, 256]
    assert len(decode_sizes(256)) == 35
    assert decode_sizes(8) == [1, 2, 4, 8] and decode_sizes(6) == [1, 2, 4, 6] and decode_sizes(1) == [1]


@pytest.fixture(scope="module")
def runner(qv_models):
    return ModelRunner(qv_models[1][1])


def _pool(runner):
    return runner.create_pool(max_batch_size=8, max_total_seq_len=(POOL_PAGES - 1) * 16, prefill_chunk_size=64)


def _logits(x):
    return np.asarray(x.numpy(), np.float64)


@pytest.mark.parametrize("adapters", [(0, None, 0), (None, None, None)])
def test_padded_decode_returns_the_same_logits_and_gives_its_pages_back(runner, qv_models, adapters):
    """Three sequences (on an adapter, or all on the base model: the LoRA or the base functions)
    padded to four; the same step unpadded gives the same rows."""
    pool = _pool(runner)
    pool.load_adapter(0, qv_models[0] / "qv8")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, runner.vocab_size, n).tolist() for n in (5, 9, 3)]
    for sid, (p, a) in enumerate(zip(prompts, adapters)):
        pool.add_sequence(sid)
        pool.set_sequence_adapter(sid, a)
    lora = "pool" if any(a is not None for a in adapters) else None
    runner.prefill(pool, [0, 1, 2], prompts, lora=lora)
    tokens = [int(t) for t in rng.integers(0, runner.vocab_size, 3)]
    free = pool.available_pages()
    runner.decode_sizes = []
    want = _logits(runner.decode(pool, [0, 1, 2], tokens, lora=lora))
    for sid in range(3):
        pool.popn(sid, 1)  # the same step again
    assert pool.available_pages() == free
    runner.decode_sizes = decode_sizes(8)
    got = runner.decode(pool, [0, 1, 2], tokens, lora=lora)
    assert tuple(got.shape) == (3, runner.vocab_size)
    np.testing.assert_allclose(_logits(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # one padding sequence took part (3 -> 4) and holds nothing now
    assert pool.sequence_length(PAD_SEQUENCE_IDS) == 0
    assert pool.available_pages() == free - sum(
        1 for sid in range(3) if pool.sequence_length(sid) % 16 == 1)  # a real sequence may open a page
    pool.check_invariants()


def test_no_padding_where_the_pool_has_no_page_to_spare(runner):
    """Five sequences of a page each in a 12-page pool leave 7 pages: not enough for 5 + 3."""
    pool = _pool(runner)
    runner.decode_sizes = decode_sizes(8)
    for sid in range(5):
        pool.add_sequence(sid)
    runner.prefill(pool, list(range(5)), [[1, 2, 3]] * 5)
    assert pool.available_pages() == POOL_PAGES - 5
    assert runner._padding(pool, 5, None) == []  # pylint: disable=protected-access
    assert runner._padding(pool, 3, None) == [PAD_SEQUENCE_IDS]  # pylint: disable=protected-access
    assert runner._padding(pool, 4, None) == []  # pylint: disable=protected-access  (a size already)
    assert runner._padding(pool, 3, {"lora_arena": None}) == []  # pylint: disable=protected-access
    got = runner.decode(pool, list(range(5)), [4] * 5)
    assert tuple(got.shape) == (5, runner.vocab_size)
    pool.check_invariants()


def test_capture_runs_every_size_and_leaves_the_pool_as_it_was(runner):
    pool = _pool(runner)
    runner.decode_sizes = decode_sizes(8)
    free = pool.available_pages()
    calls = []
    assert runner.capture_decode_graphs(pool, lambda done, total: calls.append((done, total))) == 4
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert pool.available_pages() == free
    assert all(pool.sequence_length(PAD_SEQUENCE_IDS + i) == 0 for i in range(8))
    pool.check_invariants()
    runner.decode_sizes = []
    assert runner.capture_decode_graphs(pool) == 0  # no CUDA graphs: nothing to capture


def test_a_pool_without_pages_for_the_padding_runs_the_batch_unpadded(runner, monkeypatch):
    """Padding the pool cannot hold (forced past the runner's own check) is dropped: the step runs
    as it is, with the logits of the unpadded step."""
    pool = _pool(runner)
    runner.decode_sizes = []
    for sid in range(3):
        pool.add_sequence(sid)
    for sid in range(3):
        runner.prefill(pool, [sid], [list(range(1, 41))])  # 3 pages each, 3 left
    want = _logits(runner.decode(pool, [0, 1, 2], [7, 8, 9]))
    for sid in range(3):
        pool.popn(sid, 1)
    runner.decode_sizes = decode_sizes(8)
    monkeypatch.setattr(runner, "_padding", lambda p, b, lora: p.padding_sequences(8 - b))  # 5 pads, 5 pages
    got = runner.decode(pool, [0, 1, 2], [7, 8, 9])
    np.testing.assert_allclose(_logits(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert all(pool.sequence_length(PAD_SEQUENCE_IDS + i) == 0 for i in range(5))
    assert pool.available_pages() == POOL_PAGES - 9
    pool.check_invariants()
