// far_vector and far_hash_map with a local budget of 1/8 of their size, checked against plain
// in-memory models.
#include <gtest/gtest.h>

#include <random>
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

}  // namespace
}  // namespace farmem::farptr_test
