"""The fused linear of decode_fused (ops/lora/linear_triton.py): the Triton kernel runs on the CPU
under Triton's interpreter against the numpy reference and builds to cubin for sm_90a here; its
tile choice fits every linear it accepts; LoraSpec decides which batches it covers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from mlc_lora.compiler_passes.ops import norm_triton as NORM  # noqa: E402
from mlc_lora.compiler_passes.ops.lora import linear_triton as LT  # noqa: E402
from mlc_lora.lora.layout import LoraSpec, LoraModule  # noqa: E402

from .conftest import interpret  # noqa: E402


def _case(rng, dtype, n, K, widths, ranks, R, M=4):
    layer_size, L = 60000, 3
    arena = (rng.standard_normal(L * layer_size) * 0.5).astype(dtype)
    base = layer_size
    S = len(ranks)
    rank = np.array(ranks, np.int32)
    scale = rng.uniform(0.5, 2, (S, M)).astype(np.float32)
    scale[1, 2] = 0  # an adapter that leaves a module alone
    a_off = (rng.integers(0, (40000 - K) // 8, (S, M, R)) * 8).astype(np.int32)
    b_off = (rng.integers(0, (40000 - max(widths)) // 8, (S, M, R)) * 8).astype(np.int32)
    a_off[np.broadcast_to(rank[:, None, None] <= np.arange(R)[None, None, :], a_off.shape)] = -1  # unused rows
    slot = rng.integers(-1, S, n).astype(np.int32)
    slot[:S] = np.arange(S)
    rng.shuffle(slot)
    x = rng.standard_normal((n, K)).astype(dtype)
    w = (rng.standard_normal((sum(widths), K)) / np.sqrt(K)).astype(dtype)
    return dict(x=x, w=w, arena=arena, base=base, slot=slot, rank=rank, scale=scale, a_off=a_off, b_off=b_off)


@pytest.mark.parametrize("bm,n,split,swap,cols", [
    (16, 21, 1, 0, 0), (64, 70, 1, 0, 0), (16, 21, 2, 0, 0), (64, 70, 3, 0, 0), (16, 21, 1, 1, 0), (16, 21, 3, 1, 0),
    (32, 29, 3, 1, 0), (32, 29, 3, 1, 32),
    ("small", 70, 1, 0, 0), ("large", 70, 1, 0, 0), ("rows", 70, 1, 0, 0),
    (16, 21, 3, 0, 96), (64, 70, 1, 0, 96), (16, 21, 3, 1, 32), ("small", 70, 1, 0, 96),
    ("xs", 70, 1, 0, 0), ("xs", 130, 1, 0, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kernel_matches_reference(tmp_path, bm, n, split, swap, cols, dtype):
    """bm 16/32/64: the fused kernel's token tiers (their block heights), its K loop in `split` blocks per tile (3: one
    input step each, 2: two and one), its products taken transposed (`swap`); `cols`: the weight
    stored with that many columns beside its own (NaN: never read); "small"/"large":
    cuBLAS's product, then the shrink variant and the in-place expand (the batches past
    FUSED_MAX_TOKENS); "rows": the batch's A rows filled below W (over NaN), cuBLAS over both,
    the expand from its extra columns (the rank rows route past FUSED_MAX_TOKENS)."""
    rng = np.random.default_rng(3)
    widths, mods, R = (64, 32, 32), (0, -1, 2), 16  # q|k|v with k untargeted
    K = 192 if isinstance(bm, int) else 576  # the shrink splits 576 inputs in two (5 + 4 steps of 64)
    if bm in ("small", "large"):
        assert LT.cols_launch(n, K, widths, mods, 4, R, 8, bm)["split"] == 2
    if bm == "xs":
        assert LT.xs_launch(n, K, widths, mods, 4, R, 8)["split"] == 2
    c = _case(rng, dtype, n, K, widths, [8, 16, 0, 4], R)  # ranks sum to 28 <= RANK_COLUMNS
    # a stale slot past the batch's (as a captured graph's fixed tables keep): no token uses it, its
    # rows point at NaN; it must not reach any output
    stale = 4
    c["arena"][c["base"] + 50000: c["base"] + 51000] = np.nan
    c["rank"] = np.append(c["rank"], 4).astype(np.int32)
    c["scale"] = np.concatenate([c["scale"], np.ones((1, c["scale"].shape[1]), np.float32)])
    c["a_off"] = np.concatenate([c["a_off"], np.full((1,) + c["a_off"].shape[1:], 50000, np.int32)])
    c["b_off"] = np.concatenate([c["b_off"], np.full((1,) + c["b_off"].shape[1:], 50000, np.int32)])
    assert not (c["slot"] == stale).any()
    kw = dict(bm=bm, split=split, swap=swap) if isinstance(bm, int) else dict(bm=64, variant=bm, fill_slots=stale)
    wide = np.concatenate([c["w"], np.full((c["w"].shape[0], cols), np.nan, c["w"].dtype)], axis=1)
    out = interpret(tmp_path, **{**c, "w": wide}, mods=np.array(mods), widths=np.array(widths), R=R, **kw)
    ref = LT.linear_ref(c["x"], c["w"], c["arena"], c["base"], c["slot"], c["rank"], c["scale"], c["a_off"],
                        c["b_off"], mods, widths)
    if bm == "xs":
        # [x | s]: x itself in the first K columns; the filled columns hold no NaN (the fill gets the
        # kept slots, not the stale one past them, whose rows point at NaN) and zeros past the live
        # columns
        np.testing.assert_array_equal(out["xe"][:, :K], c["x"])
        assert np.isfinite(out["cols"]).all() and np.isfinite(out["xe"]).all()
        assert (out["cols"][:64, 28:32] == 0).all()  # q's columns past the ranks' 28
    if bm == "rows":  # the filled rows: the batch's A rows (the stale slot's among them), zeros past them
        rows = LT.fill_rows_ref(c["arena"], c["base"], c["rank"], c["scale"], c["a_off"], mods, K)
        np.testing.assert_array_equal(out["rows"], rows)
        assert np.isnan(rows).any() and (rows[32:64] == 0).all()  # the untargeted part k: zeros
    base_only = c["x"].astype(np.float64) @ c["w"].astype(np.float64).T
    tol = 1e-5 if dtype == np.float32 else 4e-3
    got = out["y"].astype(np.float64)
    assert np.isfinite(got).all()
    if "cnt" in out:  # the split tiles' counters are left as they were found: zeros
        assert not out["cnt"].any()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol
    delta, delta_ref = got - base_only, ref - base_only
    assert np.linalg.norm(delta_ref) > 0.1 * np.linalg.norm(base_only)  # the deltas are not negligible
    assert np.linalg.norm(delta - delta_ref) / np.linalg.norm(delta_ref) < 3 * tol
    # base-model tokens and the untargeted part get the base output only
    rows = c["slot"] < 0
    np.testing.assert_allclose(got[rows], base_only[rows], rtol=tol, atol=tol * np.abs(base_only).max())
    np.testing.assert_allclose(got[:, 64:96], base_only[:, 64:96], rtol=tol, atol=tol * np.abs(base_only).max())


@pytest.mark.parametrize("in_f,widths", [(4096, (4096, 4096, 4096)), (4096, (4096,)), (4096, (11008, 11008)),
                                         (11008, (4096,)), (576, (576, 192, 192)), (1536, (576,)),
                                         (576, (1536, 1536)), (64, (64, 32, 32)), (96, (64,))])
@pytest.mark.parametrize("tier", LT.TOKEN_TIERS)
def test_tile_config_fits_the_linear(in_f, widths, tier):
    cfg = LT.tile_config(in_f, widths, tier)
    assert all(w % cfg["BN"] == 0 for w in widths) and in_f % cfg["BK"] == 0
    assert cfg["BM"] == 16 if tier <= LT.SMALL_MAX_TOKENS else cfg["BM"] in (32, 64)
    assert cfg["SWAP"] in (0, 1)
    # splits: narrow linears only, each split at least a few input steps
    assert cfg["SPLIT"] == 1 or (sum(widths) < 8192 and in_f // cfg["BK"] >= 4 * cfg["SPLIT"])
    assert (LT.split_scratch_elems(in_f, widths) > 0) == any(
        LT.tile_config(in_f, widths, t)["SPLIT"] > 1 for t in LT.TOKEN_TIERS)


def test_token_tier_covers_the_one_kernel_linears_batches():
    assert [LT.token_tier(n) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert LT.TOKEN_TIERS[0] == LT.SMALL_MAX_TOKENS and LT.TOKEN_TIERS[-1] == LT.FUSED_MAX_TOKENS


def test_llama_linears_tiles():
    """Llama-2-7B (H200, bench_lora_fused.py tune): o (4096 -> 4096) and down (11008 -> 4096) split
    2 and 3 ways at up to 16 tokens; past 16 both take the products transposed over 4 splits at up
    to 32 tokens, down at up to 64 too (8 warps) and o blocks of 64 tokens there; the wide linears
    never split."""
    o, down = (4096, (4096,)), (11008, (4096,))
    assert LT.tile_config(*o, 16)["SPLIT"] == 2 and LT.tile_config(*down, 16)["SPLIT"] == 3
    for lin in (o, down):
        c = LT.tile_config(*lin, 32)
        assert (c["BM"], c["BN"], c["BK"], c["SPLIT"], c["SWAP"]) == (32, 128, 64, 4, 1)
    c = LT.tile_config(*down, 64)
    assert (c["BM"], c["BN"], c["BK"], c["SPLIT"], c["SWAP"], c["num_warps"]) == (64, 128, 128, 4, 1, 8)
    c = LT.tile_config(*o, 64)
    assert (c["BM"], c["SPLIT"], c["SWAP"]) == (64, 1, 0)
    for t in LT.TOKEN_TIERS:
        assert LT.tile_config(4096, (4096,) * 3, t)["SPLIT"] == 1 and LT.tile_config(4096, (11008,) * 2, t)["SPLIT"] == 1


@pytest.mark.parametrize("n,steps,bm,plan", [
    (65, 64, 16, (5, 8, 8)),  # few tokens: 8 splits of 8 steps
    (256, 64, 16, (16, 8, 8)),
    (512, 172, 16, (32, 35, 5)),  # 11008 inputs: 4 x 35 + 32 steps
    (1024, 64, 64, (16, 8, 8)),
    (4096, 64, 64, (64, 22, 3)),  # enough blocks: 3 splits
    (4096, 3, 64, (64, 3, 1)),  # too few steps to split
])
def test_shrink_split_fills_the_gpu(n, steps, bm, plan):
    tiles, per, split = LT.shrink_split(n, steps, bm)
    assert (tiles, per, split) == plan
    assert per * (split - 1) < steps <= per * split and split <= LT.SPLIT_MAX


def test_supported_names_what_it_cannot_run():
    assert LT.supported("float16", "float16", 4096, (4096,)) is None
    assert "float32" in LT.supported("float32", "float32", 4096, (4096,))
    assert "weights" in LT.supported("float16", "int8", 4096, (4096,))
    assert "multiples of 16" in LT.supported("float16", "float16", 4096, (4100,))


def test_spec_decides_which_batches_run_fused():
    spec = LoraSpec(num_layers=1, page_elems=64, modules=(LoraModule("q_proj", 64, 64),), max_rank=16,
                    pool_pages=8, kernel="sgmv")
    assert not spec.fused_fits(1, 8)  # no _fused functions built
    lim = {"rank_columns": 32, "slot_columns": 16}
    spec = dataclasses.replace(spec, fused=lim)
    assert spec.fused_fits(4, 32) and spec.fused_fits(1, 1)
    assert not spec.fused_fits(2, 33)  # ranks sum past the rank columns
    assert not spec.fused_fits(17, 17)  # too many adapters
    assert not spec.fused_fits(0, 0)  # no adapter: the base functions run
    assert LoraSpec.from_json(spec.to_json()) == spec
    # a config that names the limits "fused_decode" (with a token limit) reads the same
    legacy = dict(spec.to_json(), fused_decode={"max_tokens": 64, **lim})
    del legacy["fused"]
    assert LoraSpec.from_json(legacy) == spec


def test_kernel_builds_to_cubin_for_sm90(cubin_cache):
    """The fused kernel's three token tiers, both shrink variants and the expand compile here (no
    GPU) and become TVM CUDA modules; the wrapper calls cuBLAS only past the fused kernel's tokens."""
    fn, mods = LT.linear_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "bfloat16", 8, "sm_90a")
    assert len(mods) == 6 and len(list(cubin_cache.glob("*.cubin"))) == 6
    script = fn.script()
    assert "mlc_lora_triton_linear_bf16" in script and all(f"_BM{b}_" in script for b in (16, 32, 64))
    # tiers of one shape share a kernel: a wide linear's 17-32 and 33-64 tokens
    _, wide = LT.linear_wrapper(4096, (11008, 11008), (5, 6), 2, 16, 7, "bfloat16", 8, "sm_90a")
    assert len(wide) == 5
    assert "_SPLIT2_" in script and "_SPLIT1_" in script  # q|k|v of 6144 outputs: narrow, split at 16 tokens
    assert script.count("mlc_lora_triton_shrink_cols_bf16") == 2 and "mlc_lora_triton_expand_cols_bf16" in script
    assert script.count("mlc_lora.runtime.cublas_gemm") == 1
    # the host code computes the launches without scalar buffers (which would live in device memory)
    import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    mod = tvm.tirx.transform.BindTarget(target)(tvm.IRModule({"main": fn.with_attr("global_symbol", "main")}))
    host = tvm.ir.transform.Sequential([tvm.tirx.transform.MakePackedAPI(), tvm.tirx.transform.LowerTVMBuiltin()])(mod)
    assert "TVMBackendAllocWorkspace" not in host.script()


