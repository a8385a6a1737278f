/*!
 * \file cpu_gemm.cc
 * \brief out = x @ w^T in float32 on CPU: register-tiled dot products, multi-threaded over N.
 *
 * Both operands are read along K (x rows and w rows are contiguous), so a tile of MR x rows by NR
 * w rows keeps MR*NR vector accumulators and reduces them horizontally at the end. The kernel is
 * written once with GCC vector extensions and instantiated twice: an AVX2+FMA version picked at run
 * time where the CPU has it, and a baseline x86-64 (SSE2) / generic version; the library is never
 * built for the build machine's own CPU, so it runs on any x86-64 (or other) host.
 *
 * Work is split over column blocks of w (N), so decode at batch 1 (M = 1, a GEMV) is parallel too,
 * and each thread streams its own slice of the weights once while x stays in cache.
 */
#include "cpu_gemm.h"

// The v8 helpers are always inlined: the AVX argument-passing ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <unistd.h>
#include <vector>

namespace mlc_lora {
namespace {

typedef float v8 __attribute__((vector_size(32)));

inline __attribute__((always_inline)) v8 Load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline __attribute__((always_inline)) float Sum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/*! \brief out[i, j] for MR rows of x and NR rows of w (row strides k, ldw and ldo). */
template <int MR, int NR>
inline __attribute__((always_inline)) void Tile(const float* __restrict x, const float* __restrict w,
                                                float* __restrict out, int64_t k, int64_t ldw,
                                                int64_t ldo) {
  v8 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = v8{};
  int64_t l = 0;
  for (; l + 8 <= k; l += 8) {
    v8 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Load8(w + j * ldw + l);
    for (int i = 0; i < MR; ++i) {
      v8 xv = Load8(x + i * k + l);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = Sum8(acc[i][j]);
      for (int64_t t = l; t < k; ++t) s += x[i * k + t] * w[j * ldw + t];
      out[i * ldo + j] = s;
    }
  }
}

/*! \brief Rows [0, m) of x against w rows [n0, n1): 4x3 tiles (12 accumulators fit 16 registers). */
inline __attribute__((always_inline)) void Panel(const float* x, const float* w, float* out,
                                                 int64_t m, int64_t n, int64_t k, int64_t ldw,
                                                 int64_t n0, int64_t n1) {
  constexpr int MR = 4, NR = 3;
  int64_t i = 0;
  for (; i + MR <= m; i += MR) {
    int64_t j = n0;
    for (; j + NR <= n1; j += NR) Tile<MR, NR>(x + i * k, w + j * ldw, out + i * n + j, k, ldw, n);
    for (; j < n1; ++j) Tile<MR, 1>(x + i * k, w + j * ldw, out + i * n + j, k, ldw, n);
  }
  for (; i < m; ++i) {
    // Leftover rows (all of decode): one x row against 4 w rows at a time.
    int64_t j = n0;
    for (; j + 4 <= n1; j += 4) Tile<1, 4>(x + i * k, w + j * ldw, out + i * n + j, k, ldw, n);
    for (; j < n1; ++j) Tile<1, 1>(x + i * k, w + j * ldw, out + i * n + j, k, ldw, n);
  }
}

/*!
 * \brief w rows [n0, n1) against all of x, in L2-sized pieces: ~128 KiB of x rows times ~96 KiB
 * of w rows at a time, so neither streams from memory once per tile.
 */
inline __attribute__((always_inline)) void Block(const float* x, const float* w, float* out,
                                                 int64_t m, int64_t n, int64_t k, int64_t ldw,
                                                 int64_t n0, int64_t n1) {
  const int64_t mc = std::max<int64_t>(4, (128 * 1024 / (4 * k)) / 4 * 4);
  const int64_t nc = std::max<int64_t>(12, (96 * 1024 / (4 * k)) / 12 * 12);
  for (int64_t i = 0; i < m; i += mc) {
    for (int64_t j = n0; j < n1; j += nc) {
      Panel(x + i * k, w, out + i * n, std::min(mc, m - i), n, k, ldw, j, std::min(n1, j + nc));
    }
  }
}

void BlockGeneric(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
                  int64_t ldw, int64_t n0, int64_t n1) {
  Block(x, w, out, m, n, k, ldw, n0, n1);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void BlockAvx2(const float* x, const float* w, float* out,
                                                   int64_t m, int64_t n, int64_t k, int64_t ldw,
                                                   int64_t n0, int64_t n1) {
  Block(x, w, out, m, n, k, ldw, n0, n1);
}
#endif

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t);

BlockFn PickBlock() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return BlockAvx2;
#endif
  return BlockGeneric;
}

/*!
 * \brief A fixed set of worker threads; Run(tasks, fn) calls fn(t) for t in [0, tasks) on the
 * workers and the caller, and returns when all are done. One Run at a time (callers serialize).
 */
class ThreadPool {
 public:
  explicit ThreadPool(int threads) : pid_(getpid()) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(int64_t tasks, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    // A forked child has this object but not the threads: it runs everything itself.
    if (workers_.empty() || tasks <= 1 || getpid() != pid_) {
      for (int64_t t = 0; t < tasks; ++t) fn(t);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void Drain() {
    for (int64_t t; (t = next_.fetch_add(1)) < tasks_;) (*fn_)(t);
  }
  void Work() {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      Drain();
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int NumThreads() {
  if (const char* env = std::getenv("MLC_LORA_NUM_THREADS")) {
    int v = std::atoi(env);
    if (v > 0) return v;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& Pool() {
  static auto* pool = new ThreadPool(NumThreads());  // never destroyed: workers outlive exit paths
  return *pool;
}

}  // namespace

void CpuGemmF32(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
                int64_t ldw) {
  static const BlockFn block = PickBlock();
  ThreadPool& pool = Pool();
  // Waking the workers costs tens of microseconds (much more on a loaded host): below ~2M
  // multiply-adds (a batch-1 decode linear of a small model) one thread is faster.
  const bool serial = pool.size() == 1 || m * n * k < (int64_t(1) << 21);
  // Column blocks: a multiple of 12 rows of w (the tile widths 3 and 4), about 4 per thread so
  // uneven progress balances out, at most 192 rows so a block of w stays in L2 across x's rows.
  int64_t nb = serial ? n : (n + 4 * pool.size() - 1) / (4 * pool.size());
  nb = std::min<int64_t>(192, std::max<int64_t>(12, (nb + 11) / 12 * 12));
  const int64_t blocks = (n + nb - 1) / nb;
  std::function<void(int64_t)> fn = [&](int64_t b) {
    block(x, w, out, m, n, k, ldw, b * nb, std::min(n, (b + 1) * nb));
  };
  if (serial) {
    for (int64_t b = 0; b < blocks; ++b) fn(b);
  } else {
    pool.Run(blocks, fn);
  }
}

}  // namespace mlc_lora
