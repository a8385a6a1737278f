// Unit tests of mlc_lora::PagePool, the TVM-free bookkeeping of the unified page pool (ctest).
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "page_pool.h"

using mlc_lora::PagePool;
using mlc_lora::PoolError;

static int failures = 0;
#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                        \
    }                                                                    \
  } while (0)

// Expect `f` to throw PoolError of `kind` whose message contains `needle`, and the pool unchanged.
static void ExpectError(PagePool& pool, PoolError::Kind kind, const std::string& needle,
                        const std::function<void()>& f, int line) {
  auto before = pool.Stats();
  try {
    f();
    std::fprintf(stderr, "line %d: expected an error containing '%s'\n", line, needle.c_str());
    ++failures;
  } catch (const PoolError& e) {
    if (e.kind != kind || std::string(e.what()).find(needle) == std::string::npos) {
      std::fprintf(stderr, "line %d: wrong error: %s\n", line, e.what());
      ++failures;
    }
  }
  auto after = pool.Stats();
  if (before.free != after.free || before.kv != after.kv || before.adapter != after.adapter) {
    std::fprintf(stderr, "line %d: a failed operation changed the pool\n", line);
    ++failures;
  }
  pool.CheckInvariants();
}
#define EXPECT_ERROR(pool, kind, needle, stmt) \
  ExpectError(pool, PoolError::kind, needle, [&] { stmt; }, __LINE__)

static void TestSequences() {
  PagePool pool(10, 16);
  CHECK(pool.num_free() == 10);
  pool.AddSequence(0);
  auto r = pool.ReserveAppend({0}, {20});
  CHECK(r.copies.empty());
  CHECK((pool.SequencePages(0) == std::vector<int32_t>{0, 1}));  // LIFO: page 0 first
  CHECK(pool.Stats().kv == 2);
  // Fork at the end shares both pages, the second only partly filled.
  pool.ForkSequence(0, 1, -1);
  CHECK(pool.num_free() == 8);
  CHECK(pool.SequencePages(1) == pool.SequencePages(0));
  // The first to append copies the shared partial page (4 tokens) ...
  r = pool.ReserveAppend({1, 0}, {1, 1});
  CHECK(r.copies.size() == 1);
  CHECK(r.copies[0].src == 1 && r.copies[0].len == 4);
  CHECK(pool.SequencePages(1)[1] == r.copies[0].dst);
  // ... the second then owns the original alone and appends in place.
  CHECK(pool.SequencePages(0)[1] == 1);
  CHECK(pool.num_free() == 7);
  // Fork inside the first page, at a boundary, and at 0.
  pool.ForkSequence(0, 2, 5);
  pool.ForkSequence(0, 3, 16);
  pool.ForkSequence(0, 4, 0);
  CHECK(pool.SequenceLength(2) == 5 && pool.SequencePages(2).size() == 1);
  CHECK(pool.SequencePages(4).empty());
  pool.CheckInvariants();
  // popn frees pages that become empty; removing the parent keeps what children share.
  pool.PopN(0, 5);  // 21 -> 16: page 1 is released
  CHECK(pool.SequencePages(0).size() == 1);
  CHECK(pool.num_free() == 8);
  pool.RemoveSequence(0);
  CHECK(pool.num_free() == 8);  // page 0 is still held by 2 and 3
  pool.RemoveSequence(2);
  pool.RemoveSequence(3);
  CHECK(pool.num_free() == 8);  // seq 1 holds page 0 and the copy of its partial page
  pool.CheckInvariants();
  EXPECT_ERROR(pool, kValue, "unknown sequence", pool.RemoveSequence(42));
  EXPECT_ERROR(pool, kValue, "already exists", pool.AddSequence(1));
  EXPECT_ERROR(pool, kValue, "outside", pool.ForkSequence(1, 9, 100));
  EXPECT_ERROR(pool, kValue, "cannot pop", pool.PopN(1, 100));
  EXPECT_ERROR(pool, kValue, "twice", pool.ReserveAppend({1, 1}, {1, 1}));
  EXPECT_ERROR(pool, kExhausted, "exhausted", pool.ReserveAppend({1, 4}, {200, 1}));
  pool.Clear();
  CHECK(pool.num_free() == 10);
}

