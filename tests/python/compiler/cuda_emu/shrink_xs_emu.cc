// compiler_passes/ops/lora/shrink_xs.cu on the CPU (prelude.h), launched as shrink_xs_cuda.py's
// wrapper launches it. Usage: shrink_xs_emu DIR n S K KE M R P m0 m1 m2 split size base; reads
// DIR/{arena, slot, rank, scale, a_off, xe} (raw), writes DIR/xe and DIR/cnt.
#include "prelude.h"
#include "io.h"

#include "shrink_xs.cu"

int main(int argc, char** argv) {
  if (argc != 15) return 2;
  const std::string d = argv[1];
  int a[11];
  for (int i = 2; i < 13; ++i) a[i - 2] = atoi(argv[i]);
  const int n = a[0], S = a[1], K = a[2], KE = a[3], M = a[4], R = a[5], P = a[6], m0 = a[7], m1 = a[8], m2 = a[9];
  const int split = a[10];
  const long size = atol(argv[13]), base = atol(argv[14]);
  auto arena = read<T>(d + "/arena", size);
  auto slot = read<int>(d + "/slot", n);
  auto rank = read<int>(d + "/rank", S);
  auto scale = read<float>(d + "/scale", S * M);
  auto a_off = read<int>(d + "/a_off", S * M * R);
  auto xe = read<T>(d + "/xe", size_t(n) * KE);
  const unsigned tiles = (n + BM - 1) / BM;
  std::vector<float> part(size_t(split) * n * P * RS, 9.f);  // garbage the kernel must not read unwritten
  std::vector<int> cnt(tiles, 0);
  auto run = [&](auto kernel) {
    launch(dim3{tiles, unsigned(split), 1}, THREADS, [&] {
      kernel(arena.data(), slot.data(), rank.data(), scale.data(), a_off.data(), xe.data(), part.data(), cnt.data(), n,
             S, K, KE, M, R, m0, m1, m2, split, base);
    });
  };
#ifdef MLC_BF16
  if (P == 1) run(mlc_lora_shrink_xs_bf16_p1);
  if (P == 2) run(mlc_lora_shrink_xs_bf16_p2);
  if (P == 3) run(mlc_lora_shrink_xs_bf16_p3);
#else
  if (P == 1) run(mlc_lora_shrink_xs_f16_p1);
  if (P == 2) run(mlc_lora_shrink_xs_f16_p2);
  if (P == 3) run(mlc_lora_shrink_xs_f16_p3);
#endif
  write(d + "/xe", xe);
  write(d + "/cnt", cnt);
  return 0;
}
