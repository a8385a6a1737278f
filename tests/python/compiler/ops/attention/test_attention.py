"""The paged attention op (compiler_passes/ops/attention): its numpy reference against torch SDPA,
what the CUDA kernels support, and the pool cache's side of the "mlc_lora" kernel contract
(argument order, max query length, split-KV split count and keys per split), by compiling a tiny
llvm model whose mlc_lora kernels are numpy stand-ins, against the same model on TVM's kernels.
The kernels themselves run in test_attention_gpu (skipped without a GPU) and
scripts/bench_attention.py.
"""

import numpy as np
import pytest
import torch
import tvm_ffi

from mlc_lora.compiler_passes.ops.attention import attention_cuda
from mlc_lora.compiler_passes.ops.attention.reference import attention_ref

from .stand_ins import Lockstep


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
    """The mlc_lora signatures (attention_cuda._prefill / _decode) in numpy. Decode follows the
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
