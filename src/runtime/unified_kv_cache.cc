/*!
 * \file unified_kv_cache.cc
 * \brief The KV side of the unified pool: sequences, the per-batch attention index tables and
 *        attention over the paged arena (unified_kv_cache.h).
 */
#include "unified_kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tensor_util.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

namespace {

constexpr int64_t kAlign = 16;  // int32 elements; every aux segment starts 64-byte aligned

int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

/*!
 * Split-KV decode: enough blocks for two waves of a 132-SM GPU (any GPU is correct, this only
 * sets how finely a short batch's context is split), at most kMaxSplits splits, at least
 * kMinSplitKeys keys each.
 */
constexpr int64_t kDecodeTargetBlocks = 264;
constexpr int64_t kMaxSplits = 32;
constexpr int64_t kMinSplitKeys = 64;

}  // namespace

UnifiedKVCacheObj::UnifiedKVCacheObj(Config cfg, Kernels k)
    : cfg_(std::move(cfg)),
      k_(std::move(k)),
      pool_(Guard([&] { return PagePool(cfg_.num_pages, cfg_.page_size); })),
      page_elems_(2 * cfg_.num_kv_heads * cfg_.page_size * cfg_.head_dim),
      arena_(Tensor::Empty({cfg_.num_layers * cfg_.num_pages * page_elems_}, cfg_.dtype,
                           cfg_.device)),
      adapters_(&pool_, arena_,
                ArenaGeometry{cfg_.num_layers, cfg_.num_pages, page_elems_, cfg_.max_batch,
                              cfg_.max_tokens, cfg_.dtype, cfg_.device}) {
  const int64_t layer_elems = cfg_.num_pages * page_elems_;
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

void UnifiedKVCacheObj::Clear() {
  pool_.Clear();
  adapters_.DropUnloaded();
  cur_seqs_.clear();
}
void UnifiedKVCacheObj::AddSequence(int64_t seq_id) { Guard([&] { pool_.AddSequence(seq_id); }); }
void UnifiedKVCacheObj::RemoveSequence(int64_t seq_id) {
  Guard([&] { pool_.RemoveSequence(seq_id); });
  adapters_.DropUnloaded();
}
void UnifiedKVCacheObj::ForkSequence(int64_t parent, int64_t child, int64_t fork_pos) {
  Guard([&] { pool_.ForkSequence(parent, child, fork_pos); });
}
void UnifiedKVCacheObj::PopN(int64_t seq_id, int32_t n) { Guard([&] { pool_.PopN(seq_id, n); }); }

void UnifiedKVCacheObj::BeginForward(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths,
                                     const ffi::Optional<ffi::Shape>& token_tree_parent_ptr) {
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
  adapters_.CheckPageIns(seqs);  // an adapter to page in without host pages: refused, nothing changed
  Reservation r = Guard([&] { return pool_.ReserveAppend(seqs, lens); });
  for (const PageCopy& c : r.copies) {
    for (const Tensor& pages : layer_pages_) {
      k_.copy_page(pages, static_cast<int64_t>(c.src), static_cast<int64_t>(c.dst),
                   static_cast<int64_t>(c.len));
    }
  }
  for (int64_t a : r.paged_in) adapters_.CopyIn(a);
  cur_seqs_ = std::move(seqs);
  cur_lens_ = std::move(lens);
  cur_tokens_ = tokens;
  is_decode_ = std::all_of(cur_lens_.begin(), cur_lens_.end(), [](int64_t n) { return n == 1; });
  BuildAux();
  if (adapters_.configured()) adapters_.BuildTables(cur_seqs_, cur_lens_, cur_tokens_);
}

void UnifiedKVCacheObj::PoisonFreePages() {
  std::vector<int32_t> ids = pool_.free_pages();
  std::sort(ids.begin(), ids.end());
  const int64_t page_bytes = page_elems_ * Bytes(cfg_.dtype);
  int64_t longest = 0;  // one host buffer for the longest run
  ForEachPageRun(ids, [&](int64_t, int64_t n) { longest = std::max(longest, n); });
  const std::vector<uint8_t> nan(longest * page_bytes, 0xFF);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    ForEachPageRun(ids, [&](int64_t i, int64_t n) {
      const int64_t offset = (l * cfg_.num_pages + ids[i]) * page_bytes;
      UploadAsync(View(arena_, offset, {n * page_bytes}, DLDataType{kDLUInt, 8, 1}), nan.data(),
                  n * page_bytes);
    });
  }
}

int32_t UnifiedKVCacheObj::GetTotalSequenceLength() const {
  return static_cast<int32_t>(pool_.TotalSequenceLength());
}
int32_t UnifiedKVCacheObj::GetSequenceLength(int64_t seq_id) const {
  return static_cast<int32_t>(Guard([&] { return pool_.SequenceLength(seq_id); }));
}
Tensor UnifiedKVCacheObj::GetQueryPositions() {
  CheckInForward();
  return q_rope_pos_;
}

