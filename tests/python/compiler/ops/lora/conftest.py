"""Shared by the Triton kernel tests: running kernels under Triton's interpreter in a process of
their own, and a cubin cache for building them here."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def interpret(tmp_path, **inp) -> dict:
    """triton_interp.py's outputs for `inp`, run in a process with TRITON_INTERPRET=1 (Triton's own
    jit'd library functions are interpreted only when it is set before triton is imported)."""
    np.savez(tmp_path / "in.npz", **inp)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[5]
    proc = subprocess.run([sys.executable, "-m", "tests.python.compiler.ops.lora.triton_interp",
                           str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          cwd=root, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as f:
        return dict(f)


@pytest.fixture
def cubin_cache(tmp_path, monkeypatch):
    """The folder the Triton kernels' cubins are cached in, fresh per test, with TVM's CUDA build
    prepared (skips where nvcc is missing)."""
    from mlc_lora.compile import prepare_cuda_build
    from mlc_lora.errors import CompileError

    monkeypatch.setenv("MLC_LORA_CACHE", str(tmp_path))
    try:
        prepare_cuda_build()
    except CompileError as e:
        pytest.skip(str(e))
    return tmp_path / "triton"
