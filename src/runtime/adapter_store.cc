/*!
 * \file adapter_store.cc
 * \brief Host copies of adapters, their validation, page-in copies and the per-batch LoRA tables.
 */
#include "adapter_store.h"

#include <tvm/runtime/device_api.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "tensor_util.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

void AdapterStore::Configure(int64_t num_modules, int64_t max_rank) {
  if (configured_) TVM_FFI_THROW(ValueError) << "pool_configure_lora was already called";
  if (num_modules < 1 || max_rank < 1) {
    TVM_FFI_THROW(ValueError) << "LoRA needs at least one module and rank >= 1, got M="
                              << num_modules << " R=" << max_rank;
  }
  if (g_.num_pages * g_.page_elems >= std::numeric_limits<int32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "a layer region of " << g_.num_pages * g_.page_elems
                              << " elements does not fit the int32 offsets of the LoRA tables";
  }
  M_ = num_modules;
  R_ = max_rank;
  const int64_t S = g_.max_batch;  // one adapter per sequence at most
  slot_ = Tensor::Empty({g_.max_tokens}, kInt32, g_.device);
  rank_ = Tensor::Empty({S}, kInt32, g_.device);
  scale_ = Tensor::Empty({S * M_}, kFloat32, g_.device);
  a_ = Tensor::Empty({S * M_ * R_}, kInt32, g_.device);
  b_ = Tensor::Empty({S * M_ * R_}, kInt32, g_.device);
  order_ = Tensor::Empty({g_.max_tokens}, kInt32, g_.device);
  start_ = Tensor::Empty({S + 1}, kInt32, g_.device);
  // graph_tables() shows every slot row: none may hold garbage (a NaN scale would make a slot live)
  const std::vector<int32_t> zeros(S * M_ * R_, 0);
  for (const Tensor* t : {&rank_, &scale_, &a_, &b_}) UploadAsync(*t, zeros.data(), (*t)->shape[0] * 4);
  configured_ = true;
}

ffi::Array<Tensor> AdapterStore::tables() const {
  if (inert_tokens_ >= 0) {  // a batch without adapters: its tables now that they are asked for
    const int64_t tokens = inert_tokens_;
    inert_tokens_ = -1;
    Upload({}, std::vector<int32_t>(tokens, -1), tokens);
  }
  return tables_;
}

ffi::Array<Tensor> AdapterStore::graph_tables() const {
  CheckConfigured();
  tables();
  if (tables_.empty()) TVM_FFI_THROW(ValueError) << "no batch: call begin_forward first";
  const int64_t S = g_.max_batch;
  return {tables_[0], tables_[1], View(rank_, 0, {S}, kInt32), View(scale_, 0, {S, M_}, kFloat32),
          View(a_, 0, {S, M_, R_}, kInt32), View(b_, 0, {S, M_, R_}, kInt32), tables_[6],
          View(start_, 0, {S + 1}, kInt32)};
}

void AdapterStore::CheckConfigured() const {
  if (!configured_) TVM_FFI_THROW(ValueError) << "call pool_configure_lora before using adapters";
}

bool AdapterStore::Load(int64_t id, ffi::TensorView pages, ffi::TensorView a_off,
                        ffi::TensorView b_off, int64_t rank, ffi::TensorView scale, bool pin) {
  CheckConfigured();
  if (pool_->HasAdapter(id)) {  // the pool checks too; refuse before copying megabytes
    TVM_FFI_THROW(ValueError) << "adapter " << id << " is already loaded";
  }
  HostAdapter h = Validate(id, pages, a_off, b_off, rank, scale);
  std::vector<int64_t> evicted;
  bool resident = Guard([&] { return pool_->AddAdapter(id, h.n_pages, pin, &evicted); });
  host_[id] = std::move(h);
  if (resident) CopyIn(id);
  return resident;
}

void AdapterStore::SetHost(int64_t id, ffi::TensorView pages, ffi::TensorView a_off,
                           ffi::TensorView b_off, int64_t rank, ffi::TensorView scale) {
  CheckConfigured();
  const HostAdapter& old = Get(id);
  if (old.pages.defined()) TVM_FFI_THROW(ValueError) << "adapter " << id << " has its host pages";
  HostAdapter h = Validate(id, pages, a_off, b_off, rank, scale);
  if (h.n_pages != old.n_pages || h.rank != old.rank || h.a_off != old.a_off ||
      h.b_off != old.b_off || h.scale != old.scale) {
    TVM_FFI_THROW(ValueError) << "adapter " << id << ": the pages handed back are not packed as "
                              << "those it was loaded with (" << h.n_pages << " pages of rank "
                              << h.rank << ", loaded as " << old.n_pages << " of rank " << old.rank
                              << "); did its folder change?";
  }
  host_[id] = std::move(h);
}

