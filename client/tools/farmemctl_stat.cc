// farmemctl stat and farmemctl export stat: collecting and rendering per-daemon state (table
// and --json), the per-daemon usage table also shown by demo (PrintNodes), and an export's health
// read from farmem-nbd's metrics endpoint. Command-line parsing and the other commands are
// farmemctl.cc.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include "farmem/common/config.h"
#include "farmem/common/metrics.h"
#include "farmemctl.h"

namespace farmem::ctl {

namespace {

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

}  // namespace

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

namespace {

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

// Exit codes of `farmemctl stat` and `farmemctl export stat` (docs/operations.md "Exit codes").
constexpr int kExitOk = 0;
constexpr int kExitError = 1;     // could not ask: bad options, unreadable secret, bad address
constexpr int kExitDown = 3;      // a daemon is down (stat), or the export is degraded
constexpr int kExitDataLost = 4;  // export stat: data was lost

}  // namespace

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
  std::string export_name, backend, resilience, ec_layout, version;
  for (const metrics::Sample& s : *samples) {
    if (s.name == "farmem_export_info") {
      export_name = s.Label("export");
      backend = s.Label("backend");
      resilience = s.Label("resilience");
      ec_layout = s.Label("ec_layout");  // empty unless ec:k+r (and from older farmem-nbd)
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
        "\"ec_layout\": {}, \"size_bytes\": {}, \"health\": {}, \"extents_mapped\": {}, "
        "\"degraded_extents\": {}, "
        "\"rebuild_in_progress\": {}, \"rebuild_percent\": {:.1f}, \"rebuild_eta_seconds\": {}, "
        "\"rebuilds_total\": {}, \"lost_bytes\": {}, \"daemons\": [",
        JsonString(export_name), JsonString(version), JsonString(backend), JsonString(resilience),
        JsonString(ec_layout), get("farmem_export_size_bytes"), JsonString(health),
        get("farmem_export_extents_mapped"), degraded, rebuilding, pct,
        eta ? fmt::format("{:.1f}", *eta) : "null", get("farmem_export_rebuilds_total"), lost);
    for (size_t i = 0; i < daemons.size(); ++i) {
      out += fmt::format("{}{{\"endpoint\": {}, \"state\": {}, \"leased_bytes\": {}}}",
                         i == 0 ? "" : ", ", JsonString(daemons[i].endpoint),
                         JsonString(daemons[i].state), daemons[i].bytes);
    }
    fmt::print("{}]}}\n", out);
    return code;
  }
  fmt::print("export '{}' ({} backend{}{}), {}, farmem-nbd {}\n", export_name, backend,
             resilience.empty() ? "" : ", " + resilience,
             ec_layout.empty() ? "" : ", " + ec_layout + " layout",
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
  // The stripe layout's space and compaction (its series exist only with that layout).
  if (metrics::Find(*samples, "farmem_export_stripe_live_pages")) {
    auto size = [&](const char* name) { return FormatSize(static_cast<uint64_t>(get(name))); };
    fmt::print(
        "stripe layout: {:.0f} live pages in {:.0f} stripes ({} of rows, {} leased); compaction "
        "moved {:.0f} pages in {:.0f} passes ({:.0f} stripes offloaded, {:.0f} fallbacks; {} "
        "sent, {} received, {:.2f} s CPU)\n",
        get("farmem_export_stripe_live_pages"), get("farmem_export_stripe_sets"),
        size("farmem_export_stripe_set_bytes"), size("farmem_export_stripe_leased_bytes"),
        get("farmem_export_stripe_compacted_pages_total"),
        get("farmem_export_stripe_compactions_total"),
        get("farmem_export_stripe_compaction_offloaded_sets_total"),
        get("farmem_export_stripe_compaction_offload_fallbacks_total"),
        size("farmem_export_stripe_compaction_sent_bytes_total"),
        size("farmem_export_stripe_compaction_received_bytes_total"),
        get("farmem_export_stripe_compaction_cpu_seconds_total"));
  }
  if (!daemons.empty()) {
    std::vector<std::vector<std::string>> rows = {{"daemon", "state", "this export holds"}};
    for (const Daemon& d : daemons) {
      rows.push_back({d.endpoint, d.state, FormatSize(static_cast<uint64_t>(d.bytes))});
    }
    PrintTable(rows);
  }
  return code;
}

}  // namespace farmem::ctl
