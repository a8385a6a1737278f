"""The LoRA TIR kernels (compiler_passes/ops/lora/{single,gather,sgmv}_tir.py) on llvm against
their numpy references (reference.py); the CUDA variants are built here and run on a GPU."""

import numpy as np
import pytest
import tvm

from mlc_lora.compiler_passes.ops.kernel_attrs import OPAQUE
from mlc_lora.compiler_passes.ops.lora import reference as lora_ref
from mlc_lora.compiler_passes.ops.lora import sgmv_tir as G
from mlc_lora.compiler_passes.ops.lora.gather_tir import lora_gather_kernel
from mlc_lora.compiler_passes.ops.lora.single_tir import lora_dense_rows_kernel

from ....conftest import needs_nvcc

KERNELS = {"gather": lora_gather_kernel, "single": lora_dense_rows_kernel}

L, M, R = 3, 4, 8  # layers, modules, max rank
IN, OUT, MOD = 24, 40, 2


def _random_tables(rng, n_tok, ranks, page=64, pages=24):
    """An arena of L*P*E with rows at random non-overlapping places; tokens on random slots or -1."""
    size = L * pages * page
    arena = rng.standard_normal(size).astype(np.float32)
    S = len(ranks)
    a_off = np.full((S, M, R), -1, np.int32)
    b_off = np.full((S, M, R), -1, np.int32)
    # Each row gets its own page: IN, OUT <= page; shuffled page ids.
    ids = iter(rng.permutation(pages))
    for s, r in enumerate(ranks):
        for k in range(r):
            a_off[s, MOD, k] = next(ids) * page + rng.integers(0, page - IN + 1)
            b_off[s, MOD, k] = next(ids) * page + rng.integers(0, page - OUT + 1)
    scale = rng.uniform(0.5, 2.0, (S, M)).astype(np.float32)
    slot = rng.integers(-1, S, n_tok).astype(np.int32)
    rank = np.asarray(ranks, np.int32)
    return arena, slot, rank, scale, a_off, b_off


def _build(func):
    target = tvm.target.Target("llvm")
    with target:
        return tvm.compile(tvm.IRModule({"main": func}), target=target)


def _t(a):
    return tvm.runtime.tensor(a, tvm.cpu())


