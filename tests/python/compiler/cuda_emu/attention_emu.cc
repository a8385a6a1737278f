// compiler_passes/ops/attention/attention.cu on the CPU (prelude.h), launched as attention_cuda.py's
// wrappers launch it (grid, 128 threads). Usage:
//   attention_emu DIR prefill n b hq hkv npages m max_q_len sm_scale_log2
//   attention_emu DIR KERNEL  n b hq hkv npages m num_splits chunk sm_scale_log2
// (KERNEL: decode, pipe2 or pipe4: mlc_lora_attn_decode or one of its pipelined variants)
// reads DIR/{q, qo_indptr (prefill), pages, page_indptr, page_indices, last_page_len} (raw), writes
// DIR/o, DIR/lse and (decode) DIR/counters.
#include "prelude.h"
#include "io.h"

#include "attention.cu"

int main(int argc, char** argv) {
  if (argc != 12) return 2;
  const std::string d = argv[1], mode = argv[2];
  const int n = atoi(argv[3]), b = atoi(argv[4]), hq = atoi(argv[5]), hkv = atoi(argv[6]);
  const int npages = atoi(argv[7]), m = atoi(argv[8]), k1 = atoi(argv[9]), k2 = atoi(argv[10]);
  const float sm_scale_log2 = static_cast<float>(atof(argv[11]));
  auto q = read<T>(d + "/q", size_t(n) * hq * D);
  auto pages = read<T>(d + "/pages", size_t(npages) * 2 * hkv * PAGE * D);
  auto page_indptr = read<int>(d + "/page_indptr", b + 1);
  auto page_indices = read<int>(d + "/page_indices", m);
  auto last = read<int>(d + "/last_page_len", b);
  std::vector<T> o(size_t(n) * hq * D, from_f(7.f));  // garbage the kernel must overwrite
  std::vector<float> lse(size_t(n) * hq, 7.f);
  if (mode == "prefill") {
    auto qo_indptr = read<int>(d + "/qo_indptr", b + 1);
    const int max_q_len = k1;
    launch(dim3{unsigned((max_q_len + BM - 1) / BM), unsigned(hq), unsigned(b)}, NTHREADS, [&] {
      mlc_lora_attn_prefill(q.data(), qo_indptr.data(), pages.data(), page_indptr.data(), page_indices.data(),
                            last.data(), o.data(), lse.data(), hq, hkv, sm_scale_log2);
    });
  } else {
    const int num_splits = k1, chunk = k2;
    std::vector<float> part_o(size_t(num_splits) * b * hq * D, 9.f), part_lse(size_t(num_splits) * b * hq, 9.f);
    std::vector<int> counters(size_t(b) * hq, 0);
    auto kernel = mode == "pipe2" ? mlc_lora_attn_decode_pipe2
                  : mode == "pipe4" ? mlc_lora_attn_decode_pipe4 : mlc_lora_attn_decode;
    launch(dim3{unsigned(num_splits), unsigned(hq), unsigned(b)}, NTHREADS, [&] {
      kernel(q.data(), pages.data(), page_indptr.data(), page_indices.data(), last.data(), o.data(), lse.data(),
             part_o.data(), part_lse.data(), counters.data(), hq, hkv, chunk, sm_scale_log2);
    });
    write(d + "/counters", counters);
  }
  write(d + "/o", o);
  write(d + "/lse", lse);
  return 0;
}
