// farmemctl: look at a farmem cluster and exercise it from the command line.
//
//   farmemctl stat --peers h:p,h:p [--secret-file F] [--json]
//       per-daemon state, version, capacity and usage; exit 3 when a daemon is down
//   farmemctl export stat HOST:PORT [--json]
//       an export's health from farmem-nbd --metrics-listen HOST:PORT
//   farmemctl drain HOST:PORT [--secret-file F] [--grace-ms 30000] [--wait]
//       the daemon grants nothing more and gives every client notice to move its data
//       (docs/operations.md "Drain"); --wait returns once it holds no lease
//   farmemctl undrain HOST:PORT [--secret-file F]     grant again, lift pending notices
//   farmemctl demo --peers h:p,h:p [--secret-file F | --key-file K] [--size 384M]
//       borrows slabs by power-of-two-choices, writes patterned data across the daemons,
//       reads it all back verified, shows per-daemon usage, frees everything.
//   farmemctl key issue NAME --secret-file F --out K
//       writes the key of identity NAME (derived from the cluster secret, docs/operations.md
//       "Security") to K, mode 0600; a client given --key-file K authenticates as NAME.
// stat and demo take --key-file K instead of --secret-file to act as one identity.
#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "farmem/client/cluster.h"
#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"
#include "farmem/common/metrics.h"

using namespace farmem;
using Sec = std::chrono::duration<double>;

namespace {

struct Common {
  std::string peers, peers_dns, secret_file, key_file, transport = "auto";
};

Result<std::unique_ptr<client::Cluster>> ConnectCluster(const Common& c, const char* name) {
  client::ClusterOptions o;
  FARMEM_ASSIGN_OR_RETURN(o.peers, ParseEndpointList(c.peers, kDefaultPort));
  o.peers_dns = c.peers_dns;
  o.transport = c.transport;
  o.client_name = name;
  FARMEM_ASSIGN_OR_RETURN(auth::ClientKeyFile cred,
                          auth::LoadClientCredentials(c.secret_file, c.key_file));
  o.secret = std::move(cred.key);
  o.identity = std::move(cred.identity);
  if (o.peers.empty() && o.peers_dns.empty()) {
    return Err(InvalidArgument("give the daemons with --peers host:port,... or --peers-dns"));
  }
  return client::Cluster::Connect(std::move(o));
}

// A table whose columns are as wide as their widest cell (a fixed width let "free to me" with
// the pool's free after it run into the next column). The first column is left-aligned.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (row.size() > width.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t i = 0; i < row.size(); ++i) {
      line += i == 0 ? fmt::format(" {:<{}}", row[i], width[i])
                     : fmt::format("  {:>{}}", row[i], width[i]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    fmt::print("{}\n", line);
  }
}

// One daemon as `farmemctl stat` reports it (table and --json).
struct DaemonStatus {
  std::string endpoint;
  std::string state;  // up, drain, press, DOWN
  std::optional<wire::StatReply> stat;
  std::string error;  // why it is down
};

std::vector<DaemonStatus> CollectStatus(client::Cluster& cluster) {
  std::vector<DaemonStatus> out;
  for (client::NodeId id = 0; id < cluster.node_count(); ++id) {
    client::NodeInfo info = cluster.node(id);
    auto st = info.alive ? cluster.Stat(id) : Result<wire::StatReply>(Err(info.last_error));
    DaemonStatus d;
    d.endpoint = info.endpoint.ToString();
    if (!st) {
      d.state = "DOWN";
      d.error = st.error().ToString();
    } else {
      d.state = (st->features & wire::kStateDraining)        ? "drain"
                : (st->features & wire::kStateUnderPressure) ? "press"
                                                             : "up";
      d.stat = *st;
    }
    out.push_back(std::move(d));
  }
  return out;
}

// A draining daemon, or one whose host is short of memory, grants nothing: its free_slabs says
// what it would grant, not what is unleased, so "lent" is unknown then.
bool Granting(const wire::StatReply& st) {
  return (st.features & (wire::kStateDraining | wire::kStateUnderPressure)) == 0;
}

