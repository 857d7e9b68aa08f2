// far_vector and far_hash_map with a local budget of 1/8 of their size, checked against plain
// in-memory models.
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "farmem/far_hash_map.h"
#include "farmem/far_vector.h"
#include "farptr_fixture.h"

namespace farmem::farptr_test {
namespace {

TEST_F(FarptrTest, FarVectorAtOneEighthBudget) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  constexpr size_t kN = (1 << 20) / kTsanScale;  // 8 MiB of uint64_t
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", kN * sizeof(uint64_t) / 8)));
  far_vector<uint64_t> v(*rt_, kN);
  std::vector<uint64_t> model(kN, 0);
  for (size_t i = 0; i < kN; ++i) {
    DerefScope s;
    v.at_mut(i, s) = model[i] = i * 2654435761u;
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 60000 / kTsanScale; ++i) {
    const size_t at = rng() % kN;
    if (rng() % 4 == 0) {
      const uint64_t x = rng();
      v.set(at, x);
      model[at] = x;
    } else {
      ASSERT_EQ(v.get(at), model[at]) << "element " << at;
    }
  }
  // Sequential scans: the prefetcher should run ahead.
  const uint64_t prefetched_before = rt_->stats().prefetches;
  for (int pass = 0; pass < 2; ++pass) {
    // One scope per 4096 elements, not one over the whole scan: everything dereferenced in a
    // scope stays pinned until it ends.
    for (size_t base = 0; base < kN; base += 4096) {
      DerefScope s;
      for (size_t i = base; i < base + 4096; ++i) {
        ASSERT_EQ(v.at(i, s), model[i]) << "element " << i;
      }
    }
  }
  RuntimeStats st = rt_->stats();
  EXPECT_GT(st.prefetches, prefetched_before);
  EXPECT_LE(st.local_bytes, st.local_budget + (1u << 20));
  v.push_back(7);
  EXPECT_EQ(v.size(), kN + 1);
  EXPECT_EQ(v.get(kN), 7u);
  v.resize(0);
}

struct Value {
  uint64_t a;
  uint32_t b;
  uint32_t c;
};

TEST_F(FarptrTest, FarHashMapAtOneEighthBudget) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  const size_t kKeys = 100000 / LongWorkloadScale();  // ~3 MiB of buckets
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", (512 << 10) / LongWorkloadScale(), 4096)));
  far_hash_map<uint64_t, Value> m(*rt_);
  std::unordered_map<uint64_t, Value> model;
  std::mt19937_64 rng(11);
  for (size_t i = 0; i < kKeys; ++i) {
    const uint64_t k = rng() % (kKeys * 2);
    const Value v{rng(), static_cast<uint32_t>(i), 7};
    EXPECT_EQ(m.insert_or_assign(k, v).second, model.insert_or_assign(k, v).second);
  }
  EXPECT_EQ(m.size(), model.size());
  EXPECT_GT(rt_->stats().spans_evicted, 0u);
  for (int i = 0; i < 100000 / LongWorkloadScale(); ++i) {
    const uint64_t k = rng() % (kKeys * 2);
    switch (rng() % 4) {
      case 0: {
        const Value v{rng(), 1, 2};
        ASSERT_EQ(m.insert_or_assign(k, v).second, model.insert_or_assign(k, v).second);
        break;
      }
      case 1:
        ASSERT_EQ(m.erase(k), model.erase(k) == 1);
        break;
      default: {
        auto got = m.find(k);
        auto it = model.find(k);
        ASSERT_EQ(got.has_value(), it != model.end()) << "key " << k;
        if (got) {
          ASSERT_EQ(got->a, it->second.a);
          ASSERT_EQ(got->b, it->second.b);
        }
      }
    }
  }
  EXPECT_EQ(m.size(), model.size());
  for (auto& [k, v] : model) {
    auto got = m.find(k);
    ASSERT_TRUE(got.has_value()) << "key " << k;
    ASSERT_EQ(got->a, v.a);
  }
  RuntimeStats st = rt_->stats();
  EXPECT_GT(st.swap_ins, 0u);
  EXPECT_LE(st.local_bytes, st.local_budget + (1u << 20));
}

