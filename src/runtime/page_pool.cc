/*!
 * \file page_pool.cc
 * \brief Page accounting of the unified pool (see page_pool.h). No TVM, no device memory.
 */
#include "page_pool.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>

namespace mlc_lora {

namespace {
template <typename... Args>
std::string Cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace

PagePool::PagePool(int32_t num_pages, int32_t page_size)
    : num_pages_(num_pages), page_size_(page_size) {
  if (num_pages < 1 || page_size < 1) {
    throw PoolError(PoolError::kValue, Cat("a page pool needs at least one page of at least one "
                                           "token; got ", num_pages, " pages of ", page_size));
  }
  owner_.assign(num_pages, Owner::kFree);
  kv_refs_.assign(num_pages, 0);
  // A stack popped from the back: page 0 is handed out first, like TVM's cache.
  free_.reserve(num_pages);
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

const PagePool::Seq& PagePool::GetSeq(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw PoolError(PoolError::kValue, Cat("unknown sequence ", seq));
  return it->second;
}
PagePool::Seq& PagePool::GetSeq(int64_t seq) {
  return const_cast<Seq&>(static_cast<const PagePool*>(this)->GetSeq(seq));
}
const PagePool::Adapter& PagePool::GetAdapter(int64_t adapter) const {
  auto it = adapters_.find(adapter);
  if (it == adapters_.end()) throw PoolError(PoolError::kValue, Cat("unknown adapter ", adapter));
  return it->second;
}
PagePool::Adapter& PagePool::GetAdapter(int64_t adapter) {
  return const_cast<Adapter&>(static_cast<const PagePool*>(this)->GetAdapter(adapter));
}

int32_t PagePool::TakePage(Owner owner) {
  // Callers have checked that enough pages are free.
  int32_t p = free_.back();
  free_.pop_back();
  owner_[p] = owner;
  kv_refs_[p] = owner == Owner::kKV ? 1 : 0;
  return p;
}

void PagePool::ReleaseKVPage(int32_t page) {
  if (--kv_refs_[page] == 0) {
    owner_[page] = Owner::kFree;
    free_.push_back(page);
  }
}

void PagePool::ReleaseAdapterPages(Adapter* a) {
  for (int32_t p : a->pages) {
    owner_[p] = Owner::kFree;
    free_.push_back(p);
  }
  a->pages.clear();
  a->resident = false;
}

PoolStats PagePool::Stats() const {
  PoolStats s{num_pages_, num_free(), 0, 0, 0, 0, static_cast<int64_t>(adapters_.size()),
              evictions_, page_ins_};
  for (Owner o : owner_) {
    s.kv += o == Owner::kKV;
    s.adapter += o == Owner::kAdapter;
  }
  for (const auto& [id, a] : adapters_) {
    if (a.pinned) s.pinned += a.n_pages;
    if (!a.resident) continue;
    ++s.resident_adapters;
    if (!a.pinned && a.refs == 0) s.evictable += a.n_pages;
  }
  return s;
}

void PagePool::Clear() {
  for (auto& [id, s] : seqs_) {
    for (int32_t p : s.pages) ReleaseKVPage(p);
  }
  seqs_.clear();
  for (auto it = adapters_.begin(); it != adapters_.end();) {
    it->second.refs = 0;
    if (it->second.unloading) {
      ReleaseAdapterPages(&it->second);
      it = adapters_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sequences

void PagePool::AddSequence(int64_t seq) {
  if (seqs_.count(seq)) throw PoolError(PoolError::kValue, Cat("sequence ", seq, " already exists"));
  seqs_.emplace(seq, Seq());
}

void PagePool::RemoveSequence(int64_t seq) {
  Seq& s = GetSeq(seq);
  for (int32_t p : s.pages) ReleaseKVPage(p);
  int64_t adapter = s.adapter;
  seqs_.erase(seq);
  if (adapter >= 0) DropRef(adapter);
}

void PagePool::ForkSequence(int64_t parent, int64_t child, int64_t fork_pos) {
  const Seq& p = GetSeq(parent);
  if (seqs_.count(child)) {
    throw PoolError(PoolError::kValue, Cat("cannot fork into sequence ", child,
                                           ": it already exists"));
  }
  if (fork_pos == -1) fork_pos = p.length;
  if (fork_pos < 0 || fork_pos > p.length) {
    throw PoolError(PoolError::kValue, Cat("fork position ", fork_pos, " is outside [0, ",
                                           p.length, "] of sequence ", parent));
  }
  Seq c;
  c.length = fork_pos;
  c.pages.assign(p.pages.begin(), p.pages.begin() + PagesFor(fork_pos));
  for (int32_t page : c.pages) ++kv_refs_[page];
  c.adapter = p.adapter;
  if (c.adapter >= 0) ++GetAdapter(c.adapter).refs;
  seqs_.emplace(child, std::move(c));
}

void PagePool::PopN(int64_t seq, int64_t n) {
  Seq& s = GetSeq(seq);
  if (n < 0 || n > s.length) {
    throw PoolError(PoolError::kValue, Cat("cannot pop ", n, " tokens from sequence ", seq,
                                           " of length ", s.length));
  }
  s.length -= n;
  size_t keep = PagesFor(s.length);
  for (size_t i = keep; i < s.pages.size(); ++i) ReleaseKVPage(s.pages[i]);
  s.pages.resize(keep);
}

void PagePool::SetSequenceAdapter(int64_t seq, int64_t adapter) {
  Seq& s = GetSeq(seq);
  if (adapter >= 0) {
    Adapter& a = GetAdapter(adapter);
    if (a.unloading) {
      throw PoolError(PoolError::kValue, Cat("adapter ", adapter, " is being unloaded"));
    }
    ++a.refs;
  } else if (adapter != -1) {
    throw PoolError(PoolError::kValue, Cat("adapter id must be >= 0 or -1 (none), got ", adapter));
  }
  int64_t old = s.adapter;
  s.adapter = adapter;
  if (old >= 0) DropRef(old);
}

void PagePool::DropRef(int64_t adapter) {
  Adapter& a = GetAdapter(adapter);
  if (--a.refs == 0 && a.unloading) {
    ReleaseAdapterPages(&a);
    adapters_.erase(adapter);
  }
}

int64_t PagePool::TotalSequenceLength() const {
  int64_t n = 0;
  for (const auto& [id, s] : seqs_) n += s.length;
  return n;
}

Reservation PagePool::ReserveAppend(const std::vector<int64_t>& seqs,
                                    const std::vector<int64_t>& lens) {
  if (seqs.size() != lens.size()) {
    throw PoolError(PoolError::kValue, Cat("got ", seqs.size(), " sequence ids but ",
                                           lens.size(), " append lengths"));
  }
  // Plan: count pages without changing anything.
  std::unordered_set<int64_t> seen;
  std::unordered_map<int32_t, int32_t> copied;  // shared page -> planned copies away from it
  std::vector<int64_t> batch_adapters;
  int64_t need = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Seq& s = GetSeq(seqs[i]);
    if (!seen.insert(seqs[i]).second) {
      throw PoolError(PoolError::kValue, Cat("sequence ", seqs[i], " appears twice in a batch"));
    }
    if (lens[i] < 0) {
      throw PoolError(PoolError::kValue, Cat("negative append length ", lens[i]));
    }
    bool cow = lens[i] > 0 && s.length % page_size_ != 0 &&
               kv_refs_[s.pages.back()] - copied[s.pages.back()] > 1;
    if (cow) ++copied[s.pages.back()];
    need += cow + PagesFor(s.length + lens[i]) - PagesFor(s.length);
    if (s.adapter >= 0 &&
        std::find(batch_adapters.begin(), batch_adapters.end(), s.adapter) == batch_adapters.end()) {
      batch_adapters.push_back(s.adapter);
      const Adapter& a = GetAdapter(s.adapter);
      if (!a.resident) need += a.n_pages;
    }
  }
  std::vector<int64_t> victims = PlanEviction(need, batch_adapters, "this batch");

  // Commit.
  Reservation r;
  Evict(victims, &r.evicted);
  for (int64_t id : batch_adapters) {
    Adapter& a = GetAdapter(id);
    a.last_use = ++clock_;
    if (a.resident) continue;
    for (int32_t j = 0; j < a.n_pages; ++j) a.pages.push_back(TakePage(Owner::kAdapter));
    a.resident = true;
    r.paged_in.push_back(id);
    ++page_ins_;
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq& s = GetSeq(seqs[i]);
    if (lens[i] == 0) continue;
    int32_t used = static_cast<int32_t>(s.length % page_size_);
    if (used != 0 && kv_refs_[s.pages.back()] > 1) {
      int32_t src = s.pages.back();
      int32_t dst = TakePage(Owner::kKV);
      r.copies.push_back({src, dst, used});
      ReleaseKVPage(src);
      s.pages.back() = dst;
    }
    s.length += lens[i];
    while (static_cast<int64_t>(s.pages.size()) < PagesFor(s.length)) {
      s.pages.push_back(TakePage(Owner::kKV));
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Adapters

std::vector<int64_t> PagePool::PlanEviction(int64_t need, const std::vector<int64_t>& keep,
                                            const std::string& what) const {
  if (need <= num_free()) return {};
  std::vector<std::pair<uint64_t, int64_t>> idle;  // (last use, id)
  for (const auto& [id, a] : adapters_) {
    if (a.resident && !a.pinned && a.refs == 0 &&
        std::find(keep.begin(), keep.end(), id) == keep.end()) {
      idle.emplace_back(a.last_use, id);
    }
  }
  std::sort(idle.begin(), idle.end());
  std::vector<int64_t> victims;
  int64_t avail = num_free();
  for (const auto& [t, id] : idle) {
    if (avail >= need) break;
    avail += adapters_.at(id).n_pages;
    victims.push_back(id);
  }
  if (avail < need) {
    PoolStats s = Stats();
    throw PoolError(PoolError::kExhausted,
                    Cat("page pool exhausted: ", what, " needs ", need, " pages but only ",
                        s.free, " are free and ", s.evictable,
                        " can be freed by evicting idle adapters (", s.kv, " pages hold KV, ",
                        s.adapter - s.evictable, " hold pinned or in-use adapters, ", s.total,
                        " in total)"));
  }
  return victims;
}

void PagePool::Evict(const std::vector<int64_t>& victims, std::vector<int64_t>* evicted) {
  for (int64_t id : victims) {
    ReleaseAdapterPages(&adapters_.at(id));
    ++evictions_;
    if (evicted) evicted->push_back(id);
  }
}

bool PagePool::AddAdapter(int64_t adapter, int32_t n_pages, bool pinned,
                          std::vector<int64_t>* evicted) {
  if (adapter < 0) {
    throw PoolError(PoolError::kValue, Cat("adapter id must be >= 0, got ", adapter));
  }
  if (auto it = adapters_.find(adapter); it != adapters_.end()) {
    throw PoolError(PoolError::kValue,
                    Cat("adapter ", adapter, it->second.unloading ? " is still being unloaded "
                                                                    "(sequences use it)"
                                                                  : " is already loaded"));
  }
  if (n_pages < 1) {
    throw PoolError(PoolError::kValue, Cat("an adapter needs at least one page, got ", n_pages));
  }
  if (n_pages > num_pages_) {
    throw PoolError(PoolError::kValue, Cat("adapter ", adapter, " needs ", n_pages,
                                           " pages but the whole pool has only ", num_pages_));
  }
  Adapter a;
  a.n_pages = n_pages;
  a.pinned = pinned;
  a.last_use = ++clock_;
  adapters_.emplace(adapter, std::move(a));
  int64_t page_ins = page_ins_;
  bool resident = TryPageIn(adapter, {}, evicted);
  page_ins_ = page_ins;  // a load is no page-in
  return resident;
}

bool PagePool::TryPageIn(int64_t adapter, const std::vector<int64_t>& keep,
                         std::vector<int64_t>* evicted) {
  Adapter& a = GetAdapter(adapter);
  if (a.unloading) {
    throw PoolError(PoolError::kValue, Cat("adapter ", adapter, " is being unloaded"));
  }
  if (a.resident) return true;
  std::vector<int64_t> k(keep);
  k.push_back(adapter);
  std::vector<int64_t> victims;
  try {
    victims = PlanEviction(a.n_pages, k, Cat("paging in adapter ", adapter));
  } catch (const PoolError& e) {
    if (e.kind == PoolError::kExhausted) return false;
    throw;
  }
  Evict(victims, evicted);
  for (int32_t j = 0; j < a.n_pages; ++j) a.pages.push_back(TakePage(Owner::kAdapter));
  a.resident = true;
  a.last_use = ++clock_;
  ++page_ins_;
  return true;
}

void PagePool::RemoveAdapter(int64_t adapter) {
  Adapter& a = GetAdapter(adapter);
  if (a.unloading) return;
  if (a.refs > 0) {
    // Sequences keep running on it; the last one to let go frees it (DropRef).
    a.unloading = true;
    a.pinned = false;
    return;
  }
  ReleaseAdapterPages(&a);
  adapters_.erase(adapter);
}

bool PagePool::PinAdapter(int64_t adapter, bool pinned, std::vector<int64_t>* evicted) {
  Adapter& a = GetAdapter(adapter);
  if (a.unloading) {
    throw PoolError(PoolError::kValue, Cat("adapter ", adapter, " is being unloaded"));
  }
  bool page_in = pinned && !a.resident;
  if (page_in) {
    std::vector<int64_t> victims =
        PlanEviction(a.n_pages, {adapter}, Cat("pinning adapter ", adapter));
    Evict(victims, evicted);
    for (int32_t j = 0; j < a.n_pages; ++j) a.pages.push_back(TakePage(Owner::kAdapter));
    a.resident = true;
    a.last_use = ++clock_;
    ++page_ins_;
  }
  a.pinned = pinned;
  return page_in;
}

// ---------------------------------------------------------------------------------------------

void PagePool::CheckInvariants() const {
  auto fail = [](const std::string& msg) { throw std::logic_error("page pool: " + msg); };
  std::vector<int32_t> refs(num_pages_, 0), adapter_owner(num_pages_, 0);
  std::unordered_map<int64_t, int64_t> adapter_refs;
  for (const auto& [id, s] : seqs_) {
    if (static_cast<int64_t>(s.pages.size()) != PagesFor(s.length)) {
      fail(Cat("sequence ", id, " of length ", s.length, " holds ", s.pages.size(), " pages"));
    }
    for (int32_t p : s.pages) ++refs.at(p);
    if (s.adapter >= 0) ++adapter_refs[s.adapter];
  }
  for (const auto& [id, a] : adapters_) {
    if (a.refs != adapter_refs[id]) fail(Cat("adapter ", id, " refcount ", a.refs));
    if (a.unloading && a.refs == 0) fail(Cat("adapter ", id, " should have been unloaded"));
    if (a.resident != (a.pages.size() == static_cast<size_t>(a.n_pages)) ||
        (!a.resident && !a.pages.empty())) {
      fail(Cat("adapter ", id, " residency"));
    }
    for (int32_t p : a.pages) ++adapter_owner.at(p);
  }
  for (const auto& [id, n] : adapter_refs) {
    if (n > 0 && !adapters_.count(id)) fail(Cat("sequences use unknown adapter ", id));
  }
  std::vector<int32_t> in_free(num_pages_, 0);
  for (int32_t p : free_) ++in_free.at(p);
  for (int32_t p = 0; p < num_pages_; ++p) {
    int owners = (refs[p] > 0) + adapter_owner[p] + in_free[p];
    if (owners != 1) fail(Cat("page ", p, " has ", owners, " owners"));
    if (refs[p] != kv_refs_[p]) fail(Cat("page ", p, " KV refcount"));
    Owner want = refs[p] > 0 ? Owner::kKV : adapter_owner[p] ? Owner::kAdapter : Owner::kFree;
    if (owner_[p] != want) fail(Cat("page ", p, " owner tag"));
  }
  PoolStats s = Stats();
  if (s.free + s.kv + s.adapter != s.total) fail("free + kv + adapter != total");
}

}  // namespace mlc_lora
