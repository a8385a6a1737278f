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
  owned_[static_cast<int>(Owner::kFree)] = num_pages;
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
  SetOwner(p, owner);
  kv_refs_[p] = owner == Owner::kKV ? 1 : 0;
  return p;
}

void PagePool::ReleaseKVPage(int32_t page) {
  if (--kv_refs_[page] == 0) {
    if (PageCached(page)) {
      IdleCachedPage(page);  // keyed: kept for later sequences of its adapter
      return;
    }
    SetOwner(page, Owner::kFree);
    free_.push_back(page);
  }
}

void PagePool::ReleaseAdapterPages(Adapter* a) {
  for (int32_t p : a->pages) {
    SetOwner(p, Owner::kFree);
    free_.push_back(p);
  }
  a->pages.clear();
  a->resident = false;
}

int64_t PagePool::EvictablePages() const {
  int64_t n = static_cast<int64_t>(idle_cache_.size());
  for (const auto& [id, a] : adapters_) {
    if (a.idle()) n += a.n_pages;  // (idle: resident, unpinned, no sequence on it)
  }
  return n;
}

PoolStats PagePool::Stats() const {
  PoolStats s{num_pages_, num_free(), 0, 0, 0, 0, static_cast<int64_t>(adapters_.size()),
              evictions_, page_ins_, static_cast<int64_t>(cache_.size()),
              static_cast<int64_t>(idle_cache_.size()), prefix_queries_, prefix_query_tokens_,
              prefix_hit_tokens_, cached_evictions_};
  s.evictable = EvictablePages();
  s.kv = owned_[static_cast<int>(Owner::kKV)];
  s.adapter = owned_[static_cast<int>(Owner::kAdapter)];
  for (const auto& [id, a] : adapters_) {
    if (a.pinned) s.pinned += a.n_pages;
    if (a.resident) ++s.resident_adapters;
  }
  return s;
}

void PagePool::Clear() {
  for (auto& [id, s] : seqs_) {
    for (int32_t p : s.pages) ReleaseKVPage(p);
  }
  seqs_.clear();
  // the prefix cache goes too: every keyed page is idle now
  for (const auto& [page, c] : cache_) {
    SetOwner(page, Owner::kFree);
    free_.push_back(page);
  }
  cache_.clear();
  cache_index_.clear();
  idle_cache_.clear();
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
  ++clock_;  // its keyed pages become idle now (one time: a chain is evicted from its tail)
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
  c.prefix_pages = std::min<int32_t>(p.prefix_pages, static_cast<int32_t>(fork_pos / page_size_));
  c.prefix_open = p.prefix_open;
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
  s.prefix_pages = std::min<int32_t>(s.prefix_pages, static_cast<int32_t>(s.length / page_size_));
  size_t keep = PagesFor(s.length);
  ++clock_;
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
  // its keyed pages hold the old adapter's KV: none of its later pages may extend that chain
  if (old != adapter && !s.pages.empty()) s.prefix_open = false;
  if (old >= 0) DropRef(old);
}

void PagePool::DropRef(int64_t adapter) {
  Adapter& a = GetAdapter(adapter);
  if (--a.refs == 0 && a.unloading) EraseAdapter(adapter);
}