// get_many reads the buckets that are not local together, and a gathering miss reads only the
// object's bytes, not its span: swap-ins happen, every value is right, absent keys are absent,
// and the bytes read are far below a span per swap-in (they were a whole span each before).
TEST_F(FarptrTest, FarHashMapGetManyReadsObjectsNotSpans) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  ASSERT_NO_FATAL_FAILURE(Open(Options("none", 1 << 20)));
  constexpr uint64_t kKeys = 60000;  // ~16,000 buckets of 100-200 B: ~200 spans of 16 KiB
  far_hash_map<uint64_t, Value> m(*rt_, kKeys);
  for (uint64_t k = 0; k < kKeys; ++k) m.insert_or_assign(k * 2, Value{k, 1, 2});
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  std::mt19937_64 rng(5);
  uint64_t ins = 0, bytes = 0;
  for (int round = 0; round < 20; ++round) {
    std::vector<uint64_t> keys(16);
    for (auto& k : keys) k = rng() % (2 * kKeys);  // odd keys are absent
    std::vector<std::optional<Value>> got(keys.size());
    const RuntimeStats before = rt_->stats();
    m.get_many(keys, got);
    const RuntimeStats after = rt_->stats();
    for (size_t i = 0; i < keys.size(); ++i) {
      ASSERT_EQ(got[i].has_value(), keys[i] % 2 == 0) << "key " << keys[i];
      if (got[i]) {
        ASSERT_EQ(got[i]->a, keys[i] / 2) << "key " << keys[i];
      }
    }
    ins += after.swap_ins - before.swap_ins;
    bytes += after.bytes_read - before.bytes_read;
  }
  ASSERT_GT(ins, 100u);  // most buckets were remote
  // A span is read whole only when a batch wants two of its objects or it was missed just before.
  EXPECT_LE(bytes, ins * 2048) << ins << " swap-ins";
  // Another batch of the same keys finds its buckets local: no read at all.
  std::vector<uint64_t> keys = {0, 2, 4, 6, 8, 10, 12, 14};
  std::vector<std::optional<Value>> got(keys.size());
  m.get_many(keys, got);
  const uint64_t reads = rt_->stats().swap_ins;
  m.get_many(keys, got);
  EXPECT_EQ(rt_->stats().swap_ins, reads);
  for (size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(got[i]->a, keys[i] / 2);
  // prefetch: the same reads, for the updates that follow to hit.
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const uint64_t before = rt_->stats().swap_ins;
  m.prefetch(keys);
  const uint64_t fetched = rt_->stats().swap_ins;
  EXPECT_GT(fetched, before);
  for (uint64_t k : keys) m.update(k, [](Value& v) { v.b = 9; });
  EXPECT_EQ(rt_->stats().swap_ins, fetched);
  for (uint64_t k : keys) ASSERT_EQ(m.find(k)->b, 9u);
}

