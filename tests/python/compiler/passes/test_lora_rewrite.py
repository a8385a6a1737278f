"""LoraRewrite on small hand-written Relax modules: exact IR (Before/After) for every registered
stage implementation (compiler_passes/ops/lora), numerics on llvm, the choice of backend."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compiler_passes.ops.lora import reference as lora_ref
from mlc_lora.compiler_passes.ops.lora import sgmv_cuda as GC
from mlc_lora.compiler_passes.ops.lora import sgmv_tir as G
from mlc_lora.compiler_passes.ops.lora import sgmv_triton as GT
from mlc_lora.compiler_passes.ops.lora.gather_tir import lora_gather_kernel
from mlc_lora.compiler_passes.ops.lora.single_tir import lora_dense_rows_kernel
from mlc_lora.compiler_passes.passes import LoraRewrite
from mlc_lora.contract import BASE_FUNCTION_SUFFIX, LORA_TABLE_INPUTS

from ...conftest import needs_nvcc

LLVM = tvm.target.Target("llvm")
NAMES = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
         "lm_head.weight"]
# Compiled modules: q, v, o (k is not a LoRA target); fused qkv rows q 0:8, k 8:12, v 12:16.
MODULES = [("q_proj", 8, 8), ("v_proj", 8, 4), ("o_proj", 8, 8)]
LINEARS = {"qkv_proj": [("q_proj", 0, 8), ("k_proj", 8, 12), ("v_proj", 12, 16)], "o_proj": [("o_proj", 0, 8)]}
ARENA = 256


def _opts(kernel, **kw):
    return dict(param_names=NAMES, modules=MODULES, linears=LINEARS, num_layers=1, max_rank=2,
                kernel=kernel, arena_elems=ARENA, functions=["decode"], target=LLVM,
                **{"base_functions": False, **kw})


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
class ExpectedGather:
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
               lora_b_off: R.Tensor(("s", 3, 2), "int32"), lora_token_order: R.Tensor(("b",), "int32"),
               lora_slot_start: R.Tensor(("c",), "int32"),
               params: R.Tuple(R.Tensor((16, 8), "float32"), R.Tensor((8, 8), "float32"),
                               R.Tensor((10, 8), "float32"))):
        R.func_attr({"num_input": 9})
        b = T.int64()
        cls = ExpectedGather
        with R.dataflow():
            w_qkv = params[0]
            w_o = params[1]
            w_head = params[2]
            wt_qkv = R.permute_dims(w_qkv)
            x2 = R.reshape(x, R.shape([b, 8]))
            qkv0 = R.matmul(x, wt_qkv)  # the stage emits the GEMM
            dq = R.call_tir(cls.lora_gather_m0_8x8, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                            lora_a_off, lora_b_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 8), "float32"))
            dk = R.zeros(R.shape([b, 4]), "float32")
            dv = R.call_tir(cls.lora_gather_m1_8x4, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                            lora_a_off, lora_b_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 4), "float32"))
            d = R.reshape(R.concat((dq, dk, dv), axis=1), R.shape([b, 1, 16]))
            qkv = R.add(qkv0, d)
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[8])
            wt_o = R.permute_dims(w_o)
            q2 = R.reshape(q, R.shape([b, 8]))
            o0 = R.matmul(q, wt_o)
            do = R.call_tir(cls.lora_gather_m2_8x8, (q2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                            lora_a_off, lora_b_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 8), "float32"))
            o = R.add(o0, R.reshape(do, R.shape([b, 1, 8])))
            gv = R.matmul(o, R.permute_dims(w_head))
            R.output(gv)
        return gv


def test_gather_rewrite_before_after():
    after = LoraRewrite(**_opts("gather"))(Before)
    expected = ExpectedGather
    for name, (mi, (_, in_f, out_f)) in zip(
            ["lora_gather_m0_8x8", "lora_gather_m1_8x4", "lora_gather_m2_8x8"], enumerate(MODULES)):
        kernel = lora_gather_kernel(in_f, out_f, mi, 1, 2, 3, "float32", LLVM)
        expected[name] = kernel.with_attr("global_symbol", name)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(expected))


@I.ir_module(check_well_formed=False)
class ExpectedSingle:
    @T.prim_func
    def lora_single_m0_8x8():  # replaced by the real kernel below
        T.evaluate(0)

    @T.prim_func
    def lora_single_m1_8x4():
        T.evaluate(0)

    @T.prim_func
    def lora_single_m2_8x8():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor(("b", 1, 8), "float32"), lora_arena: R.Tensor((256,), "float32"),
               lora_token_slot: R.Tensor(("b",), "int32"), lora_rank: R.Tensor(("s",), "int32"),
               lora_scale: R.Tensor(("s", 3), "float32"), lora_a_off: R.Tensor(("s", 3, 2), "int32"),
               lora_b_off: R.Tensor(("s", 3, 2), "int32"), lora_token_order: R.Tensor(("b",), "int32"),
               lora_slot_start: R.Tensor(("c",), "int32"),
               params: R.Tuple(R.Tensor((16, 8), "float32"), R.Tensor((8, 8), "float32"),
                               R.Tensor((10, 8), "float32"))):
        R.func_attr({"num_input": 9})
        b = T.int64()
        cls = ExpectedSingle
        with R.dataflow():
            w_qkv = params[0]
            w_o = params[1]
            w_head = params[2]
            wt_qkv = R.permute_dims(w_qkv)
            x2 = R.reshape(x, R.shape([b, 8]))
            qkv0 = R.matmul(x, wt_qkv)  # the stage emits the GEMM
            # base-model tokens (slot -1) get no delta: x masked, then dense rows of slot 0
            mask = R.reshape(R.astype(R.greater_equal(lora_token_slot, R.const(0, "int32")), "float32"),
                             R.shape([b, 1]))
            xm = R.multiply(x2, mask)
            abq = R.call_tir(cls.lora_single_m0_8x8, (lora_arena, lora_rank, lora_scale, lora_a_off, lora_b_off,
                             R.prim_value(T.int64(0))),
                             out_ty=[R.Tensor((2, 8), "float32"), R.Tensor((2, 8), "float32")])
            aq = abq[0]
            bq = abq[1]
            dq = R.matmul(R.matmul(xm, R.permute_dims(aq)), bq)
            dk = R.zeros(R.shape([b, 4]), "float32")
            abv = R.call_tir(cls.lora_single_m1_8x4, (lora_arena, lora_rank, lora_scale, lora_a_off, lora_b_off,
                             R.prim_value(T.int64(0))),
                             out_ty=[R.Tensor((2, 8), "float32"), R.Tensor((2, 4), "float32")])
            av = abv[0]
            bv = abv[1]
            dv = R.matmul(R.matmul(xm, R.permute_dims(av)), bv)
            d = R.reshape(R.concat((dq, dk, dv), axis=1), R.shape([b, 1, 16]))
            qkv = R.add(qkv0, d)
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[8])
            wt_o = R.permute_dims(w_o)
            q2 = R.reshape(q, R.shape([b, 8]))
            o0 = R.matmul(q, wt_o)
            mask2 = R.reshape(R.astype(R.greater_equal(lora_token_slot, R.const(0, "int32")), "float32"),
                              R.shape([b, 1]))
            qm = R.multiply(q2, mask2)
            abo = R.call_tir(cls.lora_single_m2_8x8, (lora_arena, lora_rank, lora_scale, lora_a_off, lora_b_off,
                             R.prim_value(T.int64(0))),
                             out_ty=[R.Tensor((2, 8), "float32"), R.Tensor((2, 8), "float32")])
            ao = abo[0]
            bo = abo[1]
            do = R.matmul(R.matmul(qm, R.permute_dims(ao)), bo)
            o = R.add(o0, R.reshape(do, R.shape([b, 1, 8])))
            gv = R.matmul(o, R.permute_dims(w_head))
            R.output(gv)
        return gv


def test_single_rewrite_before_after():
    after = LoraRewrite(**_opts("single"))(Before)
    expected = ExpectedSingle
    for mi, (name, in_f, out_f) in enumerate(MODULES):
        gv_name = f"lora_single_m{mi}_{in_f}x{out_f}"
        kernel = lora_dense_rows_kernel(in_f, out_f, mi, 1, 2, 3, "float32", LLVM)
        expected[gv_name] = kernel.with_attr("global_symbol", gv_name)
        del name
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(expected))


def test_rewrite_keeps_the_functions_as_they_were_for_batches_without_adapters():
    """decode_base: the decode of Before, unchanged, beside the rewritten decode."""
    after = LoraRewrite(**_opts("gather", base_functions=True))(Before)
    relax.analysis.well_formed(after)
    base = "decode" + BASE_FUNCTION_SUFFIX
    tvm.ir.assert_structural_equal(after[base], Before["decode"].with_attr("global_symbol", base))
    assert len(after["decode"].params) == len(Before["decode"].params) + len(LORA_TABLE_INPUTS)


def test_rewrite_keeps_untargeted_and_refuses_fused_matmuls():
    after = LoraRewrite(**_opts("gather", ))(Before)
    assert [p.name for p in after["decode"].params][1:9] == list(LORA_TABLE_INPUTS)
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
    order, start = lora_ref.sort_tokens_ref(slot, S)
    got = _run(LoraRewrite(**_opts(kernel))(Before), x, [arena, slot, rank, scale, a_off, b_off, order, start],
               [wq, wo, wh])

    def delta(h, m, out_f):
        return lora_ref.lora_gather_ref(h, arena, 0, 1, slot, rank, scale, a_off, b_off, m, out_f)

    h = x[:, 0]
    qkv = h @ wq.T + np.concatenate([delta(h, 0, 8), np.zeros((b, 4), np.float32), delta(h, 1, 4)], 1)
    q = qkv[:, :8]
    o = q @ wo.T + delta(q, 2, 8)
    want = o @ wh.T
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-5)
    base = ((h @ wq.T)[:, :8] @ wo.T) @ wh.T
    assert np.abs(want - base)[slot >= 0].min() > 1e-3  # the adapters change every adapter row
    np.testing.assert_allclose(got[slot < 0, 0], base[slot < 0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def cuda():
    """The CUDA target with TVM's CUDA codegen loaded (tests using it carry needs_nvcc)."""
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")


