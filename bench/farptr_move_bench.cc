// far_ptr under an eviction notice (issue 12, docs/benchmarks-farptr.md "Eviction notices"):
// a far_ptr workload keeps reading (and verifying) random objects, most of them remote, while one
// lender (farmemd-L) asks its memory back — its host under memory pressure (a fake cgroup v2
// directory the benchmark writes, as daemon_cgroup_pressure_test / client_eviction_test do), or
// `farmemctl drain`. The runtime moves the span sets L holds to the other lenders and frees the
// leases; L then gives the memory back to its host. Printed per resilience mode:
//   - pressure onset (or drain) -> notice -> every lease moved -> L's RSS back down, next to the
//     notice's deadline (the grace);
//   - the workload's reads per second, p50 / p99 / max latency, over a steady window before the
//     event (the baseline, same run), during the move, and after it.
//   farptr_move_bench [--resilience none,replicate:2,ec:2+1] [--event pressure|drain]
//                     [--data-mib 64] [--grace-ms 10000] [--seconds 3] [--warmup 5]
//                     [--span 65536]
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "bench_main.h"
#include "farmem/client/cluster.h"
#include "farmem/common/command_line.h"
#include "farmem/far_ptr.h"
#include "farmem/runtime.h"
#include "latency_window.h"
#include "support/daemon_fixture.h"
#include "support/fake_cgroup.h"
#include "support/object_pattern.h"
#include "support/process.h"

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "farptr_move_bench: %s\n", msg.c_str());
  std::exit(1);
}

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kLimit = 4096 * kMiB;  // the fake cgroup's memory.max
constexpr uint64_t kReserve = 512 * kMiB;
constexpr size_t kObjectSize = 1000;

struct Args {
  std::vector<std::string> modes = {"none", "replicate:2", "ec:2+1"};
  std::string event = "pressure";
  uint64_t data_mib = 64;
  uint32_t grace_ms = 10000;
  int seconds = 3;
  int warmup = 5;
  uint32_t span = 65536;
};

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one;
}

size_t LeasesOn(farmem::Runtime& rt, const farmem::Endpoint& ep) {
  for (const farmem::client::NodeInfo& n : rt.cluster().nodes()) {
    if (n.endpoint == ep) return n.leases_held;
  }
  return 0;
}

