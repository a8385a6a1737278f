"""How outputs travel from the engine thread to the callers: AsyncMLCEngine's per-loop Mailbox (one
loop wake-up for a burst, every request's items in order, refused once the loop is closed) and the
whole responses that gather their outputs on the engine thread."""

import asyncio
import threading
import time

import pytest

from mlc_lora.engine.async_frontend import Mailbox


def test_mailbox_hands_a_burst_over_with_one_wake_up_in_order():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    queues = [asyncio.Queue() for _ in range(3)]
    wakes = []

    def engine_thread(rounds):  # as LLMEngine._deliver: the wake-ups asked for, called after the puts
        asked = [w for k in rounds for j, q in enumerate(queues) if (w := box.put(q, (j, k))) is not None]
        wakes.append(len(asked))
        for w in asked:
            w()

    try:
        # a burst put while the loop is busy elsewhere: one wake-up hands all of it over
        t = threading.Thread(target=engine_thread, args=(range(50),))
        t.start()
        t.join()
        assert wakes == [1] and all(q.empty() for q in queues)
        loop.run_until_complete(asyncio.sleep(0))
        assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == \
            [[(j, k) for k in range(50)] for j in range(3)]
        # a burst before the loop took the last one needs no wake-up of its own
        engine_thread(range(50, 53))
        engine_thread(range(53, 60))
        assert wakes == [1, 1, 0]
        loop.run_until_complete(asyncio.sleep(0))
        assert [q.qsize() for q in queues] == [10, 10, 10]
        assert [queues[2].get_nowait() for _ in range(10)] == [(2, k) for k in range(50, 60)]
    finally:
        loop.close()
    for _ in range(2):  # every put after the loop closed raises (the engine drops that request)
        with pytest.raises(RuntimeError, match="closed"):
            box.put(queues[0], (0, 99))
    with pytest.raises(RuntimeError, match="closed"):
        box.alive()


def test_a_whole_response_whose_caller_is_gone_is_aborted(engine):
    """A whole response gathers its outputs on the engine thread and checks `alive()` at each; once
    that raises (AsyncMLCEngine's: the caller's event loop closed), the request is aborted at its
    next output, as a stream's would be, and its pages go back; the engine serves on."""
    from mlc_lora.engine.frontend import Request

    core = engine.engine
    before = engine.completions.create(prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    gone, checks, put = threading.Event(), [], []

    def alive():
        checks.append(1)
        if gone.is_set():
            raise RuntimeError("Event loop is closed")

    req = Request(engine, False, False, put.append, prompt="Hello", max_tokens=400, temperature=0,
                  ignore_eos=True, alive=alive)
    deadline = time.monotonic() + 60
    while len(checks) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    gone.set()
    while req.seqs[0].finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert req.seqs[0].finish_reason == "abort" and put == []
    assert 2 <= len(req.outs[0]) < 400  # gathered until the caller was found gone
    assert engine.completions.create(prompt="Hello", max_tokens=8, temperature=0).choices[0].text == before
    stats = engine._loop.call(core.stats)  # pylint: disable=protected-access
    assert stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_step_delivers_its_outputs_after_its_work_and_wakes_each_reader_once(tiny_chat):
    """LLMEngine hands a step's outputs to the sinks when the step's work is done (every sequence
    holds its new token by then), in the order of the batch, then calls each distinct callable
    the sinks returned once."""
    from mlc_lora.engine.core import LLMEngine
    from mlc_lora.engine.scheduler import SamplingParams

    core = LLMEngine(tiny_chat[1], "cpu")
    log = []

    class Reader:
        def __init__(self, name):
            self.name = name

        def wake(self):
            log.append(("wake", self.name))

    readers = [Reader("a"), Reader("b")]

    def sink(k):
        def put(out):
            log.append((k, out.finish_reason, [len(s.output_ids) for s in seqs]))
            return readers[k % 2].wake

        return put

    prompt = core.tokenizer.encode("Hello, how are you")
    seqs = [core.make_sequence(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), None, sink(k))
            for k in range(3)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    want = []
    for n in (1, 2, 3):  # a prefill of the three, then two decode steps
        want += [(k, "length" if n == 3 else None, [n, n, n]) for k in range(3)]
        want += [("wake", "a"), ("wake", "b")]
    assert log == want
