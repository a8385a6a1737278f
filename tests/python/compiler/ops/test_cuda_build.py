"""The shared CUDA build of the ops (compiler_passes/ops/cuda_build.py)."""

import pytest

from mlc_lora.compiler_passes.ops import cuda_build

from ...conftest import needs_nvcc


@needs_nvcc
def test_nvcc_errors_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_LORA_CACHE", str(tmp_path))
    bad = tmp_path / "bad.cu"
    bad.write_text("this is not C++\n")
    with pytest.raises(cuda_build.CudaBuildError, match="nvcc failed on bad.cu"):
        cuda_build.build_cubin(bad, "sm_90a", {})
