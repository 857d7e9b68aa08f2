// What the client tests of eviction notices, drains and access reports share: a client of a
// DaemonSet with their timers (heartbeat 100 ms, failure timeout 2 s: notices and reports arrive
// with heartbeats; a daemon busy evicting is not declared down), and the ids of a set of leases.
#pragma once

#include <chrono>
#include <set>
#include <span>
#include <string>

#include "farmem/client/cluster.h"
#include "support/daemon_fixture.h"

namespace farmem::client::test {

inline ClusterOptions OptionsFor(const testing::DaemonSet& d, const std::string& name) {
  ClusterOptions o;
  o.peers = d.endpoints();
  o.secret = d.secret();
  o.client_name = name;
  o.heartbeat_interval = std::chrono::milliseconds(100);
  o.failure_timeout = std::chrono::milliseconds(2000);
  return o;
}

inline std::set<uint64_t> LeaseIds(std::span<const Lease> leases) {
  std::set<uint64_t> out;
  for (const Lease& l : leases) out.insert(l.id());
  return out;
}

}  // namespace farmem::client::test
