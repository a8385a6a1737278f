// Paged attention over mlc-lora's unified pool, for sm_80+ (built for sm_90a here).
//
// Compiled by attention_cuda.py (beside this file) with nvcc, once per (dtype, head_dim):
//   -DMLC_HEAD_DIM=64|128 [-DMLC_BF16]
// The TIR wrappers in that file launch these kernels; the reference they are tested against is
// attention_ref() in reference.py.
//
// Layout (docs/DESIGN.md): a layer's pages are [P, 2, h_kv, 16, D]; sequence s owns pages
// page_indices[page_indptr[s] : page_indptr[s+1]], its last page holding last_page_len[s] tokens.
// Queries arrive RoPE'd, [tokens, h_q, D], sequence s owning rows qo_indptr[s] : qo_indptr[s+1];
// the new tokens' K/V are already in the pages. Causal mask aligned bottom-right: query i of a
// sequence with q_len new tokens and kv_len cached ones sees keys j <= i + kv_len - q_len.
//
// Semantics: o[i, h] = softmax_j(sm_scale * q[i, h] . K[j, h / (h_q / h_kv)]) @ V[j, ...]
//            lse[i, h] = log2(sum_j exp2(sm_scale * log2(e) * q . K[j]))

#include <stdint.h>

#include "dtype.cuh"

#ifndef MLC_HEAD_DIM
#error "define MLC_HEAD_DIM"
#endif
#ifndef MLC_PAGE_SIZE
#error "define MLC_PAGE_SIZE (contract.PAGE_SIZE)"
#endif

namespace {

constexpr int D = MLC_HEAD_DIM;
constexpr int PAGE = MLC_PAGE_SIZE;  // tokens per KV page

__device__ __forceinline__ uint32_t pack2(float x, float y) {
  T2 v = from_f2(x, y);  // x in the low half: the lower column of an mma fragment pair
  return *reinterpret_cast<uint32_t*>(&v);
}

// The PTX below; on the CPU (no __CUDA_ARCH__) the tests' emulation of each instruction
// (tests/python/compiler/cuda_emu/prelude.h).
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// 16 bytes global -> shared without registers; `valid == false` writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
#else
  emu_cp_async16(dst, src, valid);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#else
  emu_ldsm_x4(r, p, false);
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#else
  emu_ldsm_x4(r, p, true);
#endif
}

// c (16x8, fp32) += a (16x16, row) * b (16x8, col)
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
#ifdef MLC_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
#endif
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const uint32_t b[2] = {b0, b1};
  emu_mma16816<T>(c, a, b);
#endif
}

__device__ __forceinline__ int seq_kv_len(const int* page_indptr, const int* last_page_len,
                                          int s) {
  const int n = page_indptr[s + 1] - page_indptr[s];
  return n == 0 ? 0 : (n - 1) * PAGE + last_page_len[s];
}

// Element offset of (token j of a sequence, K or V, kv head) in a layer's pages: in `page`, the
// page of the sequence's that holds j.
__device__ __forceinline__ size_t page_offset(size_t page, int j, int which, int hkv, int kvh) {
  return (((page * 2 + which) * hkv + kvh) * PAGE + j % PAGE) * D;
}
__device__ __forceinline__ size_t kv_offset(const int* pages_of_seq, int j, int which, int hkv,
                                            int kvh) {
  return page_offset(pages_of_seq[j / PAGE], j, which, hkv, kvh);
}

}  // namespace

// ------------------------------------------------------------------------------------ prefill
// FlashAttention-2 on mma.sync m16n8k16: a block is 64 query rows of one head of one sequence,
// 4 warps of 16 rows; K/V tiles of 64 keys stream through shared memory with cp.async (the next
// K tile loads while P @ V runs); S and the running O stay in registers (fp32). Blocks past a
// sequence's rows exit at once, key tiles past the causal diagonal are never loaded.
namespace {
constexpr int BM = 64, BN = 64, NTHREADS = 128;
constexpr int SROW = D + 8;  // padded row: 16-byte aligned and conflict-free for ldmatrix
constexpr int CPR = D / 8;   // 16-byte chunks per row
}  // namespace

