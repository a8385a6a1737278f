"""Shared by the Triton kernel tests: running kernels under Triton's interpreter in a process of
their own (the cubin cache for building them here: tests/python/compiler/conftest.py)."""

import atexit
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

_interpreter: list[subprocess.Popen] = []  # the process serving interpret(), once started


def interpret(tmp_path, **inp) -> dict:
    """triton_interp.py's outputs for `inp`, run in a process with TRITON_INTERPRET=1 (Triton's own
    jit'd library functions are interpreted only when it is set before triton is imported): one
    process (`triton_interp --serve`) runs the requests in turn, a fresh one after a failed request."""
    np.savez(tmp_path / "in.npz", **inp)
    if not _interpreter or _interpreter[0].poll() is not None:
        root = Path(__file__).resolve().parents[5]
        _interpreter[:] = [subprocess.Popen(
            [sys.executable, "-m", "tests.python.compiler.ops.lora.triton_interp", "--serve"], cwd=root,
            env={**os.environ, "TRITON_INTERPRET": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)]
    proc, log = _interpreter[0], tmp_path / "interpret.log"
    proc.stdin.write(f"{tmp_path / 'in.npz'}\t{tmp_path / 'out.npz'}\t{log}\n")
    proc.stdin.flush()
    if proc.stdout.readline() != "ok\n":
        proc.wait()
        raise AssertionError(log.read_text()[-3000:] if log.exists() else f"the interpreter exited: {proc.returncode}")
    with np.load(tmp_path / "out.npz") as f:
        return dict(f)


@atexit.register
def _stop_interpreter():
    for proc in _interpreter:
        proc.stdin.close()
        proc.wait()
