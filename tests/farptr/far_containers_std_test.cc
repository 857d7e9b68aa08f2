// far_vector and far_hash_map used as standard-library containers: the iterator concepts are
// checked at compile time, and std:: / std::ranges algorithms run against real daemons with the
// elements swapped out first, checked against std::vector / std::unordered_map models.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <random>
#include <ranges>
#include <span>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "farmem/far_hash_map.h"
#include "farmem/far_vector.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

// A record with only operator< (no <=>): what a pre-C++20 program sorts.
struct Record {
  uint32_t key;
  uint32_t payload;
  bool operator<(const Record& o) const { return key < o.key; }
};

struct Order {
  uint64_t id;
  double price;
};

using Vec = far_vector<uint64_t>;
using Map = far_hash_map<uint64_t, uint64_t>;

// --- The concepts, at compile time. ---
static_assert(std::random_access_iterator<Vec::iterator>);
static_assert(std::random_access_iterator<Vec::const_iterator>);
static_assert(std::random_access_iterator<far_vector<Record>::iterator>);
static_assert(std::output_iterator<Vec::iterator, uint64_t>);
static_assert(std::sortable<Vec::iterator>);
static_assert(std::sortable<Vec::iterator, std::ranges::greater>);
static_assert(std::permutable<far_vector<Record>::iterator>);
static_assert(std::ranges::random_access_range<Vec>);
static_assert(std::ranges::random_access_range<const Vec>);
static_assert(std::ranges::sized_range<Vec>);
static_assert(std::ranges::common_range<Vec>);
static_assert(std::same_as<std::iter_value_t<Vec::iterator>, uint64_t>);
static_assert(std::same_as<std::iter_reference_t<Vec::const_iterator>, uint64_t>);
static_assert(std::is_nothrow_move_constructible_v<Vec>);
static_assert(std::is_move_assignable_v<Vec> && !std::is_copy_constructible_v<Vec>);
static_assert(std::forward_iterator<Map::iterator>);
static_assert(std::ranges::forward_range<Map>);
static_assert(std::ranges::forward_range<const Map>);
static_assert(std::same_as<std::ranges::range_value_t<Map>, std::pair<const uint64_t, uint64_t>>);
static_assert(std::is_move_constructible_v<Map> && !std::is_copy_constructible_v<Map>);

