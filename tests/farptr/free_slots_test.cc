// FreeSlots (farmem/internal/free_slots.h): the free-slot bitmap of a far_ptr span. Sizes around
// the 64-bit word boundaries, lowest-first hand-out, and the compactor's none-free rebuild.
#include "farmem/internal/free_slots.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

namespace farmem::farptr_internal {
namespace {

std::vector<uint32_t> TakeAll(FreeSlots* f) {
  std::vector<uint32_t> out;
  while (!f->empty()) out.push_back(f->Take());
  return out;
}

TEST(FreeSlotsTest, AFreshSpanHandsOutEverySlotOnceLowestFirst) {
  for (uint32_t n : {1u, 2u, 63u, 64u, 65u, 127u, 128u, 129u, 1024u}) {
    FreeSlots f;
    f.Reset(n, true);
    EXPECT_EQ(f.size(), n);
    const std::vector<uint32_t> got = TakeAll(&f);
    ASSERT_EQ(got.size(), n) << n << " slots";
    for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(got[i], i) << n << " slots";
    EXPECT_TRUE(f.empty());
  }
}

TEST(FreeSlotsTest, SlotsPutBackAreTakenAgainLowestFirst) {
  FreeSlots f;
  f.Reset(200, true);
  (void)TakeAll(&f);
  for (uint32_t s : {199u, 5u, 130u, 64u, 63u}) f.Put(s);
  EXPECT_EQ(f.size(), 5u);
  EXPECT_EQ(f.Take(), 5u);
  EXPECT_EQ(f.Take(), 63u);
  f.Put(0);  // below the words already passed
  EXPECT_EQ(f.Take(), 0u);
  EXPECT_EQ(TakeAll(&f), (std::vector<uint32_t>{64, 130, 199}));
}

TEST(FreeSlotsTest, ARebuildFromNoneFreeHoldsExactlyWhatWasPut) {
  // The compactor's rebuild and a span made for lost objects: none free, then the free ones put.
  FreeSlots f;
  f.Reset(300, true);
  (void)f.Take();
  f.Reset(300, false);
  EXPECT_TRUE(f.empty());
  std::set<uint32_t> put;
  for (uint32_t s = 0; s < 300; s += 7) {
    f.Put(s);
    put.insert(s);
  }
  const std::vector<uint32_t> got = TakeAll(&f);
  EXPECT_EQ(std::set<uint32_t>(got.begin(), got.end()), put);
  EXPECT_EQ(got.size(), put.size());
}

TEST(FreeSlotsTest, ReleaseLeavesNothingFreeAndAResetReusesIt) {
  FreeSlots f;
  f.Reset(100, true);
  f.Release();
  EXPECT_TRUE(f.empty());
  f.Reset(3, true);
  EXPECT_EQ(TakeAll(&f), (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(FreeSlots::BytesFor(64), 8u);
  EXPECT_EQ(FreeSlots::BytesFor(65), 16u);
}

}  // namespace
}  // namespace farmem::farptr_internal
