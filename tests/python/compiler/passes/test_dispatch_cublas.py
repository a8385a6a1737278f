"""DispatchCublas: the linears become calls of our GEMM extern (cuBLAS / CPU), or on CUDA fp16/bf16
of the gemv wrapper (compiler_passes/ops/gemv); everything else stays."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compile import CompileError, CompileOptions, build_library
from mlc_lora.compiler_passes import get_pipeline
from mlc_lora.compiler_passes.ops import cuda_build
from mlc_lora.compiler_passes.ops.gemv import gemv_cuda as G
from mlc_lora.compiler_passes.passes.dispatch_cublas import CUBLAS_GEMM, GEMV_MAX_ROWS, DispatchCublas

from ...conftest import needs_nvcc

ROOT = Path(__file__).resolve().parents[4]


@tvm.script.ir_module
class Before:
    @R.function
    def linear(x: R.Tensor(("n", 1, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        n = T.int64()
        with R.dataflow():
            wt = R.permute_dims(w)
            y = R.matmul(x, wt)
            z = R.add(y, y)
            R.output(z)
        return z

    @R.function
    def packed(x: R.Tensor(("n", 64), "bfloat16"),
               params: R.Tuple(R.Tensor((16, 64), "bfloat16"), R.Tensor((64,), "bfloat16"))):
        n = T.int64()
        with R.dataflow():
            w = params[0]
            y = R.matmul(x, R.permute_dims(w, axes=[1, 0]))
            R.output(y)
        return y

    @R.function
    def untouched(x: R.Tensor((1, 64), "float16"), a: R.Tensor(("m", 64), "float16"),
                  w3: R.Tensor((2, 32, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        m = T.int64()
        with R.dataflow():
            # static single row: dlight's GEMV stays
            y1 = R.matmul(x, R.permute_dims(w))
            # an activation times an activation: not a weight
            y2 = R.matmul(x, R.permute_dims(R.add(a, a)))
            # a 3-D weight (batched matmul)
            y3 = R.matmul(x, R.permute_dims(w3, axes=[0, 2, 1]))
            R.output(y1, y2, y3)
        return (y1, y2, y3)


@tvm.script.ir_module
class Expected:
    @R.function
    def linear(x: R.Tensor(("n", 1, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        n = T.int64()
        with R.dataflow():
            y = R.call_dps_packed("mlc_lora.runtime.cublas_gemm", (x, w),
                                  out_ty=R.Tensor((n, 1, 32), "float16"))
            z = R.add(y, y)
            R.output(z)
        return z

    @R.function
    def packed(x: R.Tensor(("n", 64), "bfloat16"),
               params: R.Tuple(R.Tensor((16, 64), "bfloat16"), R.Tensor((64,), "bfloat16"))):
        n = T.int64()
        with R.dataflow():
            w = params[0]
            y = R.call_dps_packed("mlc_lora.runtime.cublas_gemm", (x, w),
                                  out_ty=R.Tensor((n, 16), "bfloat16"))
            R.output(y)
        return y

    @R.function
    def untouched(x: R.Tensor((1, 64), "float16"), a: R.Tensor(("m", 64), "float16"),
                  w3: R.Tensor((2, 32, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        m = T.int64()
        with R.dataflow():
            y1 = R.matmul(x, R.permute_dims(w))
            y2 = R.matmul(x, R.permute_dims(R.add(a, a)))
            y3 = R.matmul(x, R.permute_dims(w3, axes=[0, 2, 1]))
            R.output(y1, y2, y3)
        return (y1, y2, y3)


def test_before_after():
    after = DispatchCublas()(Before)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, Expected)


@tvm.script.ir_module
class BeforeRows:
    @R.function
    def packed(x: R.Tensor(("n", 64), "float32"),
               params: R.Tuple(R.Tensor((16 + 32, 64), "float32"), R.Tensor((64,), "float32"))):
        n = T.int64()
        with R.dataflow():
            w_all = params[0]
            w = R.memory.view(w_all, R.shape([16, 64]))
            y = R.matmul(x, R.permute_dims(w, axes=[1, 0]))
            R.output(y)
        return y


@tvm.script.ir_module
class ExpectedRows:
    @R.function
    def packed(x: R.Tensor(("n", 64), "float32"),
               params: R.Tuple(R.Tensor((16 + 32, 64), "float32"), R.Tensor((64,), "float32"))):
        n = T.int64()
        with R.dataflow():
            w_all = params[0]
            y = R.call_dps_packed("mlc_lora.runtime.cublas_gemm", (x, w_all),
                                  out_ty=R.Tensor((n, 16), "float32"))
            R.output(y)
        return y


@tvm.script.ir_module
class BeforeCols:
    @R.function
    def packed(x: R.Tensor(("n", 64), "float16"),
               params: R.Tuple(R.Tensor((16, 64 + 32), "float16"), R.Tensor((64,), "float16"))):
        n = T.int64()
        with R.dataflow():
            w_all = params[0]
            w = R.strided_slice(w_all, axes=[1], begin=[0], end=[64])
            y = R.matmul(x, R.permute_dims(w, axes=[1, 0]))
            R.output(y)
        return y


def test_a_slice_of_a_weights_first_columns_passes_the_weight():
    """ReserveRankColumns's slices (a weight's first columns): cuBLAS gets the whole weight (no
    slice copied per call) and reads its first columns with its row stride."""
    after = DispatchCublas()(BeforeCols)
    relax.analysis.well_formed(after)
    text = after["packed"].script()
    assert "strided_slice" not in text and "cublas_gemm\", (x, w_all)" in text, text


@needs_nvcc
def test_gemv_gets_the_whole_weight_of_a_first_columns_slice():
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    after = DispatchCublas(arch="sm_90a")(BeforeCols)
    relax.analysis.well_formed(after)
    assert "strided_slice" not in after["packed"].script()
    name = "mlc_lora_linear_f16_16x64_of96_2d"
    want = G.wrapper(16, 64, "float16", 2, GEMV_MAX_ROWS, w_cols=96).with_attr("global_symbol", name)
    tvm.ir.assert_structural_equal(after[name], want, map_free_vars=True)


def test_a_view_of_a_weights_first_rows_passes_the_weight():
    """ReserveRankRows's views (a weight's first rows): the GEMM gets the whole weight and reads the
    rows its output has; the view goes (no view made per call)."""
    after = DispatchCublas(cpu=True)(BeforeRows)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, ExpectedRows)


def test_extern_reads_the_first_rows_of_a_taller_weight(cublas_gemm):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 40)).astype("float32")
    w = rng.standard_normal((24 + 32, 40)).astype("float32")
    w[24:] = np.nan  # rows past the output's: never read
    out = np.full((5, 24), np.nan, dtype="float32")
    cublas_gemm(x, w, out)
    np.testing.assert_allclose(out, x @ w[:24].T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shape mismatch"):  # fewer rows than outputs
        cublas_gemm(x, w[:20].copy(), out)


def test_extern_reads_the_first_columns_of_a_wider_weight(cublas_gemm):
    """A weight stored with spare columns beside its own (rows K' > K apart, the rank columns
    route): the GEMM reads each row's first K inputs, at every tile shape of the CPU kernels
    (4 x 3, 1 x 4 and their leftovers) and an input count off the 8-wide vector step."""
    rng = np.random.default_rng(6)
    for m, n, k, extra in ((5, 24, 40, 32), (1, 7, 45, 3), (9, 13, 16, 96)):
        x = rng.standard_normal((m, k)).astype("float32")
        w = rng.standard_normal((n + 4, k + extra)).astype("float32")
        w[:, k:] = np.nan  # the spare columns: never read
        w[n:] = np.nan  # and spare rows
        out = np.full((m, n), np.nan, dtype="float32")
        cublas_gemm(x, w, out)
        np.testing.assert_allclose(out, x @ w[:n, :k].T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shape mismatch"):  # fewer columns than inputs
        cublas_gemm(x, w[:, : k - 8].copy(), out)


def _tiny_llama(target, dtype="float32"):
    from mlc_lora.compile import export_model
    from mlc_lora.models import llama

    cfg = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=1, vocab_size=80,
                            prefill_chunk_size=64, max_batch_size=4)
    mod, names = export_model(llama, cfg, dtype, target)
    return llama, cfg, mod, names


def _count_cublas(mod) -> int:
    return sum(f.script().count(CUBLAS_GEMM) for _, f in mod.functions_items()
               if isinstance(f, relax.Function))


def test_every_model_linear_is_rewritten():
    """4 linears per layer + lm_head, in prefill and in decode; embed has none."""
    _, cfg, mod, _ = _tiny_llama(tvm.target.Target("llvm"))
    after = DispatchCublas()(mod)
    per_fn = 4 * cfg.num_hidden_layers + 1
    assert after["prefill"].script().count(CUBLAS_GEMM) == per_fn
    assert after["decode"].script().count(CUBLAS_GEMM) == per_fn
    assert "permute_dims" not in after["decode"].script()
    assert _count_cublas(after) == 2 * per_fn


def test_pipeline_dispatches_on_cuda_and_llvm():
    linear = tvm.IRModule({"linear": Before["linear"]})
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    with cuda:
        # (with the gemv kernels off: test_gemv_before_after below covers them)
        assert CUBLAS_GEMM in get_pipeline(cuda, gemm="cublas", gemv_max_rows=0)(linear)["linear"].script()
        assert CUBLAS_GEMM not in get_pipeline(cuda, gemm="tvm")(linear)["linear"].script()
    llvm = tvm.target.Target("llvm")
    # The CPU path takes float32 only: the float16 linear stays on TVM's matmul.
    assert CUBLAS_GEMM not in get_pipeline(llvm)(linear)["linear"].script()
    f32 = tvm.IRModule({"linear": F32["linear"]})
    assert CUBLAS_GEMM in get_pipeline(llvm)(f32)["linear"].script()
    assert CUBLAS_GEMM not in get_pipeline(llvm, gemm="tvm")(f32)["linear"].script()
    with pytest.raises(ValueError, match="gemm must be one of"):
        get_pipeline(cuda, gemm="cutlass")


@tvm.script.ir_module
class F32:
    @R.function
    def linear(x: R.Tensor((1, 64), "float32"), w: R.Tensor((32, 64), "float32")):
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(w))
            R.output(y)
        return y


def test_cpu_mode_takes_float32_and_single_rows():
    """On CPU a static single row goes to the extern too (TVM's CPU matmul is a scalar loop);
    half-precision linears stay, as the extern's CPU path is float32 only."""
    assert CUBLAS_GEMM in DispatchCublas(cpu=True)(F32)["linear"].script()
    assert CUBLAS_GEMM not in DispatchCublas()(F32)["linear"].script()
    half = tvm.IRModule({"linear": Before["linear"]})
    assert CUBLAS_GEMM not in DispatchCublas(cpu=True)(half)["linear"].script()


@pytest.fixture(scope="module")
def cublas_gemm(tmp_path_factory):
    """The extern, from the loaded runtime library or built here from src/runtime/cublas_gemm.cc."""
    f = tvm.get_global_func(CUBLAS_GEMM, allow_missing=True)
    if f is None:
        import tvm_ffi.cpp

        try:
            tvm_ffi.cpp.load("mlc_lora_cublas_gemm", cpp_files=[str(ROOT / "src/runtime/cublas_gemm.cc"),
                                                                  str(ROOT / "src/runtime/cpu_gemm.cc")],
                             extra_ldflags=["-ldl", "-lpthread"],
                             build_directory=str(tmp_path_factory.mktemp("cublas_gemm_build")))
        except Exception as e:  # pylint: disable=broad-except
            pytest.skip(f"cannot build src/runtime/cublas_gemm.cc here: {e}")
        f = tvm.get_global_func(CUBLAS_GEMM)
    return f


def test_extern_reference_path_matches_numpy(cublas_gemm):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 40)).astype("float32")
    w = rng.standard_normal((24, 40)).astype("float32")
    out = np.full((3, 2, 24), np.nan, dtype="float32")
    cublas_gemm(x, w, out)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 576, 576), (3, 37, 13), (17, 100, 129),
                                   (64, 49, 7), (8, 1536, 576), (130, 300, 65)])
