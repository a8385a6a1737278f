/*!
 * \file nccl_ccl.cc
 * \brief Disco's collectives for ccl "nccl" (`runtime.disco.nccl.*`), over NCCL opened at first use.
 *
 * The apache-tvm wheel ships disco (sessions, workers, `runtime.disco.allreduce` & co.) but was built
 * without NCCL, so nothing answers disco's look-up of `runtime.disco.nccl.<name>`. This file
 * registers those functions. libnccl.so.2 (the nvidia-nccl-cu13 wheel) and libcudart.so.13 are
 * dlopen'ed when a session first initialises NCCL; the handful of NCCL prototypes, the
 * ncclUniqueId layout and the enum values used here are declared below (checked against nccl.h of
 * nvidia-nccl-cu13 2.32.6),
 * so the library builds without CUDA or NCCL headers and a CPU install never needs NCCL.
 *
 * Semantics (one communicator over all workers; "in_group" uses the group's communicator):
 *   allreduce(send, kind, in_group, recv):   recv = reduce_kind over workers of send
 *   allgather(send, in_group, recv):         recv = concat over workers of send
 *   broadcast_from_worker0(send, g, recv):   recv = send of the group's first worker
 *   scatter_from_worker0(send, g, recv):     worker i's recv = i-th equal slice of worker 0's send
 *   gather_to_worker0(send, g, recv):        worker 0's recv = concat over workers of send
 *   recv_from_worker0(buf), send_to_worker(buf, i), recv_from_worker(buf, i): point to point
 *   sync_worker():                           waits for the worker's stream
 * Every collective runs on the stream tvm-ffi holds for the worker's device (TVMFFIEnvGetStream),
 * the one compiled kernels run on, so collectives are ordered with them and CUDA-graph capture
 * records them.
 *
 * Processes that use NCCL run with contract.NCCL_ENV (NVLink multicast off, docs/TP.md):
 * init_ccl_per_worker sets it (without overriding a user's value) before the communicator exists.
 * MLC_LORA_NCCL_ENV is that dict as "KEY=VALUE ...", read from python/mlc_lora/contract.py by CMake.
 *
 * `mlc_lora.runtime.disco_set_ccl(name)` names the ccl of the calling disco worker; the CPU tests
 * use it to run disco's collectives through a numpy reference registered from Python.
 */
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/disco/disco_worker.h>
#include <tvm/runtime/disco/session.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dl.h"

#ifndef MLC_LORA_NCCL_ENV
#error "MLC_LORA_NCCL_ENV (contract.py NCCL_ENV) must be defined by the build"
#endif

