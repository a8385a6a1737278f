// Unit tests of mlc_lora::PagePool, the TVM-free bookkeeping of the unified page pool (ctest).
#include <algorithm>
#include <cstdio>
#include <map>
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
  CHECK(pool.AdmittablePages() == 1 + 2);  // the free page and the idle unpinned adapter's
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

// The prefix cache: full pages keyed by (adapter, token chain), reused by the same adapter only.
static void TestPrefixCache() {
  PagePool pool(24, 4);
  std::vector<int64_t> ev;
  pool.AddAdapter(1, 2, false, &ev);
  pool.AddAdapter(2, 2, false, &ev);
  std::vector<int32_t> prompt;
  for (int32_t t = 0; t < 14; ++t) prompt.push_back(100 + t);  // 3 full pages + 2 tokens
  // adapter 1 computes the prompt and keys its 3 full pages
  pool.AddSequence(0);
  pool.SetSequenceAdapter(0, 1);
  CHECK(pool.AttachPrefix(0, prompt) == 0);
  pool.ReserveAppend({0}, {14});
  CHECK(pool.InsertPrefix(0, 0, prompt) == 3);
  std::vector<int32_t> keyed(pool.SequencePages(0).begin(), pool.SequencePages(0).begin() + 3);
  CHECK(pool.Stats().cached == 3 && pool.Stats().cached_idle == 0);
  CHECK(pool.LookupPrefix(1, prompt).tokens == 12);
  CHECK(pool.LookupPrefix(2, prompt).tokens == 0);   // another adapter: nothing
  CHECK(pool.LookupPrefix(-1, prompt).tokens == 0);  // the base model: nothing
  // whole pages before the last token only; a changed token ends the match at its page
  CHECK(pool.LookupPrefix(1, std::vector<int32_t>(prompt.begin(), prompt.begin() + 12)).tokens == 8);
  CHECK(pool.LookupPrefix(1, std::vector<int32_t>(prompt.begin(), prompt.begin() + 13)).tokens == 12);
  std::vector<int32_t> other = prompt;
  other[5] = 7;
  CHECK(pool.LookupPrefix(1, other).tokens == 4);
  // the keyed pages outlive their sequence, idle and evictable
  pool.RemoveSequence(0);
  auto st = pool.Stats();
  CHECK(st.cached == 3 && st.cached_idle == 3 && st.kv == 0 && st.evictable == 3 + 4);
  CHECK(pool.AdmittablePages() == st.free + st.evictable);
  CHECK(st.free + st.kv + st.adapter + st.cached_idle == st.total);
  auto hit = pool.LookupPrefix(1, prompt);
  CHECK(hit.tokens == 12 && hit.idle_pages == 3);
  pool.CheckInvariants();
  // a later sequence of adapter 1 takes them and computes only the rest
  pool.AddSequence(1);
  pool.SetSequenceAdapter(1, 1);
  CHECK(pool.AttachPrefix(1, prompt) == 12);
  CHECK(pool.SequencePages(1) == keyed && pool.SequenceLength(1) == 12);
  CHECK(pool.Stats().cached_idle == 0);
  auto r = pool.ReserveAppend({1}, {2});
  CHECK(r.copies.empty() && pool.SequencePages(1).size() == 4);
  // adapter 2 and the base model with the same prompt: their own pages, never adapter 1's
  for (int64_t seq : {2, 3}) {
    pool.AddSequence(seq);
    pool.SetSequenceAdapter(seq, seq == 2 ? 2 : -1);
    CHECK(pool.AttachPrefix(seq, prompt) == 0);
    pool.ReserveAppend({seq}, {14});
    for (int32_t p : pool.SequencePages(seq)) {
      CHECK(std::find(keyed.begin(), keyed.end(), p) == keyed.end());
    }
    CHECK(pool.InsertPrefix(seq, 0, prompt) == 3);
  }
  CHECK(pool.Stats().cached == 9);
  CHECK(pool.LookupPrefix(2, prompt).tokens == 12 && pool.LookupPrefix(-1, prompt).tokens == 12);
  // the same prefix computed twice (no attach) is keyed once: the second sequence takes the keyed
  // pages and frees its copies
  pool.AddSequence(4);
  pool.SetSequenceAdapter(4, 1);
  pool.ReserveAppend({4}, {14});
  int32_t free_before = pool.num_free();
  int32_t last = pool.SequencePages(4)[3];
  CHECK(pool.InsertPrefix(4, 0, prompt) == 3);
  CHECK(pool.num_free() == free_before + 3 && pool.Stats().cached == 9);
  CHECK((pool.SequencePages(4) == std::vector<int32_t>{keyed[0], keyed[1], keyed[2], last}));
  pool.CheckInvariants();
  pool.RemoveSequence(4);
  // keys are added page by page as a sequence grows; a prefix of it hits at once
  std::vector<int32_t> longer = prompt;
  longer.insert(longer.end(), {1, 2, 3, 4, 5, 6});  // 20 tokens: 5 pages
  CHECK(pool.InsertPrefix(1, 0, prompt) == 3);       // pages already keyed: nothing new
  pool.ReserveAppend({1}, {6});
  CHECK(pool.InsertPrefix(1, 12, std::vector<int32_t>(longer.begin() + 12, longer.end())) == 5);
  CHECK(pool.LookupPrefix(1, longer).tokens == 16);  // the last page holds the last token
  // a keyed page is never written: popping into it and appending copies it first
  pool.PopN(1, 9);  // 20 -> 11: page 2 (keyed) is partly used now
  r = pool.ReserveAppend({1}, {1});
  CHECK(r.copies.size() == 1 && r.copies[0].src == keyed[2] && r.copies[0].len == 3);
  CHECK(pool.SequencePages(1)[2] != keyed[2] && pool.PageCached(keyed[2]));
  pool.CheckInvariants();
  // a sequence moved to another adapter keys nothing more
  pool.SetSequenceAdapter(3, 1);
  pool.ReserveAppend({3}, {6});
  CHECK(pool.InsertPrefix(3, 0, longer) == -1);
  pool.CheckInvariants();
  // removing an adapter drops its keys: an adapter loaded again under the id starts cold
  CHECK(pool.Stats().cached == 3 + 2 + 3 + 3);  // adapter 1 (5 pages), 2 and the base model
  pool.RemoveSequence(2);
  pool.RemoveAdapter(2);
  CHECK(pool.Stats().cached == 8);
  CHECK(pool.LookupPrefix(2, prompt).tokens == 0);
  pool.AddAdapter(2, 2, false, &ev);
  CHECK(pool.LookupPrefix(2, prompt).tokens == 0);
  pool.CheckInvariants();
  // bad calls change nothing
  EXPECT_ERROR(pool, kValue, "empty sequence", pool.AttachPrefix(1, prompt));
  EXPECT_ERROR(pool, kValue, "not whole pages", pool.InsertPrefix(1, 2, prompt));
  EXPECT_ERROR(pool, kValue, "not whole pages", pool.InsertPrefix(1, 0, longer));
  EXPECT_ERROR(pool, kValue, "unknown sequence", pool.AttachPrefix(77, prompt));
  auto q = pool.Stats();
  CHECK(q.prefix_queries == 4 && q.prefix_hit_tokens == 12 && q.prefix_query_tokens == 4 * 14);
  pool.Clear();
  CHECK(pool.Stats().cached == 0 && pool.num_free() == 24 - 4);
  pool.CheckInvariants();
}