void PrintNodes(client::Cluster& cluster, const std::map<client::NodeId, uint64_t>& written) {
  const bool demo = !written.empty();
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head = {"daemon", "state", "version",    "capacity",
                                   "lent",   "slabs", "free to me", "clients",
                                   "ops",    "read",  "written",    "transport"};
  if (demo) head.push_back("this client");
  rows.push_back(head);
  std::vector<std::string> down;
  const std::vector<DaemonStatus> all = CollectStatus(cluster);
  for (size_t id = 0; id < all.size(); ++id) {
    const DaemonStatus& d = all[id];
    if (!d.stat) {
      down.push_back(fmt::format("  {}: DOWN: {}", d.endpoint, d.error));
      std::vector<std::string> row = {d.endpoint, "DOWN"};
      row.resize(head.size(), "-");
      rows.push_back(row);
      continue;
    }
    const wire::StatReply& st = *d.stat;
    const bool granting = Granting(st);
    const uint64_t lent = uint64_t{st.total_slabs - st.free_slabs} * st.slab_size;
    // "free to me": what this client may still lease there (its --max-client-share), with the
    // pool's free slabs after it when the share keeps some of them for other clients.
    const uint32_t mine = wire::FreeForClient(st);
    const std::string free_to_me =
        mine == st.free_slabs
            ? FormatSize(uint64_t{mine} * st.slab_size)
            : fmt::format("{} ({} free)", FormatSize(uint64_t{mine} * st.slab_size),
                          FormatSize(uint64_t{st.free_slabs} * st.slab_size));
    std::vector<std::string> row = {
        d.endpoint,
        d.state,
        st.version.empty() ? "?" : st.version.substr(0, st.version.find(' ')),
        FormatSize(st.capacity),
        granting ? FormatSize(lent) : "?",
        granting ? fmt::format("{}/{}", st.total_slabs - st.free_slabs, st.total_slabs)
                 : fmt::format("?/{}", st.total_slabs),
        free_to_me,
        std::to_string(st.clients),
        std::to_string(st.ops),
        FormatSize(st.bytes_read),
        FormatSize(st.bytes_written),
        (st.features & wire::kFeatureVerbs) ? fmt::format("tcp+rdma:{}", st.rdma_port) : "tcp"};
    if (demo) {
      auto it = written.find(static_cast<client::NodeId>(id));
      row.push_back(it == written.end() ? "-" : FormatSize(it->second));
    }
    rows.push_back(std::move(row));
  }
  PrintTable(rows);
  for (const std::string& line : down) fmt::print("{}\n", line);
}

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// `farmemctl stat --json`: one object, {"daemons": [...], "down": N}; fields of a daemon that
// answered are the STAT reply's (docs/operations.md "Looking at a cluster").
void PrintStatJson(const std::vector<DaemonStatus>& all) {
  std::string out = "{\"daemons\": [";
  size_t down = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const DaemonStatus& d = all[i];
    out += i == 0 ? "\n  {" : ",\n  {";
    out += fmt::format("\"endpoint\": {}, \"state\": {}", JsonString(d.endpoint),
                       JsonString(d.stat ? d.state : "down"));
    if (!d.stat) {
      ++down;
      out += fmt::format(", \"error\": {}}}", JsonString(d.error));
      continue;
    }
    const wire::StatReply& st = *d.stat;
    out += fmt::format(
        ", \"version\": {}, \"node_id\": \"{:016x}\", \"capacity_bytes\": {}, "
        "\"slab_size_bytes\": {}, \"total_slabs\": {}, \"free_slabs\": {}, "
        "\"lent_bytes\": {}, \"client_free_slabs\": {}, \"client_max_slabs\": {}, "
        "\"clients\": {}, \"ops\": {}, \"bytes_read\": {}, \"bytes_written\": {}, "
        "\"draining\": {}, \"under_pressure\": {}, \"auth_required\": {}, "
        "\"transports\": [\"tcp\"{}], \"rdma_port\": {}}}",
        JsonString(st.version), st.node_id, st.capacity, st.slab_size, st.total_slabs,
        st.free_slabs,
        Granting(st) ? fmt::format("{}", uint64_t{st.total_slabs - st.free_slabs} * st.slab_size)
                     : "null",
        wire::FreeForClient(st), st.client_max_slabs, st.clients, st.ops, st.bytes_read,
        st.bytes_written, (st.features & wire::kStateDraining) != 0,
        (st.features & wire::kStateUnderPressure) != 0,
        (st.features & wire::kFeatureAuthRequired) != 0,
        (st.features & wire::kFeatureVerbs) ? ", \"rdma\"" : "", st.rdma_port);
  }
  out += fmt::format("\n], \"down\": {}}}\n", down);
  fmt::print("{}", out);
}

