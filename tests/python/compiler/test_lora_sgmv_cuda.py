"""Stage 3 on hand-written CUDA (compiler_passes/lora_sgmv_cuda.py, cuda/lora_sgmv.cu).

No GPU here: nvcc builds the real cubin, the wrappers are checked to have the TIR kernels'
signatures, and LoraRewrite on a cuda target is checked Before/After (CUDA wrappers in, the
module attached). The kernels run against the numpy references in
test_sgmv_cuda_kernels_run_against_references (skipped without a GPU) and
scripts/bench_lora_kernels.py.
"""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from mlc_lora.compiler_passes import lora_kernels as K
from mlc_lora.compiler_passes import lora_sgmv as G
from mlc_lora.compiler_passes import lora_sgmv_cuda as GC
from mlc_lora.compiler_passes.lora_rewrite import LoraRewrite

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build cubin")


@pytest.fixture(scope="module")
def cuda():
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")


def _signature(func):
    """Parameter types (buffer shape and dtype, or scalar type) of a PrimFunc, in order."""
    out = []
    for p in func.params:
        ty = p.ty
        out.append((str(ty.shape), str(ty.dtype)) if hasattr(ty, "shape") else (str(ty), None))
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wrappers_have_the_tir_signatures(dtype):
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    pairs = [(GC.shrink_wrapper(11008, 3, 32, 64, 7, dtype), G.lora_sgmv_shrink_kernel(11008, 3, 32, 64, 7, dtype, target)),
             (GC.expand_wrapper(11008, 4096, 3, 32, 64, 7, dtype),
              G.lora_sgmv_expand_kernel(11008, 4096, 3, 32, 64, 7, dtype, target))]
    for cuda_f, tir_f in pairs:
        assert _signature(cuda_f) == _signature(tir_f)
        assert int(cuda_f.attrs["op_pattern"]) == K.OPAQUE and cuda_f.attrs["tirx.is_scheduled"]


def test_supported_says_why_not():
    assert GC.supported("float16", 16) is None and GC.supported("bfloat16", 128) is None
    assert "float32" in GC.supported("float32", 16)
    assert "max rank 256" in GC.supported("float16", 256)
    with pytest.raises(ValueError, match="max rank 0"):
        GC.build_module("float16", 0, "sm_90a")


@needs_nvcc
@pytest.mark.parametrize("dtype,rank", [("float16", 16), ("bfloat16", 64), ("float16", 128)])
def test_cubin_builds_with_both_kernels(cuda, dtype, rank):
    del cuda
    ext = GC.build_module(dtype, rank, "sm_90a")
    for name in GC.kernel_names(dtype, rank):
        assert ext.implements_function(name)


def test_layout_rows_allow_16_byte_loads():
    """Row offsets of Llama shapes are multiples of 8 elements, so the kernels' 16-byte path runs
    (odd offsets stay correct: load8 falls back to scalar loads)."""
    from mlc_lora.lora.layout import ALL_MODULES, LoraModule, layout_adapter

    shapes = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
              "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
    E = 2 * 8 * 16 * 128
    for rank in (8, 16, 64):
        lay = layout_adapter(E, [LoraModule(n, *shapes[n]) for n in ALL_MODULES], rank)
        assert all(off % 8 == 0 for off in lay.offsets.values())


# ---------------------------------------------------------------------------------------------
# LoraRewrite on a cuda target, Before/After.

NAMES = ["model.layers.0.self_attn.o_proj.weight"]


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor(("b", 1, 1024), "float16"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w = params[0]
            gv = R.matmul(x, R.permute_dims(w))
            R.output(gv)
        return gv


@I.ir_module(check_well_formed=False)  # the kernel stubs are swapped for the real ones
class Expected:
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
               lora_b_off: R.Tensor(("s", 1, 16), "int32"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 7})
        b = T.int64()
        cls = Expected
        with R.dataflow():
            w = params[0]
            y = R.matmul(x, R.permute_dims(w))
            x2 = R.reshape(x, R.shape([b, 1024]))
            v = R.call_tir(cls.lora_sgmv_shrink_m0_1024, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                           lora_a_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 2, 16), "float32"))
            d = R.call_tir(cls.lora_sgmv_expand_m0_1024x600, (v, lora_arena, lora_token_slot, lora_rank, lora_b_off,
                           R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 600), "float16"))
            gv = R.add(y, R.reshape(d, R.shape([b, 1, 600])))
            R.output(gv)
        return gv


