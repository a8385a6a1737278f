"""Adapter tiers through the engine on the tiny random Llama (LoRA on q/v, a pool of POOL pages):
loads on a busy pool, the host tier's budget (copies dropped and read again from their folders),
prefetch on and off, and their counters. References: HF transformers + PEFT greedy runs of the same
folders.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from mlc_lora import MLCEngine
from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.engine import LLMEngine, SamplingParams
from mlc_lora.errors import LoraError

from ..conftest import make_tiny_hf_model, save_adapter

POOL = 16
QV = dict(target_modules=["q_proj", "v_proj"])
# name -> rank: pages in the pool 2, 1, 2, 4 (every row length divides the 1024-element page)
RANKS = {"qa": 8, "qb": 4, "qc": 8, "qd": 16}
PAGES = {"qa": 2, "qb": 1, "qc": 2, "qd": 4}
PAGE_BYTES = 2 * 1024 * 4  # one page of every layer: L * E float32
BUDGET = 3 * PAGE_BYTES  # host copies of three pages of adapters
LONG = [(7 * i) % 128 for i in range(220)]  # 14 KV pages with its 5 new tokens: evicts an adapter


def peft_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].double().argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    base = make_tiny_hf_model(root / "hf", "gqa")
    lib = compile_model(root / "hf", root / "lib", CompileOptions(
        prefill_chunk_size=64, max_batch_size=8, lora_pool_pages=POOL, max_lora_rank=16,
        lora_target_modules=["q_proj", "v_proj"]), progress=False)
    d = root / "adapters"
    refs = {None: base}
    for i, (name, r) in enumerate(RANKS.items()):
        refs[name] = save_adapter(base, d / name, 300 + i, r=r, lora_alpha=2 * r, **QV)
    return lib, d, refs


def run_all(eng: LLMEngine, requests, max_tokens=6):
    """Every (adapter, prompt) at once, stepped to the end; each request's greedy tokens."""
    outs = {i: [] for i in range(len(requests))}
    for i, (name, prompt) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        eng.add(eng.make_sequence(prompt, params, name, sink=lambda o, i=i: outs[i].append(o)))
    while eng.has_work():
        eng.step()
    for i, o in outs.items():
        assert o[-1].error is None and o[-1].finish_reason == "length", (i, o[-1].error)
    return [[s.token for o in outs[i] for s in o.tokens] for i in range(len(requests))]


@pytest.mark.parametrize("prefetch", [True, False])
def test_host_budget_drops_and_reads_again_with_identical_outputs(tiers, prefetch):
    """Budget 0: every adapter that loses its pages loses its host copy too, and its next request
    reads its folder again. Three rounds of: a long base request (evicts qa, the least recently
    used), then qa (read from disk, paged in), then qb (still resident)."""
    lib, d, refs = tiers
    short = LONG[:24]
    want = {n: peft_greedy(refs[n], short, 5) for n in ("qa", "qb")}
    with MLCEngine(lib, "cpu", adapter_host_bytes=0, prefetch_adapters=prefetch) as eng:
        for n in ("qa", "qb"):
            eng.load_adapter(n, d / n)
        s = eng.stats()
        assert (s["adapter_host_drops"], s["adapters_on_host"], s["adapter_host_budget_bytes"]) == (0, 2, 0)
        assert s["adapter_host_bytes"] == (PAGES["qa"] + PAGES["qb"]) * PAGE_BYTES
        for _ in range(3):
            out = eng.completions.create(prompt=LONG, max_tokens=5, temperature=0, ignore_eos=True)
            assert out.choices[0].token_ids == peft_greedy(refs[None], LONG, 5)
            tiers_now = {a["name"]: a["tier"] for a in eng.list_adapters()}
            assert tiers_now == {"qa": "disk", "qb": "device"}
            for n in ("qa", "qb"):
                out = eng.completions.create(prompt=short, max_tokens=5, temperature=0, ignore_eos=True,
                                             adapter_id=n)
                assert out.choices[0].token_ids == want[n], n
        s = eng.stats()
    assert (s["adapter_device_hits"], s["adapter_host_hits"], s["adapter_disk_hits"]) == (3, 0, 3)
    assert (s["adapter_host_drops"], s["adapter_disk_reads"]) == (3, 3)
    assert (s["adapter_evictions"], s["adapter_page_ins"]) == (3, 3)
    lead = s["adapter_prefetch_lead_seconds"]
    if prefetch:  # qa is paged in between steps once its folder is read, before its request runs
        assert s["adapter_prefetch_page_ins"] == 3 and lead["count"] == 3 and lead["buckets"][-1] == ["+Inf", 3]
    else:
        assert s["adapter_prefetch_page_ins"] == 0 and lead["count"] == 0
    assert s["adapters_on_host"] == 2 and s["adapters_resident"] == ["qa", "qb"]