def test_rank_rows_wrapper_builds_to_cubin_for_sm90(cubin_cache):
    """The rank rows route's wrapper: the one-kernel linear's three tiers, the fill and the
    expand from e (no shrink, no in-place expand); past the fused kernel's tokens it fills, calls
    cuBLAS once over the weight's W + 3 x 32 rows and expands from e."""
    fn, mods = LT.linear_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 8, "sm_90a", rows=True)
    assert len(mods) == 5 and len(list(cubin_cache.glob("*.cubin"))) == 5
    script = fn.script()
    assert "mlc_lora_triton_fill_rows_fp16" in script and "mlc_lora_triton_expand_rows_fp16" in script
    assert "shrink_cols" not in script and "expand_cols" not in script
    assert script.count("mlc_lora.runtime.cublas_gemm") == 1
    assert "T.Buffer((6240, 4096)" in script and "T.Buffer((n, 6240)" in script  # w and e: 6144 + 96 rows
    # the reserved rows of a linear are 32 per part, one definition
    assert LT.rank_rows(3) == 96 and LT.rows_launch(100, 4096, (4096, 1024, 1024), (0, 1, 2), 7, 16, 8)["rows"] == 6240


def test_rank_columns_wrapper_builds_to_cubin_for_sm90(cubin_cache):
    """The rank columns route's wrapper (a weight with 3 x 32 spare columns, x made by its RMSNorm):
    the one-kernel linear's three tiers (reading W's first columns with its row stride), the
    norm and the shrink into [x | s]; past the fused kernel's tokens it shrinks and calls cuBLAS once
    over [x | s] and the whole weight (no expand, no fill: fill_wrapper's, when the kept columns
    change). A linear whose x has no producer keeps the pair over the weight's first columns."""
    fn, mods = LT.linear_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 8, "sm_90a",
                                 w_cols=4096 + 128, producer="rms_norm", eps=1e-5)
    assert len(mods) == 6 and len(list(cubin_cache.glob("*.cubin"))) == 6
    script = fn.script()
    assert script.count("mlc_lora_triton_shrink_xs_fp16") == 1
    assert "expand" not in script and "shrink_cols" not in script and "fill" not in script
    assert script.count("mlc_lora.runtime.cublas_gemm") == 1
    assert "T.Buffer((6144, 4224)" in script and "T.Buffer((n, 4224)" in script  # w and xe: 4096 + 96, padded to 4224
    pair, _ = LT.linear_wrapper(4096, (4096,), (3,), 2, 16, 7, "float16", 8, "sm_90a", w_cols=4096 + 64)
    script = pair.script()
    assert "shrink_xs" not in script and script.count("mlc_lora_triton_shrink_cols_fp16") == 2
    assert script.count("mlc_lora_triton_expand_cols_fp16") == 2 and "T.Buffer((4096, 4160)" in script
    fill, mods = LT.fill_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 8, "sm_90a")
    script = fill.script()
    assert len(mods) == 1 and script.count("mlc_lora_triton_fill_cols_fp16") == 1 and "T.Buffer((6144, 4224)" in script
    assert LT.xs_launch(100, 4096, (4096, 1024, 1024), (0, 1, 2), 7, 16, 8)["cols"] == 4224
    # rows of a multiple of COLUMN_ALIGN: the rank columns, then zeros
    assert [LT.spare_columns(k, p) for k, p in ((4096, 3), (4096, 2), (4096, 1), (11008, 1), (576, 3), (576, 2))] == [
        128, 64, 64, 64, 128, 64]
    with pytest.raises(ValueError, match="spare columns"):  # neither the weight's own nor + its spare columns
        LT.linear_wrapper(4096, (4096,), (0,), 2, 16, 7, "float16", 8, "sm_90a", w_cols=4096 + 96)


