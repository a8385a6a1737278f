// Runs CUDA C++ kernels on the CPU for the tests (no GPU in CI): a block is a set of std::threads,
// __syncthreads and warp shuffles are std::barriers, __shared__ is a function-local static (blocks
// run one after another). Only what compiler_passes/ops/{lora/sgmv,gemv/gemv,attention/attention}.cu
// use; warp-uniform control flow is assumed, as on the GPU with full-mask shuffles and mma.sync.
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
thread_local dim3 threadIdx;
dim3 blockIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

std::unique_ptr<std::barrier<>> g_block_bar;
std::vector<std::unique_ptr<std::barrier<>>> g_warp_bar;
float g_xch[64][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  g_xch[w][lane] = x;
  g_warp_bar[w]->arrive_and_wait();
  const float y = g_xch[w][lane ^ o];
  g_warp_bar[w]->arrive_and_wait();
  return y;
}
inline uint4 __ldg(const uint4* p) { return *p; }
inline int __ffs(unsigned x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned atomicOr(uint32_t* p, uint32_t v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __ldcg(const float* p) { return *p; }

// cp.async.cg 16 bytes global -> shared (zeros where !valid). Done at once: a kernel whose shared
// buffers are safe when the copies land any time after they are issued is also safe here; commit
// and wait have nothing to do.
inline void emu_cp_async16(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 16);
  else std::memset(dst, 0, 16);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 give the rows of matrix j (8
// elements of 16 bits each); lane = 4 g + t gets in r[j] the elements (g, 2t) and (g, 2t + 1) of
// matrix j, or with .trans (2t, g) and (2t + 1, g); the first in the low half.
const void* g_ldsm_row[64][32];
inline void emu_ldsm_x4(uint32_t* r, const void* p, bool trans) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  g_ldsm_row[w][lane] = p;
  g_warp_bar[w]->arrive_and_wait();
  for (int j = 0; j < 4; ++j) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int row = trans ? 2 * t + h : g, col = trans ? g : 2 * t + h;
      std::memcpy(&e[h], static_cast<const char*>(g_ldsm_row[w][8 * j + row]) + 2 * col, 2);
    }
    r[j] = uint32_t(e[0]) | uint32_t(e[1]) << 16;
  }
  g_warp_bar[w]->arrive_and_wait();
}

// mma.sync.aligned.m16n8k16.row.col with fp32 accumulators, over one warp's fragments in PTX's
// layout (lane = 4 g + t): a[i] holds A[g + 8 (i % 2)][2t + 8 (i / 2) + {0, 1}], b[i] holds
// B[2t + 8 i + {0, 1}][g], c[i] is C[g + 8 (i / 2)][2t + i % 2]. Elements are E (16 bits each,
// converted by the kernel's to_f).
uint32_t g_mma_a[64][32][4], g_mma_b[64][32][2];
template <class E>
void emu_mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  std::memcpy(g_mma_a[w][lane], a, 16);
  std::memcpy(g_mma_b[w][lane], b, 8);
  g_warp_bar[w]->arrive_and_wait();
  auto elem = [](uint32_t v, int hi) {
    const uint16_t bits = hi ? uint16_t(v >> 16) : uint16_t(v & 0xffffu);
    E e;
    std::memcpy(&e, &bits, 2);
    return to_f(e);
  };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float s = 0.f;
    for (int k = 0; k < 16; ++k)
      s += elem(g_mma_a[w][(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2) *
           elem(g_mma_b[w][col * 4 + (k % 8) / 2][k / 8], k % 2);
    c[i] += s;
  }
  g_warp_bar[w]->arrive_and_wait();
}

template <class F>
void launch(dim3 grid, int threads, F f) {
  gridDim = grid;
  blockDim = {unsigned(threads), 1, 1};
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        g_block_bar = std::make_unique<std::barrier<>>(threads);
        g_warp_bar.clear();
        for (int w = 0; w < (threads + 31) / 32; ++w) g_warp_bar.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { threadIdx.x = t; f(); });
        for (auto& t : ts) t.join();
      }
}
