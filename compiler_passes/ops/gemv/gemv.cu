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

template <int NT>
__device__ __forceinline__ void gemv(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                     int n, int K, int N, int LDW) {
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
  __syncthreads();
  for (int i = threadIdx.x; i < NT * ROWS; i += nthreads) {
    const int t = i / ROWS, r = i % ROWS;
    if (t >= n || row0 + r >= N) continue;
    float s = 0.f;
    for (int k = 0; k < warps; ++k) s += part[k][i];
    y[static_cast<int64_t>(t) * N + row0 + r] = from_f(s);
  }
}

#define MLC_GEMV(NT)                                                                                   \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32)                                       \
      MLC_CAT(MLC_CAT(mlc_lora_gemv_, MLC_SUFFIX), _t##NT)(const T* __restrict__ x,                  \
                                                           const T* __restrict__ w, T* __restrict__ y, \
                                                           int n, int K, int N, int LDW) {           \
    wait_for_producers();                                                                            \
    gemv<NT>(x, w, y, n, K, N, LDW);                                                                 \
  }

MLC_GEMV(1)
MLC_GEMV(2)
MLC_GEMV(4)
MLC_GEMV(8)
