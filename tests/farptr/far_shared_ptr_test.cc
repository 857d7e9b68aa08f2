// far_shared_ptr against real daemons: std::shared_ptr's ownership rules (copies share one object,
// the last one frees it: the runtime's live object count says so), with far more shared data than
// the local budget (objects evicted and fetched back through any copy), and copies made, used and
// dropped by several threads at once.
#include "farmem/far_shared_ptr.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <set>
#include <thread>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "farptr_fixture.h"

namespace farmem::farptr_test {
namespace {

static_assert(std::is_nothrow_copy_constructible_v<far_shared_ptr<Point>>);
static_assert(std::is_nothrow_move_constructible_v<far_shared_ptr<Point>>);
static_assert(std::is_nothrow_copy_assignable_v<far_shared_ptr<Point>>);
static_assert(std::totally_ordered<far_shared_ptr<Point>>);
static_assert(!std::is_convertible_v<far_ptr<Point>, far_shared_ptr<Point>>);  // explicit

// 1 KiB: sixteen to a 16 KiB span, so a few thousand of them are many times the budget.
struct Blob {
  uint64_t id;
  uint64_t version;
  uint64_t words[126];
};
Blob MakeBlob(uint64_t id, uint64_t version) {
  Blob b{id, version, {}};
  for (uint64_t i = 0; i < 126; ++i) b.words[i] = id * 1'000'003 + version * 7919 + i;
  return b;
}
bool BlobIs(const Blob& b, uint64_t id, uint64_t version) {
  if (b.id != id || b.version != version) return false;
  for (uint64_t i = 0; i < 126; ++i) {
    if (b.words[i] != id * 1'000'003 + version * 7919 + i) return false;
  }
  return true;
}

TEST_F(FarptrTest, FarSharedPtrSharesOneObjectAndTheLastCopyFreesIt) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  ASSERT_NO_FATAL_FAILURE(Open(Options("none", 1 << 20)));
  const uint64_t base = rt_->stats().objects;

  far_shared_ptr<Point> empty;
  EXPECT_FALSE(empty);
  EXPECT_EQ(empty.use_count(), 0);
  EXPECT_TRUE(empty == nullptr);

  far_shared_ptr<Point> a = make_far_shared_in<Point>(*rt_, Point{1, 2, 3.0, 4.0});
  EXPECT_EQ(rt_->stats().objects, base + 1);
  EXPECT_EQ(a.use_count(), 1);
  far_shared_ptr<Point> b = a;  // copy: the same object
  EXPECT_EQ(a.use_count(), 2);
  EXPECT_TRUE(a == b);
  EXPECT_EQ(std::hash<far_shared_ptr<Point>>()(a), std::hash<far_shared_ptr<Point>>()(b));
  b.write(Point{1, 3, 5.0, 6.0});
  EXPECT_EQ(a.read().version, 3u) << "a write through one copy is seen through the other";
  {
    DerefScope s;
    b.deref_mut(s).x = 7.5;  // deref_mut of a const-qualified access path, as shared_ptr's *
    EXPECT_EQ(a.deref(s).x, 7.5);
    auto p = a.try_deref(s);
    ASSERT_TRUE(p.has_value());
    EXPECT_EQ((*p)->y, 6.0);
  }
  EXPECT_EQ(rt_->stats().objects, base + 1) << "copies never copy the object";

  far_shared_ptr<Point> c = std::move(b);  // move: no new owner
  EXPECT_FALSE(b);                         // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(c.use_count(), 2);
  far_shared_ptr<Point> other = make_far_shared_in<Point>(*rt_, Point{9, 9, 0, 0});
  EXPECT_FALSE(a == other);
  EXPECT_TRUE((a < other) != (other < a));
  EXPECT_EQ(rt_->stats().objects, base + 2);
  other = a;  // assignment drops other's object: it was the last owner
  EXPECT_EQ(rt_->stats().objects, base + 1);
  EXPECT_EQ(a.use_count(), 3);

  a.reset();
  c = nullptr;
  EXPECT_EQ(rt_->stats().objects, base + 1) << "`other` still owns it";
  EXPECT_EQ(other.use_count(), 1);
  EXPECT_EQ(other.read().x, 7.5);
  other.reset();
  EXPECT_EQ(rt_->stats().objects, base) << "the last owner freed the object";

