#include "scenario.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "chaos_log.h"
#include "farmem/common/metrics.h"
#include "faults.h"
#include "nbd_verifier.h"
#include "network.h"
#include "support/daemon_fixture.h"
#include "support/memory_scan.h"
#include "support/wait.h"
#include "test_process.h"

namespace farmem::chaos {

namespace {

using blockdev::testing::ChildProcess;
using blockdev::testing::SpawnOptions;
using SteadyClock = std::chrono::steady_clock;

const char* const kStepsWithDaemon[] = {"kill", "stop",  "restart", "fill", "flood", "probe",
                                        "cut",  "delay", "loss",    "back", "flip"};
const char* const kStepsWithCount[] = {"stall"};
const char* const kStepsPlain[] = {"run",     "reprotect", "unfill", "unstall",
                                   "unflood", "start",     "heal",   "rejoin"};
const char* const kNetworkSteps[] = {"cut", "delay", "loss"};
const char* const kNetemSteps[] = {"delay", "loss"};
const char* const kStepsWithValue[] = {"delay", "loss", "flip"};

Result<Step> ParseStep(const std::string& word, int daemons) {
  Step s;
  const size_t colon = word.find(':');
  s.op = word.substr(0, colon);
  const bool with_daemon = std::ranges::find(kStepsWithDaemon, s.op) != std::end(kStepsWithDaemon);
  const bool with_count = std::ranges::find(kStepsWithCount, s.op) != std::end(kStepsWithCount);
  const bool plain = std::ranges::find(kStepsPlain, s.op) != std::end(kStepsPlain);
  if (!with_daemon && !with_count && !plain) {
    return Err(InvalidArgument("unknown step '" + word + "'"));
  }
  if (plain) {
    if (colon != std::string::npos) return Err(InvalidArgument("step '" + s.op + "' takes no :N"));
    return s;
  }
  if (colon == std::string::npos) return Err(InvalidArgument("step '" + s.op + "' needs :N"));
  const size_t equals = word.find('=', colon);
  if (equals != std::string::npos &&
      std::ranges::find(kStepsWithValue, s.op) == std::end(kStepsWithValue)) {
    return Err(InvalidArgument("step '" + s.op + "' takes no =VALUE"));
  }
  try {
    size_t used = 0;
    const std::string n =
        word.substr(colon + 1, equals == std::string::npos ? equals : equals - colon - 1);
    s.arg = std::stoi(n, &used);
    if (used != n.size()) throw std::invalid_argument(n);
    if (equals != std::string::npos) {
      const std::string v = word.substr(equals + 1);
      s.value = std::stod(v, &used);
      if (used != v.size() || s.value < 0) throw std::invalid_argument(v);
    }
  } catch (...) {
    return Err(InvalidArgument("bad number in '" + word + "'"));
  }
  if (with_daemon && (s.arg < 0 || s.arg >= daemons)) {
    return Err(InvalidArgument(fmt::format("'{}': there are {} daemons", word, daemons)));
  }
  return s;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Ms(double ms) { return fmt::format("{:.0f}", ms); }

std::string Join(const std::vector<std::string>& parts, std::string_view separator) {
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += separator;
    out += p;
  }
  return out;
}

bool Flips(const Scenario& s) {
  return std::ranges::any_of(s.steps, [](const Step& st) { return st.op == "flip"; });
}

// --peers for the workload: every daemon of the scenario.
std::string PeerList(testing::DaemonSet& daemons) {
  std::vector<std::string> peers;
  for (const Endpoint& ep : daemons.endpoints()) peers.push_back(ep.ToString());
  return Join(peers, ",");
}

// A fault whose detection and re-protection the table reports.
struct Fault {
  std::string what;  // "kill 0"
  std::string endpoint;
  int64_t ms = 0;  // wall clock
  // Faults with no `run` or `reprotect` step between them form one burst, re-protected together.
  int burst = 0;
  // Delay or loss: the daemon need not be declared down (if it is, detection and re-protection
  // are reported like any fault's).
  bool impairment = false;
  bool network = false;           // cut, delay, loss: ended by `heal`
  int64_t healed_ms = INT64_MAX;  // wall clock of the `heal` that ended it
  // Bits flipped in the daemon's slabs (flip:N): detected by a read that fails authentication
  // (with `impairment`: a flipped page rewritten before it was read is never noticed).
  bool integrity = false;
};

// Detection and re-protection of each fault, read from the workload's log.
struct FaultTimes {
  std::optional<int64_t> detect;     // ms after the fault
  std::optional<int64_t> reprotect;  // ms after the fault
  uint64_t needed = 0, done = 0;     // members to re-protect, seen re-protected (in its burst)
};

// A burst's re-protection lines are those from its first fault to the next burst. They are
// credited to the burst's faults in order: fault j is re-protected when the lines reach the
// members needed by faults 0..j of the burst, or when the page store says every extent is whole
// again (after the fault was detected, before the next burst), whichever comes first.
// `recovered`: faults [0, recovered) are known re-protected (the far_ptr runtime said so): each
// is complete at the last re-protection line of its burst (or at its detection if none).
std::vector<FaultTimes> Analyze(const std::vector<Fault>& faults, const std::vector<LogLine>& log,
                                size_t recovered) {
  const std::vector<DownEvent> downs = DownEvents(log);
  const std::vector<int64_t> reprotects = ReprotectTimes(log);
  const std::vector<WholeEvent> wholes = WholeEvents(log);
  const std::vector<int64_t> integrity = IntegrityTimes(log);
  std::vector<FaultTimes> out(faults.size());
  // Log timestamps have millisecond resolution: allow a few ms of rounding.
  constexpr int64_t kSlack = 5;
  for (size_t f = 0; f < faults.size(); ++f) {
    const int64_t from = faults[f].ms - kSlack;
    size_t next = f + 1;
    while (next < faults.size() && faults[next].burst == faults[f].burst) ++next;
    const int64_t until = next < faults.size() ? faults[next].ms - kSlack : INT64_MAX;
    // An impairment is blamed only for downs while it lasted.
    const int64_t last = faults[f].impairment ? faults[f].healed_ms : INT64_MAX;
    if (faults[f].integrity) {
      // Detected by the first read that failed authentication; the members it failed are
      // re-protected like those of a daemon that died (far_ptr names them).
      auto bad = std::ranges::find_if(integrity, [&](int64_t ms) { return ms >= from; });
      if (bad == integrity.end()) continue;
      out[f].detect = std::max<int64_t>(0, *bad - faults[f].ms);
      out[f].needed = std::max<uint64_t>(1, FailedMembers(log, faults[f].endpoint, from, until));
      continue;
    }
    auto down = std::ranges::find_if(downs, [&](const DownEvent& d) {
      return d.endpoint == faults[f].endpoint && d.ms >= from && d.ms < last;
    });
    if (down == downs.end()) continue;
    FaultTimes& t = out[f];
    t.detect = std::max<int64_t>(0, down->ms - faults[f].ms);
    // far_ptr names the members that failed; otherwise every lease lost held one.
    const uint64_t members = FailedMembers(log, faults[f].endpoint, from, until);
    t.needed = members > 0 ? members : down->leases;
  }
  for (size_t f = 0; f < faults.size(); ++f) {
    if (!out[f].detect) continue;
    size_t first = f;
    while (first > 0 && faults[first - 1].burst == faults[f].burst) --first;
    size_t next = f + 1;
    while (next < faults.size() && faults[next].burst == faults[f].burst) ++next;
    const int64_t from = faults[first].ms - kSlack;
    const int64_t until = next < faults.size() ? faults[next].ms - kSlack : INT64_MAX;
    std::vector<int64_t> lines;
    for (int64_t r : reprotects) {
      if (r >= from && r < until) lines.push_back(r);
    }
    uint64_t before = 0;  // members of earlier faults of the burst
    for (size_t g = first; g < f; ++g) before += out[g].needed;
    FaultTimes& t = out[f];
    t.done = lines.size() > before ? std::min<uint64_t>(lines.size() - before, t.needed) : 0;
    if (t.needed == 0) {
      t.reprotect = t.detect;
    } else if (lines.size() >= before + t.needed) {
      t.reprotect = std::max<int64_t>(lines[before + t.needed - 1] - faults[f].ms, *t.detect);
    } else if (f < recovered) {
      t.reprotect =
          lines.empty() ? *t.detect : std::max<int64_t>(lines.back() - faults[f].ms, *t.detect);
    }
    // The page store says when every extent is whole again: that ends the burst's re-protection,
    // however many leases the fault cost (a lease of an unmapped extent needs no rebuild). The
    // first such line after the detection counts if it comes within the burst; a later one only
    // for a burst whose re-protection was not done when the next burst began (no `reprotect`
    // step between them: its last member's rebuild was cut short by the next fault and finished
    // after it), since the line speaks for every extent. The lines come from one process's log,
    // in time order.
    auto whole = std::ranges::find_if(
        wholes, [&](const WholeEvent& w) { return w.ms >= faults[f].ms + *t.detect - kSlack; });
    const bool reprotected_in_burst = t.needed > 0 && lines.size() >= before + t.needed;
    if (whole != wholes.end() && whole->ms >= until && reprotected_in_burst) whole = wholes.end();
    if (whole != wholes.end()) {
      const int64_t at = std::max<int64_t>(whole->ms - faults[f].ms, *t.detect);
      t.done = t.needed;
      t.reprotect = t.reprotect ? std::min(*t.reprotect, at) : at;
    }
  }
  return out;
}

// The workload under test: farmem-nbd + the verifying NBD client, or the far_ptr program.
class Workload {
 public:
  // What every workload runs against: the scenario, the run's settings, the daemons, and their
  // work directory (where the workload keeps its socket and log). Public so that the workloads
  // inherit it as their own (the class is abstract).
  Workload(const Scenario& s, const RunConfig& c, testing::DaemonSet& d)
      : scenario_(s), config_(c), daemons_(d), dir_(d.work_dir()) {}
  virtual ~Workload() = default;
  virtual Status Start() = 0;
  virtual uint64_t progress() = 0;
  virtual bool alive() = 0;
  // Stops the workload and verifies everything.
  // lost_offsets: the export offset (bytes) of each block whose final read failed (nbd only).
  virtual Status Finish(ScenarioResult* result, std::vector<uint64_t>* lost_offsets) = 0;
  virtual std::string log_path() const = 0;
  virtual std::string nbd_socket() const { return ""; }
  // Whether the program itself knows everything is re-protected; nullopt if it cannot tell
  // (then the log lines decide).
  virtual std::optional<bool> Recovered() { return std::nullopt; }

