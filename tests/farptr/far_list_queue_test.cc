// far_list and far_queue against real daemons: seeded random operation sequences checked step by
// step against std::list / std::queue, containers several times larger than the local budget
// (the runtime's counters show chunks were evicted and swapped back in), and the standard
// algorithms on bidirectional far_list iterators over swapped-out chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <list>
#include <numeric>
#include <ostream>
#include <queue>
#include <random>
#include <ranges>
#include <utility>
#include <vector>

#include "farmem/far_list.h"
#include "farmem/far_queue.h"
#include "farptr_fixture.h"

namespace farmem::farptr_test {
namespace {

// 64 bytes: 64 to a 4 KiB chunk, so a few thousand elements span many chunks and spans.
struct Item {
  uint64_t key;
  uint64_t pad[7];
  bool operator==(const Item& o) const { return key == o.key && pad[6] == o.pad[6]; }
  friend void PrintTo(const Item& i, std::ostream* os) { *os << "Item{" << i.key << "}"; }
};
Item MakeItem(uint64_t k) { return Item{k, {0, 0, 0, 0, 0, 0, k * 31 + 7}}; }

using List = far_list<uint64_t>;
using ItemList = far_list<Item>;

// --- The concepts, at compile time. ---
static_assert(std::bidirectional_iterator<List::iterator>);
static_assert(std::bidirectional_iterator<List::const_iterator>);
static_assert(std::bidirectional_iterator<ItemList::iterator>);
static_assert(!std::random_access_iterator<List::iterator>);
static_assert(std::output_iterator<List::iterator, uint64_t>);
static_assert(std::indirectly_swappable<List::iterator>);
static_assert(std::ranges::bidirectional_range<List>);
static_assert(std::ranges::bidirectional_range<const List>);
static_assert(std::ranges::common_range<List>);
static_assert(std::ranges::sized_range<List>);
static_assert(std::same_as<std::iter_value_t<List::iterator>, uint64_t>);
static_assert(std::same_as<std::iter_reference_t<List::const_iterator>, uint64_t>);
static_assert(std::convertible_to<List::iterator, List::const_iterator>);
static_assert(std::is_nothrow_move_constructible_v<List>);
static_assert(std::is_move_assignable_v<List> && !std::is_copy_constructible_v<List>);
static_assert(std::is_move_constructible_v<far_queue<Item>> &&
              !std::is_copy_constructible_v<far_queue<Item>>);

// Compares the whole list with its model, forwards and backwards.
void ExpectSame(const ItemList& l, const std::list<Item>& model, const char* when) {
  ASSERT_EQ(l.size(), model.size()) << when;
  ASSERT_EQ(static_cast<size_t>(std::distance(l.begin(), l.end())), model.size()) << when;
  ASSERT_TRUE(std::equal(l.begin(), l.end(), model.begin(), model.end())) << when;
  ASSERT_TRUE(std::equal(l.rbegin(), l.rend(), model.rbegin(), model.rend())) << when;
}

TEST_F(FarptrTest, FarListMatchesStdListUnderRandomOps) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  // 64 KiB of local memory (4 spans of 16 KiB) for a list that grows to a few hundred KiB.
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 64 << 10)));
  const RuntimeStats before = rt_->stats();
  // TSan: a quarter of the operations, so the list still outgrows the budget.
  constexpr int kOps = 30000 / (kTsanScale > 1 ? 4 : 1);
  std::mt19937_64 rng(42);
  ItemList l(*rt_);
  std::list<Item> model;
  uint64_t next = 0;
  size_t peak = 0;
  // A random position in [0, size] (size: end) in both lists.
  auto pick = [&](bool allow_end) {
    const size_t n = model.size() + (allow_end ? 1 : 0);
    const size_t k = static_cast<size_t>(rng() % n);
    return std::pair{std::next(l.begin(), static_cast<std::ptrdiff_t>(k)),
                     std::next(model.begin(), static_cast<std::ptrdiff_t>(k))};
  };
  for (int op = 0; op < kOps; ++op) {
    const int r = static_cast<int>(rng() % 20);
    if (model.empty() && r >= 7) continue;
    if (r < 4) {
      l.push_back(MakeItem(next));
      model.push_back(MakeItem(next++));
    } else if (r < 7) {
      l.push_front(MakeItem(next));
      model.push_front(MakeItem(next++));
    } else if (r < 9) {
      l.pop_front();
      model.pop_front();
    } else if (r < 11) {
      l.pop_back();
      model.pop_back();
    } else if (r < 14) {
      auto [fit, mit] = pick(true);
      auto fr = l.insert(fit, MakeItem(next));
      auto mr = model.insert(mit, MakeItem(next++));
      ASSERT_EQ(Item(*fr), *mr) << "op " << op;
      ASSERT_EQ(std::distance(l.begin(), fr), std::distance(model.begin(), mr)) << "op " << op;
    } else if (r < 16) {
      auto [fit, mit] = pick(false);
      auto fr = l.erase(fit);
      auto mr = model.erase(mit);
      ASSERT_EQ(fr == l.end(), mr == model.end()) << "op " << op;
      if (mr != model.end()) {
        ASSERT_EQ(Item(*fr), *mr) << "op " << op;
      }
    } else if (r < 18) {
      auto [fit, mit] = pick(false);
      *fit = MakeItem(next);  // through the proxy
      *mit = MakeItem(next++);
    } else if (r < 19) {
      auto [fit, mit] = pick(true);
      const std::vector<Item> add = {MakeItem(next), MakeItem(next + 1), MakeItem(next + 2)};
      next += 3;
      auto fr = l.insert(fit, add.begin(), add.end());
      auto mr = model.insert(mit, add.begin(), add.end());
      ASSERT_EQ(Item(*fr), *mr) << "op " << op;
    } else {
      auto [fit, mit] = pick(false);
      const auto n = std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(rng() % 5),
                                              std::distance(mit, model.end()));
      auto fr = l.erase(fit, std::next(fit, n));
      auto mr = model.erase(mit, std::next(mit, n));
      ASSERT_EQ(fr == l.end(), mr == model.end()) << "op " << op;
      if (mr != model.end()) {
        ASSERT_EQ(Item(*fr), *mr) << "op " << op;
      }
    }
    ASSERT_EQ(l.size(), model.size()) << "op " << op;
    peak = std::max(peak, model.size());
    if (!model.empty()) {
      ASSERT_EQ(Item(l.front()), model.front()) << "op " << op;
      ASSERT_EQ(Item(l.back()), model.back()) << "op " << op;
    }
    if (op % 1000 == 999) {
      ASSERT_NO_FATAL_FAILURE(ExpectSame(l, model, "periodic check"));
      // Everything out: the next operations find their chunks remote.
      if (op % 5000 == 4999) {
        ASSERT_TRUE(rt_->EvictUntil(0).ok());
      }
    }
  }
  ASSERT_NO_FATAL_FAILURE(ExpectSame(l, model, "end"));
  EXPECT_GT(peak * sizeof(Item), 64u << 10) << "the list outgrew the budget";
  // No chunk is empty, and the chunks stay reasonably full despite the middle inserts/erases.
  EXPECT_LE(l.chunk_count(), model.size());
  const RuntimeStats after = rt_->stats();
  std::printf("random ops: %zu elements in %zu chunks; spans evicted %lu, swap-ins %lu\n", l.size(),
              l.chunk_count(), after.spans_evicted - before.spans_evicted,
              after.swap_ins - before.swap_ins);
  EXPECT_GT(after.spans_evicted, before.spans_evicted);
  EXPECT_GT(after.swap_ins, before.swap_ins);

  // Moves, remove_if, clear.
  ItemList moved(std::move(l));
  EXPECT_TRUE(l.empty());  // NOLINT(bugprone-use-after-move): specified to be empty
  EXPECT_EQ(l.begin(), l.end());
  ASSERT_NO_FATAL_FAILURE(ExpectSame(moved, model, "moved"));
  const auto odd = [](const Item& x) { return x.key % 2 == 1; };
  EXPECT_EQ(erase_if(moved, odd), std::erase_if(model, odd));
  ASSERT_NO_FATAL_FAILURE(ExpectSame(moved, model, "erase_if"));
  moved.clear();
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(moved.chunk_count(), 0u);
  l.push_back(MakeItem(1));
  EXPECT_EQ(l.front().get().key, 1u);
}

