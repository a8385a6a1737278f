"""The small-batch linear (compiler_passes/ops/gemv: gemv_cuda.py, gemv.cu): gemv.cu on a CPU
emulation against numpy, the wrapper's choice of kernel by token count and its launches.
DispatchCublas sending CUDA fp16/bf16 linears through it: tests/python/compiler/passes/."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import tvm

from mlc_lora.compiler_passes.ops import cuda_build
from mlc_lora.compiler_passes.ops.gemv import gemv_cuda as G
from mlc_lora.compiler_passes.ops.gemv.reference import gemv_ref
from mlc_lora.compiler_passes.passes.dispatch_cublas import CUBLAS_GEMM

from ... import emu
from ....conftest import needs_cxx

@pytest.fixture(scope="module")
def gemv_emu(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gemv_emu")
    return lambda dtype: emu.build("gemv_emu.cc", out_dir / f"gemv_emu_{G.DTYPES[dtype]}", G.SOURCE, dtype,
                                   {"MLC_SUFFIX": G.DTYPES[dtype]})


@needs_cxx
@pytest.mark.parametrize("dtype,bound,n,k,n_out,extra", [
    ("float16", 1, 1, 4096, 7, 0),     # K in one unrolled step per thread (256 threads); a partial row tile
    ("bfloat16", 4, 3, 11008, 6, 0),   # three steps, the last partial; fewer tokens than the bound
    ("float16", 8, 8, 1096, 5, 0),     # 96 threads, a partial step; the full bound
    ("bfloat16", 2, 2, 576, 9, 0),     # SmolLM2's hidden size: 64 threads
    ("float16", 2, 2, 1096, 6, 96),    # a weight stored with 96 spare columns beside its own
    ("bfloat16", 1, 1, 4096, 5, 32),
])
def test_gemv_cu_on_cpu_emulation(gemv_emu, tmp_path, dtype, bound, n, k, n_out, extra):
    import ml_dtypes

    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal((n, k)).astype(np_dt)
    w = (rng.standard_normal((n_out, k + extra)) * k ** -0.5).astype(np_dt)
    w[:, k:] = np.nan  # spare columns: never read
    x.tofile(tmp_path / "x")
    w.tofile(tmp_path / "w")
    subprocess.run([str(gemv_emu(dtype)), str(tmp_path),
                    *map(str, (bound, n, k, n_out, G.launch_threads(k), k + extra))], check=True, timeout=300)
    y = np.fromfile(tmp_path / "y", np_dt).reshape(n, n_out).astype(np.float32)
    ref = gemv_ref(x, w[:, :k])
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
    """Each kernel launch passes gemv.cu's 7 arguments (the last W's row stride), then grid x, y, z
    and block x (the CUDA module's launch tags); the grid covers N in ROWS-row tiles."""
    for w_cols, stride in ((None, 4096), (4096 + 96, 4192)):
        launches = _launches(G.wrapper(1000, 4096, "float16", 3, 8, w_cols=w_cols))
        kernels = [(n, a) for n, a in launches if n != CUBLAS_GEMM]
        assert len(kernels) == len(G.TOKENS) and len(launches) == len(G.TOKENS) + 1
        for _, args in kernels:
            assert len(args) == 7 + len(cuda_build.LAUNCH_TAGS)
            assert [int(a) for a in args[4:]] == [4096, 1000, stride, 250, 1, 1, 256]
        assert len(dict(launches)[CUBLAS_GEMM]) == 3  # x, w, y as DLTensors
    with pytest.raises(ValueError, match="columns"):
        G.wrapper(1000, 4096, "float16", 2, 8, w_cols=4100)  # not a multiple of 8


def test_supported():
    assert G.supported("float16", 4096, 3) is None
    assert "float32" in G.supported("float32", 4096, 2)
    assert "K = 60" in G.supported("bfloat16", 60, 2)
    assert "4 dimensions" in G.supported("float16", 64, 4)
    with pytest.raises(ValueError, match="K = 60"):
        G.wrapper(32, 60, "float16", 2, 8)
