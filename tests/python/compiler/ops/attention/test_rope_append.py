"""ops/attention/rope_append_triton.py: RoPE of q and k and the append of k and v to the pages in
one Triton kernel, run on the CPU under Triton's interpreter against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from mlc_lora.compiler_passes.ops.attention.rope_append_triton import rope_append_ref, supported  # noqa: E402

from ..lora.conftest import interpret  # noqa: E402


@pytest.mark.parametrize("dtype,hq,hkv,d,scale", [(np.float32, 4, 2, 32, 1.0), (np.float16, 9, 3, 64, 1.0),
                                                   (np.float16, 4, 4, 16, 0.5)])
def test_rope_append_matches_reference(tmp_path, dtype, hq, hkv, d, scale):
    """q roped, k roped into its pages, v copied into its pages, at positions and page slots in no
    order (decode tokens of several sequences, a prefill chunk past position 0); a token with slot
    -1 writes no page; the other slots of the pages keep what they held. Grouped queries (hq 9 over
    hkv 3: the blocks of BH heads straddle q, k and v)."""
    rng = np.random.default_rng(11)
    n, pages_n = 21, 6
    qkv = rng.standard_normal((n, hq + 2 * hkv, d)).astype(dtype)
    pos = rng.integers(0, 3000, n).astype(np.int32)
    app = rng.permutation(pages_n * 16)[:n].astype(np.int32)
    app[5] = -1
    pages = rng.standard_normal((pages_n, 2, hkv, 16, d)).astype(dtype)
    out = interpret(tmp_path, rope_qkv=qkv, pos=pos, app=app, pages=pages, hq=hq, hkv=hkv, scale=scale,
                    theta=10000.0)
    q_ref, pages_ref = rope_append_ref(qkv, pos, app, pages, hq, hkv, scale, 10000.0)
    # the angle pos * f_j is float32 (as TVM's kernel): at positions near 3000 its rounding alone
    # moves the result by ~2e-4 x |x|
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == np.float32 else dict(rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(out["q"].astype(np.float64), q_ref, **tol)
    np.testing.assert_allclose(out["pages"].astype(np.float64), pages_ref, **tol)
    # v is copied, not rounded again: its slots hold qkv's bits
    p, o = divmod(int(app[0]), 16)
    np.testing.assert_array_equal(out["pages"][p, 1, :, o], qkv[0, hq + hkv:])
    # the reference itself: position 0 leaves q as it is, and RoPE keeps each pair's norm
    q0, _ = rope_append_ref(qkv[:1], np.zeros(1, np.int32), np.array([-1], np.int32), pages, hq, hkv, scale, 1e4)
    np.testing.assert_allclose(q0, qkv[:1, :hq].astype(np.float64))
    half = d // 2
    x = qkv[:, :hq].astype(np.float64)
    np.testing.assert_allclose(q_ref[..., :half] ** 2 + q_ref[..., half:] ** 2, x[..., :half] ** 2 + x[..., half:] ** 2,
                               rtol=1e-9)


def test_supported_names_what_it_cannot_run():
    assert supported("float16", 128) is None and supported("bfloat16", 64) is None
    assert "float32" in supported("float32", 128)
    assert "power of two" in supported("float16", 96)
