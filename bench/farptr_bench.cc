// far_ptr benchmarks, each printed next to its baseline from the same run
// (docs/benchmarks-farptr.md):
//
//   local   deref of a local far_ptr vs a raw pointer deref (ns per deref; the instruction count of
//           the fast path comes from `objdump -d` of FarDerefOne/RawDerefOne, see the doc)
//   miss    deref of a remote object = swap-in of one span vs a bare Channel::Read of the same
//           size from the same daemons (median and p99 µs)
//   tput    far_vector (uniform, Zipfian, sequential) get and far_hash_map (uniform, Zipfian)
//           find throughput at local fractions 100/50/25/12.5% of the working set, relative to
//           100%
//   compact remote bytes before/after compaction of a churned heap, and the bytes the client
//           moved to do it
//   crypto  raw AES-256-GCM seal/open of a span's worth of 64 B / 4 KiB / span-sized objects, and
//           the deref miss with encryption off vs on (same run, two runtimes side by side, rounds
//           in ABBA order; the added wall and thread CPU time per miss as the median of per-pair
//           differences with a 95% CI), and the first deref of a neighbour in the span just
//           swapped in (where lazy opening moves the rest of the work)
//   hot     issue 13's record store: 100,000 records of 256 B behind far_ptrs, Zipf 0.99 reads
//           and updates from 2 threads at 25% local: swap-ins per operation next to an
//           object-granularity LRU of the same local memory replayed on the same keys, and
//           throughput next to 100% local on the same keys
//
//   farptr_bench [--mode all|local|miss|tput|compact|crypto|hot] [--daemons 6] [--span 65536]
//                [--pairs 16] [--ops 150000] [--local 0.25] [--gather on|off]
//
// Starts its own farmemd processes (next to this binary, or $FARMEM_BIN_DIR).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_main.h"
#include "farmem/client/cluster.h"
#include "farmem/common/aead.h"
#include "farmem/common/command_line.h"
#include "farmem/common/cpu_time.h"
#include "farmem/far_hash_map.h"
#include "farmem/far_ptr.h"
#include "farmem/far_vector.h"
#include "farmem/runtime.h"
#include "support/daemon_fixture.h"
#include "zipf.h"

namespace {

using Clock = std::chrono::steady_clock;
using farmem::DerefScope;
using farmem::far_ptr;
using farmem::bench::Zipf;

struct Args {
  std::string mode = "all";
  size_t daemons = 6;
  uint32_t span = 64u << 10;
  int pairs = 16;             // --mode crypto: pairs of rounds (encryption off / on, ABBA order)
  size_t hot_ops = 150000;    // --mode hot: measured operations per thread
  double hot_local = 0.25;    // --mode hot: local fraction
  std::string gather = "on";  // --mode hot: RuntimeOptions::gather_on_miss
  // The evictor's band (RuntimeOptions), for trying another one against the defaults.
  double high_watermark = farmem::RuntimeOptions{}.high_watermark;
  double low_watermark = farmem::RuntimeOptions{}.low_watermark;
};

[[noreturn]] void Die(const std::string& m) {
  std::fprintf(stderr, "farptr_bench: %s\n", m.c_str());
  std::exit(1);
}

double Ns(Clock::duration d) { return std::chrono::duration<double, std::nano>(d).count(); }

// CPU time of the calling thread, in ns (farmem/common/cpu_time.h): what a miss costs this thread
// whatever else the machine runs.
double ThreadCpuNs() { return static_cast<double>(farmem::ThreadCpuNs()); }

// The two fast paths the doc disassembles.
[[gnu::noinline]] uint64_t FarDerefOne(const far_ptr<uint64_t>& p, const DerefScope& s) {
  return p.deref(s);
}
[[gnu::noinline]] uint64_t RawDerefOne(const uint64_t* p) { return *p; }

std::unique_ptr<farmem::Runtime> OpenRuntime(farmem::testing::DaemonSet& d, const Args& a,
                                             uint64_t budget, const std::string& res = "ec:4+2",
                                             bool encrypt = true, bool gather = true) {
  const uint32_t span = a.span;
  farmem::RuntimeOptions o;
  o.high_watermark = a.high_watermark;
  o.low_watermark = a.low_watermark;
  o.encrypt = encrypt;
  o.gather_on_miss = gather;
  o.peers = d.endpoints();
  o.secret = d.secret();
  o.local_budget = budget;
  o.span_size = span;
  o.resilience = res;
  auto rt = farmem::Runtime::Create(o);
  if (!rt) Die(rt.error().ToString());
  return std::move(*rt);
}

void BenchLocal(farmem::testing::DaemonSet& d, const Args& a) {
  constexpr size_t kN = 1 << 16;  // 64 Ki objects: fits in L2 with the entries
  constexpr int kRounds = 200;
  auto rt = OpenRuntime(d, a, 256u << 20);
  std::vector<far_ptr<uint64_t>> fp;
  std::vector<std::unique_ptr<uint64_t>> raw;
  std::vector<uint32_t> order(kN);
  for (size_t i = 0; i < kN; ++i) {
    fp.push_back(farmem::make_far_in<uint64_t>(*rt, i));
    raw.push_back(std::make_unique<uint64_t>(i));
    order[i] = static_cast<uint32_t>(i);
  }
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  uint64_t sum = 0;
  for (const bool random : {false, true}) {
    std::vector<uint32_t> idx(kN);
    for (size_t i = 0; i < kN; ++i) idx[i] = static_cast<uint32_t>(i);
    if (random) idx = order;
    double far_ns = 1e30, raw_ns = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      {
        DerefScope s;
        const auto t0 = Clock::now();
        for (int r = 0; r < kRounds; ++r) {
          for (uint32_t i : idx) sum += FarDerefOne(fp[i], s);
        }
        far_ns = std::min(far_ns, Ns(Clock::now() - t0) / (kRounds * double(kN)));
      }
      const auto t0 = Clock::now();
      for (int r = 0; r < kRounds; ++r) {
        for (uint32_t i : idx) sum += RawDerefOne(raw[i].get());
      }
      raw_ns = std::min(raw_ns, Ns(Clock::now() - t0) / (kRounds * double(kN)));
    }
    std::printf(
        "local deref (%s order, %zu objects, best of 5, call included): far_ptr %.2f ns, "
        "raw pointer %.2f ns, ratio %.2fx\n",
        random ? "random" : "allocation", kN, far_ns, raw_ns, far_ns / raw_ns);
  }
  std::printf("  [checksum %lu]\n", static_cast<unsigned long>(sum));
}