// The byte at `offset` of slab number `slab`: distinct per slab and position, cheap to check.
inline uint64_t Pattern(uint64_t slab, uint64_t offset) {
  uint64_t x = (slab << 40) ^ offset ^ 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

void Fill(std::span<uint8_t> buf, uint64_t slab, uint64_t offset) {
  for (size_t i = 0; i < buf.size(); i += 8) {
    const uint64_t v = Pattern(slab, offset + i);
    std::memcpy(buf.data() + i, &v, 8);
  }
}

int Demo(const Common& c, const std::string& size_text) {
  auto size = ParseSize(size_text);
  if (!size) {
    fmt::print(stderr, "--size: {}\n", size.error().ToString());
    return 2;
  }
  auto cluster = ConnectCluster(c, "farmemctl-demo");
  if (!cluster) {
    fmt::print(stderr, "farmemctl: {}\n", cluster.error().ToString());
    return 1;
  }
  client::Cluster& cl = **cluster;
  fmt::print("connected to {} of {} daemons\n", cl.alive_count(), cl.node_count());
  uint64_t slab_size = 0;
  for (client::NodeId id = 0; id < cl.node_count() && slab_size == 0; ++id) {
    if (auto st = cl.Stat(id)) slab_size = st->slab_size;
  }
  if (slab_size == 0) {
    fmt::print(stderr, "farmemctl: no daemon answered STAT\n");
    return 1;
  }
  const size_t nslabs = static_cast<size_t>((*size + slab_size - 1) / slab_size);
  fmt::print("borrowing {} as {} slabs of {} (power-of-two-choices placement)\n", FormatSize(*size),
             nslabs, FormatSize(slab_size));
  auto leases = cl.Allocate(nslabs);
  if (!leases) {
    fmt::print(stderr, "farmemctl: {}\n", leases.error().ToString());
    return 1;
  }
  std::map<client::NodeId, std::unique_ptr<transport::Channel>> channels;
  std::map<client::NodeId, uint64_t> per_node;
  for (const client::Lease& l : *leases) {
    per_node[l.node] += l.grant.length;
    if (!channels.count(l.node)) {
      auto ch = cl.OpenChannel(l.node);
      if (!ch) {
        fmt::print(stderr, "farmemctl: {}\n", ch.error().ToString());
        return 1;
      }
      channels[l.node] = std::move(*ch);
    }
  }
  // Move data in batches of 16 operations of 256 KiB per daemon round.
  constexpr uint32_t kOp = 256 << 10;
  constexpr size_t kDepth = 16;
  std::vector<uint8_t> buf(kOp * kDepth), check(kOp * kDepth);
  auto pass = [&](bool write, uint64_t* bad) -> Status {
    for (size_t li = 0; li < leases->size(); ++li) {
      const client::Lease& l = (*leases)[li];
      const uint64_t len = std::min<uint64_t>(l.grant.length, *size - li * slab_size);
      for (uint64_t off = 0; off < len; off += uint64_t{kOp} * kDepth) {
        std::vector<transport::Op> ops;
        for (size_t k = 0; k < kDepth && off + k * kOp < len; ++k) {
          const uint64_t o = off + k * kOp;
          const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(kOp, len - o));
          std::span<uint8_t> b(buf.data() + k * kOp, n);
          if (write) Fill(b, li, o);
          ops.push_back({write ? transport::OpType::kWrite : transport::OpType::kRead, l.slab(), o,
                         b.data(), n});
        }
        FARMEM_RETURN_IF_ERROR(channels[l.node]->Execute(ops));
        if (!write) {
          for (size_t k = 0; k < ops.size(); ++k) {
            std::span<uint8_t> want(check.data(), ops[k].length);
            Fill(want, li, ops[k].offset);
            if (std::memcmp(want.data(), ops[k].local, ops[k].length) != 0) ++*bad;
          }
        }
      }
    }
    return Status::Ok();
  };
  uint64_t bad = 0;
  auto t0 = Clock::now();
  if (Status s = pass(true, &bad); !s.ok()) {
    fmt::print(stderr, "farmemctl: write failed: {}\n", s.ToString());
    return 1;
  }
  const double wsec = Sec(Clock::now() - t0).count();
  t0 = Clock::now();
  if (Status s = pass(false, &bad); !s.ok()) {
    fmt::print(stderr, "farmemctl: read failed: {}\n", s.ToString());
    return 1;
  }
  const double rsec = Sec(Clock::now() - t0).count();
  const double mib = static_cast<double>(*size) / (1 << 20);
  fmt::print("wrote {} in {:.2f} s ({:.0f} MiB/s), read back in {:.2f} s ({:.0f} MiB/s) over {}\n",
             FormatSize(*size), wsec, mib / wsec, rsec, mib / rsec,
             channels.begin()->second->kind());
  if (bad != 0) {
    fmt::print("VERIFY FAILED: {} chunks differ\n", bad);
    return 1;
  }
  fmt::print("verified: every byte read back is the byte written\n");
  fmt::print("per-daemon usage while borrowed:\n");
  PrintNodes(cl, per_node);
  channels.clear();
  if (Status s = cl.Free(*leases); !s.ok()) {
    fmt::print(stderr, "farmemctl: free: {}\n", s.ToString());
    return 1;
  }
  fmt::print("freed {} slabs; per-daemon usage now:\n", leases->size());
  PrintNodes(cl, {});
  (void)cl.Close();
  return 0;
}