void UnifiedKVCacheObj::AttentionWithFusedQKV(int64_t layer_id, Tensor qkv,
                                              ffi::Optional<Tensor> mask, Tensor o,
                                              double sm_scale) {
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
  const Tensor& pages = layer_pages_[layer_id];
  if (k_.rope_append) {  // one kernel: q and k roped, k and v straight into the pages
    k_.split_rotary(qkv, q_rope_pos_, append_pos_, pages, q, cfg_.rope_scale, cfg_.rope_theta);
  } else {
    if (cfg_.rope_ext_factors.has_value()) {
      k_.split_rotary(qkv, q_rope_pos_, q, k, v, cfg_.rope_ext_factors.value());
    } else {
      k_.split_rotary(qkv, q_rope_pos_, q, k, v, static_cast<int64_t>(cfg_.rope_mode == 1));
    }
    k_.append(pages, k, v, append_pos_);
  }
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

void UnifiedKVCacheObj::DebugGetKV(int64_t seq_id, int64_t start_pos, int64_t end_pos,
                                   Tensor k_data, Tensor v_data) {
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

// ---------------------------------------------------------------- the pool (pool_* functions)
ffi::Array<Tensor> UnifiedKVCacheObj::LoraTables() const {
  adapters_.CheckConfigured();
  CheckInForward();
  return adapters_.tables();
}

ffi::Array<Tensor> UnifiedKVCacheObj::LoraGraphTables() const {
  adapters_.CheckConfigured();
  CheckInForward();
  return adapters_.graph_tables();
}

int64_t UnifiedKVCacheObj::LoraNumSlots() const {
  adapters_.CheckConfigured();
  CheckInForward();
  return adapters_.num_slots();
}

int64_t UnifiedKVCacheObj::LoraRankTotal() const {
  adapters_.CheckConfigured();
  CheckInForward();
  return adapters_.rank_total();
}

ffi::Map<ffi::String, int64_t> UnifiedKVCacheObj::Stats() const {
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
          {"pinned_pages", s.pinned},
          {"page_elems", page_elems_},
          {"kv_tokens", pool_.TotalSequenceLength()},
          {"cached_pages", s.cached},
          {"cached_idle_pages", s.cached_idle},
          {"prefix_queries", s.prefix_queries},
          {"prefix_query_tokens", s.prefix_query_tokens},
          {"prefix_hit_tokens", s.prefix_hit_tokens},
          {"cached_page_evictions", s.cached_evictions}};
}

namespace {
std::vector<int32_t> TokenIds(const ffi::Shape& tokens) {
  std::vector<int32_t> out;
  out.reserve(tokens.size());
  for (int64_t t : tokens) {
    if (t < 0 || t > INT32_MAX) TVM_FFI_THROW(ValueError) << "token id " << t << " is out of range";
    out.push_back(static_cast<int32_t>(t));
  }
  return out;
}
}  // namespace

ffi::Shape UnifiedKVCacheObj::PrefixLookup(int64_t adapter, const ffi::Shape& tokens) const {
  PrefixHit hit = pool_.LookupPrefix(adapter, TokenIds(tokens));
  return ffi::Shape({hit.tokens, static_cast<int64_t>(hit.idle_pages)});
}

int64_t UnifiedKVCacheObj::PrefixAttach(int64_t seq, const ffi::Shape& tokens) {
  std::vector<int32_t> ids = TokenIds(tokens);
  return Guard([&] { return pool_.AttachPrefix(seq, ids); });
}

int64_t UnifiedKVCacheObj::PrefixInsert(int64_t seq, int64_t start, const ffi::Shape& tokens) {
  std::vector<int32_t> ids = TokenIds(tokens);
  return Guard([&] { return pool_.InsertPrefix(seq, start, ids); });
}

ffi::Array<int64_t> UnifiedKVCacheObj::SequencePages(int64_t seq) const {
  return Guard([&] {
    ffi::Array<int64_t> out;
    for (int32_t p : pool_.SequencePages(seq)) out.push_back(p);
    return out;
  });
}

void UnifiedKVCacheObj::CheckInvariants() const {
  try {
    pool_.CheckInvariants();
  } catch (const std::logic_error& e) {
    TVM_FFI_THROW(InternalError) << e.what();
  }
  adapters_.CheckInvariants();
}

void UnifiedKVCacheObj::Unsupported(const char* what) {
  TVM_FFI_THROW(ValueError) << "mlc-lora's KV cache does not support " << what;
}

void UnifiedKVCacheObj::CheckInForward() const {
  if (cur_seqs_.empty()) TVM_FFI_THROW(ValueError) << "call begin_forward first";
}

void UnifiedKVCacheObj::AllocAux(int64_t page_capacity) {
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

void UnifiedKVCacheObj::BuildAux() {
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

}  // namespace mlc_lora