void Percentiles(std::vector<double>& v, double* med, double* p99) {
  std::sort(v.begin(), v.end());
  *med = v[v.size() / 2];
  *p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
}

// The median of per-pair differences with a distribution-free ~95% confidence interval of it
// (order statistics: [x_(k), x_(n+1-k)] with P(Binomial(n, 1/2) < k) <= 2.5%; n >= 6).
struct MedianCi {
  double median, lo, hi;
};
MedianCi MedianWithCi(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  size_t k = 0;
  double cum = 0;
  for (size_t j = 0; j <= n; ++j) {
    double c = 1;  // C(n, j) / 2^n, computed in doubles
    for (size_t i = 0; i < j; ++i) c *= static_cast<double>(n - i) / static_cast<double>(i + 1);
    cum += c / std::pow(2.0, static_cast<double>(n));
    if (cum > 0.025) break;
    k = j + 1;
  }
  if (k == 0) return {median, v.front(), v.back()};
  return {median, v[k - 1], v[n - k]};
}

void BenchMiss(farmem::testing::DaemonSet& d, const Args& a) {
  constexpr size_t kSpans = 256;
  constexpr int kRounds = 4;
  for (const char* res : {"ec:4+2", "none"}) {
    auto rt = OpenRuntime(d, a, 64u << 20, res);
    // One object per span: every miss is the swap-in of exactly one span.
    std::vector<farmem::far_bytes> objs;
    for (size_t i = 0; i < kSpans; ++i) objs.push_back(farmem::make_far_bytes_in(*rt, a.span));
    // Baseline: a bare transport read of the same size, same daemons, same run.
    farmem::client::Cluster& cl = rt->cluster();
    auto lease = cl.Allocate(1);
    if (!lease) Die(lease.error().ToString());
    auto ch = cl.OpenChannel((*lease)[0].node);
    if (!ch) Die(ch.error().ToString());
    std::vector<uint8_t> buf(a.span);
    std::vector<double> miss_us, read_us;
    for (int round = 0; round < kRounds; ++round) {
      if (auto s = rt->EvictUntil(0); !s.ok()) Die(s.ToString());
      for (size_t i = 0; i < kSpans; ++i) {
        {
          const auto t0 = Clock::now();
          DerefScope s;
          auto bytes = objs[i].deref(s);
          miss_us.push_back(Ns(Clock::now() - t0) / 1000);
          if (bytes.size() != a.span) Die("bad size");
        }
        const auto t0 = Clock::now();
        if (auto s = (*ch)->Read((*lease)[0].slab(), (i % 8) * a.span, buf); !s.ok()) {
          Die(s.ToString());
        }
        read_us.push_back(Ns(Clock::now() - t0) / 1000);
      }
    }
    (void)cl.Free(*lease);
    double mm, mp, rm, rp;
    Percentiles(miss_us, &mm, &mp);
    Percentiles(read_us, &rm, &rp);
    std::printf(
        "deref miss (%s, %u B span, %zu misses): median %.1f us p99 %.1f us | bare "
        "transport read %u B: median %.1f us p99 %.1f us | ratio median %.2fx p99 %.2fx\n",
        res, a.span, miss_us.size(), mm, mp, a.span, rm, rp, mm / rm, mp / rp);
  }
}

