// Regression guard for the data path: once the decode tables of an erasure pattern are cached,
// Decode and ReconstructData (and Encode / UpdateParity always) must not allocate. This binary
// replaces the global operator new with a counting one (tests/support/counting_new.h), so it is
// kept apart from the other tests.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace farmem::ec
