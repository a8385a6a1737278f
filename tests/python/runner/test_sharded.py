"""Tensor parallelism on CPU: K = 2 and 4 shards of a tiny Llama with mixed LoRA batches, each shard
a disco worker thread, the all-reduces computed by the numpy reference collectives
(mlc_lora.runner.disco.NumpyCCL), against the same model compiled unsharded (docs/TP.md)."""

import json

import numpy as np
import pytest
import torch
import transformers

from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.errors import MLCLoraError
from mlc_lora.lora import pack_peft_adapter
from mlc_lora.lora.layout import layout_adapter
from mlc_lora.models.llama import LlamaConfig
from mlc_lora.runner import ModelRunner, ShardedModelRunner
from mlc_lora.runner.disco import make_session, numpy_ccl_of

from ..conftest import save_adapter

# 8 query heads and 4 KV heads (GQA 2:1): both divide by 4.
CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=2, vocab_size=128, tie_word_embeddings=False)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # ranks 8 to 64, different targets (column- and row-parallel modules)
    1: dict(r=8, lora_alpha=16, target_modules=ALL),
    2: dict(r=16, lora_alpha=32, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
    3: dict(r=32, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    4: dict(r=64, lora_alpha=8, target_modules=ALL),
}
REQUESTS = [(1, [1, 5, 7, 9, 3, 11, 2]), (None, [2, 4, 6]), (3, [10, 11, 12, 13, 14, 15, 16, 17, 18]),
            (2, [3, 3, 8]), (4, [7, 1, 9, 20, 21]), (1, [30, 31]), (None, [9])]
DECODE_STEPS = 3
POOL_PAGES = 320  # K = 4 pages are a quarter of the size; adapter slices shrink less


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=512, **CONFIG)).eval()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    base.save_pretrained(root / "hf", safe_serialization=True)
    for aid, kw in ADAPTERS.items():
        save_adapter(base, root / f"adapter{aid}", 300 + aid, **kw)
    compiled = {k: compile_model(root / "hf", root / f"k{k}", CompileOptions(
        prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=POOL_PAGES, max_lora_rank=64,
        tensor_parallel_shards=k), progress=False) for k in (1, 2, 4)}
    return root, compiled


def _run(runner, pool, load):
    """Load the adapters, prefill every request in one mixed batch, then decode; all logits."""
    for aid in (3, 1, 4, 2):
        load(aid)
    seqs = list(range(len(REQUESTS)))
    for s, (aid, _) in enumerate(REQUESTS):
        pool.add_sequence(s)
        pool.set_sequence_adapter(s, aid)
    out = [runner.prefill(pool, seqs, [p for _, p in REQUESTS], lora="pool").numpy().copy()]
    rng = np.random.default_rng(0)
    for _ in range(DECODE_STEPS):
        out.append(runner.decode(pool, seqs, rng.integers(0, 128, len(seqs)).tolist(), lora="pool").numpy().copy())
    return out