// Idle keyed pages and idle adapters leave by one least-recently-used order; a chain tail first.
static void TestOneEvictionPolicy() {
  PagePool pool(12, 4);
  std::vector<int64_t> ev;
  auto key = [&](int64_t seq, int64_t adapter, int32_t first, int32_t n_tokens) {
    std::vector<int32_t> t;
    for (int32_t i = 0; i < n_tokens; ++i) t.push_back(first + i);
    pool.AddSequence(seq);
    pool.SetSequenceAdapter(seq, adapter);
    pool.ReserveAppend({seq}, {n_tokens});
    CHECK(pool.InsertPrefix(seq, 0, t) == n_tokens / 4);
    std::vector<int32_t> pages = pool.SequencePages(seq);
    pool.RemoveSequence(seq);
    return pages;
  };
  auto x = key(0, -1, 0, 8);      // chain X: 2 keyed pages, used first
  pool.AddAdapter(1, 2, false, &ev);
  auto y = key(1, -1, 50, 8);     // chain Y
  pool.AddAdapter(2, 3, false, &ev);
  pool.AddAdapter(3, 1, /*pinned=*/true, &ev);
  // 12 pages: X 2, adapter 1 2, Y 2, adapter 2 3, adapter 3 1 (pinned): 2 free
  CHECK(pool.num_free() == 2 && pool.Stats().evictable == 9);
  CHECK(pool.AdmittablePages() == 2 + 9);
  pool.AddSequence(9);
  std::vector<std::string> order;
  int64_t cached_ev = 0;
  for (int step = 0; step < 9; ++step) {
    auto r = pool.ReserveAppend({9}, {4});  // one page a step
    for (int64_t a : r.evicted) order.push_back("a" + std::to_string(a));
    auto s = pool.Stats();
    for (; cached_ev < s.cached_evictions; ++cached_ev) order.push_back("p");
    pool.CheckInvariants();
  }
  // X's pages (tail then head), adapter 1, Y's pages, adapter 2; the pinned adapter stays
  CHECK((order == std::vector<std::string>{"p", "p", "a1", "p", "p", "a2"}));
  CHECK(pool.AdapterResident(3) && pool.Stats().cached == 0);
  CHECK(pool.LookupPrefix(-1, {0, 1, 2, 3, 4, 5, 6, 7, 8}).tokens == 0);
  // a keyed page a sequence holds is not evictable: an attached chain stays
  pool.Clear();
  auto z = key(0, -1, 0, 12);
  pool.AddSequence(1);
  CHECK(pool.AttachPrefix(1, {0, 1, 2, 3, 4, 5, 6, 7, 8}) == 8);  // holds 2 of the 3 keyed pages
  pool.AddSequence(2);
  // the free pages and the idle third page of the chain, no more
  int64_t room = pool.num_free() + pool.Stats().evictable;
  CHECK(pool.Stats().evictable == 1);  // the idle keyed page (adapters 1 and 2 were evicted)
  EXPECT_ERROR(pool, kExhausted, "cached prefixes", pool.ReserveAppend({2}, {4 * (room + 1)}));
  pool.ReserveAppend({2}, {4 * room});
  CHECK(pool.Stats().cached == 2 && pool.SequencePages(1) == std::vector<int32_t>(z.begin(), z.begin() + 2));
  pool.CheckInvariants();
}

