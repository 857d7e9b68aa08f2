// Drain of a daemon that holds data for two clients while both run verified I/O (issue 12, tests):
// four farmemd on loopback, started with --drain-timeout; client A is farmem-nbd (two exports, one
// replicate:2 and one none, each under a writer that reads back every write), client B a far_ptr
// Runtime in this process whose writer rewrites and evicts objects. One daemon that holds members
// of all three gets SIGTERM mid-run. It must exit cleanly within its grace period with every lease
// freed (the borrowers moved their data in time), and every byte of both clients reads back as
// last written: the whole of both exports and every far object.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/far_ptr.h"
#include "farmem/runtime.h"
#include "nbd_test_client.h"
#include "support/daemon_fixture.h"
#include "support/object_pattern.h"
#include "support/test_runtime.h"
#include "support/verified_objects.h"
#include "support/wait.h"
#include "test_process.h"
#include "verified_export.h"

namespace farmem::blockdev {
namespace {

using std::chrono::milliseconds;
using testing::Count;
using testing::FarmemNbd;
using testing::VerifiedExport;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kGraceMs = 20000;     // farmemd --drain-timeout
constexpr uint64_t kExportMiB = 16;      // 16 extents of one 1 MiB slab each
constexpr uint32_t kChunk = 256u << 10;  // the NBD writer's unit
constexpr size_t kObjects = 3000;
constexpr size_t kObjectSize = 700;  // ~2 MiB of 16 KiB spans: several 1 MiB slab groups

TEST(DrainTwoClients, SigtermDrainWhileNbdAndFarPtrRunVerifiedIoLosesNothing) {
  farmem::testing::DaemonSet daemons({.capacity = "40M",
                                      .slab_size = "1M",
                                      .extra_args = {"--no-mlock", "--memory-source", "off",
                                                     "--drain-timeout", std::to_string(kGraceMs)}});
  ASSERT_TRUE(daemons.Start(4).ok()) << daemons.Logs();
  std::string peers;
  for (const Endpoint& ep : daemons.endpoints()) {
    peers += (peers.empty() ? "" : ",") + ep.ToString();
  }

  // Client A: farmem-nbd, one export per resilience mode.
  std::vector<std::unique_ptr<VerifiedExport>> exports;
  for (const std::string mode : {"replicate:2", "none"}) {
    auto nbd = FarmemNbd::Launch({"--backend", "farmem", "--peers", peers, "--secret-file",
                                  daemons.work_dir() + "/secret", "--resilience", mode, "--size",
                                  std::to_string(kExportMiB) + "M", "--heartbeat-ms", "100",
                                  "--failure-timeout-ms", "3000"});
    ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
    exports.push_back(
        std::make_unique<VerifiedExport>(mode, std::move(*nbd), kExportMiB << 20, kChunk));
    Status s = exports.back()->Fill();
    ASSERT_TRUE(s.ok()) << mode << ": " << s.ToString() << "\n" << exports.back()->log();
  }

  // Client B: a far_ptr runtime (no redundancy: whatever it holds on the drained daemon must move).
  RuntimeOptions o = farmem::testing::TestRuntimeOptions(daemons.endpoints(), daemons.secret(),
                                                         "none", 256u << 10);
  o.reconcile_interval = milliseconds(500);
  o.auto_compact = false;  // compaction could empty the drained daemon's groups before the notice
  auto rt_or = Runtime::Create(o);
  ASSERT_TRUE(rt_or.has_value()) << rt_or.error().ToString();
  std::unique_ptr<Runtime> rt = std::move(*rt_or);
  farmem::testing::VerifiedFarObjects objs(*rt, kObjects, kObjectSize, "during the drain");
  ASSERT_TRUE(objs.Fill().ok());

  // The daemon to drain: the one holding the first member of the runtime's first (full) group.
  const std::vector<std::vector<Endpoint>> layout = rt->span_set_layout();
  ASSERT_FALSE(layout.empty());
  ASSERT_FALSE(layout[0].empty());
  size_t d = daemons.size();
  for (size_t i = 0; i < daemons.size(); ++i) {
    if (daemons[i].endpoint() == layout[0][0]) d = i;
  }
  ASSERT_LT(d, daemons.size());
  const Endpoint drained = daemons[d].endpoint();
  auto leases_on_drained = [&] {
    for (const client::NodeInfo& n : rt->cluster().nodes()) {
      if (n.endpoint == drained) return n.leases_held;
    }
    return size_t{0};
  };
  ASSERT_GT(leases_on_drained(), 0u);

  // The far_ptr writer: rewrites every seventh object (checking the previous version) and evicts.
  objs.StartWriter();
  for (auto& e : exports) e->StartWriter();

  // All three are doing I/O before the SIGTERM.
  ASSERT_TRUE(farmem::testing::WaitUntil(
      [&] {
        return objs.rounds() >= 2 && exports[0]->rounds() >= 20 && exports[1]->rounds() >= 20;
      },
      milliseconds(30000)))
      << "the workloads did not get going: far rounds " << objs.rounds() << ", nbd rounds "
      << exports[0]->rounds() << "/" << exports[1]->rounds();

  const std::string daemon_log_path = daemons[d].log_path();
  const auto t0 = Clock::now();
  Status stopped = daemons[d].Stop(milliseconds(kGraceMs + 10000));
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  const std::string daemon_log = farmem::testing::ReadFile(daemon_log_path);
  std::printf("SIGTERM to %s (--drain-timeout %u): exited after %lld ms\n",
              drained.ToString().c_str(), kGraceMs, static_cast<long long>(took.count()));
  EXPECT_TRUE(stopped.ok()) << stopped.ToString() << "\n" << daemon_log;
  EXPECT_LT(took, milliseconds(kGraceMs)) << "the daemon did not exit within its grace period";
  EXPECT_EQ(Count(daemon_log, "drain: every lease was freed"), 1u)
      << "the borrowers did not free every lease in time\n"
      << daemon_log;

  // I/O goes on after the daemon is gone, then everything is read back.
  const uint64_t far_after = objs.rounds();
  const uint64_t nbd_after[2] = {exports[0]->rounds(), exports[1]->rounds()};
  EXPECT_TRUE(farmem::testing::WaitUntil(
      [&] {
        return objs.rounds() >= far_after + 2 && exports[0]->rounds() >= nbd_after[0] + 20 &&
               exports[1]->rounds() >= nbd_after[1] + 20;
      },
      milliseconds(30000)))
      << "I/O stalled after the drain";
  objs.Stop();
  for (auto& e : exports) e->Stop();

  ASSERT_EQ(objs.error(), "") << daemons.Logs(1500);
  ASSERT_EQ(objs.Check(), "");
  for (auto& e : exports) ASSERT_NO_FATAL_FAILURE(e->ExpectIntact());

  // Both clients held data on the drained daemon and moved it (nothing was rebuilt as lost).
  const RuntimeStats st = rt->stats();
  std::printf(
      "far_ptr: %lu member(s) moved, longest %lu ms, least slack %lu ms; rounds %lu\n",
      static_cast<unsigned long>(st.members_moved), static_cast<unsigned long>(st.move_max_ms),
      static_cast<unsigned long>(st.move_min_slack_ms), static_cast<unsigned long>(objs.rounds()));
  EXPECT_GT(st.members_moved, 0u);
  EXPECT_EQ(st.members_failed, 0u);
  EXPECT_EQ(st.spans_lost, 0u);
  EXPECT_EQ(st.unrecoverable_span_sets, 0u);
  EXPECT_EQ(leases_on_drained(), 0u);
  for (auto& e : exports) {
    const std::string log = e->log();
    const size_t moved = Count(log, "moved off " + drained.ToString());
    std::printf("farmem-nbd %s: %zu member(s) moved off %s; %lu verified write+read rounds\n",
                e->resilience().c_str(), moved, drained.ToString().c_str(),
                static_cast<unsigned long>(e->rounds()));
    EXPECT_GT(moved, 0u) << e->resilience() << " held nothing on the drained daemon\n" << log;
    EXPECT_EQ(Count(log, "not moved before"), 0u) << log;
    EXPECT_EQ(Count(log, "LOST"), 0u) << log;
    EXPECT_TRUE(e->alive());
  }
}

}  // namespace
}  // namespace farmem::blockdev
