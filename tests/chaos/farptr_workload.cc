// The chaos suite's far_ptr workload: several threads each own many self-checking far objects
// (sizes from 16 B to a whole span, a local budget of ~1/8 of the working set so most of them
// live on the daemons) and read-check and rewrite them at random while the chaos driver injects
// faults into the daemons. Every object's bytes are a function of (object id, version).
//
//   chaos_farptr_workload --peers H:P,... --secret-file F --resilience ec:2+1
//       [--threads 4] [--objects 1500] [--heartbeat-ms 100] [--failure-timeout-ms 1000]
//       [--compact on|off]
//
// Protocol with the driver: prints "ready" on stdout once every object exists and was swapped
// out; on SIGUSR2 prints "recovery N done|pending" (Runtime::WaitForRecovery); on SIGUSR1 stops,
// checks every object and prints one line
//   result verified=B lost=B corrupt=B failed=N ops=N stall_ms=X reprotected=N spans_lost=N
//          auth_failures=N
// (auth_failures: cells that failed authentication when read, plus those compaction found
// corrupted by their checksum before it moved them — both are a detected flip)
// then exits 0. Logs (spdlog) go to stderr, which the driver parses like farmem-nbd's.
//
// Threads: the worker threads own their objects; the main thread waits for the signal.
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <latch>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/far_ptr.h"
#include "farmem/runtime.h"
#include "support/object_pattern.h"

namespace {

using SteadyClock = std::chrono::steady_clock;

void Fill(std::span<std::byte> out, uint64_t id, uint64_t version) {
  farmem::testing::FillObject(out, id, version);
}

bool Matches(std::span<const std::byte> got, uint64_t id, uint64_t version) {
  std::vector<std::byte> want(got.size());
  Fill(want, id, version);
  return std::memcmp(want.data(), got.data(), got.size()) == 0;
}

struct Worker {
  std::vector<farmem::far_bytes> objs;
  std::vector<uint64_t> version;
  // Not checked any more during the run: 1 = a deref failed, 2 = it came back wrong.
  std::vector<uint8_t> lost;
  uint64_t failed = 0, ops = 0, corrupt = 0, verified = 0;
  double stall_ms = 0;
  std::string first_problem;
};

}  // namespace

