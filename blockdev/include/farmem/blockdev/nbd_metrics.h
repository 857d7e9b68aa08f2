// NbdMetrics: what farmem-nbd counts of the NBD requests it serves, for --metrics-listen
// (docs/operations.md "Metrics"): requests, bytes, errors and latency per command.
//
// Who owns what: made by main.cc on a metrics::Registry (which owns the counters), handed to the
// NbdServer through NbdServerOptions::metrics (null: nothing is counted, one branch per reply).
// Threading: the pointers are set once at construction; connection threads bump the counters
// (relaxed atomic adds, no lock) and the metrics thread reads them.
#pragma once

#include <cstdint>

#include "farmem/common/metrics.h"

namespace farmem::blockdev {

struct NbdMetrics {
  enum Command { kRead, kWrite, kFlush, kTrim, kWriteZeroes, kOther, kCommands };
  static Command CommandOf(uint16_t nbd_type);
  static const char* Name(Command c);

  explicit NbdMetrics(metrics::Registry* registry);

  // Per command: requests answered, payload bytes of those that succeeded (reads and writes;
  // the range for trim and write-zeroes), those answered with an error, and the time from the
  // batch that carried the request starting to its reply being queued.
  metrics::Counter* requests[kCommands];
  metrics::Counter* bytes[kCommands];
  metrics::Counter* errors[kCommands];
  metrics::Histogram* latency[kCommands];
  metrics::Counter* connections;  // entered transmission
  // The connections' spin for the client's next request (--request-busy-poll-us, AdaptiveSpin):
  // spins, those that caught the request (the thread did not sleep), and waits that slept at
  // once while the spin backed off.
  metrics::Counter* request_spins;
  metrics::Counter* request_spin_hits;
  metrics::Counter* request_spin_skips;
};

}  // namespace farmem::blockdev