TEST_F(FarptrTest, FarListLargerThanBudgetRunsStandardAlgorithms) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 64 << 10)));
  constexpr size_t kN = (128u << 10) / kTsanScale;  // 1 MiB of uint64_t (TSan: 128 KiB)
  std::mt19937_64 rng(7);
  std::vector<uint64_t> model;
  List l(*rt_);
  const uint64_t evicted_before = rt_->stats().spans_evicted;
  // Built from both ends: the front half in reverse.
  std::vector<uint64_t> back_half, front_half;
  for (size_t i = 0; i < kN / 2; ++i) back_half.push_back(rng() % 1'000'000);
  for (size_t i = 0; i < kN / 2; ++i) front_half.push_back(rng() % 1'000'000);
  for (uint64_t x : back_half) l.push_back(x);
  for (uint64_t x : front_half) l.push_front(x);
  model.assign(front_half.rbegin(), front_half.rend());
  model.insert(model.end(), back_half.begin(), back_half.end());
  ASSERT_EQ(l.size(), kN);
  // The ends never split a chunk: every chunk but the two ends' is full.
  EXPECT_LE(l.chunk_count(), kN / List::kPerChunk + 2);
  // The list is 8 (TSan: 2) times the budget: building it alone made the evictor work.
  EXPECT_GT(rt_->stats().spans_evicted, evicted_before);

  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const uint64_t swap_ins = rt_->stats().swap_ins;
  const uint64_t sum = std::accumulate(model.begin(), model.end(), uint64_t{0});
  EXPECT_EQ(std::accumulate(l.begin(), l.end(), uint64_t{0}), sum);
  EXPECT_GT(rt_->stats().swap_ins, swap_ins);

  auto pred = [](uint64_t x) { return x % 1000 == 7; };
  EXPECT_EQ(std::distance(l.cbegin(), std::find_if(l.cbegin(), l.cend(), pred)),
            std::find_if(model.begin(), model.end(), pred) - model.begin());
  EXPECT_EQ(std::ranges::count_if(l, pred), std::ranges::count_if(model, pred));
  EXPECT_EQ(std::ranges::distance(l), static_cast<std::ptrdiff_t>(kN));
  EXPECT_EQ(*std::ranges::max_element(l), *std::ranges::max_element(model));
  uint64_t for_each_sum = 0;
  std::ranges::for_each(l, [&](uint64_t x) { for_each_sum += x; });
  EXPECT_EQ(for_each_sum, sum);
  uint64_t range_for_sum = 0;
  for (uint64_t x : l) range_for_sum += x;
  EXPECT_EQ(range_for_sum, sum);
  EXPECT_TRUE(std::equal(l.rbegin(), l.rend(), model.rbegin()));  // backwards over evicted chunks

  // Writes through proxies: range-for, std::ranges::for_each, std::transform, std::replace_if.
  for (auto&& x : l) x = x + 1;
  for (uint64_t& x : model) ++x;
  ASSERT_TRUE(std::ranges::equal(l, model));
  std::ranges::for_each(l, [](List::reference x) { x += 2; });
  for (uint64_t& x : model) x += 2;
  std::transform(l.begin(), l.end(), l.begin(), [](uint64_t x) { return x * 3; });
  std::ranges::transform(model, model.begin(), [](uint64_t x) { return x * 3; });
  std::replace_if(l.begin(), l.end(), pred, 5);
  std::replace_if(model.begin(), model.end(), pred, 5);
  ASSERT_TRUE(std::ranges::equal(l, model));
  std::ranges::reverse(l);  // bidirectional: iter_swap through the proxies
  std::ranges::reverse(model);
  ASSERT_TRUE(std::ranges::equal(l, model));

  // Drain from both ends after evicting again.
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  for (size_t i = 0; i < kN / 4; ++i) {
    ASSERT_EQ(l.front().get(), model.front()) << i;
    ASSERT_EQ(l.back().get(), model.back()) << i;
    l.pop_front();
    l.pop_back();
    model.erase(model.begin());
    model.pop_back();
  }
  ASSERT_TRUE(std::ranges::equal(std::as_const(l), model));

  // Constructors and the explicit copy.
  List copy(*rt_, l.begin(), l.end());
  EXPECT_TRUE(std::ranges::equal(copy, model));
  List init(*rt_, {5, 4, 3});
  EXPECT_TRUE(std::ranges::equal(init, std::vector<uint64_t>{5, 4, 3}));
  List filled(*rt_, 3, 9);
  EXPECT_TRUE(std::ranges::equal(filled, std::vector<uint64_t>{9, 9, 9}));
}

