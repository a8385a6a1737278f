/*!
 * \file tensor_util.cc
 * \brief Zero-offset views, async host -> device copies, PoolError -> tvm-ffi errors.
 */
#include "tensor_util.h"

#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/runtime/device_api.h>

#include <cstring>

namespace mlc_lora {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

namespace {

struct ViewAlloc {
  Tensor base;
  int64_t byte_offset;
  void AllocData(DLTensor* t) {
    t->data = static_cast<char*>(base->data) + base->byte_offset + byte_offset;
  }
  void FreeData(DLTensor*) {}
};

}  // namespace

Tensor View(const Tensor& base, int64_t byte_offset, std::vector<int64_t> shape, DLDataType dtype) {
  return Tensor(ffi::Tensor::FromNDAlloc(ViewAlloc{base, byte_offset},
                                         ffi::ShapeView(shape.data(), shape.size()), dtype,
                                         base->device));
}

void UploadAsync(const Tensor& dst, const void* src, int64_t bytes) {
  const DLDevice dev = dst->device;
  if (dev.device_type == kDLCPU || bytes == 0) {
    std::memcpy(static_cast<char*>(dst->data) + dst->byte_offset, src, bytes);
    return;
  }
  int64_t n = bytes;
  DLTensor from{const_cast<void*>(src), DLDevice{kDLCPU, 0}, 1, DLDataType{kDLUInt, 8, 1}, &n,
                nullptr, 0};
  DLTensor to = *dst.operator->();
  to.ndim = 1;
  to.shape = &n;
  to.strides = nullptr;
  to.dtype = DLDataType{kDLUInt, 8, 1};
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  if (stream == nullptr && dev.device_type == kDLCUDA) stream = reinterpret_cast<void*>(0x1);
  tvm::runtime::DeviceAPI::Get(dev)->CopyDataFromTo(&from, &to, stream);
}

void RethrowPoolError(const PoolError& e) {
  if (e.kind == PoolError::kExhausted) {
    TVM_FFI_THROW(PoolExhaustedError) << e.what();
  }
  TVM_FFI_THROW(ValueError) << e.what();
}

}  // namespace mlc_lora
