/*!
 * \file unified_kv_cache.cc
 * \brief mlc-lora's paged KV cache over one arena whose pages also hold LoRA adapter rows.
 *
 * A thin TVM layer over PagePool (page_pool.h): it owns the device arena, runs the TIR kernels
 * that tvm.relax.frontend.nn.llm.kv_cache generates (passed at creation, like TVM's own cache),
 * copies adapter weights between host and pages, and builds the per-batch index and LoRA tables.
 * It implements TVM's abstract AttentionKVCacheObj, so the stock vm.builtin.kv_state_* and
 * attention_kv_cache_* builtins drive it.
 *
 * Arena (docs/DESIGN.md): L*P*E elements, E = 2*h_kv*page_size*d; layer l owns [l*P*E, (l+1)*P*E)
 * and sees it as pages [P, 2, h_kv, page_size, d]. A page id is the same E-block in every layer.
 *
 * Attention per layer: split qkv + RoPE, append the new K/V to the pages, then one paged kernel
 * over each sequence's pages (new tokens included): decode when every sequence appends one token,
 * else prefill with a bottom-right-aligned causal mask. Prefixes shared by fork are plain shared
 * pages (reference counted); a shared page is copied before anyone appends to it. The kernels are
 * TVM's TIR ones or, on CUDA, ours (compiler_passes/ops/attention/: tensor-core prefill,
 * split-KV decode whose split count this object picks per batch).
 */
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>
#include <tvm/runtime/tensor.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "page_pool.h"
#include "runtime/vm/kv_state.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;
using tvm::runtime::vm::AttentionKVCacheObj;

namespace {

[[noreturn]] void Rethrow(const PoolError& e) {
  if (e.kind == PoolError::kExhausted) {
    TVM_FFI_THROW(PoolExhaustedError) << e.what();
  }
  TVM_FFI_THROW(ValueError) << e.what();
}

/*! \brief Run a pool operation; PoolError becomes the matching Python exception. */
template <typename F>
auto Guard(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const PoolError& e) {
    Rethrow(e);
  }
}

/*!
 * \brief A tensor whose data pointer is `base + byte_offset` and whose byte_offset is 0.
 * TVM's CPU kernels (and some GPU ones) reject a nonzero DLTensor::byte_offset, which is what
 * Tensor::CreateView would produce; pointer arithmetic is valid on CPU, CUDA and ROCm memory.
 */
struct ViewAlloc {
  Tensor base;
  int64_t byte_offset;
  void AllocData(DLTensor* t) {
    t->data = static_cast<char*>(base->data) + base->byte_offset + byte_offset;
  }
  void FreeData(DLTensor*) {}
};

Tensor View(const Tensor& base, int64_t byte_offset, std::vector<int64_t> shape, DLDataType dtype) {
  return Tensor(ffi::Tensor::FromNDAlloc(ViewAlloc{base, byte_offset},
                                         ffi::ShapeView(shape.data(), shape.size()), dtype,
                                         base->device));
}

int64_t Bytes(DLDataType t) { return (t.bits * t.lanes + 7) / 8; }

/*!
 * \brief Copy `bytes` from host memory into `dst`, ordered on the device's current stream
 * without waiting for it. Tensor::CopyFromBytes synchronizes the stream, which stalls the host
 * until the GPU has drained every step's queue; here the driver stages the pageable source at
 * once (so `src` may be reused on return) and the host runs ahead. With no stream set, TVM's
 * kernels go to the legacy default stream: cudaStreamLegacy (0x1) names it for the async copy.
 */
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

/*! \brief First element of a host tensor (DLPack producers may set byte_offset). */
template <typename T>
const T* HostData(const ffi::TensorView& t) {
  return reinterpret_cast<const T*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}

constexpr DLDataType kInt32{kDLInt, 32, 1};
constexpr DLDataType kFloat32{kDLFloat, 32, 1};
constexpr int kRoPEInline = 2;  // TVM's RoPEMode: 0 none, 1 normal (split_rotary), 2 inline
constexpr int64_t kAlign = 16;  // int32 elements; every aux segment starts 64-byte aligned

int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

/*!
 * \brief The function inside a kernel tuple: ["tirx", f] (TVM's TIR kernels, TVM's signature) or
 * ["mlc_lora", f] (compiler_passes/ops/attention/: tensor-core CUDA kernels, their own
 * signature). FlashInfer's tuples are refused.
 */
ffi::Function AttentionKernel(const ffi::Any& arg, const char* what, bool* ours) {
  auto tup = arg.cast<ffi::Array<ffi::Any>>();
  if (tup.empty()) {
    TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache needs the " << what << " kernel";
  }
  auto backend = tup[0].cast<ffi::String>();
  if ((backend != "tirx" && backend != "mlc_lora") || tup.size() != 2) {
    TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache runs TIR or mlc_lora attention kernels; the "
                              << what << " kernel comes from backend '" << backend << "'";
  }
  *ours = backend == "mlc_lora";
  return tup[1].cast<ffi::Function>();
}

/*!
 * Split-KV decode: enough blocks for two waves of a 132-SM GPU (any GPU is correct, this only
 * sets how finely a short batch's context is split), at most kMaxSplits splits, at least
 * kMinSplitKeys keys each.
 */
constexpr int64_t kDecodeTargetBlocks = 264;
constexpr int64_t kMaxSplits = 32;
constexpr int64_t kMinSplitKeys = 64;

}  // namespace

