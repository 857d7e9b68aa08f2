// The borrower itself descheduled (issue 11, "failure detection never blames a daemon for local
// stalls"): farmem-nbd gets SIGSTOP for several failure timeouts (but less than the daemons' lease
// TTL) while a verifying writer runs against its export, then SIGCONT. Every daemon answered all
// along, so none may be declared down on the client's account — or, if one is, its leases must
// come back as they were; the writer sees no I/O error, and the whole export reads back as last
// written. Run for none (a false down there would cost data) and replicate:2.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "support/daemon_fixture.h"
#include "support/wait.h"
#include "test_process.h"
#include "verified_export.h"

namespace farmem::blockdev {
namespace {

using testing::ChildProcess;
using testing::Count;
using testing::FarmemNbd;
using testing::VerifiedExport;

constexpr uint64_t kExportMiB = 16;
constexpr uint32_t kFailureTimeoutMs = 1000;
constexpr uint32_t kLeaseTtlMs = 10000;
// Stopped for four failure timeouts: long enough that every heartbeat deadline has passed when
// the process runs again, well short of the lease TTL (the daemons keep the leases).
constexpr auto kStopped = std::chrono::milliseconds(4 * kFailureTimeoutMs);

class DescheduledClientTest : public ::testing::TestWithParam<const char*> {};

TEST_P(DescheduledClientTest, SigstopOfTheBorrowerBlamesNoDaemonAndLosesNothing) {
  const std::string mode = GetParam();
  farmem::testing::DaemonSet daemons({.capacity = "40M",
                                      .slab_size = "1M",
                                      .lease_ttl_ms = kLeaseTtlMs,
                                      .extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(3).ok()) << daemons.Logs();
  std::string peers;
  for (const Endpoint& ep : daemons.endpoints()) {
    peers += (peers.empty() ? "" : ",") + ep.ToString();
  }
  auto nbd = FarmemNbd::Launch(
      {"--backend", "farmem", "--peers", peers, "--secret-file", daemons.work_dir() + "/secret",
       "--resilience", mode, "--size", std::to_string(kExportMiB) + "M", "--heartbeat-ms", "100",
       "--failure-timeout-ms", std::to_string(kFailureTimeoutMs), "--log-level", "info"});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  VerifiedExport exp(mode, std::move(*nbd), kExportMiB << 20);
  Status filled = exp.Fill();
  ASSERT_TRUE(filled.ok()) << filled.ToString() << "\n" << exp.log();
  exp.StartWriter();
  ASSERT_TRUE(
      farmem::testing::WaitUntil([&] { return exp.rounds() >= 20; }, std::chrono::seconds(30)))
      << exp.log();

  ChildProcess& proc = exp.nbd().process();
  proc.Signal(SIGSTOP);
  // The length of the stop is the subject here.
  std::this_thread::sleep_for(kStopped);
  proc.Signal(SIGCONT);

  // The writer goes on: as many rounds again after the stop as before it.
  const uint64_t after = exp.rounds();
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return exp.rounds() >= after + 40 || !exp.alive(); },
                                         std::chrono::seconds(60)))
      << "the writer made no progress after SIGCONT\n"
      << exp.log();
  // Every heartbeat round that was due while it was stopped has run since.
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return exp.rounds() >= after + 80; },
                                         std::chrono::seconds(60)))
      << exp.log();
  exp.Stop();
  ASSERT_TRUE(exp.alive()) << exp.log();
  exp.ExpectIntact();

  const std::string log = exp.log();
  // A false down must not have cost anything: no lease given up, no page declared lost, no
  // request failed. A down line is allowed only if its leases came back.
  const size_t downs = Count(log, ") is down (");
  const size_t returned = Count(log, "answered again as the same daemon");
  EXPECT_LE(downs, returned) << "a daemon was declared down and its leases did not come back\n"
                             << log;
  EXPECT_EQ(Count(log, "leases lost"), 0u) << log;
  EXPECT_EQ(Count(log, "no longer holds leases"), 0u) << log;
  EXPECT_EQ(Count(log, "has ended leases"), 0u) << log;
  EXPECT_EQ(Count(log, "are LOST"), 0u) << log;
  EXPECT_EQ(Count(log, "failed: IoError"), 0u) << log;
  std::printf("%s: stopped %lld ms: %zu daemons declared down (%zu leases-returned lines)\n",
              mode.c_str(), static_cast<long long>(kStopped.count()), downs, returned);
}

INSTANTIATE_TEST_SUITE_P(Modes, DescheduledClientTest, ::testing::Values("none", "replicate:2"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "none" ? "none" : "replicate2";
                         });

}  // namespace
}  // namespace farmem::blockdev