def _unsharded(root, folder):
    """The same traffic on the unsharded model, adapters packed here (pack_peft_adapter)."""
    r = ModelRunner(folder)
    pool = r.create_pool(16, (POOL_PAGES - 1) * 16, 128)
    out = _run(r, pool, lambda aid: pool.load_packed_adapter(aid, pack_peft_adapter(root / f"adapter{aid}", r.config)))
    return out, pool.stats()


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_logits_match_unsharded(models, shards):
    root, compiled = models
    want, stats1 = _unsharded(root, compiled[1])
    r = ShardedModelRunner(compiled[shards])
    assert r.config["tensor_parallel_shards"] == shards == r.num_shards
    pool = r.create_pool(16, (POOL_PAGES - 1) * 16, 128)
    assert pool.num_shards == shards
    ccl = numpy_ccl_of(r.sess)
    calls0 = ccl.calls

    def load(aid):
        plan = pool.load_adapter(aid, root / f"adapter{aid}")  # workers pack, the controller plans
        assert (plan.name, plan.rank, plan.num_pages) == (f"adapter{aid}", ADAPTERS[aid]["r"], _pages(r, aid))

    got = _run(r, pool, load)
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    print(f"K={shards}: max abs error vs unsharded {worst:.2e} over {len(got)} steps")
    assert worst < 1e-4
    # Two all-reduces per layer and step went through the numpy collectives.
    L = CONFIG["num_hidden_layers"]
    assert ccl.calls - calls0 >= 2 * L * (1 + DECODE_STEPS)
    # The adapters matter (an adapter request differs from its base-model logits).
    base = ShardedModelRunner(compiled[shards], session=r.sess)
    base_pool = base.create_pool(16, 256, 128)
    base_pool.add_sequence(0)
    plain = base.prefill(base_pool, [0], [REQUESTS[0][1]]).numpy()[0]
    assert np.abs(plain - got[0][0]).max() > 1e-2

    # Page accounting: every shard holds the same number of pages, each exactly its slices' layout.
    cfg = LlamaConfig(**r.model_config)
    want_pages = sum(_pages(r, aid) for aid in ADAPTERS)
    stats = pool.shard_stats()
    assert len(stats) == shards
    for s in stats:
        assert s == stats[0], "shards' pools out of step"
        assert s.adapter_pages == want_pages and s.loaded_adapters == len(ADAPTERS)
        assert s.page_elems == 2 * (cfg.num_key_value_heads // shards) * 16 * cfg.head_dim
        assert s.total_pages == stats1.total_pages
        assert s.kv_pages == stats1.kv_pages
    # A shard's slice of an adapter is smaller than the whole adapter: per-shard pages never exceed
    # the unsharded count (ranks fill pages of 1/K the size with rows of at most the same length).
    assert 0 < want_pages
    r.sess.shutdown()


def _pages(runner, aid):
    """Pages of one shard's slices of adapter `aid` (its layout at the shard's module sizes)."""
    spec = runner.lora
    mods = {m.name: m for m in spec.modules}
    kw = ADAPTERS[aid]
    return layout_adapter(spec.page_elems, [mods[n] for n in kw["target_modules"]], kw["r"]).num_pages


def test_unload_pin_and_eviction_stay_in_step(models):
    """A pinned and an idle adapter under KV pressure: the idle one is evicted on every shard, the
    pinned one stays, and the evicted one is paged back in (same logits as unsharded)."""
    root, compiled = models
    r = ShardedModelRunner(compiled[2])
    pinned, idle = 2, 1
    pages = _pages(r, pinned) + _pages(r, idle) + 4
    pool = r.create_pool(8, (pages - 1) * 16, 128)
    pool.load_adapter(pinned, root / f"adapter{pinned}", pin=True)
    pool.load_adapter(idle, root / f"adapter{idle}")
    before = pool.shard_stats()
    assert before[0] == before[1] and before[0].free_pages == 4
    pool.add_sequence(0)
    long = np.random.default_rng(1).integers(0, 128, 4 * 16 + 8).tolist()
    r.prefill(pool, [0], [long], lora="pool")  # needs the idle adapter's pages
    after = pool.shard_stats()
    assert after[0] == after[1]
    res = [info.resident for a in (pinned, idle) for info in pool.shard_adapter_info(a)]
    assert res == [True, True, False, False], res
    pool.remove_sequence(0)
    pool.add_sequence(1)
    pool.set_sequence_adapter(1, 1)
    got = r.prefill(pool, [1], [REQUESTS[0][1]], lora="pool").numpy()[0]
    assert all(info.resident for info in pool.shard_adapter_info(1))
    want, _ = _unsharded(root, compiled[1])
    np.testing.assert_allclose(got, want[0][0], atol=1e-4, rtol=0)
    pool.check_invariants()
    pool.pin_adapter(pinned, False)
    pool.unload_adapter(pinned)
    s = pool.shard_stats()
    assert s[0] == s[1] and s[0].loaded_adapters == 1
    r.sess.shutdown()


def test_config_records_the_shard_count(models):
    _, compiled = models
    cfg = json.loads((compiled[4] / "mlc-lora-config.json").read_text())
    assert cfg["tensor_parallel_shards"] == 4 and cfg["model_config"]["tensor_parallel_shards"] == 4
    assert cfg["lora"]["tensor_parallel_shards"] == 4
    with pytest.raises(MLCLoraError, match="compiled for 4 tensor-parallel shards; the session has 2"):
        ShardedModelRunner(compiled[4], session=make_session(2))


def test_engine_serves_a_sharded_model(models):
    """MLCEngine opens a K = 2 model as one worker per shard (nothing to choose but the compile
    option): greedy tokens and their logprobs equal the unsharded engine's, adapters by name."""
    from mlc_lora import MLCEngine

    root, compiled = models
    out = {}
    for k in (1, 2):
        with MLCEngine(compiled[k], "cpu") as eng:
            assert eng.engine.runner.num_shards == k
            for aid in (1, 4):
                eng.load_adapter(f"a{aid}", root / f"adapter{aid}")
            res = []
            for aid, prompt in REQUESTS[:5]:
                name = None if aid not in (1, 4) else f"a{aid}"
                c = eng.completions.create(prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True,
                                           logprobs=True, adapter_id=name).choices[0]
                res.append((c.token_ids, c.logprobs.token_logprobs))
            listed = {a["name"]: a for a in eng.list_adapters()}
        out[k] = (res, listed)
    for (t1, l1), (t2, l2) in zip(out[1][0], out[2][0]):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-4
    assert out[2][1]["a4"]["rank"] == 64 and out[2][1]["a4"]["resident"]


def test_prefix_cache_stays_in_step_across_shards(models):
    """The prefix cache on a K = 2 model: every shard keys and reuses the same pages (pool stats
    equal), and the greedy tokens with hits equal the unsharded engine's without the cache."""
    from mlc_lora import MLCEngine

    root, compiled = models
    prompt = [(9 * i + 4) % 128 for i in range(40)]  # 2 full pages before the last token
    out = {}
    for k, cache in ((1, False), (2, True)):
        with MLCEngine(compiled[k], "cpu", enable_prefix_caching=cache) as eng:
            eng.load_adapter("a1", root / "adapter1")
            out[k] = [eng.completions.create(prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True,
                                             adapter_id=name).choices[0].token_ids
                      for name in ("a1", None, "a1", None)]
            if cache:
                s = eng.engine.pool.shard_stats()
                assert s[0] == s[1]
                assert s[0].prefix_hit_tokens == 2 * 2 * 16 and s[0].cached_pages == 4
                eng.engine.pool.check_invariants()
    assert out[2] == out[1]


def test_sharded_int8_rows_run_near_unsharded(models, tmp_path):
    """int8 adapter rows under tensor parallelism: each shard packs and quantizes its own slices of
    the rows (their scales are the slices' own), so the logits are near, not equal to, those of the
    unsharded int8 library, and nearer still to the float32 rows': every error well below the
    adapters' effect; the pools stay in step."""
    root, compiled = models
    opts = dict(prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=POOL_PAGES, max_lora_rank=64,
                lora_kernel="sgmv", lora_rows="int8")
    one = compile_model(root / "hf", tmp_path / "int8-k1", CompileOptions(**opts), progress=False)
    two = compile_model(root / "hf", tmp_path / "int8-k2", CompileOptions(**opts, tensor_parallel_shards=2),
                        progress=False)
    want, _ = _unsharded(root, one)
    full, _ = _unsharded(root, compiled[1])
    r = ShardedModelRunner(two)
    assert r.lora.rows == "int8"
    pool = r.create_pool(16, (POOL_PAGES - 1) * 16, 128)
    got = _run(r, pool, lambda aid: pool.load_adapter(aid, root / f"adapter{aid}"))
    rel = max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want))
    rel_full = max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, full))
    base = ShardedModelRunner(two, session=r.sess)
    base_pool = base.create_pool(16, 256, 128)
    base_pool.add_sequence(0)
    plain = base.prefill(base_pool, [0], [REQUESTS[0][1]]).numpy()[0]
    effect = float(np.linalg.norm(full[0][0] - plain) / np.linalg.norm(full[0][0]))
    print(f"K=2 int8 rows: rel err vs unsharded int8 {rel:.2e}, vs float32 rows {rel_full:.2e}; effect {effect:.2e}")
    assert 0 < rel < effect / 20 and rel_full < effect / 20
    stats = pool.shard_stats()
    assert stats[0] == stats[1] and stats[0].loaded_adapters == len(ADAPTERS)
    r.sess.shutdown()
