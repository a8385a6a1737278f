"""LoRA adapters through `mlc_lora serve`: selection by `model`, runtime load/unload, path checks,
64 concurrent streams over 8 adapters, and loads while 64 streams fill a small pool (with a host
tier budget of 0: copies dropped and read again); references are HF + PEFT greedy runs of the same
folders.
"""

from __future__ import annotations

import asyncio
import copy
import math

import httpx
import openai
import pytest

from .conftest import API_KEY, greedy_reference, make_chat_model, run_server, scrape, wait_idle


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# eight adapters: ranks 2..8, different targets and alphas
ADAPTERS = {f"a{i}": dict(r=2 + i % 7, lora_alpha=4 + 2 * i, target_modules=ALL if i % 2 == 0 else
                          ["q_proj", "v_proj", "down_proj"]) for i in range(8)}
PROMPT_IDS = [5, 17, 42, 99, 7, 250, 13]
H = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import peft
    import torch

    from mlc_lora.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("serve_lora")
    base = make_chat_model(root / "hf")
    adapter_dir = root / "adapters"
    refs = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(200 + i)
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:  # PEFT starts B at zero; make each adapter change the output
                    p.copy_(0.3 * torch.randn_like(p))
        pm.save_pretrained(adapter_dir / name)
        refs[name] = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir / name).eval()
    compiled = compile_model(root / "hf", root / "llvm-lora", CompileOptions(
        prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=1024, max_lora_rank=8), progress=False)
    return base, refs, compiled, adapter_dir


@pytest.fixture(scope="module")
def server(setup):
    _, _, compiled, adapter_dir = setup
    with run_server(compiled, "--api-key", API_KEY, "--served-model-name", "tiny",
                    "--adapter", f"a0={adapter_dir / 'a0'}", "--adapter-dir", str(adapter_dir)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def _load(server, name, path):
    return httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=H, timeout=60)


def _unload(server, name):
    return httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": name}, headers=H, timeout=60)


def _greedy(client, model, n=8):
    c = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=n, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True}).choices[0]
    return c.logprobs.token_logprobs, c.text


def test_startup_adapter_is_listed_and_served(client, setup):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a0"}
    assert models["a0"].parent == "tiny"
    base, refs, _, _ = setup
    for model, ref in (("a0", refs["a0"]), ("tiny", base)):
        want, want_lp = greedy_reference(ref, PROMPT_IDS, 8)
        lps, _ = _greedy(client, model)
        assert lps == pytest.approx(want_lp, abs=1e-3), model


def test_load_at_runtime_and_select_by_model(server, client, setup):
    base, refs, _, adapter_dir = setup
    for name in list(ADAPTERS)[1:]:
        r = _load(server, name, adapter_dir / name)
        assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"tiny", *ADAPTERS}
    base_lp, _ = _greedy(client, "tiny")
    for name in ("a1", "a4", "a7"):
        want, want_lp = greedy_reference(refs[name], PROMPT_IDS, 8)
        lps, text = _greedy(client, name)
        assert lps == pytest.approx(want_lp, abs=1e-3), name
        assert not all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(lps, base_lp)), name


def test_bad_loads_are_refused(server, setup, tmp_path):
    _, _, _, adapter_dir = setup
    r = _load(server, "a1", adapter_dir / "a1")  # the name is taken
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    r = _load(server, "tiny", adapter_dir / "a1")
    assert r.status_code == 400
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for path in (outside, f"{adapter_dir}/../{outside.name}", "../../etc", "/etc"):
        r = _load(server, "evil", path)
        assert r.status_code == 400 and "outside the allowed" in r.json()["error"]["message"], path
    (adapter_dir / "escape").symlink_to(outside)
    r = _load(server, "evil", adapter_dir / "escape")
    assert r.status_code == 400 and "outside the allowed" in r.json()["error"]["message"]
    assert "evil" not in {m["id"] for m in httpx.get(f"{server}/v1/models", headers=H).json()["data"]}
    for name in ("a\x00b", "a\nb", "a/b", "x" * 257):  # names that could forge logs, paths or metrics
        r = _load(server, name, adapter_dir / "a1")
        assert r.status_code == 400 and "adapter name" in r.json()["error"]["message"], repr(name)
    from mlc_lora.engine.adapters import check_adapter_name

    assert check_adapter_name("y" * 256) == "y" * 256  # the longest allowed


