"""DispatchNorm: rms_norm over the last axis becomes one call of ops/norm_triton.py's kernel on CUDA
fp16/bf16; where its input is a residual sum a + b, the kernel adds them too and the sum's later
uses read the kernel's; other norms, broadcasting adds and dtypes stay."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compiler_passes.passes import DispatchNorm

from ...conftest import needs_nvcc
from .calls import call_names as _calls

pytestmark = [needs_nvcc]
triton = pytest.importorskip("triton")


@tvm.script.ir_module
class Before:
    @R.function
    def layer(h: R.Tensor((1, "n", 256), "float16"), o: R.Tensor((1, "n", 256), "float16"),
              d: R.Tensor((1, "n", 256), "float16"), g: R.Tensor((256,), "float16"),
              bias: R.Tensor((256,), "float16")):
        n = T.int64()
        with R.dataflow():
            h1 = R.add(h, o)  # the residual sum: fused, its later use (h2) reads the kernel's sum
            x = R.nn.rms_norm(h1, g, axes=[-1], epsilon=1e-5)
            h2 = R.add(h1, R.multiply(x, d))
            y = R.nn.rms_norm(h, g, axes=[-1], epsilon=1e-6)  # no add before it: the norm alone
            hb = R.add(h2, bias)  # a broadcasting add: the norm alone, the add stays
            z = R.nn.rms_norm(hb, g, axes=[-1], epsilon=1e-5)
            w = R.nn.rms_norm(h, g, axes=[1], epsilon=1e-5)  # not the last axis: stays
            R.output(h2, y, z, w)
        return (h2, y, z, w)

    @R.function
    def f32(h: R.Tensor((4, 64), "float32"), o: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32")):
        with R.dataflow():
            x = R.nn.rms_norm(R.add(h, o), g, axes=[-1], epsilon=1e-5)
            R.output(x)
        return x


@pytest.fixture
def after(cubin_cache):  # pylint: disable=unused-argument  (TVM's CUDA build prepared, a fresh cache)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm"):
        return DispatchNorm("sm_90a")(Before)


def test_residual_add_and_norm_become_one_kernel_call(after):
    layer = _calls(after["layer"])
    assert layer.count("add_rms_norm_triton_256_float16") == 1
    # the plain norms (eps 1e-6 and 1e-5: a kernel each), none left of TVM's over the last axis
    assert sum(c.startswith("rms_norm_triton_256_float16") for c in layer) == 2
    assert layer.count("relax.nn.rms_norm") == 1  # the one over axis 1
    # the fused sum's add went; h2's and the broadcasting one stay
    assert layer.count("relax.add") == 2
    assert len(after.attrs["external_mods"]) == 3
    # h2 = h1 + x * d reads the kernel's sum (output 0), not a recomputed add
    body = after["layer"].body.blocks[0].bindings
    by_var = {b.var: b.value for b in body}
    h2 = next(v for b in body for v in [b.value] if isinstance(v, relax.Call) and v.op.name == "relax.add"
              and isinstance(by_var.get(v.args[0]), relax.Call) and by_var[v.args[0]].op.name == "relax.reshape")
    summed = by_var[by_var[h2.args[0]].args[0]]
    assert isinstance(summed, relax.TupleGetItem) and summed.index == 0
    assert by_var[summed.tuple_value].args[0].name_hint == "add_rms_norm_triton_256_float16"
    assert [str(t.shape) for t in after["layer"].ret_ty.fields] == [str(t.shape) for t in Before["layer"].ret_ty.fields]
    assert "rms_norm_triton" not in " ".join(_calls(after["f32"]))
    func = after["add_rms_norm_triton_256_float16"]
    assert "mlc_lora_triton_rms_norm_fp16" in func.script()
