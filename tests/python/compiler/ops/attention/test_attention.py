"""The paged attention op (compiler_passes/ops/attention): its numpy reference against torch SDPA,
attention.cu on the CPU emulation of its CUDA instructions (cp.async, ldmatrix, mma.sync, warp
shuffles, the split-KV merge) against that reference, what the CUDA kernels support, and the pool
cache's side of the "mlc_lora" kernel contract (argument order, max query length, split-KV split
count and keys per split), by compiling a tiny llvm model whose mlc_lora kernels are numpy
stand-ins, against the same model on TVM's kernels. On a GPU, scripts/bench_attention.py checks
the built kernels against the reference before it times them.
"""

import subprocess

import numpy as np
import pytest
import torch
import tvm_ffi

from mlc_lora.compiler_passes.ops.attention import attention_cuda
from mlc_lora.compiler_passes.ops.attention.reference import attention_ref

from mlc_lora.contract import PAGE_SIZE

from .stand_ins import Lockstep
from ... import emu
from ....conftest import needs_cxx


def random_pages(rng, q_lens, kv_lens, hq, hkv, d):
    n_pages = [-(-kv // 16) for kv in kv_lens]
    pages = rng.standard_normal((sum(n_pages) + 3, 2, hkv, 16, d)).astype(np.float32)
    page_indices = rng.permutation(len(pages))[:sum(n_pages)].astype(np.int32)
    page_indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([kv - (n - 1) * 16 for kv, n in zip(kv_lens, n_pages)], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((sum(q_lens), hq, d)).astype(np.float32)
    return q, qo_indptr, pages, page_indptr, page_indices, last


def test_reference_matches_torch_sdpa():
    """Ragged prefill with and without cached prefixes, GQA 3:1, against SDPA in float64."""
    rng = np.random.default_rng(0)
    hq, hkv, d = 6, 2, 8
    q_lens, kv_lens = [5, 1, 17, 3], [5, 9, 40, 20]
    q, qo, pages, pind, pidx, last = random_pages(rng, q_lens, kv_lens, hq, hkv, d)
    o, lse = attention_ref(q, qo, pages, pind, pidx, last, 0.3)
    for s, (ql, kv) in enumerate(zip(q_lens, kv_lens)):
        pg = pidx[pind[s]:pind[s + 1]]
        k = torch.from_numpy(pages[pg, 0]).permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :kv].double()
        v = torch.from_numpy(pages[pg, 1]).permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :kv].double()
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
        qs = torch.from_numpy(q[qo[s]:qo[s + 1]]).double().transpose(0, 1)
        mask = torch.arange(kv)[None, :] <= torch.arange(ql)[:, None] + kv - ql
        ref = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=0.3)
        np.testing.assert_allclose(o[qo[s]:qo[s + 1]], ref.transpose(0, 1).numpy(), atol=1e-5)
        logits = (qs @ k.transpose(1, 2) * 0.3).masked_fill(~mask, float("-inf"))
        np.testing.assert_allclose(lse[qo[s]:qo[s + 1]].T, (torch.logsumexp(logits, -1) / np.log(2)).numpy(),
                                   atol=1e-4)


@pytest.fixture(scope="module")
def attention_emu(tmp_path_factory):  # (two builds: fp16 at d 64, bf16 at d 128)
    out_dir = tmp_path_factory.mktemp("attention_emu")
    return lambda dtype, d: emu.build("attention_emu.cc", out_dir / f"attention_emu_{dtype}_{d}", attention_cuda.SOURCE,
                                      dtype, {"MLC_HEAD_DIM": d, "MLC_PAGE_SIZE": PAGE_SIZE})