TEST_F(FarptrTest, FarQueueMatchesStdQueueBeyondTheBudget) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 64 << 10)));
  const RuntimeStats before = rt_->stats();
  // Grows to ~8000 items (500 KiB; TSan: 2000, 125 KiB) with 70% pushes, then drains with 70%
  // pops: the middle of the queue is evicted while it waits and comes back as the front nears.
  constexpr int kOps = 40000 / (kTsanScale > 1 ? 4 : 1);
  std::mt19937_64 rng(99);
  far_queue<Item> q(*rt_);
  std::queue<Item> model;
  uint64_t next = 0;
  size_t peak = 0;
  for (int op = 0; op < kOps; ++op) {
    const bool growing = op < kOps / 2;
    const bool push = static_cast<int>(rng() % 10) < (growing ? 7 : 3);
    if (push || model.empty()) {
      if (rng() % 2) {
        q.push(MakeItem(next));
      } else {
        EXPECT_EQ(Item(q.emplace(MakeItem(next))), MakeItem(next));
      }
      model.push(MakeItem(next++));
    } else {
      ASSERT_EQ(Item(q.front()), model.front()) << "op " << op;
      q.pop();
      model.pop();
    }
    peak = std::max(peak, model.size());
    ASSERT_EQ(q.size(), model.size()) << "op " << op;
    ASSERT_EQ(q.empty(), model.empty()) << "op " << op;
    if (!model.empty()) {
      ASSERT_EQ(Item(q.front()), model.front()) << "op " << op;
      ASSERT_EQ(Item(q.back()), model.back()) << "op " << op;
    }
  }
  EXPECT_GT(peak * sizeof(Item), 64u << 10) << "the queue outgrew the budget";
  // front() and back() are assignable proxies.
  q.push(MakeItem(1));
  model.push(MakeItem(1));
  q.back() = MakeItem(2);
  model.back() = MakeItem(2);
  q.front() = MakeItem(3);
  model.front() = MakeItem(3);
  while (!model.empty()) {
    ASSERT_EQ(Item(std::as_const(q).front()), model.front());
    q.pop();
    model.pop();
  }
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.container().chunk_count(), 0u);  // emptied chunks are freed
  const RuntimeStats after = rt_->stats();
  std::printf("queue: peak %zu items; spans evicted %lu, swap-ins %lu (prefetched %lu)\n", peak,
              after.spans_evicted - before.spans_evicted, after.swap_ins - before.swap_ins,
              after.prefetches - before.prefetches);
  EXPECT_GT(after.spans_evicted, before.spans_evicted);
  EXPECT_GT(after.swap_ins, before.swap_ins);
}

}  // namespace
}  // namespace farmem::farptr_test
