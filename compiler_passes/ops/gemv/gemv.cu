// Small-batch linear for decode: y (n, N) = x (n, K) @ W[:, :K]^T for n <= NT tokens, W's rows LDW
// >= K elements apart (a weight stored with spare columns), fp32 accumulation (gemv_cuda.py holds the semantics and the TIR wrapper, reference.py the numpy reference).
//
// Why: at a few tokens a linear is a stream over W. cuBLAS splits K there and adds a reduce
// kernel, and reaches 2.6-3.3 TB/s on the H200 (docs/GPU.md); this kernel only has to keep enough
// 16-byte loads of W in flight. A block owns ROWS rows of W and splits K over its threads (each
// thread reads 16 contiguous bytes per row per step, a warp 512), then reduces over the block.
//
// Launch: grid (ceil(N / ROWS)), block (32 * w) with w <= MAX_WARPS. K % 8 == 0, LDW % 8 == 0 and
// 16-byte aligned rows (the wrapper checks K and LDW; TVM's buffers are aligned).
//
// Built with MLC_RANK_COLUMNS (ops/lora/linear_triton.py builds it so), this file holds instead the
// one-token LoRA linear: the same stream over W, and in the epilogue each output's LoRA delta from
// the pair's shrink partials (lora_shrink_cols_kernel's v). Semantics: linear_triton's linear_ref.
#include "dtype.cuh"

#ifndef MLC_SUFFIX
#define MLC_SUFFIX f16
#endif
#define MLC_CAT2(a, b) a##b
#define MLC_CAT(a, b) MLC_CAT2(a, b)

// gemv_cuda.py passes both (scripts/bench_gemm.py --sweep times other values)
#ifndef MLC_GEMV_ROWS
#define MLC_GEMV_ROWS 4
#endif
#ifndef MLC_GEMV_UNROLL
#define MLC_GEMV_UNROLL 2
#endif
constexpr int ROWS = MLC_GEMV_ROWS;      // rows of W per block
constexpr int UNROLL = MLC_GEMV_UNROLL;  // K steps whose loads are issued before any is used
constexpr int MAX_WARPS = 8;  // blockDim.x <= 256

// W is read once: keep it out of L1 (x, read by every block, stays there).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
#ifdef __CUDA_ARCH__
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return *p;
#endif
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const T2* a2 = reinterpret_cast<const T2*>(&a);
  const T2* b2 = reinterpret_cast<const T2*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = to_f2(a2[i]), fb = to_f2(b2[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

// The plain epilogue: y = x @ W^T (kAdds: whether delta() adds anything; the plain kernels compile as before).
struct NoDelta {
  static constexpr bool kAdds = false;
  __device__ __forceinline__ void prepare(int /*row0*/) {}
  __device__ __forceinline__ float delta(int /*t*/, int /*row*/) const { return 0.f; }
};

template <int NT, class Epilogue>
__device__ __forceinline__ void gemv(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                     int n, int K, int N, int LDW, Epilogue& epi) {
  const int chunks = K / 8;  // 16-byte steps along K
  const int row0 = blockIdx.x * ROWS;
  const int nthreads = blockDim.x;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* wr[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    // rows past N read row N-1 (in bounds) and are not written
    wr[r] = reinterpret_cast<const uint4*>(w) + static_cast<int64_t>(min(row0 + r, N - 1)) * (LDW / 8);
  }
  float acc[NT][ROWS];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;

  for (int c0 = threadIdx.x; c0 < chunks; c0 += nthreads * UNROLL) {
    uint4 wv[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * nthreads;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) wv[u][r] = c < chunks ? load_stream(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * nthreads;
      if (c >= chunks) break;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= n) break;
        const uint4 xv = __ldg(x4 + static_cast<int64_t>(t) * chunks + c);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[t][r] += dot8(wv[u][r], xv);
      }
    }
  }

  // Sum over the block: within each warp by shuffles, then across warps through shared memory.
  __shared__ float part[MAX_WARPS][NT * ROWS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = nthreads / 32;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = acc[t][r];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[warp][t * ROWS + r] = v;
    }
  epi.prepare(row0);  // (every thread; it may fill shared memory, read after the barrier)
  __syncthreads();
  for (int i = threadIdx.x; i < NT * ROWS; i += nthreads) {
    const int t = i / ROWS, r = i % ROWS;
    if (t >= n || row0 + r >= N) continue;
    float s = 0.f;
    for (int k = 0; k < warps; ++k) s += part[k][i];
    if constexpr (Epilogue::kAdds) s += epi.delta(t, row0 + r);
    y[static_cast<int64_t>(t) * N + row0 + r] = from_f(s);
  }
}

