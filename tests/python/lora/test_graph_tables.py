"""ModelRunner's LoRA tables for decode under CUDA graphs (`graph_tables`), exercised on CPU.

A captured graph replays the addresses and the slot count it was captured with, so the runner
passes the pool's own tables (fixed-address buffers) at `max_batch_size` slots, with rows past the
batch's slots zero before any batch writes them and earlier batches' slots after.
Here the same llvm sgmv model runs with that mode forced on and off: the logits must agree for
batches with different adapter mixes, and the mode must pass the same buffers, at the same size,
whatever the batch's adapters.
"""

import json

import numpy as np
import pytest
import torch

from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.errors import MLCLoraError
from mlc_lora.lora.layout import pack_adapter
from mlc_lora.models.random_model import random_adapter
from mlc_lora.runner import ModelRunner

from ..conftest import make_tiny_hf_model

MAX_BATCH = 8


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-tables")
    make_tiny_hf_model(root / "hf", "gqa")
    return compile_model(root / "hf", root / "lora", CompileOptions(
        prefill_chunk_size=64, max_batch_size=MAX_BATCH, lora_pool_pages=64, max_lora_rank=16,
        lora_kernel="sgmv"), progress=False)


def _engine_like(folder, graph):
    """A runner + pool with three adapters (ranks 4, 8, 16) and six sequences prefilled."""
    r = ModelRunner(folder)
    r.graph_tables = graph
    kv = r.create_pool(MAX_BATCH, 63 * 16, 64)
    spec = r.lora
    mc = r.model_config
    for aid, rank in enumerate((4, 8, 16)):
        ad = random_adapter(f"a{aid}", mc, spec.module_names, rank, torch, "cpu", seed=aid)
        p = pack_adapter(spec, ad, np.float32)
        kv.load_packed_adapter(aid, p, False)
    adapters = [0, None, 1, 2, 0, 1]
    for s, aid in enumerate(adapters):
        kv.add_sequence(s)
        kv.set_sequence_adapter(s, aid)
    rng = np.random.default_rng(0)
    r.prefill(kv, list(range(6)), [rng.integers(0, r.vocab_size, 5 + s).tolist() for s in range(6)], lora="pool")
    return r, kv


def test_fixed_tables_give_the_same_logits_at_fixed_addresses_and_size(compiled):
    ref, kv_ref = _engine_like(compiled, graph=False)
    r, kv = _engine_like(compiled, graph=True)
    seen = []
    decode = r._decode  # pylint: disable=protected-access

    def spy(emb, kv_, *rest):
        tables = rest[:6]
        seen.append([(t.data_ptr(), tuple(t.shape)) for t in tables])
        return decode(emb, kv_, *rest)

    r._decode = spy  # pylint: disable=protected-access
    # batches with 3, 1 and 2 distinct adapters (and a base-only one): slot counts 3, 1, 2, 1
    for seqs in ([0, 1, 2, 3, 4, 5], [1], [2, 5], [0, 4], [1, 3]):
        toks = [(7 * s + len(seen)) % ref.vocab_size for s in seqs]
        want = ref.decode(kv_ref, seqs, toks, lora="pool").numpy()
        got = r.decode(kv, seqs, toks, lora="pool").numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # the slot tables (rank, scale, a_off, b_off): same buffers, max_batch_size slots, every batch
    M, R = len(r.lora.modules), r.lora.max_rank
    for call in seen:
        assert [shape for _, shape in call[2:]] == [(MAX_BATCH,), (MAX_BATCH, M), (MAX_BATCH, M, R),
                                                    (MAX_BATCH, M, R)]
    assert len({tuple(ptr for ptr, _ in call[2:]) for call in seen}) == 1
    # the arena and the token slots (a (batch,) view of one buffer) keep their addresses too
    assert len({call[0][0] for call in seen}) == 1 and len({call[1][0] for call in seen}) == 1
    # the base-only batch ([1]) ran the functions without LoRA inputs: four LoRA calls for five steps
    assert len(seen) == 4
    # and the adapters mattered: the mixed batch differs from the base model's rows
    assert ref.decode(kv_ref, [0, 1], [3, 3], lora="pool").numpy().std(0).max() > 1e-3


def test_a_second_kv_cache_is_refused_under_graphs(compiled):
    r, kv = _engine_like(compiled, graph=True)
    r.decode(kv, [0], [1], lora="pool")
    kv2 = r.create_pool(MAX_BATCH, 63 * 16, 64)
    spec = r.lora
    ad = random_adapter("b", r.model_config, spec.module_names, 4, torch, "cpu", seed=9)
    kv2.load_packed_adapter(0, pack_adapter(spec, ad, np.float32))
    kv2.add_sequence(0)
    kv2.set_sequence_adapter(0, 0)
    r.prefill(kv2, [0], [[1, 2, 3]], lora="pool")
    with pytest.raises(MLCLoraError, match="first pool"):
        r.decode(kv2, [0], [1], lora="pool")
    # the refused step left the cache usable
    assert int(kv2.sequence_length(0)) == 3


def test_batches_without_adapters_run_the_base_functions(compiled):
    """No token on an adapter: decode_base / prefill_base (no LoRA inputs, no LoRA kernels), with the
    logits of the LoRA functions on empty tables."""
    r, kv = _engine_like(compiled, graph=False)
    calls = []
    base_prefill, base_decode = r._base_fns  # pylint: disable=protected-access
    r._base_fns = (lambda *a: calls.append("prefill") or base_prefill(*a),  # pylint: disable=protected-access
                   lambda *a: calls.append("decode") or base_decode(*a))
    got = r.decode(kv, [1], [5], lora="pool").numpy()
    kv.add_sequence(7)
    r.prefill(kv, [7], [[4, 5, 6]], lora="pool")
    assert calls == ["decode", "prefill"]
    r._base_fns = None  # pylint: disable=protected-access  (the LoRA functions, inert tables)
    kv.popn(1, 1)
    want = r.decode(kv, [1], [5], lora=None).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
