// Regression guard for the data path: once the decode tables of an erasure pattern are cached,
// Decode and ReconstructData (and Encode / UpdateParity always) must not allocate. This binary
// replaces the global operator new with a counting one (tests/support/counting_new.h), so it is
// kept apart from the other tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <vector>

#include "farmem/ec/reed_solomon.h"
#include "support/counting_new.h"

namespace farmem::ec {
namespace {

TEST(ReedSolomonAllocations, CachedDecodeEncodeAndUpdateDoNotAllocate) {
  auto created = ReedSolomon::Create(4, 2);
  ASSERT_TRUE(created.has_value());
  const ReedSolomon& rs = **created;
  constexpr size_t kLen = 1024;
  std::vector<std::vector<uint8_t>> frags(6, std::vector<uint8_t>(kLen));
  for (int i = 0; i < 4; ++i) {
    for (size_t b = 0; b < kLen; ++b) frags[i][b] = static_cast<uint8_t>(i * 31 + b);
  }
  std::vector<uint8_t*> ptrs;
  for (auto& f : frags) ptrs.push_back(f.data());
  std::vector<const uint8_t*> data(ptrs.begin(), ptrs.begin() + 4);
  std::span<uint8_t* const> parity(ptrs.data() + 4, 2);
  std::vector<uint8_t> new_data(kLen, 0x3C);
  const int erased[] = {1, 4};
  const int present[] = {5, 0, 2, 3};

  // First use builds and caches the tables; that may allocate.
  ASSERT_TRUE(rs.Encode(data, parity, kLen).ok());
  ASSERT_TRUE(rs.Decode(ptrs, erased, kLen).ok());
  ASSERT_TRUE(rs.ReconstructData(ptrs, present, kLen).ok());

  const long before = testing::AllocationCount();
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(rs.Encode(data, parity, kLen).ok());
    ASSERT_TRUE(rs.Decode(ptrs, erased, kLen).ok());
    ASSERT_TRUE(rs.ReconstructData(ptrs, present, kLen).ok());
    ASSERT_TRUE(rs.UpdateParity(2, ptrs[2], new_data.data(), parity, kLen).ok());
    ASSERT_TRUE(rs.UpdateParity(2, new_data.data(), ptrs[2], parity, kLen).ok());
  }
  EXPECT_EQ(testing::AllocationCount() - before, 0);

  // The counter works: a new pattern builds tables, which allocates.
  const int other[] = {0};
  ASSERT_TRUE(rs.Decode(ptrs, other, kLen).ok());
  EXPECT_GT(testing::AllocationCount() - before, 0);
}

// farmem-nbd's degraded reads (the split layout's first k fragments to arrive, the stripe layout's
// first k surviving members) decode any k of the k + r fragments: with the plans prepared at start
// none of them builds one.
TEST(ReedSolomonAllocations, PreparedPlansCoverEveryReconstructPattern) {
  auto created = ReedSolomon::Create(4, 2);
  ASSERT_TRUE(created.has_value());
  const ReedSolomon& rs = **created;
  Result<size_t> plans = rs.PrepareReconstructPlans();
  ASSERT_TRUE(plans.has_value()) << plans.error().ToString();
  EXPECT_EQ(*plans, 14u);  // C(6, 4) sets of 4 present, less the one of the 4 data fragments
  constexpr size_t kLen = 1024;
  std::vector<std::vector<uint8_t>> frags(6, std::vector<uint8_t>(kLen));
  std::vector<std::vector<uint8_t>> want(4, std::vector<uint8_t>(kLen));
  std::vector<uint8_t*> ptrs;
  for (auto& f : frags) ptrs.push_back(f.data());
  for (int i = 0; i < 4; ++i) {
    for (size_t b = 0; b < kLen; ++b) frags[i][b] = static_cast<uint8_t>(i * 53 + b * 7);
    want[i] = frags[i];
  }
  std::vector<const uint8_t*> data(ptrs.begin(), ptrs.begin() + 4);
  ASSERT_TRUE(rs.Encode(data, {ptrs.data() + 4, 2}, kLen).ok());
  const long before = testing::AllocationCount();
  int patterns = 0;
  for (uint32_t mask = 0; mask < 64; ++mask) {  // every 4 of the 6, in every order of arrival
    if (std::popcount(mask) != 4) continue;
    int present[4];
    int n = 0;
    for (int i = 5; i >= 0; --i) {  // parity first: the data the mask leaves out is rebuilt
      if ((mask >> i) & 1) present[n++] = i;
    }
    for (int i = 0; i < 4; ++i) {
      if (((mask >> i) & 1) == 0) std::fill(frags[i].begin(), frags[i].end(), 0);
    }
    ASSERT_TRUE(rs.ReconstructData(ptrs, present, kLen).ok());
    for (int i = 0; i < 4; ++i) ASSERT_EQ(frags[i], want[i]) << "mask " << mask;
    ++patterns;
  }
  EXPECT_EQ(patterns, 15);
  EXPECT_EQ(testing::AllocationCount() - before, 0) << "a reconstruct built a plan";
  EXPECT_EQ(rs.cached_decode_plans(), 14u);
}

TEST(ReedSolomonAllocations, TooManyPatternsToPrepareIsRefused) {
  auto created = ReedSolomon::Create(8, 8);  // C(16, 8) = 12870 patterns
  ASSERT_TRUE(created.has_value());
  Result<size_t> plans = (*created)->PrepareReconstructPlans();
  ASSERT_FALSE(plans.has_value());
  EXPECT_EQ(plans.error().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ((*created)->cached_decode_plans(), 0u);
}

}  // namespace
}  // namespace farmem::ec