extern "C" __global__ void __launch_bounds__(NTHREADS)
    mlc_lora_attn_prefill(const T* __restrict__ q, const int* __restrict__ qo_indptr,
                          const T* __restrict__ pages, const int* __restrict__ page_indptr,
                          const int* __restrict__ page_indices,
                          const int* __restrict__ last_page_len, T* __restrict__ o,
                          float* __restrict__ lse, int hq, int hkv, float sm_scale_log2) {
  wait_for_producers();
  const int h = blockIdx.y, s = blockIdx.z;
  const int q0 = qo_indptr[s], q_len = qo_indptr[s + 1] - q0;
  const int m0 = blockIdx.x * BM;
  if (m0 >= q_len) return;
  const int kv_len = seq_kv_len(page_indptr, last_page_len, s);
  const int* seq_pages = page_indices + page_indptr[s];
  const int kvh = h / (hq / hkv);
  const int diag = kv_len - q_len;  // row i sees keys <= i + diag
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;

  __shared__ __align__(16) T sK[BN * SROW];
  __shared__ __align__(16) T sV[BN * SROW];  // stages Q first

  for (int c = threadIdx.x; c < BM * CPR; c += NTHREADS) {
    const int r = c / CPR, col = (c % CPR) * 8;
    const bool valid = m0 + r < q_len;
    const T* src = valid ? q + ((size_t)(q0 + m0 + r) * hq + h) * D + col : q;
    cp_async16(&sV[r * SROW + col], src, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[D / 16][4];  // this warp's 16 rows as mma A fragments
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int row = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
    ldsm_x4(qf[kk], &sV[row * SROW + kk * 16 + 8 * (lane / 16)]);
  }
  __syncthreads();

  auto load_tile = [&](T* dst, int n0, int which) {
    for (int c = threadIdx.x; c < BN * CPR; c += NTHREADS) {
      const int r = c / CPR, col = (c % CPR) * 8, j = n0 + r;
      const bool valid = j < kv_len;
      const T* src = valid ? pages + kv_offset(seq_pages, j, which, hkv, kvh) + col : pages;
      cp_async16(&dst[r * SROW + col], src, valid);
    }
  };

  const int last_row = min(m0 + BM, q_len) - 1;
  const int kv_end = min(kv_len, last_row + diag + 1);
  const int n_tiles = (kv_end + BN - 1) / BN;
  const int row0 = m0 + warp * 16 + g;  // this thread's rows: row0 and row0 + 8

  float oacc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};

  load_tile(sK, 0, 0);
  cp_async_commit();
  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = it * BN;
    load_tile(sV, n0, 1);
    cp_async_commit();
    cp_async_wait<1>();  // K tile `it` has landed
    __syncthreads();

    float sc[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
        uint32_t b[4];
        const int row = nb2 * 16 + (lane % 8) + 8 * (lane / 16);
        ldsm_x4(b, &sK[row * SROW + kk * 16 + 8 * ((lane / 8) % 2)]);
        mma16816(sc[2 * nb2], qf[kk], b[0], b[1]);
        mma16816(sc[2 * nb2 + 1], qf[kk], b[2], b[3]);
      }
    }

    // Mask (only tiles that reach past a row's diagonal or the end), online softmax in base 2.
    const bool need_mask = n0 + BN > kv_len || n0 + BN - 1 > m0 + diag;
    float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + nb * 8 + 2 * t + (e & 1), row = row0 + (e >> 1) * 8;
        float v = sc[nb][e] * sm_scale_log2;
        if (need_mask && (col >= kv_len || col > row + diag)) v = -INFINITY;
        sc[nb][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    }
    float base[2], alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      base[i] = mx[i] == -INFINITY ? 0.f : mx[i];  // a fully masked row so far stays at 0
      alpha[i] = exp2f(mrow[i] - base[i]);
      mrow[i] = mx[i];
    }
    uint32_t pf[BN / 16][4];  // P as mma A fragments (k = key)
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
      const float p0 = exp2f(sc[nb][0] - base[0]), p1 = exp2f(sc[nb][1] - base[0]);
      const float p2 = exp2f(sc[nb][2] - base[1]), p3 = exp2f(sc[nb][3] - base[1]);
      rs[0] += p0 + p1;
      rs[1] += p2 + p3;
      pf[nb / 2][(nb % 2) * 2] = pack2(p0, p1);
      pf[nb / 2][(nb % 2) * 2 + 1] = pack2(p2, p3);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) lrow[i] = lrow[i] * alpha[i] + rs[i];
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      oacc[nb][0] *= alpha[0];
      oacc[nb][1] *= alpha[0];
      oacc[nb][2] *= alpha[1];
      oacc[nb][3] *= alpha[1];
    }

    cp_async_wait<0>();  // V tile `it` has landed; every warp is done with sK
    __syncthreads();
    if (it + 1 < n_tiles) load_tile(sK, n0 + BN, 0);
    cp_async_commit();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int nd2 = 0; nd2 < D / 16; ++nd2) {
        uint32_t b[4];
        const int row = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
        ldsm_x4_trans(b, &sV[row * SROW + nd2 * 16 + 8 * (lane / 16)]);
        mma16816(oacc[2 * nd2], pf[kk], b[0], b[1]);
        mma16816(oacc[2 * nd2 + 1], pf[kk], b[2], b[3]);
      }
    }
    __syncthreads();  // sV is overwritten by the next tile
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    lrow[i] += __shfl_xor_sync(0xffffffffu, lrow[i], 1);
    lrow[i] += __shfl_xor_sync(0xffffffffu, lrow[i], 2);
    const int row = row0 + 8 * i;
    if (row >= q_len) continue;
    const float inv = lrow[i] > 0.f ? 1.f / lrow[i] : 0.f;
    T* dst = o + ((size_t)(q0 + row) * hq + h) * D;
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      *reinterpret_cast<uint32_t*>(dst + nb * 8 + 2 * t) =
          pack2(oacc[nb][2 * i] * inv, oacc[nb][2 * i + 1] * inv);
    }
    if (t == 0) {
      lse[(size_t)(q0 + row) * hq + h] = lrow[i] > 0.f ? mrow[i] + log2f(lrow[i]) : -INFINITY;
    }
  }
}