def test_extern_cpu_gemm_random_shapes(cublas_gemm, m, n, k):
    """Odd sizes: rows and columns not multiples of the 4x3 tile, K not a multiple of 8, and
    products large enough to go multi-threaded."""
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k)).astype("float32")
    w = rng.standard_normal((n, k)).astype("float32")
    out = np.full((m, n), np.nan, dtype="float32")
    cublas_gemm(x, w, out)
    ref = x.astype("float64") @ w.astype("float64").T
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_extern_cpu_gemm_in_forked_child(cublas_gemm):
    """A child forked after the thread pool started has no workers: it must compute, not hang."""
    import os

    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 300)).astype("float32")
    w = rng.standard_normal((500, 300)).astype("float32")
    out = np.zeros((64, 500), "float32")
    cublas_gemm(x, w, out)  # starts the pool in this process
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if the result is right
        try:
            out[:] = 0
            cublas_gemm(x, w, out)
            os._exit(0 if np.allclose(out, x @ w.T, rtol=1e-4, atol=1e-3) else 1)
        except BaseException:  # pylint: disable=broad-except
            os._exit(2)
    import signal
    import time

    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the GEMM hung in a forked child")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_extern_rejects_bad_shapes(cublas_gemm):
    x = np.zeros((2, 8), "float32")
    out = np.zeros((2, 4), "float32")
    with pytest.raises(ValueError, match="shape mismatch"):
        cublas_gemm(x, np.zeros((4, 6), "float32"), out)
    with pytest.raises(TypeError, match="mixed dtypes"):
        cublas_gemm(x, np.zeros((4, 8), "float16"), out)
    with pytest.raises(TypeError, match="float32 only"):
        cublas_gemm(x.astype("float16"), np.zeros((4, 8), "float16"), out.astype("float16"))