int main(int argc, char** argv) {
  farmem::RuntimeOptions o;
  int threads = 4;
  size_t objects = 1500;
  uint64_t seed = 0;  // 0: the fixed sequence CI runs
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--peers") {
      auto p = farmem::ParseEndpointList(v, farmem::kDefaultPort);
      if (!p) {
        std::fprintf(stderr, "--peers: %s\n", p.error().ToString().c_str());
        return 2;
      }
      o.peers = *p;
    } else if (k == "--secret-file") {
      std::ifstream in(v);
      std::stringstream ss;
      ss << in.rdbuf();
      o.secret = ss.str();
      while (!o.secret.empty() && (o.secret.back() == '\n' || o.secret.back() == '\r')) {
        o.secret.pop_back();
      }
    } else if (k == "--resilience") {
      o.resilience = v;
    } else if (k == "--threads") {
      threads = std::stoi(v);
    } else if (k == "--seed") {
      seed = std::stoull(v);
    } else if (k == "--objects") {
      objects = std::stoul(v);
    } else if (k == "--heartbeat-ms") {
      o.heartbeat_interval = std::chrono::milliseconds(std::stoul(v));
    } else if (k == "--failure-timeout-ms") {
      o.failure_timeout = std::chrono::milliseconds(std::stoul(v));
    } else if (k == "--compact") {
      o.auto_compact = v != "off";
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  // Logs to stderr (spdlog's default logger writes to stdout, which carries the protocol).
  spdlog::set_default_logger(spdlog::stderr_color_mt("farptr-workload"));
  // The driver's signals are taken by the main thread only (sigwait below); every thread the
  // runtime starts inherits this mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGUSR1);
  sigaddset(&sigs, SIGUSR2);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  o.span_size = 16384;
  o.op_timeout = std::chrono::milliseconds(5000);
  // ~1.1 KiB average object: keep about an eighth local.
  o.local_budget = std::max<uint64_t>(threads * objects * 1150 / 8, 256u << 10);
  auto rt = farmem::Runtime::Create(o);
  if (!rt) {
    std::fprintf(stderr, "runtime: %s\n", rt.error().ToString().c_str());
    return 1;
  }
  std::vector<Worker> workers(static_cast<size_t>(threads));
  std::atomic<bool> stop{false};
  std::latch ready(threads);  // every thread has made its objects
  auto id_of = [&](int t, size_t i) { return (static_cast<uint64_t>(t) << 32) | i; };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Worker& w = workers[static_cast<size_t>(t)];
      std::mt19937_64 rng(7000 + seed * 1000 + static_cast<uint64_t>(t));
      w.objs.resize(objects);
      w.version.assign(objects, 0);
      w.lost.assign(objects, 0);
      for (size_t i = 0; i < objects; ++i) {
        const unsigned r = rng() % 100;
        const size_t size = r < 70   ? 16 + rng() % 240
                            : r < 95 ? 256 + rng() % 3840
                                     : 4096 + rng() % (16384 - 4096 + 1);
        w.objs[i] = farmem::make_far_bytes_in(**rt, size);
        farmem::DerefScope s;
        Fill(w.objs[i].deref_mut(s), id_of(t, i), 0);
      }
      ready.arrive_and_wait();
      while (!stop.load(std::memory_order_relaxed)) {
        const size_t i = rng() % objects;
        if (w.lost[i]) continue;
        const bool write = rng() % 3 == 0;
        const auto t0 = SteadyClock::now();
        {
          farmem::DerefScope s;
          if (write) {
            auto bytes = w.objs[i].try_deref_mut(s);
            if (!bytes) {
              ++w.failed;
              w.lost[i] = 1;
              if (w.first_problem.empty()) w.first_problem = bytes.error().ToString();
            } else {
              Fill(*bytes, id_of(t, i), ++w.version[i]);
            }
          } else {
            auto bytes = w.objs[i].try_deref(s);
            if (!bytes) {
              ++w.failed;
              w.lost[i] = 1;
              if (w.first_problem.empty()) w.first_problem = bytes.error().ToString();
            } else if (Matches(*bytes, id_of(t, i), w.version[i])) {
              w.verified += bytes->size();
            } else {
              ++w.corrupt;
              w.lost[i] = 2;
              if (w.first_problem.empty()) {
                w.first_problem = "object " + std::to_string(i) + " of thread " +
                                  std::to_string(t) + " came back wrong";
              }
            }
          }
        }
        w.stall_ms = std::max(
            w.stall_ms, std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count());
        ++w.ops;
      }
    });
  }
  ready.wait();
  (void)(*rt)->EvictUntil(0);
  std::printf("ready\n");
  std::fflush(stdout);

  // SIGUSR2: say whether every failed span-set member was re-protected ("recovery N done" or
  // "recovery N pending", N counting the questions); SIGUSR1 or SIGTERM: stop and verify.
  for (int question = 1;; ++question) {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (sig != SIGUSR2) break;
    const farmem::Status st = (*rt)->WaitForRecovery(std::chrono::milliseconds(50));
    std::printf("recovery %d %s\n", question, st.ok() ? "done" : "pending");
    std::fflush(stdout);
  }
  stop = true;
  for (auto& th : pool) th.join();
  // Check every object once more, the lost ones too.
  uint64_t verified = 0, lost = 0, corrupt = 0, failed = 0, ops = 0;
  double stall = 0;
  std::string problem;
  (void)(*rt)->EvictUntil(0);
  for (int t = 0; t < threads; ++t) {
    Worker& w = workers[static_cast<size_t>(t)];
    failed += w.failed;
    ops += w.ops;
    verified += w.verified;
    stall = std::max(stall, w.stall_ms);
    if (problem.empty()) problem = w.first_problem;
    for (size_t i = 0; i < objects; ++i) {
      farmem::DerefScope s;
      auto bytes = w.objs[i].try_deref(s);
      if (!bytes) {
        lost += w.objs[i].size();
        if (problem.empty()) problem = bytes.error().ToString();
      } else if (!Matches(*bytes, id_of(t, i), w.version[i]) || w.lost[i] == 2) {
        corrupt += w.objs[i].size();
      } else {
        verified += w.objs[i].size();
      }
    }
  }
  const farmem::RuntimeStats st = (*rt)->stats();
  std::printf(
      "result verified=%lu lost=%lu corrupt=%lu failed=%lu ops=%lu stall_ms=%.1f "
      "reprotected=%lu spans_lost=%lu auth_failures=%lu\n",
      verified, lost, corrupt, failed, ops, stall, st.members_reprotected, st.spans_lost,
      st.auth_failures + st.compaction_corrupt_cells);
  if (!problem.empty()) std::printf("problem %s\n", problem.c_str());
  std::fflush(stdout);
  for (auto& w : workers) w.objs.clear();
  return 0;
}