def _rewrite(target, backend):
    return LoraRewrite(param_names=NAMES, modules=[("o_proj", 1024, 600)], linears={"o_proj": [("o_proj", 0, 600)]},
                       num_layers=1, max_rank=16, kernel="sgmv", arena_elems=4096, functions=["decode"],
                       target=target, sgmv_backend=backend)(Before)


@needs_nvcc
@pytest.mark.parametrize("backend", ["auto", "cuda", "tir"])
def test_rewrite_inserts_the_cuda_kernels(cuda, backend):
    after = _rewrite(cuda, backend)
    expected = Expected
    on_cuda = backend != "tir"
    if on_cuda:
        shrink = GC.shrink_wrapper(1024, 0, 1, 16, 1, "float16")
        expand = GC.expand_wrapper(1024, 600, 0, 1, 16, 1, "float16")
    else:
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


def test_rewrite_backend_choice_and_errors(cuda):
    # llvm and float32 stay on TIR under "auto"; "cuda" refuses what the kernels cannot run.
    llvm_after = _rewrite(tvm.target.Target("llvm"), "auto")
    assert not (llvm_after.attrs and "external_mods" in llvm_after.attrs)
    with pytest.raises(ValueError, match="max rank 256"):
        LoraRewrite(param_names=NAMES, modules=[("o_proj", 1024, 600)], linears={"o_proj": [("o_proj", 0, 600)]},
                    num_layers=1, max_rank=256, kernel="sgmv", functions=["decode"], target=cuda,
                    sgmv_backend="cuda")(Before)
    with pytest.raises(ValueError, match="unknown sgmv backend"):
        LoraRewrite(param_names=NAMES, modules=[], linears={}, num_layers=1, max_rank=16, sgmv_backend="triton")


@needs_nvcc
def test_cuda_module_survives_the_model_passes(cuda):
    """A tiny fp16 Llama through the pipeline's model-level passes: the sgmv module and the
    attention module both reach relax.build (external_mods)."""
    from mlc_lora.compile import export_model, lora_pass_options
    from mlc_lora.compiler_passes.dispatch_attention import DispatchAttention
    from mlc_lora.compiler_passes.dispatch_cublas import DispatchCublas
    from mlc_lora.compiler_passes.dispatch_kv_cache import DispatchKVCache
    from mlc_lora.lora.layout import make_spec
    from mlc_lora.models import llama

    cfg = llama.LlamaConfig(hidden_size=128, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                            num_hidden_layers=1, vocab_size=64)
    mod, names = export_model(llama, cfg, "float16", cuda)
    spec = make_spec(cfg, 16, 64, kernel="sgmv")
    mod = LoraRewrite(target=cuda, **lora_pass_options(spec, cfg, llama, names))(mod)
    for p in (DispatchCublas(), DispatchKVCache(), DispatchAttention("sm_90a")):
        mod = p(mod)
    mods = list(mod.attrs["external_mods"])
    names = GC.kernel_names("float16", 16)
    assert any(m.implements_function(names[0]) and m.implements_function(names[1]) for m in mods)
    assert any(m.implements_function("mlc_lora_attn_prefill") for m in mods)


# ---------------------------------------------------------------------------------------------
# On a GPU: the kernels against the numpy references (and the TIR CUDA kernels).


def _cuda_device():
    from mlc_lora.errors import MLCLoraError
    from mlc_lora.runner import device_of

    try:
        return device_of("cuda")
    except (MLCLoraError, OSError, RuntimeError):
        return None


