"""The rank columns route's shrink into [x | s] on hand-written CUDA (compiler_passes/ops/lora/
shrink_xs_cuda.py, shrink_xs.cu).

No GPU here: nvcc builds the real cubin, the wrapper's launch is checked, and the .cu source runs on
the CPU emulation (cuda_emu/, the MMA included) against shrink_xs_ref, which itself is checked
against linear_triton.linear_ref (the route's whole linear). On a GPU `bench_lora_fused.py
producers --xs-lib` checks it against the Triton kernel's [x | s] before timing it.
"""

import subprocess

import numpy as np
import pytest

from mlc_lora.compiler_passes.ops.lora import linear_triton as LT
from mlc_lora.compiler_passes.ops.lora import shrink_xs_cuda as SX

from ... import emu
from ....conftest import needs_cxx, needs_nvcc


def _case(rng, n, K, mods, ranks, M=4, L=3, layer=1, np_dt=np.float16):
    """Tables as the pool lays them out: adapters of `ranks` (summing to <= RANK_COLUMNS), tokens on
    random slots or none (-1), one adapter that leaves module 2 alone, unused offsets -1."""
    size, R = 60000, max(16, *ranks)
    arena = (rng.standard_normal(L * size) * 0.5).astype(np_dt)
    S = len(ranks)
    rank = np.array(ranks, np.int32)
    scale = rng.uniform(0.5, 2, (S, M)).astype(np.float32)
    scale[min(1, S - 1), 2] = 0
    a_off = (rng.integers(0, (size - K) // 8, (S, M, R)) * 8).astype(np.int32)
    a_off[np.broadcast_to(rank[:, None, None] <= np.arange(R)[None, None, :], a_off.shape)] = -1
    slot = rng.integers(-1, S, n).astype(np.int32)
    slot[:S] = np.arange(S)
    rng.shuffle(slot)
    x = rng.standard_normal((n, K)).astype(np_dt)
    return dict(arena=arena, base=layer * size, size=L * size, slot=slot, rank=rank, scale=scale, a_off=a_off, x=x,
                R=R, M=M)


def test_reference_is_the_routes_delta():
    """[x | s] times [W | the kept B columns] is the route's linear: shrink_xs_ref's s against
    linear_ref, with B columns laid out as the rank columns say (lora_fill_cols_kernel's layout)."""
    rng = np.random.default_rng(3)
    K, widths, mods, ranks = 64, (32, 16), (0, 2), [8, 4, 0, 16]
    c = _case(rng, 40, K, mods, ranks, np_dt=np.float64)
    P = len(mods)
    cols = P * LT.RANK_COLUMNS + 32
    s = SX.shrink_xs_ref(c["x"], c["arena"], c["base"], c["slot"], c["rank"], c["scale"], c["a_off"], mods, c["R"],
                         cols)
    assert (s[:, P * LT.RANK_COLUMNS:] == 0).all() and (s[c["slot"] < 0] == 0).all()
    b_off = (rng.integers(0, (60000 - 32) // 8, c["a_off"].shape) * 8).astype(np.int32)
    w = rng.standard_normal((sum(widths), K))
    jc, kc = SX.rank_columns(c["rank"], c["R"])
    w_ext = np.zeros((sum(widths), K + cols))
    w_ext[:, :K] = w
    o = 0
    for p, (m, wp) in enumerate(zip(mods, widths)):
        for col in range(LT.RANK_COLUMNS):
            j = jc[col]
            if j < len(ranks) and kc[col] < ranks[j]:
                off = c["base"] + b_off[j, m, kc[col]]
                w_ext[o:o + wp, K + p * LT.RANK_COLUMNS + col] = c["arena"][off:off + wp]
        o += wp
    y = np.concatenate([c["x"], s], axis=1) @ w_ext.T
    ref = LT.linear_ref(c["x"], w, c["arena"], c["base"], c["slot"], c["rank"], c["scale"], c["a_off"], b_off, mods,
                        widths)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)


def test_split_fills_the_gpu():
    """Splits until about TARGET_BLOCKS blocks, never past MAX_SPLIT or below MIN_WARP_STEPS input
    steps a warp."""
    assert SX.split_for(1024, 4096) == (64, 9)
    assert SX.split_for(16, 4096) == (1, 16)
    assert SX.split_for(16, 256) == (1, 2)  # 256 inputs: 16 steps, 4 warps x 2 steps
    assert SX.split_for(4096, 11008) == (256, 3)
    assert SX.split_for(1, 64) == (1, 1)


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_builds_to_cubin_for_sm90(cubin_cache, dtype):
    """nvcc builds the three kernels (1-3 parts); the wrapper launches the one of its parts over
    (tiles, splits) blocks of THREADS threads."""
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    SX.build_module(dtype, "sm_90a")
    script = SX.wrapper(4096, 128, (0, 1, 2), 32, 16, 7, dtype).script()
    assert f'T.call_packed("{SX.kernel_name(dtype, 3)}"' in script
    with pytest.raises(ValueError, match="columns beside x"):
        SX.wrapper(4096, 64, (0, 1, 2), 32, 16, 7, dtype)
    with pytest.raises(ValueError, match="parts"):
        SX.wrapper(4096, 160, (0, 1, 2, 3), 32, 16, 7, dtype)


@pytest.fixture(scope="module")
def shrink_emu(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("shrink_xs_emu")

    def build(dtype):
        defines = {"MLC_RANK_COLUMNS": LT.RANK_COLUMNS, "MLC_SLOT_COLUMNS": LT.SLOT_COLUMNS}
        return emu.build("shrink_xs_emu.cc", out_dir / f"shrink_xs_emu_{dtype}", SX.SOURCE, dtype, defines)

    return build


@needs_cxx
@pytest.mark.parametrize("dtype,n,K,mods,ranks,split", [
    ("float16", 21, 256, (0, -1, 2), [8, 4, 0, 16], 1),   # three parts, one uncovered; a partial tile
    ("float16", 40, 320, (0, 2), [8, 8, 8, 8], 3),        # 4 x r8; uneven splits summed by the last block
    ("bfloat16", 33, 256, (3,), [32], 2),                 # one adapter of rank 32: every column
    ("float16", 16, 64, (1, 2, 3), [3, 5, 7], 1),         # ranks off the MMA's 8-column tiles
])
def test_cuda_source_on_cpu_emulation(shrink_emu, tmp_path, dtype, n, K, mods, ranks, split):
    """shrink_xs.cu on the CPU emulation equals shrink_xs_ref: s beside x (x untouched), zeros for
    tokens without an adapter, for columns of other slots and in the padding (over NaN), the
    counters left at 0."""
    import ml_dtypes

    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(n * K)
    c = _case(rng, n, K, mods, ranks, np_dt=np_dt)
    P = len(mods)
    cols = P * LT.RANK_COLUMNS + 32
    KE = K + cols
    xe = np.full((n, KE), np.nan, np.float32).astype(np_dt)
    xe[:, :K] = c["x"]
    for name in ("arena", "slot", "rank", "scale", "a_off"):
        c[name].tofile(tmp_path / name)
    xe.tofile(tmp_path / "xe")
    ms = list(mods) + [-1] * (3 - P)
    exe = shrink_emu(dtype)
    args = [n, len(ranks), K, KE, c["M"], c["R"], P, *ms, split, c["size"], c["base"]]
    proc = subprocess.run([str(exe), str(tmp_path), *map(str, args)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    got = np.fromfile(tmp_path / "xe", dtype=np_dt).reshape(n, KE)
    assert not np.fromfile(tmp_path / "cnt", dtype=np.int32).any()
    assert np.array_equal(got[:, :K].astype(np.float32), c["x"].astype(np.float32))
    ref = SX.shrink_xs_ref(c["x"], c["arena"].astype(np.float64), c["base"], c["slot"], c["rank"], c["scale"],
                           c["a_off"], mods, c["R"], cols)
    s = got[:, K:].astype(np.float64)
    assert np.isfinite(s).all()
    assert (s[ref == 0] == 0).all()  # other slots' columns, no adapter, the padding: exact zeros
    tol = 8e-3 if dtype == "float16" else 3e-2
    np.testing.assert_allclose(s, ref, rtol=tol, atol=tol * np.abs(ref).max())
    assert np.abs(ref).max() > 1.0


@needs_nvcc
def test_route_launches_it_with_xs_kernel_cuda(cubin_cache, monkeypatch):
    """With linear_triton.XS_KERNEL = "cuda" the rank columns route's wrapper launches this kernel
    (its parts' one) after x's producer, where the Triton shrink ran, with the route's scratch and
    counters; the kernels' module rides with the wrapper's."""
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    monkeypatch.setattr(LT, "XS_KERNEL", "cuda")
    fn, mods = LT.linear_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 8, "sm_90a",
                                 w_cols=4096 + 128, producer="rms_norm", eps=1e-5)
    script = fn.script()
    assert "shrink_xs_fp16" not in script  # (the Triton kernel's name)
    call = next(ln for ln in script.splitlines() if f'T.call_packed("{SX.kernel_name("float16", 3)}"' in ln)
    assert "xe.data, v.data, cnt.data" in call and ", 4096, 4224, 7, 16, 0, 1, 2," in call
    lines = script.splitlines()
    order = [i for i, ln in enumerate(lines) if "rms_norm_fp16" in ln and "LDO4224" in ln or SX.kernel_name(
        "float16", 3) in ln or "cublas_gemm" in ln]
    assert len(order) == 3 and order == sorted(order)
    assert len(mods) == 6
