"""gemv_kernels: the small-batch linear (cuda/gemv.cu) on a CPU emulation against numpy, the
wrapper's choice of kernel by token count, and DispatchCublas sending CUDA fp16/bf16 linears
through it (Before/After)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import tvm

from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compile import CompileError, CompileOptions, build_library
from mlc_lora.compiler_passes import cuda_source
from mlc_lora.compiler_passes import gemv_kernels as G
from mlc_lora.compiler_passes.dispatch_cublas import CUBLAS_GEMM, GEMV_MAX_ROWS, DispatchCublas

from . import emu

@pytest.fixture(scope="module")
def gemv_emu(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gemv_emu")
    return lambda dtype: emu.build("gemv_emu.cc", out_dir / f"gemv_emu_{G.DTYPES[dtype]}", dtype,
                                   {"MLC_SUFFIX": G.DTYPES[dtype]})


@pytest.mark.parametrize("dtype,bound,n,k,n_out", [
    ("float16", 1, 1, 4096, 7),     # K in one unrolled step per thread (256 threads); a partial row tile
    ("bfloat16", 4, 3, 11008, 6),   # three steps, the last partial; fewer tokens than the bound
    ("float16", 8, 8, 1096, 5),     # 96 threads, a partial step; the full bound
    ("bfloat16", 2, 2, 576, 9),     # SmolLM2's hidden size: 64 threads
])
def test_gemv_cu_on_cpu_emulation(gemv_emu, tmp_path, dtype, bound, n, k, n_out):
    import ml_dtypes

    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal((n, k)).astype(np_dt)
    w = (rng.standard_normal((n_out, k)) * k ** -0.5).astype(np_dt)
    x.tofile(tmp_path / "x")
    w.tofile(tmp_path / "w")
    subprocess.run([str(gemv_emu(dtype)), str(tmp_path), *map(str, (bound, n, k, n_out, G.launch_threads(k)))],
                   check=True, timeout=300)
    y = np.fromfile(tmp_path / "y", np_dt).reshape(n, n_out).astype(np.float32)
    ref = G.gemv_ref(x, w)
    # Output rounding alone: ~2^-12 (fp16) / 2^-9 (bf16) relative.
    tol = 1e-3 if dtype == "float16" else 5e-3
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol
    np.testing.assert_allclose(y, ref, rtol=0, atol=(4e-3 if dtype == "float16" else 3e-2) * np.abs(ref).max())


def test_launch_threads():
    # a warp per 64 16-byte steps of K (32 lanes x UNROLL), at most 8 warps
    assert [G.launch_threads(k) for k in (64, 576, 1096, 4096, 11008)] == [32, 64, 96, 256, 256]


def _vars(e):
    if isinstance(e, tvm.tirx.Var):
        return [e]
    return [v for f in ("a", "b", "value") if hasattr(e, f) for v in _vars(getattr(e, f))]


def _picked(func: tvm.tirx.PrimFunc, rows: int) -> str:
    """The function the wrapper calls for `rows` tokens, read off its if/else chain."""
    ana = tvm.sym.Analyzer()
    stmt = func.body
    while True:
        if isinstance(stmt, tvm.tirx.IfThenElse):
            # x is (n, K) or (b, s, K): n = b = rows, s = 1
            for v in _vars(stmt.condition):
                ana.bind(v, 1 if v.name == "s" else rows)
            cond = ana.simplify(stmt.condition)
            stmt = stmt.then_case if int(cond) else stmt.else_case
        elif isinstance(stmt, tvm.tirx.Evaluate):
            return stmt.value.args[0].value
        elif hasattr(stmt, "body"):
            stmt = stmt.body
        else:
            raise AssertionError(f"unexpected {type(stmt)}")


@pytest.mark.parametrize("ndim", [2, 3])
def test_wrapper_picks_the_smallest_bound_then_cublas(ndim):
    f = G.wrapper(4096, 4096, "float16", ndim, max_rows=8)
    assert [_picked(f, r) for r in (1, 2, 3, 4, 5, 8, 9, 64)] == [
        "mlc_lora_gemv_f16_t1", "mlc_lora_gemv_f16_t2", "mlc_lora_gemv_f16_t4", "mlc_lora_gemv_f16_t4",
        "mlc_lora_gemv_f16_t8", "mlc_lora_gemv_f16_t8", CUBLAS_GEMM, CUBLAS_GEMM]
    # max_rows 2: bounds above it are never taken
    f = G.wrapper(1536, 576, "bfloat16", ndim, max_rows=2)
    assert [_picked(f, r) for r in (1, 2, 3, 8)] == [
        "mlc_lora_gemv_bf16_t1", "mlc_lora_gemv_bf16_t2", CUBLAS_GEMM, CUBLAS_GEMM]


def _launches(func):
    """(name, args) of every T.call_packed in the wrapper."""
    out = []

    def walk(stmt):
        if isinstance(stmt, tvm.tirx.IfThenElse):
            walk(stmt.then_case)
            if stmt.else_case is not None:
                walk(stmt.else_case)
        elif isinstance(stmt, tvm.tirx.Evaluate):
            out.append((stmt.value.args[0].value, list(stmt.value.args[1:])))
        elif hasattr(stmt, "body"):
            walk(stmt.body)
    walk(func.body)
    return out


def test_launch_arguments_follow_the_kernel_signature():
    """Each kernel launch passes gemv.cu's 6 arguments, then grid x, y, z and block x (the CUDA
    module's launch tags); the grid covers N in ROWS-row tiles."""
    launches = _launches(G.wrapper(1000, 4096, "float16", 3, 8))
    kernels = [(n, a) for n, a in launches if n != CUBLAS_GEMM]
    assert len(kernels) == len(G.TOKENS) and len(launches) == len(G.TOKENS) + 1
    for _, args in kernels:
        assert len(args) == 6 + len(cuda_source.LAUNCH_TAGS)
        assert [int(a) for a in args[4:]] == [4096, 1000, 250, 1, 1, 256]
    assert len(dict(launches)[CUBLAS_GEMM]) == 3  # x, w, y as DLTensors