 protected:
  const Scenario& scenario_;
  const RunConfig& config_;
  testing::DaemonSet& daemons_;
  std::string dir_;

  // The flags both workload programs take to join the scenario's cluster: its daemons, the
  // secret, the resilience mode and how failures are detected.
  std::vector<std::string> ClusterArgs() const {
    return {"--peers",
            PeerList(daemons_),
            "--secret-file",
            dir_ + "/secret",
            "--resilience",
            scenario_.resilience,
            "--heartbeat-ms",
            std::to_string(config_.heartbeat_ms),
            "--failure-timeout-ms",
            std::to_string(config_.failure_timeout_ms)};
  }
};

class NbdWorkload : public Workload {
 public:
  using Workload::Workload;

  Status Start() override {
    socket_ = dir_ + "/nbd.sock";
    std::vector<std::string> argv = {
        testing::BinPath("farmem-nbd"),       "--backend", "farmem", "--size",
        std::to_string(config_.device_bytes), "--unix",    socket_,  "--no-swap-safe"};
    std::ranges::copy(ClusterArgs(), std::back_inserter(argv));
    if (!scenario_.ec_layout.empty()) argv.insert(argv.end(), {"--ec-layout", scenario_.ec_layout});
    if (scenario_.backup) argv.insert(argv.end(), {"--backup", dir_ + "/backup.img"});
    // Reads that failed authentication are counted in farmem-nbd's metrics (Finish reads them).
    if (Flips(scenario_)) {
      argv.insert(argv.end(),
                  {"--metrics-listen", "127.0.0.1:0", "--metrics-port-file", metrics_port_file()});
    }
    SpawnOptions so;
    so.stderr_path = log_path();
    FARMEM_ASSIGN_OR_RETURN(ChildProcess p, ChildProcess::Spawn(argv, so));
    nbd_.emplace(std::move(p));
    if (!blockdev::testing::WaitForUnixSocket(socket_, std::chrono::seconds(30))) {
      return Unavailable("farmem-nbd did not start: " + Slurp(log_path()));
    }
    NbdWorkloadOptions o;
    o.socket_path = socket_;
    o.ops_per_second = config_.nbd_ops_per_second;
    o.seed = config_.seed;
    if (scenario_.subpage) {
      o.unit = 512;
      o.max_request_blocks = 32;  // up to 16 KiB
    }
    verifier_ = std::make_unique<NbdVerifier>(o);
    FARMEM_RETURN_IF_ERROR(verifier_->Connect());
    const auto t0 = SteadyClock::now();
    FARMEM_RETURN_IF_ERROR(verifier_->Fill());
    fill_s_ = std::chrono::duration<double>(SteadyClock::now() - t0).count();
    verifier_->Start();
    return Status::Ok();
  }