  // From a far_ptr: shared ownership taken over, an empty far_ptr gives an empty pointer.
  far_ptr<Point> unique = make_far_in<Point>(*rt_, Point{5, 5, 0, 0});
  far_shared_ptr<Point> shared(std::move(unique));
  EXPECT_FALSE(unique);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(shared.read().id, 5u);
  EXPECT_FALSE(far_shared_ptr<Point>(far_ptr<Point>()));
  shared.reset(make_far_in<Point>(*rt_, Point{6, 6, 0, 0}));
  EXPECT_EQ(shared.read().id, 6u);
  EXPECT_EQ(rt_->stats().objects, base + 1);
  // In the standard associative containers, by identity.
  std::set<far_shared_ptr<Point>> ordered{shared, shared};
  std::unordered_set<far_shared_ptr<Point>> hashed{shared, shared};
  EXPECT_EQ(ordered.size(), 1u);
  EXPECT_EQ(hashed.size(), 1u);
  EXPECT_EQ(shared.use_count(), 3);
}

// Each object is held by several pointers scattered over the program; the objects together are
// 16 times the local budget, so they are evicted and come back through whichever copy asks.
TEST_F(FarptrTest, FarSharedPtrCopiesSeeOneObjectThroughEviction) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  constexpr uint64_t kBudget = 256 << 10;
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", kBudget)));
  const RuntimeStats before = rt_->stats();
  const uint64_t n = 16 * kBudget / sizeof(Blob) / (kTsanScale > 1 ? 4 : 1);
  std::vector<far_shared_ptr<Blob>> owners, aliases;
  for (uint64_t i = 0; i < n; ++i) {
    owners.push_back(make_far_shared_in<Blob>(*rt_, MakeBlob(i, 0)));
  }
  std::mt19937_64 rng(7);
  // Two more copies of each, in a random order, so a walk through `aliases` jumps around.
  for (uint64_t i = 0; i < n; ++i) {
    aliases.push_back(owners[i]);
    aliases.push_back(owners[i]);
  }
  std::shuffle(aliases.begin(), aliases.end(), rng);
  EXPECT_EQ(rt_->stats().objects, before.objects + n);
  // Write every object through each of its two aliases (it ends at version 2)...
  std::vector<uint64_t> version(n, 0);
  for (size_t k = 0; k < aliases.size(); ++k) {
    const uint64_t id = aliases[k].read().id;
    version[id] = version[id] + 1;
    aliases[k].write(MakeBlob(id, version[id]));
  }
  // ...and read every one back through its owner, after the writes pushed most of them out.
  for (uint64_t i = 0; i < n; ++i) {
    DerefScope s;
    auto p = owners[i].try_deref(s);
    ASSERT_TRUE(p.has_value()) << "object " << i << ": " << p.error().ToString();
    ASSERT_TRUE(BlobIs(**p, i, 2)) << "object " << i << " version " << (*p)->version;
    ASSERT_EQ(owners[i].use_count(), 3);
  }
  const RuntimeStats after = rt_->stats();
  EXPECT_GT(after.spans_evicted, before.spans_evicted);
  EXPECT_GT(after.swap_ins, before.swap_ins);
  std::printf("%lu shared objects (%lu KiB, budget %lu KiB): spans evicted %lu, swap-ins %lu\n", n,
              n * sizeof(Blob) >> 10, kBudget >> 10, after.spans_evicted - before.spans_evicted,
              after.swap_ins - before.swap_ins);
  // Dropping the owners frees nothing; dropping the aliases in random order frees each object
  // exactly when its last alias goes.
  owners.clear();
  EXPECT_EQ(rt_->stats().objects, before.objects + n);
  std::shuffle(aliases.begin(), aliases.end(), rng);
  std::vector<int> left(n, 2);
  uint64_t live = n;
  while (!aliases.empty()) {
    const uint64_t id = aliases.back().read().id;
    aliases.pop_back();
    if (--left[id] == 0) --live;
    if (aliases.size() % 257 == 0) {
      ASSERT_EQ(rt_->stats().objects, before.objects + live) << aliases.size() << " aliases left";
    }
  }
  EXPECT_EQ(rt_->stats().objects, before.objects);
}

// Threads copy, read, write and drop pointers to shared objects at once, over a budget the
// objects outgrow: counts stay exact (every object freed exactly once, when its last copy went),
// and every thread's writes survive eviction.
TEST_F(FarptrTest, FarSharedPtrCopiesAcrossThreads) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  constexpr uint64_t kBudget = 256 << 10;
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", kBudget)));
  const uint64_t base = rt_->stats().objects;
  constexpr int kThreads = 4;
  const uint64_t n = 8 * kBudget / sizeof(Blob) / (kTsanScale > 1 ? 4 : 1);
  const int rounds = 6 / (kTsanScale > 1 ? 2 : 1);
  std::vector<far_shared_ptr<Blob>> shared;
  for (uint64_t i = 0; i < n; ++i) shared.push_back(make_far_shared_in<Blob>(*rt_, MakeBlob(i, 0)));

  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      // Each thread keeps its own copies of all objects (with their ids: reading another
      // thread's object while it writes would be a race), and makes and drops extra ones.
      std::vector<std::pair<uint64_t, far_shared_ptr<Blob>>> mine;
      for (uint64_t i = 0; i < n; ++i) mine.emplace_back(i, shared[i]);
      for (int r = 1; r <= rounds; ++r) {
        std::shuffle(mine.begin(), mine.end(), rng);
        for (auto& [id, p] : mine) {
          far_shared_ptr<Blob> extra = p;  // a copy made and dropped on this thread
          if (extra.use_count() < 2) bad.fetch_add(1);
          // Objects belong to thread id % kThreads: only it reads and writes them.
          if (id % kThreads != static_cast<uint64_t>(t)) continue;
          if (!BlobIs(extra.read(), id, static_cast<uint64_t>(r - 1))) bad.fetch_add(1);
          extra.write(MakeBlob(id, static_cast<uint64_t>(r)));
        }
      }
      // Half the threads drop their copies now, the others when they end: releases race.
      if (t % 2 == 0) mine.clear();
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(rt_->stats().objects, base + n) << "the main copies still own every object";
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(shared[i].use_count(), 1) << "object " << i;
    ASSERT_TRUE(BlobIs(shared[i].read(), i, static_cast<uint64_t>(rounds))) << "object " << i;
  }
  // The last owners go on several threads at once.
  std::vector<std::thread> droppers;
  for (int t = 0; t < kThreads; ++t) {
    std::vector<far_shared_ptr<Blob>> part;
    for (uint64_t i = t; i < n; i += kThreads) part.push_back(shared[i]);
    droppers.emplace_back([p = std::move(part)]() mutable { p.clear(); });
  }
  shared.clear();
  for (std::thread& th : droppers) th.join();
  EXPECT_EQ(rt_->stats().objects, base);
}

}  // namespace
}  // namespace farmem::farptr_test
