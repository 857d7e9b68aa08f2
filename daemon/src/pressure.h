// PressurePolicy: when farmemd stops lending and takes memory back (issue 12).
//
// The lender's own programs come first. From a MemorySnapshot (memory_source.h) the policy keeps
// --reserve free on its host or cgroup:
//   - granting: a slab is granted only while the memory left after it stays above the reserve
//     (grant budget = (available - reserve) / slab size);
//   - holding (pressure: available below the reserve, the limit was hit since the last reading, or
//     the PSI "full" stall share at or above its threshold): no grants at all;
//   - revoking: when a deficit or the stall is still there at the next poll (one poll of grace
//     absorbs a spike), enough leases to cover the deficit are evicted, with notice, minus those
//     already noticed; a stall without a deficit evicts one slab while none is under notice.
//     Limit hits alone only hold: a cgroup at its limit reclaims cache, which is not our deficit.
//     The stall share is that of the interval between two readings (PSI "total"), so a stall
//     that ended stops counting at once; without totals (a fake source) avg10 is used;
//   - back to granting only once available >= reserve + hysteresis (max(one slab, reserve / 4)),
//     so the daemon does not flap around the reserve.
// Victims: of a random sample of E + extra leases, the E with the fewest data operations since
// their last sample (Infiniswap's batch eviction; ChooseVictims).
//
// Pure logic, no clock and no I/O: driven by the Reclaimer's thread, tested with fake snapshots.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/status.h"
#include "memory_source.h"
#include "slab_pool.h"

namespace farmem::daemon {

// --reserve: a size ("2G") or a percentage of the limit ("10%").
struct Reserve {
  uint64_t bytes = 0;
  double fraction = 0;  // used when bytes == 0
  std::string text = "0";
  uint64_t Of(uint64_t limit) const {
    return bytes != 0 ? bytes : static_cast<uint64_t>(fraction * static_cast<double>(limit));
  }
};
Result<Reserve> ParseReserve(std::string_view text);

// Refuses a reserve that leaves less than one slab of `limit` (all the memory of the watched
// host or cgroup, named `source`): such a daemon would never lend anything.
Status CheckReserveLeavesRoom(const Reserve& reserve, uint64_t limit, uint64_t slab_size,
                              std::string_view source);

struct PressureConfig {
  Reserve reserve;
  double psi_full_threshold = 0;  // 0: PSI is not a signal
  uint32_t confirm_polls = 2;     // polls under pressure before leases are revoked
};

struct PressureDecision {
  std::optional<uint32_t> grant_budget;  // slabs that may still be granted; nullopt: no limit
  uint32_t evict = 0;                    // leases to notice now
  bool holding = false;
  bool changed = false;  // holding flipped at this update (worth a log line)
  std::string why;       // for the log: the numbers behind the decision
};

class PressurePolicy {
 public:
  explicit PressurePolicy(PressureConfig config) : config_(std::move(config)) {}
  // `noticed`: leases already under notice (their memory comes back at their deadline).
  PressureDecision Update(const MemorySnapshot& m, uint64_t slab_size, uint32_t noticed);
  bool holding() const { return holding_; }
  const PressureConfig& config() const { return config_; }

 private:
  PressureConfig config_;
  bool holding_ = false;
  uint32_t polls_under_ = 0;
  std::optional<uint64_t> last_limit_hits_;
  std::optional<uint64_t> last_psi_total_us_;
  std::chrono::steady_clock::time_point last_taken_{};
};

// The `e` least active of `sample` (fewest accesses; ties keep sample order), as lease ids.
std::vector<uint64_t> ChooseVictims(std::vector<LeaseActivity> sample, uint32_t e);

}  // namespace farmem::daemon
