// Metrics and status (issue 14): farmemd and farmem-nbd with --metrics-listen on loopback, real
// I/O through the export (nbdcopy), scraped with a real HTTP client (curl); the exposition must
// parse strictly (metrics::ParseExposition, what Prometheus accepts) and its numbers must match
// what the test did. Bad HTTP input gets an error and a close, and both programs keep serving.
// `farmemctl stat --json` is parsed by a JSON parser nobody here wrote (python3's), and the
// documented exit codes hold with a daemon down; so do `farmemctl export stat`'s.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "farmem/common/metrics.h"
#include "farmem/common/socket.h"
#include "support/daemon_fixture.h"

namespace farmem {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::CommandResult;
using testing::RunCommand;
using testing::WaitUntil;

constexpr uint64_t kIoBytes = 4 << 20;

uint16_t ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return static_cast<uint16_t>(port);
}

bool WaitForPortFile(const std::string& path) {
  return WaitUntil([&] { return ReadPort(path) != 0; }, milliseconds(20000));
}

// GET /metrics with curl; the parsed samples (the test fails on a malformed exposition).
std::vector<metrics::Sample> Scrape(uint16_t port) {
  const CommandResult r = RunCommand({"curl", "-sS", "--fail", "--max-time", "10",
                                      fmt::format("http://127.0.0.1:{}/metrics", port)},
                                     seconds(20));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto samples = metrics::ParseExposition(r.out);
  EXPECT_TRUE(samples.has_value()) << (samples ? "" : samples.error().ToString()) << "\n" << r.out;
  return samples ? *samples : std::vector<metrics::Sample>{};
}

double Value(const std::vector<metrics::Sample>& s, const char* name,
             const metrics::Labels& labels = {}) {
  auto v = metrics::Find(s, name, labels);
  EXPECT_TRUE(v.has_value()) << name;
  return v.value_or(-1);
}

// Sends raw bytes, returns what came back before the server closed.
std::string RawHttp(uint16_t port, const std::string& bytes) {
  auto s = ConnectTcp({"127.0.0.1", port}, DeadlineIn(seconds(5)));
  if (!s) return "connect failed: " + s.error().ToString();
  (void)SendAll(s->fd(), {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()},
                DeadlineIn(seconds(5)));
  ::shutdown(s->fd(), SHUT_WR);
  std::string out;
  uint8_t buf[4096];
  for (;;) {
    iovec iov{buf, sizeof buf};
    auto n = RecvSome(s->fd(), &iov, 1, DeadlineIn(seconds(10)));
    if (!n) break;
    out.append(reinterpret_cast<char*>(buf), *n);
  }
  return out;
}