@pytest.mark.parametrize("producer,kernel", [("rms_norm", "mlc_lora_triton_rms_norm_fp16"),
                                             ("silu_mul", "mlc_lora_triton_silu_mul_fp16")])
def test_rank_columns_wrapper_runs_the_producer_into_xs(cubin_cache, producer, kernel):
    """With x's producer (the RMSNorm, silu(gate) * up) the wrapper takes the producer's input and
    runs the producer's kernel itself: into x (rows in_f apart) for the one-kernel linear, into the
    first columns of [x | s] (rows in_f + 128 apart: 96 rank columns, padded) before the shrink, which
    reads x there and adds s beside it."""
    fn, mods = LT.linear_wrapper(4096, (4096, 1024, 1024), (0, 1, 2), 2, 16, 7, "float16", 8, "sm_90a",
                                 w_cols=4096 + 128, producer=producer, eps=1e-5)
    assert len(mods) == 6
    script = fn.script()
    names = {ln.split('"')[1] for ln in script.splitlines() if "T.call_packed(\"mlc_lora_triton" in ln}
    ld = "LDO" if producer == "rms_norm" else "LDH"
    produced = sorted(n for n in names if n.startswith(kernel))
    assert len(produced) == 2 and [f"_{ld}4096_" in n + "_" for n in produced].count(True) == 1, produced
    assert [f"_{ld}4224_" in n + "_" for n in produced].count(True) == 1, produced
    shrinks = [n for n in names if "shrink_xs" in n]
    assert len(shrinks) == 1, shrinks
    assert script.count("mlc_lora.runtime.cublas_gemm") == 1


