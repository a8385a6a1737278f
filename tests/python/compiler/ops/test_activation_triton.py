"""ops/activation_triton.py: silu(gate) * up on one Triton kernel, run on the CPU under Triton's
interpreter against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from mlc_lora.compiler_passes.ops.activation_triton import block_cols, silu_mul_ref, supported  # noqa: E402

from .lora.conftest import interpret  # noqa: E402


@pytest.mark.parametrize("dtype,ldh", [(np.float32, 48), (np.float16, 48), (np.float16, 48 + 32)])
def test_silu_mul_kernel_matches_reference(tmp_path, dtype, ldh):
    """h = silu(gate) * up over 37 tokens (a partial block) of 2 x 48; also into the first 48 columns
    of rows 80 apart (the rank columns route's [x | s]), the columns past them left alone."""
    y = (np.random.default_rng(6).standard_normal((37, 96)) * 3).astype(dtype)
    h = interpret(tmp_path, gate_up=y, ldh=ldh)["h"]
    got = h[:, :48].astype(np.float64)
    np.testing.assert_allclose(got, silu_mul_ref(y), rtol=1e-5 if dtype == np.float32 else 2e-3, atol=1e-6)
    assert np.isnan(h[:, 48:]).all()


def test_supported_names_what_it_cannot_run():
    assert supported("float16", 11008) is None and block_cols(11008) == 256 and block_cols(1536) == 256
    assert "float32" in supported("float32", 11008)
    assert "multiple of 16" in supported("bfloat16", 100)