// Random traffic with prefix-cache calls. Each page's simulated contents (adapter, token) are
// written where the pool says a batch appends and copied as it says: a matched prefix must hold
// exactly the tokens asked for, written under the same adapter.
static void TestRandomPrefix() {
  std::mt19937 rng(777);
  const int32_t ps = 4;
  PagePool pool(32, ps);
  std::vector<int64_t> ev;
  auto pick = [&](int n) { return static_cast<int64_t>(rng() % n); };
  using Cell = std::pair<int64_t, int32_t>;  // (adapter, token); adapter -9: adapter weights
  std::vector<std::vector<Cell>> content(32, std::vector<Cell>(ps, {-8, -1}));
  std::map<int64_t, std::vector<int32_t>> toks, pending;  // a sequence's tokens, the rest of its prompt
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
      {1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34, 35, 36},
      {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52}};
  auto paged_in = [&](int64_t id) {
    for (int32_t p : pool.AdapterPages(id)) content[p].assign(ps, {-9, -1});
  };
  int64_t hits = 0, ok = 0;
  for (int step = 0; step < 30000; ++step) {
    int64_t a = pick(8), b = pick(8), adapter = pick(4);
    try {
      switch (pick(13)) {
        case 0: pool.AddSequence(a); toks[a].clear(); pending[a].clear(); break;
        case 1: case 12: pool.RemoveSequence(a); break;
        case 2: {
          int64_t pos = pick(3) ? -1 : pick(30);
          pool.ForkSequence(a, b, pos);
          toks[b] = std::vector<int32_t>(toks[a].begin(), toks[a].begin() + pool.SequenceLength(b));
          pending[b].clear();
          break;
        }
        case 3: {
          int64_t n = pick(10);
          pool.PopN(a, n);
          toks[a].resize(pool.SequenceLength(a));
          break;
        }
        case 4: case 5: {
          int64_t n = 1 + pick(12);
          int64_t len = pool.SequenceLength(a);
          auto r = pool.ReserveAppend({a}, {n});
          for (int64_t id : r.paged_in) paged_in(id);
          for (const auto& c : r.copies) {
            CHECK(!pool.PageCached(c.dst));
            std::copy(content[c.src].begin(), content[c.src].begin() + c.len, content[c.dst].begin());
          }
          const int64_t ad = pool.SequenceAdapter(a);
          for (int64_t pos = len; pos < len + n; ++pos) {
            int32_t t;
            if (!pending[a].empty()) {
              t = pending[a].front();
              pending[a].erase(pending[a].begin());
            } else {
              t = static_cast<int32_t>(pick(3));
            }
            toks[a].push_back(t);
            int32_t page = pool.SequencePages(a)[pos / ps];
            CHECK(!pool.PageCached(page));  // keyed pages are never written
            content[page][pos % ps] = {ad, t};
          }
          break;
        }
        case 6: pool.AddAdapter(adapter, 1 + pick(8), pick(5) == 0, &ev); paged_in(adapter); break;
        case 7:
          if (pick(4) == 0) pool.RemoveAdapter(adapter);
          break;
        case 8:
          if (pick(2) ? pool.PinAdapter(adapter, pick(2), &ev) : pool.TryPageIn(adapter, {pick(4)}, &ev)) {
            paged_in(adapter);
          }
          break;
        case 9: pool.SetSequenceAdapter(a, pick(3) ? adapter : -1); break;
        case 10: {  // a new request: a shared prompt, sometimes cut, then its own tokens
          std::vector<int32_t> t = prompts[pick(3)];
          t.resize(1 + pick(static_cast<int>(t.size())));
          for (int i = pick(6); i > 0; --i) t.push_back(static_cast<int32_t>(pick(3)));
          if (pool.HasSequence(a)) pool.RemoveSequence(a);
          pool.AddSequence(a);
          toks[a].clear();
          pending[a].clear();
          pool.SetSequenceAdapter(a, pick(4) ? pick(3) : -1);
          auto before = pool.LookupPrefix(pool.SequenceAdapter(a), t);
          int64_t n = pool.AttachPrefix(a, t);
          CHECK(n == before.tokens);
          hits += n;
          const int64_t ad = pool.SequenceAdapter(a);
          for (int64_t pos = 0; pos < n; ++pos) {
            CHECK((content[pool.SequencePages(a)[pos / ps]][pos % ps] == Cell{ad, t[pos]}));
          }
          toks[a].assign(t.begin(), t.begin() + n);
          pending[a].assign(t.begin() + n, t.end());
          break;
        }
        case 11: {
          int64_t start = pick(2) ? 0 : pool.SequenceLength(a) / ps * ps;
          const std::vector<int32_t>& t = toks.at(a);
          pool.InsertPrefix(a, start, std::vector<int32_t>(t.begin() + start, t.end()));
          break;
        }
      }
      ++ok;
    } catch (const PoolError&) {
    } catch (const std::out_of_range&) {  // toks.at of a sequence never added
    }
    pool.CheckInvariants();
  }
  auto s = pool.Stats();
  std::printf("random prefix traffic: %lld ok, %lld hit tokens, %lld keyed pages evicted, %lld adapters\n",
              (long long)ok, (long long)hits, (long long)s.cached_evictions, (long long)s.evictions);
  CHECK(ok > 10000 && hits > 500 && s.cached_evictions > 100 && s.evictions > 30);
}

