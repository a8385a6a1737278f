"""ops/norm_triton.py: the RMSNorm of the hidden state, with the residual add before it, on one
Triton kernel, run on the CPU under Triton's interpreter against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from mlc_lora.compiler_passes.ops.norm_triton import MAX_K, rms_norm_ref, supported  # noqa: E402

from .lora.conftest import interpret  # noqa: E402


@pytest.mark.parametrize("dtype,K,ldo,residual", [
    (np.float16, 576, 576, False), (np.float16, 512, 512, False), (np.float16, 576, 576 + 96, False),
    (np.float16, 576, 576, True), (np.float32, 512, 512, True), (np.float16, 576, 576 + 96, True)])
def test_rms_norm_matches_reference(tmp_path, dtype, K, ldo, residual):
    """x: rms_norm_ref's, rounded once, for rows of a power of two and not (the masked tail), also
    into wider rows (the rank columns route's [x | s]: the columns past K left alone); with the
    residual add the sum is h + r rounded once and x is the norm of that rounded sum."""
    rng = np.random.default_rng(7)
    h = (rng.standard_normal((5, K)) * 3).astype(dtype)
    r = (rng.standard_normal((5, K)) * 3).astype(dtype)
    g = rng.uniform(0.5, 1.5, K).astype(dtype)
    out = interpret(tmp_path, norm_rows=h, g=g, eps=1e-5, ldo=ldo, **({"r": r} if residual else {}))
    h1, ref = rms_norm_ref(h, g, 1e-5, r if residual else None)
    np.testing.assert_allclose(out["x"][:, :K].astype(np.float64), ref.astype(dtype).astype(np.float64),
                               rtol=2 * np.finfo(dtype).eps, atol=1e-6)
    assert np.isnan(out["x"][:, K:]).all()
    if residual:
        np.testing.assert_array_equal(out["h1"], h1)
        # the sum is not h: the reference's x differs from the norm of h alone
        assert not np.allclose(ref, rms_norm_ref(h, g, 1e-5)[1], rtol=1e-2)
    else:
        assert np.isnan(out["h1"]).all()  # no sum written


def test_supported_names_what_it_cannot_run():
    assert supported("float16", 4096) is None and supported("bfloat16", MAX_K) is None
    assert "float32" in supported("float32", 4096)
    assert str(MAX_K) in supported("float16", 2 * MAX_K)
