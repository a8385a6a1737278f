"""Stage 3 on hand-written CUDA (compiler_passes/ops/lora/sgmv_cuda.py, sgmv.cu).

No GPU here: nvcc builds the real cubin, the wrappers' signatures are checked, and the .cu source
runs on a CPU emulation against the numpy references. On a GPU the kernels run against the
references and the TIR kernels (test_sgmv_cuda_kernels_run_against_references,
scripts/bench_lora_kernels.py). LoraRewrite inserting them: tests/python/compiler/passes/.
"""

import subprocess

import numpy as np
import pytest
import tvm

from mlc_lora.compiler_passes.ops import cuda_build
from mlc_lora.compiler_passes.ops.kernel_attrs import OPAQUE
from mlc_lora.compiler_passes.ops.lora import reference as lora_ref
from mlc_lora.compiler_passes.ops.lora import sgmv_cuda as GC
from mlc_lora.compiler_passes.ops.lora import sgmv_tir as G

from ... import emu
from ....conftest import needs_cxx, needs_nvcc


@pytest.fixture(scope="module")
def cuda():
    """The CUDA target with TVM's CUDA codegen loaded (tests using it carry needs_nvcc)."""
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
    """The shrink takes the TIR shrink's inputs with the token order after the slots and a parts
    axis in v; the expand takes v, the tables and y (n, W) in place of the TIR expand's delta."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    shrink = GC.shrink_wrapper(4096, (0, -1, 2), 32, 64, 7, dtype)
    expand = GC.expand_wrapper(4096, (4096, 1024, 1024), (0, -1, 2), 32, 64, 7, dtype)
    tir_shrink = _signature(G.lora_sgmv_shrink_kernel(4096, 3, 32, 64, 7, dtype, target))
    sig = _signature(shrink)
    assert sig[:3] + sig[4:-1] == tir_shrink[:-1] and sig[3] == ("(n,)", "int32")
    assert sig[-1] == ("(n, 3, 8, 64)", "float32")
    sig = _signature(expand)
    assert sig[0] == ("(n, 3, 8, 64)", "float32") and sig[3] == ("(n,)", "int32") and sig[5] == ("(S, 7)", "float32")
    assert sig[6] == ("(S, 7, 64)", "int32") and sig[-1] == ("(n, 6144)", dtype)
    for f in (shrink, expand):
        assert int(f.attrs["op_pattern"]) == OPAQUE and f.attrs["tirx.is_scheduled"]
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
# On a GPU: the kernels against the numpy references (and the TIR CUDA kernels).


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
    rv = lora_ref.sgmv_parts_shrink_ref(x.astype(np.float32), a32, layer, L, slot, rank, scale, a_off, mods, R)
    zero = np.zeros((x.shape[0], sum(widths)), np.float32)
    return rv, lora_ref.sgmv_parts_expand_ref(zero, rv, a32, layer, L, slot, rank, scale, b_off, mods, widths)


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


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,in_f,widths,mods,R,aligned", CASES)
def test_sgmv_cuda_kernels_run_against_references(cuda_device, cuda, dtype, n, in_f, widths, mods, R, aligned):
    import ml_dtypes

    dev, target = cuda_device, cuda
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
    mod = cuda_build.attach(mod, GC.build_module(dtype, R, "sm_90a"))
    with target:
        lib = tvm.compile(mod, target=target)

    def t(a):
        return tvm.runtime.tensor(a, dev)

    C = lora_ref.num_chunks(in_f)
    v = t(np.full((n, len(mods), C, R), 9.0, np.float32))
    y = t(y0)
    order = t(lora_ref.sort_tokens_ref(slot, len(ranks))[0])  # the pool's tiling order
    lib["shrink"](t(x), t(arena), t(slot), order, t(rank), t(scale), t(a_off), layer, v)
    lib["expand"](v, t(arena), t(slot), order, t(rank), t(scale), t(b_off), layer, y)
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
# Without a GPU: sgmv.cu itself, compiled by g++ against a CPU emulation of the CUDA
# features it uses (cuda_emu/: threads and barriers for blocks and warps), on the same launch grid.

@pytest.fixture(scope="module")
def sgmv_emu(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sgmv_emu")

    def build(dtype, R):
        suffix = f"{GC.DTYPES[dtype]}_r{R}"
        return emu.build("sgmv_emu.cc", out_dir / f"sgmv_emu_{suffix}", GC.SOURCE, dtype,
                         GC.defines_for(dtype, R))

    return build


@needs_cxx
@pytest.mark.parametrize("dtype,case,tiling", [("float16", CASES[0], "sorted"), ("bfloat16", CASES[3], "sorted"),
                                               ("float16", CASES[4], "sorted"), ("float16", CASES[1], "shuffled"),
                                               ("float16", CASES[0], "identity")])
def test_cuda_source_on_cpu_emulation(sgmv_emu, tmp_path, dtype, case, tiling):
    """Odd offsets and shapes (scalar paths, partial tiles); 16-byte paths, rank groups past KG,
    gridDim.z splits, three parts with one uncovered, out tiles ending mid-part. The blocks tile
    the tokens along `order`: the pool's (sorted by slot, base-model tokens last; tiles straddle
    slots), a random permutation or the identity all give the references' results."""
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
    order = {"sorted": lora_ref.sort_tokens_ref(slot, len(ranks))[0], "shuffled": rng.permutation(n),
             "identity": np.arange(n)}[tiling].astype(np.int32)
    for name, a in dict(x=x, arena=arena, slot=slot, order=order, rank=rank, scale=scale, a_off=a_off, b_off=b_off,
                        y=y0).items():
        a.tofile(tmp_path / name)
    P = len(mods)
    ms, ws = list(mods) + [-1] * (3 - P), list(widths) + [0] * (3 - P)
    subprocess.run([str(exe), str(tmp_path), *map(str, (n, in_f, M, L, len(ranks), arena.size, layer, P, *ms, *ws))],
                   check=True, timeout=600)
    v = np.fromfile(tmp_path / "v", np.float32).reshape(n, P, lora_ref.num_chunks(in_f), R)
    y = np.fromfile(tmp_path / "y", np_dt).reshape(n, sum(widths))
    np.testing.assert_allclose(v, rv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y.astype(np.float32), ry, rtol=2e-2, atol=1e-2 * np.abs(delta).max())
    untouched = (slot == -1) | (slot == len(ranks) - 1)
    assert np.array_equal(y[untouched], y0[untouched]) and np.abs(delta).max() > 0.1
    if mods[0] >= 0 and P > 1:  # the part-0-only slot leaves the other parts alone
        w0 = widths[0]
        assert np.array_equal(y[3, w0:], y0[3, w0:]) and not np.array_equal(y[3, :w0], y0[3, :w0])