namespace mlc_lora {
namespace {

namespace ffi = tvm::ffi;
using tvm::runtime::DiscoWorker;
using tvm::runtime::DRef;
using tvm::runtime::Session;

// --- the slice of the NCCL and CUDA runtime APIs we call ---------------------------------------
constexpr int kNcclSuccess = 0;  // ncclSuccess
constexpr int kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct NcclUniqueId {
  char internal[kNcclUniqueIdBytes];
};
using NcclComm = void*;  // ncclComm_t
using CudaStream = void*;  // cudaStream_t
// ncclDataType_t
constexpr int kNcclInt8 = 0, kNcclUint8 = 1, kNcclInt32 = 2, kNcclUint32 = 3, kNcclInt64 = 4,
              kNcclUint64 = 5, kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclFloat64 = 8,
              kNcclBfloat16 = 9;
// ncclRedOp_t (note: disco's ReduceKind orders min before max, NCCL the other way round)
constexpr int kNcclSum = 0, kNcclProd = 1, kNcclMax = 2, kNcclMin = 3, kNcclAvg = 4;

struct NcclApi {
  int (*GetUniqueId)(NcclUniqueId*);
  int (*CommInitRank)(NcclComm*, int, NcclUniqueId, int);
  int (*CommSplit)(NcclComm, int, int, NcclComm*, void*);
  int (*AllReduce)(const void*, void*, size_t, int, int, NcclComm, CudaStream);
  int (*AllGather)(const void*, void*, size_t, int, NcclComm, CudaStream);
  int (*Broadcast)(const void*, void*, size_t, int, int, NcclComm, CudaStream);
  int (*Send)(const void*, size_t, int, int, NcclComm, CudaStream);
  int (*Recv)(void*, size_t, int, int, NcclComm, CudaStream);
  int (*GroupStart)();
  int (*GroupEnd)();
  const char* (*GetErrorString)(int);
  int (*GetVersion)(int*);
  // libcudart.so.13
  int (*SetDevice)(int);
  int (*StreamSynchronize)(CudaStream);
};

const NcclApi& Nccl() {
  static NcclApi api = [] {
    const char* n = "libnccl.so.2";
    const char* rt = "libcudart.so.13";
    void* nccl = dl::Open(n, "NCCL, needed for --tensor-parallel-shards > 1 on GPUs",
                          "install the CUDA extra: pip install 'mlc-lora[cuda]'");
    void* cudart = dl::Open(rt, "the CUDA runtime");
    NcclApi a;
    dl::Symbol(nccl, n, "ncclGetUniqueId", &a.GetUniqueId);
    dl::Symbol(nccl, n, "ncclCommInitRank", &a.CommInitRank);
    dl::Symbol(nccl, n, "ncclCommSplit", &a.CommSplit);
    dl::Symbol(nccl, n, "ncclAllReduce", &a.AllReduce);
    dl::Symbol(nccl, n, "ncclAllGather", &a.AllGather);
    dl::Symbol(nccl, n, "ncclBroadcast", &a.Broadcast);
    dl::Symbol(nccl, n, "ncclSend", &a.Send);
    dl::Symbol(nccl, n, "ncclRecv", &a.Recv);
    dl::Symbol(nccl, n, "ncclGroupStart", &a.GroupStart);
    dl::Symbol(nccl, n, "ncclGroupEnd", &a.GroupEnd);
    dl::Symbol(nccl, n, "ncclGetErrorString", &a.GetErrorString);
    dl::Symbol(nccl, n, "ncclGetVersion", &a.GetVersion);
    dl::Symbol(cudart, rt, "cudaSetDevice", &a.SetDevice);
    dl::Symbol(cudart, rt, "cudaStreamSynchronize", &a.StreamSynchronize);
    return a;
  }();
  return api;
}

#define MLC_NCCL_CHECK(call)                                                                   \
  do {                                                                                         \
    int st_ = (call);                                                                          \
    if (st_ != kNcclSuccess) {                                                                 \
      TVM_FFI_THROW(RuntimeError) << #call << " failed: " << Nccl().GetErrorString(st_);      \
    }                                                                                          \
  } while (0)

int NcclType(DLDataType t) {
  if (t.lanes != 1) TVM_FFI_THROW(ValueError) << "NCCL collectives need scalar dtypes";
  switch (t.code) {
    case kDLInt:
      if (t.bits == 8) return kNcclInt8;
      if (t.bits == 32) return kNcclInt32;
      if (t.bits == 64) return kNcclInt64;
      break;
    case kDLUInt:
      if (t.bits == 8) return kNcclUint8;
      if (t.bits == 32) return kNcclUint32;
      if (t.bits == 64) return kNcclUint64;
      break;
    case kDLFloat:
      if (t.bits == 16) return kNcclFloat16;
      if (t.bits == 32) return kNcclFloat32;
      if (t.bits == 64) return kNcclFloat64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return kNcclBfloat16;
      break;
  }
  TVM_FFI_THROW(ValueError) << "dtype (code " << int(t.code) << ", " << int(t.bits)
                            << " bits) has no NCCL counterpart";
}

int NcclOp(int reduce_kind) {
  switch (reduce_kind) {  // disco's ReduceKind: sum, prod, min, max, avg
    case 0: return kNcclSum;
    case 1: return kNcclProd;
    case 2: return kNcclMin;
    case 3: return kNcclMax;
    case 4: return kNcclAvg;
  }
  TVM_FFI_THROW(ValueError) << "unknown disco ReduceKind " << reduce_kind;
}

// One per worker thread (a disco worker is a thread or a process).
struct Ctx {
  DiscoWorker* worker = nullptr;
  int device_id = -1;
  NcclComm global = nullptr;
  NcclComm group = nullptr;