  uint64_t progress() override { return verifier_ ? verifier_->completed() : 0; }
  bool alive() override { return nbd_ && nbd_->Alive(); }

  Status Finish(ScenarioResult* r, std::vector<uint64_t>* lost_offsets) override {
    verifier_->Stop();
    const auto t0 = SteadyClock::now();
    Status s = alive() ? verifier_->VerifyAll()
                       : Status(StatusCode::kUnavailable, "farmem-nbd died: " + Slurp(log_path()));
    const double verify_s = std::chrono::duration<double>(SteadyClock::now() - t0).count();
    const NbdWorkloadReport rep = verifier_->Report();
    r->bytes_verified = rep.bytes_verified;
    r->bytes_lost = rep.bytes_lost;
    r->bytes_corrupt = rep.bytes_corrupt;
    r->failed_requests = rep.failed_requests;
    r->longest_stall_ms = rep.longest_stall_ms;
    lost_offsets->clear();
    for (uint64_t b : rep.lost_blocks) lost_offsets->push_back(b * rep.unit);
    r->notes.push_back(fmt::format(
        "nbd: {} requests, {} MiB written (acknowledged); filling the export took {:.1f} s, the "
        "final verification {:.1f} s",
        rep.requests, rep.bytes_written >> 20, fill_s_, verify_s));
    for (const std::string& p : rep.problems) r->notes.push_back("nbd: " + p);
    if (rep.transport_failed) r->failures.push_back("an NBD connection broke (see notes)");
    if (Flips(scenario_) && alive()) {
      Result<double> n = IntegrityFailures();
      if (n) {
        r->integrity_failures = static_cast<uint64_t>(*n);
      } else {
        r->failures.push_back("reading farmem-nbd's integrity counter: " + n.error().ToString());
      }
    }
    verifier_.reset();
    if (nbd_) (void)nbd_->Stop(SIGTERM, std::chrono::seconds(10));
    return s;
  }

  std::string log_path() const override { return dir_ + "/farmem-nbd.log"; }
  std::string nbd_socket() const override { return socket_; }

 private:
  std::string metrics_port_file() const { return dir_ + "/farmem-nbd.metrics-port"; }

  // farmem_export_integrity_failures_total, from farmem-nbd's --metrics-listen.
  Result<double> IntegrityFailures() {
    unsigned port = 0;
    std::ifstream(metrics_port_file()) >> port;
    if (port == 0 || port > 65535) return Err(NotFound("no port in " + metrics_port_file()));
    FARMEM_ASSIGN_OR_RETURN(metrics::HttpResponse got,
                            metrics::HttpGet(Endpoint{"127.0.0.1", static_cast<uint16_t>(port)},
                                             "/metrics", DeadlineIn(std::chrono::seconds(10))));
    FARMEM_ASSIGN_OR_RETURN(std::vector<metrics::Sample> samples,
                            metrics::ParseExposition(got.body));
    std::optional<double> v = metrics::Find(samples, "farmem_export_integrity_failures_total");
    if (!v) return Err(NotFound("farmem-nbd serves no farmem_export_integrity_failures_total"));
    return *v;
  }