// Encryption (issue 16): the raw AES-256-GCM cost of sealing / opening one span's worth of
// objects one by one (what the runtime does per span: each object on its own nonce), next to one
// seal of the whole span; then the deref miss path with encryption off and on in the same run,
// for spans of 64-byte objects, of 4 KiB objects and of one span-sized object.
void BenchCrypto(farmem::testing::DaemonSet& d, const Args& a) {
  auto key = farmem::aead::GenerateKey();
  if (!key) Die(key.error().ToString());
  auto cipher = farmem::aead::Cipher::Create(*key);
  if (!cipher) Die(cipher.error().ToString());
  std::vector<uint8_t> plain(a.span, 0x5a), sealed(a.span);
  std::vector<farmem::aead::Tag> tags(a.span / 16);
  uint64_t seq = 1;
  for (uint32_t obj : {64u, 4096u, a.span}) {
    const uint32_t n = a.span / obj;
    constexpr int kReps = 2000;
    auto t0 = Clock::now();
    for (int r = 0; r < kReps; ++r) {
      for (uint32_t i = 0; i < n; ++i) {
        (void)cipher->Seal(farmem::aead::MakeNonce(1, seq++), {}, {plain.data() + i * obj, obj},
                           {sealed.data() + i * obj, obj}, &tags[i]);
      }
    }
    const double seal_us = Ns(Clock::now() - t0) / 1000 / kReps;
    const uint64_t first = seq - n;
    t0 = Clock::now();
    for (int r = 0; r < kReps; ++r) {
      for (uint32_t i = 0; i < n; ++i) {
        if (!cipher
                 ->Open(farmem::aead::MakeNonce(1, first + i), {}, {sealed.data() + i * obj, obj},
                        {plain.data() + i * obj, obj}, tags[i])
                 .ok()) {
          Die("open failed");
        }
        // Re-seal what was opened in place, so the next repetition opens valid ciphertext.
        (void)cipher->Seal(farmem::aead::MakeNonce(1, first + i), {}, {plain.data() + i * obj, obj},
                           {sealed.data() + i * obj, obj}, &tags[i]);
      }
    }
    const double open_us = Ns(Clock::now() - t0) / 1000 / kReps - seal_us;
    std::printf(
        "raw AES-256-GCM, one %u B span as %u objects of %u B: seal %.2f us (%.0f ns/object, "
        "%.2f GB/s), open %.2f us\n",
        a.span, n, obj, seal_us, seal_us * 1000 / n, a.span / seal_us / 1000, open_us);
  }
  // The miss path, encryption off vs on, as pairs of rounds in ABBA order (off on | on off | ...)
  // on two runtimes open side by side: on this shared machine the load drifts by more than
  // encryption costs, and a drift hits both sides of a pair alike. Per pair: the difference of
  // the two rounds' median miss (wall and the thread's CPU time); reported as the median over
  // pairs with a 95% confidence interval of that median.
  constexpr size_t kSpans = 256;
  const int pairs = a.pairs;
  for (uint32_t obj : {64u, 4096u, a.span}) {
    const size_t per_span = a.span / obj;
    struct Side {
      std::unique_ptr<farmem::Runtime> rt;
      std::vector<farmem::far_bytes> objs;
      std::vector<double> miss_us, cpu_us, next_us;  // every miss of every round
      std::vector<double> round_miss, round_cpu;     // each round's median
    } side[2];
    for (bool enc : {false, true}) {
      Side& sd = side[enc];
      sd.rt = OpenRuntime(d, a, 64u << 20, "ec:4+2", enc);
      for (size_t i = 0; i < kSpans * per_span; ++i) {
        sd.objs.push_back(farmem::make_far_bytes_in(*sd.rt, obj));
        DerefScope s;
        std::memset(sd.objs.back().deref_mut(s).data(), static_cast<int>(i), obj);
      }
    }
    auto round = [&](Side& sd) {
      if (auto s = sd.rt->EvictUntil(0); !s.ok()) Die(s.ToString());
      std::vector<double> miss, cpu;
      // One deref per span (objects fill spans in allocation order): each a swap-in.
      for (size_t i = 0; i < sd.objs.size(); i += per_span) {
        if (sd.objs[i].is_local()) continue;
        const double c0 = ThreadCpuNs();
        const auto t0 = Clock::now();
        DerefScope s;
        auto bytes = sd.objs[i].deref(s);
        miss.push_back(Ns(Clock::now() - t0) / 1000);
        cpu.push_back((ThreadCpuNs() - c0) / 1000);
        if (bytes.size() != obj) Die("bad size");
        if (per_span < 2) continue;
        // The first deref of a neighbour, in the span just swapped in: a local hit without
        // encryption; with it, the object is opened now (objects are opened lazily).
        const auto t1 = Clock::now();
        auto next = sd.objs[i + 1].deref(s);
        sd.next_us.push_back(Ns(Clock::now() - t1) / 1000);
        if (next.size() != obj || next[0] != static_cast<std::byte>(i + 1)) Die("bad bytes");
      }
      if (miss.empty()) Die("no misses in a round");
      sd.miss_us.insert(sd.miss_us.end(), miss.begin(), miss.end());
      sd.cpu_us.insert(sd.cpu_us.end(), cpu.begin(), cpu.end());
      double med, p99;
      Percentiles(miss, &med, &p99);
      sd.round_miss.push_back(med);
      Percentiles(cpu, &med, &p99);
      sd.round_cpu.push_back(med);
    };
    for (int p = 0; p < pairs; ++p) {
      const bool on_first = p % 2 == 1;
      round(side[on_first]);
      round(side[!on_first]);
    }
    std::vector<double> d_wall, d_cpu;
    for (int p = 0; p < pairs; ++p) {
      d_wall.push_back(side[1].round_miss[p] - side[0].round_miss[p]);
      d_cpu.push_back(side[1].round_cpu[p] - side[0].round_cpu[p]);
    }
    double med[2], p99[2], cpu_med[2], cpu_p99[2], next_med[2] = {}, next_p99[2] = {};
    for (int e : {0, 1}) {
      Percentiles(side[e].miss_us, &med[e], &p99[e]);
      Percentiles(side[e].cpu_us, &cpu_med[e], &cpu_p99[e]);
      if (!side[e].next_us.empty()) Percentiles(side[e].next_us, &next_med[e], &next_p99[e]);
    }
    const MedianCi wall = MedianWithCi(d_wall), cpu = MedianWithCi(d_cpu);
    std::printf(
        "deref miss (ec:4+2, %u B span of %u B objects, %d pairs of rounds x %zu misses, ABBA): "
        "encryption off median %.1f us p99 %.1f us | on median %.1f us p99 %.1f us\n"
        "  added per miss, median over pairs [95%% CI]: wall %+.1f us [%+.1f, %+.1f], CPU time "
        "of the thread %+.2f us [%+.2f, %+.2f] (CPU median off %.1f us, on %.1f us)\n",
        a.span, obj, pairs, kSpans, med[0], p99[0], med[1], p99[1], wall.median, wall.lo, wall.hi,
        cpu.median, cpu.lo, cpu.hi, cpu_med[0], cpu_med[1]);
    if (per_span >= 2) {
      std::printf(
          "  then the first deref of a neighbour in that span: encryption off median %.2f us p99 "
          "%.2f us | on median %.2f us p99 %.2f us\n",
          next_med[0], next_p99[0], next_med[1], next_p99[1]);
    }
  }
}