void ExpectBadInputIsRefused(uint16_t port) {
  std::string got = RawHttp(port, "\x16\x03\x01 not http at all\r\n\r\n");
  EXPECT_TRUE(got.starts_with("HTTP/1.1 400 ")) << got;
  got = RawHttp(port, "GET /metrics HTTP/1.1\r\n" + std::string(9000, 'x') + "\r\n\r\n");
  EXPECT_TRUE(got.starts_with("HTTP/1.1 431 ")) << got;
  got = RawHttp(port, "DELETE /metrics HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(got.starts_with("HTTP/1.1 405 ")) << got;
  const CommandResult notfound = RunCommand({"curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                             fmt::format("http://127.0.0.1:{}/admin", port)},
                                            seconds(20));
  EXPECT_EQ(notfound.out, "404");
}

// The metric names deploy/grafana/farmem.json queries (one per mention).
std::vector<std::string> DashboardMetrics() {
  const char* src = std::getenv("FARMEM_SOURCE_DIR");
  EXPECT_NE(src, nullptr);
  if (src == nullptr) return {};
  const std::string dash = testing::ReadFile(std::string(src) + "/deploy/grafana/farmem.json");
  EXPECT_FALSE(dash.empty());
  std::vector<std::string> names;
  for (size_t at = dash.find("farmem_"); at != std::string::npos;
       at = dash.find("farmem_", at + 1)) {
    if (at > 0 && (std::isalnum(static_cast<unsigned char>(dash[at - 1])) || dash[at - 1] == '_' ||
                   dash[at - 1] == '-')) {
      continue;  // part of another word ("farmem-overview")
    }
    size_t end = at;
    while (end < dash.size() &&
           (std::isalnum(static_cast<unsigned char>(dash[end])) || dash[end] == '_'))
      ++end;
    names.push_back(dash.substr(at, end - at));
  }
  return names;
}

class MetricsStatusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    if (!testing::HaveProgram("curl") || !testing::HaveProgram("nbdcopy") ||
        !testing::HaveProgram("python3")) {
      GTEST_SKIP() << "needs curl, nbdcopy (libnbd-bin) and python3: deploy/install-deps.sh";
    }
  }
  CommandResult Farmemctl(std::vector<std::string> args, const testing::DaemonSet& d) {
    args.insert(args.begin(), testing::BinPath("farmemctl"));
    args.insert(args.end(), {"--secret-file", d.work_dir() + "/secret"});
    return RunCommand(args, seconds(30));
  }
  // farmem-nbd --backend farmem on `peers` (the daemons of `d`), exporting `size` at the Unix
  // socket `sock`, its metrics port written to `port_file`, log in `log`, then `extra` options.
  Result<testing::ChildProcess> SpawnNbd(const std::string& peers, const testing::DaemonSet& d,
                                         const std::string& size, const std::string& sock,
                                         const std::string& port_file, const std::string& log,
                                         const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {testing::BinPath("farmem-nbd"),
                                     "--backend",
                                     "farmem",
                                     "--peers",
                                     peers,
                                     "--secret-file",
                                     d.work_dir() + "/secret",
                                     "--size",
                                     size,
                                     "--unix",
                                     sock,
                                     "--no-swap-safe",
                                     "--metrics-listen",
                                     "127.0.0.1:0",
                                     "--metrics-port-file",
                                     port_file};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return testing::ChildProcess::Spawn(argv, {.stderr_path = log, .kill_with_parent = true});
  }
  // Runs python3 on `json` (written to a file) with `script`, which prints what the test checks.
  std::string Python(const std::string& json, const std::string& script) {
    const std::string f = dir_.File("out.json");
    std::ofstream(f) << json;
    const CommandResult r = RunCommand(
        {"python3", "-c", "import json,sys\nd=json.load(open(sys.argv[1]))\n" + script, f});
    EXPECT_EQ(r.exit_code, 0) << r.err << "\n" << json;
    return r.out;
  }
  testing::TempDir dir_;
};

