"""The on-device sampling kernels (compiler_passes/ops/sampler/sampler_tir.py, attached by
compiler_passes/passes/attach_sampler.py) against their numpy references (ops/sampler/reference.py)."""

import numpy as np
import pytest
import tvm
from tvm import relax

from mlc_lora.compiler_passes.ops.sampler import reference as S
from mlc_lora.compiler_passes.passes import AttachSampler

from ....conftest import needs_nvcc


def _cuda_target():
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")


_DEV = {}


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def vm(request):
    """The sampling functions built alone: plain loops on llvm, thread-bound kernels on a GPU
    (skipped where none is visible)."""
    if request.param == "cuda":
        request.getfixturevalue("cuda_device")
    if request.param == "cpu":
        target = tvm.target.Target("llvm")
        ex = tvm.compile(AttachSampler(target)(tvm.IRModule()), target,
                         relax_pipeline=relax.get_pipeline("default"))
    else:
        target = _cuda_target()
        with target:
            ex = tvm.compile(AttachSampler(target)(tvm.IRModule()), target,
                             relax_pipeline=relax.get_default_pipeline(target))
    _DEV["dev"] = tvm.cpu() if request.param == "cpu" else tvm.cuda(0)
    return relax.VirtualMachine(ex, _DEV["dev"])


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a), _DEV["dev"])


@needs_nvcc
def test_gpu_kernels_build_to_cubin(tmp_path):
    """The thread-bound variants compile for sm_90a (they run in the cuda-parametrized tests on a GPU)."""
    from mlc_lora.compile import _check_cubin, prepare_cuda_build

    prepare_cuda_build()
    target = _cuda_target()
    mod = AttachSampler(target)(tvm.IRModule())
    for name in ("sample_argmax_kernel", "sample_top_p_kernel", "top_logprobs_kernel", "chosen_logprobs_kernel",
                 "process_logits_kernel"):
        assert mod[name].attrs["tirx.is_scheduled"]
    with target:
        ex = tvm.compile(mod, target, relax_pipeline=relax.get_default_pipeline(target))
    ex.export_library(str(tmp_path / "sampler.so"))
    _check_cubin(tmp_path / "sampler.so")


def _logits(rng, b, v):
    x = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    x[0, 7] = x[0, 3] = x[0].max() + 1.0  # a tie at the top: the lower index wins
    x[1, :] = np.float32(0.5)  # a flat row
    return x


def test_argmax_and_logprobs(vm):
    rng = np.random.default_rng(0)
    x = _logits(rng, 9, 301)
    np.testing.assert_array_equal(vm["sample_argmax"](_t(x)).numpy(), S.sample_argmax_ref(x))
    tok = rng.integers(0, 301, 9).astype(np.int32)
    np.testing.assert_allclose(vm["chosen_logprobs"](_t(x), _t(tok)).numpy(),
                               S.chosen_logprobs_ref(x, tok), atol=2e-5, rtol=0)
    ids, lp = vm["top_logprobs"](_t(x))
    rid, rlp = S.top_logprobs_ref(x)
    np.testing.assert_array_equal(ids.numpy(), rid)
    np.testing.assert_allclose(lp.numpy(), rlp, atol=2e-5, rtol=0)


def test_top_p_top_k_sampling_matches_reference(vm):
    rng = np.random.default_rng(1)
    x = _logits(rng, 12, 257)
    for _ in range(25):
        temp = rng.uniform(0.3, 2.0, 12).astype(np.float32)
        top_p = rng.uniform(0.1, 1.0, 12).astype(np.float32)
        top_p[:3] = 1.0
        top_k = rng.integers(-1, 40, 12).astype(np.int32)
        top_k[3] = 0
        u = rng.uniform(0, 1, 12).astype(np.float32)
        got = vm["sample_top_p"](_t(x), _t(temp), _t(top_p), _t(top_k), _t(u)).numpy()
        np.testing.assert_array_equal(got, S.sample_top_p_ref(x, temp, top_p, top_k, u))


