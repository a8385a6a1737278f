/*!
 * \file cublas_gemm.cc
 * \brief out = x @ w^T through cuBLAS (fp32 accumulation), called by compiled models as an extern.
 *
 * Semantics: x (..., K), w (N' >= N, K), out (..., N), all contiguous, one dtype (float16, bfloat16
 * or float32); out[m, n] = sum_k x[m, k] * w[n, k] for n < N, accumulated in float32 (w's rows past
 * N, rows a weight reserves below its own for the LoRA rank rows route, are not read).
 *
 * libcublas.so.13 is opened at first use (dlopen) and the few prototypes and enum values used here
 * are declared below (checked against cublas_api.h / library_types.h of nvidia-cublas 13.x), so this
 * file builds without CUDA headers and a CPU install never needs cuBLAS. The stream is the one
 * tvm-ffi holds for the device (TVMFFIEnvGetStream), so the call follows TVM's CUDA-graph capture
 * stream; each device gets one handle with a fixed workspace, made by `cublas_init` before any
 * capture (a capture cannot allocate).
 *
 * On CPU tensors (float32 only) the same function runs cpu_gemm.cc's blocked, multi-threaded GEMM:
 * DispatchCublas sends the linears of llvm-target models here too.
 */
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cpu_gemm.h"
#include "dl.h"

