// What lending costs the lender (issue 12, docs/benchmarks.md "Lender memory on demand"):
//   1. start-up time (exec to listening) and idle RSS of farmemd for several --capacity values;
//   2. one slab leased and unleased (ALLOC 1 + FREE 1 over TCP, as a client sees it): with memory
//      on demand that is populate + mlock (+ MR registration with RDMA) + MADV_DONTNEED; with the
//      prefaulted pool only bookkeeping and a memset.
// Give two farmemd binaries to compare them in the same run (e.g. one built from main before
// memory on demand): each figure is printed for both. --populate-at-start runs every binary a
// second time with farmemd --populate-at-start (the whole capacity populated before it listens,
// as before memory on demand), so one binary compares both behaviours.
//   lender_bench [--farmemd PATH]... [--capacity 1G,4G] [--slab 64M] [--rounds 30] [--mlock]
//                [--listen 127.0.0.1] [--daemon-arg=--rdma=off]... [--populate-at-start]
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/wire.h"
#include "farmem/transport/tcp_connection.h"
#include "support/process.h"

using namespace farmem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

uint64_t RssKiB(pid_t pid) {
  return static_cast<uint64_t>(std::max(0L, farmem::testing::ProcStatus(pid, "VmRSS")));
}

struct Daemon {
  testing::ChildProcess process;
  uint16_t port = 0;
  double startup_ms = 0;
};

Result<Daemon> Start(const std::string& bin, const std::string& capacity, const std::string& slab,
                     bool mlock, const std::string& host, const std::string& dir,
                     const std::vector<std::string>& extra) {
  const std::string port_file = dir + "/port";
  std::filesystem::remove(port_file);
  std::vector<std::string> argv = {bin,       "--listen",    host + ":0", "--capacity",
                                   capacity,  "--slab-size", slab,        "--port-file",
                                   port_file, "--log-level", "warn",      "--max-client-share",
                                   "1"};
  if (!mlock) argv.push_back("--no-mlock");
  argv.insert(argv.end(), extra.begin(), extra.end());
  const auto t0 = Clock::now();
  FARMEM_ASSIGN_OR_RETURN(
      testing::ChildProcess p,
      testing::ChildProcess::Spawn(argv, {.stderr_path = dir + "/log", .kill_with_parent = true}));
  Daemon d{std::move(p)};
  // Polling for the port file is the measurement: exec to listening.
  while (!std::filesystem::exists(port_file)) {
    if (!d.process.Alive()) return Err(Internal(bin + " exited; see " + dir + "/log"));
    if (Clock::now() - t0 > std::chrono::seconds(120)) return Err(DeadlineExceeded("start"));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  d.startup_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::ifstream(port_file) >> d.port;
  return d;
}

struct LeaseCost {
  double mean_ms = 0, p50_ms = 0, max_ms = 0;
};

Result<LeaseCost> MeasureLease(const std::string& host, uint16_t port, int rounds) {
  transport::ChannelOptions o;
  o.endpoint = {host, port};
  o.credentials.client_id.fill(7);
  o.credentials.client_name = "lender_bench";
  FARMEM_ASSIGN_OR_RETURN(transport::TcpConnection conn, transport::TcpConnection::Connect(o));
  std::vector<double> ms;
  std::vector<uint8_t> alloc;
  wire::EncodeAlloc({1}, &alloc);
  for (int i = 0; i < rounds; ++i) {
    const auto t0 = Clock::now();
    FARMEM_ASSIGN_OR_RETURN(auto body, conn.Call(wire::Opcode::kAlloc, alloc, milliseconds(30000)));
    FARMEM_ASSIGN_OR_RETURN(wire::AllocReply r, wire::DecodeAllocReply(body));
    std::vector<uint8_t> free;
    wire::EncodeFree({{r.leases.at(0).lease_id}}, &free);
    FARMEM_ASSIGN_OR_RETURN(auto fb, conn.Call(wire::Opcode::kFree, free, milliseconds(30000)));
    (void)fb;
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  LeaseCost c;
  for (double v : ms) c.mean_ms += v / static_cast<double>(ms.size());
  c.p50_ms = ms[ms.size() / 2];
  c.max_ms = ms.back();
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lender_bench: farmemd start-up, idle RSS and lease/unlease cost"};
  std::vector<std::string> bins;
  std::vector<std::string> caps = {"1G", "4G"};
  std::string slab = "64M", host = "127.0.0.1";
  int rounds = 30;
  bool mlock = false, populate_at_start = false;
  std::vector<std::string> extra;
  app.add_option("--farmemd", bins, "farmemd binaries to compare (default: ./farmemd)");
  app.add_option("--daemon-arg", extra, "One more farmemd argument (repeatable), e.g. --rdma=off");
  app.add_option("--capacity", caps, "Comma-separated --capacity values")
      ->capture_default_str()
      ->delimiter(',');
  app.add_option("--slab", slab, "--slab-size")->capture_default_str();
  app.add_option("--rounds", rounds, "Lease/unlease rounds")->capture_default_str();
  app.add_flag("--mlock", mlock, "Let farmemd mlock (default --no-mlock)");
  app.add_option("--listen", host, "Address to serve on (an RDMA address in the guest)")
      ->capture_default_str();
  app.add_flag("--populate-at-start", populate_at_start,
               "Also run each farmemd with --populate-at-start (the prefaulted pool)");
  CLI11_PARSE(app, argc, argv);
  if (bins.empty()) bins.push_back(testing::BinPath("farmemd"));
  testing::TempDir dir("lender-bench");

  fmt::print("slab {}, {} lease rounds, {}\n", slab, rounds, mlock ? "mlock" : "--no-mlock");
  fmt::print("{:<40} {:>9} {:>12} {:>12} {:>11} {:>11} {:>11}\n", "farmemd", "capacity",
             "startup ms", "idle RSS", "lease mean", "lease p50", "lease max");
  struct Config {
    std::string bin, label;
    std::vector<std::string> args;
  };
  std::vector<Config> configs;
  for (const std::string& bin : bins) {
    configs.push_back({bin, bin, extra});
    if (populate_at_start) {
      Config c{bin, bin + " --populate-at-start", extra};
      c.args.push_back("--populate-at-start");
      configs.push_back(std::move(c));
    }
  }
  for (const std::string& cap : caps) {
    for (const Config& config : configs) {
      const std::string& bin = config.label;
      auto d = Start(config.bin, cap, slab, mlock, host, dir.path(), config.args);
      if (!d) {
        fmt::print("{:<40} {:>9} {}\n", bin, cap, d.error().ToString());
        continue;
      }
      std::this_thread::sleep_for(milliseconds(200));  // let start-up threads settle (RSS)
      const uint64_t rss = RssKiB(d->process.pid());
      auto lc = MeasureLease(host, d->port, rounds);
      fmt::print("{:<40} {:>9} {:>12.1f} {:>9} MiB {:>8.2f} ms {:>8.2f} ms {:>8.2f} ms\n", bin, cap,
                 d->startup_ms, rss / 1024, lc ? lc->mean_ms : -1, lc ? lc->p50_ms : -1,
                 lc ? lc->max_ms : -1);
      d->process.Stop(SIGINT, milliseconds(120000));
    }
  }
  return 0;
}