  std::string socket_;
  std::optional<ChildProcess> nbd_;
  std::unique_ptr<NbdVerifier> verifier_;
  double fill_s_ = 0;
};

class FarptrWorkload : public Workload {
 public:
  using Workload::Workload;

  Status Start() override {
    std::vector<std::string> argv = {config_.farptr_workload,
                                     "--objects",
                                     std::to_string(config_.farptr_objects),
                                     "--compact",
                                     scenario_.compact ? "on" : "off",
                                     "--seed",
                                     std::to_string(config_.seed)};
    std::ranges::copy(ClusterArgs(), std::back_inserter(argv));
    SpawnOptions so;
    so.stdout_path = dir_ + "/farptr.out";
    so.stderr_path = log_path();
    FARMEM_ASSIGN_OR_RETURN(ChildProcess p, ChildProcess::Spawn(argv, so));
    proc_.emplace(std::move(p));
    bool exited = false;
    const bool ready = testing::WaitUntil(
        [&] {
          if (Slurp(dir_ + "/farptr.out").find("ready") != std::string::npos) return true;
          exited = !proc_->Alive();
          return exited;
        },
        std::chrono::seconds(120), std::chrono::milliseconds(20));
    if (exited) return Internal("the far_ptr workload exited: " + Slurp(log_path()));
    if (!ready) return DeadlineExceeded("the far_ptr workload never got ready");
    return Status::Ok();
  }

  uint64_t progress() override { return 0; }
  bool alive() override { return proc_ && proc_->Alive(); }

  Status Finish(ScenarioResult* r, std::vector<uint64_t>*) override {
    if (!alive()) return Internal("the far_ptr workload died: " + Slurp(log_path()));
    ::kill(proc_->pid(), SIGUSR1);
    if (!testing::WaitUntil([&] { return !proc_->Alive(); }, std::chrono::seconds(180),
                            std::chrono::milliseconds(20))) {
      (void)proc_->Stop(SIGKILL, std::chrono::seconds(5));
      return DeadlineExceeded("the far_ptr workload did not finish its verification in 180 s");
    }
    const std::string out = Slurp(dir_ + "/farptr.out");
    const size_t at = out.find("result ");
    if (at == std::string::npos) {
      return Internal("the far_ptr workload printed no result; its log ends: " +
                      Slurp(log_path()).substr(0, 4000));
    }
    unsigned long verified = 0, lost = 0, corrupt = 0, failed = 0, ops = 0, rep = 0, spans = 0,
                  auth = 0;
    double stall = 0;
    if (std::sscanf(out.c_str() + at,
                    "result verified=%lu lost=%lu corrupt=%lu failed=%lu ops=%lu stall_ms=%lf "
                    "reprotected=%lu spans_lost=%lu auth_failures=%lu",
                    &verified, &lost, &corrupt, &failed, &ops, &stall, &rep, &spans, &auth) != 9) {
      return Internal("cannot parse the far_ptr result: " + out);
    }
    r->bytes_verified = verified;
    r->bytes_lost = lost;
    r->bytes_corrupt = corrupt;
    r->failed_requests = failed;
    r->integrity_failures = auth;
    r->longest_stall_ms = stall;
    r->notes.push_back(
        fmt::format("far_ptr: {} derefs, {} members re-protected, {} spans lost, {} cells failed "
                    "authentication",
                    ops, rep, spans, auth));
    if (const size_t p = out.find("problem "); p != std::string::npos) {
      r->notes.push_back("far_ptr: " + out.substr(p + 8, out.find('\n', p) - p - 8));
    }
    return Status::Ok();
  }

  std::string log_path() const override { return dir_ + "/farptr.log"; }

  std::optional<bool> Recovered() override {
    if (!alive()) return std::nullopt;
    const std::string tag = fmt::format("recovery {} ", ++questions_);
    ::kill(proc_->pid(), SIGUSR2);
    std::optional<bool> answer;
    testing::WaitUntil(
        [&] {
          const std::string out = Slurp(dir_ + "/farptr.out");
          if (const size_t at = out.find(tag); at != std::string::npos) {
            answer = out.compare(at + tag.size(), 4, "done") == 0;
          }
          return answer.has_value();
        },
        std::chrono::seconds(10), std::chrono::milliseconds(10));
    return answer;
  }

