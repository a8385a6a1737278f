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
 * Every operation either succeeds or throws PoolError and leaves the state unchanged.
 */
#ifndef MLC_LORA_RUNTIME_PAGE_POOL_H_
#define MLC_LORA_RUNTIME_PAGE_POOL_H_

#include <cstdint>
#include <stdexcept>
#include <string>
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
  int64_t pinned = 0;            // pages of pinned adapters, resident or not
};

class PagePool {
 public:
  PagePool(int32_t num_pages, int32_t page_size);

  int32_t num_pages() const { return num_pages_; }
  int32_t page_size() const { return page_size_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  PoolStats Stats() const;
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
   * \brief Register an adapter of `n_pages` pages and give it pages now if free pages and idle
   * adapters allow; else it waits without pages (a busy pool never refuses a load) and is paged in
   * by the first batch that uses it, by TryPageIn or by PinAdapter. Returns whether it is resident.
   */
  bool AddAdapter(int64_t adapter, int32_t n_pages, bool pinned, std::vector<int64_t>* evicted);
  /*!
   * \brief Give a registered adapter without pages its pages now, evicting idle adapters that are
   * not in `keep` (least recently used first). Returns false, changing nothing, when the free pages
   * and those adapters are too few; true if it is resident afterwards. Counts as a page-in.
   */
  bool TryPageIn(int64_t adapter, const std::vector<int64_t>& keep, std::vector<int64_t>* evicted);
  /*! \brief Unload now if no sequence uses it, else when the last one lets go. */
  void RemoveAdapter(int64_t adapter);
  /*! \brief Pinning a non-resident adapter pages it in; returns true if it needs its weights. */
  bool PinAdapter(int64_t adapter, bool pinned, std::vector<int64_t>* evicted);
  bool HasAdapter(int64_t adapter) const { return adapters_.count(adapter) != 0; }
  bool AdapterResident(int64_t adapter) const { return GetAdapter(adapter).resident; }
  bool AdapterPinned(int64_t adapter) const { return GetAdapter(adapter).pinned; }
  int64_t AdapterRefs(int64_t adapter) const { return GetAdapter(adapter).refs; }
  int32_t AdapterNumPages(int64_t adapter) const { return GetAdapter(adapter).n_pages; }
  const std::vector<int32_t>& AdapterPages(int64_t adapter) const {
    return GetAdapter(adapter).pages;
  }

  /*! \brief Recount every page from the owners; throws std::logic_error on any inconsistency. */
  void CheckInvariants() const;

 private:
  struct Seq {
    std::vector<int32_t> pages;
    int64_t length = 0;
    int64_t adapter = -1;
  };
  struct Adapter {
    int32_t n_pages = 0;
    std::vector<int32_t> pages;  // empty while evicted
    bool resident = false;
    bool pinned = false;
    bool unloading = false;
    int64_t refs = 0;
    uint64_t last_use = 0;
  };
  enum class Owner : int8_t { kFree, kKV, kAdapter };

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
  /*! \brief Adapters to evict (LRU first) to get `need` free pages; throws if impossible. */
  std::vector<int64_t> PlanEviction(int64_t need, const std::vector<int64_t>& keep,
                                    const std::string& what) const;
  void Evict(const std::vector<int64_t>& victims, std::vector<int64_t>* evicted);

  int32_t num_pages_, page_size_;
  std::vector<int32_t> free_;      // LIFO stack of free page ids
  std::vector<Owner> owner_;       // per page
  std::vector<int32_t> kv_refs_;   // per page: sequences holding it (KV pages only)
  std::unordered_map<int64_t, Seq> seqs_;
  std::unordered_map<int64_t, Adapter> adapters_;
  uint64_t clock_ = 0;
  int64_t evictions_ = 0, page_ins_ = 0;
};

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_PAGE_POOL_H_
