"""`mlc_lora serve` on the tiny chat model, driven over loopback by the official openai client.

References: a greedy loop over the HF torch model (tokens and logprobs), transformers' chat
template rendering, and the server's own non-streaming answer for its streams.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time

import httpx
import openai
import pytest

from .conftest import API_KEY, greedy_reference, run_server, scrape, wait_idle

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def server(tiny_chat):
    with run_server(tiny_chat[1], "--api-key", API_KEY, "--served-model-name", "tiny") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_chat_hf):
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(tiny_chat_hf[1])


def test_api_key_required(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200  # health and metrics stay open
    assert httpx.get(f"{server}/metrics").status_code == 200


def test_api_key_all_routes_guards_metrics_and_docs(tiny_chat):
    with run_server(tiny_chat[1], "--api-key", API_KEY, "--api-key-all-routes") as url:
        h = {"Authorization": f"Bearer {API_KEY}"}
        for route in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
            r = httpx.get(f"{url}{route}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", route
            assert httpx.get(f"{url}{route}", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401, route
            assert httpx.get(f"{url}{route}", headers=h).status_code == 200, route
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


@pytest.mark.parametrize("how", ["flag", "env", "blank"])
def test_an_empty_api_key_is_refused_at_startup(tiny_chat, how):
    import os
    import subprocess
    import sys

    args = {"flag": ["--api-key", ""], "env": [], "blank": ["--api-key", "  "]}[how]
    env = {**os.environ, "MLC_LORA_API_KEY": ""}
    r = subprocess.run([sys.executable, "-m", "mlc_lora.cli.main", "serve", str(tiny_chat[1]), "--port", "1", *args],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "the API key is empty" in r.stderr, r.stderr


def test_models_lists_the_base_model(client, tiny_chat):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].root == str(tiny_chat[1])


def test_completion_matches_hf_greedy_with_logprobs(client, tiny_chat, hf_tokenizer):
    model = tiny_chat[0]
    ids = hf_tokenizer(PROMPT)["input_ids"]
    want, want_lp = greedy_reference(model, ids, 12)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == "tiny"
    c = r.choices[0]
    assert c.text == hf_tokenizer.decode(want, skip_special_tokens=True)
    assert c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert len(c.logprobs.token_logprobs) == 12
    for got, ref in zip(c.logprobs.token_logprobs, want_lp):
        assert math.isclose(got, ref, abs_tol=1e-3)
    # greedy: no top-2 entry beats the chosen token (entries are keyed by text, so two byte tokens
    # decoding to U+FFFD share one key); text offsets rise through the text
    for top, lp in zip(c.logprobs.top_logprobs, c.logprobs.token_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) <= lp + 1e-6
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)


def test_chat_matches_hf_greedy_and_streams_the_same(client, tiny_chat, hf_tokenizer):
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    want, _ = greedy_reference(tiny_chat[0], ids, 16, eos={eos})
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == hf_tokenizer.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("stop" if want[-1] == eos else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_with_logprobs_equals_whole(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_whole_and_streamed(client):
    """n = 3 with a seed: choice i is the single request with seed + i, streamed or not; usage
    counts the prompt once and every choice's tokens, on its own last chunk when asked."""
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    singles = [client.completions.create(seed=40 + i, **kw) for i in range(3)]
    many = client.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [r.choices[0].text for r in singles]
    assert len({r.choices[0].text for r in singles}) > 1
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles) == 36
    chunks = list(client.completions.create(n=3, seed=40, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in many.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 36
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=6, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_token_id_prompt_equals_text_prompt(client, hf_tokenizer):
    ids = hf_tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert by_ids == by_text


@pytest.mark.parametrize("kw, needle", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=100000), "exceeds the context"),
    (dict(extra_body={"temperature": "hot"}), "temperature must be a number"),
    (dict(extra_body={"logit_bias": {"x": 1}}), "logit_bias keys must be token ids"),
    (dict(n=0), "n must be an integer in [1, 16]"),
    (dict(n=17), "n must be an integer in [1, 16]"),
])
def test_invalid_requests_get_400(client, kw, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 4, **kw})
    assert e.value.status_code == 400 and needle in e.value.body["message"]