# ---------------------------------------------------------------------------------------------
# Stage 3 (sgmv) on a cuda target, Before/After: the CUDA implementation (auto, cuda) and the TIR one.

NAMES_CUDA = ["model.layers.0.self_attn.o_proj.weight"]


@I.ir_module
class BeforeCuda:
    @R.function
    def decode(x: R.Tensor(("b", 1, 1024), "float16"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w = params[0]
            gv = R.matmul(x, R.permute_dims(w))
            R.output(gv)
        return gv


@I.ir_module(check_well_formed=False)  # the kernel stubs are swapped for the real ones
class ExpectedTir:
    @T.prim_func
    def lora_sgmv_shrink_m0_1024():
        T.evaluate(0)

    @T.prim_func
    def lora_sgmv_expand_m0_1024x600():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor(("b", 1, 1024), "float16"), lora_arena: R.Tensor((4096,), "float16"),
               lora_token_slot: R.Tensor(("b",), "int32"), lora_rank: R.Tensor(("s",), "int32"),
               lora_scale: R.Tensor(("s", 1), "float32"), lora_a_off: R.Tensor(("s", 1, 16), "int32"),
               lora_b_off: R.Tensor(("s", 1, 16), "int32"), lora_token_order: R.Tensor(("b",), "int32"),
               lora_slot_start: R.Tensor(("c",), "int32"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 9})
        b = T.int64()
        cls = ExpectedTir
        with R.dataflow():
            w = params[0]
            wt = R.permute_dims(w)
            x2 = R.reshape(x, R.shape([b, 1024]))
            y = R.matmul(x, wt)
            v = R.call_tir(cls.lora_sgmv_shrink_m0_1024, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                           lora_a_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 2, 16), "float32"))
            d = R.call_tir(cls.lora_sgmv_expand_m0_1024x600, (v, lora_arena, lora_token_slot, lora_rank, lora_b_off,
                           R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 600), "float16"))
            gv = R.add(y, R.reshape(d, R.shape([b, 1, 600])))
            R.output(gv)
        return gv


