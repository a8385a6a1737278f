"""A bounded soak of the engine (scripts/soak.py `engine`, in rounds): streamed requests of varied
prompt lengths on mixed adapters and the base model under pool pressure (preemption, eviction),
clients that leave mid-stream, an adapter unloaded and loaded again and one pinned and unpinned while
requests run. After every round the pool must be idle (no KV page, every page free or held by an
idle adapter except the pinned adapter's) and, after warm-up, resident memory must stay within a
fixed margin."""

from __future__ import annotations

import pytest

import soak
from mlc_lora.compile import CompileOptions, compile_model

from ..conftest import make_tiny_hf_model

WARMUP_ROUNDS, ROUNDS = 3, 24
REQUESTS = 48
RSS_MARGIN_MB = 24


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """The tiny GQA Llama with LoRA on every module (rank <= 8) and a pool of 48 pages: four dozen
    concurrent requests and four adapters do not fit it at once."""
    root = tmp_path_factory.mktemp("soak")
    make_tiny_hf_model(root / "hf", "gqa")
    return compile_model(root / "hf", root / "lora", CompileOptions(
        prefill_chunk_size=64, max_batch_size=8, max_lora_rank=8, lora_pool_pages=48), progress=False)


def test_soak_memory_bounded_and_pool_idle_after_every_round(tiny_lora):
    rows = soak.soak(tiny_lora, "cpu", rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, adapters=4, requests=REQUESTS,
                     max_prompt=160, max_tokens=32, seed=0, log=lambda row: None)
    assert len(rows) == WARMUP_ROUNDS + ROUNDS
    for r in rows:
        assert r["problems"] == [], r
        assert r["served"] + r["aborted"] + r["refused"] == REQUESTS, r
    # the traffic did what it is for: clients left, the pool was short (preemption, eviction)
    assert sum(r["aborted"] for r in rows) >= ROUNDS
    assert sum(r["served"] for r in rows) >= 10 * ROUNDS
    assert rows[-1]["preemptions"] > 0 and rows[-1]["evictions"] > 0
    after = [r["rss_mb"] for r in rows if not r["warmup"]]
    assert max(after) - after[0] < RSS_MARGIN_MB, after


_HANDS_BACK = """
import sys

import soak
import tvm
from mlc_lora.runner import ModelRunner

runner = ModelRunner(sys.argv[1], "cpu", allocator=sys.argv[2])
assert runner.allocator == sys.argv[2]
for i in range(3):  # the first free would raise glibc's own (dynamic) threshold past 4 MB
    before = soak.heap_mb()
    buf = tvm.runtime.empty((1 << 20,), "float32", tvm.cpu(0))
    mapped = soak.heap_mb()["heap_mmap_mb"] - before["heap_mmap_mb"]
    del buf
    assert mapped >= 4, f"buffer {i}: 4 MB from the heap, not mmap'd"
    assert soak.heap_mb()["heap_free_mb"] - before["heap_free_mb"] < 1
"""


@pytest.mark.parametrize("allocator", ["naive", "pooled"])
def test_runner_hands_large_freed_host_buffers_back(tiny_lora, allocator):
    """glibc raises its mmap threshold to the size of every mmap'd block freed (up to 32 MB); from
    then on blocks that size come from the heap, which keeps its free space (malloc_trim(0) returned
    next to none of it). The naive allocator frees a forward's activations every step,
    so under varied prompt lengths resident memory grew in steps and never levelled off (the CPU
    soak); on CUDA the host's per-step buffers did the same (+359 MB free inside the heap in the GPU
    soak). Every runner pins the threshold, whatever its allocator ("pooled" is CUDA's): a large
    buffer is mmap'd and unmapped when freed, every time. Checked in a process of its own: in the test process, free heap space that earlier tests
    left behind may serve the block before any mmap is needed."""
    import ctypes  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # pylint: disable=expression-not-assigned
    except (OSError, AttributeError):
        pytest.skip("glibc 2.33 or later only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", _HANDS_BACK, str(tiny_lora), allocator], capture_output=True, text=True,
                       timeout=300, check=False, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def test_soak_random_weights_on_a_library_without_weights(tmp_path, monkeypatch):
    """`soak.py engine --random-weights`: the LoRA library of `bench_lora_throughput.py compile`
    (no params file; here its 2-layer smoke model for llvm), its weights made with torch. One round
    after the two warm-up rounds: requests are served and the pool ends idle."""
    import json  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    import bench_lora_throughput  # pylint: disable=import-outside-toplevel

    assert bench_lora_throughput.main(["compile", "--smoke", "--target", "llvm", "--out", str(tmp_path / "libs"),
                                       "--libs", "lora"]) == 0
    out = tmp_path / "soak.json"
    monkeypatch.setattr(sys, "argv", ["soak.py", "engine", str(tmp_path / "libs" / "lora"), "--random-weights",
                                      "--device", "cpu", "--rounds", "1", "--minutes", "0", "--json", str(out)])
    assert soak.main() == 0
    rows = json.loads(out.read_text())["rounds"]
    assert len(rows) == 3 and not rows[-1]["warmup"]
    for r in rows:
        assert r["served"] > 0 and r["problems"] == [], r


def test_longest_prompt_leaves_room_for_the_output():
    """The 7B benchmark library's prefill chunk is its whole context (4096): prompts of one chunk
    plus 24 output tokens were refused by the engine and ended the soak at its first round."""
    assert soak.longest_prompt(4096, 4096, 24) == 4072
    assert soak.longest_prompt(64, 512, 24) == 64
    assert soak.longest_prompt(64, 512, 24, asked=300) == 300
    assert soak.longest_prompt(4096, 4096, 24, asked=5000) == 4072
    with pytest.raises(ValueError, match="no room for a prompt"):
        soak.longest_prompt(64, 32, 32)