def test_bad_bodies_and_unknown_model(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert "messages" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-adapter", messages=MESSAGES, max_tokens=4)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    assert "no-such-adapter" in e.value.body["message"]
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json=[1, 2], headers=h)
    assert r.status_code == 400
    r = httpx.post(f"{server}/v1/nothing-here", json={}, headers=h)
    assert r.status_code == 404 and "error" in r.json()


def _openai_error(r: httpx.Response, status: int) -> dict:
    """The OpenAI error object of `r`, checked to be one (JSON, with every field)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("raw, param, needle", [
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature", "finite"),
    (b'{"model": "tiny", "prompt": "hi", "seed": -1}', "seed", "seed must be an integer in [0, "),
    (b'{"model": "tiny", "prompt": "hi", "top_k": 1099511627776}', "top_k", "top_k must be an integer in"),
    (b'{"model": "tiny", "prompt": "hi", "stop": 5}', "stop", "stop must be"),
    (b'{"model": "tiny", "prompt": "bad \\ud800 text"}', "prompt", "not valid Unicode"),
    (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', "stream", "stream must be a boolean"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages", "text must be a string"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x \\udfff"}]}', "messages",
     "not valid Unicode"),
    (b'{"model": "\\ud800", "prompt": "hi"}', "model", "does not exist"),
])
def test_bad_fields_get_openai_400s_naming_them(server, raw, param, needle):
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    route = "chat/completions" if b"messages" in raw else "completions"
    r = httpx.post(f"{server}/v1/{route}", content=raw, headers=h, timeout=30)
    err = _openai_error(r, 404 if param == "model" else 400)
    assert err["param"] == param and needle in err["message"]


def test_every_error_is_openai_json(server):
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "nested too deeply" in _openai_error(httpx.post(f"{server}/v1/completions", content=deep, headers=h),
                                                400)["message"]
    _openai_error(httpx.get(f"{server}/v1/completions", headers=h), 405)
    _openai_error(httpx.post(f"{server}/v1/completions", content=b"\xff\xfe", headers=h), 400)
    # the server still serves
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers=h)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_an_unexpected_exception_is_a_json_500_and_in_band_in_streams():
    """Errors no check foresaw (the engine raising a plain exception) are answered in OpenAI's
    shape too: a JSON 500, and in a stream an error event then [DONE]."""
    from fastapi.testclient import TestClient

    from mlc_lora.serve.app import Server, create_app

    class Broken:  # an engine whose calls fail the way a bug would
        def __init__(self):
            self.chat = type("Chat", (), {"completions": self})()
            self.completions = self

        async def create(self, stream=False, **_):
            if not stream:
                raise RuntimeError("boom")

            async def gen():
                raise KeyError("half way")
                yield  # pylint: disable=unreachable

            return gen()

        async def stats(self):
            return {}

        def is_alive(self):
            return True

    with TestClient(create_app(Server(Broken(), "tiny")), raise_server_exceptions=False) as c:
        err = _openai_error(c.post("/v1/completions", json={"prompt": "hi"}), 500)
        assert err["type"] == "server_error" and "RuntimeError: boom" in err["message"]
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and "half way" in json.loads(events[-2])["error"]["message"]


def test_adapter_endpoints_without_adapter_dir(server):
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}, headers=h)
    assert r.status_code == 400 and "--adapter-dir" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_path": "/tmp"}, headers=h)
    assert r.status_code == 400 and "lora_name" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"}, headers=h)
    assert r.status_code == 404


def _aborted(url: str) -> float:
    return scrape(url)["mlc_lora_engine_num_aborted"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(server, stream):
    before = _aborted(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    h = {"Authorization": f"Bearer {API_KEY}"}
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=h, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event arrived: the request is running; now hang up
    else:  # a raw socket, closed once the server reports the request running
        payload = json.dumps({**body, "max_tokens": 480}).encode()
        host, port = server.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                         + payload)
            deadline = time.monotonic() + 60
            while scrape(server)["mlc_lora_num_requests_running"] == 0:
                assert time.monotonic() < deadline, "the request never showed up as running"
                time.sleep(0.01)
    m = wait_idle(server)
    assert m["mlc_lora_engine_num_aborted"] == before + 1
    assert m['mlc_lora_pool_pages{kind="kv"}'] == 0
    assert m['mlc_lora_pool_pages{kind="free"}'] == m["mlc_lora_engine_kv_pages_total"]


def test_64_concurrent_streams_then_every_page_is_free(server):
    """64 streaming requests at once (more than the 16-sequence batch: queueing and continuous
    batching); all finish, then the pool is back to idle and the metrics add up."""
    before = scrape(server)

    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=8 + i % 9,
                                                 temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        return text, usage, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert [f for _, _, f in results] == ["length"] * 64
    assert [u.completion_tokens for _, u, _ in results] == [8 + i % 9 for i in range(64)]
    m = wait_idle(server)
    assert m['mlc_lora_pool_pages{kind="kv"}'] == 0 and m['mlc_lora_pool_pages{kind="adapter"}'] == 0
    assert m['mlc_lora_pool_pages{kind="free"}'] == m["mlc_lora_engine_kv_pages_total"]
    assert m["mlc_lora_engine_max_running"] == 16  # the batch filled up
    assert m['mlc_lora_requests_total{endpoint="completions",outcome="ok"}'] - \
        before['mlc_lora_requests_total{endpoint="completions",outcome="ok"}'] == 64
    assert m["mlc_lora_generation_tokens_total"] - before["mlc_lora_generation_tokens_total"] == \
        sum(8 + i % 9 for i in range(64))


def test_bench_serving_drives_the_server(server, tiny_chat, tmp_path, capsys):
    """scripts/bench_serving.py end to end over HTTP (a small ShareGPT-shaped file, cut mid-record)."""
    from .test_bench_serving import load_bench

    recs = [{"conversations": [{"from": "human", "value": f"Hello, how are you today? {i} " * (1 + i % 3)},
                               {"from": "gpt", "value": "The quick brown fox jumps over the lazy dog. " * 2}]}
            for i in range(10)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(recs)[:-30])
    before = scrape(server)['mlc_lora_requests_total{endpoint="completions",outcome="ok"}']
    rc = load_bench().main(["--base-url", server, "--api-key", API_KEY, "--tokenizer", str(tiny_chat[1]),
                            "--dataset-path", str(data), "--num-prompts", "6", "--request-rate", "50",
                            "--max-output-len", "8", "--popularity", "power", "--alpha", "0.5",
                            "--no-progress", "--save-result", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Successful requests:                     6" in out and "Mean TTFT (ms):" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["models"] == ["tiny"] and saved["metrics"]["total_output"] == 6 * 8
    after = scrape(server)['mlc_lora_requests_total{endpoint="completions",outcome="ok"}']
    assert after - before == 6


# --- the OpenAI / vLLM parameters third-party clients send --------------------------------------

def _penalized_greedy(model, prompt_ids, n, freq=0.0, pres=0.0, rep=1.0, bias=None):
    """Greedy tokens of a torch causal LM with vLLM's logit processing, written out in torch."""
    import torch

    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
            for t, b in (bias or {}).items():
                logits[t] += b
            seen = torch.tensor(sorted(set(ids)))
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / rep, v * rep)
            for t in set(out):
                logits[t] -= freq * out.count(t) + pres
            t = int(logits.argmax())
            ids.append(t)
            out.append(t)
    return out


