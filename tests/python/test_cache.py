"""The compile cache under several processes (two servers starting at once, parallel tests): one
compiles an entry while the others wait for it, and no reader sees a half-written file."""

from __future__ import annotations

import json
import threading
import time

from mlc_lora import compile as compile_mod
from mlc_lora.contract import CONFIG_FILE, cache_lock, write_cached


def test_write_cached_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "entry.bin"
    write_cached(path, b"first")
    write_cached(path, "second")
    assert path.read_text() == "second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.bin"]


def test_cache_lock_excludes_other_holders(tmp_path):
    """flock on separate opens: a second holder (here a thread) waits until the first lets go."""
    entry, order = tmp_path / "entry", []

    def second():
        with cache_lock(entry):
            order.append("second")

    with cache_lock(entry):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first done")
    t.join(10)
    assert order == ["first done", "second"]


def test_concurrent_first_use_compiles_once(tmp_path, monkeypatch):
    """Three callers ask for the same uncompiled model at once: one compile, all get the finished
    folder, no temporary folder is left; a folder an interrupted compile left (no config) is redone."""
    monkeypatch.setenv("MLC_LORA_CACHE", str(tmp_path))
    calls = []

    def fake_compile(model, output, opts, progress=True):
        calls.append(output)
        output.mkdir(parents=True)
        time.sleep(0.3)  # the others arrive while this one compiles
        (output / CONFIG_FILE).write_text(json.dumps({"model": model}))
        return output

    monkeypatch.setattr(compile_mod, "compile_model", fake_compile)
    stale = tmp_path / "tiny-llvm-float32"
    stale.mkdir()
    (stale / "half-written.bin").write_bytes(b"x")
    got = []
    threads = [threading.Thread(target=lambda: got.append(compile_mod.resolve_compiled("tiny", "cpu", False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1, calls
    assert got == [stale] * 3
    assert json.loads((stale / CONFIG_FILE).read_text()) == {"model": "tiny"}
    assert not (stale / "half-written.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llvm-float32", "tiny-llvm-float32.lock"]
