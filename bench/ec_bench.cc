// ec_bench: Reed-Solomon encode and decode throughput through farmem::ec::ReedSolomon, next to
// raw ISA-L calls on the same buffers in the same run (the baseline).
//
// For each code RS(k, r) and fragment length:
//   encode  farmem: ReedSolomon::Encode            isa-l: ec_encode_data with precomputed tables
//   decode  farmem: ReedSolomon::Decode, 2 data    isa-l: ec_encode_data with a decode matrix
//           fragments erased (cached tables)              inverted once before timing
// Throughput is GB/s (1e9 bytes/s) of data, k * fragment length per operation, timed by default
// in thread CPU time (--clock wall for wall time): on a shared machine, time spent descheduled
// is not charged to either side. The two sides alternate in short rounds so that frequency
// changes and noisy neighbours hit both alike. The GB/s columns are the fastest round of each side
// (interference only ever slows a round down); "ratio best" divides those, "ratio paired" is the
// median over rounds of farmem / isa-l within the same round (the two halves of a round run back to
// back, so they see the same machine).
//
//   ec_bench                         # defaults: RS(4,2) RS(8,2) RS(10,4), 4 KiB and 64 KiB
//   ec_bench --seconds 2 --rounds 40 # longer, steadier run
//   ec_bench --codes 8+2 --lengths 512 --cpu 1
#include <isa-l/erasure_code.h>
#include <sched.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "farmem/common/command_line.h"
#include "farmem/ec/reed_solomon.h"

namespace {

struct Code {
  int k;
  int r;
};

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

// k + r fragments of `len` bytes, each 64-byte aligned, data filled with a fixed pseudo-random
// pattern.
class Stripe {
 public:
  Stripe(int n, size_t len) {
    const size_t rounded = (len + 63) / 64 * 64;
    uint32_t x = 2463534242u;
    for (int i = 0; i < n; ++i) {
      bufs_.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(64, rounded)));
      for (size_t b = 0; b < len; ++b) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        bufs_.back().get()[b] = static_cast<uint8_t>(x);
      }
      ptrs_.push_back(bufs_.back().get());
    }
  }
  std::vector<uint8_t*>& ptrs() { return ptrs_; }

 private:
  std::vector<std::unique_ptr<uint8_t, AlignedFree>> bufs_;
  std::vector<uint8_t*> ptrs_;
};

// Which clock times a round. Thread CPU time does not advance while this thread is descheduled,
// so other processes on a shared 2-vCPU machine cost far less accuracy than with wall time.
bool g_use_cpu_clock = true;