class UnifiedKVCacheObj : public AttentionKVCacheObj {
 public:
  struct Config {
    int64_t num_layers, num_qo_heads, num_kv_heads, head_dim, page_size, num_pages;
    int64_t max_batch, max_tokens;
    int rope_mode;
    double rope_scale, rope_theta;
    ffi::Optional<Tensor> rope_ext_factors;
    DLDataType dtype;
    DLDevice device;
  };
  struct Kernels {
    ffi::Function append, prefill, decode, split_rotary, copy_page;
    ffi::Optional<ffi::Function> debug_get_kv;
    bool own_attention = false;  // prefill/decode are ["mlc_lora", f] (attention_cuda.py)
  };

  UnifiedKVCacheObj(Config cfg, Kernels k)
      : cfg_(std::move(cfg)),
        k_(std::move(k)),
        pool_(Guard([&] { return PagePool(cfg_.num_pages, cfg_.page_size); })) {
    page_elems_ = 2 * cfg_.num_kv_heads * cfg_.page_size * cfg_.head_dim;
    const int64_t layer_elems = cfg_.num_pages * page_elems_;
    arena_ = Tensor::Empty({cfg_.num_layers * layer_elems}, cfg_.dtype, cfg_.device);
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      layer_pages_.push_back(View(arena_, l * layer_elems * Bytes(cfg_.dtype),
                                  {cfg_.num_pages, 2, cfg_.num_kv_heads, cfg_.page_size,
                                   cfg_.head_dim},
                                  cfg_.dtype));
    }
    const int64_t T = cfg_.max_tokens;
    q_buf_ = Tensor::Empty({T * cfg_.num_qo_heads * cfg_.head_dim}, cfg_.dtype, cfg_.device);
    k_buf_ = Tensor::Empty({T * cfg_.num_kv_heads * cfg_.head_dim}, cfg_.dtype, cfg_.device);
    v_buf_ = Tensor::Empty({T * cfg_.num_kv_heads * cfg_.head_dim}, cfg_.dtype, cfg_.device);
    lse_buf_ = Tensor::Empty({T * cfg_.num_qo_heads}, kFloat32, cfg_.device);
    if (k_.own_attention) {
      // split-KV partials: b * splits <= kDecodeTargetBlocks / h_q + b (see BuildAux)
      const int64_t rows = kDecodeTargetBlocks + cfg_.max_batch * cfg_.num_qo_heads;
      part_o_ = Tensor::Empty({rows * cfg_.head_dim}, kFloat32, cfg_.device);
      part_lse_ = Tensor::Empty({rows}, kFloat32, cfg_.device);
      // one arrival counter per (sequence, head); the kernel leaves them at zero
      const int64_t pairs = cfg_.max_batch * cfg_.num_qo_heads;
      split_counters_ = Tensor::Empty({pairs}, kInt32, cfg_.device);
      std::vector<int32_t> zeros(pairs, 0);
      UploadAsync(split_counters_, zeros.data(), pairs * sizeof(int32_t));
    }
    AllocAux(cfg_.num_pages + cfg_.max_batch);
  }

  // ---------------------------------------------------------------- sequences (KVStateObj)
  void Clear() final {
    pool_.Clear();
    DropUnloadedHostCopies();
    cur_seqs_.clear();
  }
  void AddSequence(int64_t seq_id) final { Guard([&] { pool_.AddSequence(seq_id); }); }
  void RemoveSequence(int64_t seq_id) final {
    Guard([&] { pool_.RemoveSequence(seq_id); });
    DropUnloadedHostCopies();
  }
  void ForkSequence(int64_t parent, int64_t child, int64_t fork_pos) final {
    Guard([&] { pool_.ForkSequence(parent, child, fork_pos); });
  }
  void PopN(int64_t seq_id, int32_t n) final { Guard([&] { pool_.PopN(seq_id, n); }); }

  void BeginForward(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths,
                    const ffi::Optional<ffi::Shape>& token_tree_parent_ptr) final {
    if (token_tree_parent_ptr.has_value()) {
      TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache does not support tree attention "
                                   "(token_tree_parent_ptr was given)";
    }
    std::vector<int64_t> seqs(seq_ids.begin(), seq_ids.end());
    std::vector<int64_t> lens(append_lengths.begin(), append_lengths.end());
    if (seqs.empty() || static_cast<int64_t>(seqs.size()) > cfg_.max_batch) {
      TVM_FFI_THROW(ValueError) << "a batch needs 1 to " << cfg_.max_batch
                                << " sequences, got " << seqs.size();
    }
    int64_t tokens = 0;
    for (int64_t n : lens) {
      if (n < 1) TVM_FFI_THROW(ValueError) << "every append length must be >= 1, got " << n;
      tokens += n;
    }
    if (tokens > cfg_.max_tokens) {
      TVM_FFI_THROW(ValueError) << "a batch of " << tokens << " tokens exceeds the cache's "
                                << cfg_.max_tokens << " (the prefill chunk size)";
    }
    Reservation r = Guard([&] { return pool_.ReserveAppend(seqs, lens); });
    for (const PageCopy& c : r.copies) {
      for (const Tensor& pages : layer_pages_) {
        k_.copy_page(pages, static_cast<int64_t>(c.src), static_cast<int64_t>(c.dst),
                     static_cast<int64_t>(c.len));
      }
    }
    for (int64_t a : r.paged_in) CopyAdapterIn(a);
    cur_seqs_ = std::move(seqs);
    cur_lens_ = std::move(lens);
    cur_tokens_ = tokens;
    is_decode_ = std::all_of(cur_lens_.begin(), cur_lens_.end(), [](int64_t n) { return n == 1; });
    BuildAux();
    if (lora_configured_) BuildLoraTables();
  }

  void EndForward() final {}

  // ---------------------------------------------------------------- queries
  bool Empty() const final { return pool_.Empty(); }
  int32_t GetNumAvailablePages() const final { return pool_.num_free(); }
  int32_t GetTotalSequenceLength() const final {
    return static_cast<int32_t>(pool_.TotalSequenceLength());
  }
  int32_t GetSequenceLength(int64_t seq_id) const final {
    return static_cast<int32_t>(Guard([&] { return pool_.SequenceLength(seq_id); }));
  }
  Tensor GetQueryPositions() final {
    CheckInForward();
    return q_rope_pos_;
  }

  // ---------------------------------------------------------------- attention
  void AttentionWithFusedQKV(int64_t layer_id, Tensor qkv, ffi::Optional<Tensor> mask, Tensor o,
                             double sm_scale) final {
    CheckInForward();
    if (layer_id < 0 || layer_id >= cfg_.num_layers) {
      TVM_FFI_THROW(ValueError) << "layer " << layer_id << " is outside [0, " << cfg_.num_layers
                                << ")";
    }
    if (mask.has_value()) TVM_FFI_THROW(ValueError) << "attention masks are not supported";
    const int64_t t = cur_tokens_, hq = cfg_.num_qo_heads, hkv = cfg_.num_kv_heads,
                  d = cfg_.head_dim;
    if (qkv->ndim != 3 || qkv->shape[0] < t || qkv->shape[1] != hq + 2 * hkv ||
        qkv->shape[2] != d) {
      TVM_FFI_THROW(ValueError) << "qkv must be (" << t << ", " << hq + 2 * hkv << ", " << d
                                << ")";
    }
    if (qkv->shape[0] != t) {
      qkv = View(qkv, 0, {t, hq + 2 * hkv, d}, qkv->dtype);
      o = View(o, 0, {t, hq, d}, o->dtype);
    }
    Tensor q = View(q_buf_, 0, {t, hq, d}, cfg_.dtype);
    Tensor k = View(k_buf_, 0, {t, hkv, d}, cfg_.dtype);
    Tensor v = View(v_buf_, 0, {t, hkv, d}, cfg_.dtype);
    Tensor lse = View(lse_buf_, 0, {t, hq}, kFloat32);
    if (cfg_.rope_ext_factors.has_value()) {
      k_.split_rotary(qkv, q_rope_pos_, q, k, v, cfg_.rope_ext_factors.value());
    } else {
      k_.split_rotary(qkv, q_rope_pos_, q, k, v, static_cast<int64_t>(cfg_.rope_mode == 1));
    }
    const Tensor& pages = layer_pages_[layer_id];
    k_.append(pages, k, v, append_pos_);
    if (k_.own_attention) {
      if (is_decode_) {
        k_.decode(q, pages, page_indptr_, page_indices_, last_page_len_, o, lse, part_o_,
                  part_lse_, split_counters_, num_splits_, split_keys_, sm_scale);
      } else {
        k_.prefill(q, qo_indptr_, pages, page_indptr_, page_indices_, last_page_len_, o, lse,
                   max_q_len_, sm_scale);
      }
      return;
    }
    const int64_t inline_rope = cfg_.rope_mode == kRoPEInline;
    if (is_decode_) {
      k_.decode(q, pages, page_indptr_, page_indices_, last_page_len_, k_rope_offset_,
                q_rope_pos_, o, lse, inline_rope, cfg_.rope_scale, cfg_.rope_theta, sm_scale);
    } else {
      k_.prefill(q, qo_indptr_, pages, page_indptr_, page_indices_, last_page_len_,
                 k_rope_offset_, q_rope_pos_, o, lse, /*causal=*/int64_t{1}, inline_rope,
                 cfg_.rope_scale, cfg_.rope_theta, sm_scale);
    }
  }

  void DebugGetKV(int64_t seq_id, int64_t start_pos, int64_t end_pos, Tensor k_data,
                  Tensor v_data) final {
    if (!k_.debug_get_kv.has_value()) {
      TVM_FFI_THROW(ValueError) << "the cache was created without f_debug_get_kv";
    }
    const int64_t len = Guard([&] { return pool_.SequenceLength(seq_id); });
    if (start_pos < 0 || end_pos > len || start_pos >= end_pos) {
      TVM_FFI_THROW(ValueError) << "DebugGetKV range [" << start_pos << ", " << end_pos
                                << ") is not inside sequence " << seq_id << " of length " << len;
    }
    const std::vector<int32_t>& pages = pool_.SequencePages(seq_id);
    std::vector<int32_t> pos;
    for (int64_t i = start_pos; i < end_pos; ++i) {
      pos.push_back(pages[i / cfg_.page_size] * cfg_.page_size + i % cfg_.page_size);
    }
    Tensor pos_dev = Tensor::Empty({end_pos - start_pos}, kInt32, cfg_.device);
    pos_dev.CopyFromBytes(pos.data(), pos.size() * sizeof(int32_t));
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      k_.debug_get_kv.value()(layer_pages_[l], pos_dev, k_data, v_data, l);
    }
  }

  // ---------------------------------------------------------------- out of scope
  ffi::String GetCheckpointMetadata(int64_t) const final { Unsupported("checkpoints"); }
  ffi::String GetLayoutHash() const final { Unsupported("checkpoints"); }
  void ExportPageGroup(int64_t, int64_t, Tensor) final { Unsupported("checkpoints"); }
  void PrepareImport(int64_t, ffi::String) final { Unsupported("checkpoints"); }
  void ImportPageGroup(int64_t, int64_t, Tensor) final { Unsupported("checkpoints"); }
  void FinishImport(int64_t) final { Unsupported("checkpoints"); }
  void EnableSlidingWindowForSeq(int64_t, int32_t, int32_t) final {
    Unsupported("sliding-window attention");
  }
  void CommitAcceptedTokenTreeNodes(const ffi::Shape&, const ffi::Shape&) final {
    Unsupported("tree attention");
  }
  ffi::Shape DisaggPrepareRecv(int64_t, int) final { Unsupported("KV transfer"); }
  void DisaggMarkSend(int64_t, int64_t, const ffi::Shape&, int32_t) final {
    Unsupported("KV transfer");
  }
  void SelfAttention(int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, double) final {
    Unsupported("split self/cross attention");
  }
  void CrossAttention(int64_t, Tensor, Tensor, Tensor, double) final {
    Unsupported("split self/cross attention");
  }
  void AttentionWithSharedKV(int64_t, Tensor, Tensor, Tensor, Tensor, double) final {
    Unsupported("attention with shared KV layers");
  }
  void AppendMLAKV(int64_t, Tensor) final { Unsupported("MLA"); }
  ffi::Array<Tensor> MergeAttnOutputInplace(Tensor, Tensor, Tensor, Tensor) final {
    Unsupported("split self/cross attention");
  }
  void LinearAttention(int64_t, Tensor, Tensor, Tensor, double) final {
    Unsupported("linear attention");
  }
  void DebugGetKVMLA(int64_t, int64_t, int64_t, Tensor) final { Unsupported("MLA"); }
  void DebugSetKV(int64_t, int64_t, Tensor, Tensor) final { Unsupported("DebugSetKV"); }

  // ---------------------------------------------------------------- adapters (LoraPagePool)
  void ConfigureLora(int64_t num_modules, int64_t max_rank) {
    if (lora_configured_) TVM_FFI_THROW(ValueError) << "pool_configure_lora was already called";
    if (num_modules < 1 || max_rank < 1) {
      TVM_FFI_THROW(ValueError) << "LoRA needs at least one module and rank >= 1, got M="
                                << num_modules << " R=" << max_rank;
    }
    if (cfg_.num_pages * page_elems_ >= std::numeric_limits<int32_t>::max()) {
      TVM_FFI_THROW(ValueError) << "a layer region of " << cfg_.num_pages * page_elems_
                                << " elements does not fit the int32 offsets of the LoRA tables";
    }
    M_ = num_modules;
    R_ = max_rank;
    const int64_t S = cfg_.max_batch;  // one adapter per sequence at most
    lora_slot_ = Tensor::Empty({cfg_.max_tokens}, kInt32, cfg_.device);
    lora_rank_ = Tensor::Empty({S}, kInt32, cfg_.device);
    lora_scale_ = Tensor::Empty({S * M_}, kFloat32, cfg_.device);
    lora_a_ = Tensor::Empty({S * M_ * R_}, kInt32, cfg_.device);
    lora_b_ = Tensor::Empty({S * M_ * R_}, kInt32, cfg_.device);
    arena_flat_ = arena_;
    lora_configured_ = true;
  }

  void LoadAdapter(int64_t id, ffi::TensorView pages, ffi::TensorView a_off, ffi::TensorView b_off,
                   int64_t rank, ffi::TensorView scale, bool pin) {
    CheckLora();
    HostAdapter h = ValidateAdapter(id, pages, a_off, b_off, rank, scale);
    std::vector<int64_t> evicted;
    Guard([&] { pool_.AddAdapter(id, h.n_pages, pin, &evicted); });
    host_adapters_[id] = std::move(h);
    CopyAdapterIn(id);
  }
  void UnloadAdapter(int64_t id) {
    CheckLora();
    Guard([&] { pool_.RemoveAdapter(id); });
    DropUnloadedHostCopies();
  }
  void PinAdapter(int64_t id, bool pin) {
    CheckLora();
    std::vector<int64_t> evicted;
    if (Guard([&] { return pool_.PinAdapter(id, pin, &evicted); })) CopyAdapterIn(id);
  }
  void SetSequenceAdapter(int64_t seq, int64_t adapter) {
    CheckLora();
    Guard([&] { pool_.SetSequenceAdapter(seq, adapter); });
    DropUnloadedHostCopies();
  }
  ffi::Array<Tensor> LoraTables() {
    CheckLora();
    CheckInForward();
    return lora_tables_;
  }
  ffi::Map<ffi::String, int64_t> Stats() const {
    PoolStats s = pool_.Stats();
    return {{"total_pages", s.total},
            {"free_pages", s.free},
            {"kv_pages", s.kv},
            {"adapter_pages", s.adapter},
            {"evictable_pages", s.evictable},
            {"resident_adapters", s.resident_adapters},
            {"loaded_adapters", s.loaded_adapters},
            {"adapter_evictions", s.evictions},
            {"adapter_page_ins", s.page_ins},
            {"page_elems", page_elems_},
            {"kv_tokens", pool_.TotalSequenceLength()}};
  }
  ffi::Map<ffi::String, ffi::Any> AdapterInfo(int64_t id) const {
    return Guard([&] {
      ffi::Array<int64_t> pages;
      for (int32_t p : pool_.AdapterPages(id)) pages.push_back(p);
      return ffi::Map<ffi::String, ffi::Any>{{"pages", pages},
                                             {"resident", pool_.AdapterResident(id)},
                                             {"pinned", pool_.AdapterPinned(id)},
                                             {"refs", pool_.AdapterRefs(id)},
                                             {"num_pages", pool_.AdapterNumPages(id)}};
    });
  }
  ffi::Array<int64_t> SequencePages(int64_t seq) const {
    return Guard([&] {
      ffi::Array<int64_t> out;
      for (int32_t p : pool_.SequencePages(seq)) out.push_back(p);
      return out;
    });
  }
  void CheckInvariants() const {
    try {
      pool_.CheckInvariants();
    } catch (const std::logic_error& e) {
      TVM_FFI_THROW(InternalError) << e.what();
    }
    for (const auto& [id, h] : host_adapters_) {
      if (!pool_.HasAdapter(id)) TVM_FFI_THROW(InternalError) << "stale host copy " << id;
    }
  }

  static constexpr const bool _type_mutable = true;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("mlc_lora.runtime.UnifiedKVCache", UnifiedKVCacheObj,
                                    AttentionKVCacheObj);

 private:
  struct HostAdapter {
    Tensor pages;  // [L, n, E] on the host (pinned where the device has pinned memory)
    int32_t n_pages, rank;
    std::vector<int32_t> a_off, b_off;  // [M, R], local to the adapter's n*E region
    std::vector<float> scale;           // [M]
  };

  [[noreturn]] static void Unsupported(const char* what) {
    TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache does not support " << what;
  }
  void CheckInForward() const {
    if (cur_seqs_.empty()) TVM_FFI_THROW(ValueError) << "call begin_forward first";
  }
  void CheckLora() const {
    if (!lora_configured_) {
      TVM_FFI_THROW(ValueError) << "call pool_configure_lora before using adapters";
    }
  }

  void AllocAux(int64_t page_capacity) {
    const int64_t B = cfg_.max_batch, T = cfg_.max_tokens;
    // Segments of one int32 buffer (one host->device copy per batch); page indices last so that
    // only the used prefix is copied.
    off_qo_indptr_ = 0;
    off_page_indptr_ = off_qo_indptr_ + AlignUp(B + 1);
    off_last_len_ = off_page_indptr_ + AlignUp(B + 1);
    off_k_rope_ = off_last_len_ + AlignUp(B);
    off_q_rope_ = off_k_rope_ + AlignUp(B);
    off_append_ = off_q_rope_ + AlignUp(T);
    off_page_indices_ = off_append_ + AlignUp(T);
    page_capacity_ = page_capacity;
    aux_host_.assign(off_page_indices_ + page_capacity, 0);
    aux_dev_ = Tensor::Empty({static_cast<int64_t>(aux_host_.size())}, kInt32, cfg_.device);
  }

  void BuildAux() {
    const int64_t b = static_cast<int64_t>(cur_seqs_.size()), ps = cfg_.page_size;
    int64_t n_pages = 0;
    for (int64_t s : cur_seqs_) n_pages += pool_.SequencePages(s).size();
    if (n_pages > page_capacity_) AllocAux(std::max(n_pages, 2 * page_capacity_));
    int32_t* h = aux_host_.data();
    h[off_qo_indptr_] = 0;
    h[off_page_indptr_] = 0;
    int64_t tok = 0, pg = 0, max_kv = 0;
    max_q_len_ = 0;
    for (int64_t i = 0; i < b; ++i) {
      max_q_len_ = std::max(max_q_len_, cur_lens_[i]);
      max_kv = std::max(max_kv, pool_.SequenceLength(cur_seqs_[i]));
      const std::vector<int32_t>& pages = pool_.SequencePages(cur_seqs_[i]);
      const int64_t len = pool_.SequenceLength(cur_seqs_[i]);
      for (int64_t pos = len - cur_lens_[i]; pos < len; ++pos, ++tok) {
        h[off_q_rope_ + tok] = static_cast<int32_t>(pos);
        h[off_append_ + tok] = static_cast<int32_t>(pages[pos / ps] * ps + pos % ps);
      }
      for (int32_t p : pages) h[off_page_indices_ + pg++] = p;
      h[off_qo_indptr_ + i + 1] = static_cast<int32_t>(tok);
      h[off_page_indptr_ + i + 1] = static_cast<int32_t>(pg);
      h[off_last_len_ + i] = static_cast<int32_t>((len - 1) % ps + 1);
      h[off_k_rope_ + i] = 0;  // each sequence's pages start at position 0
    }
    // Split-KV: split each context until the grid has ~kDecodeTargetBlocks blocks.
    const int64_t blocks = b * cfg_.num_qo_heads;
    num_splits_ = std::min({(kDecodeTargetBlocks + blocks - 1) / blocks, kMaxSplits,
                            std::max<int64_t>(1, max_kv / kMinSplitKeys)});
    split_keys_ = (max_kv + num_splits_ - 1) / num_splits_;
    split_keys_ = (split_keys_ + cfg_.page_size - 1) / cfg_.page_size * cfg_.page_size;
    num_splits_ = (max_kv + split_keys_ - 1) / split_keys_;
    UploadAsync(aux_dev_, h, (off_page_indices_ + pg) * sizeof(int32_t));
    auto seg = [&](int64_t off, int64_t n) { return View(aux_dev_, off * 4, {n}, kInt32); };
    qo_indptr_ = seg(off_qo_indptr_, b + 1);
    page_indptr_ = seg(off_page_indptr_, b + 1);
    last_page_len_ = seg(off_last_len_, b);
    k_rope_offset_ = seg(off_k_rope_, b);
    q_rope_pos_ = seg(off_q_rope_, cur_tokens_);
    append_pos_ = seg(off_append_, cur_tokens_);
    page_indices_ = seg(off_page_indices_, pg);
  }

  HostAdapter ValidateAdapter(int64_t id, ffi::TensorView pages, ffi::TensorView a_off,
                              ffi::TensorView b_off, int64_t rank, ffi::TensorView scale) {
    auto host_contig = [](const ffi::TensorView& t, const char* name) {
      if (t.device().device_type != kDLCPU && t.device().device_type != kDLCUDAHost &&
          t.device().device_type != kDLROCMHost) {
        TVM_FFI_THROW(ValueError) << name << " must be in host memory";
      }
      if (!t.IsContiguous()) TVM_FFI_THROW(ValueError) << name << " must be contiguous";
    };
    host_contig(pages, "adapter pages");
    host_contig(a_off, "a_off");
    host_contig(b_off, "b_off");
    host_contig(scale, "scale");
    if (pages.ndim() != 3 || pages.size(0) != cfg_.num_layers || pages.size(2) != page_elems_) {
      TVM_FFI_THROW(ValueError) << "adapter " << id << ": pages must be [L=" << cfg_.num_layers
                                << ", n, E=" << page_elems_ << "], got " << pages.shape();
    }
    if (pages.dtype() != cfg_.dtype) {
      TVM_FFI_THROW(ValueError) << "adapter " << id << ": pages must have the model dtype "
                                << cfg_.dtype << ", got " << pages.dtype();
    }
    for (const auto* t : {&a_off, &b_off}) {
      if (t->ndim() != 2 || t->size(0) != M_ || t->size(1) != R_ || t->dtype() != kInt32) {
        TVM_FFI_THROW(ValueError) << "adapter " << id << ": a_off and b_off must be int32 [M="
                                  << M_ << ", R=" << R_ << "], got " << t->dtype() << t->shape();
      }
    }
    if (scale.ndim() != 1 || scale.size(0) != M_ || scale.dtype() != kFloat32) {
      TVM_FFI_THROW(ValueError) << "adapter " << id << ": scale must be float32 [M=" << M_
                                << "], got " << scale.dtype() << scale.shape();
    }
    if (rank < 1 || rank > R_) {
      TVM_FFI_THROW(ValueError) << "adapter " << id << " has rank " << rank
                                << ", outside [1, " << R_ << "] (the compiled maximum rank is "
                                << R_ << ")";
    }
    HostAdapter h;
    h.n_pages = static_cast<int32_t>(pages.size(1));
    h.rank = static_cast<int32_t>(rank);
    const int32_t* a = HostData<int32_t>(a_off);
    const int32_t* b = HostData<int32_t>(b_off);
    const float* sc = HostData<float>(scale);
    h.a_off.assign(a, a + M_ * R_);
    h.b_off.assign(b, b + M_ * R_);
    h.scale.assign(sc, sc + M_);
    const int64_t limit = h.n_pages * page_elems_;
    for (int64_t m = 0; m < M_; ++m) {
      for (int64_t r = 0; r < R_; ++r) {
        for (int32_t off : {h.a_off[m * R_ + r], h.b_off[m * R_ + r]}) {
          if (off < -1 || off >= limit) {
            TVM_FFI_THROW(ValueError) << "adapter " << id << ": offset " << off << " of module "
                                      << m << " row " << r << " is outside its " << limit
                                      << " elements";
          }
          if (off == -1 && r < rank && h.scale[m] != 0.0f) {
            TVM_FFI_THROW(ValueError) << "adapter " << id << ": module " << m << " row " << r
                                      << " < rank " << rank << " has no offset but scale "
                                      << h.scale[m];
          }
        }
      }
    }
    if (pool_.HasAdapter(id)) {  // the pool checks too; refuse before copying megabytes
      TVM_FFI_THROW(ValueError) << "adapter " << id << " is already loaded";
    }
    h.pages = Tensor::Empty({cfg_.num_layers, h.n_pages, page_elems_}, cfg_.dtype,
                            tvm::runtime::GetPreferredHostDevice(cfg_.device));
    std::memcpy(h.pages->data, HostData<char>(pages),
                cfg_.num_layers * h.n_pages * page_elems_ * Bytes(cfg_.dtype));
    return h;
  }

  /*! \brief Copy an adapter's host rows into its pages, every layer, one copy per page run. */
  void CopyAdapterIn(int64_t id) {
    const HostAdapter& h = host_adapters_.at(id);
    const std::vector<int32_t>& pages = pool_.AdapterPages(id);
    const int64_t eb = page_elems_ * Bytes(cfg_.dtype);
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      for (int32_t j = 0; j < h.n_pages;) {
        int32_t run = 1;
        while (j + run < h.n_pages && pages[j + run] == pages[j] + run) ++run;
        int64_t n = run * page_elems_;
        DLTensor src = *h.pages.operator->();
        src.ndim = 1;
        src.shape = &n;
        src.strides = nullptr;
        src.byte_offset = (l * h.n_pages + j) * eb;
        DLTensor dst = *arena_.operator->();
        dst.shape = &n;
        dst.strides = nullptr;
        dst.byte_offset = (l * cfg_.num_pages + pages[j]) * eb;
        Tensor::CopyFromTo(&src, &dst);
        j += run;
      }
    }
  }

  void DropUnloadedHostCopies() {
    for (auto it = host_adapters_.begin(); it != host_adapters_.end();) {
      it = pool_.HasAdapter(it->first) ? std::next(it) : host_adapters_.erase(it);
    }
  }

  void BuildLoraTables() {
    const int64_t b = static_cast<int64_t>(cur_seqs_.size());
    std::vector<int64_t> slots;  // adapter id of each slot, in order of first use
    std::vector<int32_t> token_slot;
    token_slot.reserve(cur_tokens_);
    for (int64_t i = 0; i < b; ++i) {
      int64_t a = pool_.SequenceAdapter(cur_seqs_[i]);
      int32_t s = -1;
      if (a >= 0) {
        auto it = std::find(slots.begin(), slots.end(), a);
        s = static_cast<int32_t>(it - slots.begin());
        if (it == slots.end()) slots.push_back(a);
      }
      token_slot.insert(token_slot.end(), cur_lens_[i], s);
    }
    // S >= 1: a batch without adapters gets one inert slot (rank 0, scale 0).
    const int64_t S = std::max<int64_t>(1, slots.size());
    std::vector<int32_t> rank(S, 0), a_off(S * M_ * R_, -1), b_off(S * M_ * R_, -1);
    std::vector<float> scale(S * M_, 0.0f);
    for (int64_t s = 0; s < static_cast<int64_t>(slots.size()); ++s) {
      const HostAdapter& h = host_adapters_.at(slots[s]);
      const std::vector<int32_t>& pages = pool_.AdapterPages(slots[s]);
      rank[s] = h.rank;
      std::copy(h.scale.begin(), h.scale.end(), scale.begin() + s * M_);
      // Local offsets -> offsets inside a layer region; -1 (unused) stays -1. The kernels read
      // rows k < rank of modules with scale != 0 only.
      auto global = [&](int32_t off) {
        return off < 0 ? -1
                       : static_cast<int32_t>(pages[off / page_elems_] * page_elems_ +
                                              off % page_elems_);
      };
      for (int64_t i = 0; i < M_ * R_; ++i) {
        a_off[s * M_ * R_ + i] = global(h.a_off[i]);
        b_off[s * M_ * R_ + i] = global(h.b_off[i]);
      }
    }
    auto upload = [](const Tensor& dev, const void* src, std::vector<int64_t> shape,
                     DLDataType dtype) {
      int64_t n = 1;
      for (int64_t x : shape) n *= x;
      Tensor v = View(dev, 0, shape, dtype);
      UploadAsync(v, src, n * 4);
      return v;
    };
    lora_tables_ = {arena_flat_,
                    upload(lora_slot_, token_slot.data(), {cur_tokens_}, kInt32),
                    upload(lora_rank_, rank.data(), {S}, kInt32),
                    upload(lora_scale_, scale.data(), {S, M_}, kFloat32),
                    upload(lora_a_, a_off.data(), {S, M_, R_}, kInt32),
                    upload(lora_b_, b_off.data(), {S, M_, R_}, kInt32)};
  }

  Config cfg_;
  Kernels k_;
  PagePool pool_;
  int64_t page_elems_;
  Tensor arena_;                     // (L*P*E,)
  std::vector<Tensor> layer_pages_;  // per layer (P, 2, h_kv, page_size, d), byte_offset 0
  Tensor q_buf_, k_buf_, v_buf_, lse_buf_;
  Tensor part_o_, part_lse_, split_counters_;  // split-KV decode workspace (own kernels only)

  // The batch between begin_forward and the next one.
  std::vector<int64_t> cur_seqs_, cur_lens_;
  int64_t cur_tokens_ = 0;
  bool is_decode_ = false;
  int64_t max_q_len_ = 0, num_splits_ = 1, split_keys_ = 0;
  std::vector<int32_t> aux_host_;
  Tensor aux_dev_;
  int64_t off_qo_indptr_, off_page_indptr_, off_last_len_, off_k_rope_, off_q_rope_, off_append_,
      off_page_indices_, page_capacity_;
  Tensor qo_indptr_, page_indptr_, last_page_len_, k_rope_offset_, q_rope_pos_, append_pos_,
      page_indices_;

  // LoRA: fixed-address tables at maximum size; lora_tables_ holds this batch's prefix views.
  bool lora_configured_ = false;
  int64_t M_ = 0, R_ = 0;
  Tensor arena_flat_, lora_slot_, lora_rank_, lora_scale_, lora_a_, lora_b_;
  ffi::Array<Tensor> lora_tables_;
  std::unordered_map<int64_t, HostAdapter> host_adapters_;
};

