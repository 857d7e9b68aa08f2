// The far_ptr runtime options the tests start from: one place for the timings they share.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/runtime.h"

namespace farmem::testing {

inline RuntimeOptions TestRuntimeOptions(std::vector<Endpoint> peers, std::string secret,
                                         std::string resilience, uint64_t local_budget,
                                         uint32_t span_size = 16384) {
  RuntimeOptions o;
  o.peers = std::move(peers);
  o.secret = std::move(secret);
  o.resilience = std::move(resilience);
  o.local_budget = local_budget;
  o.span_size = span_size;
  o.heartbeat_interval = std::chrono::milliseconds(100);
  // Kills are noticed at once (connections close); a long timeout keeps slow (sanitized)
  // daemons from being declared down by mistake.
  o.failure_timeout = std::chrono::milliseconds(3000);
  o.op_timeout = std::chrono::milliseconds(2000);
  return o;
}

}  // namespace farmem::testing
