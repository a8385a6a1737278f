"""LoraRewrite on a small hand-written Relax module: exact IR (Before/After) and numerics."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compiler_passes import lora_kernels as K
from mlc_lora.compiler_passes.lora_rewrite import LoraRewrite

LLVM = tvm.target.Target("llvm")
NAMES = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
         "lm_head.weight"]
# Compiled modules: q, v, o (k is not a LoRA target); fused qkv rows q 0:8, k 8:12, v 12:16.
MODULES = [("q_proj", 8, 8), ("v_proj", 8, 4), ("o_proj", 8, 8)]
LINEARS = {"qkv_proj": [("q_proj", 0, 8), ("k_proj", 8, 12), ("v_proj", 12, 16)], "o_proj": [("o_proj", 0, 8)]}
ARENA = 256


def _opts(kernel, **kw):
    return dict(param_names=NAMES, modules=MODULES, linears=LINEARS, num_layers=1, max_rank=2,
                kernel=kernel, arena_elems=ARENA, functions=["decode"], target=LLVM, **kw)


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor(("b", 1, 8), "float32"),
               params: R.Tuple(R.Tensor((16, 8), "float32"), R.Tensor((8, 8), "float32"),
                               R.Tensor((10, 8), "float32"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w_qkv = params[0]
            w_o = params[1]
            w_head = params[2]
            qkv = R.matmul(x, R.permute_dims(w_qkv))
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[8])
            o = R.matmul(q, R.permute_dims(w_o))
            gv = R.matmul(o, R.permute_dims(w_head))
            R.output(gv)
        return gv


@I.ir_module(check_well_formed=False)  # the kernel stubs are swapped for the real ones
class Expected:
    @T.prim_func
    def lora_gather_m0_8x8():  # replaced by the real kernel below
        T.evaluate(0)

    @T.prim_func
    def lora_gather_m1_8x4():
        T.evaluate(0)

    @T.prim_func
    def lora_gather_m2_8x8():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor(("b", 1, 8), "float32"), lora_arena: R.Tensor((256,), "float32"),
               lora_token_slot: R.Tensor(("b",), "int32"), lora_rank: R.Tensor(("s",), "int32"),
               lora_scale: R.Tensor(("s", 3), "float32"), lora_a_off: R.Tensor(("s", 3, 2), "int32"),
               lora_b_off: R.Tensor(("s", 3, 2), "int32"),
               params: R.Tuple(R.Tensor((16, 8), "float32"), R.Tensor((8, 8), "float32"),
                               R.Tensor((10, 8), "float32"))):
        R.func_attr({"num_input": 7})
        b = T.int64()
        cls = Expected
        with R.dataflow():
            w_qkv = params[0]
            w_o = params[1]
            w_head = params[2]
            qkv0 = R.matmul(x, R.permute_dims(w_qkv))
            x2 = R.reshape(x, R.shape([b, 8]))
            dq = R.call_tir(cls.lora_gather_m0_8x8, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                            lora_a_off, lora_b_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 8), "float32"))
            dk = R.zeros(R.shape([b, 4]), "float32")
            dv = R.call_tir(cls.lora_gather_m1_8x4, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                            lora_a_off, lora_b_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 4), "float32"))
            d = R.reshape(R.concat((dq, dk, dv), axis=1), R.shape([b, 1, 16]))
            qkv = R.add(qkv0, d)
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[8])
            o0 = R.matmul(q, R.permute_dims(w_o))
            q2 = R.reshape(q, R.shape([b, 8]))
            do = R.call_tir(cls.lora_gather_m2_8x8, (q2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                            lora_a_off, lora_b_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 8), "float32"))
            o = R.add(o0, R.reshape(do, R.shape([b, 1, 8])))
            gv = R.matmul(o, R.permute_dims(w_head))
            R.output(gv)
        return gv


def test_gather_rewrite_before_after():
    after = LoraRewrite(**_opts("gather"))(Before)
    expected = Expected
    for name, (mi, (_, in_f, out_f)) in zip(
            ["lora_gather_m0_8x8", "lora_gather_m1_8x4", "lora_gather_m2_8x8"], enumerate(MODULES)):
        kernel = K.lora_gather_kernel(in_f, out_f, mi, 1, 2, 3, "float32", LLVM)
        expected[name] = kernel.with_attr("global_symbol", name)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(expected))


def test_rewrite_keeps_untargeted_and_refuses_fused_matmuls():
    after = LoraRewrite(**_opts("gather", ))(Before)
    assert [p.name for p in after["decode"].params][1:7] == ["lora_arena", "lora_token_slot", "lora_rank",
                                                              "lora_scale", "lora_a_off", "lora_b_off"]
    # Only o_proj targeted: qkv_proj untouched (no zeros, no concat).
    opts = _opts("gather")
    opts["modules"] = [("o_proj", 8, 8)]
    text = LoraRewrite(**opts)(Before)["decode"].script()
    assert text.count("call_tir") == 1 and "concat" not in text
    # After FuseTransposeMatmul the pattern is gone: a clear error, not a silent no-op.
    fused = relax.transform.FuseTransposeMatmul()(Before)
    with pytest.raises(ValueError, match="before FuseTransposeMatmul"):
        LoraRewrite(**_opts("gather"))(fused)


def _run(mod, x, tables, weights):
    with LLVM:
        ex = tvm.compile(mod, LLVM)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    t = [tvm.runtime.tensor(a, tvm.cpu()) for a in [x, *tables]]
    return vm["decode"](*t, [tvm.runtime.tensor(w, tvm.cpu()) for w in weights]).numpy()


@pytest.mark.parametrize("kernel", ["gather", "single"])
def test_rewritten_module_matches_numpy(kernel):
    rng = np.random.default_rng(0)
    wq, wo, wh = (rng.standard_normal(s).astype(np.float32) for s in [(16, 8), (8, 8), (10, 8)])
    arena = rng.standard_normal(ARENA).astype(np.float32)
    # Two adapters (one for "single"): rows at fixed places; adapter 1 has rank 1 and no v_proj.
    ranks = [2, 1] if kernel == "gather" else [2]
    S = len(ranks)
    a_off = np.full((S, 3, 2), -1, np.int32)
    b_off = np.full((S, 3, 2), -1, np.int32)
    nxt = iter(range(0, ARENA, 8))
    for s, r in enumerate(ranks):
        for m in range(3):
            for k in range(r):
                a_off[s, m, k], b_off[s, m, k] = next(nxt), next(nxt)
    scale = rng.uniform(0.5, 2, (S, 3)).astype(np.float32)
    if S > 1:
        scale[1, 1] = 0
    b = 5
    slot = np.array([0, -1, 1, 0, -1] if S > 1 else [0, -1, 0, 0, -1], np.int32)
    rank = np.array(ranks, np.int32)
    x = rng.standard_normal((b, 1, 8)).astype(np.float32)
    got = _run(LoraRewrite(**_opts(kernel))(Before), x, [arena, slot, rank, scale, a_off, b_off], [wq, wo, wh])

    def delta(h, m, out_f):
        return K.lora_gather_ref(h, arena, 0, 1, slot, rank, scale, a_off, b_off, m, out_f)

    h = x[:, 0]
    qkv = h @ wq.T + np.concatenate([delta(h, 0, 8), np.zeros((b, 4), np.float32), delta(h, 1, 4)], 1)
    q = qkv[:, :8]
    o = q @ wo.T + delta(q, 2, 8)
    want = o @ wh.T
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-5)
    base = ((h @ wq.T)[:, :8] @ wo.T) @ wh.T
    assert np.abs(want - base)[slot >= 0].min() > 1e-3  # the adapters change every adapter row
    np.testing.assert_allclose(got[slot < 0, 0], base[slot < 0], rtol=1e-5, atol=1e-5)