@I.ir_module(check_well_formed=False)
class ExpectedCuda:
    @T.prim_func
    def lora_sgmv_shrink_m0_1024():
        T.evaluate(0)

    @T.prim_func
    def lora_sgmv_expand_m0_1024x600():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor(("b", 1, 1024), "float16"), lora_arena: R.Tensor((4096,), "float16"),
               lora_token_slot: R.Tensor(("b",), "int32"), lora_rank: R.Tensor(("s",), "int32"),
               lora_scale: R.Tensor(("s", 1), "float32"), lora_a_off: R.Tensor(("s", 1, 16), "int32"),
               lora_b_off: R.Tensor(("s", 1, 16), "int32"), lora_token_order: R.Tensor(("b",), "int32"),
               lora_slot_start: R.Tensor(("c",), "int32"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 9})
        b = T.int64()
        cls = ExpectedCuda
        with R.dataflow():
            w = params[0]
            wt = R.permute_dims(w)
            x2 = R.reshape(x, R.shape([b, 1024]))
            v = R.call_tir(cls.lora_sgmv_shrink_m0_1024, (x2, lora_arena, lora_token_slot, lora_token_order,
                           lora_rank, lora_scale, lora_a_off, R.prim_value(T.int64(0))),
                           out_ty=R.Tensor((b, 1, 2, 16), "float32"))
            y = R.matmul(x, wt)  # after the shrink, which reads only x
            y2 = R.reshape(y, R.shape([b, 600]))
            y3 = R.call_tir_inplace(cls.lora_sgmv_expand_m0_1024x600, (v, lora_arena, lora_token_slot,
                                    lora_token_order, lora_rank, lora_scale, lora_b_off, R.prim_value(T.int64(0)),
                                    y2), [8],
                                    R.Tensor((b, 600), "float16"))
            gv = R.reshape(y3, R.shape([b, 1, 600]))
            R.output(gv)
        return gv


