#include "daemon_metrics.h"

#include <fmt/format.h>

#include "farmem/common/version.h"

namespace farmem::daemon {

namespace {

const char* RefusalReason(size_t kind) {
  switch (kind) {
    case RefusalLog::kHandshakeTimeout:
      return "handshake_timeout";
    case RefusalLog::kPendingLimit:
      return "pending_handshake_limit";
    case RefusalLog::kConnectionLimit:
      return "connection_limit";
    case RefusalLog::kWrongSecret:
      return "wrong_secret";
    case RefusalLog::kBadHandshake:
      return "bad_handshake";
    case RefusalLog::kAcceptFailed:
      return "accept_failed";
  }
  return "other";
}

std::string ClientLabel(const wire::ClientId& id) {
  std::string s;
  for (size_t i = 0; i < 8; ++i) s += fmt::format("{:02x}", id[i]);
  return s;
}

double U(uint64_t v) { return static_cast<double>(v); }

}  // namespace

void RegisterDaemonMetrics(metrics::Registry* r, Server* server, SlabPool* pool) {
  using metrics::Type;
  using Emit = metrics::Registry::Emit;
  r->AddCallback("farmem_daemon_info", "This daemon: version and node id (random per start).",
                 Type::kGauge, [server](const Emit& emit) {
                   emit({{"version", std::string(kVersionString)},
                         {"node_id", fmt::format("{:016x}", server->node_id())}},
                        1);
                 });
  // Pool gauges: one stats() per gauge family is cheap (a scan of the slab table under the pool's
  // lock); they are read once per scrape.
  auto gauge = [&](const char* name, const char* help, auto value) {
    r->AddCallback(name, help, Type::kGauge,
                   [pool, value](const Emit& emit) { emit({}, value(pool->stats())); });
  };
  auto counter = [&](const char* name, const char* help, auto value) {
    r->AddCallback(name, help, Type::kCounter,
                   [pool, value](const Emit& emit) { emit({}, value(pool->stats())); });
  };
  gauge("farmem_daemon_capacity_bytes", "Most memory this daemon lends (--capacity, whole slabs).",
        [](const PoolStats& s) { return U(s.capacity); });
  gauge("farmem_daemon_slab_size_bytes", "Unit of lending (--slab-size).",
        [](const PoolStats& s) { return U(s.slab_size); });
  gauge("farmem_daemon_lent_bytes", "Memory leased to clients now.",
        [](const PoolStats& s) { return U(uint64_t{s.leased_slabs} * s.slab_size); });
  gauge("farmem_daemon_free_bytes",
        "Memory the daemon would grant now (0 while draining; less under memory pressure).",
        [](const PoolStats& s) { return U(uint64_t{s.free_slabs} * s.slab_size); });
  gauge("farmem_daemon_leases", "Leases held by clients now.",
        [](const PoolStats& s) { return U(s.leased_slabs); });
  gauge("farmem_daemon_leases_noticed", "Leases under an eviction notice now.",
        [](const PoolStats& s) { return U(s.noticed_slabs); });
  gauge("farmem_daemon_draining",
        "1 while draining (farmemctl drain, SIGTERM with --drain-timeout).",
        [](const PoolStats& s) { return s.draining ? 1.0 : 0.0; });
  gauge("farmem_daemon_under_pressure",
        "1 while the host (or cgroup) is below --reserve: granting less than is free.",
        [](const PoolStats& s) { return s.holding ? 1.0 : 0.0; });
  counter("farmem_daemon_leases_granted_total", "Leases granted (ALLOC) since start.",
          [](const PoolStats& s) { return U(s.granted_leases); });
  counter("farmem_daemon_leases_expired_total",
          "Leases ended because their client stopped heartbeating.",
          [](const PoolStats& s) { return U(s.expired_leases); });
  counter("farmem_daemon_leases_evicted_total",
          "Leases ended at an eviction notice's deadline (the client had not freed them).",
          [](const PoolStats& s) { return U(s.evicted_leases); });
  counter("farmem_daemon_huge_page_slabs_total",
          "Leased slabs collapsed into transparent huge pages (--no-huge-pages: none).",
          [](const PoolStats& s) { return U(s.huge_page_slabs); });
  counter("farmem_daemon_huge_page_failures_total",
          "Leased slabs the kernel could not collapse into huge pages (they keep 4 KiB pages).",
          [](const PoolStats& s) { return U(s.huge_page_failures); });
  counter("farmem_daemon_huge_page_skips_total",
          "Leased slabs left with 4 KiB pages because the host was short of memory or the daemon "
          "drained when their turn to be collapsed came.",
          [](const PoolStats& s) { return U(s.huge_page_skips); });
  r->AddCallback(
      "farmem_daemon_client_leased_bytes",
      "Memory leased per client (client id prefix, and its HELLO name when connected).",
      Type::kGauge, [server, pool](const Emit& emit) {
        const auto names = server->client_names();
        const uint64_t slab = pool->slab_size();
        for (const auto& [id, slabs] : pool->LeasesByOwner()) {
          auto it = names.find(id);
          emit({{"client", ClientLabel(id)}, {"name", it == names.end() ? "" : it->second}},
               U(uint64_t{slabs} * slab));
        }
      });
  r->AddCallback("farmem_daemon_clients", "Clients (distinct client ids) connected now.",
                 Type::kGauge, [server](const Emit& emit) { emit({}, server->client_count()); });
  r->AddCallback("farmem_daemon_connections", "Authenticated connections served now.", Type::kGauge,
                 [server](const Emit& emit) { emit({}, U(server->connection_count())); });
  r->AddCallback("farmem_daemon_pending_handshakes", "Connections still in HELLO/AUTH now.",
                 Type::kGauge,
                 [server](const Emit& emit) { emit({}, U(server->pending_handshakes())); });
  r->AddCallback("farmem_daemon_rdma", "1 when the daemon also serves one-sided RDMA (verbs).",
                 Type::kGauge,
                 [server](const Emit& emit) { emit({}, server->rdma() != nullptr ? 1 : 0); });

  // Counters of the connection threads (ServerCounters). The daemon's CPU sees only the TCP
  // transport's frames: RDMA reads and writes are one-sided and never reach it (clients count
  // them: farmem-nbd's farmem_export_backend_*).
  ServerCounters* c = &server->counters();
  auto load = [](const std::atomic<uint64_t>& a) { return U(a.load(std::memory_order_relaxed)); };
  r->AddCallback(
      "farmem_daemon_requests_total", "Frames received, by opcode (after the handshake).",
      Type::kCounter, [c, load](const Emit& emit) {
        for (size_t op = 0; op < ServerCounters::kOpcodeSlots; ++op) {
          const char* name = op == 0 ? "UNKNOWN" : wire::OpcodeName(static_cast<uint8_t>(op));
          if (op != 0 && std::string_view(name) == "UNKNOWN") continue;
          emit({{"opcode", name}, {"transport", "tcp"}}, load(c->requests[op]));
        }
      });
  r->AddCallback(
      "farmem_daemon_request_bytes_total",
      "Data bytes moved by the frames of each opcode (read and written).", Type::kCounter,
      [c, load](const Emit& emit) {
        for (wire::Opcode op : {wire::Opcode::kRead, wire::Opcode::kWrite, wire::Opcode::kBatch,
                                wire::Opcode::kParityEncode, wire::Opcode::kGatherCell}) {
          emit({{"opcode", wire::OpcodeName(static_cast<uint8_t>(op))}, {"transport", "tcp"}},
               load(c->request_bytes[static_cast<size_t>(op)]));
        }
      });
  r->AddCallback("farmem_daemon_data_ops_total",
                 "Reads and writes of leased memory (each one of a BATCH counts).", Type::kCounter,
                 [c, load](const Emit& emit) {
                   emit({{"transport", "tcp"}}, load(c->ops));
                 });
  r->AddCallback("farmem_daemon_data_bytes_total", "Bytes read from and written to leased memory.",
                 Type::kCounter, [c, load](const Emit& emit) {
                   emit({{"direction", "read"}, {"transport", "tcp"}}, load(c->bytes_read));
                   emit({{"direction", "write"}, {"transport", "tcp"}}, load(c->bytes_written));
                 });
  r->AddCallback("farmem_daemon_protocol_errors_total",
                 "Malformed or unexpected frames from authenticated clients.", Type::kCounter,
                 [c, load](const Emit& emit) { emit({}, load(c->protocol_errors)); });
  r->AddCallback(
      "farmem_daemon_auth_failures_total",
      "AUTH with a wrong proof (the peer does not know the secret).", Type::kCounter,
      [c, load](const Emit& emit) { emit({}, load(c->refused[RefusalLog::kWrongSecret])); });
  r->AddCallback("farmem_daemon_refused_connections_total",
                 "Connections refused or dropped before being served, by reason.", Type::kCounter,
                 [c, load](const Emit& emit) {
                   for (size_t k = 0; k < RefusalLog::kKinds; ++k) {
                     emit({{"reason", RefusalReason(k)}}, load(c->refused[k]));
                   }
                 });
  r->AddCallback(
      "farmem_daemon_foreign_lease_refusals_total",
      "Lease operations refused because the lease belongs to another identity (name, client).",
      Type::kCounter, [server](const Emit& emit) {
        emit({}, server->foreign_lease_refusals().load(std::memory_order_relaxed));
      });
  r->AddCallback("farmem_daemon_connections_admitted_total",
                 "Connections that completed the handshake and were served.", Type::kCounter,
                 [c, load](const Emit& emit) { emit({}, load(c->connections_admitted)); });
  r->AddCallback("farmem_daemon_evict_notices_total",
                 "EVICT_NOTICE frames queued to clients (memory pressure or drain).",
                 Type::kCounter, [c, load](const Emit& emit) { emit({}, load(c->evict_notices)); });
  r->AddCallback("farmem_daemon_leases_noticed_total", "Leases named in eviction notices.",
                 Type::kCounter,
                 [c, load](const Emit& emit) { emit({}, load(c->leases_noticed)); });
}

}  // namespace farmem::daemon