def test_pin_in_load_is_a_strict_boolean(server, client, setup):
    _, _, _, adapter_dir = setup
    for pin in ("false", "true", 0, 1, None, [False]):
        r = httpx.post(f"{server}/v1/load_lora_adapter", headers=H, timeout=60,
                       json={"lora_name": "strict", "lora_path": str(adapter_dir / "a1"), "pin": pin})
        assert r.status_code == 400 and r.json()["error"]["param"] == "pin", pin
    assert "strict" not in {m.id for m in client.models.list().data}


def test_64_concurrent_streams_over_8_adapters_then_pool_is_idle(server, client):
    for name in ADAPTERS:  # every adapter resident before the snapshot
        _greedy(client, name, n=1)
    before = wait_idle(server)

    async def one(c, i):
        model = list(ADAPTERS)[i % 8]
        stream = await c.completions.create(model=model, prompt=PROMPT_IDS + [i], max_tokens=6 + i % 5,
                                            temperature=0.7, seed=i, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        assert all(ch.model == model for ch in chunks)
        return [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1], chunks[-1].usage.completion_tokens

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert results == [("length", 6 + i % 5) for i in range(64)]
    after = wait_idle(server)
    kinds = ("kv", "adapter", "free")
    assert after['mlc_lora_pool_pages{kind="kv"}'] == 0
    assert after['mlc_lora_pool_pages{kind="adapter"}'] == before['mlc_lora_pool_pages{kind="adapter"}'] > 0
    assert sum(after[f'mlc_lora_pool_pages{{kind="{k}"}}'] for k in kinds) == \
        sum(before[f'mlc_lora_pool_pages{{kind="{k}"}}'] for k in kinds)


def test_unload_then_404_and_reload(server, client, setup):
    _, refs, _, adapter_dir = setup
    _, want_lp = greedy_reference(refs["a7"], PROMPT_IDS, 8)
    r = _unload(server, "a7")
    assert r.status_code == 200, r.text
    assert "a7" not in {m.id for m in client.models.list().data}
    assert _unload(server, "a7").status_code == 404
    with pytest.raises(openai.NotFoundError) as e:  # a name that is no folder of --adapter-dir
        client.completions.create(model="a9", prompt=PROMPT_IDS, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    # a7 is still a folder of --adapter-dir: naming it in a request loads it (vLLM's resolver)
    lps, _ = _greedy(client, "a7")
    assert lps == pytest.approx(want_lp, abs=1e-3)
    assert "a7" in {m.id for m in client.models.list().data}
    assert _unload(server, "a7").status_code == 200
    assert _load(server, "a7", "a7").status_code == 200  # a path relative to the adapter folder
    lps, _ = _greedy(client, "a7")
    assert lps == pytest.approx(want_lp, abs=1e-3)
    m = scrape(server)
    assert m["mlc_lora_adapter_loads_total"] == 10 and m["mlc_lora_adapter_unloads_total"] == 2
    # the pool's own counters (the engine test evicts and pages in; here the pool is large enough)
    assert m["mlc_lora_adapter_evictions_total"] == 0 and m["mlc_lora_adapter_page_ins_total"] == 0
    # the greedy requests above ran alone: their decode steps held one adapter, whose pages they read
    one = m['mlc_lora_decode_adapter_steps_total{adapters="<=1"}']
    assert one >= 7 and m['mlc_lora_decode_adapter_step_bytes_total{adapters="<=1"}'] > 0
    assert m['mlc_lora_decode_adapter_step_seconds_total{adapters="<=1"}'] > 0


def test_a_name_found_on_disk_loads_once_for_concurrent_requests(server, setup):
    """Eight requests at once naming an adapter only on disk: one load, eight answers equal to
    PEFT's; names that would leave the adapter folders are never looked up."""
    _, refs, _, adapter_dir = setup
    _, want_lp = greedy_reference(refs["a5"], PROMPT_IDS, 8)
    assert _unload(server, "a5").status_code == 200
    before = scrape(server)["mlc_lora_adapter_loads_total"]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0) as c:
            return await asyncio.gather(*[c.completions.create(
                model="a5", prompt=PROMPT_IDS, max_tokens=8, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True}) for _ in range(8)])

    for r in asyncio.run(run()):
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(want_lp, abs=1e-3)
    assert scrape(server)["mlc_lora_adapter_loads_total"] == before + 1
    (adapter_dir / "not-an-adapter").mkdir(exist_ok=True)  # a folder without adapter files: 400
    r = httpx.post(f"{server}/v1/completions", headers=H, timeout=60,
                   json={"model": "not-an-adapter", "prompt": PROMPT_IDS, "max_tokens": 2})
    assert r.status_code == 400 and "adapter_config.json" in r.text, r.text
    for name in ("..", "../adapters/a1", "escape"):  # up, out, or a symlink out of the folder
        r = httpx.post(f"{server}/v1/completions", headers=H, timeout=60,
                       json={"model": name, "prompt": PROMPT_IDS, "max_tokens": 2})
        assert r.status_code in (400, 404), (name, r.text)
        assert name not in {m.id for m in openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY).models.list().data}