def test_echo_prompt_logprobs_match_hf_for_a_batch_of_prompts(client, tiny_chat, hf_tokenizer):
    import torch

    prompts = [hf_tokenizer(p).input_ids for p in (PROMPT, "Hello, how are you today?")]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == 0
    for ids, c in zip(prompts, r.choices):
        assert c.text == hf_tokenizer.decode(ids) and c.finish_reason == "length"
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
        with torch.no_grad():
            ref = torch.log_softmax(tiny_chat[0](torch.tensor([ids])).logits[0].float(), -1)
        want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        for i, top in enumerate(lp.top_logprobs[1:], 1):  # the prompt's own token and the best one
            assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
    # echo with generation: prompt, then the new tokens (and token ids of the new tokens only)
    r = client.completions.create(model="tiny", prompt=[prompts[0]] * 2, max_tokens=3, echo=True, logprobs=0,
                                  temperature=0, n=1, extra_body={"ignore_eos": True})
    want = greedy_reference(tiny_chat[0], prompts[0], 3)[0]
    for c in r.choices:
        assert c.token_ids == want and len(c.logprobs.tokens) == len(prompts[0]) + 3
        assert c.text == hf_tokenizer.decode(prompts[0]) + hf_tokenizer.decode(want)


def test_penalties_and_logit_bias_follow_vllm(client, tiny_chat):
    ids = [5, 17, 42, 99, 7]
    model = tiny_chat[0]
    cases = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(presence_penalty=-1.0),
             dict(repetition_penalty=1.8), dict(logit_bias={"50": 8.0, "60": -100.0})]
    for kw in cases:
        extra = {"ignore_eos": True}
        if "repetition_penalty" in kw:
            extra["repetition_penalty"] = kw["repetition_penalty"]
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=extra,
                                      **{k: v for k, v in kw.items() if k != "repetition_penalty"})
        want = _penalized_greedy(model, ids, 8, kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0),
                                 kw.get("repetition_penalty", 1.0),
                                 {int(t): b for t, b in kw.get("logit_bias", {}).items()})
        assert r.choices[0].token_ids == want, kw
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].token_ids
    assert plain == greedy_reference(model, ids, 8)[0]  # no penalty: the plain greedy run
    # a token id past the vocabulary fails that request alone, as a 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=ids, max_tokens=2, logit_bias={"100000": 1.0})
    assert "logit_bias token ids must lie in" in e.value.body["message"]