@I.ir_module(check_well_formed=False)
class ExpectedTriton:
    @T.prim_func
    def lora_sgmv_triton_tiles():
        T.evaluate(0)

    @T.prim_func
    def lora_sgmv_triton_shrink_m0_1024():
        T.evaluate(0)

    @T.prim_func
    def lora_sgmv_triton_expand_m0_1024x600():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor(("b", 1, 1024), "float16"), lora_arena: R.Tensor((4096,), "float16"),
               lora_token_slot: R.Tensor(("b",), "int32"), lora_rank: R.Tensor(("s",), "int32"),
               lora_scale: R.Tensor(("s", 1), "float32"), lora_a_off: R.Tensor(("s", 1, 16), "int32"),
               lora_b_off: R.Tensor(("s", 1, 16), "int32"), lora_token_order: R.Tensor(("b",), "int32"),
               lora_slot_start: R.Tensor(("c",), "int32"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 9})
        b = T.int64()
        cls = ExpectedTriton
        with R.dataflow():
            w = params[0]
            wt = R.permute_dims(w)
            x2 = R.reshape(x, R.shape([b, 1024]))
            # the batch's tiles, laid out once per function for every linear's shrink and expand
            tiles = R.call_tir(cls.lora_sgmv_triton_tiles, (lora_token_order, lora_slot_start),
                               out_ty=R.Tensor((1 + 6 * b,), "int32"))
            v = R.call_tir(cls.lora_sgmv_triton_shrink_m0_1024, (x2, lora_arena, lora_token_order, lora_slot_start,
                           tiles, lora_rank, lora_scale, lora_a_off, R.prim_value(T.int64(0))),
                           out_ty=R.Tensor((b, 1, 16, 16), "float32"))
            y = R.matmul(x, wt)  # after the shrink, which reads only x
            y2 = R.reshape(y, R.shape([b, 600]))
            y3 = R.call_tir_inplace(cls.lora_sgmv_triton_expand_m0_1024x600, (v, lora_arena, lora_token_order,
                                    lora_slot_start, tiles, lora_rank, lora_scale, lora_b_off,
                                    R.prim_value(T.int64(0)), y2), [9], R.Tensor((b, 600), "float16"))
            gv = R.reshape(y3, R.shape([b, 1, 600]))
            R.output(gv)
        return gv


