// Access reports (issue 12), end to end: a client counts its data operations per lease and
// reports them on HEARTBEAT, and under memory pressure the daemon evicts the leases that are cold
// by the report. The daemon cannot see one-sided RDMA operations, which is what the report is
// for; these machines have no RDMA device, so the test runs over TCP with the daemon ignoring
// the operations it serves (--access-counts reported) and the client reporting its TCP ones
// (ClusterOptions::report_tcp_accesses): victim choice then knows only what the client said.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <set>

#include "client_options.h"
#include "farmem/client/cluster.h"
#include "support/daemon_fixture.h"
#include "support/fake_cgroup.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;
using test::LeaseIds;
using test::OptionsFor;
using testing::DaemonSet;
using testing::WaitUntil;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kLimit = 1024 * kMiB;
constexpr uint64_t kReserve = 100 * kMiB;

// Heartbeats the client sent node 0 after this call: waits until its last contact moved on
// `beats` times (each heartbeat reply sets it).
bool WaitForHeartbeats(Cluster& cl, int beats) {
  for (int i = 0; i < beats; ++i) {
    const Clock::time_point seen = cl.node(0).last_contact;
    if (!WaitUntil([&] { return cl.node(0).last_contact > seen; }, milliseconds(5000))) {
      return false;
    }
  }
  return true;
}

TEST(AccessReportTest, LeasesColdByTheClientsReportAreEvictedFirst) {
  testing::FakeCgroup cgroup(kLimit);
  // The grace is long: nobody moves anything here, the test only looks at who was noticed.
  DaemonSet daemons(
      {.capacity = "16M",
       .slab_size = "1M",
       .extra_args = cgroup.LenderArgs({.reserve = kReserve,
                                        .grace = milliseconds(60000),
                                        .interval = milliseconds(50),
                                        .sample_extra = 4},
                                       {"--no-mlock", "--access-counts", "reported"})});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();

  ClusterOptions o = OptionsFor(daemons, "reporter");
  o.report_tcp_accesses = true;
  auto cl = Cluster::Connect(o);
  ASSERT_TRUE(cl.has_value()) << cl.error().ToString() << daemons.Logs();
  std::mutex mu;
  std::vector<Event> notices;
  (*cl)->Subscribe([&](const Event& e) {
    if (e.type != EventType::kEvictNotice) return;
    std::lock_guard lock(mu);
    notices.push_back(e);
  });

  // Eight leases: the client hammers four (A) and never touches the other four (B).
  auto leases = (*cl)->Allocate(8);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  const std::span<const Lease> hot(leases->data(), 4), cold(leases->data() + 4, 4);
  constexpr int kOpsPerLease = 50;
  {
    auto ch = (*cl)->OpenChannel(0);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    std::vector<uint8_t> page(4096, 0x5a), back(4096);
    for (const Lease& l : hot) {
      for (int i = 0; i < kOpsPerLease / 2; ++i) {
        ASSERT_TRUE((*ch)->Write(l.slab(), 4096 * i, page).ok());
        ASSERT_TRUE((*ch)->Read(l.slab(), 4096 * i, back).ok());
      }
    }
  }
  // Every operation reaches the daemon in a heartbeat's report, and only once.
  constexpr uint64_t kTotal = 4 * kOpsPerLease;
  ASSERT_TRUE(
      WaitUntil([&] { return (*cl)->node(0).accesses_reported >= kTotal; }, milliseconds(5000)))
      << "reported " << (*cl)->node(0).accesses_reported << " of " << kTotal << " operations\n"
      << daemons.Logs();
  ASSERT_TRUE(WaitForHeartbeats(**cl, 2));
  EXPECT_EQ((*cl)->node(0).accesses_reported, kTotal);

  // 4 MiB short of the reserve: the daemon evicts four 1 MiB slabs, the four least active of a
  // sample of 4 + 4 (all eight). It counts none of the operations itself: without the report
  // all eight look idle and the four are picked by sample order.
  cgroup.SetAvailable(kReserve - 4 * kMiB);
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard lock(mu);
        std::set<uint64_t> noticed;
        for (const Event& e : notices) noticed.insert(e.lease_ids.begin(), e.lease_ids.end());
        return noticed.size() >= 4;
      },
      milliseconds(10000)))
      << daemons.Logs();
  std::set<uint64_t> noticed;
  {
    std::lock_guard lock(mu);
    for (const Event& e : notices) noticed.insert(e.lease_ids.begin(), e.lease_ids.end());
  }
  EXPECT_EQ(noticed, LeaseIds(cold)) << "the hammered leases were noticed; daemon log:\n"
                                     << daemons.Logs();
}

TEST(AccessReportTest, TcpOperationsAreNotReportedByDefault) {
  // The daemon counts the TCP operations it serves: a client reporting them too would count them
  // twice. Only one-sided (verbs) operations go into the report unless a test asks for tcp.
  DaemonSet daemons({.extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto cl = Cluster::Connect(OptionsFor(daemons, "plain"));
  ASSERT_TRUE(cl.has_value()) << cl.error().ToString();
  auto leases = (*cl)->Allocate(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  auto ch = (*cl)->OpenChannel(0);
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  ASSERT_STREQ((*ch)->kind(), "tcp");
  std::vector<uint8_t> page(4096, 0x11);
  for (const Lease& l : *leases) {
    for (int i = 0; i < 20; ++i) ASSERT_TRUE((*ch)->Write(l.slab(), 0, page).ok());
  }
  ASSERT_TRUE(WaitForHeartbeats(**cl, 3)) << daemons.Logs();
  EXPECT_EQ((*cl)->node(0).accesses_reported, 0u);
}

}  // namespace
}  // namespace farmem::client