@pytest.mark.parametrize("producer,dtype,K", [
    ("rms_norm", np.float16, 576), ("silu_mul", np.float16, 576), ("rms_norm", np.float32, 576),
    ("rms_norm", np.float16, 2048), ("silu_mul", np.float32, 2048), ("add_rms_norm", np.float16, 576),
    ("add_rms_norm", np.float32, 2048)])
def test_producer_writes_x_beside_its_shrink(tmp_path, producer, dtype, K):
    """The rank columns route with x's producer (an RMSNorm of the hidden state, of the residual sum
    h + r, silu(gate) * up): its kernel writes x into [x | s]'s first columns, the shrink reads x
    there and adds s; [x | s] and the GEMM over it equal linear_ref of the producer's x (float64,
    rounded once to the dtype); the residual sum handed on is h + r rounded once. Several input
    splits (2 for 576 inputs, 4 for 2048)."""
    rng = np.random.default_rng(5)
    widths, mods, R, n = (64, 32, 32), (0, -1, 2), 16, 70
    assert LT.xs_launch(n, K, widths, mods, 4, R, 8)["split"] == (2 if K == 576 else 4)
    c = _case(rng, dtype, n, K, widths, [8, 16, 0, 4], R)
    h = (rng.standard_normal((n, 2 * K if producer == "silu_mul" else K)) * 3).astype(dtype)
    g = rng.uniform(0.5, 1.5, K).astype(dtype)
    r = (rng.standard_normal(h.shape) * 3).astype(dtype)
    x = LT.producer_ref(producer, h, g, 1e-5, r).astype(dtype)
    # the shrink's own x input is NaN: in place it reads nothing but [x | s]
    out = interpret(tmp_path, **{**c, "x": np.full_like(x, np.nan)}, h=h, g=g, eps=1e-5, producer=producer,
                    mods=np.array(mods), widths=np.array(widths), R=R, bm=64, variant="xs",
                    fill_slots=len(c["rank"]), **({"r": r} if producer == "add_rms_norm" else {}))
    if producer == "add_rms_norm":
        np.testing.assert_array_equal(out["h1"], (h.astype(np.float32) + r.astype(np.float32)).astype(dtype))
    tol = 1e-5 if dtype == np.float32 else 4e-3
    got_x = out["xe"][:, :K].astype(np.float64)
    # [x | s] padded to a row of a multiple of COLUMN_ALIGN; the shrink writes the padding as zeros
    # (over NaN: the GEMM reads it against the weight's zero columns)
    assert out["xe"].shape == (n, K + LT.spare_columns(K, 3)) and LT.spare_columns(K, 3) > 96
    assert np.isfinite(out["xe"]).all() and (out["xe"][:, K + 96:] == 0).all()
    assert not out["cnt"].any()
    # x: the reference rounded once; the kernel's float32 sums may round the other way (one ulp)
    np.testing.assert_allclose(got_x, x.astype(np.float64), rtol=2 * np.finfo(dtype).eps, atol=1e-6)
    ref = LT.linear_ref(x, c["w"], c["arena"], c["base"], c["slot"], c["rank"], c["scale"], c["a_off"],
                        c["b_off"], mods, widths)
    base_only = x.astype(np.float64) @ c["w"].astype(np.float64).T
    got = out["y"].astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol
    assert np.linalg.norm((got - base_only) - (ref - base_only)) / np.linalg.norm(ref - base_only) < 3 * tol


def test_launch_arguments_keep_their_scalar_types():
    """TVM's CUDA module packs each launch argument by its declared type: the RMSNorm's eps is a
    float32 (declared int32 it would reach the kernel as an integer's bits), the scratch pointers
    come last; a scalar type the launch cannot pack is refused by name."""
    from mlc_lora.compiler_passes.ops import triton_build

    _, shrink = LT._cols_route_signatures("float16")  # pylint: disable=protected-access
    norm = NORM._signature("float16")  # pylint: disable=protected-access
    types = triton_build.arg_types(shrink)
    launched = [k for k, t in shrink.items() if t != "constexpr"]
    assert triton_build.arg_types(norm)[:6] == ["handle"] * 5 + ["float32"]
    assert types[launched.index("base")] == "int64"
    assert types[launched.index("n")] == "int32" and types[-2:] == ["int64", "int64"]
    with pytest.raises(ValueError, match="f: fp64"):
        triton_build.arg_types({"x": "*fp16", "f": "fp64"})