#ifndef MLC_RANK_COLUMNS

#define MLC_GEMV(NT)                                                                                   \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32)                                       \
      MLC_CAT(MLC_CAT(mlc_lora_gemv_, MLC_SUFFIX), _t##NT)(const T* __restrict__ x,                  \
                                                           const T* __restrict__ w, T* __restrict__ y, \
                                                           int n, int K, int N, int LDW) {           \
    NoDelta epi;                                                                                     \
    gemv<NT>(x, w, y, n, K, N, LDW, epi);                                                            \
  }

MLC_GEMV(1)
MLC_GEMV(2)
MLC_GEMV(4)
MLC_GEMV(8)

#else  // the one-token LoRA linear

constexpr int RS = MLC_RANK_COLUMNS;  // the batch's rank columns (linear_triton.RANK_COLUMNS)
constexpr int SC = MLC_SLOT_COLUMNS;  // the slots they may belong to (linear_triton.SLOT_COLUMNS)

// y[0, o] += the delta of token 0's own slot s (linear_ref): its rank columns c (slot s owns the
// columns after the ranks of the slots before it) of o's part p (module m_p; -1: none), each
// xs[c] = round(scale[s, m_p] * sum over the shrink's splits of v[k, 0, p, c]), times B^T[s, m_p][c's
// row][o - o_p]. A block's ROWS outputs lie in one part (the part widths are multiples of ROWS).
struct LoraDelta {
  static constexpr bool kAdds = true;
  const float* v;  // (split, n, P, RS) fp32 partial sums of x . A over the rank columns
  int split, n;
  const int *slot, *rank;
  const float* scale;  // (S, M)
  const int* b_off;    // (S, M, R)
  const T* arena;
  int64_t base;
  int S, M, R, P, W0, W1, m0, m1, m2;
  float* xs;        // shared (RS,)
  int* col_row;     // shared (RS,): the B^T row of a live own column, -1 elsewhere
  int* part_start;  // shared: o_p of the block's part

  __device__ __forceinline__ void prepare(int row0) {
    const int p = (row0 >= W0) + (row0 >= W0 + W1);
    const int m = p == 0 ? m0 : p == 1 ? m1 : m2;
    const int s = slot[0];
    if (threadIdx.x == 0) *part_start = p == 0 ? 0 : p == 1 ? W0 : W0 + W1;
    for (int c = threadIdx.x; c < RS; c += blockDim.x) {
      xs[c] = 0.f;
      col_row[c] = -1;
      if (m < 0 || s < 0 || s >= S || s >= SC) continue;
      int start = 0;  // ranks clamped to 0..R, as the kernels of linear_triton read them
      for (int j = 0; j < s; ++j) start += max(0, min(rank[j], R));
      const int k = c - start;
      const float sc = scale[s * M + m];
      if (k < 0 || k >= max(0, min(rank[s], R)) || sc == 0.f) continue;
      float a = 0.f;
      for (int i = 0; i < split; ++i) a += v[(static_cast<int64_t>(i) * n * P + p) * RS + c];
      xs[c] = to_f(from_f(a * sc));  // rounded to the model dtype, as PEFT's lora_A output
      col_row[c] = b_off[(s * M + m) * R + k];
    }
  }
  __device__ __forceinline__ float delta(int /*t*/, int row) const {
    float d = 0.f;
    const int64_t o = row - *part_start;
#pragma unroll 8
    for (int c = 0; c < RS; ++c)
      if (col_row[c] >= 0) d = fmaf(xs[c], to_f(arena[base + col_row[c] + o]), d);
    return d;
  }
};

extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32) MLC_CAT(MLC_CAT(mlc_lora_gemv_lora_, MLC_SUFFIX), _t1)(
    const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int n, int K, int N, int LDW,
    const float* __restrict__ v, int split, const int* __restrict__ slot, const int* __restrict__ rank,
    const float* __restrict__ scale, const int* __restrict__ b_off, const T* __restrict__ arena, int S, int M, int R,
    int P, int W0, int W1, int m0, int m1, int m2, int64_t base) {
  __shared__ float xs[RS];
  __shared__ int col_row[RS];
  __shared__ int part_start;
  LoraDelta epi{v, split, n, slot, rank, scale, b_off, arena, base, S, M, R, P, W0, W1, m0, m1, m2, xs, col_row,
                &part_start};
  gemv<1>(x, w, y, n, K, N, LDW, epi);
}

#endif