  static Ctx& Get() {
    thread_local Ctx ctx;
    return ctx;
  }
  NcclComm Comm(bool in_group) const {
    TVM_FFI_CHECK(worker != nullptr, RuntimeError)
        << "NCCL is not initialised on this disco worker (call session.init_ccl('nccl', ...))";
    return in_group ? group : global;
  }
  int GroupSize() const { return worker->num_workers / worker->num_groups; }
  CudaStream Stream() const { return TVMFFIEnvGetStream(kDLCUDA, device_id); }
};

size_t Numel(const ffi::Tensor& t) {
  size_t n = 1;
  for (int64_t d : t.shape()) n *= static_cast<size_t>(d);
  return n;
}

size_t ElemBytes(DLDataType t) { return (t.bits * t.lanes + 7) / 8; }
void* Data(const ffi::Tensor& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

/*! \brief Sets each KEY=VALUE of contract.NCCL_ENV that the environment does not set yet. */
void SetNcclEnv() {
  std::string pairs = MLC_LORA_NCCL_ENV;
  for (size_t start = 0, end; start < pairs.size(); start = end + 1) {
    end = pairs.find(' ', start);
    if (end == std::string::npos) end = pairs.size();
    std::string pair = pairs.substr(start, end - start);
    size_t eq = pair.find('=');
    if (eq != std::string::npos) setenv(pair.substr(0, eq).c_str(), pair.substr(eq + 1).c_str(), /*overwrite=*/0);
  }
}

void InitCCL(Session sess, ffi::Shape device_ids) {
  NcclUniqueId id;
  MLC_NCCL_CHECK(Nccl().GetUniqueId(&id));
  DRef per_worker = sess->GetGlobalFunc("runtime.disco.nccl.init_ccl_per_worker");
  sess->CallPacked(per_worker, device_ids, ffi::Bytes(id.internal, kNcclUniqueIdBytes));
}

void InitCCLPerWorker(ffi::Shape device_ids, ffi::Bytes unique_id) {
  DiscoWorker* worker = DiscoWorker::ThreadLocal();
  TVM_FFI_CHECK(worker != nullptr, RuntimeError) << "init_ccl_per_worker runs on disco workers only";
  TVM_FFI_CHECK_EQ(unique_id.size(), static_cast<size_t>(kNcclUniqueIdBytes), ValueError)
      << "NCCL unique id must be " << kNcclUniqueIdBytes << " bytes";
  TVM_FFI_CHECK_EQ(static_cast<int>(device_ids.size()), worker->num_workers, ValueError)
      << "init_ccl('nccl', ...) needs one device id per worker";
  Ctx& ctx = Ctx::Get();
  TVM_FFI_CHECK(ctx.worker == nullptr, RuntimeError) << "NCCL is already initialised on this worker";
  SetNcclEnv();  // NVLink SHARP (NVLS) multicast stays off (docs/TP.md)
  const NcclApi& api = Nccl();
  int device_id = static_cast<int>(device_ids[worker->local_worker_id]);
  if (int err = api.SetDevice(device_id)) {
    TVM_FFI_THROW(RuntimeError) << "cudaSetDevice(" << device_id << ") failed with " << err;
  }
  worker->default_device = DLDevice{kDLCUDA, device_id};
  worker->ccl = "nccl";
  NcclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), kNcclUniqueIdBytes);
  MLC_NCCL_CHECK(api.CommInitRank(&ctx.global, worker->num_workers, id, worker->worker_id));
  if (worker->num_groups == 1) {
    ctx.group = ctx.global;
  } else {
    int g = worker->num_workers / worker->num_groups;
    MLC_NCCL_CHECK(api.CommSplit(ctx.global, worker->worker_id / g, worker->worker_id % g,
                                 &ctx.group, nullptr));
  }
  ctx.worker = worker;
  ctx.device_id = device_id;
}

void AllReduce(ffi::Tensor send, int kind, bool in_group, ffi::Tensor recv) {
  const Ctx& ctx = Ctx::Get();
  MLC_NCCL_CHECK(Nccl().AllReduce(Data(send), Data(recv), Numel(send), NcclType(send.dtype()),
                                  NcclOp(kind), ctx.Comm(in_group), ctx.Stream()));
}

void AllGather(ffi::Tensor send, bool in_group, ffi::Tensor recv) {
  const Ctx& ctx = Ctx::Get();
  MLC_NCCL_CHECK(Nccl().AllGather(Data(send), Data(recv), Numel(send), NcclType(send.dtype()),
                                  ctx.Comm(in_group), ctx.Stream()));
}

bool IsRoot(const Ctx& ctx, bool in_group) {
  int w = ctx.worker->worker_id;
  return in_group ? w % ctx.GroupSize() == 0 : w == 0;
}

void BroadcastFromWorker0(ffi::Optional<ffi::Tensor> send, bool in_group, ffi::Tensor recv) {
  const Ctx& ctx = Ctx::Get();
  NcclComm comm = ctx.Comm(in_group);
  const void* src = nullptr;
  if (IsRoot(ctx, in_group)) {
    TVM_FFI_CHECK(send.has_value(), ValueError) << "broadcast_from_worker0: worker 0 needs `send`";
    src = Data(send.value());
  }
  MLC_NCCL_CHECK(Nccl().Broadcast(src, Data(recv), Numel(recv), NcclType(recv.dtype()), 0, comm,
                                  ctx.Stream()));
}

void ScatterFromWorker0(ffi::Optional<ffi::Tensor> send, bool in_group, ffi::Tensor recv) {
  const Ctx& ctx = Ctx::Get();
  NcclComm comm = ctx.Comm(in_group);
  const NcclApi& api = Nccl();
  int n = in_group ? ctx.GroupSize() : ctx.worker->num_workers;
  size_t per = Numel(recv);
  int dt = NcclType(recv.dtype());
  MLC_NCCL_CHECK(api.GroupStart());
  if (IsRoot(ctx, in_group)) {
    TVM_FFI_CHECK(send.has_value(), ValueError) << "scatter_from_worker0: worker 0 needs `send`";
    TVM_FFI_CHECK_EQ(Numel(send.value()), per * n, ValueError)
        << "scatter_from_worker0: send must hold " << n << " slices of recv's size";
    const char* base = static_cast<const char*>(Data(send.value()));
    for (int i = 0; i < n; ++i) {
      MLC_NCCL_CHECK(api.Send(base + i * per * ElemBytes(recv.dtype()), per, dt, i, comm,
                              ctx.Stream()));
    }
  }
  MLC_NCCL_CHECK(api.Recv(Data(recv), per, dt, 0, comm, ctx.Stream()));
  MLC_NCCL_CHECK(api.GroupEnd());
}

void GatherToWorker0(ffi::Tensor send, bool in_group, ffi::Optional<ffi::Tensor> recv) {
  const Ctx& ctx = Ctx::Get();
  NcclComm comm = ctx.Comm(in_group);
  const NcclApi& api = Nccl();
  int n = in_group ? ctx.GroupSize() : ctx.worker->num_workers;
  size_t per = Numel(send);
  int dt = NcclType(send.dtype());
  MLC_NCCL_CHECK(api.GroupStart());
  if (IsRoot(ctx, in_group)) {
    TVM_FFI_CHECK(recv.has_value(), ValueError) << "gather_to_worker0: worker 0 needs `recv`";
    TVM_FFI_CHECK_EQ(Numel(recv.value()), per * n, ValueError)
        << "gather_to_worker0: recv must hold " << n << " slices of send's size";
    char* base = static_cast<char*>(Data(recv.value()));
    for (int i = 0; i < n; ++i) {
      MLC_NCCL_CHECK(api.Recv(base + i * per * ElemBytes(send.dtype()), per, dt, i, comm,
                              ctx.Stream()));
    }
  }
  MLC_NCCL_CHECK(api.Send(Data(send), per, dt, 0, comm, ctx.Stream()));
  MLC_NCCL_CHECK(api.GroupEnd());
}

void SendToWorker(ffi::Tensor buf, int peer) {
  const Ctx& ctx = Ctx::Get();
  MLC_NCCL_CHECK(Nccl().Send(Data(buf), Numel(buf), NcclType(buf.dtype()), peer, ctx.Comm(false),
                             ctx.Stream()));
}

void RecvFromWorker(ffi::Tensor buf, int peer) {
  const Ctx& ctx = Ctx::Get();
  MLC_NCCL_CHECK(Nccl().Recv(Data(buf), Numel(buf), NcclType(buf.dtype()), peer, ctx.Comm(false),
                             ctx.Stream()));
}

void SyncWorker() {
  const Ctx& ctx = Ctx::Get();
  if (ctx.worker == nullptr) return;
  if (int err = Nccl().StreamSynchronize(ctx.Stream())) {
    TVM_FFI_THROW(RuntimeError) << "cudaStreamSynchronize failed with " << err;
  }
}

int64_t NcclVersion() {
  int v = 0;
  MLC_NCCL_CHECK(Nccl().GetVersion(&v));
  return v;
}

void DiscoSetCCL(ffi::String name) {
  DiscoWorker* worker = DiscoWorker::ThreadLocal();
  TVM_FFI_CHECK(worker != nullptr, RuntimeError) << "disco_set_ccl runs on disco workers only";
  worker->ccl = name;
}

// A TVM built with NCCL registers the same names itself; keep its functions then.
void Register(const char* name, ffi::Function f) {
  if (!ffi::Function::GetGlobal(name).has_value()) ffi::Function::SetGlobal(name, f);
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  using F = ffi::Function;
  Register("runtime.disco.nccl.init_ccl", F::FromTyped(InitCCL));
  Register("runtime.disco.nccl.init_ccl_per_worker", F::FromTyped(InitCCLPerWorker));
  Register("runtime.disco.nccl.allreduce", F::FromTyped(AllReduce));
  Register("runtime.disco.nccl.allgather", F::FromTyped(AllGather));
  Register("runtime.disco.nccl.broadcast_from_worker0", F::FromTyped(BroadcastFromWorker0));
  Register("runtime.disco.nccl.scatter_from_worker0", F::FromTyped(ScatterFromWorker0));
  Register("runtime.disco.nccl.gather_to_worker0", F::FromTyped(GatherToWorker0));
  Register("runtime.disco.nccl.recv_from_worker0",
           F::FromTyped([](ffi::Tensor buf) { RecvFromWorker(buf, 0); }));
  Register("runtime.disco.nccl.send_to_worker", F::FromTyped(SendToWorker));
  Register("runtime.disco.nccl.recv_from_worker", F::FromTyped(RecvFromWorker));
  Register("runtime.disco.nccl.sync_worker", F::FromTyped(SyncWorker));
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("mlc_lora.runtime.nccl_version", NcclVersion)
      .def("mlc_lora.runtime.disco_set_ccl", DiscoSetCCL);
}

}  // namespace mlc_lora