TEST_F(MetricsStatusTest, DaemonAndExportMetricsMoveWithIoAndSurviveBadHttp) {
  const std::string dport = dir_.File("farmemd.mport"), nport = dir_.File("nbd.mport");
  testing::DaemonSet daemons(
      {.capacity = "64M",
       .slab_size = "8M",
       .extra_args = {"--no-mlock", "--memory-source", "off", "--metrics-listen", "127.0.0.1:0",
                      "--metrics-port-file", dport}});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  ASSERT_TRUE(WaitForPortFile(dport)) << daemons.Logs();
  const uint16_t daemon_port = ReadPort(dport);
  auto before = Scrape(daemon_port);
  EXPECT_EQ(Value(before, "farmem_daemon_lent_bytes"), 0);
  EXPECT_EQ(Value(before, "farmem_daemon_capacity_bytes"), 64 << 20);

  // A wrong secret is an auth failure the daemon counts.
  const std::string wrong = dir_.File("wrong-secret");
  ASSERT_TRUE(testing::WritePrivateFile(wrong, "not-the-secret-of-these-daemons-at-all").ok());
  const CommandResult refused =
      RunCommand({testing::BinPath("farmemctl"), "stat", "--peers",
                  daemons[0].endpoint().ToString(), "--secret-file", wrong});
  EXPECT_EQ(refused.exit_code, 1) << "a wrong secret is an error of the command, not a daemon "
                                     "down: "
                                  << refused.out << refused.err;
  EXPECT_TRUE(WaitUntil(
      [&] { return Value(Scrape(daemon_port), "farmem_daemon_auth_failures_total") == 1; },
      milliseconds(10000)));

  const std::string sock = dir_.File("nbd.sock");
  auto nbd =
      SpawnNbd(daemons[0].endpoint().ToString(), daemons, "32M", sock, nport, dir_.File("nbd.log"),
               {"--resilience", "none", "--heartbeat-ms", "100", "--failure-timeout-ms", "1000"});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  ASSERT_TRUE(WaitForPortFile(nport)) << testing::ReadFile(dir_.File("nbd.log"));
  const uint16_t nbd_port = ReadPort(nport);
  auto idle = Scrape(nbd_port);
  EXPECT_EQ(Value(idle, "farmem_export_requests_total", {{"op", "write"}}), 0);
  EXPECT_EQ(Value(idle, "farmem_export_size_bytes"), 32 << 20);

  // I/O: 4 MiB written through the export and read back.
  const std::string in = dir_.File("in.bin"), out = dir_.File("out.bin");
  {
    std::ofstream f(in, std::ios::binary);
    for (uint64_t i = 0; i < kIoBytes / 8; ++i) {
      const uint64_t v = i * 0x9e3779b97f4a7c15ull;
      f.write(reinterpret_cast<const char*>(&v), 8);
    }
  }
  const std::string uri = "nbd+unix:///?socket=" + sock;
  CommandResult w = RunCommand({"nbdcopy", in, uri});
  ASSERT_EQ(w.exit_code, 0) << w.err;
  CommandResult r = RunCommand({"nbdcopy", uri, out});  // the whole 32 MiB export
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(testing::ReadFile(in), testing::ReadFile(out).substr(0, kIoBytes));

  auto e = Scrape(nbd_port);
  const double writes = Value(e, "farmem_export_requests_total", {{"op", "write"}});
  EXPECT_GT(writes, 0);
  EXPECT_EQ(Value(e, "farmem_export_bytes_total", {{"op", "write"}}), kIoBytes);
  EXPECT_GE(Value(e, "farmem_export_bytes_total", {{"op", "read"}}), kIoBytes);
  EXPECT_EQ(Value(e, "farmem_export_errors_total", {{"op", "write"}}), 0);
  EXPECT_EQ(Value(e, "farmem_export_request_duration_seconds_count", {{"op", "write"}}), writes);
  // Every wait for a request spins first (the default --request-busy-poll-us 10) or skips the
  // spin while it backs off; a hit is a spin that caught the request.
  const double spins = Value(e, "farmem_export_request_spins_total");
  EXPECT_GE(spins + Value(e, "farmem_export_request_spin_skips_total"), 1);
  EXPECT_LE(Value(e, "farmem_export_request_spin_hits_total"), spins);
  EXPECT_EQ(Value(e, "farmem_export_lost_bytes_total"), 0);
  EXPECT_EQ(Value(e, "farmem_export_degraded_extents"), 0);
  EXPECT_GE(Value(e, "farmem_export_extents_mapped"), 1);
  const std::string daemon = daemons[0].endpoint().ToString();
  EXPECT_EQ(Value(e, "farmem_export_daemon_state", {{"daemon", daemon}, {"state", "up"}}), 1);
  EXPECT_GE(Value(e, "farmem_export_daemon_leased_bytes", {{"daemon", daemon}}), 8 << 20);

  auto d = Scrape(daemon_port);
  EXPECT_GE(Value(d, "farmem_daemon_lent_bytes"), 8 << 20);
  EXPECT_EQ(Value(d, "farmem_daemon_lent_bytes") + Value(d, "farmem_daemon_free_bytes"), 64 << 20);
  EXPECT_GE(Value(d, "farmem_daemon_data_bytes_total", {{"direction", "write"}}), kIoBytes);
  EXPECT_GE(Value(d, "farmem_daemon_data_bytes_total", {{"direction", "read"}}), kIoBytes);
  EXPECT_GE(Value(d, "farmem_daemon_leases_granted_total"), 1);
  EXPECT_GE(Value(d, "farmem_daemon_requests_total", {{"opcode", "ALLOC"}}), 1);
  EXPECT_GE(Value(d, "farmem_daemon_requests_total", {{"opcode", "BATCH"}}) +
                Value(d, "farmem_daemon_requests_total", {{"opcode", "WRITE"}}),
            1);
  EXPECT_EQ(Value(d, "farmem_daemon_client_leased_bytes", {{"name", "farmem-nbd"}}),
            Value(d, "farmem_daemon_lent_bytes"));
  EXPECT_EQ(Value(d, "farmem_daemon_draining"), 0);
  EXPECT_EQ(Value(d, "farmem_daemon_huge_page_skips_total"), 0) << "no pressure, no drain";

  // Every metric the Grafana dashboard (deploy/grafana/farmem.json) queries is served (those of
  // the stripe layout by a stripe export: StripeExportServes... below).
  {
    std::set<std::string> served;
    for (const auto* samples : {&d, &e}) {
      for (const metrics::Sample& x : *samples) served.insert(x.name);
    }
    size_t checked = 0;
    for (const std::string& name : DashboardMetrics()) {
      if (name.starts_with("farmem_export_stripe_")) continue;
      EXPECT_TRUE(served.count(name))
          << "the dashboard queries " << name << ", which nobody serves";
      ++checked;
    }
    EXPECT_GT(checked, 20u);
  }

  ExpectBadInputIsRefused(daemon_port);
  ExpectBadInputIsRefused(nbd_port);
  EXPECT_TRUE(daemons[0].running());
  EXPECT_TRUE(nbd->running());
  Scrape(daemon_port);  // still served
  Scrape(nbd_port);

  // farmemctl export stat: whole (exit 0) and its JSON parses; with the one daemon down the
  // export is degraded (exit 3).
  CommandResult es = RunCommand({testing::BinPath("farmemctl"), "export", "stat",
                                 fmt::format("127.0.0.1:{}", nbd_port), "--json"});
  EXPECT_EQ(es.exit_code, 0) << es.out << es.err;
  EXPECT_EQ(Python(es.out,
                   "print(d['health'], d['lost_bytes'], d['rebuild_percent'], "
                   "d['daemons'][0]['state'], d['daemons'][0]['leased_bytes'] > 0)"),
            "whole 0 100.0 up True\n");
  daemons[0].Kill();
  EXPECT_TRUE(WaitUntil(
      [&] {
        return RunCommand({testing::BinPath("farmemctl"), "export", "stat",
                           fmt::format("127.0.0.1:{}", nbd_port)})
                   .exit_code == 3;
      },
      milliseconds(20000)));
}

