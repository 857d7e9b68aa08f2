// A lender's own programs push it over --reserve while borrowers run verified I/O (issue 12, the
// end-to-end pressure test). One farmemd, the lender, runs in a real memory cgroup with a limit
// (cgroup v1 on these hosts, v2 in the guest; skipped where none can be made); seven more lend
// beside it. Borrowers: farmem-nbd exports with resilience none, replicate:2 and ec-split:4+2, each
// under a writer that reads back every write through the repo's NBD client, and a far_ptr
// runtime in this process rewriting and evicting objects. Then a memory hog starts in the
// lender's cgroup, sized so that what is left is short of the reserve by more than the lender
// lends. The lender must stop granting and notice its leases; every borrower moves its members
// off before the deadline (no lease reaches it), the lender's RSS drops by what it lent, I/O goes
// on; when the hog leaves the lender grants again. At the end every byte reads back: 0 lost, and
// 0 degraded reads in none (a noticed member is copied, never reconstructed or lost).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/metrics.h"
#include "farmem/common/wire.h"
#include "farmem/far_ptr.h"
#include "farmem/runtime.h"
#include "farmem/transport/tcp_connection.h"
#include "support/daemon_fixture.h"
#include "support/memory_cgroup.h"
#include "support/object_pattern.h"
#include "support/test_runtime.h"
#include "support/verified_objects.h"
#include "support/wait.h"
#include "test_process.h"
#include "verified_export.h"

namespace farmem {
namespace {

using blockdev::testing::FarmemNbd;
using blockdev::testing::VerifiedExport;
using std::chrono::milliseconds;
using testing::WaitUntil;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kLimit = 768 * kMiB;    // the lender's cgroup
constexpr uint64_t kReserve = 320 * kMiB;  // its --reserve: more than it can lend (below)
constexpr const char* kLenderCapacity = "192M";
constexpr uint32_t kGraceMs = 30000;  // --evict-grace-ms: long, so a lease at its deadline is a bug
constexpr uint64_t kExportBytes = 32 * kMiB;
constexpr uint32_t kChunk = 256u << 10;
constexpr size_t kObjects = 12000;
constexpr size_t kObjectSize = 1000;  // ~12 MiB of 16 KiB spans: a dozen 1 MiB slabs

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos;
       pos = text.find(needle, pos + needle.size())) {
    ++n;
  }
  return n;
}

uint64_t RssBytes(pid_t pid) {
  return static_cast<uint64_t>(std::max(0L, testing::ProcStatus(pid, "VmRSS"))) * 1024;
}

uint16_t ReadPortFile(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return static_cast<uint16_t>(port);
}

// One metric of a /metrics endpoint on 127.0.0.1 (-1 when it cannot be read).
double Metric(uint16_t port, const char* name, const metrics::Labels& labels = {}) {
  auto r = metrics::HttpGet({"127.0.0.1", port}, "/metrics", DeadlineIn(milliseconds(5000)));
  if (!r.has_value() || r->status != 200) return -1;
  auto samples = metrics::ParseExposition(r->body);
  if (!samples.has_value()) return -1;
  return metrics::Find(*samples, name, labels).value_or(-1);
}

size_t LeasesOn(Runtime& rt, const Endpoint& ep) {
  for (const client::NodeInfo& n : rt.cluster().nodes()) {
    if (n.endpoint == ep) return n.leases_held;
  }
  return 0;
}

// ALLOC of one slab on `ep` over a fresh connection (the lender granting again); freed at once.
Status AllocOne(const Endpoint& ep, const std::string& secret) {
  transport::ChannelOptions o;
  o.endpoint = ep;
  o.credentials.client_id.fill(0x5a);
  o.credentials.client_name = "lender_pressure_test";
  o.credentials.secret = secret;
  FARMEM_ASSIGN_OR_RETURN(transport::TcpConnection conn, transport::TcpConnection::Connect(o));
  std::vector<uint8_t> alloc;
  wire::EncodeAlloc({1}, &alloc);
  FARMEM_ASSIGN_OR_RETURN(auto body, conn.Call(wire::Opcode::kAlloc, alloc, milliseconds(10000)));
  FARMEM_ASSIGN_OR_RETURN(wire::AllocReply r, wire::DecodeAllocReply(body));
  std::vector<uint8_t> free;
  wire::EncodeFree({{r.leases.at(0).lease_id}}, &free);
  FARMEM_ASSIGN_OR_RETURN(auto fb, conn.Call(wire::Opcode::kFree, free, milliseconds(10000)));
  (void)fb;
  return Status::Ok();
}

