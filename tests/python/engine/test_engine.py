"""MLCEngine end to end on a tiny random Llama: batching, streaming, sampling, stops, logprobs, errors."""

import asyncio

import numpy as np
import pytest
import torch

from mlc_lora import AsyncMLCEngine, MLCEngine
from mlc_lora.errors import RequestError

MSG = [{"role": "user", "content": "Hello, how are you today?"}]


def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prompts(k, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(3, 150))).tolist() for _ in range(k)]


def test_sixteen_requests_batch_and_match_alone_and_hf(tiny_chat):
    hf, compiled = tiny_chat
    prompts = _prompts(16)
    lens = [40 + 2 * i for i in range(16)]
    # a small prefill chunk so the long prompts are prefilled in several chunks beside decodes
    with AsyncMLCEngine(compiled, "cpu", prefill_chunk_size=64) as eng:
        async def run_all():
            return await asyncio.gather(*[
                eng.completions.create(prompt=p, max_tokens=n, temperature=0, ignore_eos=True)
                for p, n in zip(prompts, lens)])

        batched = asyncio.run(run_all())
        stats = asyncio.run(eng.stats())
    assert stats["max_running"] == 16  # all 16 ran in one batch at some step
    # prompts were prefilled in chunks of at most 64 tokens (decodes share those steps)
    assert stats["num_prefill_steps"] >= sum(len(p) for p in prompts) / 64
    assert stats["num_steps"] < sum(lens) // 4  # far fewer steps than one request at a time
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == stats["waiting"] == 0
    # every step is timed once, under its kind and size bucket
    times = stats["step_times"]
    assert sum(t["steps"] for t in times.values()) == stats["num_steps"]
    assert sum(t["steps"] for k, t in times.items() if k.startswith("decode_")) == stats["num_decode_steps"]
    assert times["decode_<=16"]["steps"] >= 1 and all(t["seconds"] > 0 for t in times.values())
    assert all(int(k.split("<=")[1]) <= 64 for k in times if k.startswith("prefill_"))  # chunks of <= 64
    # one forward a step, by compiled function (a model without LoRA: prefill and decode)
    assert stats["forwards"] == {"prefill": stats["num_prefill_steps"], "decode": stats["num_decode_steps"]}
    with MLCEngine(compiled, "cpu") as eng:
        for i, (p, n, r) in enumerate(zip(prompts, lens, batched)):
            alone = eng.completions.create(prompt=p, max_tokens=n, temperature=0, ignore_eos=True)
            got = r.choices[0].token_ids
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n == len(got)
            assert got == alone.choices[0].token_ids
            assert r.choices[0].text == eng.tokenizer.decode(got)
            if i % 4 == 0:
                assert got == _hf_greedy(hf, p, n)