// The stripe layout's own figures (StripeStoreStats) and its degraded episodes are served: an
// ec:4+2 stripe export on seven daemons written whole, then overwritten at random pages (holes
// in most stripes: rows in use ~1.8x packed, over compaction's 1.5x trigger), so that compaction
// moves pages; then a daemon killed, its members re-protected on the seventh, and the episode
// ended. Before these were exported, the stripe series did not
// exist and the episode figures read 0 for this layout (docs/nbd.md "Stripe layout", Stats).
TEST_F(MetricsStatusTest, StripeExportServesCompactionAndDegradedEpisodeFigures) {
  if (!testing::HaveProgram("fio")) GTEST_SKIP() << "needs fio: deploy/install-deps.sh";
  const std::string nport = dir_.File("nbd.mport");
  testing::DaemonSet daemons(
      {.capacity = "32M", .extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(7).ok()) << daemons.Logs();
  std::string peers;
  for (size_t i = 0; i < 7; ++i) {
    peers += (i == 0 ? "" : ",") + daemons[i].endpoint().ToString();
  }
  const std::string sock = dir_.File("nbd.sock");
  auto nbd = SpawnNbd(peers, daemons, "8M", sock, nport, dir_.File("nbd.log"),
                      {"--resilience", "ec:4+2", "--ec-layout", "stripe", "--write-cache-pages",
                       "0", "--heartbeat-ms", "100", "--failure-timeout-ms", "1000"});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  ASSERT_TRUE(WaitForPortFile(nport)) << testing::ReadFile(dir_.File("nbd.log"));
  const uint16_t port = ReadPort(nport);
  const std::string uri = "nbd+unix:///?socket=" + sock;
  auto fio = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"fio", "--name=stripe", "--ioengine=nbd", "--uri=" + uri,
                               "--size=8M", "--output=/dev/null"});
    const CommandResult r = RunCommand(args, seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err << testing::ReadFile(dir_.File("nbd.log"));
  };
  fio({"--rw=write", "--bs=1m", "--iodepth=4"});
  // 4096 random 4 KiB overwrites (twice the export's pages), 16 at a time.
  fio({"--rw=randwrite", "--bs=4k", "--iodepth=16", "--norandommap", "--io_size=1T",
       "--number_ios=4096"});
  auto get = [&](const char* name) { return Value(Scrape(port), name); };
  EXPECT_TRUE(WaitUntil([&] { return get("farmem_export_stripe_compacted_pages_total") > 0; },
                        milliseconds(20000)))
      << testing::ReadFile(dir_.File("nbd.log"));
  auto e = Scrape(port);
  EXPECT_EQ(Value(e, "farmem_export_stripe_live_pages"), 2048);  // 8 MiB, every page written
  EXPECT_GE(Value(e, "farmem_export_stripe_compactions_total"), 1);
  EXPECT_GT(Value(e, "farmem_export_stripe_sets_written_total"), 512);  // 512 full + more
  EXPECT_GT(Value(e, "farmem_export_stripe_sets"), 0);
  // Rows in use: (k + r) cells of 4 KiB per stripe; leased as whole slab groups.
  EXPECT_EQ(Value(e, "farmem_export_stripe_set_bytes"),
            Value(e, "farmem_export_stripe_sets") * 6 * 4096);
  EXPECT_GE(Value(e, "farmem_export_stripe_leased_bytes"),
            Value(e, "farmem_export_stripe_set_bytes"));
  // Without --compaction-offload the client moves the pages: reads them back and writes them.
  EXPECT_GT(Value(e, "farmem_export_stripe_compaction_received_bytes_total"), 0);
  EXPECT_GT(Value(e, "farmem_export_stripe_compaction_sent_bytes_total"), 0);
  EXPECT_GT(Value(e, "farmem_export_stripe_compaction_cpu_seconds_total"), 0);
  EXPECT_EQ(Value(e, "farmem_export_stripe_compaction_offloaded_sets_total"), 0);
  EXPECT_EQ(Value(e, "farmem_export_stripe_compaction_offload_fallbacks_total"), 0);
  EXPECT_EQ(Value(e, "farmem_export_degraded_episodes_total"), 0);
  EXPECT_EQ(Value(e, "farmem_export_last_degraded_seconds"), 0);
  size_t dashboard = 0;  // the dashboard's stripe panel queries only what is served
  for (const std::string& name : DashboardMetrics()) {
    if (!name.starts_with("farmem_export_stripe_")) continue;
    EXPECT_TRUE(metrics::Find(e, name).has_value()) << "the dashboard queries " << name;
    ++dashboard;
  }
  EXPECT_GE(dashboard, 4u);

  // A daemon killed: one episode, re-protected on the daemon outside each group, ended.
  size_t victim = 0;
  for (size_t i = 0; i < 7; ++i) {
    if (Value(e, "farmem_export_daemon_leased_bytes",
              {{"daemon", daemons[i].endpoint().ToString()}}) > 0) {
      victim = i;
      break;
    }
  }
  daemons[victim].Kill();
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto x = Scrape(port);
        return Value(x, "farmem_export_degraded_episodes_total") >= 1 &&
               Value(x, "farmem_export_episode_degraded_seconds") == 0 &&
               Value(x, "farmem_export_last_reprotect_bytes") > 0;
      },
      milliseconds(30000)))
      << testing::ReadFile(dir_.File("nbd.log"));
  auto after = Scrape(port);
  EXPECT_EQ(Value(after, "farmem_export_degraded_extents"), 0);
  EXPECT_GT(Value(after, "farmem_export_last_degraded_seconds"), 0);
  EXPECT_LE(Value(after, "farmem_export_last_reprotect_seconds"),
            Value(after, "farmem_export_last_degraded_seconds"));
  // Whole cells: a multiple of 4 KiB, no more than every rebuild wrote.
  const double bytes = Value(after, "farmem_export_last_reprotect_bytes");
  EXPECT_EQ(static_cast<uint64_t>(bytes) % 4096, 0u);
  EXPECT_LE(bytes, Value(after, "farmem_export_rebuilt_bytes_total"));
  EXPECT_EQ(Value(after, "farmem_export_lost_bytes_total"), 0);
  // farmemctl export stat shows the stripe layout's line.
  const CommandResult es = RunCommand(
      {testing::BinPath("farmemctl"), "export", "stat", fmt::format("127.0.0.1:{}", port)});
  EXPECT_EQ(es.exit_code, 3) << "a daemon is down: " << es.out << es.err;
  EXPECT_NE(es.out.find("stripe layout: 2048 live pages"), std::string::npos) << es.out;
  // And its data reads back (fio's verify of what it writes now, over a degraded cluster).
  fio({"--rw=randwrite", "--bs=4k", "--iodepth=16", "--verify=crc32c", "--do_verify=1",
       "--verify_state_save=0"});
}

