"""A LoRA-compiled tiny Llama fed by the pool's own tables, against HF transformers + PEFT.

The adapters live in the pool's arena (loaded through Pool.load_packed_adapter), the per-batch
tables come from Pool.lora_tables after begin_forward, and an adapter evicted by KV pressure is
paged back in from its host copy when its sequence returns.
"""


import numpy as np
import pytest
import torch
import tvm

from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.lora import pack_peft_adapter
from mlc_lora.lora.layout import PackedAdapter
from mlc_lora.runner import ModelRunner

from ..conftest import make_tiny_hf_model, save_adapter

POOL_PAGES = 48
ADAPTERS = {
    1: dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                "up_proj", "down_proj"]),
    2: dict(r=16, lora_alpha=32, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    3: dict(r=8, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-lora")
    base = make_tiny_hf_model(root / "hf", "gqa")
    refs = {None: base}
    for aid, kw in ADAPTERS.items():
        refs[aid] = save_adapter(base, root / f"adapter{aid}", 200 + aid, **kw)
    compiled = compile_model(root / "hf", root / "lora", CompileOptions(
        prefill_chunk_size=128, max_batch_size=8, lora_pool_pages=POOL_PAGES, max_lora_rank=16),
        progress=False)
    runner = ModelRunner(compiled)
    spec = runner.lora
    packed = {aid: pack_peft_adapter(root / f"adapter{aid}", runner.config) for aid in ADAPTERS}
    return runner, spec, packed, refs


def forward(r, pool, seq_ids, tokens):
    """prefill (or decode when every sequence has one token) with the pool's tables, calling the
    compiled functions directly."""
    lens = [len(t) for t in tokens]
    flat = np.concatenate([np.asarray(t, np.int32) for t in tokens])
    emb = r.embed(flat)
    pool.begin_forward(seq_ids, lens)
    tables = pool.lora_tables()
    if all(n == 1 for n in lens):
        logits, _ = r.vm["decode"](emb._create_view((len(lens), 1, emb.shape[-1])), pool.handle, *tables,
                                   r.params)
    else:
        last = tvm.runtime.tensor(np.cumsum(lens).astype(np.int32) - 1, r.device)
        logits, _ = r.vm["prefill"](emb._create_view((1, len(flat), emb.shape[-1])), last, pool.handle,
                                    *tables, r.params)
    pool.end_forward()
    return logits.numpy().reshape(len(lens), -1)


def peft_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].numpy()


def new_pool(r):
    # The compiled lora_arena is (L * pool_pages * E,): the pool must have exactly pool_pages pages
    # (TVM's rule, kept by ours: ceil(max_total_seq_len / 16) + 1).
    pool = r.create_pool(max_batch_size=8, max_total_seq_len=(POOL_PAGES - 1) * 16, prefill_chunk_size=128)
    assert pool.stats().total_pages == POOL_PAGES
    return pool


def test_pool_tables_drive_the_lora_kernels(setup):
    r, _, packed, refs = setup
    pool = new_pool(r)
    for aid in (3, 1, 2):
        pool.load_packed_adapter(aid, packed[aid])
    n_pages = sum(p.pages.shape[1] for p in packed.values())
    assert pool.stats().adapter_pages == n_pages
    reqs = [(1, [1, 5, 7, 9, 3, 11, 2]), (None, [2, 4, 6]), (2, list(range(10, 30))), (3, [3, 3, 8]),
            (1, [30, 31])]
    for s, (aid, _) in enumerate(reqs):
        pool.add_sequence(s)
        pool.set_sequence_adapter(s, aid)
    toks = [list(p) for _, p in reqs]
    out = forward(r, pool, list(range(len(reqs))), toks)
    rng = np.random.default_rng(0)
    for step in range(3):
        for row, (aid, _) in enumerate(reqs):
            np.testing.assert_allclose(out[row], peft_logits(refs[aid], toks[row]), atol=1e-4, rtol=0)
        nxt = rng.integers(0, r.vocab_size, len(reqs)).tolist()
        for row in range(len(reqs)):
            toks[row].append(nxt[row])
        out = forward(r, pool, list(range(len(reqs))), [[t] for t in nxt])
    # The adapters matter.
    assert np.abs(out[0] - peft_logits(refs[None], toks[0])).max() > 1e-2
    # A fork inherits its parent's adapter and shares its KV pages.
    pool.fork_sequence(2, 9, -1)
    out = forward(r, pool, [9], [[5]])
    np.testing.assert_allclose(out[0], peft_logits(refs[2], toks[2] + [5]), atol=1e-4, rtol=0)


def test_evicted_adapter_is_paged_back_in(setup):
    r, spec, packed, refs = setup
    n = {aid: p.pages.shape[1] for aid, p in packed.items()}
    pool = new_pool(r)
    for aid in (1, 2, 3):
        pool.load_packed_adapter(aid, packed[aid])
    # A pinned filler adapter (rank 1, targets nothing) leaves 4 pages free.
    filler = POOL_PAGES - sum(n.values()) - 4
    L, E, M, R = spec.num_layers, spec.page_elems, len(spec.modules), spec.max_rank
    none = np.full((M, R), -1, np.int32)
    pool.load_packed_adapter(99, PackedAdapter(np.zeros((L, filler, E), np.float32), none, none, 1,
                                               np.zeros(M, np.float32)), pin=True)
    assert pool.stats().free_pages == 4
    pool.add_sequence(0)
    long_prompt = np.random.default_rng(1).integers(0, r.vocab_size, 16 * 5 - 3).tolist()
    # KV for the base-model prompt evicts the least recently used idle adapter: 1.
    out = forward(r, pool, [0], [long_prompt])
    np.testing.assert_allclose(out[0], peft_logits(refs[None], long_prompt), atol=1e-4, rtol=0)
    resident = {aid: pool.adapter_info(aid).resident for aid in ADAPTERS}
    assert resident == {1: False, 2: True, 3: True}
    pool.remove_sequence(0)
    # Adapter 1's sequence arrives: paged back in from the host copy, on other page ids.
    pool.add_sequence(1)
    pool.set_sequence_adapter(1, 1)
    prompt = [4, 8, 15, 16, 23, 42]
    out = forward(r, pool, [1], [prompt])
    assert pool.adapter_info(1).resident
    np.testing.assert_allclose(out[0], peft_logits(refs[1], prompt), atol=1e-4, rtol=0)
    pool.check_invariants()