// Exit codes of `farmemctl stat` and `farmemctl export stat` (docs/operations.md "Exit codes").
constexpr int kExitOk = 0;
constexpr int kExitError = 1;     // could not ask: bad options, unreadable secret, bad address
constexpr int kExitDown = 3;      // a daemon is down (stat), or the export is degraded
constexpr int kExitDataLost = 4;  // export stat: data was lost

int StatCmd(const Common& c, bool json) {
  auto cluster = ConnectCluster(c, "farmemctl-stat");
  if (!cluster) {
    // Nobody answered: every daemon named is down. Anything else (a wrong secret, bad options)
    // is an error of this command.
    const StatusCode code = cluster.error().code();
    auto peers = ParseEndpointList(c.peers, kDefaultPort);
    if ((code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded) && peers &&
        !peers->empty() && c.peers_dns.empty()) {
      std::vector<DaemonStatus> all;
      for (const Endpoint& ep : *peers) {
        all.push_back({ep.ToString(), "DOWN", std::nullopt, cluster.error().ToString()});
      }
      if (json) {
        PrintStatJson(all);
      } else {
        for (const DaemonStatus& d : all) fmt::print("  {}: DOWN: {}\n", d.endpoint, d.error);
      }
      return kExitDown;
    }
    fmt::print(stderr, "farmemctl: {}\n", cluster.error().ToString());
    return kExitError;
  }
  const std::vector<DaemonStatus> all = CollectStatus(**cluster);
  if (json) {
    PrintStatJson(all);
  } else {
    PrintNodes(**cluster, {});
  }
  const bool any_down =
      std::any_of(all.begin(), all.end(), [](const DaemonStatus& d) { return !d.stat; });
  return any_down ? kExitDown : kExitOk;
}

