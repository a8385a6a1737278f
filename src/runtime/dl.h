/*!
 * \file dl.h
 * \brief Shared libraries opened at first use (cuBLAS, NCCL, the CUDA runtime, TVM's CUDA runtime).
 *
 * `dl::Open` reuses a copy already in the process (loaded by TVM, torch or mlc_lora's Python
 * loader: RTLD_NOLOAD) before loading one, always RTLD_NOW | RTLD_GLOBAL; `dl::Symbol` looks a
 * function up. Both throw a tvm-ffi RuntimeError naming the library, what it is needed for and
 * dlerror(), so every caller reports the same clear message.
 */
#ifndef MLC_LORA_RUNTIME_DL_H_
#define MLC_LORA_RUNTIME_DL_H_

#include <dlfcn.h>
#include <tvm/ffi/error.h>

#include <string>

namespace mlc_lora {
namespace dl {

/*!
 * \brief The handle of library `name` (a file name or a path), opened now if not loaded yet.
 * \param what what it is, for the error ("the CUDA runtime"); may be empty.
 * \param hint how to get it, appended to the error ("install the CUDA extra: ..."); may be empty.
 */
inline void* Open(const std::string& name, const std::string& what = "", const std::string& hint = "") {
  void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  if (h == nullptr) h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    const char* err = ::dlerror();
    TVM_FFI_THROW(RuntimeError) << "cannot open " << name << (what.empty() ? "" : " (" + what + ")")
                                << ": " << (err ? err : "unknown error")
                                << (hint.empty() ? "" : " (" + hint + ")");
  }
  return h;
}

/*! \brief Function `symbol` of `lib` (opened as `lib_name`) as a pointer of type F. */
template <typename F>
F Symbol(void* lib, const std::string& lib_name, const char* symbol) {
  void* p = ::dlsym(lib, symbol);
  if (p == nullptr) TVM_FFI_THROW(RuntimeError) << lib_name << " lacks symbol " << symbol;
  return reinterpret_cast<F>(p);
}

/*! \brief Fill `*out` with function `symbol` of `lib` (the type is taken from `out`). */
template <typename F>
void Symbol(void* lib, const std::string& lib_name, const char* symbol, F* out) {
  *out = Symbol<F>(lib, lib_name, symbol);
}

}  // namespace dl
}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_DL_H_