def _tables(rng, n, ranks, in_f, out_f, M, m, R, L, aligned):
    """Rows at random places of an L-layer arena (8-element aligned or not), tokens on random
    slots or -1 in random order, the last slot untargeted (scale 0, offsets -1)."""
    S = len(ranks)
    rows = sum(ranks) * (in_f + out_f)
    per_layer = rows + 64 * sum(ranks) * 2 + 64
    per_layer += -per_layer % 8
    arena = (rng.standard_normal(L * per_layer) * 0.5).astype(np.float32)
    a_off = np.full((S, M, R), -1, np.int32)
    b_off = np.full((S, M, R), -1, np.int32)
    pos = 8
    for s, r in enumerate(ranks):
        for k in range(r):
            for tab, length in ((a_off, in_f), (b_off, out_f)):
                pos += 8 * int(rng.integers(0, 4)) if aligned else int(rng.integers(0, 8))
                tab[s, m, k] = pos
                pos += length
    assert pos <= per_layer
    scale = rng.uniform(0.5, 2.0, (S, M)).astype(np.float32)
    scale[-1, m] = 0.0
    a_off[-1, m], b_off[-1, m] = -1, -1
    slot = rng.integers(-1, S, n).astype(np.int32)
    return arena, slot, np.asarray(ranks, np.int32), scale, a_off, b_off


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,in_f,out_f,R,aligned", [
    (37, 1100, 603, 16, False),   # partial chunk, partial out tile, odd offsets: the scalar paths
    (70, 1024, 1040, 16, True),   # 16-byte paths, several tiles
    (1, 2048, 520, 64, True),     # T = 1, rank groups past KG (expand's fp32 partials)
    (33, 520, 256, 64, False),
])
def test_sgmv_cuda_kernels_run_against_references(dtype, n, in_f, out_f, R, aligned):
    dev = _cuda_device()
    if dev is None:
        pytest.skip("no CUDA GPU visible")
    import ml_dtypes

    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(n + R)
    L, M, m, layer = 2, 3, 1, 1
    ranks = [R, 3, R // 2 + 1, 1, 5][: 4 if R == 16 else 5]
    arena, slot, rank, scale, a_off, b_off = _tables(rng, n, ranks, in_f, out_f, M, m, R, L, aligned)
    arena = arena.astype(np_dt)
    x = rng.standard_normal((n, in_f)).astype(np_dt)
    mod = tvm.IRModule({
        "shrink": GC.shrink_wrapper(in_f, m, L, R, M, dtype).with_attr("global_symbol", "shrink"),
        "expand": GC.expand_wrapper(in_f, out_f, m, L, R, M, dtype).with_attr("global_symbol", "expand"),
        "tir_shrink": G.lora_sgmv_shrink_kernel(in_f, m, L, R, M, dtype, target).with_attr("global_symbol", "tir_shrink"),
        "tir_expand": G.lora_sgmv_expand_kernel(in_f, out_f, m, L, R, M, dtype, target).with_attr(
            "global_symbol", "tir_expand"),
    })
    from mlc_lora.compiler_passes import cuda_source

    mod = cuda_source.attach(mod, GC.build_module(dtype, R, "sm_90a"))
    with target:
        lib = tvm.compile(mod, target=target)

    def t(a):
        return tvm.runtime.tensor(a, dev)

    C = G.num_chunks(in_f)
    args = [t(arena), t(slot), t(rank)]
    out = {}
    for pre in ("", "tir_"):
        v = t(np.full((n, C, R), 9.0, np.float32))
        y = t(np.full((n, out_f), 7.0, np_dt))
        lib[pre + "shrink"](t(x), *args, t(scale), t(a_off), layer, v)
        lib[pre + "expand"](v, *args, t(b_off), layer, y)
        out[pre] = (v.numpy(), y.numpy().astype(np.float32))
    a32 = arena.astype(np.float32)
    rv = G.lora_sgmv_shrink_ref(x.astype(np.float32), a32, layer, L, slot, rank, scale, a_off, m, R)
    rd = G.lora_sgmv_expand_ref(rv, a32, layer, L, slot, rank, b_off, m, out_f, np.float32)
    np.testing.assert_allclose(out[""][0], rv, rtol=1e-3, atol=1e-3)
    tol = 2e-2 * np.abs(rd).max()
    np.testing.assert_allclose(out[""][1], rd, rtol=2e-2, atol=tol)
    np.testing.assert_allclose(out[""][1], out["tir_"][1], rtol=2e-2, atol=tol)
    assert np.all(out[""][1][slot == -1] == 0) and np.all(out[""][1][slot == len(ranks) - 1] == 0)
    assert np.abs(rd).max() > 0.1


# ---------------------------------------------------------------------------------------------
# Without a GPU: lora_sgmv.cu itself, compiled by g++ against a CPU emulation of the CUDA
# features it uses (cuda_emu/: threads and barriers for blocks and warps), on the same launch grid.

EMU = Path(__file__).parent / "cuda_emu"


@pytest.fixture(scope="module")
def sgmv_emu(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    out_dir = tmp_path_factory.mktemp("sgmv_emu")
    built = {}

    def build(dtype, R):
        suffix = f"{GC.DTYPES[dtype]}_r{R}"
        if suffix not in built:
            exe = out_dir / f"sgmv_emu_{suffix}"
            cmd = [cxx, "-std=c++20", "-O1", "-w", "-pthread", f"-I{EMU}", f"-I{GC.SOURCE.parent}",
                   f"-DMLC_MAX_RANK={R}", f"-DMLC_SUFFIX={suffix}", "-o", str(exe), str(EMU / "sgmv_emu.cc")]
            if dtype == "bfloat16":
                cmd.append("-DMLC_BF16")
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                pytest.skip(f"g++ cannot build the emulation (needs C++20 <barrier>): {proc.stderr[-500:]}")
            built[suffix] = exe
        return built[suffix]

    return build


@pytest.mark.parametrize("dtype,n,in_f,out_f,R,aligned", [
    ("float16", 37, 1100, 603, 16, False),  # odd offsets and shapes: the scalar paths, partial tiles
    ("bfloat16", 20, 1030, 520, 64, True),  # 16-byte paths, rank groups past KG, gridDim.z splits
])
def test_cuda_source_on_cpu_emulation(sgmv_emu, tmp_path, dtype, n, in_f, out_f, R, aligned):
    import ml_dtypes

    exe = sgmv_emu(dtype, R)
    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(n)
    L, M, m, layer = 2, 3, 1, 1
    ranks = [R, 3, R // 2 + 1, 1, 5][: 4 if R == 16 else 5]
    arena, slot, rank, scale, a_off, b_off = _tables(rng, n, ranks, in_f, out_f, M, m, R, L, aligned)
    slot[:3] = slot[0]  # a tile with repeated slots
    arena = arena.astype(np_dt)
    x = rng.standard_normal((n, in_f)).astype(np_dt)
    for name, a in dict(x=x, arena=arena, slot=slot, rank=rank, scale=scale, a_off=a_off, b_off=b_off).items():
        a.tofile(tmp_path / name)
    subprocess.run([str(exe), str(tmp_path), *map(str, (n, in_f, out_f, m, M, L, len(ranks), arena.size, layer))],
                   check=True, timeout=300)
    v = np.fromfile(tmp_path / "v", np.float32).reshape(n, G.num_chunks(in_f), R)
    y = np.fromfile(tmp_path / "y", np_dt).reshape(n, out_f).astype(np.float32)
    a32 = arena.astype(np.float32)
    rv = G.lora_sgmv_shrink_ref(x.astype(np.float32), a32, layer, L, slot, rank, scale, a_off, m, R)
    rd = G.lora_sgmv_expand_ref(rv, a32, layer, L, slot, rank, b_off, m, out_f, np.float32)
    np.testing.assert_allclose(v, rv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y, rd, rtol=2e-2, atol=1e-2 * np.abs(rd).max())
    assert np.all(y[slot == -1] == 0) and np.all(y[slot == len(ranks) - 1] == 0) and np.abs(rd).max() > 0.1
