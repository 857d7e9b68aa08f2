// A small-object key-value workload written once and run on two back-ends (issue 13, item 5:
// object far memory vs kernel paging on the same workload, AIFM's comparison with Fastswap):
//
//   --backend far  farmem::far_hash_map<uint64_t, Value> with a local budget (--budget): the
//                  runtime moves cold buckets to farmemd daemons (--peers) and back on a miss
//   --backend std  std::unordered_map<uint64_t, Value> in plain process memory; what does not fit
//                  is the kernel's to swap (run it in a memory cgroup with swap on farmem-nbd:
//                  bench/kv_swap_vs_farptr.sh does that in the qemu guest)
//
// Both run the same template, Workload<Backend>: load --keys keys in key order (values of
// --value-bytes), then for each distribution in --dists (uniform, zipf = YCSB's scrambled
// Zipfian, theta 0.99) --warmup-ops untimed and --ops timed operations, --update-pct of them
// updates (read, check, write the next version), the rest gets. Keys are drawn before the phase
// (fixed seeds; the Zipf generator costs more than a hit). A phase also ends at --seconds.
// --batch N hands N consecutive operations over together, as a server with N requests at hand
// would: their gets in one GetMany (far: far_hash_map::get_many, whose bucket misses are read
// together, overlapping their round trips; std: one find after another, since a page fault
// stops the thread), then their updates one by one.
//
// --threads T runs the operations from T threads at once, each on its own part of the keys (so
// each knows its keys' versions), over one shared map: with --batch, T threads' get_many
// batches and updates contend for the same buckets.
//
// Every value read is checked: word 0 is the key, word 1 its version (the number of updates made
// to it, mod 256, kept locally in one byte per key), every other word a hash of both. A wrong
// value prints MISMATCH and exits 3.
//
// Prints "RESULT kv <backend> <dist> <ops> <seconds> <ops/s>" per distribution, and the memory it
// used: RSS before the load (the fixed overhead: binary, libraries, the version bytes, the key
// streams, the runtime and its connections) and after it, and the peak (VmHWM).
//
//   kv_bench --backend std --keys 1048576 --value-bytes 64
//   kv_bench --backend far --peers 127.0.0.1:7411 --secret-file s --budget 24M --span 16384
//            --resilience none
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bench_main.h"
#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"
#include "farmem/far_hash_map.h"
#include "farmem/runtime.h"
#include "zipf.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string backend = "std";
  uint64_t keys = 1u << 20;
  size_t value_bytes = 64;
  std::vector<std::string> dists = {"uniform", "zipf"};
  uint64_t ops = 200000;
  uint64_t warmup_ops = 50000;
  double seconds = 120;  // per phase at most
  int update_pct = 5;    // YCSB-B's mix
  size_t batch = 1;      // ops handed over together (far: get_many; 1: one op at a time)
  size_t threads = 1;    // threads running the operations, each on its own part of the keys
  uint64_t seed = 1;
  // far
  std::string peers;
  std::string secret_file;
  std::string budget = "24M";
  uint32_t span = 16u << 10;
  std::string resilience = "none";
  bool encrypt = true;
  bool metadata_in_budget = true;  // RuntimeOptions::budget_includes_metadata
};

[[noreturn]] void Die(const std::string& m) {
  std::fprintf(stderr, "kv_bench: %s\n", m.c_str());
  std::exit(1);
}

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <size_t kBytes>
struct Value {
  static_assert(kBytes % 8 == 0 && kBytes >= 16);
  static constexpr size_t kWords = kBytes / 8;
  uint64_t w[kWords];

  static Value Make(uint64_t key, uint8_t version) {
    Value v;
    v.w[0] = key;
    v.w[1] = version;
    for (size_t i = 2; i < kWords; ++i) v.w[i] = Mix(key * 0x9E3779B97F4A7C15ull ^ version ^ i);
    return v;
  }
  // The index of the first wrong word, or kWords if `key`'s value at `version` is exactly this.
  size_t FirstWrong(uint64_t key, uint8_t version) const {
    const Value want = Make(key, version);
    for (size_t i = 0; i < kWords; ++i) {
      if (w[i] != want.w[i]) return i;
    }
    return kWords;
  }
};

// VmRSS / VmHWM of this process in MiB (/proc/self/status).
double StatusMiB(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string want = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(want, 0) == 0) return std::strtod(line.c_str() + want.size(), nullptr) / 1024;
  }
  return 0;
}

