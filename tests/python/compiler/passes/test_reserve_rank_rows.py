"""ReserveRankRows: the LoRA-targeted weights of every function get 32 rows per part below their own
(the rank rows route's), every use reads a view of the first rows, and LoraRewrite hands the fused
linears the whole buffer. Exact IR (Before/After) and numerics on llvm: the reserved rows hold NaN
and nothing but the fused linears may read them."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from mlc_lora.compiler_passes.ops.lora import reference as lora_ref
from mlc_lora.compiler_passes.passes import LoraRewrite, ReserveRankRows
from mlc_lora.compiler_passes.passes.reserve_rank_rows import extra_rows

from .test_lora_rewrite import ARENA, LINEARS, MODULES, NAMES, Before, _opts, _run


@I.ir_module
class Expected:
    @R.function
    def decode(x: R.Tensor(("b", 1, 8), "float32"),
               params: R.Tuple(R.Tensor((16 + 96, 8), "float32"), R.Tensor((8 + 32, 8), "float32"),
                               R.Tensor((10, 8), "float32"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w_qkv_all = params[0]
            w_qkv = R.memory.view(w_qkv_all, R.shape([16, 8]))
            w_o_all = params[1]
            w_o = R.memory.view(w_o_all, R.shape([8, 8]))
            w_head = params[2]
            qkv = R.matmul(x, R.permute_dims(w_qkv))
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[8])
            o = R.matmul(q, R.permute_dims(w_o))
            gv = R.matmul(o, R.permute_dims(w_head))
            R.output(gv)
        return gv


def _reserve():
    return ReserveRankRows(param_names=NAMES, modules=MODULES, linears=LINEARS)


def test_reserve_before_after():
    after = _reserve()(Before)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, Expected)


def test_extra_rows_per_weight():
    assert extra_rows("model.layers.0.self_attn.qkv_proj.weight", MODULES, LINEARS) == 3 * 32  # q, k, v parts
    assert extra_rows("model.layers.3.self_attn.o_proj.weight", MODULES, LINEARS) == 32
    assert extra_rows("lm_head.weight", MODULES, LINEARS) == 0
    assert extra_rows("model.layers.0.self_attn.o_proj.weight", MODULES[:1], LINEARS) == 0  # o not targeted
    # the rank columns route's columns (axis 1): the rank columns, then zeros to a row of a multiple
    # of 64 (the modules' inputs are 8 wide: q|k|v 8 + 96 -> 128, o 8 + 32 -> 64)
    assert extra_rows("model.layers.0.self_attn.qkv_proj.weight", MODULES, LINEARS, axis=1) == 120
    assert extra_rows("model.layers.3.self_attn.o_proj.weight", MODULES, LINEARS, axis=1) == 56
    wide = [("o_proj", 4096, 4096), ("q_proj", 4096, 4096), ("gate_proj", 4096, 11008), ("down_proj", 11008, 4096)]
    llama = {"qkv_proj": LINEARS["qkv_proj"], "o_proj": LINEARS["o_proj"],
             "gate_up_proj": [("gate_proj", 0, 11008), ("up_proj", 11008, 22016)],
             "down_proj": [("down_proj", 0, 4096)]}
    kinds = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert [extra_rows(f"model.layers.0.{k}.weight", wide, llama, axis=1) for k in kinds] == [128, 64, 64, 64]
    with pytest.raises(ValueError, match="no LoRA-targeted weight"):
        ReserveRankRows(param_names=["lm_head.weight"], modules=MODULES, linears=LINEARS)(Before)


def test_lora_rewrite_sees_through_the_views_and_numerics_hold():
    """Reserved rows full of NaN: the rewritten module (gather stage) gives exactly what the
    module without reserved rows gives, so the base GEMMs and the stage read W's rows only."""
    rng = np.random.default_rng(1)
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
    want = _run(LoraRewrite(**_opts("gather"))(Before), x, tables, [wq, wo, wh])
    mod = LoraRewrite(**_opts("gather"))(_reserve()(Before))
    text = mod["decode"].script()
    assert text.count("R.memory.view") == 2 and "lora_gather_m0_8x8" in text
    nan = lambda w, r: np.concatenate([w, np.full((r, w.shape[1]), np.nan, np.float32)])  # noqa: E731
    got = _run(mod, x, tables, [nan(wq, 96), nan(wo, 32), wh])
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()
