/*!
 * \file tvm/support/io.h
 * \brief mlc-lora's stand-in for the TVM header the apache-tvm wheel does not ship.
 *
 * tvm/runtime/tensor.h includes it for Tensor::Save/Load, which mlc-lora never calls; this is the
 * smallest Stream those inline functions compile against (raw bytes, trivially copyable values).
 */
#ifndef TVM_SUPPORT_IO_H_
#define TVM_SUPPORT_IO_H_

#include <cstddef>
#include <type_traits>

namespace tvm {
namespace support {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual size_t Read(void* ptr, size_t size) = 0;
  virtual size_t Write(const void* ptr, size_t size) = 0;

  template <typename T>
  void Write(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "mlc-lora's Stream writes plain values only");
    Write(&value, sizeof(T));
  }
  template <typename T>
  bool Read(T* out) {
    static_assert(std::is_trivially_copyable_v<T>, "mlc-lora's Stream reads plain values only");
    return Read(static_cast<void*>(out), sizeof(T)) == sizeof(T);
  }
  template <typename T>
  void WriteArray(const T* data, size_t n) {
    Write(static_cast<const void*>(data), sizeof(T) * n);
  }
  template <typename T>
  bool ReadArray(T* data, size_t n) {
    return Read(static_cast<void*>(data), sizeof(T) * n) == sizeof(T) * n;
  }
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_IO_H_