def test_compiled_model_through_extern_matches_tvm_matmul(cublas_gemm):
    """The whole tiny model with every linear on the extern (its float32 CPU path) gives the logits
    of the same model on TVM's own matmul: the call_dps_packed plumbing (shapes, views, packed
    weights, KV cache in between) is right."""
    import tvm.runtime.vm  # noqa: F401

    del cublas_gemm
    target = tvm.target.Target("llvm")
    llama, cfg, _, names = _tiny_llama(target)
    rng = np.random.default_rng(1)
    from mlc_lora.models.llama_loader import param_shapes

    shapes = param_shapes(cfg)
    params = [tvm.runtime.tensor((0.2 * rng.standard_normal(shapes[n])).astype("float32")) for n in names]
    s = tvm.runtime.ShapeTuple
    g = tvm.get_global_func
    results = []
    for extra in ([], [DispatchCublas()]):
        _, _, mod, _ = _tiny_llama(target)
        with target:
            ex = tvm.compile(mod, target, relax_pipeline=get_pipeline(target, extra_passes=extra))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        kv = vm["create_paged_kv_cache"](s([4]), s([128]), s([64]), s([16]), s([0]))
        for i in range(2):
            g("vm.builtin.kv_state_add_sequence")(kv, i)
        ids = tvm.runtime.tensor(np.arange(9, dtype="int32") % cfg.vocab_size)
        emb = vm["embed"](ids, params).numpy().reshape(1, 9, cfg.hidden_size)
        g("vm.builtin.kv_state_begin_forward")(kv, s([0, 1]), s([5, 4]))
        pl, _ = vm["prefill"](tvm.runtime.tensor(emb), tvm.runtime.tensor(np.array([4, 8], "int32")), kv, params)
        g("vm.builtin.kv_state_end_forward")(kv)
        g("vm.builtin.kv_state_begin_forward")(kv, s([0, 1]), s([1, 1]))
        demb = vm["embed"](tvm.runtime.tensor(np.array([3, 7], "int32")), params).numpy().reshape(2, 1, -1)
        dl, _ = vm["decode"](tvm.runtime.tensor(demb), kv, params)
        g("vm.builtin.kv_state_end_forward")(kv)
        results.append((pl.numpy(), dl.numpy()))
    for a, b in zip(results[0], results[1]):
        assert np.abs(a).max() > 0.1
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_extern_on_gpu(cublas_gemm, cuda_device):
    import torch

    from mlc_lora.runner import load_cublas

    load_cublas(cuda_device)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(37, 256, device="cuda", dtype=dtype)
        w = torch.randn(96, 256, device="cuda", dtype=dtype)
        out = torch.empty(37, 96, device="cuda", dtype=dtype)
        cublas_gemm(x, w, out)
        ref = x.double() @ w.double().T
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("kernel", ["gather", "single"])
def test_composes_with_lora_rewrite(kernel):
    """After LoraRewrite only the base linears move to cuBLAS; the adapter ops stay as they are."""
    from mlc_lora.compiler_passes.passes import LoraRewrite

    from .test_lora_rewrite import Before as LoraBefore, _opts

    lora = LoraRewrite(**_opts(kernel))(LoraBefore)
    after = DispatchCublas()(lora)
    text, lora_text = after["decode"].script(), lora["decode"].script()
    base = LoraBefore["decode"].script().count("R.matmul")
    assert text.count(CUBLAS_GEMM) == base
    assert text.count("call_tir") == lora_text.count("call_tir")
    assert text.count("R.matmul") == lora_text.count("R.matmul") - base