// The two back-ends: Put (load), Get (copy out), Update (copy the old value out, write the new one
// in one step). False when the key is absent.
template <typename V>
class StdBackend {
 public:
  explicit StdBackend(uint64_t keys) { m_.reserve(keys); }
  void Put(uint64_t k, const V& v) { m_.insert_or_assign(k, v); }
  bool Get(uint64_t k, V* out) const {
    auto it = m_.find(k);
    if (it == m_.end()) return false;
    *out = it->second;
    return true;
  }
  bool Update(uint64_t k, V* old, const V& next) {
    auto it = m_.find(k);
    if (it == m_.end()) return false;
    *old = it->second;
    it->second = next;
    return true;
  }
  // A batch: one lookup after another (a page fault cannot be overlapped by the program).
  void GetMany(std::span<const uint64_t> keys, std::span<std::optional<V>> out) const {
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = m_.find(keys[i]);
      out[i] = it == m_.end() ? std::nullopt : std::optional<V>(it->second);
    }
  }
  void PrintStats(const char*) const {}

 private:
  std::unordered_map<uint64_t, V> m_;
};

template <typename V>
class FarBackend {
 public:
  FarBackend(farmem::Runtime& rt, uint64_t keys) : rt_(&rt), m_(rt, keys) {}
  void Put(uint64_t k, const V& v) { m_.insert_or_assign(k, v); }
  bool Get(uint64_t k, V* out) const {
    std::optional<V> v = m_.find(k);
    if (!v) return false;
    *out = *v;
    return true;
  }
  bool Update(uint64_t k, V* old, const V& next) {
    bool found = true;
    // update() inserts V{} for an absent key first: that shows as a wrong value (word 0 is 0
    // where the key is, key 0 aside), and `found` catches the rest.
    const bool inserted = m_.update(k, [&](V& v) {
      *old = v;
      v = next;
    });
    if (inserted) found = false;
    return found;
  }
  // far_hash_map::get_many: the buckets not local are read together.
  void GetMany(std::span<const uint64_t> keys, std::span<std::optional<V>> out) const {
    m_.get_many(keys, out);
  }
  // The runtime's counters since the last call, prefixed by `phase`.
  void PrintStats(const char* phase) {
    const farmem::RuntimeStats s = rt_->stats();
    std::printf(
        "  far %s: %lu swap-ins (%lu prefetched), %lu spans evicted (%lu clean), %lu objects "
        "gathered, %.1f MiB read, %.1f MiB written; now local %.1f MiB of %.1f MiB budget, %.1f "
        "MiB of objects\n",
        phase, static_cast<unsigned long>(s.swap_ins - last_.swap_ins),
        static_cast<unsigned long>(s.prefetches - last_.prefetches),
        static_cast<unsigned long>(s.spans_evicted - last_.spans_evicted),
        static_cast<unsigned long>(s.clean_evictions - last_.clean_evictions),
        static_cast<unsigned long>(s.objects_gathered - last_.objects_gathered),
        (s.bytes_read - last_.bytes_read) / 1048576.0,
        (s.bytes_written - last_.bytes_written) / 1048576.0, s.local_bytes / 1048576.0,
        s.local_budget / 1048576.0, s.object_bytes / 1048576.0);
    // Where the process's memory is beyond the budget's frames (docs/farptr.md, "Sizing the
    // local budget"); malloc's own view: bytes in use and free in its arenas, and mmap'd.
    const struct mallinfo2 mi = ::mallinfo2();
    std::printf(
        "  far %s memory: RSS %.1f MiB = frames %.1f (of %.1f allowed) + frame cache %.1f + "
        "entries %.1f + span metadata %.1f + bucket directory %.1f MiB + the rest; malloc in use "
        "%.1f MiB, free in arenas %.1f MiB\n",
        phase, StatusMiB("VmRSS"), s.local_bytes / 1048576.0, s.frame_budget_bytes / 1048576.0,
        s.frame_cache_bytes / 1048576.0, s.entry_bytes / 1048576.0, s.span_meta_bytes / 1048576.0,
        m_.bucket_count() * sizeof(farmem::far_bytes) / 1048576.0,
        (mi.uordblks + mi.hblkhd) / 1048576.0, mi.fordblks / 1048576.0);
    last_ = s;
  }