// far_vector<uint64_t> of 2 Mi elements (16 MiB) and far_hash_map<uint64_t, uint64_t> of 256 Ki
// keys, at each local fraction: uniform random reads (the worst case: every access equally
// likely, so a fraction f local misses on 1 - f of them), Zipfian reads (theta 0.99, YCSB's
// default skew) and, for the vector, a sequential scan (the prefetcher's case, AIFM's
// DataFrame-like access). Each figure is relative to the same workload at 100% local.
void BenchThroughput(farmem::testing::DaemonSet& d, const Args& a) {
  constexpr size_t kVec = 2u << 20;  // 16 MiB of uint64_t
  constexpr size_t kKeys = 256u << 10;
  constexpr int kOps = 30000;
  constexpr double kTheta = 0.99;
  const uint64_t vec_bytes = kVec * sizeof(uint64_t);
  const uint64_t map_bytes = kKeys * 32;  // measured: bucket bytes per key at the default load
  std::vector<double> fracs = {1.0, 0.5, 0.25, 0.125};
  if (const char* only = std::getenv("FARPTR_BENCH_FRACTIONS")) {
    fracs.clear();
    for (std::string_view rest = only; !rest.empty();) {
      const size_t comma = rest.find(',');
      fracs.push_back(std::stod(std::string(rest.substr(0, comma))));
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
  }
  // The Zipfian indexes are drawn before timing (the generator costs more than a local get).
  auto draw = [](Zipf z, size_t n) {
    std::vector<uint64_t> out(n);
    for (auto& x : out) x = z.Next();
    return out;
  };
  const std::vector<uint64_t> vec_zipf = draw(Zipf(kVec, kTheta, 11), kOps + kOps / 4);
  const std::vector<uint64_t> map_zipf = draw(Zipf(kKeys, kTheta, 12), kOps + kOps / 4);
  std::map<std::string, double> base;  // workload -> Mops/s at 100%
  auto report = [&](const char* what, double frac, double mops, const farmem::RuntimeStats& after,
                    const farmem::RuntimeStats& before) {
    if (frac >= 1.0) base[what] = mops;
    const double b = base.count(what) != 0 ? base[what] : 0;
    std::printf(
        "%-27s local %5.1f%%: %9.3f Mops/s = %.3f of 100%% (%lu swap-ins, %lu of them "
        "prefetched; %lu clean evictions)\n",
        what, frac * 100, mops, b > 0 ? mops / b : 0.0,
        static_cast<unsigned long>(after.swap_ins - before.swap_ins),
        static_cast<unsigned long>(after.prefetches - before.prefetches),
        static_cast<unsigned long>(after.clean_evictions - before.clean_evictions));
    std::fflush(stdout);
  };
  uint64_t sink = 0;
  for (double frac : fracs) {
    {
      // 100%: the budget holds everything (+ headroom for the watermarks).
      const uint64_t budget = frac >= 1.0
                                  ? vec_bytes * 2
                                  : static_cast<uint64_t>(static_cast<double>(vec_bytes) * frac);
      auto rt = OpenRuntime(d, a, budget);
      farmem::far_vector<uint64_t> v(*rt, kVec, 1);
      std::mt19937_64 rng(1);
      for (int i = 0; i < kOps / 4; ++i) sink += v.get(rng() % kVec);  // warm up
      farmem::RuntimeStats si = rt->stats();
      auto t0 = Clock::now();
      for (int i = 0; i < kOps; ++i) sink += v.get(rng() % kVec);
      report("far_vector uniform get", frac, kOps / (Ns(Clock::now() - t0) / 1000), rt->stats(),
             si);
      for (int i = 0; i < kOps / 4; ++i) sink += v.get(vec_zipf[kOps + i]);
      si = rt->stats();
      t0 = Clock::now();
      for (int i = 0; i < kOps; ++i) sink += v.get(vec_zipf[i]);
      report("far_vector zipf-0.99 get", frac, kOps / (Ns(Clock::now() - t0) / 1000), rt->stats(),
             si);
      // Sequential: two full passes, the second timed (elements read inside one scope per chunk
      // would be the fastest; get() is the plain API).
      for (size_t i = 0; i < kVec; ++i) sink += v.get(i);
      si = rt->stats();
      t0 = Clock::now();
      for (size_t i = 0; i < kVec; ++i) sink += v.get(i);
      report("far_vector sequential get", frac, kVec / (Ns(Clock::now() - t0) / 1000), rt->stats(),
             si);
    }
    {
      const uint64_t budget = frac >= 1.0
                                  ? map_bytes * 3
                                  : static_cast<uint64_t>(static_cast<double>(map_bytes) * frac);
      auto rt = OpenRuntime(d, a, std::max<uint64_t>(budget, 8 * a.span));
      farmem::far_hash_map<uint64_t, uint64_t> m(*rt, kKeys);
      for (uint64_t k = 0; k < kKeys; ++k) m.insert(k, k * 3);
      std::mt19937_64 rng(2);
      for (int i = 0; i < kOps / 4; ++i) sink += m.find(rng() % kKeys).has_value();
      farmem::RuntimeStats si = rt->stats();
      auto t0 = Clock::now();
      for (int i = 0; i < kOps; ++i) sink += m.find(rng() % kKeys).has_value();
      report("far_hash_map uniform find", frac, kOps / (Ns(Clock::now() - t0) / 1000), rt->stats(),
             si);
      for (int i = 0; i < kOps / 4; ++i) sink += m.find(map_zipf[kOps + i]).has_value();
      si = rt->stats();
      t0 = Clock::now();
      for (int i = 0; i < kOps; ++i) sink += m.find(map_zipf[i]).has_value();
      report("far_hash_map zipf-0.99 find", frac, kOps / (Ns(Clock::now() - t0) / 1000),
             rt->stats(), si);
      if (frac >= 1.0) {
        std::printf("  (hash map working set %.1f MiB)\n", rt->stats().object_bytes / 1048576.0);
      }
    }
  }
  std::printf("  [%lu]\n", static_cast<unsigned long>(sink % 10));
}

// Object-granularity LRU of `capacity` objects over keys [0, n): the reference a span-granularity
// runtime is held to (issue 13: far_ptr's miss rate within 1.5x of it). Intrusive list on arrays.
class ObjectLru {
 public:
  ObjectLru(size_t n, size_t capacity)
      : prev_(n, kNone), next_(n, kNone), in_(n, 0), cap_(capacity) {}
  // True on a miss (the key is then the most recent; the least recent leaves if full).
  bool Access(uint32_t k) {
    const bool miss = in_[k] == 0;
    if (!miss) {
      Unlink(k);
    } else {
      if (size_ == cap_) {
        const uint32_t victim = tail_;
        Unlink(victim);
        in_[victim] = 0;
        --size_;
      }
      in_[k] = 1;
      ++size_;
    }
    prev_[k] = kNone;
    next_[k] = head_;
    if (head_ != kNone) prev_[head_] = k;
    head_ = k;
    if (tail_ == kNone) tail_ = k;
    return miss;
  }

 private:
  static constexpr uint32_t kNone = ~0u;
  void Unlink(uint32_t k) {
    if (prev_[k] != kNone)
      next_[prev_[k]] = next_[k];
    else
      head_ = next_[k];
    if (next_[k] != kNone)
      prev_[next_[k]] = prev_[k];
    else
      tail_ = prev_[k];
  }
  std::vector<uint32_t> prev_, next_;
  std::vector<uint8_t> in_;
  size_t cap_, size_ = 0;
  uint32_t head_ = kNone, tail_ = kNone;
};

struct Record {
  uint64_t key;
  uint64_t version;
  char payload[240];
};
static_assert(sizeof(Record) == 256);

// Issue 13's record store: 100,000 records of 256 B, each behind its own far_ptr; 2 threads
// draw keys from Zipf 0.99 (each its own seed) and read or update (half each) the record, one
// DerefScope per operation. Run at 25% local and 100% local on the same traces; the far_ptr miss
// rate (swap-ins per operation) is printed next to an object-granularity LRU of the same local
// memory (budget / 256 B objects) replayed on the same keys (the two threads' traces
// interleaved one by one).
void BenchHot(farmem::testing::DaemonSet& d, const Args& a) {
  constexpr size_t kRecords = 100000;
  constexpr double kTheta = 0.99;
  constexpr int kThreads = 2;
  const size_t ops = a.hot_ops;  // per thread, measured
  const size_t warm = ops / 3;   // per thread, before
  const uint64_t data_bytes = kRecords * sizeof(Record);
  std::vector<std::vector<uint32_t>> trace(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    Zipf z(kRecords, kTheta, 100 + t);
    trace[t].resize(warm + ops);
    for (auto& k : trace[t]) k = static_cast<uint32_t>(z.Next());
  }
  struct Figures {
    double mops = 0;
    uint64_t swap_ins = 0, relocated = 0, gathered = 0, clean = 0;
    uint64_t local_objects = 0, resident_spans = 0;
    size_t ops = 0;
  };
  auto run = [&](uint64_t budget) {
    auto rt = OpenRuntime(d, a, budget, "ec:4+2", true, a.gather == "on");
    std::vector<far_ptr<Record>> recs;
    recs.reserve(kRecords);
    for (uint64_t k = 0; k < kRecords; ++k) {
      Record r{};
      r.key = k;
      recs.push_back(farmem::make_far_in<Record>(*rt, r));
    }
    std::atomic<uint64_t> bad{0};
    auto work = [&](int t, size_t from, size_t to) {
      uint64_t sum = 0;
      for (size_t i = from; i < to; ++i) {
        const uint32_t k = trace[t][i];
        DerefScope s;
        if ((i ^ k) & 1) {
          Record& r = recs[k].deref_mut(s);
          r.version++;
          r.payload[r.version % sizeof(r.payload)] = static_cast<char>(r.version);
        } else {
          const Record& r = recs[k].deref(s);
          sum += r.version;
          if (r.key != k) bad.fetch_add(1);
        }
      }
      return sum;
    };
    auto phase = [&](size_t from, size_t to) {
      std::vector<std::thread> th;
      for (int t = 0; t < kThreads; ++t) th.emplace_back([&, t] { (void)work(t, from, to); });
      for (auto& x : th) x.join();
    };
    phase(0, warm);
    const farmem::RuntimeStats b = rt->stats();
    const auto t0 = Clock::now();
    phase(warm, warm + ops);
    const double ns = Ns(Clock::now() - t0);
    const farmem::RuntimeStats e = rt->stats();
    if (bad.load() != 0) Die("a record read back with the wrong key");
    Figures f;
    f.ops = kThreads * ops;
    f.mops = static_cast<double>(f.ops) / (ns / 1000);
    f.swap_ins = e.swap_ins - b.swap_ins;
    f.relocated = e.objects_relocated - b.objects_relocated;
    f.gathered = e.objects_gathered - b.objects_gathered;
    // Objects local at the end (their bytes in a resident span), and how many spans hold them.
    f.local_objects = (e.object_bytes - e.remote_object_bytes + e.copy_object_bytes) / 256;
    f.resident_spans = e.resident_spans;
    f.clean = e.clean_evictions - b.clean_evictions;
    return f;
  };
  const double frac = a.hot_local;
  const uint64_t budget = static_cast<uint64_t>(static_cast<double>(data_bytes) * frac);
  const Figures all = run(data_bytes * 3);
  const Figures part = run(budget);
  // The LRU: the same traces, interleaved, warmed on the warm-up part.
  const size_t capacity = budget / sizeof(Record);
  ObjectLru lru(kRecords, capacity);
  uint64_t lru_miss = 0;
  for (size_t i = 0; i < warm + ops; ++i) {
    for (int t = 0; t < kThreads; ++t) {
      if (lru.Access(trace[t][i]) && i >= warm) ++lru_miss;
    }
  }
  const double far_rate = static_cast<double>(part.swap_ins) / static_cast<double>(part.ops);
  const double lru_rate = static_cast<double>(lru_miss) / static_cast<double>(part.ops);
  std::printf(
      "hot objects (%zu records of %zu B, zipf %.2f, half updates, %d threads, %u B spans, "
      "local %.1f%%, gather on miss %s):\n"
      "  far_ptr: %zu ops, %lu swap-ins = miss rate %.1f%%, %.3f Mops/s = %.3f of 100%% local "
      "(%.3f Mops/s); %lu objects gathered on their miss, %lu relocated by the evictor, %lu clean "
      "evictions; at the end %lu objects local in %lu spans\n"
      "  object LRU of %zu objects on the same keys: miss rate %.1f%%; far_ptr / LRU = %.2fx "
      "(target <= 1.5x)\n",
      kRecords, sizeof(Record), kTheta, kThreads, a.span, frac * 100, a.gather.c_str(), part.ops,
      static_cast<unsigned long>(part.swap_ins), far_rate * 100, part.mops, part.mops / all.mops,
      all.mops, static_cast<unsigned long>(part.gathered),
      static_cast<unsigned long>(part.relocated), static_cast<unsigned long>(part.clean),
      static_cast<unsigned long>(part.local_objects),
      static_cast<unsigned long>(part.resident_spans), capacity, lru_rate * 100,
      lru_rate > 0 ? far_rate / lru_rate : 0.0);
}

struct Churned {
  uint64_t id;
  char pad[120];
};

// CPU seconds the daemons have used so far (utime + stime from /proc/<pid>/stat; 10 ms ticks).
double DaemonCpuMs(farmem::testing::DaemonSet& d) {
  double ticks = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    std::ifstream in("/proc/" + std::to_string(d[i].pid()) + "/stat");
    std::string line;
    std::getline(in, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    for (int f = 3; f <= 15 && rest >> field; ++f) {
      if (f == 14 || f == 15) ticks += std::stod(field);  // utime, stime
    }
  }
  return ticks * 1000.0 / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

struct CompactFigures {
  farmem::RuntimeStats before, after;
  double wall_ms = 0, daemon_cpu_ms = 0;
};

// One churned heap compacted once, with or without parity offload. Same seed, same daemons:
// the two runs move the same objects.
CompactFigures RunCompaction(farmem::testing::DaemonSet& d, const Args& a, bool offload) {
  constexpr size_t kObjects = 64000;  // 8 MiB
  farmem::RuntimeOptions o;
  o.peers = d.endpoints();
  o.secret = d.secret();
  o.local_budget = kObjects * sizeof(Churned) / 8;
  o.span_size = a.span;
  o.auto_compact = false;  // measure one explicit compaction
  o.parity_offload = offload;
  auto rt = farmem::Runtime::Create(o);
  if (!rt) Die(rt.error().ToString());
  std::vector<far_ptr<Churned>> objs;
  for (size_t i = 0; i < kObjects; ++i)
    objs.push_back(farmem::make_far_in<Churned>(**rt, Churned{i, {}}));
  std::mt19937_64 rng(3);
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < kObjects; ++i) {
      if (rng() % 2 == 0) objs[i] = farmem::make_far_in<Churned>(**rt, Churned{i, {}});
    }
  }
  if (auto s = (*rt)->EvictUntil(0); !s.ok()) Die(s.ToString());
  CompactFigures f;
  f.before = (*rt)->stats();
  const double daemon0 = DaemonCpuMs(d);
  const auto t0 = Clock::now();
  // Compact() stops at a pass that found nothing it could lock; call it until it moves nothing.
  for (int i = 0; i < 16; ++i) {
    const uint64_t in = (*rt)->stats().compaction_spans_in;
    if (auto s = (*rt)->Compact(); !s.ok()) Die(s.ToString());
    if ((*rt)->stats().compaction_spans_in == in) break;
  }
  f.wall_ms = Ns(Clock::now() - t0) / 1e6;
  f.daemon_cpu_ms = DaemonCpuMs(d) - daemon0;
  f.after = (*rt)->stats();
  objs.clear();
  return f;
}

