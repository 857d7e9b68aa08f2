// Latency over a window of a run, for the benchmarks where a lender asks its memory back while a
// workload reads (farptr_move_bench, nbd_move_bench): every read is a Sample (when it ended, how
// long it took); Summarize gives a window's reads/s, the median of its 250 ms buckets (less swayed
// by a stalled CPU), p50/p99/max latency and the longest gap between two completed reads (the
// stall the workload saw); Row prints one window against the steady baseline of the same run.
// ReadSampler is the reading workload itself, which makes the Samples.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace farmem::bench {

struct Sample {
  int64_t end_us;
  int64_t took_us;
};

struct Window {
  double ops_per_s = 0, p50_us = 0, p99_us = 0, max_us = 0;
  double median_ops_per_s = 0;
  int64_t longest_gap_us = 0;  // between two reads completing (or the window's edges)
  size_t n = 0;
};

// `all` in completion order.
inline Window Summarize(const std::vector<Sample>& all, int64_t from_us, int64_t to_us) {
  std::vector<int64_t> lat;
  Window w;
  int64_t last = from_us;
  for (const Sample& s : all) {
    if (s.end_us >= from_us && s.end_us < to_us) {
      lat.push_back(s.took_us);
      w.longest_gap_us = std::max(w.longest_gap_us, s.end_us - last);
      last = s.end_us;
    }
  }
  w.longest_gap_us = std::max(w.longest_gap_us, to_us - last);
  w.n = lat.size();
  if (lat.empty() || to_us <= from_us) return w;

  constexpr int64_t kBucketUs = 250000;
  std::vector<double> buckets;
  for (int64_t b = from_us; b + kBucketUs <= to_us; b += kBucketUs) {
    size_t in = 0;
    for (const Sample& smp : all) in += smp.end_us >= b && smp.end_us < b + kBucketUs;
    buckets.push_back(static_cast<double>(in) * 1e6 / kBucketUs);
  }
  if (!buckets.empty()) {
    std::sort(buckets.begin(), buckets.end());
    w.median_ops_per_s = buckets[buckets.size() / 2];
  }
  std::sort(lat.begin(), lat.end());
  w.ops_per_s = static_cast<double>(lat.size()) * 1e6 / static_cast<double>(to_us - from_us);
  w.p50_us = static_cast<double>(lat[lat.size() / 2]);
  w.p99_us = static_cast<double>(lat[std::min(lat.size() - 1, lat.size() * 99 / 100)]);
  w.max_us = static_cast<double>(lat.back());
  return w;
}

inline std::string Row(const char* what, const Window& w, const Window* base) {
  auto pct = [&](double v, double b) { return base != nullptr && b > 0 ? (v / b - 1) * 100 : 0.0; };
  return fmt::format(
      "    {:<18} {:>6.0f} reads/s ({:+6.1f}%), median of 250 ms buckets {:>6.0f} ({:+6.1f}%); "
      "p50 {:>5.0f} us  p99 {:>6.0f} us  max {:>7.0f} us  longest gap {:>6.0f} ms  ({} reads)",
      what, w.ops_per_s, pct(w.ops_per_s, base ? base->ops_per_s : 0), w.median_ops_per_s,
      pct(w.median_ops_per_s, base ? base->median_ops_per_s : 0), w.p50_us, w.p99_us, w.max_us,
      static_cast<double>(w.longest_gap_us) / 1000, w.n);
}

// The four windows of a move benchmark, printed against the first: the `seconds` before the
// event (steady), event to moved, notice to moved (the move alone, without what came before the
// notice reached the client — for a drain, farmemctl starting and connecting; `notice_us` < 0:
// no notice, from the event), and the `seconds` after the move. Times in µs since the run began.
inline void PrintMoveWindows(const std::vector<Sample>& samples, int64_t event_us,
                             int64_t notice_us, int64_t moved_us, int64_t seconds) {
  const Window steady = Summarize(samples, event_us - seconds * 1000000LL, event_us);
  const Window during = Summarize(samples, event_us, moved_us);
  const Window moving = Summarize(samples, notice_us < 0 ? event_us : notice_us, moved_us);
  const Window after = Summarize(samples, moved_us, moved_us + seconds * 1000000LL);
  fmt::print("{}\n{}\n{}\n{}\n", Row("steady (baseline)", steady, nullptr),
             Row("onset to moved", during, &steady), Row("notice to moved", moving, &steady),
             Row("after the move", after, &steady));
  std::fflush(stdout);
}

// The workload of a move benchmark: one thread of its own reading random items of [0, items)
// (the same sequence every run) until Stop, each read a Sample. `read(i, end)` reads item i, sets
// `end` when the read returned (the check that follows is not timed) and returns "" or what went
// wrong; the first error ends the thread. Times are µs since the sampler was made. The samples
// and the error are the thread's until Stop returns.
class ReadSampler {
 public:
  using Clock = std::chrono::steady_clock;

  template <typename Read>
  ReadSampler(uint64_t items, size_t expected_reads, Read read) : t0_(Clock::now()) {
    samples_.reserve(expected_reads);
    thread_ = std::thread([this, items, read = std::move(read)]() mutable {
      std::mt19937_64 rng(42);
      while (!stop_.load(std::memory_order_relaxed)) {
        const uint64_t i = rng() % items;
        const Clock::time_point start = Clock::now();
        Clock::time_point end{};
        error_ = read(i, end);
        if (!error_.empty()) return;
        samples_.push_back({us_since(end), us_since(end) - us_since(start)});
      }
    });
  }
  ReadSampler(const ReadSampler&) = delete;
  ReadSampler& operator=(const ReadSampler&) = delete;
  ~ReadSampler() { Stop(); }

  // Ends the workload; returns the first read that went wrong, "" if none did.
  const std::string& Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return error_;
  }

  int64_t us_since(Clock::time_point t) const {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - t0_).count();
  }

  // PrintMoveWindows over this run (`notice` unset: there was none). After Stop.
  void PrintWindows(Clock::time_point event, Clock::time_point notice, Clock::time_point moved,
                    int64_t seconds) const {
    PrintMoveWindows(samples_, us_since(event),
                     notice == Clock::time_point{} ? -1 : us_since(notice), us_since(moved),
                     seconds);
  }

 private:
  const Clock::time_point t0_;
  std::atomic<bool> stop_{false};
  std::vector<Sample> samples_;
  std::string error_;
  std::thread thread_;
};

}  // namespace farmem::bench
