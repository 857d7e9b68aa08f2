// Page-store failure interleavings on the fake transport (tests/support/fake_fabric.h): in-process
// daemons, data ops served from memory, and a script that says exactly which data op of which
// daemon dies, stalls or is refused. Each case runs in well under a second and asserts what is
// read back, not timing. The real-daemon tests (page_store_test.cc) cover the same paths over TCP.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "page_store.h"
#include "support/fake_fabric.h"
#include "support/wait.h"

namespace farmem::blockdev {
namespace {

using farmem::testing::FakeFabric;
using farmem::testing::WaitUntil;
using std::chrono::milliseconds;

constexpr uint64_t kPage = 4096;
constexpr milliseconds kWait{10000};  // a bound on waits for state, never reached when it works

class PageStoreFakeTest : public ::testing::Test {
 protected:
  // `nodes` in-process daemons, a client over the fake transport, an ec:2+1 store of one extent.
  void Start(size_t nodes) {
    fabric_ = std::make_unique<FakeFabric>(farmem::testing::FakeFabricConfig{.nodes = nodes});
    ASSERT_TRUE(fabric_->Start().ok());
    auto c = client::Cluster::Connect(fabric_->ClusterOptionsForTest());
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    cluster_ = std::move(*c);
    PageStoreOptions o;
    o.size = 2 << 20;
    auto r = Resilience::Parse("ec:2+1");
    ASSERT_TRUE(r.has_value());
    o.resilience = *r;
    o.op_timeout = milliseconds(2000);
    o.reconcile_interval = milliseconds(100);
    o.workers = 2;
    auto ps = PageStore::Create(cluster_.get(), o);
    ASSERT_TRUE(ps.has_value()) << ps.error().ToString();
    store_ = std::move(*ps);
  }

  void TearDown() override {
    store_.reset();
    if (cluster_) (void)cluster_->Close();
    cluster_.reset();
    fabric_.reset();
  }

  // The fabric node (index) behind the store's member j of extent 0.
  size_t NodeOfMember(size_t j) const {
    const auto members = store_->extent_members(0);
    if (j >= members.size()) return fabric_->size();
    const Endpoint ep = cluster_->node(members[j].node).endpoint;
    const auto eps = fabric_->endpoints();
    for (size_t i = 0; i < eps.size(); ++i) {
      if (eps[i] == ep) return i;
    }
    return fabric_->size();
  }
  // The fabric node holding no member of extent 0.
  size_t Spare() const {
    for (size_t i = 0; i < fabric_->size(); ++i) {
      bool member = false;
      for (size_t j = 0; j < 3; ++j) member = member || NodeOfMember(j) == i;
      if (!member) return i;
    }
    return fabric_->size();
  }
  client::NodeId IdOf(size_t node) const {
    for (const client::NodeInfo& n : cluster_->nodes()) {
      if (n.endpoint == fabric_->endpoints()[node]) return n.id;
    }
    return 0;
  }

  static std::vector<uint8_t> Pages(size_t n, uint8_t seed) {
    std::vector<uint8_t> b(n * kPage);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(seed + i * 7 + i / 4096);
    return b;
  }
  void ExpectReads(uint64_t offset, const std::vector<uint8_t>& want, const char* when) {
    std::vector<uint8_t> got(want.size());
    Status s = store_->Read(offset, got);
    ASSERT_TRUE(s.ok()) << when << ": " << s.ToString();
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size())) << when;
  }
  void WaitWhole(const char* when) {
    ASSERT_TRUE(WaitUntil(
        [&] {
          const PageStoreStats st = store_->stats();
          return st.degraded_extents == 0 && st.degraded_maps == 0 && !st.rebuild_running &&
                 st.rebuild_queued == 0 && store_->extent_members(0).size() == 3;
        },
        kWait))
        << when << ": the store did not become whole again";
  }

  std::unique_ptr<FakeFabric> fabric_;
  std::unique_ptr<client::Cluster> cluster_;
  std::unique_ptr<PageStore> store_;
};

// ec:2+1 over four daemons. A one-page write round reaches the data members, and the parity
// member's daemon dies with the parity write in flight (held until both data writes were served,
// then the daemon is killed): the write still succeeds (k members hold it), the member is rebuilt
// on the spare, and the rebuilt parity holds the *new* bytes: with a data member killed
// afterwards, the page decodes to what was written.
TEST_F(PageStoreFakeTest, ParityMemberDiesBetweenDataAndParityWrites) {
  ASSERT_NO_FATAL_FAILURE(Start(4));
  const auto old_bytes = Pages(1, 1);
  ASSERT_TRUE(store_->Write(0, old_bytes, true).ok());  // maps extent 0
  const size_t d0 = NodeOfMember(0), d1 = NodeOfMember(1), parity = NodeOfMember(2);
  const size_t spare = Spare();
  ASSERT_LT(spare, fabric_->size());
  const uint64_t d0_before = fabric_->writes(d0), d1_before = fabric_->writes(d1);
  const uint64_t parity_before = fabric_->ops(parity);
  fabric_->Stall(parity, fabric_->Next(parity));
  const auto new_bytes = Pages(1, 99);
  Status w;
  std::thread writer([&] { w = store_->Write(0, new_bytes, true); });
  const bool between = WaitUntil(
      [&] {
        return fabric_->writes(d0) > d0_before && fabric_->writes(d1) > d1_before &&
               fabric_->ops(parity) > parity_before;
      },
      kWait);
  fabric_->Kill(parity);  // the held parity write fails with the daemon
  writer.join();
  ASSERT_TRUE(between) << "the round did not reach all three members";
  ASSERT_TRUE(w.ok()) << w.ToString();
  ASSERT_NO_FATAL_FAILURE(ExpectReads(0, new_bytes, "right after the round"));
  ASSERT_NO_FATAL_FAILURE(WaitWhole("after the parity member died"));
  EXPECT_EQ(NodeOfMember(2), spare) << "parity was not rebuilt on the spare";
  EXPECT_GE(store_->stats().reprotected_extents, 1u);
  // Only the rebuilt parity and one data member are left: they must decode to the new bytes.
  fabric_->Kill(d0);
  ASSERT_NO_FATAL_FAILURE(ExpectReads(0, new_bytes, "from the rebuilt parity"));
  EXPECT_EQ(store_->stats().lost_bytes, 0u);
}