def test_prefetch_on_and_off_and_a_small_host_budget_give_identical_outputs(tiers):
    """Twelve requests over four adapters and the base model in two waves, four running at a time
    on a pool that holds a few of them: adapters are evicted and paged in (prefetch: ahead of their
    requests; a budget of three pages: copies dropped after the first wave and read again in the
    second); every variant's greedy tokens equal PEFT's."""
    lib, d, refs = tiers
    names = ["qa", "qb", None, "qc", "qd"]
    requests = [(names[i % 5], [(11 * i + 3 * k) % 128 for k in range(30 + 7 * (i % 4))]) for i in range(12)]
    want = [peft_greedy(refs[n], p, 6) for n, p in requests]
    stats = {}
    for prefetch, budget in ((False, None), (True, None), (True, BUDGET)):
        eng = LLMEngine(lib, "cpu", max_num_seqs=4, adapter_host_bytes=budget, prefetch_adapters=prefetch)
        for n in RANKS:
            eng.adapters.load(n, d / n)
        got = run_all(eng, requests[:6]) + run_all(eng, requests[6:])  # two waves: copies dropped between
        assert got == want, (prefetch, budget)
        s = stats[prefetch, budget] = eng.stats()
        assert s["adapter_evictions"] > 0 and s["adapter_page_ins"] > 0, (prefetch, budget)
        assert s["pool_pages_kv"] == 0 and s["running"] == s["waiting"] == 0
        eng.pool.check_invariants()
    for key, s in stats.items():
        print(f"prefetch, budget {key}: evictions {s['adapter_evictions']}, page-ins {s['adapter_page_ins']} "
              f"({s['adapter_prefetch_page_ins']} by prefetch), drops {s['adapter_host_drops']}, disk reads "
              f"{s['adapter_disk_reads']}, preemptions {s['num_preemptions']}")
    assert stats[False, None]["adapter_prefetch_page_ins"] == 0
    for key in ((True, None), (True, BUDGET)):
        s = stats[key]
        lead = s["adapter_prefetch_lead_seconds"]
        assert s["adapter_prefetch_page_ins"] > 0 and 0 < lead["count"] <= s["adapter_prefetch_page_ins"], key
        assert lead["sum"] > 0
    assert stats[True, BUDGET]["adapter_host_drops"] > 0 and stats[True, BUDGET]["adapter_disk_reads"] > 0
    assert stats[True, None]["adapter_host_drops"] == 0


def test_a_load_on_a_busy_pool_succeeds_and_serves_a_bad_one_fails_alone(tiers, tmp_path):
    """64 requests keep every page of the pool busy (KV of eight running sequences and their
    adapters); loading qd (4 pages) then succeeds without pages, a broken folder fails with
    LoraError and nothing else, and qd's request is served as PEFT serves it."""
    lib, d, refs = tiers
    broken = tmp_path / "broken"
    shutil.copytree(d / "qb", broken)
    (broken / "adapter_config.json").write_text("{not json")
    eng = LLMEngine(lib, "cpu", max_num_seqs=8)
    for n in ("qa", "qb"):
        eng.adapters.load(n, d / n)
    outs: dict[int, list] = {}
    requests = [(["qa", "qb", None][i % 3], [(5 * i + k) % 128 for k in range(20 + i % 13)]) for i in range(64)]
    seqs = []
    for i, (name, prompt) in enumerate(requests):
        outs[i] = []
        seq = eng.make_sequence(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), name,
                                sink=outs[i].append)
        eng.add(seq)
        seqs.append(seq)
    for _ in range(200):
        eng.step()
        s = eng.pool.stats()
        if len(eng.scheduler.running) >= 4 and s.free_pages + s.evictable_pages < PAGES["qd"]:
            break
    else:
        pytest.fail("the 64 requests never filled the pool")
    info = eng.adapters.load("qd", d / "qd")
    assert (info["resident"], info["tier"], info["pages"]) == (False, "host", PAGES["qd"])
    with pytest.raises(LoraError, match="not valid JSON"):
        eng.adapters.load("bad", broken)
    assert [a["name"] for a in eng.adapters.list()] == ["qa", "qb", "qd"]
    prompt = [9, 8, 7, 6, 5]
    outs["qd"] = []
    eng.add(eng.make_sequence(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "qd",
                              sink=outs["qd"].append))
    while eng.has_work():
        eng.step()
    assert [s.token for o in outs["qd"] for s in o.tokens] == peft_greedy(refs["qd"], prompt, 6)
    for i, (name, prompt) in enumerate(requests):
        assert outs[i][-1].finish_reason == "length" and outs[i][-1].error is None
        if i % 8 == 0:  # a sample of the 64 against PEFT
            assert [s.token for o in outs[i] for s in o.tokens] == peft_greedy(refs[name], prompt, 12), i
    assert eng.pool.adapter_info(eng.adapters.get("qd").slot).resident
    eng.pool.check_invariants()