 private:
  farmem::Runtime* rt_;
  farmem::far_hash_map<uint64_t, V> m_;
  farmem::RuntimeStats last_;
};

struct Faults {
  long minor, major;
};
Faults FaultsNow() {
  rusage r{};
  ::getrusage(RUSAGE_SELF, &r);
  return {r.ru_minflt, r.ru_majflt};
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// One key stream of `n` keys for `dist` (drawn before the phase that uses it).
std::vector<uint32_t> DrawKeys(const std::string& dist, uint64_t keys, uint64_t n, uint64_t seed) {
  std::vector<uint32_t> out(n);
  if (dist == "zipf") {
    farmem::bench::Zipf z(keys, 0.99, seed);
    for (auto& k : out) k = static_cast<uint32_t>(z.Next());
  } else {
    std::mt19937_64 rng(seed);
    for (auto& k : out) k = static_cast<uint32_t>(rng() % keys);
  }
  return out;
}

template <typename V, typename Backend>
void Workload(Backend& b, const Args& a) {
  // --threads T: thread t owns the keys [t * part, (t + 1) * part) (its updates and the versions
  // it checks are its own), drawn as one thread's stream of `part` keys; the keys' buckets are
  // shared (a far_hash_map bucket holds keys from every part), so the threads contend as the
  // requests of one server would. Operations are split among the threads.
  const size_t nt = a.threads;
  const uint64_t part = a.keys / nt;
  std::vector<uint8_t> version(a.keys, 0);
  struct Stream {
    std::vector<uint32_t> warm, timed;
    std::vector<uint8_t> kind;  // per warm-up and timed op: 1 = update
  };
  struct Phase {
    std::string dist;
    std::vector<Stream> threads;
  };
  std::vector<Phase> phases;
  for (size_t i = 0; i < a.dists.size(); ++i) {
    const std::string& d = a.dists[i];
    Phase p{d, {}};
    for (size_t t = 0; t < nt; ++t) {
      const uint64_t warm = a.warmup_ops / nt, ops = a.ops / nt;
      std::vector<uint32_t> all = DrawKeys(d, part, warm + ops, a.seed + 10 * i + 1000 * t);
      for (uint32_t& k : all) k += static_cast<uint32_t>(t * part);
      Stream st{{all.begin(), all.begin() + static_cast<long>(warm)},
                {all.begin() + static_cast<long>(warm), all.end()},
                {}};
      std::mt19937_64 rng(a.seed + 10 * i + 1 + 1000 * t);
      st.kind.resize(warm + ops);
      for (auto& k : st.kind) k = rng() % 100 < static_cast<uint64_t>(a.update_pct) ? 1 : 0;
      p.threads.push_back(std::move(st));
    }
    phases.push_back(std::move(p));
  }
  std::printf(
      "kv %s: %lu keys, %zu B values, %d%% updates, %zu op(s) a batch, %zu thread(s); RSS before "
      "the load (fixed overhead) %.1f MiB\n",
      a.backend.c_str(), static_cast<unsigned long>(a.keys), sizeof(V), a.update_pct, a.batch, nt,
      StatusMiB("VmRSS"));
  std::fflush(stdout);

  auto t0 = Clock::now();
  for (uint64_t k = 0; k < a.keys; ++k) b.Put(k, V::Make(k, 0));
  std::printf("kv %s: loaded in %.1f s; RSS %.1f MiB\n", a.backend.c_str(),
              Seconds(Clock::now() - t0), StatusMiB("VmRSS"));
  b.PrintStats("load");
  std::fflush(stdout);

  // What one thread keeps.
  struct Worker {
    uint64_t checked = 0;
    std::vector<uint64_t> batch_keys;
    std::vector<std::optional<V>> batch_vals;
  };
  std::vector<Worker> workers(nt);
  auto check = [&](Worker& w, uint32_t k, uint8_t want, const std::optional<V>& got) {
    if (!got) {
      std::printf("kv %s: MISMATCH key %u is missing\n", a.backend.c_str(), k);
      std::fflush(stdout);
      std::exit(3);
    }
    if (const size_t i = got->FirstWrong(k, want); i != V::kWords) {
      std::printf("kv %s: MISMATCH key %u version %u word %zu: got %016lx want %016lx\n",
                  a.backend.c_str(), k, want, i, static_cast<unsigned long>(got->w[i]),
                  static_cast<unsigned long>(V::Make(k, want).w[i]));
      std::fflush(stdout);
      std::exit(3);
    }
    ++w.checked;
  };
  auto one = [&](Worker& w, uint32_t k, bool update) {
    V v;
    const uint8_t want = version[k];
    bool found;
    if (update) {
      found = b.Update(k, &v, V::Make(k, static_cast<uint8_t>(want + 1)));
      version[k] = static_cast<uint8_t>(want + 1);
    } else {
      found = b.Get(k, &v);
    }
    check(w, k, want, found ? std::optional<V>(v) : std::nullopt);
  };
  // A batch of ops (--batch): the gets' values come from one GetMany taken first (the values
  // at the batch's start); updates run one by one after it (their buckets now local), and a
  // get of a key updated earlier in the same batch reads again.
  auto batch = [&](Worker& w, const uint32_t* keys, const uint8_t* kind, size_t n) {
    w.batch_keys.assign(keys, keys + n);
    w.batch_vals.resize(n);
    b.GetMany(w.batch_keys, w.batch_vals);
    for (size_t j = 0; j < n; ++j) {
      const uint32_t k = keys[j];
      bool again = kind[j] != 0;
      for (size_t p = 0; p < j && !again; ++p) again = kind[p] != 0 && keys[p] == k;
      if (again) {
        one(w, k, kind[j] != 0);
      } else {
        check(w, k, version[k], w.batch_vals[j]);
      }
    }
  };
  // Runs keys[i] (op kinds from kind[offset + i]) until done or `seconds`; how many ran.
  auto run = [&](Worker& w, const std::vector<uint32_t>& keys, const std::vector<uint8_t>& kind,
                 size_t offset) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(a.seconds);
    size_t i = 0;
    if (a.batch > 1) {
      size_t since_check = 0;
      while (i < keys.size()) {
        if (since_check >= 256) {
          since_check = 0;
          if (Clock::now() > deadline) break;
        }
        const size_t n = std::min(a.batch, keys.size() - i);
        batch(w, &keys[i], &kind[offset + i], n);
        i += n;
        since_check += n;
      }
      return i;
    }
    for (; i < keys.size(); ++i) {
      if ((i & 255) == 0 && Clock::now() > deadline) break;
      one(w, keys[i], kind[offset + i] != 0);
    }
    return i;
  };
  // Every thread's part of a phase at once; the operations done.
  auto run_all = [&](const Phase& p, bool timed) {
    std::vector<size_t> done(nt, 0);
    std::vector<std::thread> th;
    for (size_t t = 1; t < nt; ++t) {
      th.emplace_back([&, t] {
        const Stream& st = p.threads[t];
        done[t] = run(workers[t], timed ? st.timed : st.warm, st.kind, timed ? st.warm.size() : 0);
      });
    }
    const Stream& st = p.threads[0];
    done[0] = run(workers[0], timed ? st.timed : st.warm, st.kind, timed ? st.warm.size() : 0);
    for (std::thread& x : th) x.join();
    size_t sum = 0;
    for (size_t d : done) sum += d;
    return sum;
  };
  for (const Phase& p : phases) {
    t0 = Clock::now();
    const size_t warm = run_all(p, false);
    std::printf("kv %s %s: warm-up %zu ops in %.1f s\n", a.backend.c_str(), p.dist.c_str(), warm,
                Seconds(Clock::now() - t0));
    b.PrintStats("warm-up");
    const Faults f0 = FaultsNow();
    t0 = Clock::now();
    const size_t done = run_all(p, true);
    const double s = Seconds(Clock::now() - t0);
    const Faults f1 = FaultsNow();
    std::printf(
        "RESULT kv %s %s %zu %.2f %.0f\n  (%zu ops in %.2f s: %.0f ops/s; %.3f major / %.3f "
        "minor page faults per op; RSS %.1f MiB, peak %.1f MiB)\n",
        a.backend.c_str(), p.dist.c_str(), done, s, done / s, done, s, done / s,
        static_cast<double>(f1.major - f0.major) / static_cast<double>(std::max<size_t>(done, 1)),
        static_cast<double>(f1.minor - f0.minor) / static_cast<double>(std::max<size_t>(done, 1)),
        StatusMiB("VmRSS"), StatusMiB("VmHWM"));
    b.PrintStats("timed");
    std::fflush(stdout);
  }
  uint64_t checked = 0;
  for (const Worker& w : workers) checked += w.checked;
  std::printf("kv %s: %lu values checked, all correct\n", a.backend.c_str(),
              static_cast<unsigned long>(checked));
}

