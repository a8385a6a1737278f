/*!
 * \file page_pool.h
 * \brief The bookkeeping of mlc-lora's unified page pool, with no TVM dependency.
 *
 * One free list of page ids serves two kinds of owners:
 *  - KV: a sequence is a list of page ids plus a length; pages are reference counted so that a
 *    forked sequence shares its parent's pages. A shared page that is only partly filled is
 *    copied before anyone appends to it (copy on write), so shared pages are never written.
 *  - adapters: a resident adapter owns a fixed number of page ids. Sequences hold references to
 *    adapters; an idle (no references), unpinned adapter may be evicted (least recently used
 *    first) when KV or another adapter needs pages, and is paged back in when a sequence using it
 *    enters a batch. An adapter loaded while the pool is busy is registered without pages and
 *    paged in the same way.
 *  - the prefix cache: a full KV page may be keyed by (adapter, hash of the token block chain up to
 *    and including it; adapter -1 is the base model). Keyed pages outlive their sequences and are
 *    reused by later sequences of the same adapter (AttachPrefix); a keyed page is never written
 *    (an append to it copies it first, like a shared page). Keyed pages that no sequence holds and
 *    idle unpinned adapters are evicted by one policy, least recently used first, from the one
 *    free list; a chain is evicted from its tail. Removing an adapter drops its keyed pages.
 * Every operation either succeeds or throws PoolError and leaves the state unchanged.
 */
#ifndef MLC_LORA_RUNTIME_PAGE_POOL_H_
#define MLC_LORA_RUNTIME_PAGE_POOL_H_

#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace mlc_lora {

/*! \brief A failed pool operation; `kind` names the Python exception class it maps to. */
class PoolError : public std::runtime_error {
 public:
  enum Kind { kValue, kExhausted };
  PoolError(Kind kind, const std::string& msg) : std::runtime_error(msg), kind(kind) {}
  Kind kind;
};

/*! \brief Copy the first `len` token slots of page `src` to page `dst` (every layer). */
struct PageCopy {
  int32_t src, dst, len;
};

/*! \brief What BeginForward must do on the device besides computing attention. */
struct Reservation {
  std::vector<PageCopy> copies;      // copy-on-write of shared partly filled pages, in order
  std::vector<int64_t> paged_in;     // adapters that got pages and need their weights copied in
  std::vector<int64_t> evicted;      // adapters that lost their pages
};

struct PoolStats {
  int64_t total, free, kv, adapter, evictable, resident_adapters, loaded_adapters;
  int64_t evictions, page_ins;  // cumulative: adapters evicted, adapters given pages after their load
  // prefix cache: keyed pages (held or idle), keyed pages no sequence holds (free + kv + adapter +
  // cached_idle == total; they are part of evictable), and cumulative counters: AttachPrefix
  // calls, the tokens they offered and matched, keyed pages evicted for room
  int64_t cached, cached_idle, prefix_queries, prefix_query_tokens, prefix_hit_tokens,
      cached_evictions;
  int64_t pinned = 0;  // pages of pinned adapters, resident or not
};

/*! \brief A LookupPrefix result: matched tokens (whole pages) and how many of those pages no
 *  sequence holds (attaching takes them out of the evictable ones). */
struct PrefixHit {
  int64_t tokens;
  int32_t idle_pages;
};

class PagePool {
 public:
  PagePool(int32_t num_pages, int32_t page_size);