// get_many holds no lock across its reads, so the buckets it noted may change before it looks
// at them again: grown (a new object, the old one freed), emptied (freed), rehashed into a
// doubled directory. Two writer threads churn a map larger than the budget while a third thread's
// batches check every value they get: it is its key's (no value from a freed or reused bucket),
// and a key's version never goes back (no stale one): each writer's versions only grow.
TEST_F(FarptrTest, FarHashMapGetManyWhileWritersChangeBuckets) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  // A fraction of the entries the writers leave (under TSan they do an eighth of the work).
  ASSERT_NO_FATAL_FAILURE(Open(Options("none", (192 << 10) / kTsanScale, 4096)));
  constexpr uint64_t kKeys = 16384;
  const int kOps = 12000 / kTsanScale;       // per writer
  far_hash_map<uint64_t, uint64_t> m(*rt_);  // 64 buckets: the inserts double the directory
  std::atomic<int> writing{2};
  std::vector<std::thread> writers;
  for (uint64_t w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      std::mt19937_64 rng(w + 1);
      uint64_t version = 1;
      for (int i = 0; i < kOps; ++i) {
        const uint64_t k = (rng() % (kKeys / 2)) * 2 + w;  // writer w's keys: k % 2 == w
        if (rng() % 8 == 0) {
          m.erase(k);
        } else {
          m.insert_or_assign(k, (version++ << 32) | k);
        }
      }
      writing.fetch_sub(1);
    });
  }
  std::vector<uint64_t> last(kKeys, 0);  // the highest version seen per key
  uint64_t batches = 0, found = 0, wrong = 0, went_back = 0;
  std::mt19937_64 rng(7);
  std::vector<uint64_t> keys(16);
  std::vector<std::optional<uint64_t>> got(keys.size());
  while (writing.load() > 0 || batches < 50) {
    for (uint64_t& k : keys) k = rng() % kKeys;
    m.get_many(keys, got);
    ++batches;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!got[i]) continue;
      ++found;
      const uint64_t v = *got[i];
      if ((v & 0xffffffffu) != keys[i]) {
        ++wrong;
        continue;
      }
      if ((v >> 32) < last[keys[i]]) ++went_back;
      last[keys[i]] = std::max(last[keys[i]], v >> 32);
    }
  }
  for (std::thread& t : writers) t.join();
  EXPECT_EQ(wrong, 0u) << "values of other keys, in " << found << " found";
  EXPECT_EQ(went_back, 0u) << "values older than one seen before, in " << found << " found";
  EXPECT_GT(found, 0u);
  EXPECT_GT(m.bucket_count(), 64u);
  EXPECT_GT(rt_->stats().swap_ins, 0u);
  // Nothing was lost: every key reads as find says.
  std::vector<uint64_t> all(kKeys);
  for (uint64_t k = 0; k < kKeys; ++k) all[k] = k;
  std::vector<std::optional<uint64_t>> every(kKeys);
  m.get_many(all, every);
  for (uint64_t k = 0; k < kKeys; ++k) ASSERT_EQ(every[k], m.find(k)) << "key " << k;
}