def test_preemption_under_page_pressure_keeps_outputs(tiny_chat):
    """A cache of 8 pages cannot hold 6 sequences of ~70 tokens: requests wait or are preempted."""
    _, compiled = tiny_chat
    prompts = [p[:40] for p in _prompts(6, seed=1)]
    with MLCEngine(compiled, "cpu") as ref:
        want = [ref.completions.create(prompt=p, max_tokens=30, temperature=0, ignore_eos=True).choices[0].text
                for p in prompts]
    with AsyncMLCEngine(compiled, "cpu", max_total_tokens=8 * 16) as eng:
        async def run_all():
            return await asyncio.gather(*[
                eng.completions.create(prompt=p, max_tokens=30, temperature=0, ignore_eos=True)
                for p in prompts])

        got = asyncio.run(run_all())
        stats = asyncio.run(eng.stats())
    assert [r.choices[0].text for r in got] == want
    assert stats["num_preemptions"] > 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_stream_equals_non_stream(engine):
    for kw in (dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=7)):
        whole = engine.chat.completions.create(messages=MSG, max_tokens=40, **kw)
        chunks = list(engine.chat.completions.create(messages=MSG, max_tokens=40, stream=True, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        pieces = list(engine.completions.create(prompt="The quick brown", max_tokens=25, stream=True, **kw))
        text = engine.completions.create(prompt="The quick brown", max_tokens=25, **kw).choices[0].text
        assert "".join(c.choices[0].text for c in pieces) == text


def test_seed_gives_same_text(engine):
    kw = dict(messages=MSG, max_tokens=30, temperature=1.0, top_k=50, top_p=0.95)
    a = engine.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = engine.chat.completions.create(seed=11, **kw).choices[0].message.content
    c = engine.chat.completions.create(seed=12, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_n_choices(engine):
    """n choices: greedy ones all equal the single answer; with a seed, choice i is the single
    request with seed + i (sync and async, whole and streamed); usage counts the prompt once."""
    one = engine.chat.completions.create(messages=MSG, max_tokens=20, temperature=0)
    three = engine.chat.completions.create(messages=MSG, max_tokens=20, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    kw = dict(prompt="The quick brown", max_tokens=20, temperature=1.0, seed=21, ignore_eos=True)
    singles = [engine.completions.create(**{**kw, "seed": 21 + i}).choices[0].text for i in range(3)]
    assert len(set(singles)) > 1
    assert [c.text for c in engine.completions.create(n=3, **kw).choices] == singles
    chunks = list(engine.completions.create(n=3, stream=True, **kw))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)] == singles
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == [60]
    for bad in (0, 17, 1.5, True, "2"):
        with pytest.raises(RequestError, match="n must be an integer"):
            engine.completions.create(n=bad, **kw)
    s = engine.stats()
    assert s["running"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]


def test_n_choices_async_and_abort(tiny_chat):
    _, compiled = tiny_chat
    kw = dict(prompt="The quick brown", max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    with AsyncMLCEngine(compiled, "cpu") as eng:
        async def run():
            whole = await eng.completions.create(n=2, **kw)
            parts = {0: "", 1: ""}
            async for c in await eng.completions.create(n=2, stream=True, **kw):
                parts[c.choices[0].index] += c.choices[0].text
            # a stream closed half way aborts both choices
            stream = await eng.completions.create(n=2, stream=True, **{**kw, "max_tokens": 64})
            await stream.__anext__()
            await stream.aclose()
            await eng.completions.create(prompt="Hello", max_tokens=2)  # the loop has seen the aborts
            return whole, parts, await eng.stats()

        whole, parts, stats = asyncio.run(run())
    assert [c.text for c in whole.choices] == [parts[0], parts[1]]
    assert stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_finish_reasons(engine):
    greedy = engine.completions.create(prompt="Hello", max_tokens=30, temperature=0, ignore_eos=True)
    ids = greedy.choices[0].token_ids
    text = greedy.choices[0].text
    assert greedy.choices[0].finish_reason == "length" and greedy.usage.completion_tokens == 30
    # a stop string: the text ends just before it, finish_reason "stop"
    stop = text[10:13]
    r = engine.completions.create(prompt="Hello", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    streamed = list(engine.completions.create(prompt="Hello", max_tokens=30, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    # a stop token id
    r = engine.completions.create(prompt="Hello", max_tokens=30, temperature=0, stop_token_ids=[ids[4]])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 5
    # EOS: make the 6th greedy token the model's EOS
    tok = engine.tokenizer
    saved = tok.eos_token_ids
    try:
        tok.eos_token_ids = [ids[5]]
        r = engine.completions.create(prompt="Hello", max_tokens=30, temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 6
        r = engine.completions.create(prompt="Hello", max_tokens=30, temperature=0, ignore_eos=True)
        assert r.choices[0].finish_reason == "length" and r.choices[0].text == text
    finally:
        tok.eos_token_ids = saved


def _hf_logprobs(hf, prompt, out):
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out])).logits[0].double(), -1).numpy()
    return ref[len(prompt) - 1:-1]  # row j: the distribution that produced out[j]


def test_logprobs_match_hf(tiny_chat, engine):
    hf, _ = tiny_chat
    prompt = engine.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        r = engine.completions.create(prompt=prompt, max_tokens=12, logprobs=5, ignore_eos=True, **kw)
        lp, out = r.choices[0].logprobs, r.choices[0].token_ids
        steps = _hf_logprobs(hf, prompt, out)
        assert len(lp.token_logprobs) == len(out) == 12
        np.testing.assert_allclose(lp.token_logprobs, steps[np.arange(12), out], atol=1e-3)
    # chat: the top_logprobs list (ids kept apart even where their text is the same)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MSG), add_special_tokens=False)
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3)):
        c = engine.chat.completions.create(messages=MSG, max_tokens=8, logprobs=True, top_logprobs=4,
                                           ignore_eos=True, **kw)
        content, out = c.choices[0].logprobs.content, c.choices[0].token_ids
        steps = _hf_logprobs(hf, prompt, out)
        np.testing.assert_allclose([t.logprob for t in content], steps[np.arange(8), out], atol=1e-3)
        for j, t in enumerate(content):
            np.testing.assert_allclose([x.logprob for x in t.top_logprobs], np.sort(steps[j])[::-1][:4], atol=1e-3)
            assert [x.token for x in t.top_logprobs] == [tok.token_text(int(i)) for i in np.argsort(-steps[j])[:4]]
        if kw["temperature"] == 0:
            assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6) for t in content)