static void TestAdapters() {
  PagePool pool(10, 16);
  std::vector<int64_t> ev;
  pool.AddAdapter(7, 3, /*pinned=*/false, &ev);
  CHECK(pool.num_free() == 7 && pool.Stats().adapter == 3);
  EXPECT_ERROR(pool, kValue, "whole pool has only 10", pool.AddAdapter(8, 11, false, &ev));
  EXPECT_ERROR(pool, kValue, "already loaded", pool.AddAdapter(7, 1, false, &ev));
  pool.AddAdapter(8, 2, /*pinned=*/true, &ev);
  pool.AddAdapter(9, 2, false, &ev);
  CHECK(pool.num_free() == 3);
  // KV needs 4 pages: the least recently used idle unpinned adapter (7) goes first.
  pool.AddSequence(0);
  auto r = pool.ReserveAppend({0}, {4 * 16});
  CHECK((r.evicted == std::vector<int64_t>{7}));
  CHECK(!pool.AdapterResident(7) && pool.AdapterResident(8) && pool.AdapterResident(9));
  CHECK(pool.num_free() == 2);
  // A sequence on adapter 7 enters a batch: 7 is paged back in, evicting 9 (idle, unpinned).
  pool.AddSequence(1);
  pool.SetSequenceAdapter(1, 7);
  CHECK(pool.AdapterRefs(7) == 1);
  r = pool.ReserveAppend({1}, {1});
  CHECK((r.paged_in == std::vector<int64_t>{7}));
  CHECK((r.evicted == std::vector<int64_t>{9}));
  CHECK(pool.num_free() == 0);
  // Everything left is KV, pinned (8) or in use (7): a clear error, nothing changed.
  EXPECT_ERROR(pool, kExhausted, "exhausted", pool.ReserveAppend({0}, {16}));
  EXPECT_ERROR(pool, kExhausted, "exhausted", pool.PinAdapter(9, true, &ev));
  // Unload while in use is deferred; the pages come back when the last user lets go.
  pool.RemoveAdapter(7);
  CHECK(pool.HasAdapter(7) && pool.AdapterResident(7));
  EXPECT_ERROR(pool, kValue, "being unloaded", pool.SetSequenceAdapter(0, 7));
  pool.ForkSequence(1, 2, -1);  // the child inherits the adapter
  CHECK(pool.AdapterRefs(7) == 2);
  pool.RemoveSequence(1);
  CHECK(pool.HasAdapter(7));
  pool.SetSequenceAdapter(2, -1);
  CHECK(!pool.HasAdapter(7));
  CHECK(pool.num_free() == 3);
  // Unpin 8 and pin 9 (not resident): 9 is paged in, taking two of the free pages.
  pool.PinAdapter(8, false, &ev);
  CHECK(pool.PinAdapter(9, true, &ev));
  CHECK(pool.num_free() == 1);
  auto s = pool.Stats();
  CHECK(s.free + s.kv + s.adapter == s.total);
  CHECK(s.evictable == 2 && s.resident_adapters == 2 && s.loaded_adapters == 2);
  // 7 and 9 were evicted once each and paged back in once each; the refused pin counted nothing.
  CHECK(s.evictions == 2 && s.page_ins == 2);
  EXPECT_ERROR(pool, kValue, "unknown adapter", pool.SetSequenceAdapter(0, 123));
  EXPECT_ERROR(pool, kValue, "unknown adapter", pool.RemoveAdapter(123));
  pool.CheckInvariants();
}