def test_best_of_seed_and_model_retrieve(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, best_of=2, seed=3, temperature=1)
    assert len(r.choices) == 2 and all(c.token_ids for c in r.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=1, best_of=3)
    assert "best_of must equal n" in e.value.body["message"]
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


def _follows(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"ok", "n", "tag"} and isinstance(obj["ok"], bool)
            and obj["n"] in (1, 2, 3) and obj["tag"] in ("a", "b"))


def test_response_format_json_schema_gives_valid_json(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
        assert _follows(json.loads(r.choices[0].message.content)), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":  # an open object may run past max_tokens
        assert isinstance(json.loads(r.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


def test_unknown_fields_are_ignored_as_vllm_does(client):
    a = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    b = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"frobnicate": 1, "guided_whatever": "x"})
    assert a.choices[0].text == b.choices[0].text


def test_openapi_schema_has_the_request_bodies(server):
    spec = httpx.get(f"{server}/openapi.json").json()
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(name)
        props = spec["components"]["schemas"][name]["properties"]
        for field in ("temperature", "frequency_penalty", "logit_bias", "response_format", "max_tokens"):
            assert field in props, (name, field)
        assert props["frequency_penalty"]["anyOf"][0]["maximum"] == 2.0


def test_a_body_past_the_limit_is_413(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}',
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "larger than the server's limit" in r.json()["error"]["message"]


def test_a_big_prompt_is_tokenized_off_the_event_loop(server):
    """A body under the limit whose prompt takes seconds to tokenize: /health keeps answering."""
    import threading

    text = ("Continuous batching serves many requests at once. " * 70_000)[:3 * 2**20]
    out = {}

    def post():
        t = time.monotonic()
        out["r"] = httpx.post(f"{server}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        out["s"] = time.monotonic() - t

    th = threading.Thread(target=post)
    th.start()
    worst = 0.0
    while th.is_alive():
        t = time.monotonic()
        assert httpx.get(f"{server}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.05)
    th.join()
    assert out["r"].status_code == 400 and "context" in out["r"].json()["error"]["message"]
    print(f"big prompt answered in {out['s']:.1f} s; slowest /health meanwhile {worst:.2f} s")
    assert out["s"] > 1.5  # the check means something: the prompt took a while (on the loop, /health waited as long)
    assert worst < 1.0