TEST_F(FarptrTest, FarVectorRunsStandardAlgorithms) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  constexpr size_t kN = (64u << 10) / kTsanScale;  // 512 KiB of uint64_t: 128 chunks
  // A quarter of the vector stays local, but never less than the 4 spans of 16 KiB the runtime
  // needs (under TSan kN is 16 times smaller).
  ASSERT_NO_FATAL_FAILURE(
      Open(Options("ec:2+1", std::max<size_t>(kN * sizeof(uint64_t) / 4, 64u << 10))));
  std::mt19937_64 rng(5);
  std::vector<uint64_t> model(kN);
  for (uint64_t& x : model) x = rng() % 1'000'000;

  Vec v(*rt_);
  v.reserve(kN);
  EXPECT_EQ(v.size(), 0u);
  EXPECT_GE(v.capacity(), kN);
  v.resize(kN);
  std::ranges::copy(model, v.begin());  // an output iterator
  ASSERT_EQ(v.size(), kN);

  // Everything out: every algorithm below reads its elements back from the daemons.
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const uint64_t swap_ins = rt_->stats().swap_ins;
  EXPECT_EQ(std::accumulate(v.begin(), v.end(), uint64_t{0}),
            std::accumulate(model.begin(), model.end(), uint64_t{0}));
  EXPECT_GT(rt_->stats().swap_ins, swap_ins);

  auto pred = [](uint64_t x) { return x % 1000 == 7; };
  EXPECT_EQ(std::find_if(v.cbegin(), v.cend(), pred) - v.cbegin(),
            std::find_if(model.begin(), model.end(), pred) - model.begin());
  EXPECT_EQ(std::ranges::count_if(v, pred), std::ranges::count_if(model, pred));
  EXPECT_EQ(*std::max_element(v.begin(), v.end()), *std::ranges::max_element(model));

  // range-for: by value (T), and through proxies that write.
  uint64_t sum = 0;
  for (uint64_t x : v) sum += x;
  EXPECT_EQ(sum, std::accumulate(model.begin(), model.end(), uint64_t{0}));
  for (auto&& x : v) x = x + 1;  // `x` is a far_vector::reference
  for (uint64_t& x : model) ++x;
  EXPECT_TRUE(std::ranges::equal(v, model));
  EXPECT_TRUE(std::equal(v.rbegin(), v.rend(), model.rbegin()));

  // Block access: algorithms on one chunk's std::span at a time.
  uint64_t span_sum = 0;
  v.for_each_span([&](std::span<const uint64_t> s) {
    span_sum = std::accumulate(s.begin(), s.end(), span_sum);
  });
  EXPECT_EQ(span_sum, std::accumulate(model.begin(), model.end(), uint64_t{0}));
  v.for_each_span_mut(kN / 3, kN / 2, [](std::span<uint64_t> s) {
    std::ranges::transform(s, s.begin(), [](uint64_t x) { return x + 1; });
  });
  std::transform(model.begin() + kN / 3, model.begin() + kN / 2, model.begin() + kN / 3,
                 [](uint64_t x) { return x + 1; });
  uint64_t subrange_sum = 0;
  v.for_each_span(10, kN - 10, [&](std::span<const uint64_t> s) {
    subrange_sum = std::accumulate(s.begin(), s.end(), subrange_sum);
  });
  EXPECT_EQ(subrange_sum, std::accumulate(model.begin() + 10, model.end() - 10, uint64_t{0}));

  // std::sort (classic) and std::ranges::sort on proxy iterators.
  std::sort(v.begin(), v.end());
  std::sort(model.begin(), model.end());
  EXPECT_TRUE(std::is_sorted(v.cbegin(), v.cend()));
  ASSERT_TRUE(std::ranges::equal(v, model));
  const uint64_t probe = model[kN / 3];
  EXPECT_EQ(std::ranges::lower_bound(v, probe) - v.begin(),
            std::ranges::lower_bound(model, probe) - model.begin());
  std::ranges::sort(v, std::ranges::greater{});
  std::ranges::sort(model, std::ranges::greater{});
  ASSERT_TRUE(std::ranges::equal(v, model));

  // Element access, proxies and the rest of the vector interface.
  EXPECT_EQ(v.front(), model.front());
  EXPECT_EQ(v.back(), model.back());
  EXPECT_EQ(std::as_const(v)[7], model[7]);
  v[7] += 5;
  EXPECT_EQ(v.get(7), model[7] + 5);
  v[7] = v[8];  // copies the value, does not rebind
  EXPECT_EQ(v.get(7), model[8]);
  EXPECT_EQ(v.get(8), model[8]);
  swap(v[0], v[1]);
  EXPECT_EQ(v.get(0), model[1]);
  EXPECT_EQ(v.get(1), model[0]);

  v.clear();
  EXPECT_TRUE(v.empty());
  EXPECT_GE(v.capacity(), kN);  // like std::vector, clear keeps the capacity
  for (uint64_t i = 0; i < 10; ++i) v.push_back(i);
  v.erase(v.begin() + 2);                 // 0 1 3 4 ... 9
  v.insert(v.begin() + 5, 100);           // 0 1 3 4 5 100 6 7 8 9
  v.erase(v.begin() + 7, v.begin() + 9);  // 0 1 3 4 5 100 6 9
  EXPECT_TRUE(std::ranges::equal(v, std::vector<uint64_t>{0, 1, 3, 4, 5, 100, 6, 9}));
  v.resize(10, 42);
  EXPECT_EQ(v.get(8), 42u);
  EXPECT_EQ(v.get(9), 42u);
  v.pop_back();
  EXPECT_EQ(v.size(), 9u);
  v.shrink_to_fit();
  EXPECT_LT(v.capacity(), kN);

  // Moves take the elements; the moved-from vector is empty and usable.
  Vec w(std::move(v));
  EXPECT_EQ(w.size(), 9u);
  EXPECT_TRUE(v.empty());  // NOLINT(bugprone-use-after-move): specified to be empty
  v.push_back(3);
  EXPECT_EQ(v.get(0), 3u);
  v = std::move(w);
  EXPECT_EQ(v.size(), 9u);
  EXPECT_EQ(v.get(5), 100u);
  Vec copy(*rt_, v.begin(), v.end());  // the explicit copy
  EXPECT_TRUE(std::ranges::equal(copy, v));
  Vec init(*rt_, {5, 4, 3});
  std::ranges::reverse(init);
  EXPECT_TRUE(std::ranges::equal(init, std::vector<uint64_t>{3, 4, 5}));
}