// ------------------------------------------------------------------------------------- decode
// Split-KV (flash-decoding): a block is one (split of the context, query head, sequence). Each
// key row is read by D/8 threads with 16-byte loads, RPI rows per step, UNROLL steps of loads in
// flight; rows keep their own online softmax and are combined through shared memory. With one
// split the block writes the output; otherwise it writes fp32 partials, and the last block of a
// (sequence, head) to finish (a counter per pair, reset by that block) merges them: no second
// launch.
namespace {
constexpr int VEC = 8;
constexpr int TPR = D / VEC;            // threads per key row
constexpr int RPI = NTHREADS / TPR;     // key rows per step
constexpr int UNROLL = 4;

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const T* p = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int e = 0; e < VEC; ++e) f[e] = to_f(p[e]);
}
}  // namespace

// U: the steps of RPI rows whose loads a thread issues at once, a round (the plain kernel:
// UNROLL). PIPE: the pipelined variants (mlc_lora_attn_decode_pipe<U>): the rows of round i + 1 are
// loaded while round i is summed, and their page ids a round earlier still, so a block waits for
// memory about once instead of once a round (a context of a few hundred keys takes only a few
// rounds, each a round trip in the plain kernel). The same sums in the same order as the plain
// kernel: the same bits. Not the default until timed (attention_cuda.DECODE_KERNELS).
// (each kernel below waits for its producers first, then runs this)
template <bool PIPE, int U>
__device__ __forceinline__ void attn_decode(const T* __restrict__ q, const T* __restrict__ pages,
                                            const int* __restrict__ page_indptr,
                                            const int* __restrict__ page_indices,
                                            const int* __restrict__ last_page_len, T* __restrict__ o,
                                            float* __restrict__ lse, float* part_o, float* part_lse,
                                            int* counters, int hq, int hkv, int chunk,
                                            float sm_scale_log2) {
  const int split = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  const int nsplit = gridDim.x, b = gridDim.z;
  const int kv_len = seq_kv_len(page_indptr, last_page_len, s);
  const int* seq_pages = page_indices + page_indptr[s];
  const int kvh = h / (hq / hkv);
  const int lo = split * chunk, hi = min(kv_len, lo + chunk);
  const int row = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const size_t v_delta = (size_t)hkv * PAGE * D;  // V of a token sits one K block further

  float qv[VEC];
  unpack8(*reinterpret_cast<const uint4*>(q + ((size_t)s * hq + h) * D + sub * VEC), qv);
#pragma unroll
  for (int e = 0; e < VEC; ++e) qv[e] *= sm_scale_log2;

  float m = -INFINITY, l = 0.f, acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
  constexpr int ROUND = RPI * U;  // key rows a round
  // Each thread's rows of the round at j0: j0 + u * RPI + row (u < U), row j in page page_of(u, j);
  // zeros past hi.
  auto load_rows = [&](int j0, auto page_of, uint4* kr, uint4* vr) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * RPI + row;
      if (j < hi) {
        const T* p = pages + page_offset(page_of(u, j), j, 0, hkv, kvh) + sub * VEC;
        kr[u] = *reinterpret_cast<const uint4*>(p);
        vr[u] = *reinterpret_cast<const uint4*>(p + v_delta);
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto page_ids = [&](int j0, int* pg) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * RPI + row;
      pg[u] = j < hi ? seq_pages[j / PAGE] : 0;
    }
  };
  auto sum_rows = [&](int j0, const uint4* kr, const uint4* vr) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      unpack8(kr[u], kf);
      float sc = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) sc += qv[e] * kf[e];