namespace {

/*!
 * \brief Same arguments as vm.builtin.paged_attention_kv_cache_create (28, or 29 with a trailing
 * argument that is ignored); the DispatchKVCache pass points create_paged_kv_cache here.
 */
void CreateCache(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() != 28 && args.size() != 29) {
    TVM_FFI_THROW(ValueError) << "expected the 28 or 29 arguments of TVM's paged KV cache "
                                 "constructor, got "
                              << args.size();
  }
  auto cache_config = args[0].cast<ffi::Shape>();
  auto layer_indptr = args[1].cast<ffi::Shape>();
  auto attn_kinds = args[6].cast<ffi::Shape>();
  if (cache_config.size() < 5) TVM_FFI_THROW(ValueError) << "cache config needs 5 fields";
  if (cache_config[4] != 0) {
    TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache does not support sliding-window attention";
  }
  if (layer_indptr.size() != 2 || layer_indptr[0] != 0) {
    TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache holds all layers on one device "
                                 "(layer_indptr must be [0, L])";
  }
  for (int64_t kind : attn_kinds) {
    if (kind != 0) {
      TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache supports plain multi-head attention "
                                   "only (attention kind "
                                << kind << " is MLA, linear or sliding-window)";
    }
  }
  if (args[7].cast<bool>()) {
    TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache does not support KV transfer";
  }
  const int64_t page_size = cache_config[3];
  if (page_size != 16) {
    TVM_FFI_THROW(ValueError) << "the attention kernels are compiled for page size 16, got "
                              << page_size;
  }
  if (args[4].cast<int64_t>() != args[5].cast<int64_t>()) {
    TVM_FFI_THROW(ValueError) << "different qk and v head dims are not supported";
  }
  auto init = args[12].cast<Tensor>();
  UnifiedKVCacheObj::Config cfg;
  cfg.num_layers = layer_indptr[1];
  cfg.num_qo_heads = args[2].cast<int64_t>();
  cfg.num_kv_heads = args[3].cast<int64_t>();
  cfg.head_dim = args[4].cast<int64_t>();
  cfg.page_size = page_size;
  const int64_t total_tokens = cache_config[1];
  cfg.num_pages = (total_tokens + page_size - 1) / page_size + 1;  // as TVM's cache
  cfg.max_batch = cache_config[0];
  cfg.max_tokens = std::max<int64_t>(cache_config[2], cache_config[0]);
  cfg.rope_mode = args[8].cast<int>();
  cfg.rope_scale = args[9].cast<double>();
  cfg.rope_theta = args[10].cast<double>();
  if (auto ext = args[11].as<Tensor>()) cfg.rope_ext_factors = ext.value();
  cfg.dtype = init->dtype;
  cfg.device = init->device;
  if (cfg.num_pages > std::numeric_limits<int32_t>::max() / page_size) {
    TVM_FFI_THROW(ValueError) << "too many pages for int32 token positions: " << cfg.num_pages;
  }
  UnifiedKVCacheObj::Kernels k;
  auto append = args[13].as<ffi::Function>();
  if (!append.has_value()) TVM_FFI_THROW(ValueError) << "f_transpose_append_mha is missing";
  k.append = append.value();
  bool prefill_ours = false, decode_ours = false;
  k.prefill = AttentionKernel(args[16], "paged prefill", &prefill_ours);
  k.decode = AttentionKernel(args[17], "paged decode", &decode_ours);
  if (prefill_ours != decode_ours) {
    TVM_FFI_THROW(ValueError) << "the paged prefill and decode kernels must come from one backend";
  }
  k.own_attention = prefill_ours;
  if (k.own_attention && cfg.rope_mode == kRoPEInline) {
    TVM_FFI_THROW(ValueError) << "the mlc_lora attention kernels take RoPE'd queries and keys; "
                                 "inline RoPE (rope_mode 2) needs TVM's TIR kernels";
  }
  k.split_rotary = args[24].cast<ffi::Function>();
  k.copy_page = args[25].cast<ffi::Function>();
  k.debug_get_kv = args[26].as<ffi::Function>();
  *rv = ffi::ObjectRef(ffi::make_object<UnifiedKVCacheObj>(std::move(cfg), std::move(k)));
}