// `farmemctl export stat HOST:PORT`: an export's health from farmem-nbd's --metrics-listen
// endpoint (the one place it is published; nothing is kept twice).
int ExportStatCmd(const std::string& target, bool json) {
  auto ep = ParseEndpoint(target);
  if (!ep) {
    fmt::print(stderr, "farmemctl: export stat {}: {}\n", target, ep.error().ToString());
    return kExitError;
  }
  auto r = metrics::HttpGet(*ep, "/metrics", DeadlineIn(std::chrono::seconds(10)));
  if (r && r->status != 200) {
    r = Err(Unavailable(fmt::format("HTTP status {}", r->status)));
  }
  if (!r) {
    fmt::print(stderr,
               "farmemctl: export stat: {} (give the address of farmem-nbd --metrics-listen)\n",
               r.error().ToString());
    return kExitError;
  }
  auto samples = metrics::ParseExposition(r->body);
  if (!samples) {
    fmt::print(stderr, "farmemctl: export stat: {}\n", samples.error().ToString());
    return kExitError;
  }
  auto get = [&](const char* name, const metrics::Labels& l = {}) {
    return metrics::Find(*samples, name, l).value_or(0);
  };
  std::string export_name, backend, resilience, version;
  for (const metrics::Sample& s : *samples) {
    if (s.name == "farmem_export_info") {
      export_name = s.Label("export");
      backend = s.Label("backend");
      resilience = s.Label("resilience");
      version = s.Label("version");
    }
  }
  if (backend.empty()) {
    fmt::print(stderr, "farmemctl: export stat: {} serves no farmem export metrics\n", target);
    return kExitError;
  }
  const double degraded = get("farmem_export_degraded_extents");
  const double done = get("farmem_export_episode_reprotected_extents");
  const double running_s = get("farmem_export_episode_reprotect_seconds");
  const double lost = get("farmem_export_lost_bytes_total");
  const bool rebuilding = get("farmem_export_rebuild_in_progress") > 0;
  // Progress of the current degraded episode: extents made whole of those degraded in it; the
  // ETA extrapolates the rate so far (unknown before the first extent is whole).
  const double pct = degraded + done > 0 ? 100.0 * done / (degraded + done) : 100.0;
  std::optional<double> eta;
  if (degraded > 0 && done > 0 && running_s > 0) eta = running_s / done * degraded;
  struct Daemon {
    std::string endpoint, state;
    double bytes = 0;
  };
  std::vector<Daemon> daemons;
  for (const metrics::Sample& s : *samples) {
    if (s.name == "farmem_export_daemon_state" && s.value == 1) {
      daemons.push_back(
          {s.Label("daemon"), s.Label("state"),
           get("farmem_export_daemon_leased_bytes", {{"daemon", s.Label("daemon")}})});
    }
  }
  const bool any_down =
      std::any_of(daemons.begin(), daemons.end(), [](const Daemon& d) { return d.state != "up"; });
  const int code = lost > 0 ? kExitDataLost : (degraded > 0 || any_down) ? kExitDown : kExitOk;
  const std::string health = lost > 0 ? "DATA LOST" : degraded > 0 ? "degraded" : "whole";
  if (json) {
    std::string out = fmt::format(
        "{{\"export\": {}, \"version\": {}, \"backend\": {}, \"resilience\": {}, "
        "\"size_bytes\": {}, \"health\": {}, \"extents_mapped\": {}, \"degraded_extents\": {}, "
        "\"rebuild_in_progress\": {}, \"rebuild_percent\": {:.1f}, \"rebuild_eta_seconds\": {}, "
        "\"rebuilds_total\": {}, \"lost_bytes\": {}, \"daemons\": [",
        JsonString(export_name), JsonString(version), JsonString(backend), JsonString(resilience),
        get("farmem_export_size_bytes"), JsonString(health), get("farmem_export_extents_mapped"),
        degraded, rebuilding, pct, eta ? fmt::format("{:.1f}", *eta) : "null",
        get("farmem_export_rebuilds_total"), lost);
    for (size_t i = 0; i < daemons.size(); ++i) {
      out += fmt::format("{}{{\"endpoint\": {}, \"state\": {}, \"leased_bytes\": {}}}",
                         i == 0 ? "" : ", ", JsonString(daemons[i].endpoint),
                         JsonString(daemons[i].state), daemons[i].bytes);
    }
    fmt::print("{}]}}\n", out);
    return code;
  }
  fmt::print("export '{}' ({} backend{}), {}, farmem-nbd {}\n", export_name, backend,
             resilience.empty() ? "" : ", " + resilience,
             FormatSize(static_cast<uint64_t>(get("farmem_export_size_bytes"))), version);
  fmt::print("health: {}: {:.0f} extents mapped, {:.0f} degraded; lost {}\n", health,
             get("farmem_export_extents_mapped"), degraded,
             FormatSize(static_cast<uint64_t>(lost)));
  if (degraded > 0 || rebuilding) {
    fmt::print(
        "rebuild: {}, {:.1f}% of this episode's extents whole again ({:.0f} of {:.0f}), "
        "ETA {}\n",
        rebuilding ? "running" : "waiting for a daemon with room", pct, done, degraded + done,
        eta ? fmt::format("{:.0f} s", *eta) : "unknown");
  }
  fmt::print("rebuilds since start: {:.0f} members, {}\n", get("farmem_export_rebuilds_total"),
             FormatSize(static_cast<uint64_t>(get("farmem_export_rebuilt_bytes_total"))));
  if (!daemons.empty()) {
    std::vector<std::vector<std::string>> rows = {{"daemon", "state", "this export holds"}};
    for (const Daemon& d : daemons) {
      rows.push_back({d.endpoint, d.state, FormatSize(static_cast<uint64_t>(d.bytes))});
    }
    PrintTable(rows);
  }
  return code;
}