void BenchCompact(farmem::testing::DaemonSet& d, const Args& a) {
  const CompactFigures off = RunCompaction(d, a, false);
  const CompactFigures on = RunCompaction(d, a, true);
  auto mib = [](uint64_t b) { return static_cast<double>(b) / 1048576.0; };
  auto print = [&](const char* name, const CompactFigures& f) {
    const auto& b = f.before;
    const auto& e = f.after;
    std::printf(
        "compaction, parity offload %-3s (ec:4+2, 64000 objects of %zu B, half reallocated 3 "
        "times): span sets %.2f -> %.2f MiB, slabs leased %.2f -> %.2f MiB, remote live %.2f "
        "MiB; %lu -> %lu spans, %lu sets offloaded, %lu fallbacks; client sent %.2f MiB, "
        "received %.2f MiB, client CPU %.1f ms, daemons' CPU %.0f ms, %.0f ms wall\n",
        name, sizeof(Churned), mib(b.remote_set_bytes), mib(e.remote_set_bytes),
        mib(b.remote_leased_bytes), mib(e.remote_leased_bytes), mib(e.remote_object_bytes),
        e.compaction_spans_in - b.compaction_spans_in,
        e.compaction_spans_out - b.compaction_spans_out,
        e.compaction_offloaded_sets - b.compaction_offloaded_sets,
        e.compaction_offload_fallbacks - b.compaction_offload_fallbacks,
        mib(e.compaction_client_bytes_sent - b.compaction_client_bytes_sent),
        mib(e.compaction_client_bytes_received - b.compaction_client_bytes_received),
        (e.compaction_cpu_ns - b.compaction_cpu_ns) / 1e6, f.daemon_cpu_ms, f.wall_ms);
  };
  print("off", off);
  print("on", on);
  auto per_span = [](const CompactFigures& f, bool sent) {
    const uint64_t out = f.after.compaction_spans_out - f.before.compaction_spans_out;
    const uint64_t b =
        sent ? f.after.compaction_client_bytes_sent - f.before.compaction_client_bytes_sent
             : f.after.compaction_cpu_ns - f.before.compaction_cpu_ns;
    return out == 0 ? 0.0 : static_cast<double>(b) / static_cast<double>(out);
  };
  std::printf(
      "parity offload: client bytes sent per span written %.0f -> %.0f (x%.2f), client CPU per "
      "span written %.1f -> %.1f us (x%.2f)\n",
      per_span(off, true), per_span(on, true), per_span(on, true) / per_span(off, true),
      per_span(off, false) / 1e3, per_span(on, false) / 1e3,
      per_span(on, false) / per_span(off, false));
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"far_ptr: local deref, miss, container throughput, compaction, encryption"};
  farmem::cli::AddVersionOption(app, "farptr_bench");
  app.add_option("--mode", a.mode, "what to measure")
      ->capture_default_str()
      ->check(farmem::cli::OneOf({"all", "local", "miss", "tput", "compact", "crypto", "hot"}));
  app.add_option("--daemons", a.daemons, "farmemd processes to start")->capture_default_str();
  app.add_option("--span", a.span, "span size in bytes")->capture_default_str();
  app.add_option("--pairs", a.pairs,
                 "--mode crypto: pairs of rounds of misses, encryption off and on in ABBA order")
      ->capture_default_str()
      ->check(CLI::Range(2, 1000));
  app.add_option("--ops", a.hot_ops, "--mode hot: measured operations per thread")
      ->capture_default_str();
  app.add_option("--local", a.hot_local, "--mode hot: local fraction of the records")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--gather", a.gather, "--mode hot: gather missed objects into hot spans")
      ->capture_default_str()
      ->check(farmem::cli::OneOf({"on", "off"}));
  app.add_option("--high-watermark", a.high_watermark,
                 "RuntimeOptions::high_watermark (the evictor starts above it)")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--low-watermark", a.low_watermark,
                 "RuntimeOptions::low_watermark (the evictor stops at it)")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1.0));
  CLI11_PARSE(app, argc, argv);
  farmem::bench::UseBinariesBeside(argv[0]);
  farmem::testing::DaemonConfig cfg;
  cfg.capacity = "96M";
  cfg.slab_size = "4M";
  cfg.log_level = "warn";
  farmem::testing::DaemonSet d(cfg);
  if (auto s = d.Start(a.daemons); !s.ok()) Die(s.ToString());
  if (a.mode == "all" || a.mode == "local") BenchLocal(d, a);
  if (a.mode == "all" || a.mode == "miss") BenchMiss(d, a);
  if (a.mode == "all" || a.mode == "tput") BenchThroughput(d, a);
  if (a.mode == "all" || a.mode == "compact") BenchCompact(d, a);
  if (a.mode == "all" || a.mode == "crypto") BenchCrypto(d, a);
  if (a.mode == "all" || a.mode == "hot") BenchHot(d, a);
  return 0;
}
