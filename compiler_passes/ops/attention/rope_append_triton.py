"""RoPE of the new queries and keys and their append to the pool's pages, as one Triton kernel.

Before attention each layer split qkv into q, k, v with RoPE applied to q and k (TVM's
`fused_rope`, its TIR kernel: 22.5 us at 512 Llama-2-7B tokens on an H100, ~33% of the memory
bandwidth) and then copied k and v into their pages (`tir_kv_cache_transpose_append`, 9.1 us): k
and v went through a buffer of their own between the two. This kernel reads qkv once, writes q
and writes k and v straight into the pages. DispatchAttention puts it in the pool cache's place of
the two (CUDA, fp16/bf16, Llama's RoPE: no scaling other than a linear position scale), in every
function of a library, base or LoRA.

Semantics (qkv (n, HQ + 2 HKV, D) model dtype; pos, app (n,) int32; pages (P, 2, HKV, PAGE_SIZE, D)):
  for token t, head h, j < D / 2, with f_j = (pos[t] * scale) / theta ** (2 j / D) (float32):
    x = qkv[t, h] as float32, r(x)[j] = x[j] cos f_j - x[j + D/2] sin f_j,
                              r(x)[j + D/2] = x[j + D/2] cos f_j + x[j] sin f_j
    q[t, h] = round(r(qkv[t, h]))                                  for h < HQ
    pages[p, 0, h - HQ, o] = round(r(qkv[t, h]))                   for HQ <= h < HQ + HKV
    pages[p, 1, h - HQ - HKV, o] = qkv[t, h]                       for the rest
  where p = app[t] // PAGE_SIZE, o = app[t] % PAGE_SIZE; a token with app[t] = -1 writes no page (as TVM's
  append). round: to the model dtype, once. This is TVM's llama_rope_with_position_map (the
  default frequencies; `rope_scale` the position scale) followed by its transpose-append.
Reference: `rope_append_ref` below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mlc_lora.contract import PAGE_SIZE

from .. import triton_build

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None

DTYPES = ("float16", "bfloat16")
BH, WARPS = 4, 4  # heads of one token per block; warps
NAME = "mlc_lora_rope_append"  # the TIR wrapper's global symbol


def rope_append_ref(qkv: np.ndarray, pos: np.ndarray, app: np.ndarray, pages: np.ndarray, hq: int, hkv: int,
                    scale: float, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Semantics in float64: (q (n, hq, D), pages with the tokens' k and v written)."""
    n, _, d = qkv.shape
    half = d // 2
    f = (pos.astype(np.float64)[:, None] * scale) / theta ** (2.0 * np.arange(half) / d)  # (n, D/2)
    cos, sin = np.cos(f)[:, None, :], np.sin(f)[:, None, :]
    x = qkv.astype(np.float64)
    x1, x2 = x[..., :half], x[..., half:]
    rot = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    q = rot[:, :hq]
    out = pages.astype(np.float64).copy()
    for t in range(n):
        if app[t] < 0:
            continue
        p, o = divmod(int(app[t]), PAGE_SIZE)
        out[p, 0, :, o] = rot[t, hq:hq + hkv]
        out[p, 1, :, o] = x[t, hq + hkv:]
    return q, out


def supported(dtype: str, head_dim: int) -> str | None:
    """None when the kernel runs this cache, else why not."""
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernel is float16/bfloat16)"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (a power of two, at least 16)"
    return None