#pragma unroll
      for (int off = TPR / 2; off > 0; off >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
      if (j0 + u * RPI + row >= hi) continue;  // the whole row group agrees
      const float mn = fmaxf(m, sc), a = exp2f(m - mn), p = exp2f(sc - mn);
      float vf[VEC];
      unpack8(vr[u], vf);
      l = l * a + p;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = acc[e] * a + p * vf[e];
      m = mn;
    }
  };
  if constexpr (!PIPE) {
    for (int j0 = lo; j0 < hi; j0 += ROUND) {
      uint4 kr[U], vr[U];
      load_rows(j0, [&](int, int j) { return seq_pages[j / PAGE]; }, kr, vr);
      sum_rows(j0, kr, vr);
    }
  } else if (lo < hi) {  // (constexpr: the plain kernel has none of this)
    // two register sets of rows (a, b) in turn; page ids a round ahead of the rows
    int pa[U], pb[U];
    uint4 ka[U], va[U], kb[U], vb[U];
    page_ids(lo, pa);
    page_ids(lo + ROUND, pb);
    auto in_a = [&](int u, int) { return pa[u]; };
    auto in_b = [&](int u, int) { return pb[u]; };
    load_rows(lo, in_a, ka, va);
    for (int j0 = lo; j0 < hi; j0 += 2 * ROUND) {
      const int j1 = j0 + ROUND, j2 = j1 + ROUND;
      if (j1 < hi) load_rows(j1, in_b, kb, vb);
      if (j2 < hi) page_ids(j2, pa);
      sum_rows(j0, ka, va);
      if (j1 >= hi) break;
      if (j2 < hi) load_rows(j2, in_a, ka, va);
      if (j2 + ROUND < hi) page_ids(j2 + ROUND, pb);
      sum_rows(j1, kb, vb);
    }
  }

  __shared__ float sm_m[RPI], sm_l[RPI];
  __shared__ float sm_acc[RPI][D];
  __shared__ bool is_last;
  if (sub == 0) {
    sm_m[row] = m;
    sm_l[row] = l;
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) sm_acc[row][sub * VEC + e] = acc[e];
  __syncthreads();
  const int dim = threadIdx.x;  // threads >= D only take part in the barriers below
  float out = 0.f, out_lse = -INFINITY;
  if (dim < D) {
    float M = -INFINITY;
#pragma unroll
    for (int r = 0; r < RPI; ++r) M = fmaxf(M, sm_m[r]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const float w = sm_m[r] == -INFINITY ? 0.f : exp2f(sm_m[r] - M);
      L += sm_l[r] * w;
      O += sm_acc[r][dim] * w;
    }
    out = L > 0.f ? O / L : 0.f;
    out_lse = L > 0.f ? M + log2f(L) : -INFINITY;
  }
  const size_t pair = (size_t)s * hq + h;
  if (nsplit == 1) {
    if (dim < D) o[pair * D + dim] = from_f(out);
    if (dim == 0) lse[pair] = out_lse;
    return;
  }
  if (dim < D) part_o[((size_t)split * b * hq + pair) * D + dim] = out;
  if (dim == 0) part_lse[(size_t)split * b * hq + pair] = out_lse;
  __threadfence();  // partials visible device-wide before this block is counted
  __syncthreads();
  if (dim == 0) is_last = atomicAdd(&counters[pair], 1) == nsplit - 1;
  __syncthreads();
  if (!is_last) return;
  if (dim < D) {
    float M = -INFINITY;
    for (int k = 0; k < nsplit; ++k) M = fmaxf(M, __ldcg(&part_lse[(size_t)k * b * hq + pair]));
    float L = 0.f, O = 0.f;
    for (int k = 0; k < nsplit; ++k) {
      const size_t r = (size_t)k * b * hq + pair;
      const float lk = __ldcg(&part_lse[r]);
      const float w = lk == -INFINITY ? 0.f : exp2f(lk - M);
      L += w;
      O += w * __ldcg(&part_o[r * D + dim]);
    }
    o[pair * D + dim] = from_f(L > 0.f ? O / L : 0.f);
    if (dim == 0) {
      lse[pair] = L > 0.f ? M + log2f(L) : -INFINITY;
      counters[pair] = 0;  // ready for the next launch
    }
  }
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
    mlc_lora_attn_decode(const T* __restrict__ q, const T* __restrict__ pages,
                         const int* __restrict__ page_indptr,
                         const int* __restrict__ page_indices,
                         const int* __restrict__ last_page_len, T* __restrict__ o,
                         float* __restrict__ lse, float* part_o, float* part_lse, int* counters,
                         int hq, int hkv, int chunk, float sm_scale_log2) {
  wait_for_producers();
  attn_decode<false, UNROLL>(q, pages, page_indptr, page_indices, last_page_len, o, lse, part_o,
                             part_lse, counters, hq, hkv, chunk, sm_scale_log2);
}

#define MLC_ATTN_DECODE_PIPE(U)                                                                    \
  extern "C" __global__ void __launch_bounds__(NTHREADS) mlc_lora_attn_decode_pipe##U(             \
      const T* __restrict__ q, const T* __restrict__ pages, const int* __restrict__ page_indptr,    \
      const int* __restrict__ page_indices, const int* __restrict__ last_page_len,                 \
      T* __restrict__ o, float* __restrict__ lse, float* part_o, float* part_lse, int* counters,   \
      int hq, int hkv, int chunk, float sm_scale_log2) {                                           \
    wait_for_producers();                                                                          \
    attn_decode<true, U>(q, pages, page_indptr, page_indices, last_page_len, o, lse, part_o,       \
                         part_lse, counters, hq, hkv, chunk, sm_scale_log2);                      \
  }
MLC_ATTN_DECODE_PIPE(2)
MLC_ATTN_DECODE_PIPE(4)
