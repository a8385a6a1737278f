"""The prefix cache (`enable_prefix_caching`) on the tiny random Llama with LoRA, against HF
transformers + PEFT: KV pages are reused by later requests of the same adapter (and of the base
model) only, never across adapters or across an unload and reload under one name; on small pools
cached pages and idle adapters are evicted by one policy, outputs stay identical to PEFT, and the
pool's bookkeeping holds after every step of a random mixed run."""

from __future__ import annotations

import numpy as np
import pytest

from mlc_lora import MLCEngine
from mlc_lora.compile import CompileOptions
from mlc_lora.contract import PAGE_SIZE
from mlc_lora.engine import LLMEngine, SamplingParams
from mlc_lora.errors import PoolExhaustedError

from ..conftest import make_tiny_hf_model, save_adapter
from .test_lora_engine import peft_greedy

# a 2-page "system prompt" shared by many requests, and a long prompt that starts with it
SYSTEM = [(5 * i + 3) % 128 for i in range(2 * PAGE_SIZE)]
PROMPT = SYSTEM + [(11 * i + 1) % 128 for i in range(22)]  # 54 tokens: 3 full pages
# every adapter targets k_proj or v_proj: its KV differs from the base model's in layer 0 already
ADAPTERS = {"a1": dict(seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"]),
            "a2": dict(seed=2, r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"]),
            "a3": dict(seed=3, r=8, lora_alpha=8, target_modules=["k_proj", "gate_proj"]),
            "a1_new": dict(seed=4, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"])}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, compile_once):
    """(libraries by pool size, adapter folders, PEFT references by adapter name, None: base)."""
    root = tmp_path_factory.mktemp("prefix")
    base = make_tiny_hf_model(root / "hf", "gqa")
    refs, folders = {None: base}, {}
    for name, kw in ADAPTERS.items():
        kw = dict(kw)
        folders[name] = root / name
        refs[name] = save_adapter(base, folders[name], kw.pop("seed"), **kw)
    libs = {pages: compile_once(root / "hf", CompileOptions(
        prefill_chunk_size=64, max_batch_size=8, lora_pool_pages=pages, max_lora_rank=8)) for pages in (64, 20)}
    return libs, folders, refs


_REFS: dict = {}


def want(refs, adapter, prompt, n):
    key = (adapter, tuple(prompt), n)
    if key not in _REFS:
        _REFS[key] = peft_greedy(refs[adapter], prompt, n)[0]
    return _REFS[key]


def complete(eng, prompt, adapter, n=5):
    out = eng.completions.create(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, adapter_id=adapter)
    return out.choices[0].token_ids


def hits(eng):
    return eng.stats()["prefix_cache_hit_tokens"]


def run_to_end(eng, check=False):
    while eng.has_work():
        eng.step()
        if check:
            eng.pool.check_invariants()


def add(eng, prompt, adapter, n, outs=None, **params):
    toks = []
    seq = eng.make_sequence(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **params), adapter,
                            sink=lambda o: toks.extend(s.token for s in o.tokens))
    eng.add(seq)
    if outs is not None:
        outs.append((seq, adapter, prompt, n, toks))
    return seq, toks


def test_off_by_default_caches_nothing(setup):
    libs, folders, refs = setup
    with MLCEngine(libs[64], "cpu") as eng:
        eng.load_adapter("a1", folders["a1"])
        for _ in range(2):
            assert complete(eng, PROMPT, "a1") == want(refs, "a1", PROMPT, 5)
        s = eng.stats()
        assert not s["prefix_caching"]
        assert (s["prefix_cache_queries"], s["prefix_cache_pages"], s["prefix_cache_hit_tokens"]) == (0, 0, 0)
        assert s["pool_pages_free"] + s["pool_pages_adapter"] == s["pool_pages_total"]


def test_same_adapter_hits_other_adapters_and_the_base_model_never_share(setup):
    libs, folders, refs = setup
    with MLCEngine(libs[64], "cpu", enable_prefix_caching=True) as eng:
        eng.load_adapter("a1", folders["a1"])
        eng.load_adapter("a2", folders["a2"])
        # one prompt, three keys: each computes its own pages (54 + 4 KV tokens: 3 full pages each)
        for i, adapter in enumerate(("a1", "a2", None)):
            assert complete(eng, PROMPT, adapter) == want(refs, adapter, PROMPT, 5), adapter
            s = eng.stats()
            assert (s["prefix_cache_hit_tokens"], s["prefix_cache_pages"]) == (0, 3 * (i + 1))
        # each again: all 3 pages hit, the same tokens
        for adapter in ("a1", "a2", None):
            before = hits(eng)
            assert complete(eng, PROMPT, adapter) == want(refs, adapter, PROMPT, 5), adapter
            assert hits(eng) - before == 3 * PAGE_SIZE
        # a prompt that shares only the system prompt hits its 2 pages
        other = SYSTEM + [9, 8, 7, 6, 5]
        before = hits(eng)
        assert complete(eng, other, "a2") == want(refs, "a2", other, 5)
        assert hits(eng) - before == 2 * PAGE_SIZE
        # a prompt of exactly 2 pages leaves its last token to compute: 1 page hits
        before = hits(eng)
        assert complete(eng, SYSTEM, None) == want(refs, None, SYSTEM, 5)
        assert hits(eng) - before == PAGE_SIZE
        s = eng.stats()
        assert s["prefix_cache_queries"] == 8
        rate = s["prefix_cache_hit_tokens"] / s["prefix_cache_query_tokens"]
        assert s["prefix_cache_hit_rate"] == pytest.approx(rate)
        assert s["pool_pages_kv"] == 0 and s["prefix_cache_idle_pages"] == s["prefix_cache_pages"]
        assert s["pool_pages_free"] + s["pool_pages_adapter"] + s["prefix_cache_idle_pages"] == s["pool_pages_total"]


def test_two_adapters_one_prompt_at_once_hold_disjoint_pages(setup):
    """With a1's pages of the prompt cached, a1 and a2 run it side by side: a1 holds the cached
    pages, a2 none of them (it computes its own), and each matches its own PEFT reference."""
    libs, folders, refs = setup
    eng = LLMEngine(libs[64], "cpu", enable_prefix_caching=True)
    for name in ("a1", "a2"):
        eng.adapters.load(name, folders[name])
    _, toks = add(eng, PROMPT, "a1", 4)
    run_to_end(eng)
    assert toks == want(refs, "a1", PROMPT, 4)
    cached = eng.pool.stats().cached_pages
    assert cached == 3
    s1, t1 = add(eng, PROMPT, "a1", 6)
    s2, t2 = add(eng, PROMPT, "a2", 6)
    s0, t0 = add(eng, PROMPT, None, 6)
    eng.step()  # a1 computes 6 tokens after its hit, a2 all 54, the base model the chunk's last 4
    assert (s1.num_cached, s2.num_cached, s0.num_cached) == (len(PROMPT), len(PROMPT), 4)
    eng.step()  # the base model's prompt is in: everyone's first 3 pages hold the prompt's KV
    assert (s1.num_cached, s2.num_cached, s0.num_cached) == (len(PROMPT) + 1, len(PROMPT) + 1, len(PROMPT))
    p1, p2, p0 = (set(eng.pool.sequence_pages(s.seq_id)) for s in (s1, s2, s0))
    assert not p1 & p2 and not p1 & p0 and not p2 & p0
    assert eng.pool.stats().prefix_hit_tokens == 3 * PAGE_SIZE  # a1's hit only
    run_to_end(eng, check=True)
    assert t1 == want(refs, "a1", PROMPT, 6)
    assert t2 == want(refs, "a2", PROMPT, 6)
    assert t0 == want(refs, None, PROMPT, 6)
    assert t1 != t2 and t1 != t0  # the adapters change the output: shared KV would show


def test_prompt_logprobs_requests_compute_their_whole_prompt(setup):
    libs, folders, refs = setup
    eng = LLMEngine(libs[64], "cpu", enable_prefix_caching=True)
    eng.adapters.load("a1", folders["a1"])
    add(eng, PROMPT, "a1", 2)
    run_to_end(eng)
    seq, toks = add(eng, PROMPT, "a1", 2, prompt_logprobs=True)
    run_to_end(eng)
    assert eng.pool.stats().prefix_hit_tokens == 0
    assert len(seq.state.prompt_logprobs) == len(PROMPT)
    assert toks == want(refs, "a1", PROMPT, 2)


def test_unload_and_reload_under_one_name_does_not_reuse_old_kv(setup):
    libs, folders, refs = setup
    with MLCEngine(libs[64], "cpu", enable_prefix_caching=True) as eng:
        eng.load_adapter("x", folders["a1"])
        assert complete(eng, PROMPT, "x") == want(refs, "a1", PROMPT, 5)
        assert complete(eng, PROMPT, "x") == want(refs, "a1", PROMPT, 5)
        assert hits(eng) == 3 * PAGE_SIZE and eng.stats()["prefix_cache_pages"] == 3
        eng.unload_adapter("x")
        assert eng.stats()["prefix_cache_pages"] == 0  # its keys went with it
        eng.load_adapter("x", folders["a1_new"])  # same name, same shapes, new weights
        assert complete(eng, PROMPT, "x") == want(refs, "a1_new", PROMPT, 5)
        assert hits(eng) == 3 * PAGE_SIZE  # no hit
        assert want(refs, "a1_new", PROMPT, 5) != want(refs, "a1", PROMPT, 5)
        assert complete(eng, PROMPT, "x") == want(refs, "a1_new", PROMPT, 5)
        assert hits(eng) == 6 * PAGE_SIZE  # the new adapter's own pages hit


def test_unload_while_running_keeps_its_kv_until_done_then_drops_it(setup):
    """An adapter unloaded while its request runs: the request finishes on it, its pages leave the
    cache with the adapter, and a reload under the name starts cold."""
    libs, folders, refs = setup
    eng = LLMEngine(libs[64], "cpu", enable_prefix_caching=True)
    eng.adapters.load("x", folders["a1"])
    _, toks = add(eng, PROMPT, "x", 8)
    eng.step()
    eng.step()
    eng.adapters.unload("x")
    eng.adapters.load("x", folders["a1_new"])
    _, toks_new = add(eng, PROMPT, "x", 8)
    run_to_end(eng, check=True)
    assert toks == want(refs, "a1", PROMPT, 8)
    assert toks_new == want(refs, "a1_new", PROMPT, 8)
    assert eng.pool.stats().prefix_hit_tokens == 0
    assert eng.pool.stats().cached_pages == 3  # the new adapter's 3 full pages (54 + 7 tokens of KV)


def test_small_pool_evicts_cached_pages_and_adapters_outputs_match_peft(setup):
    """20 pages: three adapters (7 pages) and the KV of a few requests do not fit together, so
    cached pages and idle adapters are evicted, least recently used first; every output is PEFT's."""
    libs, folders, refs = setup
    with MLCEngine(libs[20], "cpu", enable_prefix_caching=True) as eng:
        for name in ("a1", "a2", "a3"):
            eng.load_adapter(name, folders[name])
        assert sum(a["pages"] for a in eng.list_adapters()) == 7
        prompts = [SYSTEM + [(7 * i + j) % 128 for j in range(6 + 5 * i)] for i in range(4)]
        long = [(13 * i + 5) % 128 for i in range(9 * PAGE_SIZE)]  # a base request of 10 pages
        for rnd in range(3):
            for i, p in enumerate(prompts + [long]):
                adapter = (None, "a1", "a2", "a3")[(i + rnd) % 4] if p is not long else None
                assert complete(eng, p, adapter, 4) == want(refs, adapter, p, 4), (rnd, i, adapter)
        s = eng.stats()
        print({k: v for k, v in s.items() if k.startswith(("prefix", "adapter_"))})
        assert s["prefix_cache_hit_tokens"] > 0
        assert s["prefix_cache_evictions"] > 0 and s["adapter_evictions"] > 0 and s["adapter_page_ins"] > 0
        assert s["pool_pages_kv"] == 0


def test_random_mixed_run_keeps_the_pool_consistent_and_matches_peft(setup):
    """Requests of three adapters and the base model arrive at random steps on the 20-page pool,
    sharing system prompts (some aborted, an adapter reloaded under its name with new weights
    midway); the pool's invariants hold after every step, preemptions and evictions happen, and
    every finished request's greedy tokens are PEFT's for the weights it was admitted with."""
    libs, folders, refs = setup
    rng = np.random.default_rng(5)
    systems = [SYSTEM, [(3 * i + 7) % 128 for i in range(PAGE_SIZE + 5)]]
    eng = LLMEngine(libs[20], "cpu", max_num_seqs=6, enable_prefix_caching=True)
    for name in ("a1", "a2", "a3"):
        eng.adapters.load(name, folders[name])
    weights = {"a1": "a1", "a2": "a2", "a3": "a3", None: None}  # name -> the folder it holds now
    outs, aborted, reloaded = [], set(), False
    for step in range(400):
        if step >= 120 and not reloaded:  # retried until the pool has room for it
            if "a2" in eng.adapters.by_name:
                eng.adapters.unload("a2")
            try:
                eng.adapters.load("a2", folders["a1_new"])
                weights["a2"], reloaded = "a1_new", True
            except PoolExhaustedError:
                pass
        if step < 250 and rng.random() < 0.3:
            name = [None, "a1", "a2", "a3"][int(rng.integers(0, 4))]
            if name == "a2" and step >= 120 and not reloaded:
                name = None
            prompt = list(systems[int(rng.integers(0, 2))][:int(rng.integers(8, 40))])
            prompt += rng.integers(0, 128, int(rng.integers(1, 20))).tolist()
            seq, _ = add(eng, prompt, name, int(rng.integers(1, 30)), outs)
            outs[-1] = outs[-1] + (weights[name],)
        if outs and rng.random() < 0.03:
            seq = outs[int(rng.integers(0, len(outs)))][0]
            if seq.finish_reason is None:
                eng.abort(seq)
                aborted.add(seq.seq_id)
        eng.step()
        eng.pool.check_invariants()
        if step >= 250 and not eng.has_work():
            break
    assert not eng.has_work()
    checked = 0
    for seq, _, prompt, n, toks, folder in outs:
        if seq.seq_id in aborted:
            continue
        assert seq.finish_reason == "length"
        assert toks == want(refs, folder, prompt, n), (folder, prompt, n)
        checked += 1
    s = eng.stats()
    print(checked, {k: v for k, v in s.items() if k.startswith(("prefix", "adapter_", "num_pre"))})
    assert checked >= 40
    assert s["prefix_cache_hit_tokens"] > 0 and s["prefix_cache_evictions"] > 0
    assert s["adapter_evictions"] > 0 and s["num_preemptions"] > 0 and reloaded
    assert s["pool_pages_kv"] == 0 and s["running"] == s["waiting"] == 0


def test_model_without_lora_reuses_and_evicts_base_prefixes(tiny_models):
    """A model compiled without LoRA on a 10-page cache: repeated system prompts hit, cached pages
    are evicted for running requests (which also preempt each other), outputs stay HF's."""
    hf, lib = tiny_models["gqa"]
    eng = LLMEngine(lib, "cpu", max_total_tokens=9 * PAGE_SIZE, enable_prefix_caching=True)
    refs = {None: hf}
    outs = []
    for rnd in range(3):
        for i in range(4):
            prompt = SYSTEM + [(17 * i + rnd + j) % 128 for j in range(4 + 3 * i)]
            add(eng, prompt, None, 40, outs)
        run_to_end(eng, check=True)
    for _, adapter, prompt, n, toks in outs:
        assert toks == want(refs, adapter, prompt, n)
    s = eng.stats()
    assert s["prefix_cache_hit_tokens"] > 0 and s["prefix_cache_evictions"] > 0 and s["num_preemptions"] > 0
