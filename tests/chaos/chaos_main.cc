// farmem_chaos: runs chaos scenarios (tests/chaos/scenarios.txt) and prints the results table.
//
//   farmem_chaos --scenario NAME [--scenario NAME...]   run these (ctest runs one each)
//   farmem_chaos --all                                 every scenario, known-failing ones too
//   farmem_chaos --list                                names, expectations, schedules
//   options: --long (or FARMEM_CHAOS_LONG=1): the long form: 30 s periods, a 256 MiB export,
//            unthrottled NBD workload; --duration S: seconds per `run` period; --export-mib N:
//            the NBD export's size; --seed N (or FARMEM_CHAOS_SEED=N): another sequence of
//            workload choices (blocks, sizes, reads/writes; far objects), 0 (CI's) by default;
//            --verbose
//
// Exit status 0 when every scenario run met its expectation (see scenarios.txt).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "network.h"
#include "scenario.h"

namespace {

std::string SelfDir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

std::string Bytes(uint64_t b) {
  if (b == 0) return "0";
  if (b >= (1u << 20)) return std::to_string(b >> 20) + " MiB";
  if (b >= 1024) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

int Usage() {
  std::fprintf(stderr,
               "usage: farmem_chaos (--scenario NAME ... | --all | --list) [--long] "
               "[--duration SECONDS] [--export-mib MIB] [--seed N] [--verbose]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace farmem::chaos;  // NOLINT(build/namespaces): a test program's main
  std::vector<std::string> wanted;
  bool all = false, list = false;
  RunConfig cfg;
  const char* long_env = std::getenv("FARMEM_CHAOS_LONG");
  cfg.long_form = long_env != nullptr && std::string(long_env) != "0" && *long_env != '\0';
  int duration = 0;
  int export_mib = 0;
  // A seed that is not a whole number is refused rather than read as 0 (CI's sequence).
  auto parse_seed = [&](std::string_view text) {
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), cfg.seed);
    if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
      std::fprintf(stderr, "--seed / FARMEM_CHAOS_SEED: '%.*s' is not a whole number\n",
                   static_cast<int>(text.size()), text.data());
      return false;
    }
    return true;
  };
  if (const char* seed_env = std::getenv("FARMEM_CHAOS_SEED"); seed_env && !parse_seed(seed_env)) {
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--scenario" && i + 1 < argc) {
      wanted.push_back(argv[++i]);
    } else if (a == "--all") {
      all = true;
    } else if (a == "--list") {
      list = true;
    } else if (a == "--long") {
      cfg.long_form = true;
    } else if (a == "--duration" && i + 1 < argc) {
      duration = std::atoi(argv[++i]);
    } else if (a == "--export-mib" && i + 1 < argc) {
      export_mib = std::atoi(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      if (!parse_seed(argv[++i])) return 2;
    } else if (a == "--verbose") {
      cfg.verbose = true;
    } else {
      return Usage();
    }
  }
  if (cfg.long_form) {
    cfg.period = std::chrono::seconds(30);
    cfg.device_bytes = 256u << 20;
    cfg.daemon_capacity = "384M";
    cfg.reprotect_deadline = std::chrono::seconds(120);
    cfg.nbd_ops_per_second = 0;
    cfg.farptr_objects = 6000;
  }
  if (duration > 0) cfg.period = std::chrono::seconds(duration);
  if (export_mib > 0) cfg.device_bytes = static_cast<uint64_t>(export_mib) << 20;