// The single-key operations read a bucket that is not local holding no lock, then look again
// under its stripe (far_hash_map's AtBucket): meanwhile other threads change buckets of the same
// stripes and the same buckets (grown, emptied and freed, rehashed into a doubled directory) and
// the evictor takes them away again. Three threads each own the keys k % 3 == t of a map larger
// than the budget and check every find, insert, insert_or_assign, update and erase against their
// own model (one writer per key: each answer is exact), and all three add to shared counters with
// update (an increment lost or applied twice shows in the sums). The main thread iterates
// meanwhile: every counter (present throughout) is seen exactly once per pass, and every entry
// seen is its key's. At the end iteration and find agree with the models.
TEST_F(FarptrTest, FarHashMapSingleKeyOpsOnSharedStripesUnderEviction) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  ASSERT_NO_FATAL_FAILURE(Open(Options("none", (192 << 10) / kTsanScale, 4096)));
  constexpr uint64_t kThreads = 3;
  constexpr uint64_t kKeys = 24576;    // owned keys: 0 .. kKeys - 1, thread k % kThreads
  constexpr uint64_t kCounters = 256;  // shared: kKeys .. kKeys + kCounters - 1, one per stripe
  const int kOps = 8000 / kTsanScale;  // per thread
  far_hash_map<uint64_t, uint64_t> m(*rt_);  // 64 buckets: the directory doubles under the ops
  // An owned key's value is (version << 32) | key: an entry seen with other low bits is another
  // key's.
  auto value = [](uint64_t k, uint64_t version) { return (version << 32) | k; };
  for (uint64_t k = 0; k < kKeys; k += 2) m.insert(k, value(k, 1));
  for (uint64_t c = 0; c < kCounters; ++c) m.insert(kKeys + c, 0);
  std::vector<std::optional<uint64_t>> model(kKeys);  // entry k written by thread k % kThreads only
  for (uint64_t k = 0; k < kKeys; k += 2) model[k] = value(k, 1);
  std::atomic<uint64_t> wrong{0}, added{0};
  std::atomic<int> running{static_cast<int>(kThreads)};
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t + 11);
      uint64_t version = 2, adds = 0, bad = 0;
      for (int i = 0; i < kOps; ++i) {
        const uint64_t k = (rng() % (kKeys / kThreads)) * kThreads + t;
        std::optional<uint64_t>& want = model[k];
        switch (rng() % 6) {
          case 0:
            bad += m.find(k) != want;
            break;
          case 1: {
            const uint64_t v = value(k, version++);
            auto [it, inserted] = m.insert(k, v);
            bad += inserted == want.has_value();
            if (inserted) want = v;
            bad += it->first != k || it->second != *want;
            break;
          }
          case 2: {
            const uint64_t v = value(k, version++);
            bad += m.insert_or_assign(k, v).second == want.has_value();
            want = v;
            break;
          }
          case 3:
            bad += m.erase(k) != (want.has_value() ? 1u : 0u);
            want.reset();
            break;
          case 4: {
            const bool inserted = m.update(k, [&](uint64_t& v) { v = value(k, (v >> 32) + 1); });
            bad += inserted == want.has_value();
            want = value(k, want ? (*want >> 32) + 1 : 1);
            break;
          }
          default:
            m.update(kKeys + rng() % kCounters, [](uint64_t& v) { ++v; });
            ++adds;
        }
      }
      wrong += bad;
      added += adds;
      running.fetch_sub(1);
    });
  }
  uint64_t passes = 0, iteration_wrong = 0;
  while (running.load() > 0 || passes == 0) {
    std::vector<int> seen(kCounters, 0);
    for (auto [k, v] : m) {
      if (k >= kKeys) {
        ++seen[k - kKeys];
      } else if ((v & 0xffffffffu) != k) {
        ++iteration_wrong;
      }
    }
    for (int n : seen) iteration_wrong += n != 1;
    ++passes;
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0u) << "answers that differ from the owner's model";
  EXPECT_EQ(iteration_wrong, 0u) << "in " << passes << " passes of iteration";
  uint64_t sum = 0;
  for (uint64_t c = 0; c < kCounters; ++c) sum += m.find(kKeys + c).value_or(0);
  EXPECT_EQ(sum, added.load()) << "increments lost or applied twice";
  const RuntimeStats st = rt_->stats();
  EXPECT_GT(st.spans_evicted, 0u);
  EXPECT_GT(st.swap_ins, 0u);
  EXPECT_GT(m.bucket_count(), 64u);
  // Iteration and find agree with the models.
  std::vector<std::optional<uint64_t>> got(kKeys);
  size_t entries = 0;
  for (auto [k, v] : m) {
    ++entries;
    if (k < kKeys) got[k] = v;
  }
  EXPECT_EQ(entries, m.size());
  for (uint64_t k = 0; k < kKeys; ++k) {
    ASSERT_EQ(got[k], model[k]) << "key " << k << " (iteration)";
    ASSERT_EQ(m.find(k), model[k]) << "key " << k << " (find)";
  }
}

// budget_includes_metadata: entries and span tables count against the budget, so frames get what
// is left and frames + metadata stay within the budget (plus one span of slack).
TEST_F(FarptrTest, BudgetIncludesMetadata) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  RuntimeOptions o = Options("none", 2 << 20);
  o.budget_includes_metadata = true;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  std::vector<far_bytes> objs;
  for (uint64_t i = 0; i < 6000; ++i) {  // 6 MiB of objects, 0.4 MiB of entries
    objs.push_back(make_far_bytes_in(*rt_, 1000));
    DerefScope sc;
    Fill(objs.back().deref_mut(sc), i, 1);
  }
  const RuntimeStats s = rt_->stats();
  const uint64_t meta = s.entry_bytes + s.span_meta_bytes + s.frame_cache_bytes;
  EXPECT_GT(s.entry_bytes, 6000u * 40);
  EXPECT_LT(s.frame_budget_bytes, s.local_budget - s.entry_bytes);
  EXPECT_GT(s.frame_budget_bytes, s.local_budget / 2);
  EXPECT_LE(s.local_bytes + meta, s.local_budget + 16384)
      << "frames " << s.local_bytes << " of " << s.frame_budget_bytes << " allowed, entries "
      << s.entry_bytes << ", spans " << s.span_meta_bytes << ", frame cache "
      << s.frame_cache_bytes;
  for (uint64_t i = 0; i < objs.size(); ++i) {
    DerefScope sc;
    ASSERT_TRUE(Matches(objs[i].deref(sc), i, 1)) << "object " << i;
  }
}

}  // namespace
}  // namespace farmem::farptr_test