def _run_emu(exe, tmp_path, dtype, mode, q_lens, kv_lens, hq, hkv, d, seed, splits=3):
    """attention.cu's kernel on the emulation (`mode`: prefill, or a decode kernel: decode, pipe2,
    pipe4; decode over about `splits` splits) and the reference on the same rounded inputs: (o, lse,
    ref o, ref lse, counters or None, the splits)."""
    import ml_dtypes

    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    q, qo, pages, pind, pidx, last = random_pages(np.random.default_rng(seed), q_lens, kv_lens, hq, hkv, d)
    q, pages = q.astype(np_dt), pages.astype(np_dt)
    sm_scale = d ** -0.5
    for name, a in dict(q=q, qo_indptr=qo, pages=pages, page_indptr=pind, page_indices=pidx,
                        last_page_len=last).items():
        a.tofile(tmp_path / name)
    if mode == "prefill":
        k1, k2 = max(q_lens), 0
    else:  # as the pool cache splits: whole pages per split, every split holding keys of the longest
        k2 = -(-max(kv_lens) // splits // PAGE_SIZE) * PAGE_SIZE
        k1 = -(-max(kv_lens) // k2)
    args = (len(q), len(q_lens), hq, hkv, len(pages), len(pidx), k1, k2, sm_scale * 1.4426950408889634)
    subprocess.run([str(exe), str(tmp_path), mode, *map(str, args)], check=True, timeout=600)
    o = np.fromfile(tmp_path / "o", np_dt).reshape(q.shape).astype(np.float32)
    lse = np.fromfile(tmp_path / "lse", np.float32).reshape(q.shape[:2])
    ref_o, ref_lse = attention_ref(q.astype(np.float32), qo, pages.astype(np.float32), pind, pidx, last, sm_scale)
    counters = np.fromfile(tmp_path / "counters", np.int32) if mode != "prefill" else None
    return o, lse, ref_o, ref_lse, counters, k1


@needs_cxx
@pytest.mark.parametrize("dtype,d,hq,hkv,q_lens,kv_lens", [
    # ragged, a cached prefix, a sequence of 100 rows (two row blocks), 150 keys (three key tiles,
    # the causal tile and one past the end masked), GQA 2:1
    ("float16", 64, 4, 2, [5, 100, 1, 17], [5, 150, 9, 40]),
    ("bfloat16", 128, 2, 2, [70, 3], [70, 131]),
])
def test_prefill_cu_on_cpu_emulation(attention_emu, tmp_path, dtype, d, hq, hkv, q_lens, kv_lens):
    o, lse, ref_o, ref_lse, _, _ = _run_emu(attention_emu(dtype, d), tmp_path, dtype, "prefill", q_lens, kv_lens,
                                            hq, hkv, d, seed=d + len(q_lens))
    _assert_near(dtype, o, lse, ref_o, ref_lse)


def _assert_near(dtype, o, lse, ref_o, ref_lse, what=""):
    """P and the output are rounded to the dtype (fp32 sums): ~2^-11 / 2^-8 relative."""
    tol = 2e-3 if dtype == "float16" else 1.5e-2
    assert np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o) < tol, what
    np.testing.assert_allclose(o, ref_o, rtol=0, atol=8 * tol * np.abs(ref_o).max())
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-3)


DECODE_KERNELS = ("decode", "pipe2", "pipe4")  # mlc_lora_attn_decode and its pipelined variants


@needs_cxx
@pytest.mark.parametrize("dtype,d,hq,hkv,kv_lens,splits", [
    # 3 splits of whole pages: the longest context fills them, the shortest (5 keys) only the
    # first, so the last block of its pairs merges empty splits
    ("float16", 64, 4, 2, [5, 70, 130], 3),
    ("bfloat16", 128, 2, 1, [33, 48, 17], 3),
    # one split: 300 keys are 10-38 rounds of loads (odd and even counts, a partial last round)
    ("float16", 64, 2, 2, [300, 7, 161], 1),
    ("bfloat16", 128, 2, 2, [300, 7, 161], 1),
])
def test_decode_cu_on_cpu_emulation(attention_emu, tmp_path, dtype, d, hq, hkv, kv_lens, splits):
    """Every decode kernel against the reference; the pipelined ones, which add the same rows in
    the same order, equal the plain kernel bit for bit."""
    first = None
    for kernel in DECODE_KERNELS:
        o, lse, ref_o, ref_lse, counters, n = _run_emu(attention_emu(dtype, d), tmp_path, dtype, kernel,
                                                       [1] * len(kv_lens), kv_lens, hq, hkv, d, seed=d, splits=splits)
        assert n == splits  # (> 1: the merge ran)
        _assert_near(dtype, o, lse, ref_o, ref_lse, kernel)
        assert not counters.any()  # the last block of each pair set its counter back to 0
        if first is None:
            first = o, lse
        else:
            np.testing.assert_array_equal(o, first[0], err_msg=kernel)
            np.testing.assert_array_equal(lse, first[1], err_msg=kernel)


def test_decode_wrapper_launches_the_named_kernel(monkeypatch):
    def launched(kernel=None):
        script = attention_cuda.decode_wrapper("float16", 128, 32, 8, kernel).script()
        return [k for k in attention_cuda.DECODE_KERNELS if f'"{k}"' in script]

    for kernel in attention_cuda.DECODE_KERNELS:
        assert launched(kernel) == [kernel]
    assert launched() == [attention_cuda.DECODE_KERNEL] == ["mlc_lora_attn_decode"]  # the default, until timed
    # the default is read when a wrapper is made (bench_lora_throughput.py compile --attention-decode)
    monkeypatch.setattr(attention_cuda, "DECODE_KERNEL", "mlc_lora_attn_decode_pipe2")
    assert launched() == ["mlc_lora_attn_decode_pipe2"]
    with pytest.raises(ValueError, match="decode kernel 'mlc_lora_attn_decode_pipe3'"):
        attention_cuda.decode_wrapper("float16", 128, 32, 8, "mlc_lora_attn_decode_pipe3")


