// Metrics in the Prometheus text exposition format (version 0.0.4), served over HTTP by
// `farmemd --metrics-listen` and `farmem-nbd --metrics-listen` (docs/operations.md "Metrics").
//
// What it solves: operators watch farmem with Prometheus/Grafana; the data path must not pay for
// it. So there are two kinds of metric:
//  - Counter / Histogram: bumped on the data path, each one relaxed atomic add (a histogram two),
//    no lock, no allocation. They live in the Registry that made them (stable addresses).
//  - Callbacks: values that already exist elsewhere (pool size, leases, degraded extents) are read
//    only when someone scrapes, by a function given at setup; nothing is kept twice.
// The parser (ParseExposition) is the same format read back: `farmemctl export stat` and the tests
// use it, and it rejects what Prometheus would reject, so the tests check the format too.
//
// Why our own and not prometheus-cpp (Debian's libprometheus-cpp-dev): its pull side brings an
// embedded web server (civetweb) and zlib to two daemons that otherwise have no HTTP, and its
// Counter::Increment is a compare-exchange loop on an atomic<double>; ours is one fetch_add on an
// atomic<uint64_t>. The whole exposition is this header, metrics.cc and metrics_http.cc
// (docs/operations.md).
//
// Threading: Add*() at setup (any thread, under the registry's lock); Counter::Add and
// Histogram::Observe from any thread at any time; Render() from any thread (the HTTP thread):
// it runs the callbacks under the registry's lock, so a callback must not call into the registry.
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"

namespace farmem::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;
enum class Type { kCounter, kGauge, kHistogram };

// A count that only goes up. One relaxed fetch_add per Add: no ordering with anything else is
// promised (a scrape may see an op's bytes before its count); the values are for monitoring.
class Counter {
 public:
  void Add(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

// Observations in integer units (nanoseconds, bytes) into fixed buckets; exposed multiplied by
// `scale` (1e-9: seconds, as Prometheus wants). Observe: the first bucket that can hold a value
// of v's bit width from a table (so the cost does not grow with the value: bounds at least 2x
// apart leave at most one more comparison), and two relaxed adds (bucket, sum); the count is the
// buckets' total.
class Histogram {
 public:
  Histogram(std::vector<uint64_t> upper_bounds, double scale);
  void Observe(uint64_t v) {
    // Every bound before first_[bit_width(v)] is below 2^(bit_width(v) - 1) <= v.
    size_t i = first_[static_cast<size_t>(std::bit_width(v))];
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    buckets_[i].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(v, std::memory_order_relaxed);
  }
  const std::vector<uint64_t>& bounds() const { return bounds_; }
  double scale() const { return scale_; }
  // Per bucket (not cumulative), the last one is +Inf.
  std::vector<uint64_t> Buckets() const;
  uint64_t sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  const std::vector<uint64_t> bounds_;
  const double scale_;
  // Per bit width w of a value (0..64): the first bucket whose bound is >= 2^(w-1).
  std::array<uint16_t, 65> first_{};
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1
  std::atomic<uint64_t> sum_{0};
};

// Latency buckets from 10 µs to 5 s in nanoseconds, for Histogram(kLatencyBoundsNs, 1e-9).
std::vector<uint64_t> LatencyBoundsNs();

class Registry {
 public:
  Registry();
  ~Registry();
  // Emits one sample of a callback family: its labels and value.
  using Emit = std::function<void(const Labels&, double)>;

  // Names must match [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]*: a bad one is a
  // programming error and aborts at setup. Several series of one family: same name and help,
  // different labels.
  Counter& AddCounter(std::string_view name, std::string_view help, Labels labels = {});
  Histogram& AddHistogram(std::string_view name, std::string_view help, Labels labels,
                          std::vector<uint64_t> upper_bounds, double scale);
  // A family whose samples `collect` emits at every scrape (gauges of existing state, counters
  // kept elsewhere). Runs on the HTTP thread under the registry's lock.
  void AddCallback(std::string_view name, std::string_view help, Type type,
                   std::function<void(const Emit&)> collect);

  // The whole exposition: every family with its # HELP and # TYPE, in the order first added.
  std::string Render() const EXCLUDES(mu_);

 private:
  struct Family;
  Family& FamilyFor(std::string_view name, std::string_view help, Type type) REQUIRES(mu_);

  mutable Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ GUARDED_BY(mu_);
};

// One sample line of an exposition, as ParseExposition reads it.
struct Sample {
  std::string name;  // with _bucket/_sum/_count for histograms
  Labels labels;
  double value = 0;
  std::string Label(std::string_view key) const;  // "" when absent
};
// Parses the text format strictly: every sample's family has a # TYPE before it, names and label
// names are valid, label values are properly quoted and escaped, values are numbers (or NaN,
// +Inf, -Inf), a family's lines are contiguous, no series repeats, histogram buckets are
// cumulative and end with le="+Inf" equal to _count. InvalidArgument naming the line otherwise.
Result<std::vector<Sample>> ParseExposition(std::string_view text);
// The value of the one sample `name` whose labels include `match` (nullopt: none).
std::optional<double> Find(const std::vector<Sample>& samples, std::string_view name,
                           const Labels& match = {});

// The HTTP side: one thread answers one request per connection, one connection at a time:
//   GET|HEAD /metrics -> 200, the exposition     GET|HEAD /healthz -> 200 "ok" (liveness)
//   another path -> 404    another method -> 405    malformed request line, not HTTP/1.x -> 400
//   request head over 8 KiB -> 431                  head not complete within 2 s -> 408
// and closes the connection after every answer (Connection: close). Nothing a client sends can
// do more than close its own connection; a slow client delays the next scrape by 2 s at most.
class MetricsServer {
 public:
  static Result<std::unique_ptr<MetricsServer>> Start(const Endpoint& listen,
                                                      const Registry* registry);
  ~MetricsServer();  // stops the thread
  uint16_t port() const { return port_; }
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }

  static constexpr size_t kMaxRequestHead = 8192;
  static constexpr std::chrono::milliseconds kRequestTimeout{2000};

 private:
  MetricsServer(const Registry* registry, Socket listener, Socket wake, uint16_t port);
  void Loop();
  void ServeOne(Socket conn);

  const Registry* registry_;
  Socket listener_;
  Socket wake_;  // eventfd: the destructor wakes the loop
  uint16_t port_;
  std::atomic<uint64_t> requests_{0};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// Answer of an HTTP/1.1 GET (for farmemctl and tests): status code and body.
struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string body;
};
// GET `path` from `ep`, reading until the server closes (Connection: close), at most 64 MiB.
Result<HttpResponse> HttpGet(const Endpoint& ep, std::string_view path, Deadline deadline);

// Writes the port actually bound to `path` (via a temporary file and rename), for scripts and
// tests that listen on port 0.
Status WritePortFile(const std::string& path, uint16_t port);

}  // namespace farmem::metrics
