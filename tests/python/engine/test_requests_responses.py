"""The engine's request validation (requests.py) and its one response builder (responses.py), without
a model: arguments -> SamplingParams, and step outputs -> OpenAI chunks and whole responses."""

import pytest

from mlc_lora.engine.core import StepOutput
from mlc_lora.engine.requests import MAX_CHOICES, prompt_ids, request_options
from mlc_lora.engine.responses import ResponseBuilder
from mlc_lora.engine.sampler import Sampled
from mlc_lora.engine.scheduler import SamplingParams, Sequence
from mlc_lora.errors import RequestError


def test_request_options_defaults_and_aliases():
    params, n = request_options()
    assert n == 1 and params == SamplingParams(max_tokens=None)
    params, n = request_options(max_completion_tokens=7, n=3, stop="x", logprobs=2, model="m", user="u")
    assert (n, params.max_tokens, params.stop, params.logprobs, params.top_logprobs) == (3, 7, ("x",), True, 2)
    params, _ = request_options(max_tokens=4, max_completion_tokens=9, temperature=0, top_k=5)
    assert (params.max_tokens, params.temperature, params.top_k) == (4, 0.0, 5)


@pytest.mark.parametrize("kw, needle", [
    (dict(n=0), f"n must be an integer in \\[1, {MAX_CHOICES}\\], got 0"),
    (dict(n=True), "n must be an integer"),
    (dict(frequency_penalty=1.0, tools=[], foo=1), "unknown request arguments: foo, tools"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1 \\(0 only with echo"),
    (dict(max_tokens=-1), "max_tokens must be an integer in \\[0, 2147483647\\], got -1"),
    (dict(frequency_penalty=2.5), "frequency_penalty must be >= -2.0 and <= 2.0, got 2.5"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
    (dict(repetition_penalty=0), "repetition_penalty must be in \\(0, 10.0\\], got 0"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={"5": float("inf")}), "logit_bias\\['5'\\] must be a finite number"),
    (dict(logit_bias=[1]), "logit_bias must be an object"),
    (dict(n=2, best_of=3), "best_of must equal n \\(2\\)"),
    (dict(response_format={"type": "xml"}), "response_format.type: Input should be"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), "top_p must be in \\(0, 1\\]"),
    (dict(top_k=-2), "top_k must be >= 0"),
    (dict(stop=["ok", ""]), "stop must be a non-empty string"),
    (dict(top_logprobs=21), "top_logprobs must be an integer in \\[0, 20\\]"),
])
def test_request_options_refuse_bad_arguments(kw, needle):
    with pytest.raises(RequestError, match=needle):
        request_options(**kw)


def test_prompt_ids_need_what_they_need():
    assert prompt_ids(None, chat=False, prompt=[3, 1, 4]) == [3, 1, 4]
    with pytest.raises(RequestError, match="text prompts need a tokenizer"):
        prompt_ids(None, chat=False, prompt="hi")
    with pytest.raises(RequestError, match="chat needs a tokenizer"):
        prompt_ids(None, chat=True, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="messages must be a non-empty list"):
        prompt_ids(None, chat=True, messages=[])
    with pytest.raises(RequestError, match="prompt must be a string or a list of token ids"):
        prompt_ids(None, chat=False, prompt=[1, "2"])


def _outputs():
    """Two choices of a 3-token prompt: (choice, output) in arrival order, with logprobs."""
    s = lambda t, lp: Sampled(t, lp, [(t, lp)])  # noqa: E731
    return [(0, StepOutput("Hel", [s(1, -0.1)])), (1, StepOutput("", [s(7, -0.7)])),
            (0, StepOutput("lo", [s(2, -0.2)], "stop", usage=(3, 2))),
            (1, StepOutput("Hi!", [s(8, -0.8)], "length", usage=(3, 2)))]


def _seqs():
    return [Sequence([4, 5, 6], SamplingParams(max_tokens=2, logprobs=True, top_logprobs=1)) for _ in range(2)]


def test_streamed_chunks_and_the_whole_response_agree():
    for chat in (False, True):
        stream = ResponseBuilder(chat, "m", None, _seqs())
        chunks = [c for c in (stream.chunk(i, o) for i, o in _outputs())]
        whole_builder = ResponseBuilder(chat, "m", None, _seqs())
        outs = [[o for i, o in _outputs() if i == k] for k in (0, 1)]
        whole = whole_builder.response(outs)
        # every output carries a token with logprobs: one chunk each; usage once, on the last
        assert all(c is not None for c in chunks)
        assert [c.usage for c in chunks[:-1]] == [None] * 3
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 4)
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (3, 4, 7)
        assert [c.id for c in chunks] == [stream.id] * 4 and stream.id != whole.id
        text = {k: "".join(o.text for i, o in _outputs() if i == k) for k in (0, 1)}
        if chat:
            assert [c.choices[0].delta.role for c in chunks] == ["assistant", "assistant", None, None]
            assert [ch.message.content for ch in whole.choices] == [text[0], text[1]] == ["Hello", "Hi!"]
            assert [t.token for t in whole.choices[0].logprobs.content] == ["1", "2"]
            assert whole.object == "chat.completion" and chunks[0].object == "chat.completion.chunk"
        else:
            assert [ch.text for ch in whole.choices] == ["Hello", "Hi!"]
            # text_offset: where each token's text starts in the choice's text (streamed: in chunks)
            assert whole.choices[0].logprobs.text_offset == [0, 3]
            assert [c.choices[0].logprobs.text_offset for c in chunks if c.choices[0].index == 0] == [[0], [3]]
            assert whole.choices[1].logprobs.top_logprobs == [{"7": -0.7}, {"8": -0.8}]
        assert [ch.finish_reason for ch in whole.choices] == ["stop", "length"]
        assert [ch.token_ids for ch in whole.choices] == [[1, 2], [7, 8]]