def test_a_folder_gone_after_its_copy_was_dropped_fails_its_requests_alone(tiers, tmp_path):
    """Budget 0 and an adapter evicted: its folder is read again on its next request. While the
    folder is gone its requests fail with LoraError and a request beside them is served; once the
    folder is back, so is the adapter."""
    lib, d, refs = tiers
    folder = tmp_path / "qz"
    shutil.copytree(d / "qa", folder)
    short = LONG[:16]
    eng = LLMEngine(lib, "cpu", adapter_host_bytes=0)
    eng.adapters.load("qz", folder)
    eng.adapters.load("qb", d / "qb")
    run_all(eng, [(None, LONG)], max_tokens=3)  # evicts qz; its host copy goes at the next step
    eng.step()
    assert eng.adapters.info(eng.adapters.get("qz"))["tier"] == "disk"
    shutil.rmtree(folder)
    outs = {0: [], 1: []}
    for i, name in enumerate(("qz", "qb")):
        eng.add(eng.make_sequence(short, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), name,
                                  sink=outs[i].append))
    while eng.has_work():
        eng.step()
    assert isinstance(outs[0][-1].error, LoraError) and "cannot be read again" in str(outs[0][-1].error)
    assert [s.token for o in outs[1] for s in o.tokens] == peft_greedy(refs["qb"], short, 4)
    shutil.copytree(d / "qa", folder)
    assert run_all(eng, [("qz", short)], max_tokens=4) == [peft_greedy(refs["qa"], short, 4)]
    s = eng.stats()
    assert s["adapter_disk_hits"] == 2 and s["adapter_disk_reads"] == 1
    assert s["running"] == s["waiting"] == 0 and s["pool_pages_kv"] == 0


def test_tiers_with_the_prefix_cache_and_fair_share_match_peft(tiers):
    """Everything at once on the 16-page pool: fair share, the prefix cache, prefetch and a host
    budget of three pages. Requests of four adapters and the base model share two system prompts and
    arrive in bursts; the adapter qd is loaded while the running requests fill the pool (no pages for
    it yet) and then served. Cached pages and idle adapters are evicted by one order, copies
    are dropped and read again, adapters are paged in ahead of their requests; the pool's bookkeeping
    holds after every step and every greedy output is PEFT's."""
    lib, d, refs = tiers
    systems = [LONG[:2 * 16], [(3 * i + 7) % 128 for i in range(16 + 5)]]
    names = ["qa", "qb", None, "qc", "qd"]
    eng = LLMEngine(lib, "cpu", max_num_seqs=4, adapter_host_bytes=BUDGET, fair_share=True,
                    enable_prefix_caching=True)
    for n in ("qa", "qb", "qc"):
        eng.adapters.load(n, d / n)
    outs, busy_load = [], None
    for step in range(2000):
        if step < 240 and step % 12 == 0:  # a burst of three
            for i in range(step // 4, step // 4 + 3):
                name = names[i % (5 if busy_load else 4)]
                prompt = systems[i % 2][:20 + 3 * (i % 5)] + [(11 * i + k) % 128 for k in range(1 + i % 7)]
                n, toks = 6 + i % 7, []
                eng.add(eng.make_sequence(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                          name, sink=lambda o, toks=toks: toks.extend(s.token for s in o.tokens)))
                outs.append((name, prompt, n, toks))
        s = eng.pool.stats()
        if busy_load is None and len(eng.scheduler.running) >= 3 and s.free_pages + s.evictable_pages < PAGES["qd"]:
            busy_load = eng.adapters.load("qd", d / "qd")
        eng.step()
        eng.pool.check_invariants()
        if step >= 240 and not eng.has_work():
            break
    assert not eng.has_work()
    # registered without pages; its 4 pages are over the host budget, so its copy waits on disk
    assert busy_load is not None and (busy_load["resident"], busy_load["tier"]) == (False, "disk"), busy_load
    for name, prompt, n, toks in outs:
        assert toks == peft_greedy(refs[name], prompt, n), (name, prompt, n)
    s = eng.stats()
    print({k: v for k, v in s.items() if k.startswith(("prefix", "adapter_", "num_pre"))})
    assert sum(1 for name, *_ in outs if name == "qd") >= 4
    assert s["tokens_served"]["adapters"]["qd"]["generated_tokens"] > 0
    assert s["prefix_cache_hit_tokens"] > 0 and s["prefix_cache_evictions"] > 0
    assert s["adapter_evictions"] > 0 and s["adapter_prefetch_page_ins"] > 0
    assert s["adapter_host_drops"] > 0 and s["adapter_disk_reads"] > 0
    assert s["pool_pages_kv"] == 0 and s["running"] == s["waiting"] == 0
