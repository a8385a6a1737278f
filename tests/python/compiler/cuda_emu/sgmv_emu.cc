// compiler_passes/ops/lora/sgmv.cu's shrink then in-place expand on the CPU (prelude.h), launched
// as sgmv_cuda.py's wrappers launch them. Usage: sgmv_emu DIR n in_f M L S size layer P m0 m1 m2 w0 w1 w2; reads
// DIR/{x, arena, slot, order, rank, scale, a_off, b_off, y} (raw), writes DIR/v and DIR/y.
#include "prelude.h"
#include "io.h"

#include <algorithm>

#include "sgmv.cu"

int main(int argc, char** argv) {
  if (argc != 16) return 2;
  const std::string d = argv[1];
  int a[15];
  for (int i = 2; i < 16; ++i) a[i - 2] = atoi(argv[i]);
  const int n = a[0], in_f = a[1], M = a[2], L = a[3], S = a[4], layer = a[6], P = a[7];
  const int m0 = a[8], m1 = a[9], m2 = a[10], w0 = a[11], w1 = a[12], w2 = a[13];
  const long size = atol(argv[7]);
  const int C = (in_f + CHUNK - 1) / CHUNK, W = w0 + w1 + w2;
  auto x = read<T>(d + "/x", size_t(n) * in_f);
  auto arena = read<T>(d + "/arena", size);
  auto slot = read<int>(d + "/slot", n);
  auto order = read<int>(d + "/order", n);
  auto rank = read<int>(d + "/rank", S);
  auto scale = read<float>(d + "/scale", S * M);
  auto a_off = read<int>(d + "/a_off", S * M * R);
  auto b_off = read<int>(d + "/b_off", S * M * R);
  auto y = read<T>(d + "/y", size_t(n) * W);
  std::vector<float> v(size_t(n) * P * C * R, 9.f);  // garbage the shrink must overwrite
  const int64_t base = int64_t(layer) * (size / L);
  // gridDim.z as sgmv_cuda._split
  auto split = [](int b) { return std::max(1, std::min(8, (528 + b - 1) / b)); };
  dim3 g1{unsigned((n + TILE - 1) / TILE), unsigned(C), 1};
  g1.z = split(g1.x * g1.y);
  launch(g1, SHRINK_THREADS, [&] {
    MLC_CAT(mlc_lora_sgmv_shrink_, MLC_SUFFIX)(x.data(), arena.data(), slot.data(), order.data(), rank.data(), scale.data(),
                                               a_off.data(), v.data(), n, in_f, P, m0, m1, m2, M, base);
  });
  unsigned tiles = 0;
  for (int w : {w0, w1, w2}) tiles += (w + EXPAND_OUT - 1) / EXPAND_OUT;
  dim3 g2{unsigned((n + TILE - 1) / TILE), tiles, 1};
  g2.z = split(g2.x * g2.y);
  launch(g2, EXPAND_THREADS, [&] {
    MLC_CAT(mlc_lora_sgmv_expand_, MLC_SUFFIX)(v.data(), arena.data(), slot.data(), order.data(), rank.data(), scale.data(),
                                               b_off.data(), y.data(), n, C, P, m0, m1, m2, w0, w1, w2, M, base);
  });
  write(d + "/v", v);
  write(d + "/y", y);
  return 0;
}