 private:
  int questions_ = 0;
  std::optional<ChildProcess> proc_;
};

}  // namespace

bool Scenario::network() const {
  return std::ranges::any_of(steps, [](const Step& s) {
    return std::ranges::find(kNetworkSteps, s.op) != std::end(kNetworkSteps);
  });
}

bool Scenario::netem() const {
  return std::ranges::any_of(steps, [](const Step& s) {
    return std::ranges::find(kNetemSteps, s.op) != std::end(kNetemSteps);
  });
}

Result<std::vector<Scenario>> LoadScenarios(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Err(NotFound("cannot read " + path));
  std::vector<Scenario> out;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    Scenario s;
    s.line = line;
    std::string expect;
    if (!(ss >> s.name >> s.workload >> s.resilience >> s.daemons >> expect)) {
      return Err(
          InvalidArgument(fmt::format("{}:{}: want name workload resilience daemons "
                                      "expect steps...",
                                      path, lineno)));
    }
    auto bad = [&](const std::string& why) {
      return Err(InvalidArgument(fmt::format("{}:{}: {}", path, lineno, why)));
    };
    if (s.workload == "farptr+nocompact") {
      s.workload = "farptr";
      s.compact = false;
    }
    if (s.workload == "nbd+subpage") {
      s.workload = "nbd";
      s.subpage = true;
    }
    if (s.workload != "nbd" && s.workload != "farptr") {
      return bad("workload is nbd, nbd+subpage, farptr or farptr+nocompact");
    }
    if (expect != "tolerate" && expect != "beyond") return bad("expect is tolerate or beyond");
    s.tolerate = expect == "tolerate";
    if (s.resilience.ends_with("+backup")) {
      s.backup = true;
      s.resilience.resize(s.resilience.size() - 7);
    }
    if (const size_t slash = s.resilience.find('/'); slash != std::string::npos) {
      // farmem-nbd checks the pair (--ec-layout only with ec:k+r); this only keeps the
      // column to what the driver passes on.
      s.ec_layout = s.resilience.substr(slash + 1);
      s.resilience.resize(slash);
      if (s.ec_layout != "split" && s.ec_layout != "stripe") {
        return bad("the layout after '/' is split or stripe (farmem-nbd's --ec-layout)");
      }
      if (s.workload != "nbd") return bad("a layout ('/" + s.ec_layout + "') needs workload nbd");
    }
    std::string word;
    while (ss >> word) {
      if (word.starts_with("known-fail:")) {
        s.known_fail = word.substr(11);
        continue;
      }
      auto step = ParseStep(word, s.daemons);
      if (!step) return bad(step.error().message());
      s.steps.push_back(*step);
    }
    out.push_back(std::move(s));
  }
  return out;
}

