"""The LoRA stage registry (compiler_passes/ops/lora/__init__.py): every stage of the contract has
an implementation, and the backend choice per linear ("auto" and explicit) with its reasons."""

import pytest
import tvm

from mlc_lora.compiler_passes.ops import lora
from mlc_lora.compiler_passes.ops.lora import sgmv_cuda, sgmv_tir, sgmv_triton
from mlc_lora.compiler_passes.ops.lora.stage import LoraStage
from mlc_lora.contract import LORA_KERNELS

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
LLVM = tvm.target.Target("llvm")


def test_every_stage_of_the_contract_is_registered():
    assert {stage for stage, _ in lora.STAGES} == set(LORA_KERNELS)
    for stage in LORA_KERNELS:
        impls = lora.implementations(stage)
        # a TIR implementation runs anywhere, so "auto" always finds one
        assert "tir" in [impl.backend for impl in impls], stage
        assert impls[-1].supported(LLVM, "float32", 256, 7) is None
    for (stage, backend), impl in lora.STAGES.items():
        assert isinstance(impl, LoraStage) and (impl.stage, impl.backend) == (stage, backend)
        assert type(impl).emit is not LoraStage.emit and type(impl).supported is not LoraStage.supported
    assert lora.BACKENDS == ("auto", "cuda", "tir", "triton")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_auto_picks_the_triton_sgmv_on_cuda_half(dtype, monkeypatch):
    pytest.importorskip("triton")
    for parts in (1, 2, 3):
        assert lora.select("sgmv", "auto", CUDA, dtype, 64, parts) is sgmv_triton.STAGE
    assert lora.select("sgmv", "auto", CUDA, dtype, 128, 1) is sgmv_triton.STAGE
    monkeypatch.setattr(sgmv_triton, "triton", None)  # without Triton: the CUDA C++ kernels alone
    assert lora.select("sgmv", "auto", CUDA, dtype, 64, 3) is sgmv_cuda.STAGE


def test_the_other_sgmv_backends_run_when_asked_for(monkeypatch):
    pytest.importorskip("triton")
    assert lora.select("sgmv", "cuda", CUDA, "bfloat16", 64, 3) is sgmv_cuda.STAGE
    assert lora.select("sgmv", "triton", CUDA, "bfloat16", 64, 3) is sgmv_triton.STAGE
    monkeypatch.setattr(sgmv_triton, "triton", None)
    with pytest.raises(ValueError, match="triton is not installed"):
        lora.select("sgmv", "triton", CUDA, "float16", 16, 1)
    with pytest.raises(ValueError, match="unknown LoRA kernel backend 'mixed'"):  # removed: dominated by triton
        lora.select("sgmv", "mixed", CUDA, "float16", 16, 1)


@pytest.mark.parametrize("target,dtype,rank,parts,why", [
    (LLVM, "float32", 16, 1, "target llvm"),
    (LLVM, "float16", 16, 1, "target llvm"),
    (CUDA, "float32", 16, 1, "dtype float32"),
    (CUDA, "float16", 256, 1, "max rank 256"),
    (CUDA, "float16", 16, 4, "a linear of 4 parts"),
])
def test_auto_falls_back_to_tir_with_the_reason(target, dtype, rank, parts, why):
    assert why in sgmv_cuda.STAGE.supported(target, dtype, rank, parts)
    assert why in sgmv_triton.STAGE.supported(target, dtype, rank, parts)
    assert lora.select("sgmv", "auto", target, dtype, rank, parts) is sgmv_tir.STAGE
    # an explicit "cuda" refuses with the same reason; "tir" is always there
    with pytest.raises(ValueError, match=why):
        lora.select("sgmv", "cuda", target, dtype, rank, parts)
    assert lora.select("sgmv", "tir", target, dtype, rank, parts) is sgmv_tir.STAGE


@pytest.mark.parametrize("stage", ["single", "gather"])
def test_stages_without_cuda_stay_on_tir(stage):
    impl = lora.select(stage, "auto", CUDA, "float16", 16, 3)
    assert (impl.stage, impl.backend) == (stage, "tir")
    with pytest.raises(ValueError, match=f"'{stage}' has no 'cuda' implementation"):
        lora.select(stage, "cuda", CUDA, "float16", 16, 1)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown LoRA kernel 'bgmv'"):
        lora.check("bgmv", "auto")
    with pytest.raises(ValueError, match="unknown LoRA kernel backend 'cutlass'; choose from auto, cuda, tir, triton"):
        lora.check("sgmv", "cutlass")


def test_int8_rows_take_the_stages_that_read_them(monkeypatch):
    """int8 adapter rows: stage 3 on Triton (CUDA) or TIR (CPU); every other implementation says why
    not, and with no reader left "auto" refuses, naming each reason."""
    pytest.importorskip("triton")
    assert lora.select("sgmv", "auto", CUDA, "float16", 64, 3, "int8") is sgmv_triton.STAGE
    assert lora.select("sgmv", "auto", LLVM, "float32", 64, 3, "int8") is sgmv_tir.STAGE
    for backend, why in (("cuda", "int8 adapter rows .on CUDA the triton kernels"), ("tir", "int8 adapter rows on a GPU")):
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot run {why}"):
            lora.select("sgmv", backend, CUDA, "float16", 64, 3, "int8")
    for stage in ("single", "gather"):
        with pytest.raises(ValueError, match="int8 adapter rows .the sgmv stage reads them"):
            lora.select(stage, "auto", LLVM, "float32", 64, 1, "int8")
    monkeypatch.setattr(sgmv_triton, "triton", None)
    with pytest.raises(ValueError, match="cuda: int8 adapter rows.*tir: int8 adapter rows on a GPU"):
        lora.select("sgmv", "auto", CUDA, "float16", 64, 3, "int8")
