/*!
 * \file adapter_store.h
 * \brief The adapter side of the unified pool: host copies of loaded adapters, their validation,
 *        copying their rows into the pages the PagePool gives them, and the per-batch LoRA tables.
 *
 * An adapter is loaded once as host pages [L, n, E] (the model dtype) plus local row offsets
 * a_off / b_off [M, R] (local_page * E + offset in page, -1 unused), its rank and its per-module
 * scale [M] (what `mlc_lora.runtime.pack_adapter` / `pack_peft_adapter` produce). A load never
 * waits for pages: the adapter gets them at once if the pool has room, else when a batch, a pin or
 * a prefetch needs it (PagePool::AddAdapter). The host copy of its pages is the host tier: an
 * adapter evicted for KV is paged back in from it without the caller. The caller may drop the host
 * pages of an adapter without pages (DropHost: the host tier's budget) and hand them back later
 * (SetHost); the small tables (rank, scale, offsets) stay. A batch or pin that would page in an
 * adapter without host pages is refused before anything changes. Each batch's tables (docs/DESIGN.md) map every token to a slot (its sequence's adapter,
 * -1 for the base model) and every slot to its rank, scales and global row offsets in a layer
 * region of the arena; they live in fixed-address device buffers of the maximum size, and
 * `tables()` returns this batch's prefix views [arena, token_slot, rank, scale, a_off, b_off].
 */
#ifndef MLC_LORA_RUNTIME_ADAPTER_STORE_H_
#define MLC_LORA_RUNTIME_ADAPTER_STORE_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/runtime/tensor.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "page_pool.h"

namespace mlc_lora {

/*! \brief The arena the adapters' rows live in: L layer regions of P pages of E elements. */
struct ArenaGeometry {
  int64_t num_layers, num_pages, page_elems;
  int64_t max_batch, max_tokens;  // table sizes: one slot per sequence, one entry per token
  DLDataType dtype;
  DLDevice device;
};

class AdapterStore {
 public:
  AdapterStore(PagePool* pool, tvm::runtime::Tensor arena, ArenaGeometry geometry)
      : pool_(pool), arena_(std::move(arena)), g_(geometry) {}
  ~AdapterStore();
  AdapterStore(const AdapterStore&) = delete;
  AdapterStore& operator=(const AdapterStore&) = delete;

  /*! \brief Once, before any adapter: M modules, compiled maximum rank R (table shapes). */
  void Configure(int64_t num_modules, int64_t max_rank);
  /*!
   * \brief Keep the slots of batches that fit `rank_columns` over `slot_columns` adapters in a fixed
   *  column order (a library whose weights hold the batch's B rows in spare columns: the rank
   *  columns route). Such a batch's slots are the kept adapters, in the order they were first
   *  kept, absent ones included: an adapter's rank columns stay where they are while it stays
   *  resident, so the columns need filling again only when the kept set changes
   *  (columns_generation()). Adapters come in at the end while their ranks fit; else the kept
   *  set becomes the batch's (the kept ones it uses, in order, then the others). Adapters that
   *  stop being resident, or are unloaded or loaded again, leave it. 0, 0: off (slots in order
   *  of first use by the batch's sequences).
   */
  void KeepColumns(int64_t rank_columns, int64_t slot_columns);
  /*! \brief Counts the changes of the kept columns (KeepColumns): the spare columns hold the
   *  B rows of the kept adapters as of the generation they were last filled for. */
  int64_t columns_generation() const { return columns_generation_; }
  bool configured() const { return configured_; }
  /*! \brief Throws unless Configure was called. */
  void CheckConfigured() const;

  /*! \brief Validate and keep a host copy; if the pool has room (free pages and idle adapters),
   *  take pages and copy the rows in. Returns whether the adapter is resident. */
  bool Load(int64_t id, tvm::ffi::TensorView pages, tvm::ffi::TensorView a_off,
            tvm::ffi::TensorView b_off, int64_t rank, tvm::ffi::TensorView scale, bool pin);
  /*! \brief Hand back the host pages of a loaded adapter that has none (DropHost): the same
   *  packing as its load (rank, offsets and scale must match). */
  void SetHost(int64_t id, tvm::ffi::TensorView pages, tvm::ffi::TensorView a_off,
               tvm::ffi::TensorView b_off, int64_t rank, tvm::ffi::TensorView scale);
  /*! \brief Drop the host pages of a loaded adapter that holds no pool pages. */
  void DropHost(int64_t id);
  /*! \brief Page in a loaded adapter ahead of its batch if free pages, idle adapters not in
   *  `keep` and idle cached prefix pages allow (PagePool::TryPageIn), never evicting the cached
   *  prefixes of `protect` ((adapter, tokens) of waiting requests: they would hit them), and copy
   *  its rows in; whether it is resident now. */
  bool Prefetch(int64_t id, const std::vector<int64_t>& keep,
                const std::vector<std::pair<int64_t, std::vector<int32_t>>>& protect = {});
  /*! \brief Throws ValueError if a batch of `seqs` would page in an adapter without host pages. */
  void CheckPageIns(const std::vector<int64_t>& seqs) const;
  /*! \brief The ids of the loaded adapters that hold their pages. */
  std::vector<int64_t> Resident() const;
  void Unload(int64_t id);
  void Pin(int64_t id, bool pin);
  void SetSequenceAdapter(int64_t seq, int64_t adapter);