void RunOne(const Args& a, const std::string& resilience) {
  farmem::testing::FakeCgroup cgroup(kLimit);
  farmem::testing::DaemonConfig others_cfg;
  others_cfg.capacity = "512M";
  others_cfg.slab_size = "4M";
  others_cfg.log_level = "warn";
  others_cfg.extra_args = {"--memory-source", "off"};
  farmem::testing::DaemonConfig lender_cfg = others_cfg;
  lender_cfg.extra_args = cgroup.LenderArgs({.reserve = kReserve,
                                             .grace = std::chrono::milliseconds(a.grace_ms),
                                             .interval = std::chrono::milliseconds(20),
                                             .sample_extra = 4});
  // The lender is started first so that it is node 0; three others take what it gives back.
  farmem::testing::DaemonSet lender(lender_cfg);
  farmem::testing::DaemonSet others(others_cfg);
  if (auto s = lender.Start(1); !s.ok()) Die(s.ToString());
  if (auto s = others.Start(3); !s.ok()) Die(s.ToString());
  const farmem::Endpoint lender_ep = lender[0].endpoint();

  farmem::RuntimeOptions o;
  o.peers = lender.endpoints();
  for (const auto& ep : others.endpoints()) o.peers.push_back(ep);
  o.secret = lender.secret();
  o.resilience = resilience;
  o.span_size = a.span;
  o.local_budget = a.data_mib * kMiB / 8;
  o.auto_compact = false;  // the same data stays where it was put: nothing but the move moves it
  o.heartbeat_interval = milliseconds(100);
  auto created = farmem::Runtime::Create(o);
  if (!created) Die(created.error().ToString());
  std::unique_ptr<farmem::Runtime> rt = std::move(*created);

  const size_t n = a.data_mib * kMiB / kObjectSize;
  std::vector<farmem::far_bytes> objs;
  objs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    farmem::far_bytes b = farmem::make_far_bytes_in(*rt, kObjectSize);
    {
      farmem::DerefScope s;
      farmem::testing::FillObject(b.deref_mut(s), i, 1);
    }
    objs.push_back(std::move(b));
  }
  if (auto s = rt->EvictUntil(0); !s.ok()) Die(s.ToString());
  size_t leases_on_l = LeasesOn(*rt, lender_ep);
  if (leases_on_l == 0) Die("the runtime put nothing on the lender; run again");
  long rss_before_kib = farmem::testing::ProcStatus(lender[0].pid(), "VmRSS");

  // The workload: one thread reading random objects and checking every byte.
  farmem::bench::ReadSampler reader(
      n, 1 << 20,
      [&, want = std::vector<std::byte>(kObjectSize)](uint64_t i, Clock::time_point& end) mutable {
        farmem::DerefScope s;
        auto got = objs[i].try_deref(s);
        end = Clock::now();
        if (!got) return fmt::format("object {}: {}", i, got.error().ToString());
        farmem::testing::FillObject(want, i, 1);
        if (std::memcmp(want.data(), got->data(), kObjectSize) != 0) {
          return fmt::format("object {} came back wrong", i);
        }
        return std::string();
      });

  // Warm-up (the evictor settles, the local share of the objects turns over), then the steady
  // window (the baseline), then the event. The windows are time itself.
  std::this_thread::sleep_for(std::chrono::seconds(a.warmup + a.seconds));
  std::mutex mu;
  Clock::time_point noticed{};
  Clock::time_point deadline{};
  const farmem::client::SubscriptionId sub =
      rt->cluster().Subscribe([&](const farmem::client::Event& e) {
        if (e.type != farmem::client::EventType::kEvictNotice) return;
        // The fake cgroup does not see the lender give memory back: say it did, so it picks no more
        // victims (above the reserve, below reserve + hysteresis: still not granting).
        if (a.event == "pressure") cgroup.SetAvailable(kReserve + 16 * kMiB);
        std::lock_guard lock(mu);
        if (noticed == Clock::time_point{}) {
          noticed = Clock::now();
          deadline = e.deadline;
        }
      });
  leases_on_l = LeasesOn(*rt, lender_ep);  // the evictor may have placed more there meanwhile
  rss_before_kib = farmem::testing::ProcStatus(lender[0].pid(), "VmRSS");
  const Clock::time_point onset = Clock::now();
  const uint64_t leased_bytes = leases_on_l * 4 * kMiB;
  if (a.event == "pressure") {
    // Short by far more than the runtime holds there: the lender notices every lease (its
    // victims cover the deficit; the evictor may have placed more slabs there since we counted).
    cgroup.SetAvailable(kReserve / 2);
  } else {
    farmem::testing::CommandResult r = farmem::testing::RunCommand(
        {farmem::testing::BinPath("farmemctl"), "drain", lender_ep.ToString(), "--grace-ms",
         std::to_string(a.grace_ms), "--secret-file", lender.work_dir() + "/secret"});
    if (r.exit_code != 0) Die("farmemctl drain: " + r.out + r.err);
  }
  // Poll (1 ms) for the three moments: all moved (no lease of ours left on L), RSS returned.
  Clock::time_point moved{}, returned{};
  const Clock::time_point give_up = onset + milliseconds(a.grace_ms) + std::chrono::seconds(5);
  long rss_after_kib = rss_before_kib;
  while (Clock::now() < give_up &&
         (moved == Clock::time_point{} || returned == Clock::time_point{})) {
    if (moved == Clock::time_point{} && LeasesOn(*rt, lender_ep) == 0) moved = Clock::now();
    rss_after_kib = farmem::testing::ProcStatus(lender[0].pid(), "VmRSS");
    if (returned == Clock::time_point{} &&
        static_cast<uint64_t>(std::max(0L, rss_before_kib - rss_after_kib)) * 1024 >=
            leased_bytes * 9 / 10) {
      returned = Clock::now();
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  const Clock::time_point end_of_move = moved == Clock::time_point{} ? Clock::now() : moved;
  std::this_thread::sleep_for(std::chrono::seconds(a.seconds));  // the window after the move
  const std::string reader_error = reader.Stop();
  rt->cluster().Unsubscribe(sub);
  if (!reader_error.empty()) Die(resilience + ": the workload failed: " + reader_error);

  const farmem::RuntimeStats st = rt->stats();
  auto ms = [&](Clock::time_point t) {
    return t == Clock::time_point{}
               ? std::string("never")
               : fmt::format("{:.0f} ms",
                             std::chrono::duration<double, std::milli>(t - onset).count());
  };
  std::lock_guard lock(mu);
  fmt::print(
      "{} ({}; {} MiB of objects, {} KiB spans, {} slab(s) of 4 MiB on the lender, grace {} "
      "ms):\n",
      resilience, a.event, a.data_mib, a.span / 1024, leases_on_l, a.grace_ms);
  fmt::print(
      "    onset -> notice {}, -> all moved and freed {}, -> lender RSS down by {} MiB {} "
      "(RSS {} -> {} MiB); deadline at {}\n",
      ms(noticed), ms(moved), leased_bytes * 9 / 10 / kMiB, ms(returned), rss_before_kib / 1024,
      rss_after_kib / 1024, ms(deadline));
  fmt::print("    load average (1 min) at the end: {}\n", LoadAverage());
  fmt::print(
      "    runtime: members moved {}, failed {}, re-protected {}, degraded reads {}, "
      "lost {}; longest move {} ms\n",
      st.members_moved, st.members_failed, st.members_reprotected, st.degraded_reads, st.spans_lost,
      st.move_max_ms);
  reader.PrintWindows(onset, noticed, end_of_move, a.seconds);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"far_ptr while a lender asks its memory back (pressure or drain)"};
  farmem::cli::AddVersionOption(app, "farptr_move_bench");
  farmem::bench::AddMoveOptions(app, a.modes, a.grace_ms, a.seconds);
  app.add_option("--event", a.event, "how the lender asks")
      ->capture_default_str()
      ->check(farmem::cli::OneOf({"pressure", "drain"}));
  app.add_option("--data-mib", a.data_mib, "MiB of objects")->capture_default_str();
  app.add_option("--warmup", a.warmup, "warm-up seconds")->capture_default_str();
  app.add_option("--span", a.span, "span size in bytes")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  farmem::bench::UseBinariesBeside(argv[0]);
  for (const std::string& m : a.modes) RunOne(a, m);
  return 0;
}
