/*!
 * \file cpu_gemm.h
 * \brief The CPU float32 GEMM behind mlc_lora.runtime.cublas_gemm on CPU tensors.
 */
#ifndef MLC_LORA_RUNTIME_CPU_GEMM_H_
#define MLC_LORA_RUNTIME_CPU_GEMM_H_

#include <cstdint>

namespace mlc_lora {

/*!
 * Semantics: out[i, j] = sum_{l < k} x[i, l] * w[j, l] for x (m, k), w (n, ldw >= k), out (m, n),
 * all row-major (row strides k, ldw and n), float32 accumulation. Runs on a persistent pool of
 * MLC_LORA_NUM_THREADS threads (default: the hardware concurrency).
 */
void CpuGemmF32(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
                int64_t ldw);

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_CPU_GEMM_H_