  int32_t num_pages() const { return num_pages_; }
  int32_t page_size() const { return page_size_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  /*! \brief The free page ids (in no particular order). */
  const std::vector<int32_t>& free_pages() const { return free_; }
  PoolStats Stats() const;
  /*! \brief Pages that idle resident adapters (unpinned, no sequence on them) and idle cached
   *  prefixes would give back: evicted on demand (Stats' evictable). */
  int64_t EvictablePages() const;
  /*! \brief Pages a batch can take: the free ones and the evictable ones (without the rest of
   *  Stats: the scheduler asks it every step). */
  int64_t AdmittablePages() const { return num_free() + EvictablePages(); }
  /*! \brief Forget every sequence; adapters stay loaded, their references drop to zero. */
  void Clear();

  // ---- sequences
  void AddSequence(int64_t seq);
  void RemoveSequence(int64_t seq);
  /*! \brief The child shares the parent's pages up to fork_pos (-1: the parent's length). */
  void ForkSequence(int64_t parent, int64_t child, int64_t fork_pos);
  void PopN(int64_t seq, int64_t n);
  bool HasSequence(int64_t seq) const { return seqs_.count(seq) != 0; }
  int64_t SequenceLength(int64_t seq) const { return GetSeq(seq).length; }
  const std::vector<int32_t>& SequencePages(int64_t seq) const { return GetSeq(seq).pages; }
  int64_t SequenceAdapter(int64_t seq) const { return GetSeq(seq).adapter; }
  /*! \brief -1 detaches. The adapter need not be resident (it is paged in by ReserveAppend). */
  void SetSequenceAdapter(int64_t seq, int64_t adapter);
  int64_t TotalSequenceLength() const;
  bool Empty() const { return seqs_.empty(); }

  /*!
   * \brief Make room to append lens[i] tokens to seqs[i] and make the batch's adapters resident.
   * On success the sequence lengths grow by lens; on failure nothing changes.
   */
  Reservation ReserveAppend(const std::vector<int64_t>& seqs, const std::vector<int64_t>& lens);

  // ---- adapters
  /*!
   * \brief Register an adapter of `n_pages` pages and give it pages now if free pages, idle
   * adapters and idle cached prefix pages allow (one least-recently-used order); else it waits
   * without pages (a busy pool never refuses a load) and is paged in by the first batch that uses
   * it, by TryPageIn or by PinAdapter. Returns whether it is resident.
   */
  bool AddAdapter(int64_t adapter, int32_t n_pages, bool pinned, std::vector<int64_t>* evicted);
  /*!
   * \brief Give a registered adapter without pages its pages now, evicting idle adapters that are
   * not in `keep` and idle cached prefix pages not in `protect` (least recently used first over
   * both). Returns false, changing nothing, when what it may evict is too little; true if it is
   * resident afterwards. Counts as a page-in. (A prefetch protects the cached prefixes its waiting
   * requests would hit: PrefixPages.)
   */
  bool TryPageIn(int64_t adapter, const std::vector<int64_t>& keep, std::vector<int64_t>* evicted,
                 const std::vector<int32_t>& protect = {});
  /*! \brief Unload now if no sequence uses it, else when the last one lets go. */
  void RemoveAdapter(int64_t adapter);
  /*! \brief Pinning a non-resident adapter pages it in; returns true if it needs its weights. */
  bool PinAdapter(int64_t adapter, bool pinned, std::vector<int64_t>* evicted);
  bool HasAdapter(int64_t adapter) const { return adapters_.count(adapter) != 0; }
  bool AdapterResident(int64_t adapter) const { return GetAdapter(adapter).resident; }
  /*! \brief The pages a batch must find for the adapter: none if it is resident and kept (pinned
   *  or used by a sequence), else all of them (an idle one stops being evictable). */
  int32_t AdapterPagesToRun(int64_t adapter) const {
    const Adapter& a = GetAdapter(adapter);
    return a.resident && !a.idle() ? 0 : a.n_pages;
  }
  bool AdapterPinned(int64_t adapter) const { return GetAdapter(adapter).pinned; }
  int64_t AdapterRefs(int64_t adapter) const { return GetAdapter(adapter).refs; }
  int32_t AdapterNumPages(int64_t adapter) const { return GetAdapter(adapter).n_pages; }
  const std::vector<int32_t>& AdapterPages(int64_t adapter) const {
    return GetAdapter(adapter).pages;
  }

  // ---- prefix cache (keys of full KV pages; see the file comment)
  /*!
   * \brief The longest chain of keyed pages of `adapter` (-1: base model) holding the first
   * tokens of `tokens`, in whole pages, leaving at least the last token out (its logits must be
   * computed). Changes nothing.
   */
  PrefixHit LookupPrefix(int64_t adapter, const std::vector<int32_t>& tokens) const;
  /*! \brief The keyed pages LookupPrefix(adapter, tokens) counts, in chain order. */
  std::vector<int32_t> PrefixPages(int64_t adapter, const std::vector<int32_t>& tokens) const {
    return MatchPrefix(adapter, tokens);
  }
  /*!
   * \brief Give an empty sequence the pages of LookupPrefix(its adapter, tokens): its length
   * becomes the matched tokens. Counts one query. Returns the matched tokens.
   */
  int64_t AttachPrefix(int64_t seq, const std::vector<int32_t>& tokens);
  /*!
   * \brief Key the sequence's full pages after those already keyed: `tokens` are its tokens
   * from position `start` (a multiple of the page size) on. A page whose key another page has
   * already (the same prefix computed twice) is replaced by that page, as a hit would have given
   * it, and freed. Returns the sequence's leading keyed pages, or -1 once its chain has ended
   * (its adapter changed, a hash collision, or such a copy shared with a fork).
   */
  int64_t InsertPrefix(int64_t seq, int64_t start, const std::vector<int32_t>& tokens);
  bool PageCached(int32_t page) const { return cache_.count(page) != 0; }

  /*! \brief Recount every page from the owners; throws std::logic_error on any inconsistency. */
  void CheckInvariants() const;

 private:
  struct Seq {
    std::vector<int32_t> pages;
    int64_t length = 0;
    int64_t adapter = -1;
    int32_t prefix_pages = 0;  // leading pages that are keyed, a chain (prefix cache)
    bool prefix_open = true;   // later full pages may be keyed (false: the chain ended)
  };
  struct Adapter {
    int32_t n_pages = 0;
    std::vector<int32_t> pages;  // empty while evicted
    bool resident = false;
    bool pinned = false;
    bool unloading = false;
    int64_t refs = 0;
    uint64_t last_use = 0;
    /*! \brief Resident, unpinned and used by no sequence: its pages may be evicted. */
    bool idle() const { return resident && !pinned && refs == 0; }
  };
  /*! \brief A keyed KV page (prefix cache). */
  struct CachedPage {
    int64_t adapter;
    uint64_t hash;       // of the token chain up to and including this page
    int32_t parent;      // the keyed page before it in the chain, -1: the first page
    int32_t depth;       // its index in the chain
    int32_t children;    // keyed pages whose parent it is
    uint64_t last_use;   // when the last sequence holding it let go
    std::vector<int32_t> tokens;  // page_size tokens
  };
  struct CacheKey {
    int64_t adapter;
    uint64_t hash;
    bool operator==(const CacheKey& o) const { return adapter == o.adapter && hash == o.hash; }
  };
  struct CacheKeyHash {
    size_t operator()(const CacheKey& k) const {
      return static_cast<size_t>(k.hash ^ (static_cast<uint64_t>(k.adapter) * 0x9E3779B97F4A7C15ull));
    }
  };
  /*! \brief What to evict: adapters and keyed pages (children before parents). */
  struct EvictionPlan {
    std::vector<int64_t> adapters;
    std::vector<int32_t> pages;
  };
  // kCached: a keyed page no sequence holds (a keyed page that sequences hold is kKV)
  enum class Owner : int8_t { kFree, kKV, kAdapter, kCached };

  void SetOwner(int32_t page, Owner owner) {
    --owned_[static_cast<int>(owner_[page])];
    ++owned_[static_cast<int>(owner)];
    owner_[page] = owner;
  }
  const Seq& GetSeq(int64_t seq) const;
  Seq& GetSeq(int64_t seq);
  const Adapter& GetAdapter(int64_t adapter) const;
  Adapter& GetAdapter(int64_t adapter);
  int32_t PagesFor(int64_t tokens) const {
    return static_cast<int32_t>((tokens + page_size_ - 1) / page_size_);
  }
  int32_t TakePage(Owner owner);
  void ReleaseKVPage(int32_t page);
  void ReleaseAdapterPages(Adapter* a);
  void DropRef(int64_t adapter);
  /*!
   * \brief Idle adapters (not in `keep`) and keyed pages no sequence holds (not in `protect`, a set
   * closed under parents: whole chains from their roots) to evict, least recently used first over
   * both, to get `need` free pages; throws if impossible.
   */
  EvictionPlan PlanEviction(int64_t need, const std::vector<int64_t>& keep, const std::string& what,
                            const std::vector<int32_t>& protect = {}) const;
  void Evict(const EvictionPlan& plan, std::vector<int64_t>* evicted);
  /*! \brief Evict for a non-resident adapter (throws like PlanEviction) and give it its pages. */
  void PageIn(int64_t adapter, const std::vector<int64_t>& keep, const std::string& what,
              std::vector<int64_t>* evicted, const std::vector<int32_t>& protect = {});
  /*! \brief Give a non-resident adapter pages from the free list (counts a page-in). */
  void TakeAdapterPages(Adapter* a);

  // prefix cache
  static uint64_t BlockHash(uint64_t parent, const int32_t* tokens, int32_t n);
  /*! \brief The keyed pages of LookupPrefix, in chain order. */
  std::vector<int32_t> MatchPrefix(int64_t adapter, const std::vector<int32_t>& tokens) const;
  /*! \brief A keyed page the last sequence let go of: idle, evictable. */
  void IdleCachedPage(int32_t page);
  /*! \brief Unkey a page (a leaf of its chain or one whose whole chain goes): freed if idle. */
  void UncachePage(int32_t page);
  /*! \brief Unkey every page of `adapter` (it is removed: a new adapter never reuses its KV). */
  void DropCachedPrefixes(int64_t adapter);
  void EraseAdapter(int64_t adapter);
  void CheckPrefixCache() const;
  std::tuple<uint64_t, int32_t, int32_t> IdleKey(int32_t page) const {
    const CachedPage& c = cache_.at(page);
    return {c.last_use, -c.depth, page};  // oldest first; a chain's tail before its head
  }

  int32_t num_pages_, page_size_;
  std::vector<int32_t> free_;      // LIFO stack of free page ids
  std::vector<Owner> owner_;       // per page
  int64_t owned_[4] = {0, 0, 0, 0};  // pages per owner tag (Stats stays O(adapters))
  std::vector<int32_t> kv_refs_;   // per page: sequences holding it (KV pages only)
  std::unordered_map<int64_t, Seq> seqs_;
  std::unordered_map<int64_t, Adapter> adapters_;
  uint64_t clock_ = 0;
  int64_t evictions_ = 0, page_ins_ = 0;
  // prefix cache
  std::unordered_map<int32_t, CachedPage> cache_;                  // keyed page -> its key
  std::unordered_map<CacheKey, int32_t, CacheKeyHash> cache_index_;  // key -> page
  std::set<std::tuple<uint64_t, int32_t, int32_t>> idle_cache_;    // IdleKey of idle keyed pages
  int64_t prefix_queries_ = 0, prefix_query_tokens_ = 0, prefix_hit_tokens_ = 0,
          cached_evictions_ = 0;
};

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_PAGE_POOL_H_
