// lora_sgmv.cu's shrink then expand on the CPU (prelude.h), launched as lora_sgmv_cuda.py's
// wrappers launch them. Usage: sgmv_emu DIR n in_f out_f m M L S size layer; reads DIR/{x, arena,
// slot, rank, scale, a_off, b_off} (raw), writes DIR/v and DIR/y.
#include "prelude.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "lora_sgmv.cu"

template <class E>
std::vector<E> read(const std::string& p, size_t n) {
  std::vector<E> v(n);
  FILE* f = fopen(p.c_str(), "rb");
  if (!f || fread(v.data(), sizeof(E), n, f) != n) {
    fprintf(stderr, "cannot read %zu items from %s\n", n, p.c_str());
    exit(1);
  }
  fclose(f);
  return v;
}

template <class E>
void write(const std::string& p, const std::vector<E>& v) {
  FILE* f = fopen(p.c_str(), "wb");
  fwrite(v.data(), sizeof(E), v.size(), f);
  fclose(f);
}

int main(int argc, char** argv) {
  if (argc != 11) return 2;
  const std::string d = argv[1];
  const int n = atoi(argv[2]), in_f = atoi(argv[3]), out_f = atoi(argv[4]), m = atoi(argv[5]);
  const int M = atoi(argv[6]), L = atoi(argv[7]), S = atoi(argv[8]), layer = atoi(argv[10]);
  const long size = atol(argv[9]);
  const int C = (in_f + CHUNK - 1) / CHUNK;
  auto x = read<T>(d + "/x", size_t(n) * in_f);
  auto arena = read<T>(d + "/arena", size);
  auto slot = read<int>(d + "/slot", n);
  auto rank = read<int>(d + "/rank", S);
  auto scale = read<float>(d + "/scale", S * M);
  auto a_off = read<int>(d + "/a_off", S * M * R);
  auto b_off = read<int>(d + "/b_off", S * M * R);
  std::vector<float> v(size_t(n) * C * R, 9.f);  // garbage the kernels must overwrite
  std::vector<T> y(size_t(n) * out_f, from_f(7.f));
  const int64_t base = int64_t(layer) * (size / L);
  // gridDim.z as lora_sgmv_cuda._split
  auto split = [](int b) { return std::max(1, std::min(8, (528 + b - 1) / b)); };
  dim3 g1{unsigned((n + TILE - 1) / TILE), unsigned(C), 1};
  g1.z = split(g1.x * g1.y);
  launch(g1, SHRINK_THREADS, [&] {
    MLC_CAT(mlc_lora_sgmv_shrink_, MLC_SUFFIX)(x.data(), arena.data(), slot.data(), rank.data(), scale.data(),
                                               a_off.data(), v.data(), n, in_f, m, M, base);
  });
  dim3 g2{unsigned((n + TILE - 1) / TILE), unsigned((out_f + EXPAND_OUT - 1) / EXPAND_OUT), 1};
  g2.z = split(g2.x * g2.y);
  launch(g2, EXPAND_THREADS, [&] {
    MLC_CAT(mlc_lora_sgmv_expand_, MLC_SUFFIX)(v.data(), arena.data(), slot.data(), rank.data(), b_off.data(),
                                               y.data(), n, C, out_f, m, M, base);
  });
  write(d + "/v", v);
  write(d + "/y", y);
  return 0;
}
