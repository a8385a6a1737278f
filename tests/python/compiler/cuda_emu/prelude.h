// Runs CUDA C++ kernels on the CPU for the tests (no GPU in CI): a block is a set of std::threads,
// __syncthreads and warp shuffles are std::barriers, __shared__ is a function-local static (blocks
// run one after another). Only what compiler_passes/ops/{lora/sgmv,gemv/gemv}.cu use; warp-uniform
// control flow is assumed, as on the GPU with full-mask shuffles.
#pragma once
#include <barrier>
#include <cstdint>
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
