// The rank columns route's shrink into [x | s] on tensor cores, its operands loaded straight into
// registers (no shared-memory staging), for sm_80+.
//
// Compiled by shrink_xs_cuda.py (beside this file) with nvcc once per dtype:
//   -DMLC_RANK_COLUMNS=32 -DMLC_SLOT_COLUMNS=16 [-DMLC_BF16]
// (stage.RANK_COLUMNS / SLOT_COLUMNS). The kernels are named mlc_lora_shrink_xs_<dtype>_p<P>,
// one per number of parts P (1..3). shrink_xs_cuda.shrink_xs_ref is the numpy reference.
//
// Arena (docs/DESIGN.md): row k of A[s, m] of the layer is arena[base + a_off[s, m, k] : + K].
// The rank columns (linear_triton.py): column c < RS of every part belongs to slot jc(c), the
// slot whose ranks' running sum first passes c (ranks clamped to [0, R], slots past S hold none),
// as its row kc(c) = c - (the ranks before jc). Part p is module mp[p] of the tables (-1: none).
//
// Semantics (linear_triton.lora_shrink_xs_kernel's): xe (n, KE) = [x | s], x in its first K
// columns (its producer wrote it there); for token t on slot j = slot[t] and part p, m = mp[p]:
//   s[t, p * RS + c] = round(scale[j, m] * sum_i x[t, i] * A[j, m][kc(c), i])
//                      where jc(c) == j, m >= 0 and scale[j, m] != 0; else 0;
//   s[t, P * RS:] = 0 (the row's padding up to KE).
// fp32 products and sums, rounded once to the element type.
//
// Launch: grid (ceil(n / BM), split), THREADS threads. Block (tile, k) takes the tile's BM tokens
// over its share of the inputs (whole 16-input steps; its warps split that share again) and only
// the rank columns whose slot is a slot of its tokens (for a prefill tile, one adapter's rows: the
// other columns are neither loaded nor multiplied). The warps' sums meet in shared memory; with
// split > 1 each block writes its tile's partial sums to part (fp32, (split, n, P * RS)) and the
// block that counts last in cnt[tile] sums them in split order (the same bits whichever block is
// last), writes s and sets cnt[tile] back to 0. The grid depends only on n (CUDA graphs).

#include <stdint.h>

#include "dtype.cuh"

#ifndef MLC_RANK_COLUMNS
#error "define MLC_RANK_COLUMNS"
#endif
#ifndef MLC_SLOT_COLUMNS
#error "define MLC_SLOT_COLUMNS"
#endif

namespace {

constexpr int RS = MLC_RANK_COLUMNS;  // rank columns of a part
constexpr int SC = MLC_SLOT_COLUMNS;  // slots of a batch (at most)
constexpr int BM = 16;                // tokens per block: the MMA's rows
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int KSTEP = 16;             // inputs per MMA
constexpr int BATCH = 4;              // input steps whose x fragments a warp loads at once
constexpr int MAX_P = 3;
static_assert(RS % 8 == 0 && RS <= 32, "rank columns come in MMA tiles of 8, at most 32 (a 32-bit mask)");

__device__ __forceinline__ uint32_t ld32(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }

// c += a (16 x 16, row-major fragments) * b (16 x 8, column-major fragments), fp32 accumulators
// (PTX mma.m16n8k16; on the CPU the tests' emulation, tests/python/compiler/cuda_emu/prelude.h).
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b) {
#if defined(__CUDA_ARCH__)
#ifdef MLC_BF16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  emu_mma16816<T>(c, a, b);
#endif
}