def test_supported():
    assert G.supported("float16", 4096, 3) is None
    assert "float32" in G.supported("float32", 4096, 2)
    assert "K = 60" in G.supported("bfloat16", 60, 2)
    assert "4 dimensions" in G.supported("float16", 64, 4)
    with pytest.raises(ValueError, match="K = 60"):
        G.wrapper(32, 60, "float16", 2, 8)


@tvm.script.ir_module
class Before:
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


def _expected():
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


def _needs_nvcc():
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()


def test_before_after():
    _needs_nvcc()
    after = DispatchCublas(arch="sm_90a")(Before)
    relax.analysis.well_formed(after)
    expected = _expected()
    for name in ("linear", "packed", "mlc_lora_linear_f16_32x64_3d", "mlc_lora_linear_bf16_16x64_2d"):
        tvm.ir.assert_structural_equal(after[name], expected[name], map_free_vars=True)
    others = after["others"].script()  # K % 8 != 0 and float32: cuBLAS
    assert others.count(CUBLAS_GEMM) == 2 and "mlc_lora_linear" not in others
    # one kernel module per dtype used, each with every bound
    mods = after.attrs["external_mods"]
    assert len(mods) == 2 and all(m.kind == "cuda" for m in mods)
    cubin = cuda_source.build_cubin(G.SOURCE, "sm_90a", {"MLC_SUFFIX": "bf16", "MLC_BF16": None})
    assert all(G.kernel_name("bfloat16", t).encode() in cubin for t in G.TOKENS)
    # off: straight to cuBLAS (gemv_max_rows 0, or no arch)
    for off in (DispatchCublas(arch="sm_90a", gemv_max_rows=0), DispatchCublas()):
        script = off(Before)["linear"].script()
        assert CUBLAS_GEMM in script and "mlc_lora_linear" not in script
    with pytest.raises(ValueError, match="gemv_max_rows must be >= 0"):
        DispatchCublas(arch="sm_90a", gemv_max_rows=-1)


def test_compile_option_is_checked(tmp_path):
    from mlc_lora.models import llama

    with pytest.raises(CompileError, match="gemv_max_rows must be 0..8"):
        cfg = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                num_hidden_layers=1, vocab_size=80)
        build_library(llama, cfg, "float16", CompileOptions(target="cuda", gemv_max_rows=9),
                      tmp_path / "x.so")
