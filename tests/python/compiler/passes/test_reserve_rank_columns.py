"""ReserveRankColumns: the LoRA-targeted weights of every function get 32 columns per part beside their
own (the rank columns route's), then zeros to a row length of a multiple of 64; every use reads a
strided_slice of the first columns, and LoraRewrite and DispatchCublas hand the whole buffer to the
GEMMs, which read the first columns with the weight's row stride. Exact IR (Before/After) and
numerics on llvm: the reserved columns hold NaN, and the module (gather stage, then the CPU GEMM
extern) gives what the module without them gives, bit for bit."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from mlc_lora.compiler_passes.ops.lora import reference as lora_ref
from mlc_lora.compiler_passes.passes import DispatchCublas, LoraRewrite, ReserveRankColumns

from .test_lora_rewrite import ARENA, LINEARS, MODULES, NAMES, Before, _opts, _run


@I.ir_module
class Expected:
    @R.function
    def decode(x: R.Tensor(("b", 1, 8), "float32"),
               # q|k|v: 8 + 3 x 32 = 104 columns, padded to 128; o: 8 + 32 = 40, padded to 64
               params: R.Tuple(R.Tensor((16, 8 + 120), "float32"), R.Tensor((8, 8 + 56), "float32"),
                               R.Tensor((10, 8), "float32"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w_qkv_all = params[0]
            w_qkv = R.strided_slice(w_qkv_all, axes=[1], begin=[0], end=[8])
            w_o_all = params[1]
            w_o = R.strided_slice(w_o_all, axes=[1], begin=[0], end=[8])
            w_head = params[2]
            qkv = R.matmul(x, R.permute_dims(w_qkv))
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[8])
            o = R.matmul(q, R.permute_dims(w_o))
            gv = R.matmul(o, R.permute_dims(w_head))
            R.output(gv)
        return gv


def _reserve():
    return ReserveRankColumns(param_names=NAMES, modules=MODULES, linears=LINEARS)


def test_reserve_before_after():
    after = _reserve()(Before)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, Expected)


def test_refuses_params_without_a_targeted_weight():
    with pytest.raises(ValueError, match="no LoRA-targeted weight"):
        ReserveRankColumns(param_names=["lm_head.weight"], modules=MODULES, linears=LINEARS)(Before)


def test_lora_rewrite_and_the_gemm_see_through_the_slices_and_numerics_hold():
    """Reserved columns full of NaN: LoraRewrite (gather stage) and DispatchCublas give the GEMM
    extern the whole weights (no slice left to copy them), and the module's output equals the
    module's without reserved columns, so every GEMM reads each row's own columns only."""
    rng = np.random.default_rng(2)
    wq, wo, wh = (rng.standard_normal(s).astype(np.float32) for s in [(16, 8), (8, 8), (10, 8)])
    arena = rng.standard_normal(ARENA).astype(np.float32)
    S, b = 2, 5
    a_off = (np.arange(S * 3 * 2).reshape(S, 3, 2) * 16).astype(np.int32)
    b_off = a_off + 8
    scale = rng.uniform(0.5, 2, (S, 3)).astype(np.float32)
    slot = np.array([0, -1, 1, 0, -1], np.int32)
    rank = np.array([2, 1], np.int32)
    order, start = lora_ref.sort_tokens_ref(slot, S)
    tables = [arena, slot, rank, scale, a_off, b_off, order, start]
    x = rng.standard_normal((b, 1, 8)).astype(np.float32)
    gemm = DispatchCublas(cpu=True)
    want = _run(gemm(LoraRewrite(**_opts("gather"))(Before)), x, tables, [wq, wo, wh])
    mod = gemm(LoraRewrite(**_opts("gather"))(_reserve()(Before)))
    text = mod["decode"].script()
    assert text.count("mlc_lora.runtime.cublas_gemm") == 3 and "end=[8]" not in text, text
    nan = lambda w, c: np.concatenate([w, np.full((w.shape[0], c), np.nan, np.float32)], axis=1)  # noqa: E731
    got = _run(mod, x, tables, [nan(wq, 120), nan(wo, 56), wh])
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()
