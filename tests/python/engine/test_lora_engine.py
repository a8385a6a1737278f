"""LoRA through MLCEngine on the tiny random Llama: a mixed batch of adapters (ranks 4..64, rsLoRA,
rank/alpha patterns, different targets) and base requests against HF transformers + PEFT, stage 1
(`single`) against stage 2 (`gather`), bad adapters and requests, pool exhaustion and eviction.

The adapters, requests and the two libraries come from tests/python/lora/test_peft_parity.py.
"""

import asyncio
import shutil
import threading

import pytest
import torch

from mlc_lora import AsyncMLCEngine, MLCEngine
from mlc_lora.engine import LLMEngine, SamplingParams
from mlc_lora.compile import CompileOptions
from mlc_lora.errors import LoraError, PoolExhaustedError, UnknownAdapterError
from mlc_lora.runner.config import CompiledConfig

from ..conftest import make_tiny_hf_model, save_adapter
from ..lora.test_peft_parity import ADAPTERS, REQUESTS, lora_setup  # noqa: F401  (module fixture)

MAX_TOKENS = 6
SMALL_POOL = 12


def peft_greedy(model, prompt, n):
    """HF + PEFT greedy continuation and the log-probability of each chosen token."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return ids[len(prompt):], lps


def run_mixed(compiled, root):
    """Every REQUESTS entry at once through an AsyncMLCEngine with the five adapters loaded."""
    with AsyncMLCEngine(compiled, "cpu") as eng:
        for aid in ADAPTERS:
            asyncio.run(eng.load_adapter(f"a{aid}", root / f"adapter{aid}"))

        # The engine thread waits between steps until every request has been submitted, so that
        # they all start in one batch (submissions otherwise race the steps of the earlier ones).
        holding, gate = threading.Event(), threading.Event()

        def hold():
            holding.set()
            assert gate.wait(60), "the requests were not all submitted"

        held = threading.Thread(target=eng._loop.call, args=(hold,))  # pylint: disable=protected-access
        held.start()
        assert holding.wait(60)

        async def go():
            tasks = [asyncio.ensure_future(eng.completions.create(
                prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True,
                adapter_id=None if aid is None else f"a{aid}")) for aid, p in REQUESTS]
            for _ in range(12000):  # (a minute at most)
                if sum(not callable(i) for i in eng._loop.incoming) >= len(REQUESTS):  # pylint: disable=protected-access
                    break
                await asyncio.sleep(0.005)
            gate.set()
            return await asyncio.gather(*tasks)

        out = asyncio.run(go())
        held.join()
        stats = asyncio.run(eng.stats())
        listed = asyncio.run(eng.list_adapters())
    return ([(o.choices[0].token_ids, o.choices[0].logprobs.token_logprobs) for o in out], stats, listed)


def assert_idle(stats, adapter_pages):
    assert stats["running"] == stats["waiting"] == 0
    assert stats["pool_pages_kv"] == 0 and stats["pool_pages_adapter"] == adapter_pages
    assert stats["pool_pages_free"] == stats["pool_pages_total"] - adapter_pages


def test_mixed_adapter_batch_matches_peft_and_single_agrees(lora_setup):  # noqa: F811
    _, root, refs, compiled = lora_setup
    gather, stats, listed = run_mixed(compiled["gather"], root)
    assert stats["max_running"] == len(REQUESTS)  # adapters and base requests in one batch
    worst = 0.0
    for (aid, prompt), (toks, lps) in zip(REQUESTS, gather):
        want, want_lps = peft_greedy(refs[aid], prompt, MAX_TOKENS)
        assert toks == want, f"adapter {aid}"
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, want_lps)))
    assert worst < 1e-3
    print(f"engine, gather: greedy tokens identical to PEFT, chosen-token logprob error {worst:.1e}")
    # the adapters matter: some adapter's greedy tokens differ from the base model's
    assert any(toks != peft_greedy(refs[None], p, MAX_TOKENS)[0]
               for (aid, p), (toks, _) in zip(REQUESTS, gather) if aid is not None)
    by_name = {a["name"]: a for a in listed}
    assert by_name["a2"]["use_rslora"] and by_name["a2"]["scales"]["q_proj"] == pytest.approx(32 / 4)
    assert by_name["a1"]["rank"] == 4 and by_name["a3"]["rank"] == 64 and by_name["a3"]["lora_alpha"] == 16
    assert by_name["a3"]["target_modules"] == ["o_proj", "gate_proj", "down_proj"]
    assert all(a["resident"] and not a["pinned"] for a in listed)
    assert_idle(stats, sum(a["pages"] for a in listed))
    assert stats["adapters_resident"] == [f"a{i}" for i in sorted(ADAPTERS)]
    # every decode step held all the requests (one batch, the same max_tokens): all five adapters,
    # whose pages it read: pages x layers x page elements x 4 bytes (float32)
    lora = CompiledConfig.read(compiled["gather"], "cpu").lora
    page_bytes = lora.num_layers * lora.page_elems * 4
    steps = stats["decode_adapter_steps"]
    assert list(steps) == ["<=8"] and steps["<=8"]["steps"] == stats["num_decode_steps"] == MAX_TOKENS - 1
    assert steps["<=8"]["sequences"] == len(REQUESTS) * stats["num_decode_steps"]
    assert steps["<=8"]["adapter_bytes"] == stats["num_decode_steps"] * page_bytes * sum(a["pages"] for a in listed)
    assert steps["<=8"]["seconds"] == pytest.approx(stats["step_times"]["decode_<=8"]["seconds"], abs=1e-5)
    assert set(stats["host_times"]) == {"adapters", "schedule", "outputs", "wait_reads"}
    assert all(t >= 0 for t in stats["host_times"].values()) and stats["host_times"]["schedule"] > 0
    # stage 1: the scheduler runs one adapter per batch (the runner refuses anything else)
    single, stats1, _ = run_mixed(compiled["single"], root)
    assert stats1["num_finished"] == len(REQUESTS)
    for (toks, lps), (toks1, lps1) in zip(gather, single):
        assert toks1 == toks
        assert max(abs(a - b) for a, b in zip(lps, lps1)) < 1e-4


@pytest.fixture(scope="module")
def small(lora_setup, tmp_path_factory, compile_once):  # noqa: F811
    """A library with LoRA on q/v only, a pool of SMALL_POOL pages; adapters for it."""
    cfg, root, refs, _ = lora_setup
    lib = compile_once(root / "hf", CompileOptions(
        prefill_chunk_size=64, max_batch_size=8, lora_pool_pages=SMALL_POOL, max_lora_rank=64,
        lora_target_modules=["q_proj", "v_proj"]))
    base = refs[None]
    d = tmp_path_factory.mktemp("small-adapters")
    qv = dict(target_modules=["q_proj", "v_proj"])
    small_refs = {"qv8": save_adapter(base, d / "qv8", 1, r=8, lora_alpha=16, **qv),  # 2 pages
                  "qv4": save_adapter(base, d / "qv4", 2, r=4, lora_alpha=4, **qv)}  # 1 page
    save_adapter(base, d / "qv64", 3, r=64, lora_alpha=16, **qv)  # 14 pages > SMALL_POOL
    save_adapter(base, d / "r128", 4, r=128, lora_alpha=16, **qv)
    other = make_tiny_hf_model(root / "other-hf", "mha_tied")  # hidden 48: shapes do not fit
    save_adapter(other, d / "other", 5, r=4, lora_alpha=8, layers_to_transform=[0, 1], **qv)
    return lib, d, small_refs | {None: base}


def test_bad_adapters_and_requests_fail_clearly_others_go_on(lora_setup, small, tmp_path):  # noqa: F811
    _, root, refs, compiled = lora_setup
    lib, d, _ = small
    no_cfg = tmp_path / "no-config"
    shutil.copytree(root / "adapter1", no_cfg)
    (no_cfg / "adapter_config.json").unlink()
    broken = tmp_path / "broken"
    shutil.copytree(root / "adapter1", broken)
    (broken / "adapter_config.json").write_text("{not json")
    with MLCEngine(compiled["gather"], "cpu") as eng:
        eng.load_adapter("a1", root / "adapter1")
        idle = eng.stats()
        pages = idle["pool_pages_adapter"]
        bad = [(no_cfg, "no adapter_config.json"), (broken, "not valid JSON"),
               (d / "other", r"has shape \(4, 48\), expected \(r, 64\)"),
               (d / "r128", "rank 128, above the compiled --max-lora-rank 64"),
               (tmp_path / "nowhere", "is not a folder")]
        for path, msg in bad:
            with pytest.raises(LoraError, match=msg):
                eng.load_adapter("bad", path)
        with pytest.raises(LoraError, match="'a1' is already loaded"):
            eng.load_adapter("a1", root / "adapter2")
        assert [a["name"] for a in eng.list_adapters()] == ["a1"]
        assert eng.stats()["pool_pages_adapter"] == pages
        # an unknown adapter_id fails its request, naming it; a request beside it goes on
        results = {}

        def good():
            results["good"] = eng.completions.create(prompt=REQUESTS[0][1], max_tokens=MAX_TOKENS,
                                                     temperature=0, ignore_eos=True, adapter_id="a1")

        t = threading.Thread(target=good)
        t.start()
        with pytest.raises(UnknownAdapterError, match="'pirate' is not a loaded LoRA adapter.*loaded: a1"):
            eng.completions.create(prompt=[1, 2, 3], max_tokens=4, adapter_id="pirate")
        t.join()
        assert results["good"].choices[0].token_ids == peft_greedy(refs[1], REQUESTS[0][1], MAX_TOKENS)[0]
        # unload: the name is gone at once, the pages come back
        eng.unload_adapter("a1")
        with pytest.raises(UnknownAdapterError, match="'a1'"):
            eng.completions.create(prompt=[1, 2, 3], max_tokens=4, adapter_id="a1")
        assert_idle(eng.stats(), 0)
    with MLCEngine(lib, "cpu") as eng:
        with pytest.raises(LoraError, match=r"targets \['o_proj', 'gate_proj', 'down_proj'\], which the "
                                            r"model was not compiled for \(compiled LoRA modules: q_proj, v_proj"):
            eng.load_adapter("a3", root / "adapter3")
        with pytest.raises(LoraError, match=f"needs 14 pages, but the whole pool has {SMALL_POOL}"):
            eng.load_adapter("big", d / "qv64")
        assert_idle(eng.stats(), 0)


def test_model_without_lora_refuses_adapters(tiny_models, lora_setup):  # noqa: F811
    _, root, _, _ = lora_setup
    with MLCEngine(tiny_models["gqa"][1], "cpu") as eng:
        with pytest.raises(LoraError, match="compiled without LoRA: recompile it with --max-lora-rank"):
            eng.load_adapter("a1", root / "adapter1")
        with pytest.raises(UnknownAdapterError, match="'a1'.*loaded: none"):
            eng.completions.create(prompt=[1, 2, 3], max_tokens=2, adapter_id="a1")
        assert eng.completions.create(prompt=[1, 2, 3], max_tokens=2, temperature=0).choices[0].token_ids


def test_idle_adapter_evicted_for_kv_and_paged_back(small):
    lib, d, refs = small
    prompt = [(7 * i) % 128 for i in range(150)]
    with MLCEngine(lib, "cpu") as eng:
        eng.load_adapter("qv8", d / "qv8")
        eng.load_adapter("qv4", d / "qv4", pin=True)
        # 12 pages: 1 pinned, 2 idle, 9 free; the base request needs 10 for KV: qv8 goes (LRU)
        out = eng.completions.create(prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True)
        assert out.choices[0].token_ids == peft_greedy(refs[None], prompt, 5)[0]
        state = {a["name"]: (a["resident"], a["pinned"]) for a in eng.list_adapters()}
        assert state == {"qv8": (False, False), "qv4": (True, True)}
        assert eng.stats()["adapters_resident"] == ["qv4"]
        assert (eng.stats()["adapter_evictions"], eng.stats()["adapter_page_ins"]) == (1, 0)
        # its next request pages it back in from the host copy
        short = prompt[:20]
        for name in ("qv8", "qv4"):
            out = eng.completions.create(prompt=short, max_tokens=5, temperature=0, ignore_eos=True,
                                         adapter_id=name)
            assert out.choices[0].token_ids == peft_greedy(refs[name], short, 5)[0]
        assert eng.stats()["adapters_resident"] == ["qv4", "qv8"]
        assert (eng.stats()["adapter_evictions"], eng.stats()["adapter_page_ins"]) == (1, 1)
        assert_idle(eng.stats(), 3)


def test_pin_and_unpin_at_runtime(small):
    """Pinning an evicted adapter pages it back in and keeps it from KV; unpinning gives its pages
    back to whoever needs them."""
    lib, d, refs = small
    prompt = [(7 * i) % 128 for i in range(150)]  # 10 KV pages of the 12
    with MLCEngine(lib, "cpu") as eng:
        eng.load_adapter("qv8", d / "qv8")
        eng.load_adapter("qv4", d / "qv4", pin=True)
        eng.completions.create(prompt=prompt, max_tokens=2, ignore_eos=True)  # evicts qv8
        info = eng.pin_adapter("qv8")
        assert (info["pinned"], info["resident"]) == (True, True)
        assert (eng.stats()["adapter_evictions"], eng.stats()["adapter_page_ins"]) == (1, 1)
        # 3 pinned pages leave 9: the request cannot run, the engine goes on
        with pytest.raises(PoolExhaustedError, match="3 by pinned or busy"):
            eng.completions.create(prompt=prompt, max_tokens=2, ignore_eos=True)
        short = prompt[:20]
        out = eng.completions.create(prompt=short, max_tokens=5, temperature=0, ignore_eos=True, adapter_id="qv8")
        assert out.choices[0].token_ids == peft_greedy(refs["qv8"], short, 5)[0]
        info = eng.pin_adapter("qv8", False)
        assert (info["pinned"], info["resident"]) == (False, True)
        out = eng.completions.create(prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True)
        assert out.choices[0].token_ids == peft_greedy(refs[None], prompt, 5)[0]
        assert {a["name"]: a["resident"] for a in eng.list_adapters()} == {"qv8": False, "qv4": True}
        with pytest.raises(UnknownAdapterError, match="'nope'"):
            eng.pin_adapter("nope")
        with pytest.raises(LoraError, match="pin must be true or false"):
            eng.pin_adapter("qv4", "yes")
        assert_idle(eng.stats(), 1)


def test_request_that_cannot_fit_beside_pinned_adapters_fails_others_go_on(small):
    lib, d, refs = small
    with MLCEngine(lib, "cpu") as eng:
        eng.load_adapter("qv8", d / "qv8", pin=True)
        eng.load_adapter("qv4", d / "qv4", pin=True)
        # 11 pages of KV would hold this request, but 3 of the 12 are pinned adapters
        long = [(3 * i) % 128 for i in range(160)]
        with pytest.raises(PoolExhaustedError, match=r"adapter 'qv4' \(1 pages\).*3 by pinned or busy"):
            eng.completions.create(prompt=long, max_tokens=10, ignore_eos=True, adapter_id="qv4")
        short = [5, 6, 7, 8]
        out = eng.completions.create(prompt=short, max_tokens=4, temperature=0, ignore_eos=True,
                                     adapter_id="qv8")
        assert out.choices[0].token_ids == peft_greedy(refs["qv8"], short, 4)[0]
        assert_idle(eng.stats(), 3)


def test_a_sequence_keeps_its_adapter_name_and_gets_its_pool_slot(small):
    """The request's adapter name stays the name; the pool's slot is a field of its own, set when the
    engine takes the adapter (and freed with the sequence)."""
    lib, d, refs = small
    eng = LLMEngine(lib, "cpu")
    eng.adapters.load("qv4", d / "qv4")
    info = eng.adapters.load("qv8", d / "qv8")
    outs = []
    prompt = [5, 6, 7, 8]
    seq = eng.make_sequence(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "qv8",
                            sink=outs.append)
    assert (seq.adapter_name, seq.adapter_slot) == ("qv8", None)
    eng.add(seq)
    assert (seq.adapter_name, seq.adapter_slot) == ("qv8", info["id"]) and info["id"] == 1
    assert eng.adapters.list()[1]["active_requests"] == 1
    while eng.has_work():
        eng.step()
    assert [s.token for o in outs for s in o.tokens] == peft_greedy(refs["qv8"], prompt, 3)[0]
    assert (seq.adapter_name, seq.adapter_slot, seq.finish_reason) == ("qv8", 1, "length")
    assert eng.adapters.list()[1]["active_requests"] == 0
    base = eng.make_sequence(prompt, SamplingParams(max_tokens=1), None)
    eng.add(base)
    assert (base.adapter_name, base.adapter_slot) == (None, None)