ScenarioResult RunScenario(const Scenario& sc, const RunConfig& cfg) {
  const auto t_start = SteadyClock::now();
  ScenarioResult res;
  res.name = sc.name;
  res.mode = sc.resilience + (sc.ec_layout.empty() ? "" : " " + sc.ec_layout) +
             (sc.backup ? " + backup" : "");
  auto fail = [&](std::string why) { res.failures.push_back(std::move(why)); };
  auto note = [&](std::string what) {
    if (cfg.verbose) std::fprintf(stderr, "[%s] %s\n", sc.name.c_str(), what.c_str());
    res.notes.push_back(std::move(what));
  };

  if (sc.network() && !cfg.no_network.empty()) {
    res.skipped = cfg.no_network;
    return res;
  }
  if (sc.netem() && !cfg.no_netem.empty()) {
    res.skipped = cfg.no_netem;
    return res;
  }

  testing::DaemonConfig dc;
  dc.capacity = cfg.daemon_capacity;
  dc.slab_size = cfg.slab_size;
  dc.log_level = "warn";
  dc.extra_args = {"--no-prefault"};
  testing::DaemonSet daemons(dc);
  if (Status s = daemons.Start(static_cast<size_t>(sc.daemons)); !s.ok()) {
    fail("daemons did not start: " + s.ToString());
    return res;
  }
  const std::string secret_file = daemons.work_dir() + "/secret";
  // Listening is not serving yet (under emulation a daemon can take seconds more to answer its
  // first client): every daemon answers a STAT before the workload starts.
  for (size_t i = 0; i < daemons.size(); ++i) {
    ProbeResult p;
    const bool ready = testing::WaitUntil(
        [&] {
          p = ProbeDaemon(cfg.farmemctl, daemons[i].endpoint(), secret_file,
                          std::chrono::seconds(10));
          return p.ok;
        },
        std::chrono::seconds(60), std::chrono::milliseconds(100));
    if (!ready) {
      fail(fmt::format("daemon {} did not answer farmemctl stat in 60 s: {}", i, p.error));
      return res;
    }
  }
  std::unique_ptr<Workload> workload;
  if (sc.workload == "nbd") {
    workload = std::make_unique<NbdWorkload>(sc, cfg, daemons);
  } else {
    workload = std::make_unique<FarptrWorkload>(sc, cfg, daemons);
  }
  SlabFiller filler;
  SocketFlood flood;
  StalledNbdClients stalled;
  NetworkFaults network;
  std::vector<Fault> faults;
  size_t flipped_bits = 0;       // flip:N, every daemon together
  size_t runtime_recovered = 0;  // faults [0, n) the far_ptr runtime said were re-protected
  int burst = 0;
  bool started = false;

  auto wait_reprotected = [&]() {
    std::string missing;
    const bool whole = testing::WaitUntil(
        [&] {
          const auto times = Analyze(faults, ReadLog(workload->log_path()), runtime_recovered);
          bool all = true;
          missing.clear();
          for (size_t f = 0; f < faults.size(); ++f) {
            // A delay or loss the client never took for a failure cost nothing to re-protect.
            const bool unnoticed = faults[f].impairment && !times[f].detect;
            if (!times[f].reprotect && !unnoticed) {
              all = false;
              missing += fmt::format(" [{}: {} of {} members]", faults[f].what, times[f].done,
                                     times[f].needed);
            }
          }
          // The far_ptr runtime knows which members still wait, better than counting log lines.
          const std::optional<bool> recovered = workload->Recovered();
          if (recovered.has_value() && all != *recovered) {
            all = *recovered;
            if (all) runtime_recovered = faults.size();
            if (!all) missing += " [the far_ptr runtime still has members waiting]";
          }
          return all;
        },
        std::chrono::duration_cast<std::chrono::milliseconds>(cfg.reprotect_deadline),
        std::chrono::milliseconds(50));
    if (whole) return;
    const std::string why = fmt::format("re-protection not finished after {} s:{}",
                                        cfg.reprotect_deadline.count() / 1000, missing);
    note(why);
    // Re-protection starts as soon as an eligible daemon is reachable (design.md, fault
    // model); every `reprotect` step in scenarios.txt has one.
    if (sc.tolerate) fail(why);
  };

  // Every daemon whose path had a network fault is up again in the client's view: its latest
  // "is down" (if any) has an "is up" after it.
  auto wait_rejoined = [&]() {
    std::string missing;
    const bool all_up = testing::WaitUntil(
        [&] {
          const std::vector<LogLine> log = ReadLog(workload->log_path());
          const std::vector<DownEvent> downs = DownEvents(log);
          const std::vector<UpEvent> ups = UpEvents(log);
          missing.clear();
          std::set<std::string> seen;
          for (const Fault& f : faults) {
            if (!f.network || !seen.insert(f.endpoint).second) continue;
            int64_t last_down = INT64_MIN, last_up = INT64_MIN;
            for (const DownEvent& d : downs) {
              if (d.endpoint == f.endpoint) last_down = d.ms;
            }
            for (const UpEvent& u : ups) {
              if (u.endpoint == f.endpoint) last_up = u.ms;
            }
            if (last_down > last_up) missing += " " + f.endpoint;
          }
          return missing.empty();
        },
        std::chrono::duration_cast<std::chrono::milliseconds>(cfg.reprotect_deadline),
        std::chrono::milliseconds(50));
    if (all_up) return;
    const std::string why =
        fmt::format("the client still holds{} down {} s after the network healed", missing,
                    cfg.reprotect_deadline.count() / 1000);
    note(why);
    if (sc.tolerate) fail(why);
  };

  auto start_workload = [&]() -> bool {
    started = true;
    if (Status s = workload->Start(); !s.ok()) {
      fail("workload did not start: " + s.ToString());
      return false;
    }
    return true;
  };

  const bool has_start =
      std::ranges::any_of(sc.steps, [](const Step& s) { return s.op == "start"; });
  if (!has_start && !start_workload()) return res;
  for (const Step& step : sc.steps) {
    const std::string what = step.arg >= 0 ? fmt::format("{} {}", step.op, step.arg) : step.op;
    if (!started && step.op != "start" && step.op != "fill") {
      fail("step '" + what + "' before start: only fill may come first");
      return res;
    }
    if (step.op == "start") {
      if (!start_workload()) return res;
    } else if (step.op == "run") {
      if (!faults.empty() && faults.back().burst == burst) ++burst;
      // A period of workload: the length of the run is the subject here.
      const uint64_t before = workload->progress();
      std::this_thread::sleep_for(cfg.period);
      if (sc.workload == "nbd" && workload->progress() == before) {
        note(fmt::format("the workload completed no request for {} ms", cfg.period.count()));
      }
    } else if (step.op == "kill") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      faults.push_back(Fault{what, d.endpoint().ToString(), WallMs(), burst});
      d.Kill();
      note(what + " (" + d.endpoint().ToString() + ")");
    } else if (step.op == "stop") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      faults.push_back(Fault{what, d.endpoint().ToString(), WallMs(), burst});
      d.Pause();
      // A gray failure lasts a while: three failure timeouts (time is the subject here).
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * cfg.failure_timeout_ms));
      d.Resume();
      note(fmt::format("{} ({}) for {} ms, then SIGCONT", what, d.endpoint().ToString(),
                       3 * cfg.failure_timeout_ms));
    } else if (step.op == "flip") {
      // Bit flips in the daemon's lent memory, from outside (its slab pool through
      // /proc/PID/mem: the driver is root or the daemon's parent), on pages a client wrote.
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      const size_t pages = step.value >= 0 ? static_cast<size_t>(step.value) : cfg.flip_pages;
      const uint64_t slab = ParseSize(cfg.slab_size).value_or(1);
      const uint64_t pool = ParseSize(cfg.daemon_capacity).value_or(0) / slab * slab;
      const uint64_t seed = static_cast<uint64_t>(WallMs());
      auto range = testing::FindSlabPool(d.pid(), pool);
      auto at =
          range ? testing::FlipBitsInWrittenPages(d.pid(), range->first, range->second, pages, seed)
                : Result<std::vector<uint64_t>>(Err(range.error()));
      Fault fault{what, d.endpoint().ToString(), WallMs(), burst, /*impairment=*/true};
      fault.integrity = true;
      faults.push_back(fault);
      if (!at) {
        fail(what + ": " + at.error().ToString());
      } else if (at->empty()) {
        fail(what + ": no page of daemon " + std::to_string(step.arg) +
             "'s slab pool holds data: nothing to flip");
      } else {
        flipped_bits += at->size();
        note(fmt::format(
            "{} ({}): one bit flipped in each of {} written pages of its slab pool "
            "(seed {}; first at offset {:#x} of the pool)",
            what, d.endpoint().ToString(), at->size(), seed, at->front() - range->first));
      }
    } else if (step.op == "back") {
      // The client took daemon N for down and had its leases back from the same process (a
      // false down: nothing to rebuild, nothing lost): its "answered again as the same daemon"
      // line, after the last fault on N.
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      const std::string ep = d.endpoint().ToString();
      int64_t since = 0;
      for (const Fault& f : faults) {
        if (f.endpoint == ep) since = f.ms - 5;
      }
      const bool back = testing::WaitUntil(
          [&] {
            for (const LogLine& l : ReadLog(workload->log_path())) {
              if (l.ms >= since && l.text.find("(" + ep + ") answered again as the same daemon") !=
                                       std::string::npos) {
                return true;
              }
            }
            return false;
          },
          std::chrono::duration_cast<std::chrono::milliseconds>(cfg.reprotect_deadline),
          std::chrono::milliseconds(50));
      if (back) {
        note(fmt::format("{}: the client had its leases on {} back", what, ep));
      } else {
        fail(fmt::format("{}: the client did not get its leases on {} back within {} s", what, ep,
                         cfg.reprotect_deadline.count() / 1000));
      }
    } else if (step.op == "restart") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      Status s = d.running() ? d.Restart() : d.Start();
      if (!s.ok()) fail(what + ": " + s.ToString());
      note(what + " on " + d.endpoint().ToString());
    } else if (step.op == "reprotect") {
      wait_reprotected();
      if (!faults.empty() && faults.back().burst == burst) ++burst;
    } else if (step.op == "fill") {
      Status s = filler.Fill(daemons[static_cast<size_t>(step.arg)].endpoint(), daemons.secret());
      if (!s.ok()) fail(what + ": " + s.ToString());
      note(fmt::format("{}: another client holds {} slabs there", what, filler.slabs()));
    } else if (step.op == "unfill") {
      filler.Release();
      note("unfill: the other client freed its slabs");
    } else if (step.op == "stall") {
      if (workload->nbd_socket().empty()) {
        fail("stall needs the nbd workload");
      } else if (Status s = stalled.Start(workload->nbd_socket(), static_cast<size_t>(step.arg));
                 !s.ok()) {
        fail(what + ": " + s.ToString());
      }
      note(what + ": NBD clients that never read their replies");
    } else if (step.op == "unstall") {
      stalled.Release();
      note("unstall: the stalled clients closed");
    } else if (step.op == "flood") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      Status s = flood.Start(d.endpoint(), 2000, 16);
      if (!s.ok()) fail(what + ": " + s.ToString());
      note(fmt::format("{}: {} idle + 16 slowloris sockets at {}", what, flood.connected(),
                       d.endpoint().ToString()));
    } else if (step.op == "unflood") {
      flood.Release();
      note("unflood: the sockets closed");
    } else if (step.op == "cut") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      Status s = network.Partition(step.arg, d.endpoint().port);
      // The partition is whole once both directions are cut: time it from there.
      faults.push_back(Fault{what, d.endpoint().ToString(), WallMs(), burst, false, true});
      if (!s.ok()) fail(what + ": " + s.ToString());
      note(fmt::format("{} ({}): every packet to and from it dropped until heal", what,
                       d.endpoint().ToString()));
    } else if (step.op == "delay") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      const int ms = step.value >= 0 ? static_cast<int>(step.value) : cfg.delay_ms;
      const int jitter = step.value >= 0 ? ms / 5 : cfg.jitter_ms;
      Status s = network.Delay(step.arg, d.endpoint().port, ms, jitter);
      faults.push_back(Fault{what, d.endpoint().ToString(), WallMs(), burst, true, true});
      if (!s.ok()) fail(what + ": " + s.ToString());
      note(fmt::format("{} ({}): {} ms ± {} ms each way until heal", what, d.endpoint().ToString(),
                       ms, jitter));
    } else if (step.op == "loss") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      const double percent = step.value >= 0 ? step.value : cfg.loss_percent;
      Status s = network.Loss(step.arg, d.endpoint().port, percent);
      faults.push_back(Fault{what, d.endpoint().ToString(), WallMs(), burst, true, true});
      if (!s.ok()) fail(what + ": " + s.ToString());
      note(fmt::format("{} ({}): {}% of packets dropped each way until heal", what,
                       d.endpoint().ToString(), percent));
    } else if (step.op == "heal") {
      // Timed from the start: no daemon can be back before the first filter goes.
      const int64_t now = WallMs();
      Status s = network.HealAll();
      for (Fault& f : faults) {
        if (f.network && f.healed_ms == INT64_MAX) f.healed_ms = now;
      }
      if (!s.ok()) fail("heal: " + s.ToString());
      note("heal: every network fault removed");
    } else if (step.op == "rejoin") {
      wait_rejoined();
    } else if (step.op == "probe") {
      testing::DaemonProcess& d = daemons[static_cast<size_t>(step.arg)];
      ProbeResult p =
          ProbeDaemon(cfg.farmemctl, d.endpoint(), secret_file, std::chrono::seconds(5));
      if (p.ok) {
        note(fmt::format("{}: farmemctl stat answered in {} ms", what, Ms(p.ms)));
      } else {
        note(fmt::format("{}: farmemctl stat FAILED after {} ms: {}", what, Ms(p.ms), p.error));
        if (sc.tolerate) fail(what + ": a new authenticated client was not served");
      }
    }
    if (started && !workload->alive()) {
      fail("the workload process died after '" + what + "'");
      break;
    }
  }
  stalled.Release();
  flood.Release();
  filler.Release();
  if (network.any()) {
    const int64_t now = WallMs();
    if (Status s = network.HealAll(); !s.ok()) fail("heal at the end: " + s.ToString());
    for (Fault& f : faults) {
      if (f.network && f.healed_ms == INT64_MAX) f.healed_ms = now;
    }
  }

  std::vector<uint64_t> lost_offsets;
  const bool only_flips = std::ranges::all_of(faults, [](const Fault& f) { return f.integrity; });
  if (started && !sc.tolerate && !only_flips) {
    // Beyond tolerance: a killed daemon's leases are kept for their TTL (the "down" could be
    // false), and I/O to the pages only there fails meanwhile; the loss is declared, with its
    // ranges logged, once the TTL has passed. The check below needs those ranges.
    (void)testing::WaitUntil([&] { return !LostRanges(ReadLog(workload->log_path())).empty(); },
                             std::chrono::seconds(30));
  }
  if (started) {
    if (Status s = workload->Finish(&res, &lost_offsets); !s.ok()) {
      fail("final verification: " + s.ToString());
    }
  }
  const std::vector<LogLine> log = ReadLog(workload->log_path());
  const auto times = Analyze(faults, log, runtime_recovered);
  std::vector<std::string> det, rep;
  const std::vector<DownEvent> downs = DownEvents(log);
  const std::vector<UpEvent> ups = UpEvents(log);
  for (size_t f = 0; f < faults.size(); ++f) {
    if (faults[f].impairment && !times[f].detect) {
      det.push_back("none");  // never taken for a failure: nothing to re-protect
      rep.push_back("-");
    } else {
      det.push_back(times[f].detect ? std::to_string(*times[f].detect) : "n/a");
      rep.push_back(times[f].reprotect
                        ? std::to_string(*times[f].reprotect)
                        : fmt::format("n/a ({}/{})", times[f].done, times[f].needed));
    }
    if (!faults[f].network) continue;
    // How often the path's daemon was declared down while the fault lasted, and when the client
    // had it back after the heal.
    const int64_t from = faults[f].ms - 5, until = faults[f].healed_ms;
    const auto n_down = std::ranges::count_if(downs, [&](const DownEvent& d) {
      return d.endpoint == faults[f].endpoint && d.ms >= from && d.ms < until;
    });
    std::string rejoin = "it was never down";
    if (n_down > 0 && until != INT64_MAX) {
      auto up = std::ranges::find_if(ups, [&](const UpEvent& u) {
        return u.endpoint == faults[f].endpoint && u.ms >= until - 5;
      });
      rejoin = up == ups.end() ? "NOT up again after the heal"
                               : fmt::format("up again {} ms after the heal",
                                             std::max<int64_t>(0, up->ms - until));
    }
    note(fmt::format("{} ({}): declared down {} time(s) while it lasted; {}", faults[f].what,
                     faults[f].endpoint, n_down, rejoin));
  }
  res.detect_ms = det.empty() ? "-" : Join(det, " / ");
  res.reprotect_ms = rep.empty() ? "-" : Join(rep, " / ");

  // Expectations.
  if (res.bytes_corrupt != 0) fail(fmt::format("{} bytes came back WRONG", res.bytes_corrupt));
  if (sc.tolerate) {
    if (res.bytes_lost != 0) fail(fmt::format("{} bytes lost", res.bytes_lost));
    if (res.failed_requests != 0) {
      fail(fmt::format("{} requests failed during the run", res.failed_requests));
    }
  } else {
    // A page lost in `none` is LOST until written again: a workload that runs long enough after
    // the fault (the long form: 30 s unpaced over 256 MiB) writes every one of them again, and
    // the final pass finds nothing lost. The requests that failed meanwhile show the fault hit.
    if (res.bytes_lost == 0 && res.failed_requests == 0) {
      fail("beyond tolerance, yet nothing was lost and no request failed: the faults missed");
    } else if (res.bytes_lost == 0) {
      note(fmt::format(
          "nothing lost at the end: the workload wrote every lost page again ({} requests failed "
          "during the run)",
          res.failed_requests));
    }
    const std::vector<LostRange> ranges = LostRanges(log);
    uint64_t outside = 0;
    std::vector<std::string> where;  // the first few, by export offset
    for (uint64_t off : lost_offsets) {
      const bool inside = std::ranges::any_of(
          ranges, [&](const LostRange& r) { return off >= r.begin && off < r.end; });
      if (inside) continue;
      if (++outside <= 8) where.push_back(std::to_string(off));
    }
    if (outside != 0) {
      fail(fmt::format(
          "{} blocks failed to read outside every range farmem-nbd reported LOST (at bytes {})",
          outside, Join(where, ", ")));
    }
    note(fmt::format("{} ranges reported LOST, {} blocks read EIO, all inside them: {}",
                     ranges.size(), lost_offsets.size(), outside == 0 ? "yes" : "no"));
  }
  if (flipped_bits > 0) {
    // Every flipped bit lies in data a client wrote; the final verification reads every byte,
    // so unless each flipped page was rewritten before any read, some read failed authentication
    // and was counted (and logged: IntegrityTimes).
    const size_t logged = IntegrityTimes(log).size();
    note(fmt::format("{} bits flipped: {} reads failed authentication (counted), {} log lines",
                     flipped_bits, res.integrity_failures, logged));
    if (res.integrity_failures == 0) {
      fail(
          fmt::format("{} bits flipped in written slab memory, yet no read failed "
                      "authentication",
                      flipped_bits));
    }
    if (res.integrity_failures > 0 && logged == 0) {
      fail("reads failed authentication, yet the workload logged none of them");
    }
  }
  if (res.bytes_verified == 0 && res.failures.empty()) fail("nothing was verified");
  res.passed = res.failures.empty();
  if (!res.passed || cfg.verbose) {
    for (const std::string& l : NotableLines(log, 24)) res.notes.push_back("log: " + l);
  }
  res.seconds = std::chrono::duration<double>(SteadyClock::now() - t_start).count();
  if (!res.passed) res.notes.push_back("daemon logs:\n" + daemons.Logs(1500));
  return res;
}

}  // namespace farmem::chaos