// Adapters loaded on a busy pool and paged in later (TryPageIn, a batch) take their pages by the
// same least-recently-used order as the loads do, over idle adapters and idle keyed pages alike.
static void TestPageInsWithPrefixCache() {
  PagePool pool(12, 4);
  std::vector<int64_t> ev;
  auto key = [&](int64_t seq, int32_t first) {  // a base-model chain of 2 keyed pages, idle
    std::vector<int32_t> t;
    for (int32_t i = 0; i < 8; ++i) t.push_back(first + i);
    pool.AddSequence(seq);
    pool.ReserveAppend({seq}, {8});
    CHECK(pool.InsertPrefix(seq, 0, t) == 2);
    pool.RemoveSequence(seq);
  };
  key(0, 0);                              // chain X, the oldest
  CHECK(pool.AddAdapter(1, 2, false, &ev));
  key(1, 50);                             // chain Y, newer than adapter 1
  pool.AddSequence(9);
  pool.ReserveAppend({9}, {24});          // 6 KV pages: nothing free, 6 evictable
  CHECK(pool.num_free() == 0 && pool.Stats().evictable == 6);
  CHECK(pool.AdmittablePages() == 6);
  // a load evicts X (tail, head), then adapter 1; Y, used later, stays
  CHECK(pool.AddAdapter(2, 4, false, &ev));
  CHECK(ev == std::vector<int64_t>{1});
  auto s = pool.Stats();
  CHECK(s.cached == 2 && s.cached_evictions == 2 && s.page_ins == 0);
  // too big for Y and the idle adapter 2: registered without pages, nothing else changes
  CHECK(!pool.AddAdapter(3, 7, false, &ev));
  CHECK(!pool.AdapterResident(3) && pool.AdapterResident(2) && pool.Stats().cached == 2);
  CHECK(!pool.TryPageIn(3, {2}, &ev));
  pool.CheckInvariants();
  // KV gone: 6 free and Y's tail page; adapter 2 kept
  pool.RemoveSequence(9);
  CHECK(pool.TryPageIn(3, {2}, &ev));
  s = pool.Stats();
  CHECK(pool.AdapterResident(2) && s.cached == 1 && s.cached_evictions == 3 && s.page_ins == 1);
  // a batch pages adapter 1 back in: Y's head (older) goes, then the idle adapter 2, not adapter 3
  pool.AddSequence(10);
  pool.SetSequenceAdapter(10, 1);
  auto r = pool.ReserveAppend({10}, {4});
  CHECK(r.paged_in == std::vector<int64_t>{1} && r.evicted == std::vector<int64_t>{2});
  s = pool.Stats();
  CHECK(s.cached == 0 && pool.AdapterResident(3) && s.page_ins == 2 && s.evictions == 2);
  pool.CheckInvariants();
}

