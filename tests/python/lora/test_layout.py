"""Page arithmetic, packing and per-batch tables against hand computation."""

import numpy as np
import pytest

from mlc_lora.contract import INT8_ROW_ALIGN
from mlc_lora.errors import LoraError
from mlc_lora.lora import layout
from mlc_lora.lora.layout import LoraModule, LoraSpec, layout_adapter, make_spec, pack_adapter
from mlc_lora.lora.peft import LoraAdapter
from mlc_lora.models.llama import LlamaConfig

from ..conftest import TINY_CONFIGS
from .reference import NumpyArena


def _tiny_cfg():
    return LlamaConfig(**{k: v for k, v in TINY_CONFIGS["gqa"].items()})


def test_llama2_7b_page_table_by_hand():
    rows = {r["rank"]: r for r in layout.reference_page_table("Llama-2-7B")}
    # E = 2 * 32 * 16 * 128 = 131072; 32 rows of 4096 or 11 rows of 11008 per page.
    # Attention only, rank r: 8r rows of 4096 -> r/4 pages, no waste.
    assert [rows[r]["attn_pages"] for r in (8, 16, 32, 64)] == [2, 4, 8, 16]
    # All 7 at rank 8: 24 rows of 11008 (A of down, B^T of gate/up) -> pages of 11, 11, 2 rows,
    # leaving 9984, 9984 and 109056 free: 2 + 2 + 26 rows of 4096 go there; the other 88 - 30 = 58
    # rows of 4096 take 2 more pages. 5 pages = ceil(78080 * 8 / 131072), the lower bound.
    assert rows[8]["all_pages"] == 5 and rows[8]["all_lower_bound"] == 5
    assert rows[8]["all_waste_elems"] == 5 * 131072 - 78080 * 8
    # Every rank reaches ceil(78080 r / 131072): 10, 20, 39 (one row length per page would give 11, 20, 40).
    assert [rows[r]["all_pages"] for r in (16, 32, 64)] == [10, 20, 39]
    assert rows[8]["all_mib"] == 40 and rows[64]["attn_mib"] == 128  # 8 MiB per page id


def test_llama3_8b_page_table_by_hand():
    rows = {r["rank"]: r for r in layout.reference_page_table("Llama-3-8B")}
    # E = 2 * 8 * 16 * 128 = 32768: 8 rows of 4096, 32 of 1024, 2 of 14336 (4096 left over).
    # Attention, rank 8: 48 rows of 4096 -> 6 pages; 16 rows of 1024 = half a page -> 7.
    assert [rows[r]["attn_pages"] for r in (8, 16, 32, 64)] == [7, 13, 26, 52]
    # All 7, rank 8: 24 rows of 14336 -> 12 pages, each also takes one of the 72 rows of 4096;
    # 60 left -> 7.5 pages; the 16 rows of 1024 fill the last half page: 20 = 81920 * 8 / 32768.
    assert rows[8]["all_pages"] == 20 and rows[8]["all_waste_elems"] == 0
    assert [rows[r]["all_pages"] for r in (16, 32, 64)] == [40, 80, 160]
    assert rows[64]["all_mib"] == 320  # 2 MiB per page id


def test_layout_rows_stay_inside_pages_and_do_not_overlap():
    rng = np.random.default_rng(0)
    for _ in range(20):
        E = int(rng.integers(64, 400))
        mods = [LoraModule(f"m{i}", int(rng.integers(1, E + 1)), int(rng.integers(1, E + 1)))
                for i in range(int(rng.integers(1, 6)))]
        r = int(rng.integers(1, 9))
        lay = layout_adapter(E, mods, r)
        used = np.zeros(lay.num_pages * E, int)
        lengths = {m.name: (m.in_features, m.out_features) for m in mods}
        for (name, ab, k), off in lay.offsets.items():
            n = lengths[name][0 if ab == "A" else 1]
            assert off // E == (off + n - 1) // E, "a row crosses a page"
            used[off:off + n] += 1
        assert used.max() == 1 and used.sum() == lay.used_elems
        assert lay.waste == lay.num_pages * E - lay.used_elems
        assert layout.lower_bound_pages(E, mods, r) <= lay.num_pages
        assert len(lay.offsets) == 2 * r * len(mods)


