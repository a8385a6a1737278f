"""Stage 3 on tensor cores (ops/lora/sgmv_triton.py): the Triton kernels run on the CPU under
Triton's interpreter against the numpy references, and build to cubin for sm_90a here."""

from __future__ import annotations

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from mlc_lora.compiler_passes.ops.lora import sgmv_triton as ST  # noqa: E402

from .conftest import interpret  # noqa: E402


def _interpret(tmp_path, **inp):
    """The kernels' outputs under Triton's interpreter, in a process of its own (triton_interp.py)."""
    out = interpret(tmp_path, **inp)
    return out["v"], out["y"], out["tiles"]


def _case(rng, dtype, n, S, K, widths, mods, R, M=4):
    layer_size, L = 50000, 3
    arena = (rng.standard_normal(L * layer_size) * 0.5).astype(dtype)
    base = layer_size
    rank = rng.integers(1, R + 1, S).astype(np.int32)
    rank[0] = R
    scale = rng.uniform(0.5, 2, (S, M)).astype(np.float32)
    scale[min(1, S - 1), max(m for m in mods)] = 0  # an adapter that leaves a part alone
    a_off = (rng.integers(0, (layer_size - K) // 8, (S, M, R)) * 8).astype(np.int32)
    b_off = (rng.integers(0, (layer_size - max(widths)) // 8, (S, M, R)) * 8).astype(np.int32)
    slot = rng.integers(-1, S, n).astype(np.int32)
    slot[:S] = np.arange(S)  # slots numbered by first appearance, every one used (as the pool does)
    rng.shuffle(slot)
    x = rng.standard_normal((n, K)).astype(dtype)
    y = rng.standard_normal((n, sum(widths))).astype(dtype)
    return arena, base, rank, scale, a_off, b_off, slot, x, y


# tile configurations besides each variant's own: several output tiles per expand block with a
# partial last group and tile (BN 16, G 2 over widths 72 | 24 | 40), an input of whole BK steps
# (the unmasked loads) over uneven splits, a grid of fewer blocks than tiles (each block takes
# several, as when more slots are used than GRID_SLOTS), the shrink's rank rows over two blocks, and
# dot steps of 128 inputs (whole steps, and a masked last one), and a batch of tiles too few for
# the GPU taking more splits than SPLITS (of MIN_STEPS steps, uneven) with output groups regrouped
# (G 4 -> GMIN 1), alone, over a grid of one block, with the rank rows over two blocks, and with
# regrouping off (GMIN = G)
CONFIGS = {"own": (300, {}), "groups": (300, dict(BN=16, G=2, SPLITS=2)), "even": (320, dict(SPLITS=3, BN=32, G=3)),
           "loop": (300, dict(grid_slots=1)), "ranks": (300, dict(RSPLIT=2, SPLITS=2)),
           "bk": (512, dict(BK=128, SPLITS=3)), "bk-tail": (300, dict(BK=128, SPLITS=2)),
           "fill": (700, dict(SPLITS=2, MIN_STEPS=2, BN=16, G=4, GMIN=1)),
           "fill-loop": (700, dict(SPLITS=2, MIN_STEPS=3, BK=64, BN=16, G=4, GMIN=1, grid_slots=1)),
           "fill-ranks": (700, dict(SPLITS=2, MIN_STEPS=2, RSPLIT=2, BN=16, G=2, GMIN=2))}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("variant", list(ST.VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kernels_match_references(tmp_path, variant, dtype, config):
    rng = np.random.default_rng(7)
    widths, mods, R = (72, 24, 40), (0, -1, 2), 32  # q|k|v with k untargeted
    K, override = CONFIGS[config]
    n = 90 if variant == "large" else 37
    arena, base, rank, scale, a_off, b_off, slot, x, y = _case(rng, dtype, n, 6, K, widths, mods, R)
    S, cap = len(rank), 9
    order, start = ST.sort_tokens_ref(slot, S)
    start = np.concatenate([start, np.full(cap - S, start[-1], np.int32)])  # padded to the capacity
    v, got, tiles = _interpret(tmp_path, variant=variant, x=x, arena=arena, rank=rank, scale=scale, order=order, start=start,
                        mods=np.array(mods), widths=np.array(widths), base=base, R=R, a_off=a_off, b_off=b_off, y=y,
                        **override)
    cfg = dict(ST.VARIANTS[variant], **{k: v for k, v in override.items() if k != "grid_slots"})
    # the tile table the kernels read: the reference's, nothing written past it
    want = ST.tiles_ref(start, cfg["BM"])
    assert np.array_equal(tiles[:len(want)], want) and (tiles[len(want):] == -7).all()
    consts = ST.constants("shrink", variant, K, mods, None, R, 4, 9, 8, cfg)[0]
    C = ST.splits_for(int(tiles[0]), K, variant, consts["UNITS"], cfg)  # this batch's splits, as the kernels chose
    bk = ST.step_elems(variant, cfg)
    chunk = -(-(-(-K // bk)) // C) * bk
    assert v.shape[2] == consts["CMAX"] >= C > 1 and (C - 1) * chunk < K <= C * chunk
    if config.startswith("fill"):  # few tiles: more splits than SPLITS, output groups of GMIN
        assert C > ST.num_chunks(K, variant, cfg), (C, ST.num_chunks(K, variant, cfg))
        assert ST.groups_for(int(tiles[0]), widths, variant, cfg) == cfg["GMIN"] < cfg["G"] or config == "fill-ranks"
    assert np.isnan(v[:, :, C:]).all()  # splits past the batch's are never written
    v_ref = ST.shrink_ref(x, arena, base, order, start, rank, scale, a_off, mods, R, chunk)
    written = ~np.isnan(v)
    # every entry the expand reads was written, and equals the reference
    for s in range(len(rank)):
        for p in range(start[s], start[s + 1]):
            for part, m in enumerate(mods):
                if m >= 0 and scale[s, m] != 0:
                    assert written[p, part, :, :rank[s]].all()
    tol = 1e-5 if dtype == np.float32 else 3e-3
    np.testing.assert_allclose(np.where(written, v, 0), v_ref, rtol=tol, atol=tol * np.abs(v_ref).max())
    ref = ST.expand_ref(y, v_ref, arena, base, order, start, rank, scale, b_off, mods, widths)
    delta, delta_ref = got.astype(np.float64) - y, ref - y
    assert np.linalg.norm(delta - delta_ref) / np.linalg.norm(delta_ref) < tol
    base_rows = slot < 0
    assert np.array_equal(got[base_rows], y[base_rows])  # base-model tokens untouched
    assert np.array_equal(got[:, 72:96], y[:, 72:96])  # the untargeted part untouched


def _int8_case(rng, dtype, S, K, widths, mods, R, M=4):
    """_case's tables over an arena of int8 rows (contract.ROW_FORMATS) at places of their own, NaN
    around them; returns (arena, the float32 arena of the values it stands for, base, rank, scale, a_off,
    b_off)."""
    from mlc_lora.compiler_passes.ops.lora.reference import int8_rows_as_model_ref
    from mlc_lora.contract import INT8_ROW_ALIGN
    from mlc_lora.lora.layout import int8_row_bytes

    eb = np.dtype(dtype).itemsize
    lead, step = INT8_ROW_ALIGN // eb, -(-(INT8_ROW_ALIGN // eb + max(K, *widths)) // 8) * 8
    rank = rng.integers(1, R + 1, S).astype(np.int32)
    rank[0] = R
    scale = rng.uniform(0.5, 2, (S, M)).astype(np.float32)
    scale[min(1, S - 1), max(mods)] = 0
    a_off = np.zeros((S, M, R), np.int32)  # past rank, untargeted: never read
    b_off = np.zeros((S, M, R), np.int32)
    wanted = [(s, m, k) for s in range(S) for m in mods if m >= 0 and scale[s, m] != 0 for k in range(rank[s])]
    places = iter(rng.permutation(2 * len(wanted)))
    layer_size = 2 * len(wanted) * step + step
    L, base = 3, layer_size
    arena = np.full(L * layer_size, np.nan, dtype)
    raw, rows = arena.view(np.uint8), []
    for s, m, k in wanted:
        for offs, width in ((a_off, K), (b_off, widths[list(mods).index(m)])):
            offs[s, m, k] = next(places) * step + lead
            w = rng.standard_normal(width).astype(np.float32) * rng.uniform(0.1, 2)
            at = (base + int(offs[s, m, k])) * eb
            row = int8_row_bytes(w[None])[0]
            raw[at - INT8_ROW_ALIGN:at - INT8_ROW_ALIGN + row.size] = row
            rows.append((base + int(offs[s, m, k]), width))
    return arena, int8_rows_as_model_ref(arena, rows, INT8_ROW_ALIGN), base, rank, scale, a_off, b_off


@pytest.mark.parametrize("variant", list(ST.VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kernels_read_int8_rows(tmp_path, variant, dtype):
    """int8 rows: the kernels over an arena of int8 rows with their scales (NaN around them) match
    the references on the values the rows stand for, and the same kernels over those values in
    the model dtype (which round them; the int8 kernels scale the products)."""
    rng = np.random.default_rng(11)
    widths, mods, R = (72, 24, 40), (0, -1, 2), 32
    n, K, S, cap = (90 if variant == "large" else 37), 300, 6, 9
    arena8, model, base, rank, scale, a_off, b_off = _int8_case(rng, dtype, S, K, widths, mods, R)
    slot = rng.integers(-1, S, n).astype(np.int32)
    slot[:S] = np.arange(S)
    rng.shuffle(slot)
    x = rng.standard_normal((n, K)).astype(dtype)
    y = rng.standard_normal((n, sum(widths))).astype(dtype)
    order, start = ST.sort_tokens_ref(slot, S)
    start = np.concatenate([start, np.full(cap - S, start[-1], np.int32)])
    common = dict(variant=variant, x=x, rank=rank, scale=scale, order=order, start=start, mods=np.array(mods),
                  widths=np.array(widths), base=base, R=R, a_off=a_off, b_off=b_off, y=y)
    v8, y8, _ = _interpret(tmp_path, arena=arena8, rows="int8", **common)
    vm, ym, tiles = _interpret(tmp_path, arena=model.astype(dtype), **common)
    tol = 1e-5 if dtype == np.float32 else 3e-3
    written = ~np.isnan(v8)
    assert np.array_equal(written, ~np.isnan(vm))
    np.testing.assert_allclose(v8[written], vm[written], rtol=tol, atol=tol * np.abs(vm[written]).max())
    assert np.linalg.norm(y8.astype(np.float64) - ym) / np.linalg.norm(ym.astype(np.float64) - y) < tol
    cfg = ST.VARIANTS[variant]
    C = ST.splits_for(int(tiles[0]), K, variant, ST.constants("shrink", variant, K, mods, None, R, 4, cap, 8)[0]["UNITS"])
    chunk = -(-(-(-K // ST.step_elems(variant))) // C) * ST.step_elems(variant)
    v_ref = ST.shrink_ref(x, model, base, order, start, rank, scale, a_off, mods, R, chunk)
    np.testing.assert_allclose(np.where(written, v8, 0), v_ref, rtol=tol, atol=tol * np.abs(v_ref).max())
    ref = ST.expand_ref(y, v_ref, model, base, order, start, rank, scale, b_off, mods, widths)
    delta, delta_ref = y8.astype(np.float64) - y, ref - y
    assert np.isfinite(y8).all() and np.linalg.norm(delta - delta_ref) / np.linalg.norm(delta_ref) < tol
    assert np.array_equal(y8[slot < 0], y[slot < 0]) and cfg["BM"] in (16, 64)


@pytest.mark.parametrize("bm", [16, 64])
def test_tile_table_matches_the_reference(tmp_path, bm):
    """Slots of 0-300 tokens (several blocks of TILE_BLOCK tiles at BM 16), unused slots between
    used ones and at the end of a 40-slot table, base-model tokens after them."""
    rng = np.random.default_rng(bm)
    counts = rng.integers(0, 300, 40) * (rng.random(40) < 0.7)
    counts[-5:] = 0
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    out = interpret(tmp_path, tiles_only=1, start=start, BM=bm, n=int(start[-1]) + 3)
    want = ST.tiles_ref(start, bm)
    assert want[0] > 2 * ST.TILE_BLOCK or bm == 64
    assert np.array_equal(out["tiles"][:len(want)], want) and (out["tiles"][len(want):] == -7).all()


def test_kernels_build_to_cubin_for_sm90(cubin_cache):
    """Both tile variants of both kernels compile here (no GPU) and become TVM CUDA modules."""
    sh, smods = ST.shrink_wrapper(4096, (0, 1, 2), 2, 16, 7, "float16", 64, 8, "sm_90a")
    ex, emods = ST.expand_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 64, 8, "sm_90a")
    ti, tmods = ST.tiles_wrapper(64, "sm_90a")
    assert len(smods) == len(emods) == len(tmods) == len(ST.VARIANTS)
    bms = {cfg["BM"] for cfg in ST.VARIANTS.values()}  # tile kernels of equal BM are one cubin
    assert len(list(cubin_cache.glob("*.cubin"))) == 2 * len(ST.VARIANTS) + len(bms)
    script = sh.script() + ex.script() + ti.script()
    for var in ST.VARIANTS:
        assert f"_BM{ST.VARIANTS[var]['BM']}_" in script  # each variant's kernel, by its constants


def test_past_256_tokens_the_tiles_follow_the_tokens_per_slot(cubin_cache):
    """Past SMALL_MAX_TOKENS the 16-row tiles run where the batch's slots average fewer than
    SMALL_SLOT_TOKENS tokens (the pool's non-graph tables hand slot_start at the batch's slots),
    and the three wrappers (tile table, shrink, expand) branch on that one condition."""
    k = ST.SMALL_SLOT_TOKENS
    assert [ST.variant_for(16, 256), ST.variant_for(200, 1), ST.variant_for(256, 1)] == ["tiny", "small", "small"]
    assert ST.variant_for(k * 64 - 1, 64) == "small" and ST.variant_for(k * 64, 64) == "large"
    assert ST.variant_for(4096, 4) == "large" and ST.variant_for(4096) == "small"
    sh, _ = ST.shrink_wrapper(4096, (0, 1, 2), 2, 16, 7, "float16", 64, 8, "sm_90a")
    ex, _ = ST.expand_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 64, 8, "sm_90a")
    ti, _ = ST.tiles_wrapper(64, "sm_90a")
    want = f"if n <= T.int64({ST.SMALL_MAX_TOKENS}) or n < T.int64({k}) * (cap1 - T.int64(1)):"
    for f in (sh, ex, ti):
        assert [ln.strip() for ln in f.script().splitlines() if "T.int64(256)" in ln] == [want]


def test_kernels_import_with_the_tvm_runtime_alone():
    """The GPU machine has TVM's runtime only (no relax, no TVMScript): the kernels and their launch
    constants import there (bench_lora_kernels.py --triton-jit runs them). Checked on the module
    level imports of sgmv_triton.py and of every mlc-lora module it imports at its top."""
    import ast  # pylint: disable=import-outside-toplevel
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    ops = Path(ST.__file__).resolve().parents[1]
    todo, seen = [Path(ST.__file__).resolve()], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.parse(f.read_text()).body:  # module level only: imports inside functions are lazy
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = f.parent if node.level == 1 else ops
                names = []
                for a in node.names:
                    mod = base / (node.module or "").replace(".", "/")
                    for cand in (mod.with_suffix(".py"), mod / f"{a.name}.py", mod / "__init__.py"):
                        if cand.is_file():
                            todo.append(cand)
                            break
                continue
            else:
                continue
            assert not [n for n in names if n.startswith(("tvm.relax", "tvm.script", "tvm.tirx"))], (f, names)
    assert {p.name for p in seen} >= {"sgmv_triton.py", "stage.py", "triton_build.py", "kernel_attrs.py"}
    c, gy = ST.constants("shrink", "large", 11008, (0,), None, 64, 1, 256, 8)
    assert (c["C"], gy, ST.grid_x(1024, 256, 64), ST.variant_for(17)) == (4, 4, 16 + 64, "small")


def test_every_variant_fits_a_block_at_the_largest_rank(cubin_cache):
    """At the largest rank the kernels take (MAX_RANK: the most rank rows per tile), every tile
    variant's shrink and expand fit the shared memory a block may take on sm_90a, which the build
    checks (a kernel past it would be refused only at its first launch on the GPU); a configuration
    past it is refused with the bytes and the limit."""
    from mlc_lora.compiler_passes.ops import triton_build

    for var in ST.VARIANTS:
        for kind in ("shrink", "expand"):
            name, _, shared, _, _ = ST.variant_kernel(kind, var, 4096, (0, 1, 2), (4096, 1024, 1024), ST.MAX_RANK,
                                                      7, "float16", 64, 8, "sm_90a")
            assert 0 < shared <= triton_build.MAX_SHARED[90], (name, shared)
    big = dict(ST.VARIANTS["large"], num_stages=4, BK=256)
    consts, _ = ST.constants("shrink", "large", 4096, (0,), None, ST.MAX_RANK, 7, 64, 8, big)
    with pytest.raises(ValueError, match=r"bytes of shared memory, more than the 232448 a block may take on sm_90"):
        ST._module("shrink", "float16", consts, big, "sm_90a")  # pylint: disable=protected-access


def test_int8_row_kernels_build_to_cubin_for_sm90(cubin_cache):
    """The int8-row kernels of every variant compile here (no GPU), fp16 and bf16, apart from the
    model-dtype ones (their own cubins)."""
    for dtype in ("float16", "bfloat16"):
        before = set(cubin_cache.glob("*.cubin"))
        ST.shrink_wrapper(4096, (0, 1, 2), 2, 64, 7, dtype, 64, 8, "sm_90a", "int8")
        ST.expand_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 64, 7, dtype, 64, 8, "sm_90a", "int8")
        assert len(set(cubin_cache.glob("*.cubin")) - before) == 2 * len(ST.VARIANTS)