TEST_F(FarptrTest, FarVectorOfRecordsSortsWithOperatorLess) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 64 << 10)));
  constexpr size_t kN = 20000 / kTsanScale;  // 160 KiB
  std::mt19937_64 rng(9);
  far_vector<Record> v(*rt_);
  std::vector<Record> model;
  for (size_t i = 0; i < kN; ++i) {
    const Record r{static_cast<uint32_t>(rng() % 5000), static_cast<uint32_t>(i)};
    v.push_back(r);
    model.push_back(r);
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  std::stable_sort(model.begin(), model.end());
  std::sort(v.begin(), v.end());  // operator< through the proxies
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ(v.get(i).key, model[i].key) << i;
  // A comparator over const Record& sees the proxies converted to values.
  std::ranges::sort(v, [](const Record& a, const Record& b) { return a.payload < b.payload; });
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ(v.cbegin()[i].payload, i);
  EXPECT_EQ(v.cbegin()->payload, 0u);  // operator-> of an iterator: a read-only copy
  // Projections by member pointer need T itself: project through a const view (values).
  auto it = std::ranges::find(std::as_const(v), uint32_t{5}, &Record::payload);
  ASSERT_NE(it, v.cend());
  EXPECT_EQ(it->payload, 5u);
}

TEST_F(FarptrTest, FarHashMapHasTheStandardShape) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 1 << 20, 4096)));

  far_hash_map<uint64_t, Order> orders(*rt_);
  auto [it, inserted] = orders.insert(1, Order{1, 9.5});
  EXPECT_TRUE(inserted);
  EXPECT_EQ(it->second.price, 9.5);
  // insert does not overwrite; it shows what is there.
  std::tie(it, inserted) = orders.insert(1, Order{1, 20.0});
  EXPECT_FALSE(inserted);
  EXPECT_EQ(it->first, 1u);
  EXPECT_EQ(it->second.price, 9.5);
  EXPECT_EQ(orders.find(1)->price, 9.5);
  // insert_or_assign does.
  std::tie(it, inserted) = orders.insert_or_assign(1, Order{1, 20.0});
  EXPECT_FALSE(inserted);
  EXPECT_EQ(it->second.price, 20.0);
  EXPECT_EQ(orders.find(1)->price, 20.0);
  // try_emplace builds the value only for a new key.
  EXPECT_TRUE(orders.try_emplace(2, 2u, 3.0).second);
  EXPECT_FALSE(orders.try_emplace(2, 2u, 4.0).second);
  EXPECT_EQ(orders.find(2)->price, 3.0);
  EXPECT_TRUE(orders.insert({3, Order{3, 1.0}}).second);
  EXPECT_EQ(orders.size(), 3u);
  EXPECT_EQ(orders.count(3), 1u);
  EXPECT_EQ(orders.erase(3), 1u);
  EXPECT_EQ(orders.erase(3), 0u);
  EXPECT_FALSE(orders.contains(3));

  // operator[]: writes and atomic read-modify-writes; reading an absent key inserts nothing.
  Map counts(*rt_);
  counts[10] = 5;
  counts[10] += 2;
  ++counts[11];
  EXPECT_EQ(counts.find(10), std::optional<uint64_t>(7));
  EXPECT_EQ(counts.find(11), std::optional<uint64_t>(1));
  const uint64_t absent = counts[12];
  EXPECT_EQ(absent, 0u);
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_TRUE(counts.update(13, [](uint64_t& x) { x += 4; }));
  EXPECT_FALSE(counts.update(13, [](uint64_t& x) { x *= 10; }));
  EXPECT_EQ(counts.find(13), std::optional<uint64_t>(40));

  // Enough keys to grow the directory several times and send buckets out; then iterate the
  // swapped-out map with range-for and algorithms.
  constexpr uint64_t kKeys = 20000 / kTsanScale;
  Map m(*rt_);
  std::unordered_map<uint64_t, uint64_t> model;
  std::mt19937_64 rng(17);
  while (model.size() < kKeys) {
    const uint64_t k = rng(), v = rng() % 1000;
    EXPECT_EQ(m.insert(k, v).second, model.insert({k, v}).second);
  }
  EXPECT_GT(m.bucket_count(), 64u);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const uint64_t swap_ins = rt_->stats().swap_ins;
  std::map<uint64_t, uint64_t> seen;
  for (auto [k, v] : m) EXPECT_TRUE(seen.emplace(k, v).second) << "key " << k << " seen twice";
  EXPECT_GT(rt_->stats().swap_ins, swap_ins);
  EXPECT_EQ(seen, (std::map<uint64_t, uint64_t>(model.begin(), model.end())));
  EXPECT_EQ(static_cast<size_t>(std::distance(m.begin(), m.end())), m.size());
  auto value_sum = [](uint64_t s, const auto& kv) { return s + kv.second; };
  EXPECT_EQ(std::accumulate(m.begin(), m.end(), uint64_t{0}, value_sum),
            std::accumulate(model.begin(), model.end(), uint64_t{0}, value_sum));
  const auto is_999 = [](const auto& kv) { return kv.second == 999; };
  auto found = std::find_if(m.begin(), m.end(), is_999);
  ASSERT_NE(found, m.end());
  EXPECT_EQ(model.at(found->first), 999u);
  EXPECT_EQ(std::ranges::count_if(m, is_999), std::ranges::count_if(model, is_999));

  // erase_if, erase(iterator), clear, moves.
  const size_t odd = std::ranges::count_if(model, [](const auto& kv) { return kv.first % 2; });
  EXPECT_EQ(erase_if(m, [](const auto& kv) { return kv.first % 2 == 1; }), odd);
  EXPECT_EQ(m.size(), kKeys - odd);
  const uint64_t first_key = m.begin()->first;
  m.erase(m.begin());
  EXPECT_FALSE(m.contains(first_key));
  Map moved(std::move(m));
  EXPECT_EQ(moved.size(), kKeys - odd - 1);
  EXPECT_TRUE(m.empty());  // NOLINT(bugprone-use-after-move): specified to be empty
  EXPECT_EQ(m.begin(), m.end());
  m = std::move(moved);
  EXPECT_EQ(m.size(), kKeys - odd - 1);
  m.clear();
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.begin(), m.end());
  EXPECT_TRUE(m.insert(1, 1).second);
}