def _rewrite(target, backend):
    return LoraRewrite(param_names=NAMES_CUDA, modules=[("o_proj", 1024, 600)],
                       linears={"o_proj": [("o_proj", 0, 600)]}, num_layers=1, max_rank=16, kernel="sgmv",
                       arena_elems=4096, functions=["decode"], target=target, backend=backend,
                       base_functions=False)(BeforeCuda)


@needs_nvcc
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda", "tir"])
def test_rewrite_inserts_the_cuda_kernels(cuda, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    after = _rewrite(cuda, backend)
    if backend == "auto":  # "auto" is "triton" where Triton is installed, else "cuda"
        try:
            import triton  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
            backend = "triton"
        except ImportError:
            backend = "cuda"
    on_cuda = backend == "cuda"
    if backend == "triton":
        expected = ExpectedTriton
        names = ("lora_sgmv_triton_tiles", "lora_sgmv_triton_shrink_m0_1024", "lora_sgmv_triton_expand_m0_1024x600")
        tiles, tmods = GT.tiles_wrapper(256, "sm_90a")
        shrink, smods = GT.shrink_wrapper(1024, (0,), 1, 16, 1, "float16", 256, 8, "sm_90a")
        expand, emods = GT.expand_wrapper(1024, (600,), (0,), 1, 16, 1, "float16", 256, 8, "sm_90a")
        for name, func in zip(names, (tiles, shrink, expand)):
            expected[name] = func.with_attr("global_symbol", name)
        relax.analysis.well_formed(after)
        tvm.ir.assert_structural_equal(after.without_attr("external_mods"), relax.transform.Normalize()(expected))
        mods = list(after.attrs["external_mods"])
        assert len(mods) == len(tmods) + len(smods) + len(emods)  # one cubin per kernel and tile variant
        # every kernel the wrappers launch (one per kind and tile variant; the tile kernel per BM) is
        # in a linked module
        launched = set(re.findall(r'"(mlc_lora_triton_\w+)"', after.script()))
        bms = {cfg["BM"] for cfg in GT.VARIANTS.values()}
        assert len(launched) == 2 * len(GT.VARIANTS) + len(bms)
        assert all(any(m.implements_function(k) for m in mods) for k in launched)
        return
    if on_cuda:
        expected = ExpectedCuda
        shrink = GC.shrink_wrapper(1024, (0,), 1, 16, 1, "float16")
        expand = GC.expand_wrapper(1024, (600,), (0,), 1, 16, 1, "float16")
    else:
        expected = ExpectedTir
        shrink = G.lora_sgmv_shrink_kernel(1024, 0, 1, 16, 1, "float16", cuda)
        expand = G.lora_sgmv_expand_kernel(1024, 600, 0, 1, 16, 1, "float16", cuda)
    expected["lora_sgmv_shrink_m0_1024"] = shrink.with_attr("global_symbol", "lora_sgmv_shrink_m0_1024")
    expected["lora_sgmv_expand_m0_1024x600"] = expand.with_attr("global_symbol", "lora_sgmv_expand_m0_1024x600")
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after.without_attr("external_mods"), relax.transform.Normalize()(expected))
    mods = list(after.attrs["external_mods"]) if after.attrs and "external_mods" in after.attrs else []
    if on_cuda:
        assert len(mods) == 1
        assert all(mods[0].implements_function(k) for k in GC.kernel_names("float16", 16))
    else:
        assert not mods