// TryPageIn's `protect`: keyed pages (whole chains from their roots) it never evicts; it takes an
// unprotected chain instead, though more recently used, and fails, changing nothing, if only
// protected pages would make room.
static void TestPageInProtectsChains() {
  PagePool pool(8, 4);
  std::vector<int64_t> ev;
  std::vector<int32_t> x, y;
  for (int32_t i = 0; i < 8; ++i) {
    x.push_back(i);
    y.push_back(50 + i);
  }
  for (int64_t seq : {0, 1}) {
    pool.AddSequence(seq);
    pool.ReserveAppend({seq}, {8});
  }
  pool.AddSequence(9);
  pool.ReserveAppend({9}, {16});  // the rest: nothing free
  CHECK(!pool.AddAdapter(2, 2, false, &ev));  // nothing to evict: it waits without pages
  CHECK(pool.InsertPrefix(0, 0, x) == 2 && pool.InsertPrefix(1, 0, y) == 2);
  pool.RemoveSequence(0);  // x idles first: the least recently used
  pool.RemoveSequence(1);
  CHECK(pool.num_free() == 0 && pool.Stats().cached == 4);
  std::vector<int32_t> x9(x), y9(y);  // (a lookup leaves the last token out)
  x9.push_back(999);
  y9.push_back(999);
  std::vector<int32_t> px = pool.PrefixPages(-1, x9), both = px, py = pool.PrefixPages(-1, y9);
  both.insert(both.end(), py.begin(), py.end());
  CHECK(px.size() == 2 && py.size() == 2);
  CHECK(!pool.TryPageIn(2, {}, &ev, both));  // only protected pages could make room
  CHECK(!pool.AdapterResident(2) && pool.Stats().cached == 4 && pool.Stats().cached_evictions == 0);
  CHECK(pool.TryPageIn(2, {}, &ev, px));  // y goes, though x is older
  CHECK(pool.AdapterResident(2) && pool.PrefixPages(-1, x9).size() == 2 && pool.PrefixPages(-1, y9).empty());
  pool.CheckInvariants();
}

int main() {
  for (auto* t : {TestSequences, TestAdapters, TestLoadOnBusyPool, TestRandom, TestPrefixCache,
                  TestOneEvictionPolicy, TestRandomPrefix, TestPageInsWithPrefixCache,
                  TestPageInProtectsChains}) {
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