template <int P>
__device__ __forceinline__ void shrink_xs(const T* __restrict__ arena, const int* __restrict__ slot,
                                          const int* __restrict__ rank, const float* __restrict__ scale,
                                          const int* __restrict__ a_off, T* xe, float* part, int* cnt, int n,
                                          int S, int K, int KE, int M, int R, int m0, int m1, int m2, int split,
                                          int64_t base) {
  constexpr int COLS = P * RS, NT = COLS / 8;
  __shared__ int64_t s_row[COLS];  // each rank column's A row (arena offset) where used, else 0
  __shared__ float s_scale[COLS];
  __shared__ int s_use[COLS];      // live, and of a slot of the tile's tokens
  __shared__ int s_jc[RS], s_kc[RS];
  __shared__ int s_tok[BM];        // the tile's tokens' slots (-1 past n)
  __shared__ float s_red[WARPS][BM][COLS];
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32;
  const int tile = blockIdx.x, kb = blockIdx.y, r0 = tile * BM;
  if (tid < BM) s_tok[tid] = r0 + tid < n ? slot[r0 + tid] : -1;
  if (tid < RS) {  // column tid -> its slot and its row there (linear_triton._rank_columns)
    int end = 0, jc = SC, kc = 0;
    for (int j = 0; j < SC; ++j) {
      const int rk = j < S ? min(max(rank[j], 0), R) : 0;
      if (jc == SC && tid < end + rk) {
        jc = j;
        kc = tid - end;
      }
      end += rk;
    }
    s_jc[tid] = jc;
    s_kc[tid] = kc;
  }
  __syncthreads();
  if (tid < COLS) {
    const int p = tid / RS, c = tid % RS, m = p == 0 ? m0 : p == 1 ? m1 : m2;
    const int jc = s_jc[c], js = min(jc, SC - 1);
    const float sc = (jc < SC && m >= 0) ? scale[js * M + m] : 0.f;
    bool here = false;
    for (int i = 0; i < BM; ++i) here |= s_tok[i] == jc;
    const bool use = sc != 0.f && here;
    s_scale[tid] = sc;
    s_use[tid] = use;
    s_row[tid] = use ? base + a_off[(js * M + m) * R + min(s_kc[c], R - 1)] : 0;
  }
  __syncthreads();
  uint32_t active = 0;  // the 8-column MMA tiles with a used column (the same in every thread)
  for (int c = 0; c < COLS; ++c) active |= uint32_t(s_use[c] != 0) << (c / 8);

  // this warp's input steps: the block's share of K / KSTEP, split again over the warps
  const int steps = K / KSTEP;
  const int b0 = int(int64_t(steps) * kb / split), b1 = int(int64_t(steps) * (kb + 1) / split);
  const int k0 = b0 + (b1 - b0) * w / WARPS, k1 = b0 + (b1 - b0) * (w + 1) / WARPS;
  const int g = lane / 4, t = lane % 4;
  const bool ok0 = r0 + g < n, ok1 = r0 + g + 8 < n;
  const T* x0 = xe + int64_t(ok0 ? r0 + g : 0) * KE + 2 * t;
  const T* x1 = xe + int64_t(ok1 ? r0 + g + 8 : 0) * KE + 2 * t;
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  for (int kk = k0; kk < k1; kk += BATCH) {
    uint32_t a[BATCH][4];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = (kk + b) * KSTEP;
      const bool in = kk + b < k1;
      a[b][0] = in && ok0 ? ld32(x0 + i) : 0u;
      a[b][1] = in && ok1 ? ld32(x1 + i) : 0u;
      a[b][2] = in && ok0 ? ld32(x0 + i + 8) : 0u;
      a[b][3] = in && ok1 ? ld32(x1 + i + 8) : 0u;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (!(active >> nt & 1u)) continue;
      const int col = nt * 8 + g;
      const bool u = s_use[col] != 0;
      const T* ar = arena + s_row[col] + 2 * t;
      uint32_t bf[BATCH][2];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int i = (kk + b) * KSTEP;
        const bool in = kk + b < k1 && u;
        bf[b][0] = in ? ld32(ar + i) : 0u;
        bf[b][1] = in ? ld32(ar + i + 8) : 0u;
      }
#pragma unroll
      for (int b = 0; b < BATCH; ++b)
        if (kk + b < k1) mma16816(acc[nt], a[b], bf[b]);
    }
  }
  // the warps' sums meet: s_red[w][row][col] (rows g, g + 8; columns 2t, 2t + 1 of each MMA tile)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = nt * 8 + 2 * t;
    s_red[w][g][col] = acc[nt][0];
    s_red[w][g][col + 1] = acc[nt][1];
    s_red[w][g + 8][col] = acc[nt][2];
    s_red[w][g + 8][col + 1] = acc[nt][3];
  }
  __syncthreads();
  constexpr int PER = (BM * COLS + THREADS - 1) / THREADS;
  float sum[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) {
    const int idx = tid + e * THREADS, row = idx / COLS, col = idx % COLS;
    sum[e] = 0.f;
    if (idx < BM * COLS && s_use[col])
      for (int v = 0; v < WARPS; ++v) sum[e] += s_red[v][row][col];
  }
  if (split > 1) {  // partial sums out; the tile's last block sums them in split order
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int idx = tid + e * THREADS, row = idx / COLS, col = idx % COLS;
      if (idx < BM * COLS && r0 + row < n) part[(int64_t(kb) * n + r0 + row) * COLS + col] = sum[e];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(cnt + tile, 1) == split - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int idx = tid + e * THREADS, row = idx / COLS, col = idx % COLS;
      sum[e] = 0.f;
      if (idx < BM * COLS && r0 + row < n && s_use[col])
        for (int k = 0; k < split; ++k) sum[e] += __ldcg(part + (int64_t(k) * n + r0 + row) * COLS + col);
    }
    if (tid == 0) cnt[tile] = 0;
  }
  // s: each token's own slot's columns, scaled and rounded; zeros elsewhere and in the padding
#pragma unroll
  for (int e = 0; e < PER; ++e) {
    const int idx = tid + e * THREADS, row = idx / COLS, col = idx % COLS;
    if (idx < BM * COLS && r0 + row < n) {
      const bool keep = s_use[col] && s_tok[row] == s_jc[col % RS];
      xe[int64_t(r0 + row) * KE + K + col] = from_f(keep ? sum[e] * s_scale[col] : 0.f);
    }
  }
  const int pad = KE - K - COLS;
  for (int idx = tid; idx < BM * pad; idx += THREADS) {
    const int row = idx / pad;
    if (r0 + row < n) xe[int64_t(r0 + row) * KE + K + COLS + idx % pad] = from_f(0.f);
  }
}

}  // namespace

#define MLC_SHRINK_XS(NAME, P)                                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
      NAME(const T* arena, const int* slot, const int* rank, const float* scale, const int* a_off, T* xe,  \
           float* part, int* cnt, int n, int S, int K, int KE, int M, int R, int m0, int m1, int m2,        \
           int split, int64_t base) {                                                                       \
    wait_for_producers();                                                                                   \
    shrink_xs<P>(arena, slot, rank, scale, a_off, xe, part, cnt, n, S, K, KE, M, R, m0, m1, m2, split,     \
                 base);                                                                                     \
  }

#ifdef MLC_BF16
MLC_SHRINK_XS(mlc_lora_shrink_xs_bf16_p1, 1)
MLC_SHRINK_XS(mlc_lora_shrink_xs_bf16_p2, 2)
MLC_SHRINK_XS(mlc_lora_shrink_xs_bf16_p3, 3)
#else
MLC_SHRINK_XS(mlc_lora_shrink_xs_f16_p1, 1)
MLC_SHRINK_XS(mlc_lora_shrink_xs_f16_p2, 2)
MLC_SHRINK_XS(mlc_lora_shrink_xs_f16_p3, 3)
#endif