// A load while sequences hold the pool registers the adapter without pages; it is paged in by
// TryPageIn once pages come free (never evicting what `keep` names) or by the first batch using it.
static void TestLoadOnBusyPool() {
  PagePool pool(10, 16);
  std::vector<int64_t> ev;
  CHECK(pool.AddAdapter(1, 2, /*pinned=*/false, &ev));
  pool.AddSequence(0);
  pool.ReserveAppend({0}, {7 * 16});  // KV holds 7 pages, adapter 1 two, one is free
  CHECK(pool.num_free() == 1 && pool.AdapterResident(1));
  // 1 free + 2 of the idle adapter 1 < 4: the loads succeed without pages, a pinned one too.
  CHECK(!pool.AddAdapter(2, 4, /*pinned=*/false, &ev));
  CHECK(!pool.AddAdapter(3, 4, /*pinned=*/true, &ev));
  CHECK(pool.HasAdapter(2) && !pool.AdapterResident(2) && pool.AdapterResident(1));
  auto s = pool.Stats();
  CHECK(s.pinned == 4 && s.loaded_adapters == 3 && s.resident_adapters == 1);
  CHECK(s.page_ins == 0 && s.evictions == 0 && ev.empty());
  pool.CheckInvariants();
  // KV shrinks: 2 free + 2 of adapter 1 give adapter 2 its pages, unless adapter 1 is kept.
  pool.PopN(0, 16);
  CHECK(!pool.TryPageIn(2, {1}, &ev));
  CHECK(!pool.AdapterResident(2) && pool.AdapterResident(1) && pool.num_free() == 2);
  CHECK(pool.TryPageIn(2, {}, &ev));
  CHECK(ev == std::vector<int64_t>{1});
  CHECK(pool.AdapterResident(2) && !pool.AdapterResident(1) && pool.num_free() == 0);
  CHECK(pool.TryPageIn(2, {}, &ev));  // resident already: nothing changes
  CHECK(pool.Stats().page_ins == 1 && pool.Stats().evictions == 1);
  // The sequence ends: the pinned adapter 3 is paged in by the first batch that uses it.
  pool.RemoveSequence(0);
  pool.AddSequence(5);
  pool.SetSequenceAdapter(5, 3);
  auto r = pool.ReserveAppend({5}, {1});
  CHECK(r.paged_in == std::vector<int64_t>{3});
  CHECK(pool.AdapterResident(3) && pool.num_free() == 10 - 4 - 4 - 1);
  CHECK(pool.Stats().page_ins == 2);
  EXPECT_ERROR(pool, kValue, "unknown adapter", pool.TryPageIn(42, {}, &ev));
  pool.RemoveAdapter(2);
  EXPECT_ERROR(pool, kValue, "whole pool has only 10", pool.AddAdapter(8, 11, false, &ev));
  pool.CheckInvariants();
}

// Random operations; the invariants (one owner per page, free+kv+adapter=total, refcounts) after
// each one, and no state change when an operation fails.
static void TestRandom() {
  std::mt19937 rng(12345);
  PagePool pool(40, 16);
  std::vector<int64_t> ev;
  auto pick = [&](int n) { return static_cast<int64_t>(rng() % n); };
  int ok = 0, failed = 0;
  for (int step = 0; step < 20000; ++step) {
    int64_t a = pick(12), b = pick(12), adapter = pick(6);
    try {
      switch (pick(10)) {
        case 0: pool.AddSequence(a); break;
        case 1: pool.RemoveSequence(a); break;
        case 2: pool.ForkSequence(a, b, pick(3) ? -1 : pick(40)); break;
        case 3: pool.PopN(a, pick(20)); break;
        case 4: pool.ReserveAppend({a, b}, {pick(40), 1}); break;
        case 5: pool.AddAdapter(adapter, 1 + pick(8), pick(4) == 0, &ev); break;
        case 6: pool.RemoveAdapter(adapter); break;
        case 7:
          if (pick(2)) {
            pool.PinAdapter(adapter, pick(2), &ev);
          } else {
            pool.TryPageIn(adapter, {pick(6)}, &ev);
          }
          break;
        case 8: pool.SetSequenceAdapter(a, pick(3) ? adapter : -1); break;
        default: pool.ReserveAppend({a}, {1 + pick(3)}); break;
      }
      ++ok;
    } catch (const PoolError&) {
      ++failed;
    }
    pool.CheckInvariants();
  }
  CHECK(ok > 5000 && failed > 1000);
}

int main() {
  for (auto* t : {TestSequences, TestAdapters, TestLoadOnBusyPool, TestRandom}) {
    try {
      t();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected exception: %s\n", e.what());
      ++failures;
    }
  }
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("page pool: all checks passed\n");
  return 0;
}
