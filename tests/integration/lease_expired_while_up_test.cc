// A lease that ends while its daemon stays up (issue 11): farmem-nbd is stopped (SIGSTOP) for
// longer than one daemon's lease TTL, so that daemon reclaims every lease the client held there
// (no heartbeat arrived in time), while the others, with a long TTL, keep theirs. After SIGCONT
// that daemon answers as before — it was never down — but refuses the old leases. The client must
// learn it (not keep using members that are gone, nor wait on them forever), and:
//   none:        exactly the ranges that lived on that daemon are reported LOST and read EIO;
//                everything else reads back as written; nothing reads back wrong;
//   replicate:2: the members on that daemon are rebuilt from the other replica: 0 lost.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "nbd_test_client.h"
#include "support/daemon_fixture.h"
#include "support/lost_ranges.h"
#include "support/wait.h"
#include "test_process.h"

namespace farmem {
namespace {

using blockdev::testing::ChildProcess;
using blockdev::testing::Count;
using blockdev::testing::FarmemNbd;
using blockdev::testing::NbdTestClient;
using blockdev::testing::Pattern;

constexpr uint64_t kExportMiB = 16;
constexpr uint32_t kChunk = 256u << 10;
constexpr uint32_t kShortTtlMs = 1500;  // the daemon that ends the leases
constexpr uint32_t kLongTtlMs = 60000;  // the others keep them through the stop
constexpr uint32_t kFailureTimeoutMs = 1000;
// Longer than the short TTL plus the daemon's reclaim period, much shorter than the long TTL.
constexpr auto kStopped = std::chrono::milliseconds(4 * kShortTtlMs);

// How many leases farmem-nbd's client said `endpoint` ended while up ("... is up but holds ...:
// it ended leases [0x.., 0x.. and N more]"); 0 before it said so.
size_t EndedLeases(const std::string& log, const std::string& endpoint) {
  const size_t line = log.find("(" + endpoint + ") is up but holds");
  if (line == std::string::npos) return 0;
  const size_t open = log.find("it ended leases [", line);
  const size_t close = open == std::string::npos ? open : log.find(']', open);
  if (close == std::string::npos) return 0;
  const std::string ids = log.substr(open, close - open);
  size_t n = Count(ids, "0x");
  std::smatch more;
  if (std::regex_search(ids, more, std::regex(" and (\\d+) more"))) n += std::stoull(more[1]);
  return n;
}

class LeaseExpiredWhileUpTest : public ::testing::TestWithParam<const char*> {};

TEST_P(LeaseExpiredWhileUpTest, ClientLearnsAndReportsOrRebuildsExactlyThoseMembers) {
  const std::string mode = GetParam();
  const std::vector<std::string> args = {"--no-mlock", "--memory-source", "off"};
  testing::DaemonSet short_ttl(
      {.capacity = "40M", .slab_size = "1M", .lease_ttl_ms = kShortTtlMs, .extra_args = args});
  testing::DaemonSet long_ttl(
      {.capacity = "40M", .slab_size = "1M", .lease_ttl_ms = kLongTtlMs, .extra_args = args});
  ASSERT_TRUE(short_ttl.Start(1).ok()) << short_ttl.Logs();
  ASSERT_TRUE(long_ttl.Start(2).ok()) << long_ttl.Logs();
  const std::string expiring = short_ttl[0].endpoint().ToString();
  std::string peers = expiring;
  for (const Endpoint& ep : long_ttl.endpoints()) peers += "," + ep.ToString();
  // Both sets write the fixture's one test secret.
  auto nbd = FarmemNbd::Launch({"--backend", "farmem", "--peers", peers, "--secret-file",
                                short_ttl.work_dir() + "/secret", "--resilience", mode, "--size",
                                std::to_string(kExportMiB) + "M", "--heartbeat-ms", "100",
                                "--failure-timeout-ms", std::to_string(kFailureTimeoutMs)});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  blockdev::testing::ClientOptions co;
  co.timeout = std::chrono::seconds(60);
  auto client = NbdTestClient::Connect((*nbd)->socket_path(), co);
  ASSERT_TRUE(client.has_value()) << client.error().ToString();
  const uint64_t chunks = (kExportMiB << 20) / kChunk;
  for (uint64_t i = 0; i < chunks; ++i) {
    Status s = client->Write(i * kChunk, Pattern(kChunk, 1000 + i));
    ASSERT_TRUE(s.ok()) << "chunk " << i << ": " << s.ToString() << "\n" << (*nbd)->log();
  }

  ChildProcess& proc = (*nbd)->process();
  proc.Signal(SIGSTOP);
  // The length of the stop is the subject: past one daemon's lease TTL.
  std::this_thread::sleep_for(kStopped);
  proc.Signal(SIGCONT);
  ASSERT_TRUE(farmem::testing::WaitUntil(
      [&] {
        return Count(testing::ReadFile(short_ttl[0].log_path()),
                     "expired: its client stopped heartbeating") > 0;
      },
      std::chrono::seconds(10)))
      << "the short-TTL daemon reclaimed nothing: " << short_ttl.Logs();

  // The client learns it from the daemon (which stayed up), and reacts.
  const bool none = mode == "none";
  const bool learned = farmem::testing::WaitUntil(
      [&] {
        const std::string log = (*nbd)->log();
        const size_t ended = EndedLeases(log, expiring);
        if (ended == 0) return false;
        // none: every ended lease held a written extent (the whole export was written), and
        // each is declared LOST on its own; read back only once all of them are.
        return none ? testing::LostRanges(log).size() >= ended
                    : Count(log, "every extent is whole again") > 0 && Count(log, "rebuilt on") > 0;
      },
      std::chrono::seconds(30), std::chrono::milliseconds(20));
  ASSERT_TRUE(learned) << "the client did not learn that " << expiring
                       << " ended its leases while up\n"
                       << (*nbd)->log();

  const std::string log = (*nbd)->log();
  const std::vector<testing::LostRange> lost = testing::LostRanges(log);
  auto in_lost = [&](uint64_t off) { return testing::InLostRange(lost, off); };
  uint64_t failed = 0, failed_outside = 0, read_inside = 0;
  for (uint64_t i = 0; i < chunks; ++i) {
    auto back = client->Read(i * kChunk, kChunk);
    if (!back.has_value()) {
      ++failed;
      failed_outside += in_lost(i * kChunk) ? 0 : 1;
      continue;
    }
    // Never wrong data, wherever it is.
    ASSERT_TRUE(*back == Pattern(kChunk, 1000 + i)) << mode << ": chunk " << i << " read WRONG";
    read_inside += in_lost(i * kChunk) ? 1 : 0;
  }
  std::printf("%s: %zu ranges LOST, %llu chunks of %llu read EIO\n", mode.c_str(), lost.size(),
              static_cast<unsigned long long>(failed), static_cast<unsigned long long>(chunks));
  if (none) {
    EXPECT_GT(failed, 0u) << log;
    EXPECT_EQ(failed_outside, 0u) << "reads failed outside every range reported LOST\n" << log;
    EXPECT_EQ(read_inside, 0u) << "ranges reported LOST read back: they were not lost\n" << log;
  } else {
    EXPECT_TRUE(lost.empty()) << log;
    EXPECT_EQ(failed, 0u) << log;
  }
  // Not a false down: the daemon was never declared down for it.
  EXPECT_EQ(Count(log, "(" + expiring + ") is down"), 0u) << log;
  // And the export still takes writes where the pages were lost.
  for (uint64_t i = 0; i < chunks; ++i) {
    Status s = client->Write(i * kChunk, Pattern(kChunk, 5000 + i));
    ASSERT_TRUE(s.ok()) << "rewriting chunk " << i << ": " << s.ToString() << "\n" << (*nbd)->log();
    auto back = client->Read(i * kChunk, kChunk);
    ASSERT_TRUE(back.has_value()) << "chunk " << i << ": " << back.error().ToString();
    ASSERT_TRUE(*back == Pattern(kChunk, 5000 + i)) << "chunk " << i << " read WRONG after rewrite";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, LeaseExpiredWhileUpTest, ::testing::Values("none", "replicate:2"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "none" ? "none" : "replicate2";
                         });

}  // namespace
}  // namespace farmem