void AdapterStore::DropHost(int64_t id) {
  CheckConfigured();
  Get(id);  // an unknown id: ValueError
  if (pool_->AdapterResident(id)) {
    TVM_FFI_THROW(ValueError) << "adapter " << id << " holds pool pages: its host copy stays";
  }
  FinishCopies(id);  // evicted right after a page-in: its copy may still read the host pages
  host_.at(id).pages = Tensor();
}

bool AdapterStore::Prefetch(int64_t id, const std::vector<int64_t>& keep,
                            const std::vector<std::pair<int64_t, std::vector<int32_t>>>& protect) {
  CheckConfigured();
  if (Guard([&] { return pool_->AdapterResident(id); })) return true;
  CheckHost(id, "prefetching it");
  std::vector<int64_t> evicted;
  // ahead of its batch: never at the cost of a cached prefix a waiting request would hit
  std::vector<int32_t> pages;
  for (const auto& [adapter, tokens] : protect) {
    std::vector<int32_t> chain = Guard([&] { return pool_->PrefixPages(adapter, tokens); });
    pages.insert(pages.end(), chain.begin(), chain.end());
  }
  if (!Guard([&] { return pool_->TryPageIn(id, keep, &evicted, pages); })) return false;
  CopyIn(id);
  return true;
}

void AdapterStore::CheckPageIns(const std::vector<int64_t>& seqs) const {
  if (!configured_) return;
  for (int64_t seq : seqs) {
    int64_t a = Guard([&] { return pool_->HasSequence(seq) ? pool_->SequenceAdapter(seq) : -1; });
    if (a >= 0 && !pool_->AdapterResident(a)) CheckHost(a, "a batch needs it");
  }
}