  // farmemd, farmem-nbd and farmemctl: $FARMEM_BIN_DIR (ctest sets it), else next to this one.
  if (std::getenv("FARMEM_BIN_DIR") == nullptr) {
    const std::string bin = SelfDir();  // every program is built into <build>/bin
    ::setenv("FARMEM_BIN_DIR", bin.c_str(), 1);
  }
  cfg.farmemctl = std::string(std::getenv("FARMEM_BIN_DIR")) + "/farmemctl";
  // $FARMEM_CHAOS_FARPTR_WORKLOAD replaces the far_ptr workload built with this driver (to run a
  // scenario against another build of the runtime, e.g. before and after a fix).
  const char* workload = std::getenv("FARMEM_CHAOS_FARPTR_WORKLOAD");
  cfg.farptr_workload = workload != nullptr ? workload : FARMEM_CHAOS_FARPTR_WORKLOAD;
  // The idle-socket flood needs a few thousand descriptors.
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &nofile);
  }

  auto scenarios = LoadScenarios(FARMEM_CHAOS_SCENARIOS);
  if (!scenarios) {
    std::fprintf(stderr, "%s\n", scenarios.error().ToString().c_str());
    return 2;
  }
  if (list) {
    for (const Scenario& s : *scenarios) std::printf("%s\n", s.line.c_str());
    return 0;
  }
  std::vector<const Scenario*> run;
  for (const Scenario& s : *scenarios) {
    if (all || std::find(wanted.begin(), wanted.end(), s.name) != wanted.end()) run.push_back(&s);
  }
  for (const std::string& w : wanted) {
    if (std::none_of(scenarios->begin(), scenarios->end(),
                     [&](const Scenario& s) { return s.name == w; })) {
      std::fprintf(stderr, "no scenario named '%s' (farmem_chaos --list)\n", w.c_str());
      return 2;
    }
  }
  if (run.empty()) return Usage();

  // Network faults are made with tc on the loopback device of a namespace of our own
  // (network.h). Entered now, while this process is single-threaded; every scenario of this run
  // then runs in it, the others too (they only use loopback).
  if (std::any_of(run.begin(), run.end(), [](const Scenario* s) { return s->network(); })) {
    if (farmem::Status s = EnterPrivateNetwork(); !s.ok()) {
      cfg.no_network =
          "needs a network namespace of its own (root, or user namespaces): " + s.ToString();
    } else if (farmem::Status n = NetemAvailable(); !n.ok()) {
      cfg.no_netem =
          "needs netem, which this kernel does not have (the build hosts have none): run it in the "
          "qemu guest "
          "(docs/reliability.md, \"Network faults\"); " +
          n.ToString();
    }
  }

  std::printf(
      "chaos: %s form, %lld ms periods, export %llu MiB, heartbeat %u ms, failure "
      "timeout %u ms, seed %llu\n",
      cfg.long_form ? "long" : "short", static_cast<long long>(cfg.period.count()),
      static_cast<unsigned long long>(cfg.device_bytes >> 20), cfg.heartbeat_ms,
      cfg.failure_timeout_ms, static_cast<unsigned long long>(cfg.seed));
  std::fflush(stdout);
  std::vector<ScenarioResult> results;
  bool ok = true;
  size_t skipped = 0;
  for (const Scenario* s : run) {
    std::printf("== %s: %s\n", s->name.c_str(), s->line.c_str());
    std::fflush(stdout);
    ScenarioResult r = RunScenario(*s, cfg);
    if (!r.skipped.empty()) {
      std::printf("== %s: skipped: %s\n", s->name.c_str(), r.skipped.c_str());
      std::fflush(stdout);
      ++skipped;
      results.push_back(std::move(r));
      continue;
    }
    for (const std::string& n : r.notes) std::printf("   %s\n", n.c_str());
    for (const std::string& f : r.failures) std::printf("   FAILED: %s\n", f.c_str());
    std::printf("== %s: %s in %.1f s%s\n", s->name.c_str(), r.passed ? "passed" : "FAILED",
                r.seconds,
                !r.passed && !s->known_fail.empty()
                    ? (" (known to fail today: " + s->known_fail + ")").c_str()
                    : "");
    std::fflush(stdout);
    ok = ok && r.passed;
    results.push_back(std::move(r));
  }

  std::printf(
      "\n| scenario | resilience | verified | lost | corrupt | failed requests | "
      "longest stall (ms) | detect (ms) | re-protect (ms) | result |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const ScenarioResult& r = results[i];
    if (!r.skipped.empty()) {
      std::printf("| %s | %s | | | | | | | | skipped |\n", r.name.c_str(), r.mode.c_str());
      continue;
    }
    std::string verdict = r.passed ? "pass" : "FAIL";
    if (!r.passed && !run[i]->known_fail.empty()) verdict += " (" + run[i]->known_fail + ")";
    std::printf("| %s | %s | %s | %s | %s | %llu | %.0f | %s | %s | %s |\n", r.name.c_str(),
                r.mode.c_str(), Bytes(r.bytes_verified).c_str(), Bytes(r.bytes_lost).c_str(),
                Bytes(r.bytes_corrupt).c_str(), static_cast<unsigned long long>(r.failed_requests),
                r.longest_stall_ms, r.detect_ms.c_str(), r.reprotect_ms.c_str(), verdict.c_str());
  }
  // 77: ctest's SKIP_RETURN_CODE, when nothing could run here.
  if (skipped == results.size()) return 77;
  return ok ? 0 : 1;
}