UnifiedKVCacheObj* Pool(const ffi::ObjectRef& kv) {
  auto* p = const_cast<UnifiedKVCacheObj*>(kv.as<UnifiedKVCacheObj>());
  if (p == nullptr) {
    TVM_FFI_THROW(ValueError) << "not an mlc-lora KV cache (" << kv->GetTypeKey()
                              << "); compile the model with the DispatchKVCache pass";
  }
  return p;
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::ObjectDef<UnifiedKVCacheObj>();
  using Ref = const ffi::ObjectRef&;
  refl::GlobalDef()
      .def_packed("mlc_lora.runtime.create_paged_kv_cache", CreateCache)
      .def("mlc_lora.runtime.pool_configure_lora",
           [](Ref kv, int64_t m, int64_t r) { Pool(kv)->ConfigureLora(m, r); })
      .def("mlc_lora.runtime.pool_load_adapter",
           [](Ref kv, int64_t id, ffi::TensorView pages, ffi::TensorView a_off,
              ffi::TensorView b_off, int64_t rank, ffi::TensorView scale, bool pin) {
             Pool(kv)->LoadAdapter(id, pages, a_off, b_off, rank, scale, pin);
           })
      .def("mlc_lora.runtime.pool_unload_adapter",
           [](Ref kv, int64_t id) { Pool(kv)->UnloadAdapter(id); })
      .def("mlc_lora.runtime.pool_pin_adapter",
           [](Ref kv, int64_t id, bool pin) { Pool(kv)->PinAdapter(id, pin); })
      .def("mlc_lora.runtime.pool_set_sequence_adapter",
           [](Ref kv, int64_t seq, int64_t adapter) { Pool(kv)->SetSequenceAdapter(seq, adapter); })
      .def("mlc_lora.runtime.pool_lora_tables", [](Ref kv) { return Pool(kv)->LoraTables(); })
      .def("mlc_lora.runtime.pool_stats", [](Ref kv) { return Pool(kv)->Stats(); })
      .def("mlc_lora.runtime.pool_adapter_info",
           [](Ref kv, int64_t id) { return Pool(kv)->AdapterInfo(id); })
      .def("mlc_lora.runtime.pool_sequence_pages",
           [](Ref kv, int64_t seq) { return Pool(kv)->SequencePages(seq); })
      .def("mlc_lora.runtime.pool_check_invariants",
           [](Ref kv) { Pool(kv)->CheckInvariants(); })
      .def("mlc_lora.runtime.upload_async", [](Tensor dst, ffi::TensorView src) {
        // host array -> device tensor of the same size, without a stream synchronization
        if (src.device().device_type != kDLCPU || !src.IsContiguous()) {
          TVM_FFI_THROW(ValueError) << "upload_async takes a contiguous host array";
        }
        int64_t n = 1;
        for (int64_t i = 0; i < src.ndim(); ++i) n *= src.size(i);
        const int64_t bytes = n * Bytes(src.dtype());
        if (bytes != tvm::ffi::GetDataSize(*dst.operator->()) || src.dtype() != dst->dtype) {
          TVM_FFI_THROW(ValueError) << "upload_async: " << src.dtype() << src.shape()
                                    << " does not fit " << dst->dtype << dst.Shape();
        }
        UploadAsync(dst, HostData<char>(src), bytes);
      });
}

}  // namespace mlc_lora