def _fake_adapter(spec, rank, modules, seed):
    rng = np.random.default_rng(seed)
    shapes = {m.name: (m.in_features, m.out_features) for m in spec.modules}
    w = {(l, m): (rng.standard_normal((rank, shapes[m][0])).astype(np.float32),
                  rng.standard_normal((rank, shapes[m][1])).astype(np.float32))
         for l in range(spec.num_layers) for m in modules}
    return LoraAdapter(f"a{seed}", rank, list(modules), {m: 0.5 + i for i, m in enumerate(modules)}, w, {})


def test_pack_adapter_round_trip_and_tables():
    cfg = _tiny_cfg()
    spec = make_spec(cfg, max_rank=8, pool_pages=40, target_modules=["q_proj", "v_proj", "down_proj"])
    assert spec.page_elems == 2 * 2 * 16 * 16 and spec.module_names == ["q_proj", "v_proj", "down_proj"]
    a1 = _fake_adapter(spec, 3, ["v_proj", "down_proj"], 1)
    a2 = _fake_adapter(spec, 8, ["q_proj"], 2)
    p1 = pack_adapter(spec, a1, np.float32)
    assert p1.pages.shape == (2, p1.pages.shape[1], spec.page_elems)
    assert list(p1.scale) == [0.0, 0.5, 1.5] and p1.rank == 3
    assert (p1.a_off[0] == -1).all() and (p1.a_off[1, 3:] == -1).all() and (p1.a_off[1, :3] >= 0).all()
    arena = NumpyArena(spec, np.float32)
    ids1 = arena.load(11, p1, page_ids=[30, 2, 17][: p1.pages.shape[1]])
    arena.load(22, pack_adapter(spec, a2, np.float32))
    t = arena.tables([22, None, 11, 11, None, 22])
    assert t["lora_token_slot"].tolist() == [0, -1, 1, 1, -1, 0]  # first appearance
    assert t["lora_rank"].tolist() == [8, 3]
    np.testing.assert_array_equal(t["lora_scale"][1], p1.scale)
    # Every row read back from the arena through the global offsets equals the adapter's row.
    E, P = spec.page_elems, spec.pool_pages
    for l in range(spec.num_layers):
        for mi, m in enumerate(spec.modules):
            if m.name not in a1.modules:
                assert (t["lora_a_off"][1, mi] == -1).all()
                continue
            for k in range(3):
                off = l * P * E + t["lora_a_off"][1, mi, k]
                np.testing.assert_array_equal(arena.data[off:off + m.in_features], a1.weights[l, m.name][0][k])
                off = l * P * E + t["lora_b_off"][1, mi, k]
                np.testing.assert_array_equal(arena.data[off:off + m.out_features], a1.weights[l, m.name][1][k])
    assert sorted(set(t["lora_a_off"][1][t["lora_a_off"][1] >= 0] // E)) <= sorted(ids1)
    empty = arena.tables([None, None])
    assert empty["lora_rank"].shape == (0,) and empty["lora_a_off"].shape == (0, 3, 8)
    with pytest.raises(LoraError, match="not loaded"):
        arena.tables([5])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pack_adapter_rounds_float32_as_numpy_does(dtype):
    """float32 rows packed into 16-bit pages are numpy's (ml_dtypes') round to nearest even, bit for
    bit, at the edges of the format too: ties, the overflow threshold, subnormals, signed zeros,
    infinities (NaN stays NaN); rows of every length, so that both the 8-wide hardware conversion
    and its scalar tail run."""
    import ml_dtypes

    np_dt = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, np.dtype(dtype))
    spec = make_spec(_tiny_cfg(), max_rank=8, pool_pages=40, target_modules=["q_proj", "v_proj", "down_proj"])
    ad = _fake_adapter(spec, 5, ["q_proj", "v_proj", "down_proj"], 7)
    tie = np.float32(1 + 2.0 ** -11)  # halfway between two float16 values: rounds to the even one
    special = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e30, np.inf, -np.inf, 2.0 ** -25,
                        2.0 ** -25 * 1.0001, 1.5 * 2.0 ** -24, 2.5 * 2.0 ** -24, -3e-6, 6.1e-5, 1e-40, tie,
                        np.nextafter(tie, np.float32(2)), 3.0e38, np.nan], np.float32)
    scale = np.float32(1e-3) if dtype == "bfloat16" else np.float32(1)
    for i, (l, m) in enumerate(sorted(ad.weights)):
        a, bt = ad.weights[l, m]
        a[i % a.shape[0], 3:3 + len(special)] = special
        bt[(i + 1) % bt.shape[0], -len(special) - i % 3:bt.shape[1] - i % 3] = special * scale
    got = reference_unpack_bits(spec, pack_adapter(spec, ad, np_dt))
    for (l, m), (a, bt) in ad.weights.items():
        for rows, name in ((a, "A"), (bt, "B^T")):
            with np.errstate(over="ignore"):
                want = rows.astype(np_dt)
            nan = np.isnan(rows)
            np.testing.assert_array_equal(np.isnan(got[l, m, name].astype(np.float32)), nan)
            np.testing.assert_array_equal(got[l, m, name].view(np.uint16)[~nan], want.view(np.uint16)[~nan],
                                          err_msg=f"layer {l} {m} {name}")