@pytest.mark.parametrize("layer", [0, 2])
def test_gather_kernel_matches_reference(layer):
    rng = np.random.default_rng(layer)
    n = 9
    arena, slot, rank, scale, a_off, b_off = _random_tables(rng, n, ranks=[3, 8, 1])
    scale[2, MOD] = 0.0  # an adapter that does not target this module
    slot[:3] = [-1, 2, 1]  # base token, untargeted slot, full rank, in any order
    x = rng.standard_normal((n, IN)).astype(np.float32)
    lib = _build(lora_gather_kernel(IN, OUT, MOD, L, R, M, "float32", tvm.target.Target("llvm")))
    out = _t(np.full((n, OUT), 7.0, np.float32))  # garbage must be overwritten
    lib["main"](_t(x), _t(arena), _t(slot), _t(rank), _t(scale), _t(a_off), _t(b_off), layer, out)
    ref = lora_ref.lora_gather_ref(x, arena, layer, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert np.all(ref[slot == -1] == 0) and np.all(ref[slot == 2] == 0)
    assert np.abs(ref[slot == 1]).max() > 0.1
    # Independent check of one token: dense maths from the same rows.
    t = int(np.flatnonzero(slot == 0)[0]) if (slot == 0).any() else 2
    s = slot[t]
    base = layer * (arena.size // L)
    A = np.stack([arena[base + a_off[s, MOD, k]:][:IN] for k in range(rank[s])])
    B = np.stack([arena[base + b_off[s, MOD, k]:][:OUT] for k in range(rank[s])])
    np.testing.assert_allclose(out.numpy()[t], scale[s, MOD] * (x[t] @ A.T) @ B, rtol=1e-5, atol=1e-5)


def test_gather_kernel_ignores_rows_past_rank():
    """Offsets past rank[s] are -1 (garbage); the kernel must not read them."""
    rng = np.random.default_rng(5)
    arena, slot, rank, scale, a_off, b_off = _random_tables(rng, 4, ranks=[2])
    slot[:] = 0
    a_off[0, MOD, 2:] = 10**6  # would be out of bounds
    x = rng.standard_normal((4, IN)).astype(np.float32)
    lib = _build(lora_gather_kernel(IN, OUT, MOD, L, R, M, "float32", tvm.target.Target("llvm")))
    out = _t(np.zeros((4, OUT), np.float32))
    lib["main"](_t(x), _t(arena), _t(slot), _t(rank), _t(scale), _t(a_off), _t(b_off), 1, out)
    ref = lora_ref.lora_gather_ref(x, arena, 1, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [[5], []])
def test_dense_rows_kernel_matches_reference(ranks):
    rng = np.random.default_rng(1)
    arena, _, rank, scale, a_off, b_off = _random_tables(rng, 1, ranks=ranks)
    lib = _build(lora_dense_rows_kernel(IN, OUT, MOD, L, R, M, "float32", tvm.target.Target("llvm")))
    a = _t(np.full((R, IN), 3.0, np.float32))
    b = _t(np.full((R, OUT), 3.0, np.float32))
    lib["main"](_t(arena), _t(rank), _t(scale), _t(a_off), _t(b_off), 1, a, b)
    ra, rb = lora_ref.lora_dense_rows_ref(arena, 1, L, rank, scale, a_off, b_off, MOD, IN, OUT, R)
    np.testing.assert_allclose(a.numpy(), ra, rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), rb, rtol=1e-6)
    if ranks:
        assert np.all(ra[ranks[0]:] == 0) and np.all(np.abs(ra[: ranks[0]]).max(axis=1) > 0)


def test_dense_rows_of_an_untargeted_module_are_zero():
    """An adapter that does not target the module (scale 0) has no rows for it: its offsets may
    point at pages holding anything (here inf), and A's rows must stay zero, or the dense path's
    x @ A.T is inf and 0 * inf gives NaN logits (what a pool arena with unwritten pages did)."""
    rng = np.random.default_rng(4)
    arena, _, rank, scale, a_off, b_off = _random_tables(rng, 1, ranks=[5])
    scale[0, MOD] = 0.0
    arena[:] = np.inf
    lib = _build(lora_dense_rows_kernel(IN, OUT, MOD, L, R, M, "float32", tvm.target.Target("llvm")))
    a = _t(np.full((R, IN), 3.0, np.float32))
    b = _t(np.full((R, OUT), 3.0, np.float32))
    lib["main"](_t(arena), _t(rank), _t(scale), _t(a_off), _t(b_off), 1, a, b)
    assert not a.numpy().any() and not b.numpy().any()
    ra, rb = lora_ref.lora_dense_rows_ref(arena, 1, L, rank, scale, a_off, b_off, MOD, IN, OUT, R)
    assert not ra.any() and not rb.any()


def test_dense_rows_equal_gather_for_one_slot():
    """Stage 1's dense path gives stage 2's result when every adapter token uses slot 0."""
    rng = np.random.default_rng(2)
    arena, slot, rank, scale, a_off, b_off = _random_tables(rng, 6, ranks=[6])
    slot[:] = [0, -1, 0, 0, -1, 0]
    x = rng.standard_normal((6, IN)).astype(np.float32)
    A, Bs = lora_ref.lora_dense_rows_ref(arena, 0, L, rank, scale, a_off, b_off, MOD, IN, OUT, R)
    dense = ((x @ A.T) * (slot >= 0)[:, None]) @ Bs
    ref = lora_ref.lora_gather_ref(x, arena, 0, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    np.testing.assert_allclose(dense, ref, rtol=1e-5, atol=1e-5)


@needs_nvcc
@pytest.mark.parametrize("name", list(KERNELS))
def test_cuda_kernels_build(name):
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    func = KERNELS[name](4096, 1024, 1, 32, 64, 7, "float16", target)
    assert func.attrs["tirx.is_scheduled"] and int(func.attrs["op_pattern"]) == OPAQUE
    with target:
        lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    assert lib is not None


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_kernels_run_against_reference(cuda_device, dtype):
    dev = cuda_device
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    rng = np.random.default_rng(3)
    n = 37
    arena, slot, rank, scale, a_off, b_off = _random_tables(rng, n, ranks=[3, 8, 1])
    scale[2, MOD] = 0.0
    arena = arena.astype(dtype)
    x = rng.standard_normal((n, IN)).astype(dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2

    def dev_t(a):
        return tvm.runtime.tensor(a, dev)

    with target:
        gather = tvm.compile(tvm.IRModule({"main": lora_gather_kernel(IN, OUT, MOD, L, R, M, dtype, target)}),
                             target=target)
        rows = tvm.compile(tvm.IRModule({"main": lora_dense_rows_kernel(IN, OUT, MOD, L, R, M, dtype, target)}),
                           target=target)
    out = dev_t(np.full((n, OUT), 7, dtype))
    gather["main"](dev_t(x), dev_t(arena), dev_t(slot), dev_t(rank), dev_t(scale), dev_t(a_off), dev_t(b_off),
                   2, out)
    ref = lora_ref.lora_gather_ref(x, arena, 2, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    np.testing.assert_allclose(out.numpy().astype(np.float32), ref.astype(np.float32), rtol=tol, atol=tol)
    a, b = dev_t(np.full((R, IN), 7, dtype)), dev_t(np.full((R, OUT), 7, dtype))
    rows["main"](dev_t(arena), dev_t(rank), dev_t(scale), dev_t(a_off), dev_t(b_off), 1, a, b)
    ra, rb = lora_ref.lora_dense_rows_ref(arena, 1, L, rank, scale, a_off, b_off, MOD, IN, OUT, R)
    np.testing.assert_allclose(a.numpy(), ra, rtol=tol)
    np.testing.assert_allclose(b.numpy().astype(np.float32), rb.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("layer,ranks", [(0, [3, 8, 1]), (2, [6, 5])])
def test_sgmv_kernels_match_references(layer, ranks):
    """Stage 3: shrink then expand against their references and the stage-2 reference; mixed
    ranks, tokens on any slot in any order, an untargeted slot, base tokens, garbage past rank."""
    rng = np.random.default_rng(10 + layer)
    n = 11
    arena, slot, rank, scale, a_off, b_off = _random_tables(rng, n, ranks=ranks)
    scale[-1, MOD] = 0.0 if len(ranks) > 2 else scale[-1, MOD]
    slot[:2] = [-1, 0]
    a_off[0, MOD, rank[0]:] = 10**6  # past rank: must never be read
    b_off[0, MOD, rank[0]:] = 10**6
    x = rng.standard_normal((n, IN)).astype(np.float32)
    llvm = tvm.target.Target("llvm")
    shrink = _build(G.lora_sgmv_shrink_kernel(IN, MOD, L, R, M, "float32", llvm))
    expand = _build(G.lora_sgmv_expand_kernel(IN, OUT, MOD, L, R, M, "float32", llvm))
    C = lora_ref.num_chunks(IN)
    v = _t(np.full((n, C, R), 9.0, np.float32))
    out = _t(np.full((n, OUT), 7.0, np.float32))
    shrink["main"](_t(x), _t(arena), _t(slot), _t(rank), _t(scale), _t(a_off), layer, v)
    expand["main"](v, _t(arena), _t(slot), _t(rank), _t(b_off), layer, out)
    rv = lora_ref.lora_sgmv_shrink_ref(x, arena, layer, L, slot, rank, scale, a_off, MOD, R)
    np.testing.assert_allclose(v.numpy(), rv, rtol=1e-5, atol=1e-5)
    rd = lora_ref.lora_sgmv_expand_ref(rv, arena, layer, L, slot, rank, b_off, MOD, OUT, np.float32)
    np.testing.assert_allclose(out.numpy(), rd, rtol=1e-5, atol=1e-5)
    ref = lora_ref.lora_gather_ref(x, arena, layer, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert np.all(out.numpy()[slot == -1] == 0) and np.abs(ref).max() > 0.1


@pytest.mark.parametrize("layer", [0, 2])
def test_sgmv_reads_nothing_of_an_untargeted_module(layer):
    """An adapter that does not target the module has offsets -1 and scale 0 for it, as the pool's
    tables write them; the arena holds NaN everywhere but the live rows (what unwritten pool pages
    may hold). The expand must read no row for it (it did: base - 1 + o, 0 * NaN = NaN), and the
    other slots' deltas stay exact."""
    rng = np.random.default_rng(7)
    n = 9
    arena, slot, rank, scale, a_off, b_off = _random_tables(rng, n, ranks=[4, 3, 5])
    a_off[1], b_off[1], scale[1] = -1, -1, 0.0  # slot 1 targets no module
    live = np.full(arena.size, np.nan, np.float32)
    base = layer * (arena.size // L)
    for s in (0, 2):
        for k in range(rank[s]):
            for off, w in ((a_off[s, MOD, k], IN), (b_off[s, MOD, k], OUT)):
                live[base + off: base + off + w] = arena[base + off: base + off + w]
    slot[:3] = [1, 0, 2]
    x = rng.standard_normal((n, IN)).astype(np.float32)
    llvm = tvm.target.Target("llvm")
    shrink = _build(G.lora_sgmv_shrink_kernel(IN, MOD, L, R, M, "float32", llvm))
    expand = _build(G.lora_sgmv_expand_kernel(IN, OUT, MOD, L, R, M, "float32", llvm))
    v = _t(np.full((n, lora_ref.num_chunks(IN), R), 9.0, np.float32))
    out = _t(np.full((n, OUT), 7.0, np.float32))
    shrink["main"](_t(x), _t(live), _t(slot), _t(rank), _t(scale), _t(a_off), layer, v)
    expand["main"](v, _t(live), _t(slot), _t(rank), _t(b_off), layer, out)
    got = out.numpy()
    assert np.isfinite(got).all()
    assert not got[(slot == 1) | (slot == -1)].any()
    rd = lora_ref.lora_sgmv_expand_ref(v.numpy(), live, layer, L, slot, rank, b_off, MOD, OUT, np.float32)
    ref = lora_ref.lora_gather_ref(x, arena, layer, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    np.testing.assert_allclose(got, rd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert np.abs(ref).max() > 0.1


@needs_nvcc
def test_sgmv_cuda_kernels_build():
    """The hand-scheduled CUDA variants lower and compile: fp16 and bf16, rank 64, 11008 wide."""
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    for dtype in ("float16", "bfloat16"):
        mod = tvm.IRModule({"shrink": G.lora_sgmv_shrink_kernel(11008, 0, 2, 64, 7, dtype, cuda),
                            "expand": G.lora_sgmv_expand_kernel(11008, 4096, 0, 2, 64, 7, dtype, cuda)})
        with cuda:
            src = tvm.compile(mod, target=cuda).mod.imports[0].inspect_source()
        assert "__shfl_down_sync" in src  # the warp-level reduction made it into the kernel


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sgmv_kernels_read_int8_rows(dtype):
    """int8 rows (contract.ROW_FORMATS): the stage-3 TIR kernels on an arena of int8 rows with their
    scales, NaN around them, match the references on the values they stand for
    (int8_rows_as_model_ref) and the kernels on those values in the model dtype; each row stands
    for values within half a step of the float rows it was made from."""
    from mlc_lora.contract import INT8_ROW_ALIGN
    from mlc_lora.lora.layout import int8_row_bytes, row_elems

    rng = np.random.default_rng(21)
    np_dt = np.dtype(dtype)
    eb, page, pages, ranks, n, layer = np_dt.itemsize, 64, 32, [3, 8, 2], 13, 1
    size = L * pages * page
    arena = np.full(size, np.nan, np_dt)
    raw = arena.view(np.uint8)
    S = len(ranks)
    a_off = np.full((S, M, R), -1, np.int32)
    b_off = np.full((S, M, R), -1, np.int32)
    ids = iter(rng.permutation(pages))
    lead = INT8_ROW_ALIGN // eb
    rows, floats = [], []
    for s, r in enumerate(ranks):
        for k in range(r):
            for offs, width in ((a_off, IN), (b_off, OUT)):
                room = page - lead - width  # room for the row at model length too (the reference's arena)
                assert row_elems(width, "int8", eb) <= lead + width
                offs[s, MOD, k] = next(ids) * page + lead + rng.integers(0, room // lead + 1) * lead
                for l in range(L):
                    w = rng.standard_normal(width).astype(np.float32) * rng.uniform(0.01, 3)
                    at = (l * pages * page + int(offs[s, MOD, k])) * eb
                    row = int8_row_bytes(w[None])[0]
                    raw[at - INT8_ROW_ALIGN:at - INT8_ROW_ALIGN + row.size] = row
                    rows.append((l * pages * page + int(offs[s, MOD, k]), width))
                    floats.append(w)
    scale = rng.uniform(0.5, 2.0, (S, M)).astype(np.float32)
    slot = rng.integers(-1, S, n).astype(np.int32)
    slot[:3] = [-1, 0, 2]
    rank = np.asarray(ranks, np.int32)
    model = lora_ref.int8_rows_as_model_ref(arena, rows, INT8_ROW_ALIGN)
    for (off, width), w in zip(rows, floats):
        assert np.abs(model[off:off + width] - w).max() <= np.abs(w).max() / 127 * 0.5 * (1 + 1e-6)
    x = rng.standard_normal((n, IN)).astype(np_dt)
    llvm = tvm.target.Target("llvm")
    C = lora_ref.num_chunks(IN)
    outs = {}
    for fmt, ar in (("int8", arena), ("model", model.astype(np_dt))):
        shrink = _build(G.lora_sgmv_shrink_kernel(IN, MOD, L, R, M, dtype, llvm, fmt))
        expand = _build(G.lora_sgmv_expand_kernel(IN, OUT, MOD, L, R, M, dtype, llvm, fmt))
        v = _t(np.full((n, C, R), 9.0, np.float32))
        out = _t(np.full((n, OUT), 7.0, np_dt))
        shrink["main"](_t(x), _t(ar), _t(slot), _t(rank), _t(scale), _t(a_off), layer, v)
        expand["main"](v, _t(ar), _t(slot), _t(rank), _t(b_off), layer, out)
        outs[fmt] = (v.numpy(), out.numpy())
    tol = 1e-5 if dtype == "float32" else 2e-2  # (float16: the model-dtype kernels round the values)
    np.testing.assert_allclose(outs["int8"][0], outs["model"][0], rtol=tol, atol=tol)
    np.testing.assert_allclose(outs["int8"][1].astype(np.float32), outs["model"][1].astype(np.float32), rtol=tol,
                               atol=tol)
    rv = lora_ref.lora_sgmv_shrink_ref(x, model, layer, L, slot, rank, scale, a_off, MOD, R)
    np.testing.assert_allclose(outs["int8"][0], rv, rtol=1e-4, atol=1e-4)
    ref = lora_ref.lora_gather_ref(x.astype(np.float32), model, layer, L, slot, rank, scale, a_off, b_off, MOD, OUT)
    tol = 1e-4 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(outs["int8"][1].astype(np.float32), ref, rtol=tol, atol=tol)
    assert np.isfinite(outs["int8"][1]).all() and np.abs(ref).max() > 0.1
    assert not outs["int8"][1][slot == -1].any()
