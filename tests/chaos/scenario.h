// Chaos scenarios: parsed from scenarios.txt (the format is described at its top), run against
// real farmemd daemons with a verified workload, each producing one row of the results table.
//
// Used by the driver's main thread (it owns the daemons: see tests/support/daemon_fixture.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::chaos {

struct Step {
  std::string op;     // run, kill, stop, restart, reprotect, fill, unfill, stall, unstall, ...
  int arg = -1;       // daemon index or client count; -1 when the step takes none
  double value = -1;  // delay:N=MS, loss:N=PERCENT, flip:N=PAGES; -1: the RunConfig's default
};

struct Scenario {
  std::string name;
  std::string workload;    // nbd | farptr
  bool compact = true;     // farptr: background compaction (off: "farptr+nocompact")
  bool subpage = false;    // nbd: 512-byte blocks, requests of 1-32 sectors ("nbd+subpage")
  std::string resilience;  // as the programs take it (without "/layout" and "+backup")
  std::string ec_layout;   // farmem-nbd's --ec-layout ("ec:2+1/stripe"); empty: its default
  bool backup = false;
  int daemons = 0;
  bool tolerate = true;  // false: beyond what the mode tolerates
  std::vector<Step> steps;
  std::string known_fail;  // why it fails on today's main (empty: it should pass)
  std::string line;        // as written, for messages

  // Whether it has network faults (cut, delay, loss): it runs in the driver's own network
  // namespace; delay and loss need netem, which only the qemu guest has (network.h).
  bool network() const;
  bool netem() const;
};

Result<std::vector<Scenario>> LoadScenarios(const std::string& path);

// Short form (CI) or long form (by hand).
struct RunConfig {
  bool long_form = false;
  std::chrono::milliseconds period{3000};  // one `run` step
  uint64_t device_bytes = 64u << 20;       // NBD export size
  std::string daemon_capacity = "96M";
  std::string slab_size = "1M";
  std::chrono::milliseconds reprotect_deadline{20000};
  uint32_t heartbeat_ms = 100;
  uint32_t failure_timeout_ms = 1000;
  double nbd_ops_per_second = 4000;  // 0: unthrottled
  int farptr_objects = 1000;         // per thread, 4 threads
  std::string farmemctl;
  std::string farptr_workload;
  bool verbose = false;
  // Network faults (network.h): the default delay:N (each way) and loss:N.
  int delay_ms = 50;
  int jitter_ms = 10;
  double loss_percent = 10;
  // flip:N: pages of daemon N's written slab memory that get one flipped bit each.
  size_t flip_pages = 16;
  // Seeds the workloads' choices (--seed, FARMEM_CHAOS_SEED): 0, CI's, is a fixed sequence.
  uint64_t seed = 0;
  // Why scenarios with network faults (or with delay/loss) cannot run here; empty: they can.
  std::string no_network;
  std::string no_netem;
};

struct ScenarioResult {
  std::string name;
  std::string mode;  // resilience as shown in the table
  uint64_t bytes_verified = 0;
  uint64_t bytes_lost = 0;
  uint64_t bytes_corrupt = 0;
  uint64_t failed_requests = 0;
  // Reads whose data failed authentication, as the workload counted them (farmem-nbd's
  // farmem_export_integrity_failures_total, the far_ptr runtime's auth_failures); only read when
  // the scenario flips bits.
  uint64_t integrity_failures = 0;
  double longest_stall_ms = 0;
  std::string detect_ms;     // per fault, "a / b"; "n/a" when not seen
  std::string reprotect_ms;  // per fault; "n/a" when not seen within the run
  double seconds = 0;
  bool passed = false;
  std::string skipped;                // why it was not run here (then it neither passed nor failed)
  std::vector<std::string> failures;  // why it did not pass (empty when it did)
  std::vector<std::string> notes;     // what happened (faults, probes, log lines)
};

ScenarioResult RunScenario(const Scenario& scenario, const RunConfig& config);

}  // namespace farmem::chaos
