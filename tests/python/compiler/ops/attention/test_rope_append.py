"""ops/attention/rope_append_triton.py: RoPE of q and k and the append of k and v to the pages in
one kernel. The Triton kernel runs on the CPU under Triton's interpreter against the numpy
reference; the pool cache's side of the contract (the ["mlc_lora", f] split-rotary argument, the
call's arguments: positions, append slots, the layer's pages, scale and theta) by a tiny llvm model
whose kernel is the numpy reference, against the same model on TVM's split-rotary + append."""

from __future__ import annotations

import numpy as np
import pytest
import tvm_ffi

from mlc_lora.compiler_passes.ops.attention.rope_append_triton import rope_append_ref, supported
from mlc_lora.runner import ModelRunner

from ..lora.conftest import interpret
from .stand_ins import Lockstep


@pytest.mark.parametrize("dtype,hq,hkv,d,scale", [(np.float32, 4, 2, 32, 1.0), (np.float16, 9, 3, 64, 1.0),
                                                   (np.float16, 4, 4, 16, 0.5)])
def test_rope_append_matches_reference(tmp_path, dtype, hq, hkv, d, scale):
    pytest.importorskip("triton")
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


class _NumpyRopeAppend:
    """The kernel's stand-in: rope_append_ref on the cache's tensors (qkv, pos, app, pages, q, scale,
    theta), recording what it was given."""

    def __init__(self, hq, hkv):
        self.hq, self.hkv, self.calls, self.args, self.pos, self.app = hq, hkv, 0, set(), [], []

    def __call__(self, qkv, pos, app, pages, q, scale, theta):
        q_new, pages_new = rope_append_ref(qkv.numpy(), pos.numpy(), app.numpy(), pages.numpy(), self.hq, self.hkv,
                                           scale, theta)
        q.copyfrom(q_new.astype(q.dtype))
        pages.copyfrom(pages_new.astype(pages.dtype))
        self.calls += 1
        self.args.add((round(scale, 6), round(theta, 3)))
        self.pos.append(pos.numpy().tolist())
        self.app.append(app.numpy().tolist())


def test_pool_cache_drives_the_rope_append_kernel(tiny_models, tmp_path):
    """Logits of ragged prefill (over a cached prefix too) and decode, the cache calling one RoPE +
    append function per layer, equal the same model on TVM's split-rotary and append kernels."""
    _, base_dir = tiny_models["gqa"]
    mc = ModelRunner(base_dir).model_config
    kernel = _NumpyRopeAppend(mc["num_attention_heads"], mc["num_key_value_heads"])
    tvm_ffi.register_global_func("mlc_lora_test.rope_append", kernel, override=True)
    step = Lockstep(base_dir, tmp_path, {24: "mlc_lora_test.rope_append"}, seed=3).step

    step([0, 1, 2], [40, 7, 19])  # ragged prefill
    step([2, 0], [21, 5])  # chunked prefill after cached tokens (positions past 0, pages part full)
    for _ in range(3):
        step([0, 1, 2], [1, 1, 1])  # decode
    layers = mc["num_hidden_layers"]
    assert kernel.calls == 5 * layers
    assert kernel.args == {(1.0, round(float(mc.get("rope_theta", 10000.0)), 3))}
    # each layer's call gets the tokens' positions in their sequences and distinct page slots
    def r(a, b):
        return list(range(a, b))

    want = [r(0, 40) + r(0, 7) + r(0, 19), r(19, 40) + r(40, 45), [45, 7, 40], [46, 8, 41], [47, 9, 42]]
    assert kernel.pos == [p for p in want for _ in range(layers)]
    slots = [a for i in range(0, len(kernel.app), layers) for a in kernel.app[i]]
    assert len(slots) == len(set(slots)) == sum(len(p) for p in want) and min(slots) >= 0
    assert all(kernel.app[i] == kernel.app[i - i % layers] for i in range(len(kernel.app)))  # the same in every layer