void PagePool::EraseAdapter(int64_t adapter) {
  ReleaseAdapterPages(&adapters_.at(adapter));
  DropCachedPrefixes(adapter);
  adapters_.erase(adapter);
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
    // a keyed page is never written: appending to it copies it, as to a shared one
    bool cow = lens[i] > 0 && s.length % page_size_ != 0 &&
               (kv_refs_[s.pages.back()] - copied[s.pages.back()] > 1 ||
                PageCached(s.pages.back()));
    if (cow) ++copied[s.pages.back()];
    need += cow + PagesFor(s.length + lens[i]) - PagesFor(s.length);
    if (s.adapter >= 0 &&
        std::find(batch_adapters.begin(), batch_adapters.end(), s.adapter) == batch_adapters.end()) {
      batch_adapters.push_back(s.adapter);
      const Adapter& a = GetAdapter(s.adapter);
      if (!a.resident) need += a.n_pages;
    }
  }
  EvictionPlan victims = PlanEviction(need, batch_adapters, "this batch");

  // Commit.
  Reservation r;
  Evict(victims, &r.evicted);
  ++clock_;  // keyed pages copied away from below become idle now
  for (int64_t id : batch_adapters) {
    Adapter& a = GetAdapter(id);
    a.last_use = ++clock_;
    if (a.resident) continue;
    TakeAdapterPages(&a);
    r.paged_in.push_back(id);
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq& s = GetSeq(seqs[i]);
    if (lens[i] == 0) continue;
    int32_t used = static_cast<int32_t>(s.length % page_size_);
    if (used != 0 && (kv_refs_[s.pages.back()] > 1 || PageCached(s.pages.back()))) {
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

PagePool::EvictionPlan PagePool::PlanEviction(int64_t need, const std::vector<int64_t>& keep,
                                              const std::string& what,
                                              const std::vector<int32_t>& protect) const {
  EvictionPlan plan;
  if (need <= num_free()) return plan;
  std::vector<std::pair<uint64_t, int64_t>> idle;  // (last use, id)
  for (const auto& [id, a] : adapters_) {
    if (a.idle() && std::find(keep.begin(), keep.end(), id) == keep.end()) {
      idle.emplace_back(a.last_use, id);
    }
  }
  std::sort(idle.begin(), idle.end());
  // One least-recently-used order over idle adapters and idle keyed pages. A keyed page's
  // children are idle too and sort before it (older or as old, deeper), so a chain goes tail first.
  int64_t avail = num_free();
  auto a = idle.begin();
  auto c = idle_cache_.begin();
  // protected pages are skipped; their chains' roots are protected too, so no page skipped here
  // has a child that the order below would evict before it
  auto skip = [&] {
    while (c != idle_cache_.end() && std::find(protect.begin(), protect.end(), std::get<2>(*c)) != protect.end()) {
      ++c;
    }
  };
  skip();
  while (avail < need && (a != idle.end() || c != idle_cache_.end())) {
    if (c == idle_cache_.end() || (a != idle.end() && a->first < std::get<0>(*c))) {
      avail += adapters_.at(a->second).n_pages;
      plan.adapters.push_back(a->second);
      ++a;
    } else {
      avail += 1;
      plan.pages.push_back(std::get<2>(*c));
      ++c;
      skip();
    }
  }
  if (avail < need) {
    PoolStats s = Stats();
    throw PoolError(PoolError::kExhausted,
                    Cat("page pool exhausted: ", what, " needs ", need, " pages but only ",
                        s.free, " are free and ", s.evictable,
                        " can be freed by evicting idle adapters and cached prefixes (", s.kv,
                        " pages hold KV, ", s.adapter - (s.evictable - s.cached_idle),
                        " hold pinned or in-use adapters, ", s.total, " in total)"));
  }
  return plan;
}

void PagePool::Evict(const EvictionPlan& plan, std::vector<int64_t>* evicted) {
  for (int64_t id : plan.adapters) {
    ReleaseAdapterPages(&adapters_.at(id));
    ++evictions_;
    if (evicted) evicted->push_back(id);
  }
  for (int32_t page : plan.pages) {
    if (cache_.at(page).children != 0) {
      throw std::logic_error(Cat("page pool: evicting keyed page ", page, " before its children"));
    }
    UncachePage(page);
    ++cached_evictions_;
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
                         std::vector<int64_t>* evicted, const std::vector<int32_t>& protect) {
  Adapter& a = GetAdapter(adapter);
  if (a.unloading) {
    throw PoolError(PoolError::kValue, Cat("adapter ", adapter, " is being unloaded"));
  }
  if (a.resident) return true;
  std::vector<int64_t> k(keep);
  k.push_back(adapter);
  try {
    PageIn(adapter, k, Cat("paging in adapter ", adapter), evicted, protect);
  } catch (const PoolError& e) {
    if (e.kind == PoolError::kExhausted) return false;
    throw;
  }
  return true;
}

void PagePool::PageIn(int64_t adapter, const std::vector<int64_t>& keep, const std::string& what,
                      std::vector<int64_t>* evicted, const std::vector<int32_t>& protect) {
  Adapter& a = GetAdapter(adapter);
  Evict(PlanEviction(a.n_pages, keep, what, protect), evicted);
  TakeAdapterPages(&a);
  a.last_use = ++clock_;
}

void PagePool::TakeAdapterPages(Adapter* a) {
  // Callers have made room (PlanEviction).
  for (int32_t j = 0; j < a->n_pages; ++j) a->pages.push_back(TakePage(Owner::kAdapter));
  a->resident = true;
  ++page_ins_;
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
  EraseAdapter(adapter);
}

bool PagePool::PinAdapter(int64_t adapter, bool pinned, std::vector<int64_t>* evicted) {
  Adapter& a = GetAdapter(adapter);
  if (a.unloading) {
    throw PoolError(PoolError::kValue, Cat("adapter ", adapter, " is being unloaded"));
  }
  bool page_in = pinned && !a.resident;
  if (page_in) PageIn(adapter, {adapter}, Cat("pinning adapter ", adapter), evicted);
  a.pinned = pinned;
  return page_in;
}

// ---------------------------------------------------------------------------------------------
// Prefix cache

uint64_t PagePool::BlockHash(uint64_t parent, const int32_t* tokens, int32_t n) {
  // splitmix64 over the parent's hash and each token; a match is confirmed on the tokens
  auto mix = [](uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent);
  for (int32_t i = 0; i < n; ++i) h = mix(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

std::vector<int32_t> PagePool::MatchPrefix(int64_t adapter,
                                           const std::vector<int32_t>& tokens) const {
  std::vector<int32_t> pages;
  if (tokens.empty()) return pages;
  const size_t n_pages = (tokens.size() - 1) / page_size_;  // the last token is left to compute
  int32_t parent = -1;
  uint64_t h = 0;
  for (size_t i = 0; i < n_pages; ++i) {
    const int32_t* block = tokens.data() + i * page_size_;
    h = BlockHash(h, block, page_size_);
    auto it = cache_index_.find({adapter, h});
    if (it == cache_index_.end()) break;
    const CachedPage& c = cache_.at(it->second);
    if (c.parent != parent || !std::equal(block, block + page_size_, c.tokens.begin())) break;
    parent = it->second;
    pages.push_back(parent);
  }
  return pages;
}

PrefixHit PagePool::LookupPrefix(int64_t adapter, const std::vector<int32_t>& tokens) const {
  std::vector<int32_t> pages = MatchPrefix(adapter, tokens);
  int32_t idle = 0;
  for (int32_t p : pages) idle += kv_refs_[p] == 0;
  return {static_cast<int64_t>(pages.size()) * page_size_, idle};
}

int64_t PagePool::AttachPrefix(int64_t seq, const std::vector<int32_t>& tokens) {
  Seq& s = GetSeq(seq);
  if (s.length != 0) {
    throw PoolError(PoolError::kValue, Cat("a cached prefix is attached to an empty sequence; ",
                                           "sequence ", seq, " has ", s.length, " tokens"));
  }
  std::vector<int32_t> pages = MatchPrefix(s.adapter, tokens);
  for (int32_t p : pages) {
    if (kv_refs_[p] == 0) {
      idle_cache_.erase(IdleKey(p));
      SetOwner(p, Owner::kKV);
    }
    ++kv_refs_[p];
  }
  s.length = static_cast<int64_t>(pages.size()) * page_size_;
  s.prefix_pages = static_cast<int32_t>(pages.size());
  s.prefix_open = true;
  s.pages = std::move(pages);
  ++prefix_queries_;
  prefix_query_tokens_ += static_cast<int64_t>(tokens.size());
  prefix_hit_tokens_ += s.length;
  return s.length;
}

int64_t PagePool::InsertPrefix(int64_t seq, int64_t start, const std::vector<int32_t>& tokens) {
  Seq& s = GetSeq(seq);
  const int64_t end = start + static_cast<int64_t>(tokens.size());
  if (start < 0 || start % page_size_ != 0 || end > s.length) {
    throw PoolError(PoolError::kValue,
                    Cat("tokens [", start, ", ", end, ") to key are not whole pages from a page ",
                        "start inside sequence ", seq, " of length ", s.length));
  }
  if (!s.prefix_open) return -1;
  for (int64_t i = s.prefix_pages; i < end / page_size_ && i * page_size_ >= start; ++i) {
    const int32_t* block = tokens.data() + (i * page_size_ - start);
    const int32_t page = s.pages[i];
    const int32_t parent = i == 0 ? -1 : s.pages[i - 1];
    const uint64_t h = BlockHash(parent < 0 ? 0 : cache_.at(parent).hash, block, page_size_);
    auto it = cache_index_.find({s.adapter, h});
    if (it != cache_index_.end()) {
      const int32_t keyed = it->second;
      const CachedPage& c = cache_.at(keyed);
      if (c.parent != parent || !std::equal(block, block + page_size_, c.tokens.begin())) {
        s.prefix_open = false;  // a hash collision: key nothing more, stay exact
        return -1;
      }
      if (keyed != page) {
        // A copy a fork shares, or keyed elsewhere: its later pages could not be keyed after the
        // keyed one (a sequence holding a keyed page holds its whole chain).
        if (kv_refs_[page] > 1 || PageCached(page)) {
          s.prefix_open = false;
          return -1;
        }
        // The same page computed twice (both started before either was keyed): take the keyed
        // one, as a hit would have, and give back the copy; the chain goes on.
        if (kv_refs_[keyed]++ == 0) {
          idle_cache_.erase(IdleKey(keyed));
          SetOwner(keyed, Owner::kKV);
        }
        ReleaseKVPage(page);
        s.pages[i] = keyed;
      }
      ++s.prefix_pages;
      continue;
    }
    if (PageCached(page)) {  // keyed under another chain (not expected): end here, stay exact
      s.prefix_open = false;
      return -1;
    }
    cache_.emplace(page, CachedPage{s.adapter, h, parent, static_cast<int32_t>(i), 0, 0,
                                    std::vector<int32_t>(block, block + page_size_)});
    if (parent >= 0) ++cache_.at(parent).children;
    cache_index_.emplace(CacheKey{s.adapter, h}, page);
    ++s.prefix_pages;
  }
  return s.prefix_pages;
}

void PagePool::IdleCachedPage(int32_t page) {
  SetOwner(page, Owner::kCached);
  cache_.at(page).last_use = clock_;
  idle_cache_.insert(IdleKey(page));
}

void PagePool::UncachePage(int32_t page) {
  auto it = cache_.find(page);
  const CachedPage& c = it->second;
  cache_index_.erase({c.adapter, c.hash});
  if (auto parent = cache_.find(c.parent); parent != cache_.end()) --parent->second.children;
  if (kv_refs_[page] == 0) {
    idle_cache_.erase(IdleKey(page));
    SetOwner(page, Owner::kFree);
    free_.push_back(page);
  }
  cache_.erase(it);
}

void PagePool::DropCachedPrefixes(int64_t adapter) {
  std::vector<int32_t> pages;
  for (const auto& [page, c] : cache_) {
    if (c.adapter == adapter) pages.push_back(page);
  }
  // Every page of a chain goes; pages sequences still hold (ones that moved to another adapter)
  // stay theirs, unkeyed.
  for (int32_t p : pages) UncachePage(p);
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
    const bool idle_cached = PageCached(p) && refs[p] == 0;
    int owners = (refs[p] > 0) + adapter_owner[p] + in_free[p] + idle_cached;
    if (owners != 1) fail(Cat("page ", p, " has ", owners, " owners"));
    if (refs[p] != kv_refs_[p]) fail(Cat("page ", p, " KV refcount"));
    Owner want = refs[p] > 0         ? Owner::kKV
                 : adapter_owner[p]  ? Owner::kAdapter
                 : idle_cached       ? Owner::kCached
                                     : Owner::kFree;
    if (owner_[p] != want) fail(Cat("page ", p, " owner tag"));
  }
  for (int o = 0; o < 4; ++o) {
    if (std::count(owner_.begin(), owner_.end(), static_cast<Owner>(o)) != owned_[o]) {
      fail(Cat("the count of owner tag ", o));
    }
  }
  CheckPrefixCache();
  PoolStats s = Stats();
  if (s.free + s.kv + s.adapter + s.cached_idle != s.total) {
    fail("free + kv + adapter + idle cached != total");
  }
}

void PagePool::CheckPrefixCache() const {
  auto fail = [](const std::string& msg) { throw std::logic_error("page pool: prefix cache: " + msg); };
  if (cache_index_.size() != cache_.size()) fail("index and pages differ in size");
  std::unordered_map<int32_t, int32_t> children;
  size_t idle = 0;
  for (const auto& [page, c] : cache_) {
    auto it = cache_index_.find({c.adapter, c.hash});
    if (it == cache_index_.end() || it->second != page) fail(Cat("page ", page, " is not indexed"));
    if (static_cast<int32_t>(c.tokens.size()) != page_size_) fail(Cat("page ", page, " tokens"));
    uint64_t parent_hash = 0;
    if (c.parent >= 0) {
      auto p = cache_.find(c.parent);
      if (p == cache_.end() || p->second.adapter != c.adapter || p->second.depth != c.depth - 1) {
        fail(Cat("page ", page, " has no keyed parent of its adapter one page up"));
      }
      parent_hash = p->second.hash;
      ++children[c.parent];
      // a sequence holding a keyed page holds its whole chain; an idle chain goes tail first
      if (kv_refs_[page] > 0 && kv_refs_[c.parent] == 0) fail(Cat("page ", page, " held, parent idle"));
      if (kv_refs_[page] == 0 && kv_refs_[c.parent] == 0 && c.last_use > p->second.last_use) {
        fail(Cat("idle page ", page, " was used after its parent"));
      }
    } else if (c.depth != 0) {
      fail(Cat("page ", page, " starts a chain at depth ", c.depth));
    }
    if (BlockHash(parent_hash, c.tokens.data(), page_size_) != c.hash) fail(Cat("page ", page, " hash"));
    if (kv_refs_[page] == 0) {
      ++idle;
      if (!idle_cache_.count(IdleKey(page))) fail(Cat("idle page ", page, " is not evictable"));
    }
    if (c.adapter >= 0 && !adapters_.count(c.adapter)) fail(Cat("page ", page, " of a removed adapter"));
  }
  for (const auto& [page, c] : cache_) {
    auto it = children.find(page);
    if (c.children != (it == children.end() ? 0 : it->second)) fail(Cat("page ", page, " children"));
  }
  if (idle != idle_cache_.size()) fail("evictable set size");
  for (const auto& [id, s] : seqs_) {
    if (s.prefix_pages > s.length / page_size_) fail(Cat("sequence ", id, " keys a partial page"));
    if (!s.prefix_open) continue;
    for (int32_t i = 0; i < s.prefix_pages; ++i) {
      auto c = cache_.find(s.pages[i]);
      if (c == cache_.end() || c->second.adapter != s.adapter ||
          c->second.parent != (i == 0 ? -1 : s.pages[i - 1])) {
        fail(Cat("sequence ", id, " page ", i, " is not its chain's"));
      }
    }
  }
}

}  // namespace mlc_lora