// DRAIN (or undrain) one daemon over a control connection of its own; with `wait`, repeats the
// (idempotent) DRAIN until the daemon holds no lease or the grace period and 5 s more have passed.
int DrainCmd(const Common& c, const std::string& target, bool drain, uint32_t grace_ms, bool wait) {
  Common one = c;
  one.peers = target;
  one.peers_dns.clear();
  auto cluster = ConnectCluster(one, drain ? "farmemctl-drain" : "farmemctl-undrain");
  if (!cluster) {
    fmt::print(stderr, "farmemctl: {}\n", cluster.error().ToString());
    return 1;
  }
  auto conn = (*cluster)->ControlConnection(0);
  if (!conn) {
    fmt::print(stderr, "farmemctl: {}: {}\n", target, conn.error().ToString());
    return 1;
  }
  std::vector<uint8_t> req;
  wire::EncodeDrain({drain, grace_ms}, &req);
  auto call = [&]() -> Result<wire::DrainReply> {
    FARMEM_ASSIGN_OR_RETURN(auto body,
                            conn->Call(wire::Opcode::kDrain, req, std::chrono::seconds(10)));
    return wire::DecodeDrainReply(body);
  };
  auto r = call();
  if (!r) {
    fmt::print(stderr, "farmemctl: {} {}: {}\n", drain ? "drain" : "undrain", target,
               r.error().ToString());
    return 1;
  }
  if (!drain) {
    fmt::print("{}: undrained; granting again ({} lease(s) held)\n", target, r->leases_held);
    return 0;
  }
  fmt::print("{}: draining; {} lease(s) noticed to move within {} ms, {} held\n", target,
             r->leases_noticed, grace_ms, r->leases_held);
  if (!wait) return 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms) +
                        std::chrono::seconds(5);
  while (r->leases_held > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // polling the daemon's state
    r = call();
    if (!r) {
      fmt::print(stderr, "farmemctl: drain {}: {}\n", target, r.error().ToString());
      return 1;
    }
  }
  if (r->leases_held > 0) {
    fmt::print(stderr, "farmemctl: {} still holds {} lease(s)\n", target, r->leases_held);
    return 1;
  }
  fmt::print("{}: drained, no lease held\n", target);
  return 0;
}