@needs_nvcc
def test_rewrite_fuses_the_parts_of_qkv(cuda):
    """q|k|v with k untargeted: one shrink over parts (q, none, v), one in-place expand over the
    fused output; no delta tensor, no concat, no add."""
    before = BeforeCuda.script().replace("600", "1600")
    names = ["model.layers.0.self_attn.qkv_proj.weight"]
    after = LoraRewrite(param_names=names, modules=[("q_proj", 1024, 1024), ("v_proj", 1024, 288)],
                        linears={"qkv_proj": [("q_proj", 0, 1024), ("k_proj", 1024, 1312), ("v_proj", 1312, 1600)]},
                        num_layers=1, max_rank=16, kernel="sgmv", arena_elems=4096, functions=["decode"],
                        target=cuda, backend="cuda")(tvm.script.from_source(before))
    text = after["decode"].script()
    assert text.count("R.call_tir(") == 1 and text.count("R.call_tir_inplace(") == 1
    assert "R.add" not in text and "R.concat" not in text
    assert "lora_sgmv_shrink_m0_x_1_1024" in text and "lora_sgmv_expand_m0_x_1_1024x1600" in text
    assert 'R.Tensor((b, 3, 2, 16), dtype="float32")' in text


@needs_nvcc
def test_rewrite_backend_choice_and_errors(cuda):
    # llvm and float32 stay on TIR under "auto"; "cuda" refuses what the kernels cannot run.
    llvm_after = _rewrite(tvm.target.Target("llvm"), "auto")
    assert not (llvm_after.attrs and "external_mods" in llvm_after.attrs)
    with pytest.raises(ValueError, match="max rank 256"):
        LoraRewrite(param_names=NAMES_CUDA, modules=[("o_proj", 1024, 600)], linears={"o_proj": [("o_proj", 0, 600)]},
                    num_layers=1, max_rank=256, kernel="sgmv", functions=["decode"], target=cuda,
                    backend="cuda")(BeforeCuda)
    with pytest.raises(ValueError, match="unknown LoRA kernel backend 'cutlass'"):
        LoraRewrite(param_names=NAMES_CUDA, modules=[], linears={}, num_layers=1, max_rank=16, backend="cutlass")
    # an explicit backend the stage has no implementation for, or that cannot run the target
    with pytest.raises(ValueError, match="'gather' has no 'cuda' implementation"):
        LoraRewrite(param_names=NAMES_CUDA, modules=[], linears={}, num_layers=1, max_rank=16, kernel="gather",
                    backend="cuda")
    with pytest.raises(ValueError, match="target llvm"):
        _rewrite(tvm.target.Target("llvm"), "cuda")


@needs_nvcc
def test_cuda_module_survives_the_model_passes(cuda):
    """A tiny fp16 Llama through the pipeline's model-level passes: the sgmv module and the
    attention module both reach relax.build (external_mods)."""
    from mlc_lora.compile import export_model, lora_pass_options
    from mlc_lora.compiler_passes.passes import DispatchAttention, DispatchCublas, DispatchKVCache
    from mlc_lora.lora.layout import make_spec
    from mlc_lora.models import llama

    cfg = llama.LlamaConfig(hidden_size=128, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                            num_hidden_layers=1, vocab_size=64)
    mod, names = export_model(llama, cfg, "float16", cuda)
    spec = make_spec(cfg, 16, 64, kernel="sgmv")
    mod = LoraRewrite(target=cuda, **lora_pass_options(spec, cfg, llama, names, backend="cuda"))(mod)
    for p in (DispatchCublas(), DispatchKVCache(), DispatchAttention("sm_90a")):
        mod = p(mod)
    mods = list(mod.attrs["external_mods"])
    names = GC.kernel_names("float16", 16)
    assert any(m.implements_function(names[0]) and m.implements_function(names[1]) for m in mods)
    assert any(m.implements_function("mlc_lora_attn_prefill") for m in mods)