def test_supported_says_why_not():
    assert attention_cuda.supported("float16", 128, 32, 8) is None
    assert "head_dim 96" in attention_cuda.supported("float16", 96, 32, 8)
    assert "float32" in attention_cuda.supported("float32", 128, 32, 8)
    assert "group" in attention_cuda.supported("bfloat16", 64, 6, 4)
    with pytest.raises(ValueError, match="head_dim 80"):
        attention_cuda.build("float16", 80, 8, 8, "sm_90a")


# ---------------------------------------------------------------------------------------------
# The cache's side of the contract, on CPU: numpy stand-ins for the mlc_lora kernels.

class _NumpyKernels:
    """The mlc_lora signatures (attention_cuda._prefill / decode_wrapper) in numpy. Decode follows the
    split-KV contract: split k covers keys [k * chunk, (k + 1) * chunk) and the partials merge."""

    def __init__(self):
        self.calls = {"prefill": 0, "decode": 0}
        self.splits_seen = set()

    def prefill(self, q, qo, pages, pind, pidx, last, o, lse, max_q_len, sm_scale):
        qo_np = qo.numpy()
        assert max_q_len == int(np.diff(qo_np).max())
        out, ls = attention_ref(q.numpy(), qo_np, pages.numpy(), pind.numpy(),
                                                  pidx.numpy(), last.numpy(), sm_scale)
        o.copyfrom(out.astype(o.dtype))
        lse.copyfrom(ls)
        self.calls["prefill"] += 1

    def decode(self, q, pages, pind, pidx, last, o, lse, part_o, part_lse, counters, num_splits, chunk,
               sm_scale):
        qn, pages, pind, pidx, last = q.numpy(), pages.numpy(), pind.numpy(), pidx.numpy(), last.numpy()
        b, hq, d = qn.shape
        kv_lens = [(pind[s + 1] - pind[s] - 1) * 16 + last[s] for s in range(b)]
        assert chunk % 16 == 0 and (num_splits - 1) * chunk < max(kv_lens) <= num_splits * chunk
        assert part_o.shape[0] >= num_splits * b * hq * d and part_lse.shape[0] >= num_splits * b * hq
        assert counters.shape[0] >= b * hq and not counters.numpy().any()
        self.splits_seen.add(num_splits)
        out = np.zeros((b, hq, d), np.float32)
        for s in range(b):
            pg = pidx[pind[s]:pind[s + 1]]
            hkv = pages.shape[2]
            k = pages[pg, 0].transpose(1, 0, 2, 3).reshape(hkv, -1, d)
            v = pages[pg, 1].transpose(1, 0, 2, 3).reshape(hkv, -1, d)
            for h in range(hq):
                kvh = h // (hq // hkv)
                parts = []
                for sp in range(num_splits):
                    lo, hi = sp * chunk, min(kv_lens[s], (sp + 1) * chunk)
                    if lo >= hi:
                        continue
                    sc = k[kvh, lo:hi] @ qn[s, h] * sm_scale
                    m = sc.max()
                    p = np.exp(sc - m)
                    parts.append((m + np.log(p.sum()), p @ v[kvh, lo:hi] / p.sum()))
                big = max(x[0] for x in parts)
                w = np.array([np.exp(x[0] - big) for x in parts])
                out[s, h] = sum(wi * x[1] for wi, x in zip(w, parts)) / w.sum()
        o.copyfrom(out.astype(o.dtype))
        self.calls["decode"] += 1


def test_pool_cache_drives_mlc_lora_kernels(tiny_models, tmp_path):
    """Logits of ragged prefill (with a cached prefix) and decode at contexts that split, through
    the mlc_lora contract, equal the same model on TVM's TIR kernels."""
    kernels = _NumpyKernels()
    tvm_ffi.register_global_func("mlc_lora_test.attn_prefill", kernels.prefill, override=True)
    tvm_ffi.register_global_func("mlc_lora_test.attn_decode", kernels.decode, override=True)
    _, base_dir = tiny_models["gqa"]
    both = Lockstep(base_dir, tmp_path, {16: "mlc_lora_test.attn_prefill", 17: "mlc_lora_test.attn_decode"}, seed=0)
    ref, step = both.ref, both.step

    step([0, 1, 2], [150, 7, 40])  # ragged prefill
    step([2, 0], [90, 5])  # chunked prefill over cached prefixes
    for _ in range(3):
        step([0, 1, 2], [1, 1, 1])  # decode: 155+ keys for 3 x 4 heads -> several splits
    step([1], [1])  # one sequence alone
    assert kernels.calls["prefill"] == 2 * ref.model_config["num_hidden_layers"]
    assert kernels.calls["decode"] == 4 * ref.model_config["num_hidden_layers"]
    assert max(kernels.splits_seen) > 1