def _targeted_rows(spec, packed):
    """(layer, module, "A" | "B^T", the rows' offsets, their length) of every targeted module."""
    for mi, m in enumerate(spec.modules):
        if packed.scale[mi] == 0:
            continue
        for l in range(packed.pages.shape[0]):
            yield l, m.name, "A", packed.a_off[mi, :packed.rank], m.in_features
            yield l, m.name, "B^T", packed.b_off[mi, :packed.rank], m.out_features


def reference_unpack_bits(spec, packed):
    """Every targeted row of a packed adapter as stored (the pages' dtype, no widening)."""
    pages = packed.pages.reshape(packed.pages.shape[0], -1)
    return {(l, m, name): np.stack([pages[l, o:o + width] for o in offs])
            for l, m, name, offs, width in _targeted_rows(spec, packed)}


def test_pack_adapter_refuses_what_was_not_compiled():
    spec = make_spec(_tiny_cfg(), max_rank=4, pool_pages=8, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="rank 8, above the compiled --max-lora-rank 4"):
        pack_adapter(spec, _fake_adapter(spec, 8, ["q_proj"], 0), np.float32)
    bad = _fake_adapter(spec, 2, ["q_proj"], 0)
    bad.modules.append("v_proj")
    with pytest.raises(LoraError, match=r"targets \['v_proj'\], which the model was not compiled for"):
        pack_adapter(spec, bad, np.float32)
    arena = NumpyArena(spec, np.float32)
    big = pack_adapter(make_spec(_tiny_cfg(), 4, 8), _fake_adapter(make_spec(_tiny_cfg(), 4, 8), 4, ["q_proj"], 0),
                       np.float32)
    arena.free = arena.free[:0]
    with pytest.raises(LoraError, match="free pages"):
        arena.load(1, big)


@pytest.mark.parametrize("kw, msg", [
    (dict(target_modules=["q_proj", "lm_head"]), "unknown LoRA target module"),
    (dict(kernel="bgmv"), "unknown LoRA kernel"),
    (dict(max_rank=0), "max-lora-rank must be >= 1"),
    (dict(pool_pages=0), "lora-pool-pages must be >= 1"),
    (dict(pool_pages=2**21), "exceeds 2\\^31"),
    (dict(rows="fp8", kernel="sgmv"), "unknown adapter row format 'fp8'"),
    (dict(rows="int8", kernel="gather"), "int8 adapter rows need the sgmv kernel"),
])
def test_make_spec_refuses_bad_options(kw, msg):
    args = dict(max_rank=8, pool_pages=4) | kw
    with pytest.raises(LoraError, match=msg):
        make_spec(_tiny_cfg(), **args)


def test_spec_json_round_trip():
    spec = make_spec(_tiny_cfg(), max_rank=16, pool_pages=12, kernel="single")
    assert LoraSpec.from_json(spec.to_json()) == spec
    int8 = make_spec(_tiny_cfg(), max_rank=16, pool_pages=12, kernel="sgmv", rows="int8")
    assert LoraSpec.from_json(int8.to_json()) == int8 and int8.rows == "int8"
    assert spec.arena_elems == 2 * 12 * 1024