// farmemctl key issue: the key of one identity, derived from the cluster secret (auth.h).
int KeyIssueCmd(const std::string& secret_file, const std::string& name, const std::string& out) {
  if (Status s = auth::ValidateIdentity(name); !s.ok()) {
    fmt::print(stderr, "farmemctl key issue: {}\n", s.message());
    return 2;
  }
  if (name == auth::kClusterIdentity) {
    fmt::print(stderr,
               "farmemctl key issue: '{}' is the built-in identity of the cluster secret itself; "
               "give its holders --secret-file\n",
               name);
    return 2;
  }
  auto secret = auth::LoadSecretFile(secret_file);
  if (!secret) {
    fmt::print(stderr, "farmemctl key issue: --secret-file: {}\n", secret.error().ToString());
    return 1;
  }
  const std::string text = auth::FormatClientKeyFile({name, auth::ClientKey(*secret, name)});
  // Created 0600 and never widened: the key is as good as the name's password.
  const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    fmt::print(stderr, "farmemctl key issue: cannot create {}: {}{}\n", out, strerror(errno),
               errno == EEXIST ? " (remove it first: a key file is never overwritten)" : "");
    return 1;
  }
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok) {
    fmt::print(stderr, "farmemctl key issue: writing {} failed\n", out);
    ::unlink(out.c_str());
    return 1;
  }
  fmt::print(
      "wrote the key of identity '{}' to {} (mode 0600); give it to that client with "
      "--key-file {}\n",
      name, out, out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"farmemctl - inspect and exercise a farmem cluster"};
  app.require_subcommand(1);
  Common c;
  std::string size = "384M", log_level = "warn";
  auto add_common = [&](CLI::App* sub) {
    sub->add_option("--peers", c.peers, "Daemons: host:port,host:port (port defaults to 7411)");
    sub->add_option("--peers-dns", c.peers_dns, "A name:port whose every address is a daemon");
    sub->add_option("--secret-file", c.secret_file, "Shared secret the daemons require");
    sub->add_option("--key-file", c.key_file,
                    "Authenticate as one identity: its key file (farmemctl key issue)");
    sub->add_option("--transport", c.transport, "tcp, verbs or auto")
        ->capture_default_str()
        ->check(cli::OneOf(kTransports));
  };
  cli::AddLogLevelOption(app, log_level);
  cli::AddVersionOption(app, "farmemctl");
  bool json = false;
  CLI::App* stat = app.add_subcommand(
      "stat",
      "Show every daemon's state, version, capacity and usage. Exit 0: every daemon answered; "
      "3: a daemon is down; 1: could not ask (docs/operations.md)");
  add_common(stat);
  stat->add_flag("--json", json, "Print JSON instead of a table");
  std::string export_target;
  CLI::App* exp = app.add_subcommand("export", "Look at a farmem-nbd export");
  exp->require_subcommand(1);
  CLI::App* export_stat = exp->add_subcommand(
      "stat",
      "An export's health from farmem-nbd --metrics-listen: degraded extents, rebuild progress "
      "and ETA, daemons and placement. Exit 0: whole; 3: degraded or a daemon not up; 4: data "
      "lost; 1: could not ask");
  export_stat->add_option("target", export_target, "farmem-nbd's --metrics-listen, host:port")
      ->required();
  export_stat->add_flag("--json", json, "Print JSON instead of text");
  std::string target;
  uint32_t grace_ms = 30000;
  bool wait = false;
  CLI::App* drain = app.add_subcommand(
      "drain", "Make one daemon grant nothing and give its clients notice to move their data");
  drain->add_option("target", target, "The daemon, host:port")->required();
  drain->add_option("--secret-file", c.secret_file, "Shared secret the daemon requires");
  drain->add_option("--key-file", c.key_file, "An identity's key file (DRAIN needs the secret)");
  drain->add_option("--grace-ms", grace_ms, "How long clients have to move their data")
      ->capture_default_str();
  drain->add_flag("--wait", wait,
                  "Return once the daemon holds no lease (exit 1 if it still does)");
  CLI::App* undrain =
      app.add_subcommand("undrain", "Let a drained daemon grant again and lift pending notices");
  undrain->add_option("target", target, "The daemon, host:port")->required();
  undrain->add_option("--secret-file", c.secret_file, "Shared secret the daemon requires");
  CLI::App* demo = app.add_subcommand(
      "demo", "Borrow slabs, write patterned data, read it back verified, free it");
  add_common(demo);
  demo->add_option("--size", size, "How much memory to borrow and fill")->capture_default_str();
  CLI::App* key = app.add_subcommand("key", "Client identities (docs/operations.md \"Security\")");
  key->require_subcommand(1);
  CLI::App* key_issue = key->add_subcommand(
      "issue", "Write the key of one identity, derived from the cluster secret, to a new file");
  std::string key_name, key_out;
  key_issue->add_option("name", key_name, "The identity: letters, digits and . _ @ -")->required();
  key_issue->add_option("--secret-file", c.secret_file, "The cluster secret")->required();
  key_issue->add_option("--out", key_out, "The key file to create (mode 0600)")->required();
  CLI11_PARSE(app, argc, argv);
  cli::SetUpLogging("farmemctl", log_level);
  if (*stat) return StatCmd(c, json);
  if (*exp) return ExportStatCmd(export_target, json);
  if (*drain) return DrainCmd(c, target, true, grace_ms, wait);
  if (*undrain) return DrainCmd(c, target, false, 0, false);
  if (*key) return KeyIssueCmd(c.secret_file, key_name, key_out);
  return Demo(c, size);
}
