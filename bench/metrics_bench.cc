// What --metrics-listen adds to farmem-nbd's request path, per NBD reply, next to its baseline:
//   baseline  one relaxed add (what a request already costs in counters: requests_ etc.)
//   on        steady_clock::now() + requests/bytes counter adds + a latency histogram observe
//             (NbdConnection::CountReply's metrics block, with a clock read per reply: the
//             connection reads it once per burst of replies since 2026-12-03, so this is an
//             upper bound; nbd_bench.sh --instructions counts the real request path)
// and what a scrape costs the metrics thread (Render of farmem-nbd's ~150 series). Single thread;
// run it pinned (taskset -c 0) for stable figures. The per-reply figure divided by a request's
// time (docs/benchmarks-nbd.md) is the IOPS cost. Usage: metrics_bench [iterations]
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdlib>

#include "farmem/blockdev/nbd_metrics.h"
#include "farmem/common/metrics.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double NsPer(uint64_t n, F&& f) {
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < n; ++i) f(i);
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / n;
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 20'000'000;
  farmem::metrics::Registry registry;
  farmem::blockdev::NbdMetrics m(&registry);
  std::atomic<uint64_t> sink{0};
  const Clock::time_point batch_start = Clock::now();
  for (int rep = 0; rep < 3; ++rep) {
    const double base = NsPer(n, [&](uint64_t i) { sink.fetch_add(i, std::memory_order_relaxed); });
    const double on = NsPer(n, [&](uint64_t i) {
      const auto c = static_cast<farmem::blockdev::NbdMetrics::Command>(i & 1);
      m.requests[c]->Add();
      m.bytes[c]->Add(4096);
      m.latency[c]->Observe(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - batch_start)
              .count()));
    });
    std::string text;
    const double render = NsPer(2000, [&](uint64_t) { text = registry.Render(); });
    fmt::print(
        "rep {}: per reply: baseline {:.1f} ns, metrics on {:.1f} ns (+{:.1f} ns); scrape: "
        "{:.1f} us for {} bytes\n",
        rep, base, on, on - base, render / 1000, text.size());
  }
  return sink.load() == 42 ? 1 : 0;
}
