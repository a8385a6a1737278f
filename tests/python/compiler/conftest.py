"""Shared by the compiler tests that build CUDA kernels here (no GPU)."""

import pytest


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