def test_pin_and_unpin_through_the_api(server, client):
    def pin(body):
        return httpx.post(f"{server}/v1/pin_lora_adapter", json=body, headers=H, timeout=60)

    def state(name):
        return next((m.model_extra["pinned"], m.model_extra["resident"])
                    for m in client.models.list().data if m.id == name)

    assert pin({"lora_name": "a7"}).status_code == 200
    assert state("a7") == (True, True)
    assert pin({"lora_name": "a7", "pin": False}).status_code == 200
    assert state("a7") == (False, True)
    r = pin({"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert pin({"lora_name": "a7", "pin": "yes"}).status_code == 400
    assert pin({"pin": True}).status_code == 400
    assert httpx.post(f"{server}/v1/pin_lora_adapter", json={"lora_name": "a7"}, timeout=60).status_code == 401


def test_load_inplace_replaces_and_vllm_texts(server, client, setup):
    _, refs, _, adapter_dir = setup
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=H, timeout=60,
                   json={"lora_name": "a6", "lora_path": str(adapter_dir / "a5"), "load_inplace": True})
    assert r.status_code == 200, r.text
    want, _ = greedy_reference(refs["a5"], PROMPT_IDS, 8)
    got = client.completions.create(model="a6", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].token_ids
    assert got == want  # "a6" now serves a5's weights
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=H, timeout=60,
                   json={"lora_name": "a6", "lora_path": "a6", "load_inplace": "yes"})
    assert r.status_code == 400 and "load_inplace must be true or false" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=H, timeout=60,
                   json={"lora_name": "a6", "lora_path": "a6", "load_inplace": True})
    assert r.status_code == 200
    want, _ = greedy_reference(refs["a6"], PROMPT_IDS, 8)
    got = client.completions.create(model="a6", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].token_ids
    assert got == want
    r = _unload(server, "never-loaded")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."


# A second server on the same library with a pool of BUSY_TOKENS tokens (about 30 pages: the
# streams' KV and the startup adapters fill it) and a host tier budget of 0.
BUSY_TOKENS = 480
STREAM_TOKENS = 40


@pytest.fixture(scope="module")
def busy_server(setup):
    _, _, compiled, adapter_dir = setup
    startup = [arg for name in ("a0", "a1", "a2", "a3") for arg in ("--adapter", f"{name}={adapter_dir / name}")]
    with run_server(compiled, "--api-key", API_KEY, "--served-model-name", "tiny", *startup,
                    "--adapter-dir", str(adapter_dir), "--max-total-tokens", str(BUSY_TOKENS),
                    "--adapter-host-bytes", "0") as url:
        yield url