  /*! \brief Copy adapter `id`'s host rows into the pages the pool gave it (every layer). On a
   *  GPU the copies run on the store's copy stream from the pinned host pages and the caller does
   *  not wait for them: the copy stream first waits for the work queued on the compute stream (the
   *  pages may have held KV or another adapter it reads), and the compute stream then waits for
   *  the copies (every later kernel, the one that reads the adapter or writes the pages, sees
   *  them), as TVM's paged KV cache orders its auxiliary copies. */
  void CopyIn(int64_t id);
  /*! \brief Forget the host copies of adapters the pool no longer has. */
  void DropUnloaded();
  /*! \brief The tables of a batch of `seqs` appending `lens` tokens each (`tokens` in all). */
  void BuildTables(const std::vector<int64_t>& seqs, const std::vector<int64_t>& lens,
                   int64_t tokens);
  /*! \brief The tables of the last BuildTables, in contract.LORA_TABLE_INPUTS order: [arena,
   *  token_slot, rank, scale, a_off, b_off, token_order, slot_start], the slot tables (slot_start:
   *  its S + 1 entries) at the batch's S slots (the kernels may pick their tiles by tokens per
   *  slot where the slot count is the batch's). Those of a batch without
   *  adapters (one inert slot) are built on first use: such batches mostly run the base functions,
   *  which read none, and the uploads are most of a batch's table cost. */
  tvm::ffi::Array<tvm::runtime::Tensor> tables() const;
  /*! \brief The same tables with the slot tables at the maximum slot count: the same device
   *  addresses and shapes at every batch, for a decode captured in CUDA graphs. Rows past the
   *  batch's slots hold earlier batches' slots (zeros before any), which no token uses;
   *  slot_start's entries past them hold the batch's token count (those slots have none). */
  tvm::ffi::Array<tvm::runtime::Tensor> graph_tables() const;
  /*! \brief Distinct adapters of the last BuildTables (0: every token is on the base model). */
  int64_t num_slots() const { return num_slots_; }
  /*! \brief The sum of the ranks of those adapters. */
  int64_t rank_total() const { return rank_total_; }

  tvm::ffi::Map<tvm::ffi::String, tvm::ffi::Any> Info(int64_t id) const;
  /*! \brief For each adapter, the pages a batch must find for it: none if it is resident and kept
   *  (pinned, or held by a sequence), else all of its pages (an idle resident one stops being
   *  evictable). One call for a whole batch's adapters: the scheduler's per-step question. */
  std::vector<int64_t> PagesToRun(const std::vector<int64_t>& ids) const;
  /*! \brief Every host copy belongs to an adapter the pool has; throws InternalError if not. */
  void CheckInvariants() const;

 private:
  struct HostAdapter {
    tvm::runtime::Tensor pages;  // [L, n, E] on the host (pinned where the device has pinned
                                 // memory); undefined after DropHost
    int32_t n_pages, rank;
    std::vector<int32_t> a_off, b_off;  // [M, R], local to the adapter's n*E region
    std::vector<float> scale;           // [M]
    // a_off / b_off placed in the arena (offsets in a layer's region) for the pages they were
    // placed on: built again when the adapter's pages differ (a batch's tables copy them)
    mutable std::vector<int32_t> placed_pages, a_placed, b_placed;
  };

  /*! \brief The slots of a batch using adapters `used` (in order of first use) that fits the
   *  kept columns' limits: the kept adapters, updated (KeepColumns). */
  const std::vector<int64_t>& KeptColumns(const std::vector<int64_t>& used);
  /*! \brief Adapter `id` leaves the kept columns (its rows changed or went away). */
  void ForgetColumns(int64_t id);
  /*! \brief Write the batch's tables (slot i: adapter slots[i]) to the device: tables_. */
  void Upload(const std::vector<int64_t>& slots, const std::vector<int32_t>& token_slot,
              int64_t tokens) const;
  HostAdapter Validate(int64_t id, tvm::ffi::TensorView pages, tvm::ffi::TensorView a_off,
                       tvm::ffi::TensorView b_off, int64_t rank, tvm::ffi::TensorView scale) const;
  const HostAdapter& Get(int64_t id) const;
  /*! \brief Throws ValueError unless adapter `id` has host pages (`what` would page it in). */
  void CheckHost(int64_t id, const char* what) const;
  /*! \brief Before host pages are freed: wait for the copies still reading them, if `id`'s
   *  (-1: any adapter's) may be among them. */
  void FinishCopies(int64_t id = -1);

  PagePool* pool_;
  tvm::runtime::Tensor arena_;  // (L*P*E,)
  ArenaGeometry g_;
  bool configured_ = false;
  int64_t M_ = 0, R_ = 0;
  // Fixed-address tables at maximum size; tables_ holds this batch's prefix views.
  // token_order (max_tokens,) and slot_start (max_batch + 1,) sort the batch's tokens by slot;
  // slot_start always has every entry (slots past the batch's own no tokens).
  tvm::runtime::Tensor slot_, rank_, scale_, a_, b_, order_, start_;
  int64_t num_slots_ = 0, rank_total_ = 0;
  int64_t keep_rank_columns_ = 0, keep_slot_columns_ = 0;  // KeepColumns' limits (0: off)
  std::vector<int64_t> kept_;                              // the kept adapters, in column order
  int64_t columns_generation_ = 0;
  mutable tvm::ffi::Array<tvm::runtime::Tensor> tables_;
  mutable std::vector<int32_t> a_host_, b_host_;  // the a_off / b_off tables on the host (Upload)
  mutable int64_t inert_tokens_ = -1;  // >= 0: the tokens of a batch without adapters, tables not built
  std::unordered_map<int64_t, HostAdapter> host_;
  void* copy_stream_ = nullptr;                   // GPU: the page-in copies' stream (made on first use)
  std::unordered_set<int64_t> copying_;          // adapters copied in since copy_stream_'s last sync
};

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_ADAPTER_STORE_H_