@needs_nvcc  # (the pipeline builds CUDA modules: gemv, the activation kernel)
@pytest.mark.parametrize("gemv_max_rows", [0, 8])
def test_decode_cuda_graphs_capture_the_linears(gemv_max_rows):
    """With decode's graph attributes, RewriteCUDAGraph lifts the linears (cuBLAS calls, or the
    gemv/cuBLAS wrappers) into the captured functions; the KV-cache attention calls stay in decode
    itself. (fp16: the lm_head GEMM writes an intermediate, the float32 cast the output; a GEMM
    writing decode's output directly would stay outside, as the output is allocated per call.)"""
    from mlc_lora.compile import _decode_graph_attrs, prepare_cuda_build

    prepare_cuda_build()
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    _, cfg, mod, _ = _tiny_llama(cuda, "float16")
    mod = _decode_graph_attrs(mod, 4)
    with cuda, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        lowered = get_pipeline(cuda, stock_kv_cache=True, gemv_max_rows=gemv_max_rows)(mod)
    captured = [f.script() for gv, f in lowered.functions_items()
                if gv.name_hint.startswith("decode_cuda_graph_capture")]
    assert captured, "decode was not captured"
    linear = r"mlc_lora_linear_\w+\(" if gemv_max_rows else re.escape(CUBLAS_GEMM)
    assert sum(len(re.findall(linear, s)) for s in captured) == 4 * cfg.num_hidden_layers + 1
    decode = lowered["decode"].script()
    assert not re.search(linear, decode) and CUBLAS_GEMM not in decode
    assert decode.count("vm.builtin.cuda_graph.run_or_capture") >= cfg.num_hidden_layers + 1