// A data member's daemon refuses exactly one write (the next one) while its control connection
// stays healthy: the write succeeds on the others, the member is failed and rebuilt, and reads
// give the new bytes, also once the other data member is gone.
TEST_F(PageStoreFakeTest, RefusedDataWriteFailsOnlyThatMember) {
  ASSERT_NO_FATAL_FAILURE(Start(4));
  ASSERT_TRUE(store_->Write(0, Pages(4, 3), true).ok());
  const size_t d0 = NodeOfMember(0), d1 = NodeOfMember(1);
  fabric_->Fail(d0, fabric_->Next(d0), RemoteAccessError("scripted: write refused"));
  const auto bytes = Pages(4, 42);
  Status w = store_->Write(kPage * 2, bytes, true);
  ASSERT_TRUE(w.ok()) << w.ToString();
  ASSERT_NO_FATAL_FAILURE(ExpectReads(kPage * 2, bytes, "after the refused write"));
  ASSERT_NO_FATAL_FAILURE(WaitWhole("after the refused write"));
  EXPECT_NE(NodeOfMember(0), d0) << "the member that refused the write was kept";
  fabric_->Kill(d1);
  ASSERT_NO_FATAL_FAILURE(ExpectReads(kPage * 2, bytes, "without the other data member"));
}

// A read during a rebuild: the spare's writes are stalled, so the rebuild of a dead data member
// stays in progress while the extent is read: the read is served degraded from the two survivors
// at once (it neither waits for the rebuild nor makes it give up). Once the spare resumes, the
// rebuild finishes, and the rebuilt member with parity decodes to the bytes written.
TEST_F(PageStoreFakeTest, ReadDuringStalledRebuild) {
  ASSERT_NO_FATAL_FAILURE(Start(4));
  const auto bytes = Pages(16, 5);
  ASSERT_TRUE(store_->Write(0, bytes, true).ok());
  const size_t d0 = NodeOfMember(0), d1 = NodeOfMember(1), spare = Spare();
  fabric_->Stall(spare, fabric_->Next(spare));
  fabric_->Kill(d0);
  ASSERT_TRUE(cluster_->WaitForNode(IdOf(d0), client::NodeState::kDown, kWait).ok());
  ASSERT_TRUE(WaitUntil([&] { return fabric_->ops(spare) > 0; }, kWait))
      << "the rebuild never wrote to the spare";
  ASSERT_NO_FATAL_FAILURE(ExpectReads(0, bytes, "during the rebuild"));
  const PageStoreStats during = store_->stats();
  EXPECT_GT(during.degraded_reads, 0u);
  EXPECT_TRUE(during.rebuild_running) << "the rebuild ended before the read";
  EXPECT_EQ(during.copies_abandoned, 0u) << "the read waited the stalled rebuild out";
  fabric_->Resume(spare);
  ASSERT_NO_FATAL_FAILURE(WaitWhole("after the spare resumed"));
  EXPECT_EQ(NodeOfMember(0), spare);
  fabric_->Kill(d1);  // now member 0 (rebuilt) and parity must hold everything
  ASSERT_NO_FATAL_FAILURE(ExpectReads(0, bytes, "from the rebuilt member"));
  EXPECT_EQ(store_->stats().lost_bytes, 0u);
}

// Three daemons, no spare: the parity member's daemon dies, a write goes on degraded, then the
// daemon comes back as a new process without its leases. The member is rebuilt there (nowhere
// else to go) with the write it missed: with a data member killed afterwards the pages read back
// as last written.
TEST_F(PageStoreFakeTest, DaemonReturnsWithoutLeasesAndIsRebuilt) {
  ASSERT_NO_FATAL_FAILURE(Start(3));
  ASSERT_TRUE(store_->Write(0, Pages(8, 9), true).ok());
  const size_t d0 = NodeOfMember(0), parity = NodeOfMember(2);
  fabric_->Kill(parity);
  ASSERT_TRUE(cluster_->WaitForNode(IdOf(parity), client::NodeState::kDown, kWait).ok());
  const auto missed = Pages(8, 200);
  ASSERT_TRUE(store_->Write(0, missed, true).ok());
  EXPECT_GE(store_->stats().degraded_extents, 1u);
  ASSERT_TRUE(fabric_->Restart(parity).ok());
  ASSERT_TRUE(cluster_->WaitForNode(IdOf(parity), client::NodeState::kUp, kWait).ok());
  ASSERT_NO_FATAL_FAILURE(WaitWhole("after the daemon returned"));
  EXPECT_EQ(NodeOfMember(2), parity);
  fabric_->Kill(d0);
  ASSERT_NO_FATAL_FAILURE(ExpectReads(0, missed, "from the member rebuilt on the returned daemon"));
  EXPECT_EQ(store_->stats().lost_bytes, 0u);
}

}  // namespace
}  // namespace farmem::blockdev
