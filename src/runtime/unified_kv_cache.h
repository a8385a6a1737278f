/*!
 * \file unified_kv_cache.h
 * \brief mlc-lora's paged KV cache over one arena whose pages also hold LoRA adapter rows.
 *
 * A thin TVM layer over PagePool (page_pool.h): it owns the device arena, runs the TIR kernels
 * that tvm.relax.frontend.nn.llm.kv_cache generates (passed at creation, like TVM's own cache)
 * and builds each batch's attention index tables; the adapters' side of the arena (host copies,
 * page-in, the per-batch LoRA tables) is its AdapterStore (adapter_store.h). It implements TVM's
 * abstract AttentionKVCacheObj, so the stock vm.builtin.kv_state_* and attention_kv_cache_*
 * builtins drive it; `mlc_lora.runtime.create_paged_kv_cache` (create_kv_cache.cc) makes one.
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
#ifndef MLC_LORA_RUNTIME_UNIFIED_KV_CACHE_H_
#define MLC_LORA_RUNTIME_UNIFIED_KV_CACHE_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/tensor.h>

#include <cstdint>
#include <vector>

#include "adapter_store.h"
#include "page_pool.h"
#include "runtime/vm/kv_state.h"

namespace mlc_lora {

class UnifiedKVCacheObj : public tvm::runtime::vm::AttentionKVCacheObj {
 public:
  using Tensor = tvm::runtime::Tensor;
  struct Config {
    int64_t num_layers, num_qo_heads, num_kv_heads, head_dim, page_size, num_pages;
    int64_t max_batch, max_tokens;
    int rope_mode;  // TVM's RoPEMode: 0 none, 1 normal (split_rotary), 2 inline
    double rope_scale, rope_theta;
    tvm::ffi::Optional<Tensor> rope_ext_factors;
    DLDataType dtype;
    DLDevice device;
  };
  struct Kernels {
    tvm::ffi::Function append, prefill, decode, split_rotary, copy_page;
    tvm::ffi::Optional<tvm::ffi::Function> debug_get_kv;
    bool own_attention = false;  // prefill/decode are ["mlc_lora", f] (compiler_passes/ops/attention/)
    // split_rotary given as ["mlc_lora", f]: f(qkv, q positions, append positions, pages, q,
    // rope_scale, rope_theta) ropes q and k and writes k and v into the pages itself
    // (ops/attention/rope_append_triton.py), in place of split_rotary + append
    bool rope_append = false;
  };
  static constexpr int kRoPEInline = 2;

  UnifiedKVCacheObj(Config cfg, Kernels k);

  // ---------------------------------------------------------------- sequences (KVStateObj)
  void Clear() final;
  void AddSequence(int64_t seq_id) final;
  void RemoveSequence(int64_t seq_id) final;
  void ForkSequence(int64_t parent, int64_t child, int64_t fork_pos) final;
  void PopN(int64_t seq_id, int32_t n) final;
  void BeginForward(const tvm::ffi::Shape& seq_ids, const tvm::ffi::Shape& append_lengths,
                    const tvm::ffi::Optional<tvm::ffi::Shape>& token_tree_parent_ptr) final;
  void EndForward() final {}

  // ---------------------------------------------------------------- queries
  bool Empty() const final { return pool_.Empty(); }
  int32_t GetNumAvailablePages() const final { return pool_.num_free(); }
  int32_t GetTotalSequenceLength() const final;
  int32_t GetSequenceLength(int64_t seq_id) const final;
  Tensor GetQueryPositions() final;

  // ---------------------------------------------------------------- attention
  void AttentionWithFusedQKV(int64_t layer_id, Tensor qkv, tvm::ffi::Optional<Tensor> mask,
                             Tensor o, double sm_scale) final;
  void DebugGetKV(int64_t seq_id, int64_t start_pos, int64_t end_pos, Tensor k_data,
                  Tensor v_data) final;

  // ---------------------------------------------------------------- out of scope
  tvm::ffi::String GetCheckpointMetadata(int64_t) const final { Unsupported("checkpoints"); }
  tvm::ffi::String GetLayoutHash() const final { Unsupported("checkpoints"); }
  void ExportPageGroup(int64_t, int64_t, Tensor) final { Unsupported("checkpoints"); }
  void PrepareImport(int64_t, tvm::ffi::String) final { Unsupported("checkpoints"); }
  void ImportPageGroup(int64_t, int64_t, Tensor) final { Unsupported("checkpoints"); }
  void FinishImport(int64_t) final { Unsupported("checkpoints"); }
  void EnableSlidingWindowForSeq(int64_t, int32_t, int32_t) final {
    Unsupported("sliding-window attention");
  }
  void CommitAcceptedTokenTreeNodes(const tvm::ffi::Shape&, const tvm::ffi::Shape&) final {
    Unsupported("tree attention");
  }
  tvm::ffi::Shape DisaggPrepareRecv(int64_t, int) final { Unsupported("KV transfer"); }
  void DisaggMarkSend(int64_t, int64_t, const tvm::ffi::Shape&, int32_t) final {
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
  tvm::ffi::Array<Tensor> MergeAttnOutputInplace(Tensor, Tensor, Tensor, Tensor) final {
    Unsupported("split self/cross attention");
  }
  void LinearAttention(int64_t, Tensor, Tensor, Tensor, double) final {
    Unsupported("linear attention");
  }
  void DebugGetKVMLA(int64_t, int64_t, int64_t, Tensor) final { Unsupported("MLA"); }
  void DebugSetKV(int64_t, int64_t, Tensor, Tensor) final { Unsupported("DebugSetKV"); }

  // ---------------------------------------------------------------- the pool (pool_* functions)
  AdapterStore& adapters() { return adapters_; }
  const AdapterStore& adapters() const { return adapters_; }
  /*! \brief This batch's LoRA tables (after begin_forward). */
  tvm::ffi::Array<Tensor> LoraTables() const;
  tvm::ffi::Array<Tensor> LoraGraphTables() const;
  /*! \brief Distinct adapters of the batch begun last (0: no token has one). */
  int64_t LoraNumSlots() const;
  /*! \brief The sum of the ranks of those adapters. */
  int64_t LoraRankTotal() const;
  tvm::ffi::Map<tvm::ffi::String, int64_t> Stats() const;
  int64_t AdmittablePages() const { return pool_.AdmittablePages(); }
  /*! \brief The prefix cache (page_pool.h): [matched tokens, idle pages among them]. */
  tvm::ffi::Shape PrefixLookup(int64_t adapter, const tvm::ffi::Shape& tokens) const;
  /*! \brief An empty sequence takes its cached prefix; returns the matched tokens. */
  int64_t PrefixAttach(int64_t seq, const tvm::ffi::Shape& tokens);
  /*! \brief Key the sequence's full pages; returns its keyed pages, -1 once its chain ended. */
  int64_t PrefixInsert(int64_t seq, int64_t start, const tvm::ffi::Shape& tokens);
  tvm::ffi::Array<int64_t> SequencePages(int64_t seq) const;
  /*! \brief The pool's bookkeeping and the adapters' host copies agree; throws InternalError. */
  void CheckInvariants() const;
  /*! \brief Fill every free page of every layer with NaN (all bits set, NaN in every float
   *  dtype): a kernel that reads a page its batch does not own then shows NaN (tests). */
  void PoisonFreePages();

  static constexpr const bool _type_mutable = true;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("mlc_lora.runtime.UnifiedKVCache", UnifiedKVCacheObj,
                                    tvm::runtime::vm::AttentionKVCacheObj);

 private:
  [[noreturn]] static void Unsupported(const char* what);
  void CheckInForward() const;
  void AllocAux(int64_t page_capacity);
  void BuildAux();

  Config cfg_;
  Kernels k_;
  PagePool pool_;
  int64_t page_elems_;
  Tensor arena_;                     // (L*P*E,)
  AdapterStore adapters_;            // the adapters' rows in arena_ and the LoRA tables
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
};

/*!
 * \brief `mlc_lora.runtime.create_paged_kv_cache` (create_kv_cache.cc): the arguments of
 * vm.builtin.paged_attention_kv_cache_create (28, or 29 with a trailing one that is ignored).
 */
void CreateUnifiedKVCache(tvm::ffi::PackedArgs args, tvm::ffi::Any* rv);

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_UNIFIED_KV_CACHE_H_
