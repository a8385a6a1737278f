// compiler_passes/ops/gemv/gemv.cu on the CPU (prelude.h), launched as gemv_cuda.wrapper launches it.
// Usage: gemv_emu DIR NT n K N threads LDW; reads DIR/{x, w (N, LDW)} (raw), writes DIR/y.
#include "prelude.h"
#include "io.h"

#include "gemv.cu"

int main(int argc, char** argv) {
  if (argc != 8) return 2;
  const std::string d = argv[1];
  const int nt = atoi(argv[2]), n = atoi(argv[3]), K = atoi(argv[4]), N = atoi(argv[5]), threads = atoi(argv[6]), ldw = atoi(argv[7]);
  auto x = read<T>(d + "/x", size_t(n) * K);
  auto w = read<T>(d + "/w", size_t(N) * ldw);
  std::vector<T> y(size_t(n) * N, from_f(7.f));  // garbage the kernel must overwrite
  const dim3 grid{unsigned((N + ROWS - 1) / ROWS), 1, 1};
  launch(grid, threads, [&] {
    const T *xp = x.data(), *wp = w.data();
    T* yp = y.data();
    switch (nt) {
      case 1: MLC_CAT(MLC_CAT(mlc_lora_gemv_, MLC_SUFFIX), _t1)(xp, wp, yp, n, K, N, ldw); break;
      case 2: MLC_CAT(MLC_CAT(mlc_lora_gemv_, MLC_SUFFIX), _t2)(xp, wp, yp, n, K, N, ldw); break;
      case 4: MLC_CAT(MLC_CAT(mlc_lora_gemv_, MLC_SUFFIX), _t4)(xp, wp, yp, n, K, N, ldw); break;
      default: MLC_CAT(MLC_CAT(mlc_lora_gemv_, MLC_SUFFIX), _t8)(xp, wp, yp, n, K, N, ldw); break;
    }
  });
  write(d + "/y", y);
  return 0;
}