namespace mlc_lora {
namespace {

namespace ffi = tvm::ffi;

// --- the slice of the CUDA runtime and cuBLAS APIs we call -------------------------------------
using cublasHandle_t = void*;
using cudaStream_t = void*;
constexpr int kCublasSuccess = 0;      // CUBLAS_STATUS_SUCCESS
constexpr int kOpN = 0, kOpT = 1;      // CUBLAS_OP_N, CUBLAS_OP_T
constexpr int kComputeF32 = 68;        // CUBLAS_COMPUTE_32F
constexpr int kGemmDefault = -1;       // CUBLAS_GEMM_DEFAULT
constexpr int kR16F = 2, kR16BF = 14, kR32F = 0;  // cudaDataType: CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F
// 32 MiB: what cuBLAS asks for on Hopper (and PyTorch's default there).
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct CudaApi {
  int (*GetDevice)(int*);
  int (*SetDevice)(int);
  int (*Malloc)(void**, size_t);
  const char* (*GetErrorString)(int);
};

struct CublasApi {
  int (*Create)(cublasHandle_t*);
  int (*SetStream)(cublasHandle_t, cudaStream_t);
  int (*SetWorkspace)(cublasHandle_t, void*, size_t);
  int (*GemmEx)(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int,
                const void*, int, int, const void*, void*, int, int, int, int);
  const char* (*GetStatusString)(int);
};

const CudaApi& Cuda() {
  static CudaApi api = [] {
    const char* n = "libcudart.so.13";
    void* lib = dl::Open(n, "the CUDA runtime");
    CudaApi a;
    dl::Symbol(lib, n, "cudaGetDevice", &a.GetDevice);
    dl::Symbol(lib, n, "cudaSetDevice", &a.SetDevice);
    dl::Symbol(lib, n, "cudaMalloc", &a.Malloc);
    dl::Symbol(lib, n, "cudaGetErrorString", &a.GetErrorString);
    return a;
  }();
  return api;
}

const CublasApi& Cublas() {
  static CublasApi api = [] {
    // libcublas.so.13 needs libcublasLt.so.13 beside it; the Python loader (mlc_lora.runner)
    // preloads both from the nvidia-cublas wheel when they are not on the library path.
    const char* n = "libcublas.so.13";
    void* lib = dl::Open(n, "", "install the CUDA extra: pip install 'mlc-lora[cuda]', or compile with --gemm tvm");
    CublasApi a;
    dl::Symbol(lib, n, "cublasCreate_v2", &a.Create);
    dl::Symbol(lib, n, "cublasSetStream_v2", &a.SetStream);
    dl::Symbol(lib, n, "cublasSetWorkspace_v2", &a.SetWorkspace);
    dl::Symbol(lib, n, "cublasGemmEx", &a.GemmEx);
    dl::Symbol(lib, n, "cublasGetStatusString", &a.GetStatusString);
    return a;
  }();
  return api;
}

#define MLC_CUBLAS_CHECK(call)                                                            \
  do {                                                                                    \
    int st_ = (call);                                                                     \
    if (st_ != kCublasSuccess) {                                                          \
      TVM_FFI_THROW(RuntimeError) << #call << " failed: " << Cublas().GetStatusString(st_); \
    }                                                                                     \
  } while (0)

#define MLC_CUDA_CHECK(call)                                                             \
  do {                                                                                   \
    int st_ = (call);                                                                    \
    if (st_ != 0) {                                                                      \
      TVM_FFI_THROW(RuntimeError) << #call << " failed: " << Cuda().GetErrorString(st_); \
    }                                                                                    \
  } while (0)

/*! \brief One cuBLAS handle per device, its fixed workspace and the stream it was last bound to. */
struct DeviceState {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  cudaStream_t stream = nullptr;
  bool bound = false;
};

std::mutex g_mutex;
std::unordered_map<int, DeviceState>& States() {
  static auto* states = new std::unordered_map<int, DeviceState>();  // never freed: outlives users
  return *states;
}

DeviceState& StateFor(int device_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceState& s = States()[device_id];
  if (s.handle != nullptr) return s;
  int prev = 0;
  MLC_CUDA_CHECK(Cuda().GetDevice(&prev));
  MLC_CUDA_CHECK(Cuda().SetDevice(device_id));
  MLC_CUBLAS_CHECK(Cublas().Create(&s.handle));
  MLC_CUDA_CHECK(Cuda().Malloc(&s.workspace, kWorkspaceBytes));
  MLC_CUDA_CHECK(Cuda().SetDevice(prev));
  return s;
}

/*! \brief Make the handle and workspace of a device now (outside any CUDA-graph capture). */
void CublasInit(int device_id) { StateFor(device_id); }

/*! \brief Whether libcublas.so.13 can be opened in this process. */
bool CublasAvailable() {
  try {
    Cublas();
    return true;
  } catch (const ffi::Error&) {
    return false;
  }
}

int CudaDataType(DLDataType t) {
  if (t.code == kDLFloat && t.bits == 16 && t.lanes == 1) return kR16F;
  if (t.code == kDLBfloat && t.bits == 16 && t.lanes == 1) return kR16BF;
  if (t.code == kDLFloat && t.bits == 32 && t.lanes == 1) return kR32F;
  TVM_FFI_THROW(TypeError) << "cublas_gemm supports float16, bfloat16 and float32, not "
                           << ffi::DLDataTypeToString(t);
  return -1;
}

char* DataOf(const ffi::TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

void CpuGemm(const ffi::TensorView& x, const ffi::TensorView& w, const ffi::TensorView& out,
             int64_t m, int64_t n, int64_t k, int64_t ldw) {
  if (x.dtype().code != kDLFloat || x.dtype().bits != 32 || x.dtype().lanes != 1) {
    TVM_FFI_THROW(TypeError) << "cublas_gemm on CPU tensors supports float32 only";
  }
  CpuGemmF32(reinterpret_cast<const float*>(DataOf(x)), reinterpret_cast<const float*>(DataOf(w)),
             reinterpret_cast<float*>(DataOf(out)), m, n, k, ldw);
}

/*!
 * \brief out (..., N) = x (..., K) @ w[:N, :K]^T for w (N' >= N, K' >= K): the weight's first N
 * rows and first K columns, its rows K' apart (a weight stored with spare rows below or spare
 * columns beside its own); destination-passing (out is written).
 */
void CublasGemm(ffi::TensorView x, ffi::TensorView w, ffi::TensorView out) {
  if (w.ndim() != 2 || x.ndim() < 1 || out.ndim() != x.ndim()) {
    TVM_FFI_THROW(ValueError) << "cublas_gemm expects x (..., K), w (N, K), out (..., N); got ranks "
                              << x.ndim() << ", " << w.ndim() << ", " << out.ndim();
  }
  const int64_t k = x.size(-1), ldw = w.size(1), n = out.size(-1);
  if (ldw < k || w.size(0) < n) {
    TVM_FFI_THROW(ValueError) << "cublas_gemm shape mismatch: x[..., " << x.size(-1) << "], w ["
                              << w.size(0) << ", " << k << "], out[..., " << n << "]";
  }
  int64_t m = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) {
    if (x.size(i) != out.size(i)) TVM_FFI_THROW(ValueError) << "cublas_gemm: x and out rows differ";
    m *= x.size(i);
  }
  for (const ffi::TensorView* t : {&x, &w, &out}) {
    if (!t->IsContiguous()) TVM_FFI_THROW(ValueError) << "cublas_gemm needs contiguous tensors";
    if (t->dtype() != x.dtype()) TVM_FFI_THROW(TypeError) << "cublas_gemm: mixed dtypes";
    if (t->device().device_type != x.device().device_type ||
        t->device().device_id != x.device().device_id) {
      TVM_FFI_THROW(ValueError) << "cublas_gemm: tensors on different devices";
    }
  }
  if (m == 0 || n == 0) return;
  if (x.device().device_type == kDLCPU) return CpuGemm(x, w, out, m, n, k, ldw);
  if (x.device().device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << "cublas_gemm runs on CUDA (or float32 CPU) tensors only";
  }
  if (m > INT32_MAX || n > INT32_MAX || ldw > INT32_MAX) {
    TVM_FFI_THROW(ValueError) << "cublas_gemm: a dimension exceeds 2^31-1";
  }
  const int dev = x.device().device_id;
  DeviceState& s = StateFor(dev);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  if (!s.bound || stream != s.stream) {
    // cublasSetStream resets the workspace to cuBLAS's own pool: set ours again after it, so no
    // call allocates (which a CUDA-graph capture would refuse).
    MLC_CUBLAS_CHECK(Cublas().SetStream(s.handle, stream));
    MLC_CUBLAS_CHECK(Cublas().SetWorkspace(s.handle, s.workspace, kWorkspaceBytes));
    s.stream = stream;
    s.bound = true;
  }
  const int dt = CudaDataType(x.dtype());
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major out (m x n) = x (m x k) . w^T is column-major out^T (n x m) = w (k x n)^T . x^T:
  // the "TN" GEMM with both operands read along K, cuBLAS's fastest layout.
  MLC_CUBLAS_CHECK(Cublas().GemmEx(s.handle, kOpT, kOpN, static_cast<int>(n), static_cast<int>(m),
                                   static_cast<int>(k), &alpha, DataOf(w), dt, static_cast<int>(ldw),
                                   DataOf(x), dt, static_cast<int>(k), &beta, DataOf(out), dt,
                                   static_cast<int>(n), kComputeF32, kGemmDefault));
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("mlc_lora.runtime.cublas_gemm", CublasGemm)
      .def("mlc_lora.runtime.cublas_init", CublasInit)
      .def("mlc_lora.runtime.cublas_available", CublasAvailable);
}

}  // namespace mlc_lora