double Now() {
  if (g_use_cpu_clock) {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs op `iters` times and returns the seconds taken.
double TimeIt(const std::function<void()>& op, long iters) {
  const double start = Now();
  for (long i = 0; i < iters; ++i) op();
  return Now() - start;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Best(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

struct Measurement {
  double farmem_best;
  double isal_best;
  double paired_ratio;  // median over rounds of farmem / isa-l
};

// Alternates the two implementations for `rounds` rounds of about `seconds / rounds` each.
Measurement Compare(const std::function<void()>& farmem_op, const std::function<void()>& isal_op,
                    double bytes_per_op, double seconds, int rounds) {
  // Warm up both (caches, table pages, CPU frequency) and size the rounds from the baseline.
  long iters = 1;
  double t = 0;
  while ((t = TimeIt(isal_op, iters)) < 0.01) iters *= 2;
  TimeIt(farmem_op, iters);
  const long per_round = std::max(1L, static_cast<long>(iters * (seconds / rounds) / t));
  std::vector<double> ours;
  std::vector<double> base;
  for (int i = 0; i < rounds; ++i) {
    if (i % 2 == 0) {
      ours.push_back(bytes_per_op * per_round / TimeIt(farmem_op, per_round) / 1e9);
      base.push_back(bytes_per_op * per_round / TimeIt(isal_op, per_round) / 1e9);
    } else {
      base.push_back(bytes_per_op * per_round / TimeIt(isal_op, per_round) / 1e9);
      ours.push_back(bytes_per_op * per_round / TimeIt(farmem_op, per_round) / 1e9);
    }
  }
  std::vector<double> ratios;
  for (int i = 0; i < rounds; ++i) ratios.push_back(ours[i] / base[i]);
  return {Best(ours), Best(base), Median(ratios)};
}

std::vector<Code> ParseCodes(const std::vector<std::string>& specs) {
  std::vector<Code> codes;
  for (const std::string& s : specs) {
    Code c{};
    if (std::sscanf(s.c_str(), "%d+%d", &c.k, &c.r) != 2) {
      std::fprintf(stderr, "ec_bench: bad --codes entry '%s', expected k+r such as 4+2\n",
                   s.c_str());
      std::exit(2);
    }
    codes.push_back(c);
  }
  return codes;
}

// Prints one result line and returns farmem / isa-l of the fastest rounds.
double PrintRow(Code c, size_t len, const char* op, Measurement m) {
  const double ratio = m.farmem_best / m.isal_best;
  std::printf("%-8s  %6zu  %-6s  %11.2f  %10.2f  %10.3f  %12.3f\n",
              ("RS(" + std::to_string(c.k) + "," + std::to_string(c.r) + ")").c_str(), len, op,
              m.farmem_best, m.isal_best, ratio, m.paired_ratio);
  std::fflush(stdout);
  return ratio;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Reed-Solomon encode/decode throughput: farmem::ec vs raw ISA-L, same buffers"};
  double seconds = 0.6;
  int rounds = 20;
  int cpu = -1;
  std::vector<std::string> code_specs = {"4+2", "8+2", "10+4"};
  std::vector<size_t> lengths = {4096, 65536};
  app.add_option("--seconds", seconds, "timed seconds per (case, implementation)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "alternating rounds per case")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--codes", code_specs, "codes as k+r")->capture_default_str()->delimiter(',');
  app.add_option("--lengths", lengths, "fragment lengths in bytes")
      ->capture_default_str()
      ->delimiter(',')
      ->check(CLI::Range(size_t{1}, size_t{1} << 30));
  std::string clock = "cpu";
  app.add_option("--clock", clock, "cpu: thread CPU time; wall: steady_clock")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "wall"}));
  app.add_option("--cpu", cpu, "pin to this CPU (-1: do not pin)")->capture_default_str();
  farmem::cli::AddVersionOption(app, "ec_bench");
  CLI11_PARSE(app, argc, argv);
  g_use_cpu_clock = clock == "cpu";

  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      std::perror("ec_bench: sched_setaffinity");
      return 1;
    }
  }

  std::printf(
      "# GB/s of data (k * fragment bytes per op, 1e9 B/s): fastest of %d alternating "
      "rounds, %.2f s per side per case, %s time\n",
      rounds, seconds, g_use_cpu_clock ? "thread CPU" : "wall");
  std::printf("%-8s  %6s  %-6s  %11s  %10s  %10s  %12s\n", "code", "frag B", "op", "farmem GB/s",
              "isa-l GB/s", "ratio best", "ratio paired");
  double worst_ratio = 1e9;
  for (Code c : ParseCodes(code_specs)) {
    auto created = farmem::ec::ReedSolomon::Create(c.k, c.r);
    if (!created) {
      std::fprintf(stderr, "ec_bench: %s\n", created.error().ToString().c_str());
      return 2;
    }
    const farmem::ec::ReedSolomon& rs = **created;
    const int n = c.k + c.r;

    // Raw ISA-L state, built the way ISA-L's own examples do.
    std::vector<uint8_t> matrix(static_cast<size_t>(n) * c.k);
    gf_gen_cauchy1_matrix(matrix.data(), n, c.k);
    std::vector<uint8_t> encode_tables(static_cast<size_t>(32) * c.k * c.r);
    ec_init_tables(c.k, c.r, matrix.data() + c.k * c.k, encode_tables.data());

    // Erase data fragments 0 and 1 (fewer if the code has fewer data or parity fragments).
    std::vector<int> erased;
    for (int e = 0; e < std::min({2, c.r, c.k}); ++e) erased.push_back(e);
    const int erasures = static_cast<int>(erased.size());
    std::vector<int> survivors;  // the first k fragments not erased, as ReedSolomon::Decode reads
    for (int i = erasures; i < n && static_cast<int>(survivors.size()) < c.k; ++i) {
      survivors.push_back(i);
    }
    std::vector<uint8_t> sub(static_cast<size_t>(c.k) * c.k);
    std::vector<uint8_t> inverse(sub.size());
    for (int i = 0; i < c.k; ++i) {
      std::memcpy(&sub[i * c.k], &matrix[survivors[i] * c.k], c.k);
    }
    if (gf_invert_matrix(sub.data(), inverse.data(), c.k) != 0) {
      std::fprintf(stderr, "ec_bench: singular decode matrix\n");
      return 1;
    }
    std::vector<uint8_t> decode_tables(static_cast<size_t>(32) * c.k * std::max(erasures, 1));
    if (erasures > 0) ec_init_tables(c.k, erasures, inverse.data(), decode_tables.data());

    for (size_t len : lengths) {
      Stripe stripe(n, len);
      std::vector<uint8_t*>& ptrs = stripe.ptrs();
      std::vector<const uint8_t*> data(ptrs.begin(), ptrs.begin() + c.k);
      std::span<uint8_t* const> parity(ptrs.data() + c.k, c.r);
      std::vector<uint8_t*> isal_src(ptrs.begin(), ptrs.begin() + c.k);
      std::vector<uint8_t*> isal_dst(ptrs.begin() + c.k, ptrs.end());
      const int ilen = static_cast<int>(len);
      const double bytes = static_cast<double>(len) * c.k;

      auto farmem_encode = [&] {
        if (!rs.Encode(data, parity, len).ok()) std::abort();
      };
      auto isal_encode = [&] {
        ec_encode_data(ilen, c.k, c.r, encode_tables.data(), isal_src.data(), isal_dst.data());
      };
      worst_ratio = std::min(
          worst_ratio,
          PrintRow(c, len, "encode", Compare(farmem_encode, isal_encode, bytes, seconds, rounds)));
      if (erasures == 0) continue;

      // Both decoders must rebuild the same bytes before either is timed.
      std::vector<std::vector<uint8_t>> saved;
      for (int e : erased) saved.emplace_back(ptrs[e], ptrs[e] + len);
      std::vector<uint8_t*> dec_src;
      for (int s : survivors) dec_src.push_back(ptrs[s]);
      std::vector<uint8_t*> dec_dst;
      for (int e : erased) dec_dst.push_back(ptrs[e]);
      for (int e : erased) std::memset(ptrs[e], 0, len);
      ec_encode_data(ilen, c.k, erasures, decode_tables.data(), dec_src.data(), dec_dst.data());
      for (size_t i = 0; i < erased.size(); ++i) {
        if (std::memcmp(ptrs[erased[i]], saved[i].data(), len) != 0) {
          std::fprintf(stderr, "ec_bench: raw ISA-L decode gave wrong bytes\n");
          return 1;
        }
        std::memset(ptrs[erased[i]], 0, len);
      }
      if (!rs.Decode(ptrs, erased, len).ok()) return 1;
      for (size_t i = 0; i < erased.size(); ++i) {
        if (std::memcmp(ptrs[erased[i]], saved[i].data(), len) != 0) {
          std::fprintf(stderr, "ec_bench: farmem decode gave wrong bytes\n");
          return 1;
        }
      }

      auto farmem_decode = [&] {
        if (!rs.Decode(ptrs, erased, len).ok()) std::abort();
      };
      auto isal_decode = [&] {
        ec_encode_data(ilen, c.k, erasures, decode_tables.data(), dec_src.data(), dec_dst.data());
      };
      worst_ratio = std::min(
          worst_ratio,
          PrintRow(c, len, "decode", Compare(farmem_decode, isal_decode, bytes, seconds, rounds)));
    }
  }
  std::printf("# lowest farmem / isa-l ratio (fastest rounds): %.3f\n", worst_ratio);
  return 0;
}