TEST(LenderPressure, HogInTheLendersCgroupMovesEveryBorrowerOffAndNothingIsLost) {
  testing::MemoryCgroup cg("farmem-lender", kLimit);
  if (!cg.ok()) GTEST_SKIP() << cg.why();

  // The lender: in the cgroup before it grants anything (memory is charged where it is touched).
  testing::TempDir tmp;
  const std::string lender_metrics = tmp.File("lender-metrics-port");
  testing::DaemonSet lender(
      {.capacity = kLenderCapacity,
       .slab_size = "1M",
       .extra_args = {"--memory-source", "cgroup:" + cg.dir().string(), "--reserve",
                      std::to_string(kReserve / kMiB) + "M", "--evict-grace-ms",
                      std::to_string(kGraceMs), "--pressure-interval-ms", "100", "--metrics-listen",
                      "127.0.0.1:0", "--metrics-port-file", lender_metrics}});
  ASSERT_TRUE(lender.Start(1).ok()) << lender.Logs();
  const pid_t lender_pid = lender[0].pid();
  ASSERT_TRUE(cg.Join(lender_pid)) << "cannot move farmemd into " << cg.dir();
  const Endpoint lender_ep = lender[0].endpoint();
  ASSERT_TRUE(WaitUntil([&] { return ReadPortFile(lender_metrics) != 0; }, milliseconds(10000)));
  const uint16_t lender_port = ReadPortFile(lender_metrics);
  ASSERT_NE(lender_port, 0) << lender.Logs();
  // Seven more small ones: room for everything the lender holds, on enough nodes for ec:4+2.
  testing::DaemonSet others({.capacity = "96M",
                             .slab_size = "1M",
                             .extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(others.Start(7).ok()) << others.Logs();
  std::string peers = lender_ep.ToString();
  for (const Endpoint& ep : others.endpoints()) peers += "," + ep.ToString();
  ASSERT_EQ(lender.secret(), others.secret());

  // Borrower 1: farmem-nbd, one export per resilience mode, each filled and then under a writer.
  std::vector<std::unique_ptr<VerifiedExport>> exports;
  std::vector<uint16_t> export_ports;
  // ec-split:4+2: the split layout, whose moves this test counts in its log ("moved off") and in
  // farmem_export_moved_bytes_total (the stripe layout does not report moved bytes yet).
  for (const std::string mode : {"none", "replicate:2", "ec-split:4+2"}) {
    const std::string port_file = tmp.File("nbd-metrics-" + std::to_string(exports.size()));
    auto nbd = FarmemNbd::Launch({"--backend", "farmem", "--peers", peers, "--secret-file",
                                  lender.work_dir() + "/secret", "--resilience", mode, "--size",
                                  std::to_string(kExportBytes / kMiB) + "M", "--heartbeat-ms",
                                  "100", "--failure-timeout-ms", "5000", "--metrics-listen",
                                  "127.0.0.1:0", "--metrics-port-file", port_file});
    ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
    exports.push_back(
        std::make_unique<VerifiedExport>(mode, std::move(*nbd), kExportBytes, kChunk));
    Status s = exports.back()->Fill();
    ASSERT_TRUE(s.ok()) << mode << ": " << s.ToString() << "\n" << exports.back()->log();
    ASSERT_TRUE(WaitUntil([&] { return ReadPortFile(port_file) != 0; }, milliseconds(10000)));
    export_ports.push_back(ReadPortFile(port_file));
  }
  auto held_on_lender = [&](size_t e) {
    return Metric(export_ports[e], "farmem_export_daemon_leased_bytes",
                  {{"daemon", lender_ep.ToString()}});
  };

  // Borrower 2: a far_ptr runtime without redundancy (what it holds on the lender must move).
  std::vector<Endpoint> far_peers = lender.endpoints();
  for (const Endpoint& ep : others.endpoints()) far_peers.push_back(ep);
  RuntimeOptions o = testing::TestRuntimeOptions(far_peers, lender.secret(), "none", 256u << 10);
  o.failure_timeout = milliseconds(5000);
  o.op_timeout = milliseconds(3000);
  o.reconcile_interval = milliseconds(500);
  o.auto_compact = false;  // compaction could empty the lender's groups before the notice
  auto rt_or = Runtime::Create(o);
  ASSERT_TRUE(rt_or.has_value()) << rt_or.error().ToString();
  std::unique_ptr<Runtime> rt = std::move(*rt_or);
  testing::VerifiedFarObjects objs(*rt, kObjects, kObjectSize, "under pressure");
  ASSERT_TRUE(objs.Fill().ok());
  // Power-of-two choices samples the lender for a slab one time in four (two of eight daemons;
  // then it is the emptiest): the dozen slabs of kObjects miss it in ~3% of runs. Add objects
  // until the runtime holds a lease there (bounded: four times as many).
  while (LeasesOn(*rt, lender_ep) == 0 && objs.size() < 4 * kObjects) {
    ASSERT_TRUE(objs.Add(kObjects / 12).ok());
  }

  // Every borrower holds something on the lender (placement favours it: it is the emptiest).
  for (size_t e = 0; e < exports.size(); ++e) {
    ASSERT_GT(held_on_lender(e), 0) << exports[e]->resilience() << " put nothing on the lender";
  }
  ASSERT_GT(LeasesOn(*rt, lender_ep), 0u) << "the far_ptr runtime put nothing on the lender";

  objs.StartWriter();
  for (auto& e : exports) e->StartWriter();
  auto io_going = [&](uint64_t far_from, const std::vector<uint64_t>& nbd_from) {
    if (objs.rounds() < far_from + 2) return false;
    for (size_t e = 0; e < exports.size(); ++e) {
      if (exports[e]->rounds() < nbd_from[e] + 20) return false;
    }
    return true;
  };
  auto nbd_rounds = [&] {
    std::vector<uint64_t> r;
    for (auto& e : exports) r.push_back(e->rounds());
    return r;
  };
  ASSERT_TRUE(WaitUntil(
      [&] {
        return io_going(0, {0, 0, 0});
      },
      milliseconds(60000)))
      << "the workloads did not get going";

  // The hog: what the cgroup has left becomes the reserve minus all the lender lends, minus 16
  // MiB, so every lease must go; and even then the lender stays short (it grants nothing until
  // the hog leaves). reserve > lent + 16 MiB keeps the cgroup under its limit (no OOM).
  const double lent = Metric(lender_port, "farmem_daemon_lent_bytes");
  ASSERT_GT(lent, 0);
  const uint64_t lent_bytes = static_cast<uint64_t>(lent);
  ASSERT_LT(lent_bytes + 32 * kMiB, kReserve);
  const uint64_t rss_before = RssBytes(lender_pid);
  const uint64_t usage = cg.Usage();
  ASSERT_GT(usage, 0u) << "cannot read the cgroup's usage";
  ASSERT_GT(kLimit, usage + kReserve - lent_bytes);
  const uint64_t hog_bytes = kLimit - usage - kReserve + lent_bytes + 16 * kMiB;
  std::printf(
      "lender %s lends %.0f MiB (RSS %lu MiB, cgroup usage %lu MiB of %lu MiB); hog %lu "
      "MiB\n",
      lender_ep.ToString().c_str(), lent / kMiB, static_cast<unsigned long>(rss_before / kMiB),
      static_cast<unsigned long>(usage / kMiB), static_cast<unsigned long>(kLimit / kMiB),
      static_cast<unsigned long>(hog_bytes / kMiB));
  testing::MemoryHog hog;
  const auto onset = Clock::now();
  ASSERT_TRUE(hog.Start(cg, hog_bytes)) << "the hog did not start";

  // Under pressure: no grants, notices sent, every lease freed by its borrower (none reached the
  // deadline), the lender's RSS down by at least 90% of what it lent.
  ASSERT_TRUE(WaitUntil([&] { return Metric(lender_port, "farmem_daemon_under_pressure") == 1; },
                        milliseconds(20000)))
      << lender.Logs();
  ASSERT_TRUE(WaitUntil([&] { return Metric(lender_port, "farmem_daemon_leases") == 0; },
                        milliseconds(kGraceMs + 10000)))
      << "leases still held on the lender: " << Metric(lender_port, "farmem_daemon_leases") << "\n"
      << lender.Logs(3000);
  const auto all_moved = Clock::now();
  ASSERT_TRUE(WaitUntil([&] { return RssBytes(lender_pid) + lent_bytes * 9 / 10 <= rss_before; },
                        milliseconds(10000)))
      << "RSS did not drop: " << RssBytes(lender_pid) / kMiB << " MiB (before " << rss_before / kMiB
      << " MiB, lent " << lent_bytes / kMiB << " MiB)";
  std::printf(
      "hog onset -> every lease moved off the lender: %lld ms; RSS %lu -> %lu MiB\n",
      static_cast<long long>(std::chrono::duration_cast<milliseconds>(all_moved - onset).count()),
      static_cast<unsigned long>(rss_before / kMiB),
      static_cast<unsigned long>(RssBytes(lender_pid) / kMiB));
  EXPECT_GE(Metric(lender_port, "farmem_daemon_evict_notices_total"), 4)
      << "one notice per borrower (three exports, one runtime)";
  EXPECT_EQ(Metric(lender_port, "farmem_daemon_leases_evicted_total"), 0)
      << "a lease reached its deadline\n"
      << lender.Logs(3000);
  for (size_t e = 0; e < exports.size(); ++e) {
    EXPECT_EQ(held_on_lender(e), 0) << exports[e]->resilience();
  }
  EXPECT_EQ(LeasesOn(*rt, lender_ep), 0u);
  // The lender grants nothing while the hog stays (its reserve is still short).
  EXPECT_FALSE(AllocOne(lender_ep, lender.secret()).ok()) << "granted a slab under pressure";

  // I/O goes on with the hog there, then the hog leaves and the lender grants again.
  const uint64_t far_now = objs.rounds();
  const std::vector<uint64_t> nbd_now = nbd_rounds();
  EXPECT_TRUE(WaitUntil([&] { return io_going(far_now, nbd_now); }, milliseconds(60000)))
      << "I/O stalled after the move";
  const uint64_t rss_low = RssBytes(lender_pid);
  hog.Stop();
  ASSERT_TRUE(WaitUntil([&] { return Metric(lender_port, "farmem_daemon_under_pressure") == 0; },
                        milliseconds(20000)))
      << lender.Logs(2000);
  Status granted = AllocOne(lender_ep, lender.secret());
  EXPECT_TRUE(granted.ok()) << "the lender does not grant after the hog left: "
                            << granted.ToString();

  objs.Stop();
  for (auto& e : exports) e->Stop();

  // Every byte reads back as last written.
  ASSERT_EQ(objs.error(), "");
  ASSERT_EQ(objs.Check(), "");
  for (auto& e : exports) ASSERT_NO_FATAL_FAILURE(e->ExpectIntact());

  const RuntimeStats st = rt->stats();
  std::printf("far_ptr: %lu member(s) moved, longest %lu ms; %lu rounds\n",
              static_cast<unsigned long>(st.members_moved),
              static_cast<unsigned long>(st.move_max_ms),
              static_cast<unsigned long>(objs.rounds()));
  EXPECT_GT(st.members_moved, 0u);
  EXPECT_EQ(st.members_failed, 0u);
  EXPECT_EQ(st.spans_lost, 0u);
  EXPECT_EQ(st.unrecoverable_span_sets, 0u);
  for (size_t e = 0; e < exports.size(); ++e) {
    const std::string log = exports[e]->log();
    const size_t moved = Count(log, "moved off " + lender_ep.ToString());
    std::printf("farmem-nbd %s: %zu member(s) moved off the lender; %lu verified rounds\n",
                exports[e]->resilience().c_str(), moved,
                static_cast<unsigned long>(exports[e]->rounds()));
    EXPECT_GT(moved, 0u) << exports[e]->resilience() << "\n" << log;
    EXPECT_EQ(Count(log, "not moved before"), 0u) << log;
    EXPECT_EQ(Metric(export_ports[e], "farmem_export_lost_bytes_total"), 0)
        << exports[e]->resilience();
    // The moves are counted where an operator sees them: one per member the log says it moved,
    // none missed.
    EXPECT_EQ(Metric(export_ports[e], "farmem_export_moved_members_total"),
              static_cast<double>(moved))
        << exports[e]->resilience();
    EXPECT_GT(Metric(export_ports[e], "farmem_export_moved_bytes_total"), 0)
        << exports[e]->resilience();
    EXPECT_EQ(Metric(export_ports[e], "farmem_export_moves_missed_total"), 0)
        << exports[e]->resilience();
    EXPECT_TRUE(exports[e]->alive());
  }
  EXPECT_EQ(Metric(export_ports[0], "farmem_export_degraded_reads_total"), 0)
      << "none: a noticed member must be copied, not lost\n"
      << exports[0]->log();
  EXPECT_GE(RssBytes(lender_pid) + 4 * kMiB, rss_low) << "RSS after the hog left";
}

}  // namespace
}  // namespace farmem
