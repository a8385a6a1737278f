"""Fair share through the engine on the tiny random Llama with two PEFT adapters: one adapter
floods the queue, the other's requests are admitted within a bounded number of steps with
`fair_share` (and wait for the whole flood without it); greedy outputs equal HF + PEFT either way;
the tokens served per adapter (stats and /metrics) match what the requests got."""

from __future__ import annotations

import pytest

from mlc_lora.compile import CompileOptions
from mlc_lora.engine import LLMEngine, SamplingParams
from mlc_lora.engine.scheduler import Status
from mlc_lora.serve.metrics import Metrics, tokens_served

from ..conftest import make_tiny_hf_model, save_adapter
from .test_lora_engine import peft_greedy

MAX_TOKENS = 5
HEAVY = 14  # requests of the flooding adapter
LIGHT = 2
SLOTS = 2  # max_num_seqs: the flood holds every place


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory, compile_once):
    root = tmp_path_factory.mktemp("fair")
    base = make_tiny_hf_model(root / "hf", "gqa")
    refs = {"heavy": save_adapter(base, root / "heavy", 11, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            "light": save_adapter(base, root / "light", 12, r=4, lora_alpha=8,
                                  target_modules=["o_proj", "down_proj"])}
    lib = compile_once(root / "hf", CompileOptions(prefill_chunk_size=64, max_batch_size=8, lora_pool_pages=64,
                                                   max_lora_rank=8))
    return lib, root, refs


def prompt(i: int) -> list[int]:
    return [(5 * i + 3 * k + 1) % 128 for k in range(4 + i % 5)]


def run_flood(lib, root, fair: bool):
    """HEAVY requests of `heavy`, one step, then LIGHT of `light`; steps until all are done.
    Returns (tokens per request, steps from the light requests' arrival to each one's admission,
    heavy's counter when they arrived, stats)."""
    eng = LLMEngine(lib, "cpu", max_num_seqs=SLOTS, fair_share=fair)
    for name in ("heavy", "light"):
        eng.adapters.load(name, root / name)
    outs: dict = {}

    def submit(name, i):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        sink = lambda o, k=(name, i): outs.setdefault(k, []).extend(t.token for t in o.tokens)  # noqa: E731
        seq = eng.make_sequence(prompt(i), params, name, sink=sink)
        eng.add(seq)
        return seq

    for i in range(HEAVY):
        submit("heavy", i)
    eng.step()
    lift = eng.scheduler.service.of("heavy").counter
    light = [submit("light", 100 + i) for i in range(LIGHT)]
    admitted, steps = {}, 0
    while eng.has_work():
        eng.step()
        steps += 1
        for s in light:
            if s.status != Status.WAITING:
                admitted.setdefault(s.seq_id, steps)
    return outs, sorted(admitted.values()), lift, eng.stats()


@pytest.mark.parametrize("fair", [True, False])
def test_outputs_match_peft_and_tokens_served_add_up(two_adapters, fair):
    lib, root, refs = two_adapters
    outs, _, lift, stats = run_flood(lib, root, fair)
    assert len(outs) == HEAVY + LIGHT
    for (name, i), toks in outs.items():
        assert toks == peft_greedy(refs[name], prompt(i), MAX_TOKENS)[0], (name, i, fair)
    served = stats["tokens_served"]
    assert stats["fair_share"] is fair
    assert served["base"] == dict(prompt_tokens=0, generated_tokens=0, service=0.0)
    for name, ids in (("heavy", range(HEAVY)), ("light", range(100, 100 + LIGHT))):
        s = served["adapters"][name]
        prompts = sum(len(prompt(i)) for i in ids)
        assert (s["prompt_tokens"], s["generated_tokens"]) == (prompts, len(ids) * MAX_TOKENS)
        # prompt tokens weigh 1, generated 2; the light adapter, idle until then, started from the
        # heavy one's counter (the least among the clients with waiting requests)
        assert s["service"] == (lift if name == "light" else 0) + prompts + 2 * len(ids) * MAX_TOKENS
    assert stats["num_generated_tokens"] == (HEAVY + LIGHT) * MAX_TOKENS


def test_a_flood_does_not_starve_the_other_adapter(two_adapters):
    """With fair share the light adapter's requests take the next places that free up: each waits at
    most for one request of the flood to finish per request ahead of it (MAX_TOKENS + 1 steps);
    first come first served makes them wait for the whole flood."""
    lib, root, _ = two_adapters
    _, fair, _, _ = run_flood(lib, root, True)
    _, fifo, _, _ = run_flood(lib, root, False)
    bound = LIGHT * (MAX_TOKENS + 1)
    assert len(fair) == len(fifo) == LIGHT
    assert max(fair) <= bound, fair
    # the baseline starves it for the whole flood: (HEAVY - SLOTS) / SLOTS rounds of requests
    assert min(fifo) >= (HEAVY - SLOTS) // SLOTS * MAX_TOKENS > 2 * bound, fifo


def test_metrics_label_the_loaded_adapters_at_most_a_bounded_number(two_adapters):
    """/metrics: the base model under the served name, adapters by name; with more adapters loaded
    than the limit, those served the most tokens."""
    lib, root, _ = two_adapters
    _, _, _, stats = run_flood(lib, root, True)
    heavy, light = (stats["tokens_served"]["adapters"][n] for n in ("heavy", "light"))
    rows = tokens_served(stats, "tiny")
    assert rows == [("tiny", 0, 0), ("heavy", heavy["prompt_tokens"], HEAVY * MAX_TOKENS),
                    ("light", light["prompt_tokens"], LIGHT * MAX_TOKENS)]
    assert tokens_served(stats, "tiny", limit=1) == rows[:2]
    m = Metrics("tiny")
    m.observe_engine(stats)
    text = m.render().decode()
    assert f'mlc_lora_model_tokens_served_total{{kind="generated",model="light"}} {LIGHT * MAX_TOKENS}.0' in text
    assert 'mlc_lora_model_tokens_served_total{kind="prompt",model="tiny"} 0.0' in text


@pytest.mark.parametrize("fair", [True, False])
def test_max_loras_bounds_the_adapters_running_at_once_outputs_unchanged(two_adapters, fair):
    """max_loras=1 (vLLM's --max-loras): the running sequences never span both adapters, though
    places are free; requests of the other adapter wait, none is starved, outputs equal PEFT."""
    lib, root, refs = two_adapters
    eng = LLMEngine(lib, "cpu", max_num_seqs=8, fair_share=fair, max_loras=1)
    for name in ("heavy", "light"):
        eng.adapters.load(name, root / name)
    outs: dict = {}
    for i in range(6):  # interleaved: heavy, light, heavy, ...
        name = ("heavy", "light")[i % 2]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        eng.add(eng.make_sequence(prompt(i), params, name,
                                  sink=lambda o, k=(name, i): outs.setdefault(k, []).extend(t.token for t in o.tokens)))
    spans = []
    while eng.has_work():
        eng.step()
        spans.append({s.adapter_name for s in eng.scheduler.running})
    assert max(len(s) for s in spans) == 1 and {"heavy"} in spans and {"light"} in spans
    assert len(outs) == 6
    for (name, i), toks in outs.items():
        assert toks == peft_greedy(refs[name], prompt(i), MAX_TOKENS)[0], (name, i)
    assert eng.stats()["max_loras"] == 1
    with pytest.raises(ValueError, match="max_loras must be a positive integer"):
        LLMEngine(lib, "cpu", max_loras=0)