TEST_F(MetricsStatusTest, StatJsonShowsEveryFieldAndExitCodesSayWhenADaemonIsDown) {
  testing::DaemonSet daemons({.extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(2).ok()) << daemons.Logs();
  const std::string peers =
      daemons[0].endpoint().ToString() + "," + daemons[1].endpoint().ToString();
  const CommandResult version = RunCommand({testing::BinPath("farmemd"), "--version"});
  ASSERT_EQ(version.exit_code, 0);
  const std::string want_version = version.out.substr(8, version.out.size() - 9);  // "farmemd "

  CommandResult st = Farmemctl({"stat", "--peers", peers, "--json"}, daemons);
  ASSERT_EQ(st.exit_code, 0) << st.out << st.err;
  EXPECT_EQ(Python(st.out,
                   "print(d['down'], len(d['daemons']))\n"
                   "for x in d['daemons']:\n"
                   "  print(x['state'], x['version'], x['capacity_bytes'], x['clients'],"
                   " x['ops'], x['bytes_read'], x['transports'], x['lent_bytes'])"),
            fmt::format("0 2\nup {0} 16777216 1 0 0 ['tcp'] 0\nup {0} 16777216 1 0 0 ['tcp'] 0\n",
                        want_version));
  // The table: one row per daemon with the columns it used to drop.
  st = Farmemctl({"stat", "--peers", peers}, daemons);
  ASSERT_EQ(st.exit_code, 0) << st.err;
  for (const char* column : {"version", "clients", "ops", "read", "written", "transport"}) {
    EXPECT_NE(st.out.find(column), std::string::npos) << column << "\n" << st.out;
  }

  daemons[1].Kill();
  st = Farmemctl({"stat", "--peers", peers, "--json"}, daemons);
  EXPECT_EQ(st.exit_code, 3) << "a daemon down: exit 3 (docs/operations.md)\n" << st.out;
  EXPECT_EQ(Python(st.out, "print(d['down'], [x['state'] for x in d['daemons']])"),
            "1 ['up', 'down']\n");
  daemons[0].Kill();
  st = Farmemctl({"stat", "--peers", peers}, daemons);
  EXPECT_EQ(st.exit_code, 3) << "every daemon down is a daemon down too\n" << st.out << st.err;
  // An error of the command itself (here an unreadable secret file) is exit 1.
  st = RunCommand({testing::BinPath("farmemctl"), "stat", "--peers", peers, "--secret-file",
                   dir_.File("no-such-file")});
  EXPECT_EQ(st.exit_code, 1) << st.out << st.err;
}

// Which ec layout serves an export is visible where a user looks: the startup log line, the
// farmem_export_info metric and `farmemctl export stat` (text and --json). ec:k+r is the stripe
// layout unless --ec-layout split or the spelling ec-split:k+r (issue 13) asks for the split one.
TEST_F(MetricsStatusTest, EcExportSaysWhichLayoutServesIt) {
  testing::DaemonSet daemons({.capacity = "32M",
                              .slab_size = "1M",
                              .log_level = "warn",
                              .extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(3).ok()) << daemons.Logs();
  std::string peers;
  for (const Endpoint& ep : daemons.endpoints())
    peers += (peers.empty() ? "" : ",") + ep.ToString();
  struct Case {
    std::vector<std::string> args;
    const char* layout;
  };
  const std::vector<Case> cases = {
      {{"--resilience", "ec:2+1"}, "stripe"},
      {{"--resilience", "ec-split:2+1"}, "split"},
      {{"--resilience", "ec:2+1", "--ec-layout", "split"}, "split"},
      {{"--resilience", "ec-split:2+1", "--ec-layout", "split"}, "split"}};
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::string given;
    for (const std::string& a : c.args) given += a + " ";
    SCOPED_TRACE(given + "-> " + c.layout);
    const std::string nport = dir_.File(fmt::format("nbd{}.mport", i));
    const std::string log = dir_.File(fmt::format("nbd{}.log", i));
    auto nbd =
        SpawnNbd(peers, daemons, "8M", dir_.File(fmt::format("nbd{}.sock", i)), nport, log, c.args);
    ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
    ASSERT_TRUE(WaitForPortFile(nport)) << testing::ReadFile(log);
    const uint16_t port = ReadPort(nport);
    EXPECT_EQ(Value(Scrape(port), "farmem_export_info",
                    {{"resilience", "ec:2+1"}, {"ec_layout", c.layout}}),
              1);
    CommandResult es = RunCommand(
        {testing::BinPath("farmemctl"), "export", "stat", fmt::format("127.0.0.1:{}", port)});
    EXPECT_EQ(es.exit_code, 0) << es.out << es.err;
    EXPECT_NE(es.out.find(fmt::format("ec:2+1, {} layout", c.layout)), std::string::npos) << es.out;
    es = RunCommand({testing::BinPath("farmemctl"), "export", "stat",
                     fmt::format("127.0.0.1:{}", port), "--json"});
    EXPECT_EQ(Python(es.out, "print(d['resilience'], d['ec_layout'])"),
              fmt::format("ec:2+1 {}\n", c.layout));
    const std::string text = testing::ReadFile(log);
    EXPECT_NE(text.find(fmt::format("from the farmem backend (ec:2+1, {} layout)", c.layout)),
              std::string::npos)
        << text;
    // The store that serves it says so too (the stripe store logs its stripes).
    EXPECT_EQ(text.find("stripe store:") != std::string::npos, std::string(c.layout) == "stripe")
        << text;
    nbd->Stop(SIGTERM, milliseconds(10000));
  }
}

}  // namespace
}  // namespace farmem
