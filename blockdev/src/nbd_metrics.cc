#include "farmem/blockdev/nbd_metrics.h"

#include "farmem/blockdev/nbd_protocol.h"

namespace farmem::blockdev {

NbdMetrics::Command NbdMetrics::CommandOf(uint16_t t) {
  switch (t) {
    case nbd::kCmdRead:
      return kRead;
    case nbd::kCmdWrite:
      return kWrite;
    case nbd::kCmdFlush:
      return kFlush;
    case nbd::kCmdTrim:
      return kTrim;
    case nbd::kCmdWriteZeroes:
      return kWriteZeroes;
    default:
      return kOther;
  }
}

const char* NbdMetrics::Name(Command c) {
  static constexpr const char* kNames[] = {"read", "write",        "flush",
                                           "trim", "write_zeroes", "other"};
  return kNames[c];
}

NbdMetrics::NbdMetrics(metrics::Registry* r) {
  for (int c = 0; c < kCommands; ++c) {
    const metrics::Labels op{{"op", Name(static_cast<Command>(c))}};
    requests[c] =
        &r->AddCounter("farmem_export_requests_total", "NBD requests answered, by command.", op);
  }
  for (int c = 0; c < kCommands; ++c) {
    const metrics::Labels op{{"op", Name(static_cast<Command>(c))}};
    bytes[c] = &r->AddCounter("farmem_export_bytes_total",
                              "Bytes of NBD requests that succeeded, by command.", op);
  }
  for (int c = 0; c < kCommands; ++c) {
    const metrics::Labels op{{"op", Name(static_cast<Command>(c))}};
    errors[c] = &r->AddCounter("farmem_export_errors_total",
                               "NBD requests answered with an error, by command.", op);
  }
  for (int c = 0; c < kCommands; ++c) {
    const metrics::Labels op{{"op", Name(static_cast<Command>(c))}};
    latency[c] = &r->AddHistogram(
        "farmem_export_request_duration_seconds",
        "From the start of the batch that carried an NBD request to its reply being queued.", op,
        metrics::LatencyBoundsNs(), 1e-9);
  }
  connections = &r->AddCounter("farmem_export_connections_total",
                               "NBD connections that entered transmission.");
  request_spins =
      &r->AddCounter("farmem_export_request_spins_total",
                     "Spins for a client's next request before sleeping (--request-busy-poll-us).");
  request_spin_hits = &r->AddCounter("farmem_export_request_spin_hits_total",
                                     "Of those, spins that caught the request (no sleep).");
  request_spin_skips = &r->AddCounter(
      "farmem_export_request_spin_skips_total",
      "Waits for a request that slept at once: the spin backing off after spins that ran out.");
}

}  // namespace farmem::blockdev