def test_loads_while_64_streams_fill_the_pool(busy_server, setup, tmp_path):
    """64 greedy streams over four adapters keep every page busy; loading a4 (6 pages) then answers
    200 and a broken folder 400 without touching the streams. Every stream and a4's first request
    equal PEFT's greedy tokens; the tier counters show copies read again from their folders."""
    from mlc_lora.lora import peft_adapter_plan
    from mlc_lora.runner import read_compiled_config

    base, refs, compiled, adapter_dir = setup
    url = busy_server
    pages = peft_adapter_plan(adapter_dir / "a4", read_compiled_config(compiled, "cpu")).num_pages
    broken = adapter_dir / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                               '"target_modules": ["q_proj"]}')
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    prompts = [PROMPT_IDS + [(i * 7 + k) % 90 + 3 for k in range(4 + i % 9)] for i in range(64)]
    models = [f"a{i % 4}" for i in range(64)]

    async def one(c, i):
        stream = await c.completions.create(  # logprobs: a chunk for every token, even one with no text yet
            model=models[i], prompt=prompts[i], max_tokens=STREAM_TOKENS, temperature=0, logprobs=1, stream=True,
            extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        return chunks[-1].choices[0].finish_reason, [t for ch in chunks for t in ch.choices[0].token_ids]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(64)]
            busy = None
            for _ in range(400):
                m = await asyncio.to_thread(scrape, url)
                room = m['mlc_lora_pool_pages{kind="free"}'] + m["mlc_lora_engine_pool_pages_evictable"]
                if m["mlc_lora_num_requests_running"] >= 4 and room < pages:
                    busy = m
                    break
                await asyncio.sleep(0.01)
            loaded = await asyncio.to_thread(_load, url, "a4", adapter_dir / "a4")
            after = await asyncio.to_thread(scrape, url)
            bad = await asyncio.to_thread(_load, url, "bad", broken)
            return busy, loaded, after, bad, await asyncio.gather(*tasks)

    busy, loaded, after, bad, results = asyncio.run(run())
    assert busy is not None, "the 64 streams never filled the pool"
    assert loaded.status_code == 200, loaded.text
    assert bad.status_code == 400 and "broken" in bad.json()["error"]["message"], bad.text
    for i, (finish, tokens) in enumerate(results):
        want, _ = greedy_reference(refs[models[i]], prompts[i], STREAM_TOKENS)
        assert (finish, tokens) == ("length", want), i
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert {m.id for m in client.models.list().data} == {"tiny", "a0", "a1", "a2", "a3", "a4"}
    _, want_lp = greedy_reference(refs["a4"], PROMPT_IDS, 8)
    lps, _ = _greedy(client, "a4")
    assert lps == pytest.approx(want_lp, abs=1e-3)
    m = wait_idle(url)
    hits = {t: m[f'mlc_lora_adapter_tier_hits_total{{tier="{t}"}}'] for t in ("device", "host", "disk")}
    assert sum(hits.values()) == 64 + 1
    assert m['mlc_lora_adapter_tier_misses_total{tier="device"}'] == hits["host"] + hits["disk"]
    assert m["mlc_lora_adapter_host_bytes"] > 0
    # a4 loaded while the pool is full gets no pages, so its host copy is dropped (budget 0) and its
    # request reads the folder again. If the last streams freed pages while its folder was being
    # read, the load took them and the request may find it resident; but the streams may also evict
    # it (idle) before its request, or page an evicted a0-a3 back in (the resident count says nothing
    # of a4): which happened is a race, so the counters are checked against the path they report.
    assert after['mlc_lora_adapters{state="loaded"}'] == busy['mlc_lora_adapters{state="loaded"}'] + 1
    if hits["disk"] == 0:  # a4 was resident when its request came
        assert hits == {"device": 64 + 1, "host": 0, "disk": 0}
    else:
        assert hits["disk"] == 1 and hits["device"] == 64
        assert m["mlc_lora_adapter_disk_reads_total"] >= 1 and m["mlc_lora_adapter_host_drops_total"] >= 1
        assert m["mlc_lora_adapter_page_ins_total"] >= 1
    lead = m["mlc_lora_adapter_prefetch_lead_seconds_count"]
    assert lead <= m["mlc_lora_adapter_prefetch_page_ins_total"]
    assert m['mlc_lora_adapter_prefetch_lead_seconds_bucket{le="+Inf"}'] == lead