def test_sampling_edge_cases(vm):
    rng = np.random.default_rng(2)
    x = _logits(rng, 6, 100)
    ones = np.ones(6, np.float32)
    # top_k = 1 is greedy whatever the draw (ties at the top are all kept: rows 0 and 1)
    got = vm["sample_top_p"](_t(x), _t(ones), _t(ones), _t(np.ones(6, np.int32)),
                             _t(rng.uniform(0, 1, 6).astype(np.float32))).numpy()
    np.testing.assert_array_equal(got[2:], S.sample_argmax_ref(x)[2:])
    assert got[0] in (3, 7)
    # u -> 0 picks the first kept token in vocabulary order, u -> 1 the last
    keep_all = np.zeros(6, np.int32)
    first = vm["sample_top_p"](_t(x), _t(ones), _t(ones), _t(keep_all), _t(np.zeros(6, np.float32))).numpy()
    np.testing.assert_array_equal(first, np.zeros(6))
    last = vm["sample_top_p"](_t(x), _t(ones), _t(ones), _t(keep_all),
                              _t(np.full(6, np.nextafter(np.float32(1), np.float32(0))))).numpy()
    np.testing.assert_array_equal(last, np.full(6, 99))


def test_sampling_frequencies_follow_softmax(vm):
    """The draw is a real sample: over many uniforms the frequencies match softmax(x / T)."""
    x = np.array([[0.0, 1.0, 2.0, -1.0, 0.5]], np.float32)
    n = 4000
    u = (np.arange(n, dtype=np.float64) + 0.5) / n  # a stratified grid of draws
    xs = np.repeat(x, n, 0)
    temp = np.full(n, 0.7, np.float32)
    got = vm["sample_top_p"](_t(xs), _t(temp), _t(np.ones(n, np.float32)), _t(np.zeros(n, np.int32)),
                             _t(u.astype(np.float32))).numpy()
    p = np.exp(x[0] / 0.7) / np.exp(x[0] / 0.7).sum()
    np.testing.assert_allclose(np.bincount(got, minlength=5) / n, p, atol=2e-3)


def test_process_logits(vm):
    """Penalties, logit_bias and a grammar mask: listed pairs change, masked entries fall to
    -3.4e38 (a listed pair that is masked too stays masked), the rest is copied."""
    rng = np.random.default_rng(3)
    b, v = 5, 301
    x = _logits(rng, b, v)
    w = (v + 31) // 32
    mask = np.full((b, w), -1, np.int32)  # every bit set: nothing masked
    bits = np.ones((b, w * 32), np.uint8)
    bits[2, rng.choice(v, 200, replace=False)] = 0  # row 2 follows a grammar
    bits[2, 11] = 0
    mask[2] = np.packbits(bits[2], bitorder="little").view(np.int32)
    pairs = [(0, 3), (0, 7), (0, 200), (2, 11), (3, 0), (3, 300), (4, 150)]
    rows = np.array([r for r, _ in pairs], np.int32)
    tokens = np.array([t for _, t in pairs], np.int32)
    bias = rng.uniform(-5, 5, len(pairs)).astype(np.float32)
    rep = rng.uniform(0.5, 2.0, len(pairs)).astype(np.float32)
    sub = rng.uniform(-1, 1, len(pairs)).astype(np.float32)
    out = vm["process_logits"](_t(x), _t(rows), _t(tokens), _t(bias), _t(rep), _t(sub), _t(mask)).numpy()
    want = S.process_logits_ref(x, rows, tokens, bias, rep, sub, mask)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)
    assert (out[2] == np.float32(-3.4e38)).sum() == 201 and out[2, 11] == np.float32(-3.4e38)
    untouched = np.ones((b, v), bool)
    untouched[rows, tokens] = False
    untouched[2] = bits[2, :v] == 1
    untouched[rows, tokens] = False
    np.testing.assert_array_equal(out[untouched], x[untouched])
