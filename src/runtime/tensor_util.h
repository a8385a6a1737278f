/*!
 * \file tensor_util.h
 * \brief Helpers shared by the KV cache and the adapter store: zero-offset tensor views, host ->
 *        device copies that do not wait for the stream, and PoolError -> tvm-ffi errors.
 */
#ifndef MLC_LORA_RUNTIME_TENSOR_UTIL_H_
#define MLC_LORA_RUNTIME_TENSOR_UTIL_H_

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/runtime/tensor.h>

#include <cstdint>
#include <vector>

#include "page_pool.h"

namespace mlc_lora {

constexpr DLDataType kInt32{kDLInt, 32, 1};
constexpr DLDataType kFloat32{kDLFloat, 32, 1};

/*! \brief Bytes of one element of `t`. */
inline int64_t Bytes(DLDataType t) { return (t.bits * t.lanes + 7) / 8; }

/*!
 * \brief A tensor whose data pointer is `base + byte_offset` and whose byte_offset is 0.
 * TVM's CPU kernels (and some GPU ones) reject a nonzero DLTensor::byte_offset, which is what
 * Tensor::CreateView would produce; pointer arithmetic is valid on CPU, CUDA and ROCm memory.
 */
tvm::runtime::Tensor View(const tvm::runtime::Tensor& base, int64_t byte_offset,
                          std::vector<int64_t> shape, DLDataType dtype);

/*!
 * \brief Copy `bytes` from host memory into `dst`, ordered on the device's current stream
 * without waiting for it. Tensor::CopyFromBytes synchronizes the stream, which stalls the host
 * until the GPU has drained every step's queue; here the driver stages the pageable source at
 * once (so `src` may be reused on return) and the host runs ahead. With no stream set, TVM's
 * kernels go to the legacy default stream: cudaStreamLegacy (0x1) names it for the async copy.
 */
void UploadAsync(const tvm::runtime::Tensor& dst, const void* src, int64_t bytes);

/*! \brief Calls f(i, n) for each run ids[i .. i + n) of consecutive page ids, in order: one copy
 *  per run where pages are copied. */
template <typename F>
void ForEachPageRun(const std::vector<int32_t>& ids, F f) {
  for (size_t i = 0; i < ids.size();) {
    size_t n = 1;
    while (i + n < ids.size() && ids[i + n] == ids[i] + static_cast<int32_t>(n)) ++n;
    f(static_cast<int64_t>(i), static_cast<int64_t>(n));
    i += n;
  }
}

/*! \brief First element of a host tensor (DLPack producers may set byte_offset). */
template <typename T>
const T* HostData(const tvm::ffi::TensorView& t) {
  return reinterpret_cast<const T*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}

/*! \brief Throw `e` as the tvm-ffi error Python maps to it (PoolExhaustedError or ValueError). */
[[noreturn]] void RethrowPoolError(const PoolError& e);

/*! \brief Run a pool operation; PoolError becomes the matching Python exception. */
template <typename F>
auto Guard(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const PoolError& e) {
    RethrowPoolError(e);
  }
}

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_TENSOR_UTIL_H_
