// Remote compaction: freeing and re-allocating half the objects, many times over, must not make
// remote usage grow: span sets with holes and sparse spans are merged into full ones and their
// slabs go back to the daemons.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "farptr_fixture.h"

namespace farmem::farptr_test {
namespace {

struct Obj {
  uint64_t id;
  uint64_t version;
  char pad[184];
};

TEST_F(FarptrTest, RemoteUsageTracksLiveDataUnderChurn) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  constexpr size_t kObjects = 24000;  // ~4.6 MiB
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", kObjects * sizeof(Obj) / 8)));
  const double expansion = 1.0 + 2.0 / 4.0;
  std::vector<far_ptr<Obj>> objs(kObjects);
  std::vector<uint64_t> ids(kObjects);
  uint64_t next = 0;
  for (size_t i = 0; i < kObjects; ++i) {
    ids[i] = next++;
    objs[i] = make_far_in<Obj>(*rt_, Obj{ids[i], 0, {}});
  }
  std::mt19937_64 rng(5);
  for (int round = 0; round < 12 / kTsanScale + 2; ++round) {
    // Free a random half, then allocate as many new objects.
    std::vector<size_t> order(kObjects);
    for (size_t i = 0; i < kObjects; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t j = 0; j < kObjects / 2; ++j) objs[order[j]].reset();
    for (size_t j = 0; j < kObjects / 2; ++j) {
      const size_t i = order[j];
      ids[i] = next++;
      objs[i] = make_far_in<Obj>(*rt_, Obj{ids[i], static_cast<uint64_t>(round), {}});
    }
    ASSERT_TRUE(rt_->Compact().ok());
    const RuntimeStats st = rt_->stats();
    const double live = static_cast<double>(st.object_bytes);
    const double remote_live = static_cast<double>(st.remote_object_bytes);
    std::fprintf(stderr,
                 "round %2d: live %.2f MiB (remote %.2f MiB), span sets %.2f MiB = %.2f x "
                 "remote live, leased %.2f MiB = %.2f x live; compacted %lu -> %lu spans\n",
                 round, live / 1048576, remote_live / 1048576, st.remote_set_bytes / 1048576.0,
                 st.remote_set_bytes / remote_live, st.remote_leased_bytes / 1048576.0,
                 st.remote_leased_bytes / live, st.compaction_spans_in, st.compaction_spans_out);
    // The bound of the issue, on the memory span sets occupy, against the live data they hold.
    EXPECT_LE(static_cast<double>(st.remote_set_bytes), expansion * remote_live * 1.25)
        << "round " << round;
    // Slabs are lent whole: allow one slab group being filled beyond the same bound on all live
    // data, and the one leased ahead of need (RuntimeOptions::lease_ahead).
    const double group_bytes = 6.0 * (1 << 20);
    EXPECT_LE(static_cast<double>(st.remote_leased_bytes),
              expansion * live * 1.25 + 2 * group_bytes)
        << "round " << round;
  }
  EXPECT_GT(rt_->stats().compactions, 0u);
  for (size_t i = 0; i < kObjects; ++i) {
    DerefScope s;
    ASSERT_EQ(objs[i].deref(s).id, ids[i]) << "object " << i;
  }
}

}  // namespace
}  // namespace farmem::farptr_test
