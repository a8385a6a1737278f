"""DispatchActivation: silu(gate) * up over split(y, 2) becomes one call of ops/activation_triton.py's
kernel on CUDA fp16/bf16; other splits, activations and dtypes stay."""

from __future__ import annotations

import pytest
import tvm
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compiler_passes.passes import DispatchActivation

from ...conftest import needs_nvcc
from .calls import call_names as _calls

pytestmark = [needs_nvcc]
triton = pytest.importorskip("triton")


@tvm.script.ir_module
class Before:
    @R.function
    def mlp(y: R.Tensor(("n", 1, 192), "float16"), other: R.Tensor(("n", 1, 192), "bfloat16")):
        n = T.int64()
        with R.dataflow():
            s = R.split(y, indices_or_sections=2, axis=-1)
            g = s[0]
            u = s[1]
            h = R.multiply(R.nn.silu(g), u)
            # three parts, silu of the second part, and a float32 split: all left alone
            s3 = R.split(other, indices_or_sections=3, axis=-1)
            h3 = R.multiply(R.nn.silu(s3[0]), s3[1])
            s2 = R.split(other, indices_or_sections=2, axis=-1)
            swapped = R.multiply(R.nn.silu(s2[1]), s2[0])
            R.output(h, h3, swapped)
        return (h, h3, swapped)

    @R.function
    def f32(y: R.Tensor((4, 64), "float32")):
        with R.dataflow():
            s = R.split(y, indices_or_sections=2, axis=-1)
            h = R.multiply(R.nn.silu(s[0]), s[1])
            R.output(h)
        return h


@pytest.fixture
def after(cubin_cache):  # pylint: disable=unused-argument  (TVM's CUDA build prepared, a fresh cache)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm"):
        return DispatchActivation("sm_90a")(Before)


def test_silu_times_up_becomes_one_kernel_call(after):
    mlp = _calls(after["mlp"])
    assert mlp.count("silu_mul_triton_96_float16") == 1
    # the matched split/silu/multiply went; the three others stay as they were
    assert mlp.count("relax.split") == 2 and mlp.count("relax.nn.silu") == 2 and mlp.count("relax.multiply") == 2
    assert [str(t.shape) for t in after["mlp"].ret_ty.fields] == [str(t.shape) for t in Before["mlp"].ret_ty.fields]
    assert "silu_mul_triton" not in " ".join(_calls(after["f32"]))
    # the kernel's CUDA module is linked into the library
    assert len(after.attrs["external_mods"]) == 1
    func = after["silu_mul_triton_96_float16"]
    assert int(func.attrs["op_pattern"]) == 8 and "mlc_lora_triton_silu_mul_fp16" in func.script()