template <typename V>
void RunWithValue(const Args& a) {
  if (a.backend == "std") {
    StdBackend<V> b(a.keys);
    Workload<V>(b, a);
    return;
  }
  farmem::RuntimeOptions o;
  auto peers = farmem::ParseEndpointList(a.peers);
  if (!peers || peers->empty()) Die("--backend far needs --peers HOST:PORT,...");
  o.peers = *peers;
  auto secret = farmem::auth::LoadSecretFile(a.secret_file);
  if (!secret) Die("--secret-file: " + secret.error().ToString());
  o.secret = *secret;
  auto budget = farmem::ParseSize(a.budget);
  if (!budget) Die("--budget: " + budget.error().ToString());
  o.local_budget = *budget;
  o.span_size = a.span;
  o.resilience = a.resilience;
  o.encrypt = a.encrypt;
  o.budget_includes_metadata = a.metadata_in_budget;
  auto rt = farmem::Runtime::Create(o);
  if (!rt) Die(rt.error().ToString());
  std::printf("kv far: budget %.1f MiB (%s), %u B spans, resilience %s, encryption %s\n",
              static_cast<double>(*budget) / 1048576.0,
              a.metadata_in_budget ? "metadata included" : "frames only", a.span,
              a.resilience.c_str(), a.encrypt ? "on" : "off");
  {
    FarBackend<V> b(**rt, a.keys);
    Workload<V>(b, a);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"a small-object key-value workload on far_hash_map or std::unordered_map"};
  farmem::cli::AddVersionOption(app, "kv_bench");
  app.add_option("--backend", a.backend, "far (far_hash_map) or std (std::unordered_map)")
      ->capture_default_str()
      ->check(farmem::cli::OneOf({"far", "std"}));
  app.add_option("--keys", a.keys, "keys loaded")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 31));
  app.add_option("--value-bytes", a.value_bytes, "value size")
      ->capture_default_str()
      ->check(CLI::IsMember({64, 128, 256}));
  app.add_option("--dists", a.dists, "key distributions, comma-separated: uniform, zipf")
      ->capture_default_str()
      ->delimiter(',')
      ->check(farmem::cli::OneOf({"uniform", "zipf"}));
  app.add_option("--ops", a.ops, "timed operations per distribution")->capture_default_str();
  app.add_option("--warmup-ops", a.warmup_ops, "untimed operations before them")
      ->capture_default_str();
  app.add_option("--seconds", a.seconds, "at most this long per phase (warm-up, timed)")
      ->capture_default_str();
  app.add_option("--update-pct", a.update_pct, "updates among the operations, percent")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  app.add_option("--seed", a.seed, "seed of the key streams")->capture_default_str();
  app.add_option("--batch", a.batch,
                 "operations handed to the map together: their gets in one get_many (far: the "
                 "misses overlapped; std: one after another), then the updates; 1: one at a time")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{256}));
  app.add_option("--threads", a.threads,
                 "threads running the operations at once, each updating and checking its own "
                 "part of the keys (their buckets shared); --ops and --warmup-ops are split "
                 "among them")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{64}));
  app.add_option("--peers", a.peers, "far: the farmemd daemons, HOST:PORT,...");
  app.add_option("--secret-file", a.secret_file, "far: the cluster secret");
  app.add_option("--budget", a.budget, "far: local_budget (e.g. 24M)")->capture_default_str();
  app.add_option("--span", a.span, "far: span size in bytes")->capture_default_str();
  app.add_option("--resilience", a.resilience, "far: none, replicate:N, ec:k+r")
      ->capture_default_str();
  app.add_flag("--encrypt,!--no-encrypt", a.encrypt, "far: encrypt objects (the default)");
  app.add_flag("--metadata-in-budget,!--no-metadata-in-budget", a.metadata_in_budget,
               "far: the budget counts the runtime's metadata too (entries, span tables, frame "
               "cache), so RSS is about budget + fixed overhead (the default); off: frames only");
  CLI11_PARSE(app, argc, argv);
  switch (a.value_bytes) {
    case 64:
      RunWithValue<Value<64>>(a);
      break;
    case 128:
      RunWithValue<Value<128>>(a);
      break;
    default:
      RunWithValue<Value<256>>(a);
      break;
  }
  return 0;
}