def test_bad_requests_error_and_engine_keeps_serving(engine):
    before = engine.completions.create(prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    bad = [
        dict(messages=[]),
        dict(messages=[{"role": "wizard", "content": "hi"}]),
        dict(messages=MSG, max_tokens=0),
        dict(messages=MSG, max_tokens=10_000),
        dict(messages=[{"role": "user", "content": "hello " * 600}]),
        dict(messages=MSG, adapter_id="my-lora"),
        dict(messages=MSG, temperature=-1),
        dict(messages=MSG, top_p=0),
        dict(messages=MSG, top_logprobs=21),
        # wrong types and out-of-bound values: a RequestError naming the field, never a raw TypeError
        dict(messages=MSG, temperature="a"), dict(messages=MSG, seed="x"), dict(messages=MSG, stop=5),
        dict(messages=MSG, max_tokens=True), dict(messages=MSG, top_k=1.5), dict(messages=MSG, top_k=2**40),
        dict(messages=MSG, stop_token_ids=[-1]), dict(messages=MSG, stop_token_ids=[10**6]),
        dict(messages=MSG, temperature=float("inf")), dict(messages=MSG, seed=-1),
        dict(messages=[{"role": "user", "content": "lone \ud800 surrogate"}]),
    ]
    for kw in bad:
        with pytest.raises(RequestError):
            engine.chat.completions.create(**kw)
    with pytest.raises(RequestError, match="context"):
        engine.completions.create(prompt=list(range(3, 300)) * 2, max_tokens=4)
    with pytest.raises(RequestError, match="token ids"):
        engine.completions.create(prompt=[5, 100000], max_tokens=4)
    # aborting a stream half way frees its pages
    stream = engine.chat.completions.create(messages=MSG, max_tokens=50, stream=True)
    next(stream)
    stream.close()
    assert engine.completions.create(prompt="Hello", max_tokens=8, temperature=0).choices[0].text == before
    s = engine.stats()
    assert s["running"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]


def test_chat_template_like_transformers(tiny_chat_hf, engine):
    from transformers import PreTrainedTokenizerFast

    hf_dir = tiny_chat_hf[1]
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    ref.chat_template = engine.tokenizer.chat_template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ünïcödé 🙂?"}]
    for m in (msgs, msgs[1:]):
        want = ref.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert engine.tokenizer.apply_chat_template(m) == want


def test_top_k_above_the_vocabulary_is_top_k_off(engine):
    kw = dict(prompt="The quick brown", max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    off = engine.completions.create(top_k=0, **kw).choices[0].token_ids
    assert engine.completions.create(top_k=2**31 - 1, **kw).choices[0].token_ids == off


def _run_core(compiled, param_list, prompt=lambda p: [5, 6, 7, 8], edit=None):
    """Each SamplingParams as one sequence of one LLMEngine, stepped until done (`edit` may change
    the sequences first); the StepOutputs per sequence. The pool ends with every page free."""
    from mlc_lora.engine.core import LLMEngine

    core = LLMEngine(compiled, "cpu")
    outs = {i: [] for i in range(len(param_list))}
    seqs = [core.make_sequence(prompt(p), p, sink=outs[i].append) for i, p in enumerate(param_list)]
    if edit is not None:
        edit(seqs)
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    assert core.pool.available_pages() == core.kv_pages_total
    return outs


def test_a_row_whose_sampling_fails_fails_alone(tiny_chat):
    """A sequence whose sampling raises (here parameters that bypassed the request checks, as a
    sampler bug would) gets its own error; the rest of its batch goes on as if it were alone."""
    from mlc_lora.engine.scheduler import SamplingParams
    from mlc_lora.errors import MLCLoraError

    def run(param_list):
        return _run_core(tiny_chat[1], param_list, prompt=lambda p: [5, 6, 7, 8 + p.seed if p.seed else 8])

    good = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    bad = SamplingParams(max_tokens=6, temperature=1.0, top_k=2**40, seed=9, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    alone = run(good + [greedy])
    mixed = run([good[0], bad, good[1], greedy])
    err = [o.error for o in mixed[1] if o.error is not None]
    assert len(err) == 1 and isinstance(err[0], MLCLoraError) and "sampling failed" in str(err[0])
    for a, m in ((0, 0), (1, 2), (2, 3)):
        assert all(o.error is None for o in mixed[m])
        assert [t.token for o in mixed[m] for t in o.tokens] == [t.token for o in alone[a] for t in o.tokens]
        assert mixed[m][-1].finish_reason == "length"


def test_a_row_whose_logit_processing_fails_fails_alone(tiny_chat):
    """Penalties and logit_bias run per row: a row whose processing raises (a token id past the
    vocabulary that bypassed make_sequence's check) fails alone; a penalized row beside it and a
    plain one give what they give alone."""
    import dataclasses

    from mlc_lora.engine.scheduler import SamplingParams
    from mlc_lora.errors import MLCLoraError

    def run(param_list, broken=None):
        def edit(seqs):
            if broken is not None:
                seqs[broken].params = dataclasses.replace(seqs[broken].params, logit_bias=((10**6, 1.0),))

        return _run_core(tiny_chat[1], param_list, edit=edit)

    penal = SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=1.0, ignore_eos=True)
    plain = SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=((3, 1.0),), ignore_eos=True)
    alone = run([penal, plain])
    mixed = run([penal, bad, plain], broken=1)
    err = [o.error for o in mixed[1] if o.error is not None]
    assert len(err) == 1 and isinstance(err[0], MLCLoraError) and "outside the vocabulary" in str(err[0])
    for a, m in ((0, 0), (1, 2)):
        assert all(o.error is None for o in mixed[m])
        assert [t.token for o in mixed[m] for t in o.tokens] == [t.token for o in alone[a] for t in o.tokens]


def test_a_raising_output_callback_ends_its_request_alone(engine):
    """A request whose output callback raises (as a closed asyncio loop's would) is aborted; the
    engine thread keeps serving the others and the pool returns to idle."""
    from mlc_lora.engine.scheduler import SamplingParams

    before = engine.completions.create(prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    calls = []

    def sink(out):
        calls.append(out)
        raise RuntimeError("Event loop is closed")

    core = engine.engine
    seq = core.make_sequence(engine.tokenizer.encode("Hi there"), SamplingParams(max_tokens=40, temperature=0),
                             None, sink)
    engine._loop.submit(seq)  # pylint: disable=protected-access
    import time

    deadline = time.monotonic() + 60
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the step that called the sink has ended
    # checked before the next request: a dead engine thread would never answer it
    assert calls and engine._loop.is_alive()  # pylint: disable=protected-access
    assert engine.completions.create(prompt="Hello", max_tokens=8, temperature=0).choices[0].text == before
    assert len(calls) == 1 and seq.finish_reason == "abort"
    stats = engine._loop.call(core.stats)  # pylint: disable=protected-access
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_prompt_logprobs_across_prefill_chunks_match_hf(tiny_chat):
    """echo + logprobs on a prompt longer than the prefill chunk (128 here), beside a short one in
    the same batch: every prompt token's logprob equals HF's (a chunk boundary loses none)."""
    import asyncio

    import numpy as np
    import torch

    from mlc_lora import AsyncMLCEngine

    rng = np.random.default_rng(0)
    long_ids = [int(x) for x in rng.integers(3, 300, 300)]
    short_ids = [5, 17, 42, 99]
    with AsyncMLCEngine(tiny_chat[1], "cpu") as eng:
        async def go():
            return await asyncio.gather(*[eng.completions.create(prompt=p, max_tokens=0, echo=True, logprobs=2)
                                          for p in (long_ids, short_ids)])

        outs = asyncio.run(go())
    for ids, r in zip((long_ids, short_ids), outs):
        lp = r.choices[0].logprobs
        with torch.no_grad():
            ref = torch.log_softmax(tiny_chat[0](torch.tensor([ids])).logits[0].float(), -1)
        want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
        best = [max(top.values()) for top in lp.top_logprobs[1:]]  # the most likely token is listed
        np.testing.assert_allclose(best, [float(ref[i - 1].max()) for i in range(1, len(ids))], atol=1e-4)


def test_logit_processing_on_the_host_matches_the_device(tiny_chat):
    """A library compiled before `process_logits` processes on the host: same tokens."""
    from mlc_lora.engine.core import LLMEngine
    from mlc_lora.engine.scheduler import SamplingParams

    def run(device: bool):
        core = LLMEngine(tiny_chat[1], "cpu")
        if not device:
            del core.sampler.fn["process_logits"]
        outs = {i: [] for i in range(3)}
        params = [SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=8, temperature=0.8, seed=5, repetition_penalty=1.5, ignore_eos=True),
                  SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((40, 3.0), (41, -100.0)),
                                 ignore_eos=True)]
        for i, p in enumerate(params):
            core.add(core.make_sequence([5, 6, 7, 8, 5, 6], p, sink=outs[i].append))
        while core.has_work():
            core.step()
        return [[t.token for o in outs[i] for t in o.tokens] for i in range(3)]

    assert run(device=True) == run(device=False)