def test_layout_int8_rows_leave_room_for_their_scales():
    """int8 rows take their scale's 16 bytes and their values padded to 16 bytes; offsets point at
    the values, 16-byte aligned, and no row (with its scale) crosses a page or overlaps another."""
    rng = np.random.default_rng(1)
    for elem_bytes in (2, 4):
        for _ in range(20):
            E = int(rng.integers(16, 200)) * 16 // elem_bytes
            mods = [LoraModule(f"m{i}", int(rng.integers(1, E)), int(rng.integers(1, E)))
                    for i in range(int(rng.integers(1, 6)))]
            r = int(rng.integers(1, 9))
            lay = layout_adapter(E, mods, r, "int8", elem_bytes)
            lead = INT8_ROW_ALIGN // elem_bytes
            used = np.zeros(lay.num_pages * E, int)
            for (name, ab, k), off in lay.offsets.items():
                m = next(x for x in mods if x.name == name)
                n = m.in_features if ab == "A" else m.out_features
                size = (INT8_ROW_ALIGN + -(-n // INT8_ROW_ALIGN) * INT8_ROW_ALIGN) // elem_bytes
                assert size == layout.row_elems(n, "int8", elem_bytes)
                assert off * elem_bytes % INT8_ROW_ALIGN == 0
                start = off - lead
                assert start // E == (start + size - 1) // E, "a row crosses a page"
                used[start:start + size] += 1
            assert used.max() == 1 and used.sum() == lay.used_elems
            assert layout.lower_bound_pages(E, mods, r, "int8", elem_bytes) <= lay.num_pages
    # a 7B layer's rows take half the pages: rank 16 on all 7 modules, 10 pages in fp16, 5 in int8
    mods7b = [LoraModule(n, i, o) for n, (i, o) in layout.module_shapes(LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
        num_hidden_layers=1, vocab_size=32000)).items()]
    assert layout_adapter(131072, mods7b, 16).num_pages == 10
    assert layout_adapter(131072, mods7b, 16, "int8", 2).num_pages == 5


def read_int8_rows(spec, packed):
    """Every targeted row of an int8-row adapter: (q int8 (rank, n), s float32 (rank,)) as stored."""
    raw = np.ascontiguousarray(packed.pages).view(np.uint8).reshape(packed.pages.shape[0], -1)
    eb = packed.pages.dtype.itemsize
    out = {}
    for l, m, name, offs, width in _targeted_rows(spec, packed):
        q = np.stack([raw[l, o * eb:o * eb + width].view(np.int8) for o in offs])
        lead = INT8_ROW_ALIGN  # the scale's bytes before the values: the float32, then zeros
        s = np.array([raw[l, o * eb - lead:o * eb - lead + 4].view(np.float32)[0] for o in offs], np.float32)
        assert all((raw[l, o * eb - lead + 4:o * eb] == 0).all() for o in offs)
        out[l, m, name] = (q, s)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_pack_adapter_int8_rows_are_quantize_rows(dtype):
    """The runtime's int8 packing equals quantize_rows bit for bit (ties to even, a zero row, a row
    of one large value), on pages of every dtype; dequantized, a row is within half a step of the
    float32 row."""
    import ml_dtypes

    np_dt = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, np.dtype(dtype))
    spec = make_spec(_tiny_cfg(), max_rank=8, pool_pages=40, target_modules=["q_proj", "v_proj", "down_proj"],
                     kernel="sgmv", rows="int8")
    ad = _fake_adapter(spec, 5, ["q_proj", "v_proj", "down_proj"], 3)
    a, bt = ad.weights[0, "q_proj"]
    a[0] = 0.0
    a[1, :4] = [127.0, 0.5, 1.5, -2.5]  # s = 1: ties to even give 0, 2, -2
    a[1, 4:] = 0.0
    bt[2, 5] = 1e30
    got = read_int8_rows(spec, pack_adapter(spec, ad, np_dt))
    assert got[0, "q_proj", "A"][0][1, :4].tolist() == [127, 0, 2, -2]
    for (l, m), (a, bt) in ad.weights.items():
        for rows, name in ((a, "A"), (bt, "B^T")):
            q, s = got[l, m, name]
            want_q, want_s = layout.quantize_rows(rows)
            np.testing.assert_array_equal(s, want_s, err_msg=f"layer {l} {m} {name}")
            np.testing.assert_array_equal(q, want_q, err_msg=f"layer {l} {m} {name}")
            err = np.abs(q.astype(np.float32) * s[:, None] - rows)
            assert (err <= s[:, None] * 0.5 * (1 + 1e-6)).all()
    nan = _fake_adapter(spec, 2, ["q_proj"], 4)
    nan.weights[1, "q_proj"][1][1, 3] = np.nan
    with pytest.raises(LoraError, match="q_proj layer 1 lora_B holds a value that is not finite"):
        pack_adapter(spec, nan, np_dt)
