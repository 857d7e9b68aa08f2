// Cluster setup: options checked, credentials and transports chosen, every peer (named, or found
// through DNS) dialed in parallel and made a node, the background thread started. The node table,
// control calls, shutdown and subscriptions are in cluster.cc.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <utility>

#include "farmem/client/cluster.h"
#include "farmem/common/auth.h"
#include "farmem/common/version.h"
#include "farmem/transport/verbs.h"
#include "node.h"
#include "stall_meter.h"

namespace farmem::client {

using transport::TcpConnection;

namespace {

Status ValidateOptions(const ClusterOptions& o) {
  if (o.peers.empty() && o.peers_dns.empty()) {
    return InvalidArgument("no peers: set ClusterOptions.peers or peers_dns");
  }
  if (!o.identity.empty()) {
    FARMEM_RETURN_IF_ERROR(auth::ValidateIdentity(o.identity));
    if (o.secret.empty()) {
      return InvalidArgument(
          fmt::format("identity '{}' without its key: set ClusterOptions.secret to the key "
                      "(auth::LoadClientKeyFile of `farmemctl key issue {}`)",
                      o.identity, o.identity));
    }
  }
  if (o.heartbeat_interval.count() <= 0) {
    return InvalidArgument("heartbeat_interval must be positive");
  }
  if (o.failure_timeout <= o.heartbeat_interval) {
    return InvalidArgument(
        fmt::format("failure_timeout ({} ms) must exceed heartbeat_interval ({} ms)",
                    o.failure_timeout.count(), o.heartbeat_interval.count()));
  }
  if (o.connect_timeout.count() <= 0 || o.op_timeout.count() <= 0 ||
      o.dns_refresh_interval.count() <= 0 || o.reconnect_interval.count() < 0) {
    return InvalidArgument(
        "connect_timeout, op_timeout and dns_refresh_interval must be positive, "
        "reconnect_interval not negative");
  }
  if (o.transport != "auto" && o.transport != "tcp" && o.transport != "verbs") {
    return InvalidArgument(
        fmt::format("unknown transport '{}': expected tcp, verbs or auto", o.transport));
  }
  if (o.channel_depth == 0) return InvalidArgument("channel_depth must be at least 1");
  if (o.client_name.size() > wire::kMaxClientName) {
    return InvalidArgument(
        fmt::format("client_name is longer than {} bytes", wire::kMaxClientName));
  }
  return Status::Ok();
}

uint64_t SeedFrom(const std::optional<uint64_t>& seed) {
  if (seed) return *seed;
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace

Cluster::Cluster(ClusterOptions options)
    : options_(std::move(options)),
      reconnect_interval_(options_.reconnect_interval.count() > 0
                              ? options_.reconnect_interval
                              : 2 * options_.heartbeat_interval),
      stall_meter_(std::make_unique<internal::StallMeter>()),
      rng_(SeedFrom(options_.rng_seed)) {}

Cluster::~Cluster() {
  Status st = Close();
  if (!st.ok()) spdlog::warn("closing farmem cluster client: {}", st.ToString());
}

Result<std::unique_ptr<Cluster>> Cluster::Connect(ClusterOptions options) {
  FARMEM_RETURN_IF_ERROR(ValidateOptions(options));
  std::unique_ptr<Cluster> cluster(new Cluster(std::move(options)));
  FARMEM_RETURN_IF_ERROR(cluster->Start());
  return cluster;
}

Result<TcpConnection> Cluster::ConnectTo(const Endpoint& ep,
                                         std::chrono::milliseconds timeout) const {
  transport::ChannelOptions o;
  o.endpoint = ep;
  o.credentials = credentials_;
  o.connect_timeout = timeout;
  o.op_timeout = options_.op_timeout;
  o.max_outstanding = options_.channel_depth;
  return TcpConnection::Connect(o);
}

// Start: who we are, how data moves, whom to dial, dial them all at once, adopt who answered,
// then the background thread.
Status Cluster::Start() {
  FARMEM_RETURN_IF_ERROR(InitCredentials());
  FARMEM_RETURN_IF_ERROR(ChooseTransports());
  std::string dns_error;
  FARMEM_ASSIGN_OR_RETURN(std::vector<DialTarget> targets, PeersToDial(&dns_error));
  std::vector<Result<TcpConnection>> dialed = DialAll(targets);
  FARMEM_RETURN_IF_ERROR(AdoptDialed(targets, dialed, dns_error));
  // Fill in node(id).stat before anyone asks; a failure here is the background thread's business.
  for (NodeId id : AliveNodes()) {
    if (Node* n = FindNode(id)) (void)StatNode(*n);
  }
  monitor_ = std::thread([this] { MonitorLoop(); });
  return Status::Ok();
}

Status Cluster::InitCredentials() {
  if (options_.client_id) {
    client_id_ = *options_.client_id;
  } else {
    FARMEM_RETURN_IF_ERROR(auth::RandomBytes(client_id_));
  }
  credentials_.secret = options_.secret;
  credentials_.identity = options_.identity;
  credentials_.client_id = client_id_;
  credentials_.client_name = options_.client_name.empty()
                                 ? fmt::format("farmem-client-{}", ::getpid())
                                 : options_.client_name;
  return Status::Ok();
}

Status Cluster::ChooseTransports() {
  if (options_.data_transport) {  // a test's fake: it alone carries data
    transport_ = options_.data_transport;
    return Status::Ok();
  }
  transport_ = transport::MakeTcpTransport();
  if (options_.transport == "tcp") return Status::Ok();
  // verbs wherever both ends have an RDMA device; tcp otherwise (auto) or an error (verbs).
  auto verbs = transport::MakeVerbsTransport();
  if (verbs) {
    verbs_ = std::move(*verbs);
  } else if (options_.transport == "verbs") {
    return verbs.error().WithContext("transport=verbs");
  } else {
    spdlog::info("farmem client: {}; data moves over tcp", verbs.error().message());
  }
  return Status::Ok();
}

Result<std::vector<Cluster::DialTarget>> Cluster::PeersToDial(std::string* dns_error) {
  // The explicit peers (each a node even if down), then every DNS address (a node only once it
  // answers); each address once.
  std::vector<DialTarget> targets;
  auto add = [&](const Endpoint& ep, bool from_dns) {
    const bool known = std::any_of(targets.begin(), targets.end(),
                                   [&](const DialTarget& t) { return t.endpoint == ep; });
    if (!known) targets.push_back({ep, from_dns});
  };
  for (const Endpoint& ep : options_.peers) add(ep, false);
  if (options_.peers_dns.empty()) return targets;
  auto parsed = ParseEndpoint(options_.peers_dns, kDefaultPort);
  if (!parsed) return Err(parsed.error().WithContext("peers_dns"));
  dns_endpoint_ = *parsed;
  auto addrs = ResolveAll(parsed->host);
  if (!addrs) {
    *dns_error = fmt::format("resolving {}: {}", options_.peers_dns, addrs.error().ToString());
    spdlog::warn("{}", *dns_error);
    return targets;
  }
  for (const std::string& a : *addrs) add(Endpoint{a, parsed->port}, true);
  if (addrs->empty()) *dns_error = fmt::format("{} resolved to no address", options_.peers_dns);
  return targets;
}

std::vector<Result<TcpConnection>> Cluster::DialAll(const std::vector<DialTarget>& targets) const {
  // Every peer at once: setup time is one connect timeout, not one per unreachable peer.
  std::vector<std::optional<Result<TcpConnection>>> dialed(targets.size());
  {
    std::vector<std::thread> dialers;
    dialers.reserve(targets.size());
    for (size_t i = 0; i < targets.size(); ++i) {
      dialers.emplace_back([this, &targets, &dialed, i] {
        dialed[i].emplace(ConnectTo(targets[i].endpoint, options_.connect_timeout));
      });
    }
    for (std::thread& t : dialers) t.join();
  }
  std::vector<Result<TcpConnection>> out;
  out.reserve(dialed.size());
  for (auto& d : dialed) out.push_back(std::move(*d));
  return out;
}

Status Cluster::AdoptDialed(const std::vector<DialTarget>& targets,
                            std::vector<Result<TcpConnection>>& dialed,
                            const std::string& dns_error) {
  std::vector<std::string> failures;
  std::optional<StatusCode> common_code;
  bool same_code = true;
  std::vector<std::pair<Node*, TcpConnection>> adopted;
  {
    MutexLock lock(&mu_);
    const auto now = Clock::now();
    for (size_t i = 0; i < targets.size(); ++i) {
      Result<TcpConnection>& r = dialed[i];
      const Endpoint& ep = targets[i].endpoint;
      if (!r) {
        failures.push_back(fmt::format("{}: {}", ep.ToString(), r.error().ToString()));
        if (common_code && *common_code != r.error().code()) same_code = false;
        common_code = r.error().code();
        if (!targets[i].from_dns) {
          Node* n = AddNode(ep);
          n->last_error = r.error();
          n->next_reconnect = now + reconnect_interval_;
          n->reconnect_backoff = reconnect_interval_;
        }
        continue;
      }
      const uint64_t daemon_id = r->hello().node_id;
      auto same = std::find_if(nodes_.begin(), nodes_.end(), [&](const auto& n) {
        return n->alive && n->daemon_id == daemon_id;
      });
      if (same != nodes_.end()) {
        spdlog::info("farmem client: {} is the same daemon as {}; using it once", ep.ToString(),
                     (*same)->name());
        aliases_.push_back(ep);
        continue;
      }
      Node* n = AddNode(ep);
      n->alive = true;
      n->daemon_id = daemon_id;
      n->features = r->hello().features;  // OpenChannel picks verbs from these
      internal::WarnOnVersionMismatch(ep, r->hello());
      NoteContactLocked(*n, now);
      n->reconnect_backoff = reconnect_interval_;
      adopted.emplace_back(n, std::move(*r));
    }
  }
  for (auto& [n, conn] : adopted) {
    MutexLock call(&n->call_mu);  // lock order: call_mu is never taken under mu_
    n->conn.emplace(std::move(conn));
  }
  if (alive_count() == 0) {
    if (!dns_error.empty()) failures.push_back(dns_error);
    const StatusCode code =
        same_code && common_code && dns_error.empty() ? *common_code : StatusCode::kUnavailable;
    std::string msg = "no farmem daemon reachable";
    for (size_t i = 0; i < failures.size(); ++i) msg += (i == 0 ? ": " : "; ") + failures[i];
    return Status(code, msg);
  }
  for (const std::string& f : failures) spdlog::warn("farmem client: peer unreachable: {}", f);
  return Status::Ok();
}

Cluster::Node* Cluster::AddNode(const Endpoint& ep) {
  nodes_.push_back(std::make_unique<Node>(static_cast<NodeId>(nodes_.size()), ep));
  return nodes_.back().get();
}

}  // namespace farmem::client