if triton is not None:

    @triton.jit(repr=triton_build.kernel_namer("mlc_lora_triton_rope_append", "qkv_ptr"))
    def rope_append_kernel(qkv_ptr, pos_ptr, app_ptr, q_ptr, pages_ptr, scale, log2_theta,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                           PS: tl.constexpr):
        """Grid (tokens, heads / BH): token t's heads [BH * j, BH * (j + 1)) (the Semantics above)."""
        triton_build.wait_for_producers()
        HT: tl.constexpr = HQ + 2 * HKV
        HALF: tl.constexpr = D // 2
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)  # (BH,)
        j = tl.arange(0, HALF)  # (HALF,)
        live = h < HT
        src = qkv_ptr + (t * HT + h[:, None]) * D + j[None, :]
        x1 = tl.load(src, mask=live[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=live[:, None], other=0.0).to(tl.float32)
        # f_j = pos * scale / theta ** (2 j / D)
        f = (tl.load(pos_ptr + t).to(tl.float32) * scale) * tl.exp2(-(2.0 * j.to(tl.float32) / D) * log2_theta)
        c, s = tl.cos(f)[None, :], tl.sin(f)[None, :]
        is_v = h >= HQ + HKV
        r1 = tl.where(is_v[:, None], x1, x1 * c - x2 * s).to(q_ptr.dtype.element_ty)
        r2 = tl.where(is_v[:, None], x2, x2 * c + x1 * s).to(q_ptr.dtype.element_ty)
        is_q = h < HQ
        dst_q = q_ptr + (t * HQ + h[:, None]) * D + j[None, :]
        tl.store(dst_q, r1, mask=is_q[:, None])
        tl.store(dst_q + HALF, r2, mask=is_q[:, None])
        ap = tl.load(app_ptr + t)
        page = (ap // PS).to(tl.int64)
        kv = is_v.to(tl.int64)
        head = (h - HQ - kv * HKV).to(tl.int64)  # (BH,): the k or v head
        dst = pages_ptr + (((page * 2 + kv) * HKV + head) * PS + ap % PS)[:, None] * D + j[None, :]
        on = (live & ~is_q & (ap >= 0))[:, None]
        tl.store(dst, r1, mask=on)
        tl.store(dst + HALF, r2, mask=on)


def _signature(dtype: str) -> dict:
    e = triton_build.PTR[dtype]
    return dict(qkv_ptr=e, pos_ptr="*i32", app_ptr="*i32", q_ptr=e, pages_ptr=e, scale="fp32", log2_theta="fp32",
                HQ="constexpr", HKV="constexpr", D="constexpr", BH="constexpr", PS="constexpr")


def constants(hq: int, hkv: int, head_dim: int) -> dict:
    return dict(HQ=hq, HKV=hkv, D=head_dim, BH=BH, PS=PAGE_SIZE)


def wrapper(hq: int, hkv: int, head_dim: int, dtype: str, arch: str):
    """(TIR wrapper, CUDA module). Signature: (qkv (n, HQ + 2 HKV, D), pos (n,) int32, app (n,)
    int32, pages (P, 2, HKV, PAGE_SIZE, D) [in place], q (n, HQ, D) [out], rope_scale: float32,
    rope_theta: float32), what the pool cache calls (src/runtime/unified_kv_cache.cc)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    from ..kernel_attrs import kernel_attrs  # pylint: disable=import-outside-toplevel

    name, threads, shared, mod = triton_build.cuda_module(rope_append_kernel, _signature(dtype),
                                                          constants(hq, hkv, head_dim), WARPS, arch, Path(__file__))
    ht, d, blocks = hq + 2 * hkv, head_dim, -(-(hq + 2 * hkv) // BH)

    # pylint: disable=unused-variable
    @T.prim_func(s_tir=True)
    def rope_append(qkv_h: T.handle, pos_h: T.handle, app_h: T.handle, pages_h: T.handle, q_h: T.handle,
                    rope_scale: T.float32, rope_theta: T.float32):
        T.func_attr(kernel_attrs(True))
        n, p = T.int64(), T.int64()
        qkv = T.match_buffer(qkv_h, (n, ht, d), dtype)
        pos = T.match_buffer(pos_h, (n,), "int32")
        app = T.match_buffer(app_h, (n,), "int32")
        pages = T.match_buffer(pages_h, (p, 2, hkv, PAGE_SIZE, d), dtype)
        q = T.match_buffer(q_h, (n, hq, d), dtype)
        if n > 0:
            T.call_packed(name, qkv.data, pos.data, app.data, q.data, pages.data, rope_scale,
                          T.log2(rope_theta), T.int64(0), T.int64(0), T.Cast("int32", n), blocks, threads, shared)

    return rope_append, mod
