// Memory on demand (issue 12): farmemd takes a slab's memory when it is leased and gives it back
// when the lease ends. Its resident memory at start does not depend on --capacity, grows with
// leases, drops when they are freed, and a slab leased again reads zeros.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "daemon_client.h"
#include "support/daemon_fixture.h"
#include "support/sanitizer.h"

namespace farmem::testing {
namespace {

using std::chrono::milliseconds;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kSlab = 16 * kMiB;

uint64_t RssBytes(pid_t pid) {
  return static_cast<uint64_t>(std::max(0L, ProcStatus(pid, "VmRSS"))) * 1024;
}

class MemoryOnDemandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 4 GiB of --capacity on a test machine: before, this was prefaulted at start.
    ASSERT_TRUE(daemons_.Start(1).ok()) << daemons_.Logs();
    auto c = DaemonClient::Connect(daemons_[0].endpoint(), daemons_.secret());
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    client_.emplace(std::move(*c));
  }
  pid_t pid() { return daemons_[0].pid(); }

  DaemonSet daemons_{{.capacity = "4G", .slab_size = "16M"}};
  std::optional<DaemonClient> client_;
};

TEST_F(MemoryOnDemandTest, StartsSmallGrowsWithLeasesAndGivesMemoryBack) {
  const uint64_t idle = RssBytes(pid());
#if FARMEM_UNDER_ASAN
  // ASan's shadow memory, allocator and quarantine: 72 MiB idle in the fresh-clone ASan run.
  constexpr uint64_t kIdleBound = 192 * kMiB;
#else
  constexpr uint64_t kIdleBound = 64 * kMiB;
#endif
  EXPECT_LT(idle, kIdleBound) << "an idle daemon with --capacity 4G holds its capacity";

  auto leases = client_->Alloc(8);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  auto ch = client_->OpenChannel();
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  std::vector<uint8_t> pattern(kSlab, 0xa5);
  for (const wire::LeaseGrant& g : *leases) {
    ASSERT_TRUE((*ch)->Write(transport::RemoteSlab::From(g), 0, pattern).ok());
  }
  const uint64_t busy = RssBytes(pid());
  EXPECT_GE(busy, idle + 8 * kSlab - 8 * kMiB) << "8 leased and written slabs are not resident";

  std::vector<uint64_t> ids;
  for (const wire::LeaseGrant& g : *leases) ids.push_back(g.lease_id);
  ASSERT_TRUE(client_->Free(ids).ok());
  // FREE returns once the lease ended and its memory was given back (no operation pins it).
  EXPECT_LT(RssBytes(pid()), idle + 2 * kSlab) << "freed slabs stay resident";

  // The same slabs again (the pool reuses them first): zeros, not the old pattern.
  auto again = client_->Alloc(8);
  ASSERT_TRUE(again.has_value()) << again.error().ToString();
  std::vector<uint8_t> got(kSlab);
  for (const wire::LeaseGrant& g : *again) {
    ASSERT_TRUE((*ch)->Read(transport::RemoteSlab::From(g), 0, got).ok());
    for (size_t i = 0; i < got.size(); i += 4096) {
      ASSERT_EQ(got[i], 0) << "lease " << g.lease_id << " offset " << i << " kept old data";
    }
  }
}

}  // namespace
}  // namespace farmem::testing
