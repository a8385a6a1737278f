/*!
 * \file create_kv_cache.cc
 * \brief `mlc_lora.runtime.create_paged_kv_cache`: TVM's paged-KV-cache constructor arguments ->
 *        a UnifiedKVCacheObj (the DispatchKVCache pass points compiled models here).
 *
 * MLC_LORA_PAGE_SIZE is PAGE_SIZE of python/mlc_lora/contract.py, read by CMake at configure time.
 */
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <limits>

#include "unified_kv_cache.h"

#ifndef MLC_LORA_PAGE_SIZE
#error "MLC_LORA_PAGE_SIZE (contract.py PAGE_SIZE) must be defined by the build"
#endif

namespace mlc_lora {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

namespace {

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

}  // namespace

/*!
 * \brief Same arguments as vm.builtin.paged_attention_kv_cache_create (28, or 29 with a trailing
 * argument that is ignored); the DispatchKVCache pass points create_paged_kv_cache here.
 */
void CreateUnifiedKVCache(ffi::PackedArgs args, ffi::Any* rv) {
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
  if (page_size != MLC_LORA_PAGE_SIZE) {
    TVM_FFI_THROW(ValueError) << "the attention kernels are compiled for page size "
                              << MLC_LORA_PAGE_SIZE << ", got " << page_size;
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
  if (k.own_attention && cfg.rope_mode == UnifiedKVCacheObj::kRoPEInline) {
    TVM_FFI_THROW(ValueError) << "the mlc_lora attention kernels take RoPE'd queries and keys; "
                                 "inline RoPE (rope_mode 2) needs TVM's TIR kernels";
  }
  if (auto fused = args[24].as<ffi::Array<ffi::Any>>()) {  // ["mlc_lora", rope + append]
    auto tup = fused.value();
    if (tup.size() != 2 || tup[0].cast<ffi::String>() != "mlc_lora") {
      TVM_FFI_THROW(ValueError) << "the split-rotary argument must be a function or [\"mlc_lora\", f]";
    }
    if (cfg.rope_mode != 1 || cfg.rope_ext_factors.has_value()) {
      TVM_FFI_THROW(ValueError) << "the mlc_lora RoPE + append kernel takes plain RoPE (rope_mode 1, no "
                                   "extension factors); got rope_mode "
                                << cfg.rope_mode;
    }
    k.split_rotary = tup[1].cast<ffi::Function>();
    k.rope_append = true;
  } else {
    k.split_rotary = args[24].cast<ffi::Function>();
  }
  k.copy_page = args[25].cast<ffi::Function>();
  k.debug_get_kv = args[26].as<ffi::Function>();
  *rv = ffi::ObjectRef(ffi::make_object<UnifiedKVCacheObj>(std::move(cfg), std::move(k)));
}

}  // namespace mlc_lora
