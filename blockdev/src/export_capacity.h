// ExportCapacity: does an export fit in the cluster at its resilience? farmem-nbd asks at start,
// so that an export larger than the daemons can hold is refused up front instead of failing writes
// with ENOSPC once the kernel's swap spreads past what the daemons hold (issue 11, defect 5).
//
// The page store maps the export as extents of k slabs' worth of data (k = data width: ec:k+r's k,
// 1 otherwise), each extent a group of g = group size slabs on g distinct daemons. A fully written
// export therefore holds G = ceil(size / (k * slab)) groups, G * g slabs: replicate:N costs
// N * size, ec:k+r size * (k+r)/k. G groups fit on daemons with free slabs f_i exactly when
// sum_i min(f_i, G) >= g * G (no daemon can hold two members of one group).
//
// Pure functions (CheckExportCapacity) and one call that asks the cluster (SurveyExportCapacity);
// setup code, any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/config.h"
#include "page_store.h"

namespace farmem::blockdev {

// One daemon as the start-time check sees it.
struct DaemonSpace {
  Endpoint endpoint;
  bool up = false;          // answered STAT
  uint64_t free_bytes = 0;  // slabs this client may still take * slab size (0 when down)
  uint64_t capacity = 0;    // what it lends in all (0 when down)
  // What this client may hold there at most (the daemon's --max-client-share); 0: no cap said.
  // free_bytes is already capped by it.
  uint64_t client_limit = 0;
};

struct ExportCapacity {
  enum class Verdict {
    kFits,               // the daemons that answered can hold the whole export
    kFitsIfPeersReturn,  // too big for the daemons up now, but not if the down ones come back
    kTooBig,             // too big even with every daemon up
  };
  Verdict verdict = Verdict::kFits;
  uint64_t size = 0;
  Resilience resilience;
  uint64_t slab_size = 0;
  uint64_t needed_bytes = 0;     // G * g * slab_size
  uint64_t free_bytes = 0;       // free on the daemons that answered
  uint64_t largest_fitting = 0;  // the largest export size that fits on them now
  size_t daemons_up = 0, daemons_down = 0;
  std::vector<DaemonSpace> daemons;

  // "1 GiB at ec:4+2 needs 1.5 GiB of daemon memory (24 slabs of 64 MiB); 6 of 6 daemons answer
  // with 576 MiB free: 127.0.0.1:7001 96 MiB free of 192 MiB, ..."
  std::string Describe() const;
};

// The slabs a fully written export of `size` bytes holds at `resilience`: G * g (above).
uint64_t ExportSlabs(uint64_t size, const Resilience& resilience, uint64_t slab_size);

// The verdict for an export of `size` bytes at `resilience` on `daemons`, whose slabs are
// `slab_size` bytes (the page store's slab size: the first daemon's). A down daemon is assumed
// to come back with as much room as the average daemon that answered has in all.
ExportCapacity CheckExportCapacity(uint64_t size, const Resilience& resilience, uint64_t slab_size,
                                   std::span<const DaemonSpace> daemons);

// Waits up to `wait` for every peer of `cluster` to answer (returns as soon as all do), asks each
// for its free memory (STAT) and checks the export against it. Unavailable if no daemon answers
// STAT.
Result<ExportCapacity> SurveyExportCapacity(client::Cluster& cluster, uint64_t size,
                                            const Resilience& resilience,
                                            std::chrono::milliseconds wait);

// The running capacity check both layouts make every reconcile interval (PageStore, StripeStore):
// while the export still needs `needed` slabs (what it does not hold yet plus members to
// re-protect), asks the daemons that are up for the slabs this client may take there (STAT,
// --max-client-share included) and warns, once a minute, when they are fewer. `store` names the
// layout in the log ("page store"); `breakdown()` says how `needed` adds up. Returns the free
// slabs: 0 when nothing is needed (no STAT is sent then).
uint64_t CheckRunningCapacity(client::Cluster& cluster, std::string_view store, uint64_t needed,
                              uint64_t slab_size, const std::function<std::string()>& breakdown);

}  // namespace farmem::blockdev