// An iteration that spans directory growth neither repeats nor misses an entry that was there
// all along (the reverse-binary bucket order).
TEST_F(FarptrTest, FarHashMapIterationAcrossGrowth) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 1 << 20, 4096)));
  Map m(*rt_);
  constexpr uint64_t kOld = 400;
  for (uint64_t k = 0; k < kOld; ++k) m.insert(k, k);
  const size_t buckets = m.bucket_count();
  std::map<uint64_t, int> seen;
  auto it = m.begin();
  for (int i = 0; i < 150; ++i, ++it) ++seen[it->first];
  // Grow the directory at least twice under the iterator.
  for (uint64_t k = 1'000'000; m.bucket_count() < 4 * buckets; ++k) m.insert(k, k);
  for (; it != m.end(); ++it) ++seen[it->first];
  for (uint64_t k = 0; k < kOld; ++k) EXPECT_EQ(seen[k], 1) << "key " << k;
  for (auto& [k, n] : seen) EXPECT_EQ(n, 1) << "key " << k;
}

// Iteration while another thread inserts and erases other keys (growing the directory): every
// key that is there throughout is seen exactly once by each pass.
TEST_F(FarptrTest, FarHashMapIterationUnderConcurrentWriters) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 1 << 20, 4096)));
  Map m(*rt_);
  constexpr uint64_t kStable = 2000 / kTsanScale;
  for (uint64_t k = 0; k < kStable; ++k) m.insert(2 * k, k);  // even keys stay
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> writes{0};
  std::thread writer([&] {
    std::mt19937_64 rng(23);
    uint64_t next = 1;
    while (!stop.load()) {
      if (rng() % 3 == 0) {
        m.erase(2 * (rng() % next) + 1);
      } else {
        m[2 * next++ + 1] = 1;  // odd keys come and go
      }
      writes.fetch_add(1);
    }
  });
  // Stops and joins the writer however the test ends (an ASSERT returns early).
  struct Joiner {
    std::atomic<bool>* stop;
    std::thread* t;
    ~Joiner() {
      stop->store(true);
      t->join();
    }
  } joiner{&stop, &writer};
  const size_t initial_buckets = m.bucket_count();
  for (int pass = 0; pass < 3; ++pass) {
    const uint64_t writes_before = writes.load();
    const size_t buckets_before = m.bucket_count();
    std::vector<int> seen(kStable, 0);
    for (auto [k, v] : m) {
      if (k % 2 == 0) {
        ASSERT_LT(k / 2, kStable);
        ASSERT_EQ(v, k / 2);
        ++seen[k / 2];
      }
    }
    for (uint64_t k = 0; k < kStable; ++k) ASSERT_EQ(seen[k], 1) << "key " << 2 * k;
    // Wait (on state) until the writer has made progress and grown the directory since this pass
    // began, so that every pass overlaps writes and the passes straddle growth.
    ASSERT_TRUE(testing::WaitUntil(
        [&] { return writes.load() > writes_before + 100 && m.bucket_count() > buckets_before; },
        std::chrono::seconds(60)))
        << "writes " << writes.load() << ", buckets " << m.bucket_count();
  }
  EXPECT_GE(m.bucket_count(), 8 * initial_buckets);
}

}  // namespace
}  // namespace farmem::farptr_test
