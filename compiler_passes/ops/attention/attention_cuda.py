"""Paged attention on tensor cores for CUDA (attention.cu beside this file) and the TIR wrappers
that launch it; reference.attention_ref is the plain numpy reference the tests compare it with.

TVM's TIR attention kernels run their prefill on SIMT FMAs (no tensor cores, 5.5 TFLOP/s at
16 x 512 tokens on the H200) and their decode with one block per (sequence, KV head), which
leaves most SMs idle at small batches (docs/GPU.md). These replace both on sm_80+ GPUs:
- prefill: FlashAttention-2 on mma.sync, causal (bottom-right aligned), reading K/V from pages;
- decode: split-KV ("flash-decoding"), the split count chosen per batch by the cache; the last
  block of each (sequence, head) merges the splits (one launch).

Semantics (both): o[i, h] = softmax_j(sm_scale * q[i, h] . K[j, kvh]) @ V[j, kvh] over the keys j
that query i may see (j <= i + kv_len - q_len), kvh = h // (h_q // h_kv); lse in base 2.
"""

from __future__ import annotations

from pathlib import Path

from tvm.script import tirx as T

from mlc_lora.contract import PAGE_SIZE

from .. import cuda_build

SOURCE = Path(__file__).parent / "attention.cu"
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
PREFILL_ROWS = 64  # query rows per prefill block (BM in attention.cu)
THREADS = 128
_LOG2E = 1.4426950408889634
# attention.cu's decode kernels, all of one signature and one result (the same bits): the plain
# split-KV kernel, and the variants that load a round of key rows while they sum the one before
# (2 or 4 rows of loads a thread a round). DECODE_KERNEL is the one the wrappers launch (read when
# a wrapper is made: scripts/bench_lora_throughput.py compile --attention-decode sets it); the
# others are for scripts/bench_attention.py to time beside it.
DECODE_KERNELS = ("mlc_lora_attn_decode", "mlc_lora_attn_decode_pipe2", "mlc_lora_attn_decode_pipe4")
DECODE_KERNEL = DECODE_KERNELS[0]