# ---------------------------------------------------------------------------------------------
# On CUDA with an arch: fp16/bf16 linears through the gemv wrapper (gemv.cu up to gemv_max_rows
# tokens, cuBLAS above), one kernel module per dtype.

@tvm.script.ir_module
class BeforeGemv:
    @R.function
    def linear(x: R.Tensor(("n", 1, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        n = T.int64()
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(w))
            z = R.add(y, y)
            R.output(z)
        return z

    @R.function
    def packed(x: R.Tensor(("n", 64), "bfloat16"),
               params: R.Tuple(R.Tensor((16, 64), "bfloat16"), R.Tensor((64,), "bfloat16"))):
        n = T.int64()
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(params[0], axes=[1, 0]))
            R.output(y)
        return y

    @R.function
    def others(x: R.Tensor(("n", 60), "float16"), w: R.Tensor((32, 60), "float16"),
               x32: R.Tensor(("n", 64), "float32"), w32: R.Tensor((32, 64), "float32")):
        n = T.int64()
        with R.dataflow():
            y1 = R.matmul(x, R.permute_dims(w))  # K % 8 != 0: cuBLAS
            y2 = R.matmul(x32, R.permute_dims(w32))  # float32: cuBLAS
            R.output(y1, y2)
        return (y1, y2)


def _expected_gemv():
    bb = relax.BlockBuilder()
    lin = bb.add_func(G.wrapper(32, 64, "float16", 3, GEMV_MAX_ROWS).with_attr("global_symbol", "mlc_lora_linear_f16_32x64_3d"),
                      "mlc_lora_linear_f16_32x64_3d")
    pk = bb.add_func(G.wrapper(16, 64, "bfloat16", 2, GEMV_MAX_ROWS).with_attr("global_symbol", "mlc_lora_linear_bf16_16x64_2d"),
                     "mlc_lora_linear_bf16_16x64_2d")
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 1, 64], "float16"))
    w = relax.Var("w", relax.TensorType([32, 64], "float16"))
    with bb.function("linear", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.call_tir(lin, [x, w], relax.TensorType([n, 1, 32], "float16")))
            z = bb.emit_output(relax.op.add(y, y))
        bb.emit_func_output(z)
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 64], "bfloat16"))
    params = relax.Var("params", relax.TupleType([relax.TensorType([16, 64], "bfloat16"),
                                                  relax.TensorType([64], "bfloat16")]))
    with bb.function("packed", [x, params]):
        with bb.dataflow():
            w = bb.emit(relax.TupleGetItem(params, 0))
            y = bb.emit_output(relax.call_tir(pk, [x, w], relax.TensorType([n, 16], "bfloat16")))
        bb.emit_func_output(y)
    return bb.get()