def test_an_output_with_nothing_to_say_makes_no_chunk():
    seqs = [Sequence([1], SamplingParams(max_tokens=3))]
    b = ResponseBuilder(False, "m", None, seqs)
    assert b.chunk(0, StepOutput("", [Sampled(5)])) is None  # text held back, no logprobs asked
    assert b.chunk(0, StepOutput("a", [Sampled(6)])).choices[0].text == "a"
    last = b.chunk(0, StepOutput("", [Sampled(7)], "length", usage=(1, 3)))
    assert (last.choices[0].finish_reason, last.usage.total_tokens) == ("length", 4)


@pytest.mark.parametrize("kw, param, needle", [
    (dict(temperature="a"), "temperature", "temperature must be a number"),
    (dict(temperature=float("inf")), "temperature", "temperature must be a finite number"),
    (dict(temperature=float("nan")), "temperature", "temperature must be a finite number"),
    (dict(temperature=True), "temperature", "temperature must be a number"),
    (dict(top_p=float("nan")), "top_p", "top_p must be a finite number"),
    (dict(seed="x"), "seed", "seed must be an integer"),
    (dict(seed=-1), "seed", "seed must be an integer in \\[0, "),
    (dict(seed=2**64), "seed", "seed must be an integer in \\[0, "),
    (dict(stop=5), "stop", "stop must be a non-empty string or a list of them"),
    (dict(stop=["ok", 5]), "stop", "stop must be a non-empty string"),
    (dict(stop="\ud800"), "stop", "stop.*not valid Unicode"),
    (dict(max_tokens=True), "max_tokens", "max_tokens must be an integer"),
    (dict(max_tokens=2.0), "max_tokens", "max_tokens must be an integer"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens must be an integer in \\[1, "),
    (dict(top_k=1.5), "top_k", "top_k must be an integer"),
    (dict(top_k=2**40), "top_k", "top_k must be an integer in \\[0, 2147483647\\]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "stop_token_ids must be a list of integers >= 0"),
    (dict(stop_token_ids=[True]), "stop_token_ids", "stop_token_ids must be a list of integers"),
    (dict(stop_token_ids=5), "stop_token_ids", "stop_token_ids must be a list of integers"),
    (dict(ignore_eos="yes"), "ignore_eos", "ignore_eos must be a boolean"),
    (dict(logprobs="yes"), "logprobs", "logprobs must be a boolean"),
    (dict(top_logprobs=1.0), "top_logprobs", "top_logprobs must be an integer"),
])
def test_every_parameter_is_checked_with_bounds_and_named(kw, param, needle):
    with pytest.raises(RequestError, match=needle) as e:
        request_options(**kw)
    assert e.value.param == param


@pytest.mark.parametrize("kw, param, needle", [
    (dict(chat=False, prompt="bad \ud800 text"), "prompt", "prompt is not valid Unicode"),
    (dict(chat=False, prompt=[1, True]), "prompt", "prompt must be a string or a list of token ids"),
    (dict(chat=True, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages",
     "messages\\[0\\].content\\[0\\].text must be a string"),
    (dict(chat=True, messages=[{"role": "user", "content": "hi \udfff"}]), "messages",
     "messages\\[0\\].content is not valid Unicode"),
    (dict(chat=True, messages=[{"role": ["user"], "content": "hi"}]), "messages", "unknown role"),
])
def test_prompts_and_messages_are_checked_before_the_tokenizer(kw, param, needle):
    with pytest.raises(RequestError, match=needle) as e:
        prompt_ids(object(), **kw)  # refused before the (here unusable) tokenizer is touched
    assert e.value.param == param


def test_bounds_that_pass():
    params, _ = request_options(top_k=2**31 - 1, seed=2**63 - 1, temperature=100, stop_token_ids=[0, 5],
                                ignore_eos=True, logprobs=False, max_completion_tokens=3)
    assert (params.top_k, params.seed, params.temperature, params.stop_token_ids, params.max_tokens) == \
        (2**31 - 1, 2**63 - 1, 100.0, (0, 5), 3)