def supported(dtype: str, head_dim: int, num_qo_heads: int, num_kv_heads: int) -> str | None:
    """None when these kernels can run the model's attention, else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels are float16/bfloat16)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the kernels are built for {HEAD_DIMS})"
    if num_qo_heads % num_kv_heads:
        return f"{num_qo_heads} query heads do not group over {num_kv_heads} KV heads"
    return None


def decode_workspace_floats(max_batch: int, num_qo_heads: int, head_dim: int,
                            target_blocks: int) -> int:
    """fp32 elements of the split-KV partials: splits * b * h_q * d for the largest split count
    the cache picks (ceil(target_blocks / (b * h_q)) splits at most, so b * splits <=
    target_blocks / h_q + b)."""
    return (target_blocks + max_batch * num_qo_heads) * head_dim


def build(dtype: str, head_dim: int, num_qo_heads: int, num_kv_heads: int, arch: str,
          decode_kernel: str | None = None):
    """(prefill PrimFunc, decode PrimFunc, CUDA module) for one model's attention shape; the decode
    PrimFunc launches `decode_kernel` (None: DECODE_KERNEL; the module holds every one of
    DECODE_KERNELS)."""
    why = supported(dtype, head_dim, num_qo_heads, num_kv_heads)
    if why is not None:
        raise ValueError(f"no CUDA attention kernels for {why}")
    defines = {"MLC_HEAD_DIM": head_dim, "MLC_PAGE_SIZE": PAGE_SIZE}
    if dtype == "bfloat16":
        defines["MLC_BF16"] = None
    cubin = cuda_build.build_cubin(SOURCE, arch, defines)
    ptr, i32, f32 = "handle", "int32", "float32"
    module = cuda_build.cuda_module(cubin, {
        "mlc_lora_attn_prefill": [ptr] * 8 + [i32, i32, f32],
        **{k: [ptr] * 10 + [i32, i32, i32, f32] for k in DECODE_KERNELS},
    }, arch)
    return _prefill(dtype, head_dim, num_qo_heads, num_kv_heads), \
        decode_wrapper(dtype, head_dim, num_qo_heads, num_kv_heads, decode_kernel), module


def _prefill(dtype: str, D: int, HQ: int, HKV: int):  # pylint: disable=invalid-name
    """Signature: (q (n, h_q, d), qo_indptr (b+1,), pages (P, 2, h_kv, 16, d), page_indptr
    (b+1,), page_indices (m,), last_page_len (b,), o (n, h_q, d) [out], lse (n, h_q) [out],
    max_q_len: int32, sm_scale: float32)."""

    # pylint: disable=unused-variable
    @T.prim_func
    def attn_prefill(q_h: T.handle, qo_indptr_h: T.handle, pages_h: T.handle,
                     page_indptr_h: T.handle, page_indices_h: T.handle, last_h: T.handle,
                     o_h: T.handle, lse_h: T.handle, max_q_len: T.int32, sm_scale: T.float32):
        n, b, b1, p, m = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n, HQ, D), dtype)
        qo_indptr = T.match_buffer(qo_indptr_h, (b1,), "int32")
        pages = T.match_buffer(pages_h, (p, 2, HKV, PAGE_SIZE, D), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (b1,), "int32")
        page_indices = T.match_buffer(page_indices_h, (m,), "int32")
        last = T.match_buffer(last_h, (b,), "int32")
        o = T.match_buffer(o_h, (n, HQ, D), dtype)
        lse = T.match_buffer(lse_h, (n, HQ), "float32")
        T.call_packed("mlc_lora_attn_prefill", q.data, qo_indptr.data, pages.data,
                      page_indptr.data, page_indices.data, last.data, o.data, lse.data, HQ, HKV,
                      sm_scale * T.float32(_LOG2E),
                      (max_q_len + PREFILL_ROWS - 1) // PREFILL_ROWS, HQ, b, THREADS)

    return attn_prefill


def decode_wrapper(dtype: str, D: int, HQ: int, HKV: int,  # pylint: disable=invalid-name
                   kernel: str | None = None):
    """The PrimFunc that launches decode kernel `kernel` (one of DECODE_KERNELS; None:
    DECODE_KERNEL). Signature: (q (b, h_q, d), pages, page_indptr (b+1,), page_indices (m,),
    last_page_len (b,), o (b, h_q, d) [out], lse (b, h_q) [out], part_o (w,) f32, part_lse (w2,)
    f32, counters (w3,) int32 [workspace; counters zero before the first call, left zero after
    each], num_splits: int32, chunk: int32 (keys per split), sm_scale: float32)."""
    kernel = kernel or DECODE_KERNEL
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {kernel!r}: attention.cu has {', '.join(DECODE_KERNELS)}")

    # pylint: disable=unused-variable
    @T.prim_func
    def attn_decode(q_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle,
                    page_indices_h: T.handle, last_h: T.handle, o_h: T.handle, lse_h: T.handle,
                    part_o_h: T.handle, part_lse_h: T.handle, counters_h: T.handle,
                    num_splits: T.int32, chunk: T.int32, sm_scale: T.float32):
        b, b1, p, m = T.int32(), T.int32(), T.int32(), T.int32()
        w, w2, w3 = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (b, HQ, D), dtype)
        pages = T.match_buffer(pages_h, (p, 2, HKV, PAGE_SIZE, D), dtype)
        page_indptr = T.match_buffer(page_indptr_h, (b1,), "int32")
        page_indices = T.match_buffer(page_indices_h, (m,), "int32")
        last = T.match_buffer(last_h, (b,), "int32")
        o = T.match_buffer(o_h, (b, HQ, D), dtype)
        lse = T.match_buffer(lse_h, (b, HQ), "float32")
        part_o = T.match_buffer(part_o_h, (w,), "float32")
        part_lse = T.match_buffer(part_lse_h, (w2,), "float32")
        counters = T.match_buffer(counters_h, (w3,), "int32")
        T.call_packed(kernel, q.data, pages.data, page_indptr.data,
                      page_indices.data, last.data, o.data, lse.data, part_o.data,
                      part_lse.data, counters.data, HQ, HKV, chunk, sm_scale * T.float32(_LOG2E),
                      num_splits, HQ, b, THREADS)

    return attn_decode