@needs_nvcc
def test_gemv_before_after():
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    after = DispatchCublas(arch="sm_90a")(BeforeGemv)
    relax.analysis.well_formed(after)
    expected = _expected_gemv()
    for name in ("linear", "packed", "mlc_lora_linear_f16_32x64_3d", "mlc_lora_linear_bf16_16x64_2d"):
        tvm.ir.assert_structural_equal(after[name], expected[name], map_free_vars=True)
    others = after["others"].script()  # K % 8 != 0 and float32: cuBLAS
    assert others.count(CUBLAS_GEMM) == 2 and "mlc_lora_linear" not in others
    # one kernel module per dtype used, each with every bound
    mods = after.attrs["external_mods"]
    assert len(mods) == 2 and all(m.kind == "cuda" for m in mods)
    cubin = cuda_build.build_cubin(G.SOURCE, "sm_90a", {"MLC_SUFFIX": "bf16", "MLC_BF16": None})
    assert all(G.kernel_name("bfloat16", t).encode() in cubin for t in G.TOKENS)
    # off: straight to cuBLAS (gemv_max_rows 0, or no arch)
    for off in (DispatchCublas(arch="sm_90a", gemv_max_rows=0), DispatchCublas()):
        script = off(BeforeGemv)["linear"].script()
        assert CUBLAS_GEMM in script and "mlc_lora_linear" not in script
    with pytest.raises(ValueError, match="gemv_max_rows must be >= 0"):
        DispatchCublas(arch="sm_90a", gemv_max_rows=-1)


def test_gemv_compile_option_is_checked(tmp_path):
    from mlc_lora.models import llama

    with pytest.raises(CompileError, match="gemv_max_rows must be 0..8"):
        cfg = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                num_hidden_layers=1, vocab_size=80)
        build_library(llama, cfg, "float16", CompileOptions(target="cuda", gemv_max_rows=9),
                      tmp_path / "x.so")