std::vector<int64_t> AdapterStore::Resident() const {
  std::vector<int64_t> out;
  for (const auto& [id, h] : host_) {
    if (pool_->HasAdapter(id) && pool_->AdapterResident(id)) out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  return out;
}

const AdapterStore::HostAdapter& AdapterStore::Get(int64_t id) const {
  auto it = host_.find(id);
  if (it == host_.end()) TVM_FFI_THROW(ValueError) << "unknown adapter " << id;
  return it->second;
}

void AdapterStore::CheckHost(int64_t id, const char* what) const {
  if (!Get(id).pages.defined()) {
    TVM_FFI_THROW(ValueError) << "adapter " << id << " has no host copy (dropped for the host "
                              << "tier's budget) and " << what << ": hand its pages back first "
                              << "(pool_set_adapter_host)";
  }
}

void AdapterStore::Unload(int64_t id) {
  CheckConfigured();
  ForgetColumns(id);
  Guard([&] { pool_->RemoveAdapter(id); });
  DropUnloaded();
}

void AdapterStore::Pin(int64_t id, bool pin) {
  CheckConfigured();
  if (pin && Guard([&] { return !pool_->AdapterResident(id); })) CheckHost(id, "pinning pages it in");
  std::vector<int64_t> evicted;
  if (Guard([&] { return pool_->PinAdapter(id, pin, &evicted); })) CopyIn(id);
}

void AdapterStore::SetSequenceAdapter(int64_t seq, int64_t adapter) {
  CheckConfigured();
  Guard([&] { pool_->SetSequenceAdapter(seq, adapter); });
  DropUnloaded();
}

ffi::Map<ffi::String, ffi::Any> AdapterStore::Info(int64_t id) const {
  return Guard([&] {
    ffi::Array<int64_t> pages;
    for (int32_t p : pool_->AdapterPages(id)) pages.push_back(p);
    auto it = host_.find(id);
    const bool host = it != host_.end() && it->second.pages.defined();
    return ffi::Map<ffi::String, ffi::Any>{
        {"pages", pages},
        {"resident", pool_->AdapterResident(id)},
        {"pinned", pool_->AdapterPinned(id)},
        {"refs", pool_->AdapterRefs(id)},
        {"num_pages", pool_->AdapterNumPages(id)},
        {"host", host},
        {"host_bytes", host ? g_.num_layers * pool_->AdapterNumPages(id) * g_.page_elems *
                                  Bytes(g_.dtype)
                            : int64_t{0}}};
  });
}

std::vector<int64_t> AdapterStore::PagesToRun(const std::vector<int64_t>& ids) const {
  return Guard([&] {
    std::vector<int64_t> out;
    out.reserve(ids.size());
    for (int64_t id : ids) out.push_back(pool_->AdapterPagesToRun(id));
    return out;
  });
}

void AdapterStore::CheckInvariants() const {
  for (const auto& [id, h] : host_) {
    if (!pool_->HasAdapter(id)) TVM_FFI_THROW(InternalError) << "stale host copy " << id;
  }
}

AdapterStore::HostAdapter AdapterStore::Validate(int64_t id, ffi::TensorView pages,
                                                 ffi::TensorView a_off, ffi::TensorView b_off,
                                                 int64_t rank, ffi::TensorView scale) const {
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
  const int64_t E = g_.page_elems;
  if (pages.ndim() != 3 || pages.size(0) != g_.num_layers || pages.size(2) != E) {
    TVM_FFI_THROW(ValueError) << "adapter " << id << ": pages must be [L=" << g_.num_layers
                              << ", n, E=" << E << "], got " << pages.shape();
  }
  if (pages.dtype() != g_.dtype) {
    TVM_FFI_THROW(ValueError) << "adapter " << id << ": pages must have the model dtype "
                              << g_.dtype << ", got " << pages.dtype();
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
    TVM_FFI_THROW(ValueError) << "adapter " << id << " has rank " << rank << ", outside [1, "
                              << R_ << "] (the compiled maximum rank is " << R_ << ")";
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
  const int64_t limit = h.n_pages * E;
  for (int64_t m = 0; m < M_; ++m) {
    for (int64_t r = 0; r < R_; ++r) {
      for (int32_t off : {h.a_off[m * R_ + r], h.b_off[m * R_ + r]}) {
        if (off < -1 || off >= limit) {
          TVM_FFI_THROW(ValueError) << "adapter " << id << ": offset " << off << " of module " << m
                                    << " row " << r << " is outside its " << limit << " elements";
        }
        if (off == -1 && r < rank && h.scale[m] != 0.0f) {
          TVM_FFI_THROW(ValueError) << "adapter " << id << ": module " << m << " row " << r
                                    << " < rank " << rank << " has no offset but scale "
                                    << h.scale[m];
        }
      }
    }
  }
  h.pages = Tensor::Empty({g_.num_layers, h.n_pages, E}, g_.dtype,
                          tvm::runtime::GetPreferredHostDevice(g_.device));
  std::memcpy(h.pages->data, HostData<char>(pages), g_.num_layers * h.n_pages * E * Bytes(g_.dtype));
  return h;
}

AdapterStore::~AdapterStore() {
  if (copy_stream_ == nullptr) return;
  try {
    FinishCopies();
    tvm::runtime::DeviceAPI::Get(g_.device)->FreeStream(g_.device, copy_stream_);
  } catch (...) {  // a destructor must not throw (the process may be going down with its device)
  }
}

void AdapterStore::FinishCopies(int64_t id) {
  if (copying_.empty() || (id >= 0 && copying_.count(id) == 0)) return;
  tvm::runtime::DeviceAPI::Get(g_.device)->StreamSync(g_.device, copy_stream_);
  copying_.clear();
}

void AdapterStore::CopyIn(int64_t id) {
  const HostAdapter& h = host_.at(id);
  CheckHost(id, "its pages are copied in");
  const std::vector<int32_t>& pages = pool_->AdapterPages(id);
  const int64_t eb = g_.page_elems * Bytes(g_.dtype);
  tvm::runtime::DeviceAPI* api = nullptr;
  void* compute = nullptr;
  if (g_.device.device_type != kDLCPU) {  // on the CPU the copies are memcpy, done on return
    api = tvm::runtime::DeviceAPI::Get(g_.device);
    if (copy_stream_ == nullptr) copy_stream_ = api->CreateStream(g_.device);
    compute = api->GetCurrentStream(g_.device);  // the stream the kernels run on
    api->SyncStreamFromTo(g_.device, compute, copy_stream_);
    copying_.insert(id);
  }
  for (int64_t l = 0; l < g_.num_layers; ++l) {
    ForEachPageRun(pages, [&](int64_t j, int64_t run) {
      int64_t n = run * g_.page_elems;
      DLTensor src = *h.pages.operator->();
      src.ndim = 1;
      src.shape = &n;
      src.strides = nullptr;
      src.byte_offset = (l * h.n_pages + j) * eb;
      DLTensor dst = *arena_.operator->();
      dst.shape = &n;
      dst.strides = nullptr;
      dst.byte_offset = (l * g_.num_pages + pages[j]) * eb;
      Tensor::CopyFromTo(&src, &dst, copy_stream_);
    });
  }
  if (api != nullptr) api->SyncStreamFromTo(g_.device, copy_stream_, compute);
}

void AdapterStore::DropUnloaded() {
  for (auto it = host_.begin(); it != host_.end();) {
    if (pool_->HasAdapter(it->first)) {
      ++it;
      continue;
    }
    FinishCopies(it->first);
    it = host_.erase(it);
  }
}

void AdapterStore::KeepColumns(int64_t rank_columns, int64_t slot_columns) {
  if (rank_columns < 0 || slot_columns < 0 || (rank_columns == 0) != (slot_columns == 0)) {
    TVM_FFI_THROW(ValueError) << "pool_keep_lora_columns: rank and slot columns both > 0 (or both 0: off), got "
                              << rank_columns << ", " << slot_columns;
  }
  keep_rank_columns_ = rank_columns;
  keep_slot_columns_ = slot_columns;
  kept_.clear();
  ++columns_generation_;
}

void AdapterStore::ForgetColumns(int64_t id) {
  auto it = std::find(kept_.begin(), kept_.end(), id);
  if (it == kept_.end()) return;
  kept_.erase(it);
  ++columns_generation_;
}

const std::vector<int64_t>& AdapterStore::KeptColumns(const std::vector<int64_t>& used) {
  auto rank_of = [&](const std::vector<int64_t>& ids) {
    int64_t r = 0;
    for (int64_t a : ids) r += host_.at(a).rank;
    return r;
  };
  auto kept = [&](int64_t a) { return std::find(kept_.begin(), kept_.end(), a) != kept_.end(); };
  std::vector<int64_t> next;  // the kept adapters still resident, in order, then the batch's new ones
  for (int64_t a : kept_) {
    if (pool_->HasAdapter(a) && pool_->AdapterResident(a)) next.push_back(a);
  }
  for (int64_t a : used) {
    if (!kept(a)) next.push_back(a);
  }
  if (static_cast<int64_t>(next.size()) > keep_slot_columns_ || rank_of(next) > keep_rank_columns_) {
    next.clear();  // no room: the batch's own, the kept ones first (in order)
    for (int64_t a : kept_) {
      if (std::find(used.begin(), used.end(), a) != used.end()) next.push_back(a);
    }
    for (int64_t a : used) {
      if (std::find(next.begin(), next.end(), a) == next.end()) next.push_back(a);
    }
  }
  if (next != kept_) {  // (appended ones leave the others' columns where they were; all are filled again)
    kept_ = std::move(next);
    ++columns_generation_;
  }
  return kept_;
}

void AdapterStore::BuildTables(const std::vector<int64_t>& seqs, const std::vector<int64_t>& lens,
                               int64_t tokens) {
  const int64_t b = static_cast<int64_t>(seqs.size());
  std::vector<int64_t> used;  // the batch's adapters, in order of first use
  std::unordered_set<int64_t> seen;
  std::vector<int64_t> adapter(b);
  for (int64_t i = 0; i < b; ++i) {
    adapter[i] = pool_->SequenceAdapter(seqs[i]);
    if (adapter[i] >= 0 && seen.insert(adapter[i]).second) used.push_back(adapter[i]);
  }
  int64_t used_rank = 0;
  for (int64_t a : used) used_rank += host_.at(a).rank;
  const bool keep = keep_rank_columns_ > 0 && !used.empty() &&
                    static_cast<int64_t>(used.size()) <= keep_slot_columns_ && used_rank <= keep_rank_columns_;
  const std::vector<int64_t> slots = keep ? KeptColumns(used) : used;  // adapter id of each slot
  std::unordered_map<int64_t, int32_t> slot_of;
  for (size_t s = 0; s < slots.size(); ++s) slot_of.emplace(slots[s], static_cast<int32_t>(s));
  std::vector<int32_t> token_slot;
  token_slot.reserve(tokens);
  for (int64_t i = 0; i < b; ++i) {
    token_slot.insert(token_slot.end(), lens[i], adapter[i] >= 0 ? slot_of.at(adapter[i]) : -1);
  }
  num_slots_ = static_cast<int64_t>(slots.size());
  rank_total_ = 0;
  for (int64_t a : slots) rank_total_ += host_.at(a).rank;
  inert_tokens_ = slots.empty() ? tokens : -1;  // (tables() builds them if asked)
  if (!slots.empty()) Upload(slots, token_slot, tokens);
}

void AdapterStore::Upload(const std::vector<int64_t>& slots, const std::vector<int32_t>& token_slot,
                          int64_t tokens) const {
  // S >= 1: a batch without adapters gets one inert slot (rank 0, scale 0).
  const int64_t S = std::max<int64_t>(1, slots.size()), E = g_.page_elems;
  std::vector<int32_t> rank(S, 0);
  std::vector<float> scale(S * M_, 0.0f);
  // every slot's rows are written below (the inert slot's: -1), so the buffers kept between
  // batches need no clearing (0.9 MB at 256 adapters of max rank 64); reusing them is safe as
  // UploadAsync has read pageable host memory when it returns
  std::vector<int32_t>& a_off = a_host_;
  std::vector<int32_t>& b_off = b_host_;
  a_off.resize(std::max<size_t>(a_off.size(), S * M_ * R_));
  b_off.resize(std::max<size_t>(b_off.size(), S * M_ * R_));
  if (slots.empty()) {
    std::fill_n(a_off.begin(), M_ * R_, -1);
    std::fill_n(b_off.begin(), M_ * R_, -1);
  }
  for (int64_t s = 0; s < static_cast<int64_t>(slots.size()); ++s) {
    const HostAdapter& h = host_.at(slots[s]);
    const std::vector<int32_t>& pages = pool_->AdapterPages(slots[s]);
    rank[s] = h.rank;
    std::copy(h.scale.begin(), h.scale.end(), scale.begin() + s * M_);
    if (h.placed_pages != pages) {
      // Local offsets -> offsets inside a layer region; -1 (unused) stays -1. The kernels read
      // rows k < rank of modules with scale != 0 only.
      auto global = [&](int32_t off) {
        return off < 0 ? -1 : static_cast<int32_t>(pages[off / E] * E + off % E);
      };
      h.a_placed.resize(M_ * R_);
      h.b_placed.resize(M_ * R_);
      for (int64_t i = 0; i < M_ * R_; ++i) {
        h.a_placed[i] = global(h.a_off[i]);
        h.b_placed[i] = global(h.b_off[i]);
      }
      h.placed_pages = pages;
    }
    std::copy(h.a_placed.begin(), h.a_placed.end(), a_off.begin() + s * M_ * R_);
    std::copy(h.b_placed.begin(), h.b_placed.end(), b_off.begin() + s * M_ * R_);
  }
  // Tokens sorted by slot (a counting sort; stable), base-model tokens last; slot s owns the
  // sorted positions [start[s], start[s + 1]). Every entry of start is written.
  const int64_t cap = g_.max_batch;
  std::vector<int32_t> start(cap + 1, 0), order(tokens);
  for (int32_t s : token_slot) {
    if (s >= 0) ++start[s + 1];
  }
  for (int64_t s = 0; s < cap; ++s) start[s + 1] += start[s];
  std::vector<int32_t> next(start.begin(), start.end() - 1);
  int32_t base_pos = start[cap];
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t s = token_slot[t];
    order[s >= 0 ? next[s]++ : base_pos++] = static_cast<int32_t>(t);
  }
  auto upload = [](const Tensor& dev, const void* src, std::vector<int64_t> shape,
                   DLDataType dtype) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    Tensor v = View(dev, 0, shape, dtype);
    UploadAsync(v, src, n * 4);
    return v;
  };
  tables_ = {arena_,
             upload(slot_, token_slot.data(), {tokens}, kInt32),
             upload(rank_, rank.data(), {S}, kInt32),
             upload(scale_, scale.data(), {S, M_}, kFloat32),
             upload(a_, a_off.data(), {S, M_, R_}, kInt32),
             upload(b_, b_off.data(), {S, M_, R_}, kInt32),
             upload(order_, order.data(), {tokens}, kInt32),
             // every entry written (graph_tables' view), this batch's slots' here
             View(upload(start_, start.data(), {cap + 1}, kInt32), 0, {S + 1}, kInt32)};
}

}  // namespace mlc_lora
