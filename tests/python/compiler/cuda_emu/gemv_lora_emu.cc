// compiler_passes/ops/gemv/gemv.cu's one-token LoRA linear (built with MLC_RANK_COLUMNS) on the CPU
// (prelude.h), launched as linear_triton's wrapper launches it.
// Usage: gemv_lora_emu DIR K N threads LDW split S M R P W0 W1 m0 m1 m2 base arena_len
// reads DIR/{x (1, K), w (N, LDW), v (split, 1, P, RS) f32, slot (1,) i32, rank (S,) i32,
// scale (S, M) f32, b_off (S, M, R) i32, arena (arena_len,)} (raw), writes DIR/y.
#include "prelude.h"
#include "io.h"

#include "gemv.cu"

int main(int argc, char** argv) {
  if (argc != 18) return 2;
  const std::string d = argv[1];
  int a[16];
  for (int i = 0; i < 16; ++i) a[i] = atoi(argv[2 + i]);
  const int K = a[0], N = a[1], threads = a[2], ldw = a[3], split = a[4], S = a[5], M = a[6], R = a[7], P = a[8];
  const int W0 = a[9], W1 = a[10], m0 = a[11], m1 = a[12], m2 = a[13];
  const int64_t base = a[14];
  const size_t arena_len = size_t(a[15]);
  auto x = read<T>(d + "/x", size_t(K));
  auto w = read<T>(d + "/w", size_t(N) * ldw);
  auto v = read<float>(d + "/v", size_t(split) * P * RS);
  auto slot = read<int>(d + "/slot", 1);
  auto rank = read<int>(d + "/rank", size_t(S));
  auto scale = read<float>(d + "/scale", size_t(S) * M);
  auto b_off = read<int>(d + "/b_off", size_t(S) * M * R);
  auto arena = read<T>(d + "/arena", arena_len);
  std::vector<T> y(size_t(N), from_f(7.f));  // garbage the kernel must overwrite
  const dim3 grid{unsigned((N + ROWS - 1) / ROWS), 1, 1};
  launch(grid, threads, [&] {
    MLC_CAT(MLC_CAT(mlc_lora_gemv_lora_, MLC_SUFFIX), _t1)(x.data(), w.data(), y.data(), 1, K, N, ldw, v.data(), split,
                                                          slot.data(), rank.data(), scale.data(), b_off.data(),
                                                          arena.data(), S, M, R, P, W0, W1, m0, m1, m2, base);
  });
  write(d + "/y", y);
  return 0;
}
