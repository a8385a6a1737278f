"""Stage 3 on hand-written CUDA (compiler_passes/lora_sgmv_cuda.py, cuda/lora_sgmv.cu).

No GPU here: nvcc builds the real cubin, the wrappers' signatures are checked, LoraRewrite on a
cuda target is checked Before/After (one shrink and one in-place expand per fused linear, the
module attached), and the .cu source runs on a CPU emulation against the numpy references. On a
GPU the kernels run against the references and the TIR kernels
(test_sgmv_cuda_kernels_run_against_references, scripts/bench_lora_kernels.py).
"""

import shutil
import subprocess

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

from . import emu

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
def test_wrapper_signatures(dtype):
    """The shrink takes the TIR shrink's inputs with a parts axis in v; the expand takes v, the
    tables and y (n, W) in place of the TIR expand's delta."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    shrink = GC.shrink_wrapper(4096, (0, -1, 2), 32, 64, 7, dtype)
    expand = GC.expand_wrapper(4096, (4096, 1024, 1024), (0, -1, 2), 32, 64, 7, dtype)
    tir_shrink = _signature(G.lora_sgmv_shrink_kernel(4096, 3, 32, 64, 7, dtype, target))
    assert _signature(shrink)[:-1] == tir_shrink[:-1]
    assert _signature(shrink)[-1] == ("(n, 3, 8, 64)", "float32")
    sig = _signature(expand)
    assert sig[0] == ("(n, 3, 8, 64)", "float32") and sig[4] == ("(S, 7)", "float32")
    assert sig[5] == ("(S, 7, 64)", "int32") and sig[-1] == ("(n, 6144)", dtype)
    for f in (shrink, expand):
        assert int(f.attrs["op_pattern"]) == K.OPAQUE and f.attrs["tirx.is_scheduled"]
    with pytest.raises(ValueError, match="4 parts"):
        GC.shrink_wrapper(4096, (0, 1, 2, 3), 32, 64, 7, dtype)
    with pytest.raises(ValueError, match="2 widths for 3 parts"):
        GC.expand_wrapper(4096, (1, 2), (0, 1, 2), 32, 64, 7, dtype)


def test_supported_says_why_not():
    assert GC.supported("float16", 16) is None and GC.supported("bfloat16", 128) is None
    assert "float32" in GC.supported("float32", 16)
    assert "max rank 256" in GC.supported("float16", 256)
    assert "4 parts" in GC.supported("float16", 16, 4)
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
    from mlc_lora.contract import LORA_MODULES
    from mlc_lora.lora.layout import LoraModule, layout_adapter

    shapes = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
              "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
    E = 2 * 8 * 16 * 128
    for rank in (8, 16, 64):
        lay = layout_adapter(E, [LoraModule(n, *shapes[n]) for n in LORA_MODULES], rank)
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
               lora_b_off: R.Tensor(("s", 1, 16), "int32"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 7})
        b = T.int64()
        cls = ExpectedTir
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
               lora_b_off: R.Tensor(("s", 1, 16), "int32"), params: R.Tuple(R.Tensor((600, 1024), "float16"))):
        R.func_attr({"num_input": 7})
        b = T.int64()
        cls = ExpectedCuda
        with R.dataflow():
            w = params[0]
            y = R.matmul(x, R.permute_dims(w))
            x2 = R.reshape(x, R.shape([b, 1024]))
            v = R.call_tir(cls.lora_sgmv_shrink_m0_1024, (x2, lora_arena, lora_token_slot, lora_rank, lora_scale,
                           lora_a_off, R.prim_value(T.int64(0))), out_ty=R.Tensor((b, 1, 2, 16), "float32"))
            y2 = R.reshape(y, R.shape([b, 600]))
            y3 = R.call_tir_inplace(cls.lora_sgmv_expand_m0_1024x600, (v, lora_arena, lora_token_slot, lora_rank,
                                    lora_scale, lora_b_off, R.prim_value(T.int64(0)), y2), [7],
                                    R.Tensor((b, 600), "float16"))
            gv = R.reshape(y3, R.shape([b, 1, 600]))
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
    on_cuda = backend != "tir"
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
    before = Before.script().replace("600", "1600")
    names = ["model.layers.0.self_attn.qkv_proj.weight"]
    after = LoraRewrite(param_names=names, modules=[("q_proj", 1024, 1024), ("v_proj", 1024, 288)],
                        linears={"qkv_proj": [("q_proj", 0, 1024), ("k_proj", 1024, 1312), ("v_proj", 1312, 1600)]},
                        num_layers=1, max_rank=16, kernel="sgmv", arena_elems=4096, functions=["decode"],
                        target=cuda)(tvm.script.from_source(before))
    text = after["decode"].script()
    assert text.count("R.call_tir(") == 1 and text.count("R.call_tir_inplace(") == 1
    assert "R.add" not in text and "R.concat" not in text
    assert "lora_sgmv_shrink_m0_x_1_1024" in text and "lora_sgmv_expand_m0_x_1_1024x1600" in text
    assert 'R.Tensor((b, 3, 2, 16), dtype="float32")' in text


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


def _tables(rng, n, ranks, in_f, widths, M, mods, R, L, aligned):
    """Rows at random places of an L-layer arena (8-element aligned or not), tokens on random
    slots or -1 in random order; the last slot targets no part (scale 0, offsets -1) and the one
    before it only part 0."""
    S = len(ranks)
    rows = sum(ranks) * sum(in_f + w for w in widths)
    per_layer = rows + 64 * sum(ranks) * 2 * len(widths) + 64
    per_layer += -per_layer % 8
    arena = (rng.standard_normal(L * per_layer) * 0.5).astype(np.float32)
    a_off = np.full((S, M, R), -1, np.int32)
    b_off = np.full((S, M, R), -1, np.int32)
    scale = rng.uniform(0.5, 2.0, (S, M)).astype(np.float32)
    pos = 8
    for s, r in enumerate(ranks):
        for p, (m, w) in enumerate(zip(mods, widths)):
            if m < 0:
                continue
            if s == S - 1 or (s == S - 2 and p > 0):
                scale[s, m] = 0.0
                continue
            for k in range(r):
                for tab, length in ((a_off, in_f), (b_off, w)):
                    pos += 8 * int(rng.integers(0, 4)) if aligned else int(rng.integers(0, 8))
                    tab[s, m, k] = pos
                    pos += length
    assert pos <= per_layer
    slot = rng.integers(-1, S, n).astype(np.int32)
    return arena, slot, np.asarray(ranks, np.int32), scale, a_off, b_off


def _refs(x, arena, layer, L, slot, rank, scale, a_off, b_off, mods, widths, R):
    """v and the deltas of the references (float32)."""
    a32 = arena.astype(np.float32)
    rv = GC.sgmv_parts_shrink_ref(x.astype(np.float32), a32, layer, L, slot, rank, scale, a_off, mods, R)
    zero = np.zeros((x.shape[0], sum(widths)), np.float32)
    return rv, GC.sgmv_parts_expand_ref(zero, rv, a32, layer, L, slot, rank, scale, b_off, mods, widths)


def _base_output(rng, delta, np_dt):
    """y before the expand, as large as the deltas: an expand that dropped it would fail."""
    return (rng.standard_normal(delta.shape) * np.abs(delta).max()).astype(np_dt)


# (n, in_f, widths, mods, R, aligned): single parts and q|k|v-like triples with an untargeted part
CASES = [
    (37, 1100, (603,), (1,), 16, False),             # partial chunk and out tile, odd offsets: scalar paths
    (70, 1024, (1040,), (1,), 16, True),             # 16-byte paths, several tiles
    (1, 2048, (520, 136, 136), (0, 2, 1), 64, True),  # T = 1, three parts, rank groups past KG
    (33, 520, (256, 72, 72), (2, -1, 0), 64, False),  # a part no module covers
    (20, 1030, (520, 1000), (1, 0), 64, True),        # gate|up-like, out tiles ending mid-part
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,in_f,widths,mods,R,aligned", CASES)
def test_sgmv_cuda_kernels_run_against_references(dtype, n, in_f, widths, mods, R, aligned):
    dev = _cuda_device()
    if dev is None:
        pytest.skip("no CUDA GPU visible")
    import ml_dtypes

    from mlc_lora.compile import prepare_cuda_build
    from mlc_lora.compiler_passes import cuda_source

    prepare_cuda_build()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(n + R)
    L, M, layer = 2, 3, 1
    ranks = [R, 3, R // 2 + 1, 1, 5][: 4 if R == 16 else 5]
    arena, slot, rank, scale, a_off, b_off = _tables(rng, n, ranks, in_f, widths, M, mods, R, L, aligned)
    arena = arena.astype(np_dt)
    x = rng.standard_normal((n, in_f)).astype(np_dt)
    rv, delta = _refs(x, arena, layer, L, slot, rank, scale, a_off, b_off, mods, widths, R)
    y0 = _base_output(rng, delta, np_dt)
    ry = y0.astype(np.float32) + delta
    funcs = {"shrink": GC.shrink_wrapper(in_f, mods, L, R, M, dtype),
             "expand": GC.expand_wrapper(in_f, widths, mods, L, R, M, dtype)}
    for p, m in enumerate(mods):  # the TIR stage 3 of each part
        if m >= 0:
            funcs[f"tir_shrink{p}"] = G.lora_sgmv_shrink_kernel(in_f, m, L, R, M, dtype, target)
            funcs[f"tir_expand{p}"] = G.lora_sgmv_expand_kernel(in_f, widths[p], m, L, R, M, dtype, target)
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    mod = cuda_source.attach(mod, GC.build_module(dtype, R, "sm_90a"))
    with target:
        lib = tvm.compile(mod, target=target)

    def t(a):
        return tvm.runtime.tensor(a, dev)

    C = G.num_chunks(in_f)
    v = t(np.full((n, len(mods), C, R), 9.0, np.float32))
    y = t(y0)
    lib["shrink"](t(x), t(arena), t(slot), t(rank), t(scale), t(a_off), layer, v)
    lib["expand"](v, t(arena), t(slot), t(rank), t(scale), t(b_off), layer, y)
    np.testing.assert_allclose(v.numpy(), rv, rtol=1e-3, atol=1e-3)
    got = y.numpy().astype(np.float32)
    tol = 2e-2 * np.abs(delta).max()
    np.testing.assert_allclose(got, ry, rtol=2e-2, atol=tol)
    # the TIR kernels, part by part, give the same deltas (their zeros for untargeted tokens
    # included: the CUDA expand leaves those rows of y alone)
    o = 0
    for p, (m, w) in enumerate(zip(mods, widths)):
        if m >= 0:
            on = np.where((slot >= 0) & (scale[np.maximum(slot, 0), m] != 0), slot, -1).astype(np.int32)
            vp = t(np.zeros((n, C, R), np.float32))
            dp = t(np.zeros((n, w), np_dt))
            lib[f"tir_shrink{p}"](t(x), t(arena), t(on), t(rank), t(scale), t(a_off), layer, vp)
            lib[f"tir_expand{p}"](vp, t(arena), t(on), t(rank), t(b_off), layer, dp)
            np.testing.assert_allclose(got[:, o:o + w] - y0[:, o:o + w].astype(np.float32),
                                       dp.numpy().astype(np.float32), rtol=3e-2, atol=2 * tol)
        o += w
    untouched = (slot == -1) | (slot == len(ranks) - 1)
    assert np.array_equal(y.numpy()[untouched], y0[untouched])
    assert np.abs(delta).max() > 0.1


# ---------------------------------------------------------------------------------------------
# Without a GPU: lora_sgmv.cu itself, compiled by g++ against a CPU emulation of the CUDA
# features it uses (cuda_emu/: threads and barriers for blocks and warps), on the same launch grid.

@pytest.fixture(scope="module")
def sgmv_emu(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sgmv_emu")

    def build(dtype, R):
        suffix = f"{GC.DTYPES[dtype]}_r{R}"
        return emu.build("sgmv_emu.cc", out_dir / f"sgmv_emu_{suffix}", dtype,
                         {"MLC_MAX_RANK": R, "MLC_SUFFIX": suffix})

    return build


@pytest.mark.parametrize("dtype,case", [("float16", CASES[0]), ("bfloat16", CASES[3]), ("float16", CASES[4])])
def test_cuda_source_on_cpu_emulation(sgmv_emu, tmp_path, dtype, case):
    """Odd offsets and shapes (scalar paths, partial tiles); 16-byte paths, rank groups past KG,
    gridDim.z splits, three parts with one uncovered, out tiles ending mid-part."""
    import ml_dtypes

    n, in_f, widths, mods, R, aligned = case
    exe = sgmv_emu(dtype, R)
    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(n)
    L, M, layer = 2, 3, 1
    ranks = [R, 3, R // 2 + 1, 1, 5][: 4 if R == 16 else 5]
    arena, slot, rank, scale, a_off, b_off = _tables(rng, n, ranks, in_f, widths, M, mods, R, L, aligned)
    slot[:3] = slot[0]  # a tile with repeated slots
    slot[3] = len(ranks) - 2  # a slot that targets part 0 only
    arena = arena.astype(np_dt)
    x = rng.standard_normal((n, in_f)).astype(np_dt)
    rv, delta = _refs(x, arena, layer, L, slot, rank, scale, a_off, b_off, mods, widths, R)
    y0 = _base_output(rng, delta, np_dt)
    ry = y0.astype(np.float32) + delta
    for name, a in dict(x=x, arena=arena, slot=slot, rank=rank, scale=scale, a_off=a_off, b_off=b_off, y=y0).items():
        a.tofile(tmp_path / name)
    P = len(mods)
    ms, ws = list(mods) + [-1] * (3 - P), list(widths) + [0] * (3 - P)
    subprocess.run([str(exe), str(tmp_path), *map(str, (n, in_f, M, L, len(ranks), arena.size, layer, P, *ms, *ws))],
                   check=True, timeout=600)
    v = np.fromfile(tmp_path / "v", np.float32).reshape(n, P, G.num_chunks(in_f), R)
    y = np.fromfile(tmp_path / "y", np_dt).reshape(n, sum(widths))
    np.testing.assert_allclose(v, rv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y.astype(np.float32), ry, rtol=2e-2, atol=1e-2 * np.abs(delta).max())
    untouched = (slot == -1) | (slot == len(ranks) - 1)
    assert np.array_equal(y[untouched], y0[untouched]) and np.abs(delta).max() > 0.1
    if mods[0] >= 0 and P > 1:  # the part-0-only slot leaves the other parts alone
        w0 = widths[0]
        assert np.array_equal(y[3, w0:], y0[3, w0:]) and not np.array_equal(y[3, :w0], y0[3, :w0])
