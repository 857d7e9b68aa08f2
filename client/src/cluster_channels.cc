// Data channels: opening one to a node (verbs where both ends can, else tcp), keeping a caller's
// channel current across daemon restarts, and hearing of data-path failures.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "farmem/client/cluster.h"
#include "farmem/transport/verbs.h"
#include "node.h"

namespace farmem::client {

namespace {
// The longest a node stays out of placement after data-path errors (ReportFailure).
constexpr std::chrono::milliseconds kMaxSuspectWindow{60000};
}  // namespace

transport::Channel* Cluster::EnsureChannel(std::unique_ptr<transport::Channel>& slot, NodeId id,
                                           Status* error, uint64_t* opened_to) {
  if (slot && slot->broken()) slot.reset();
  uint64_t daemon_id = 0;
  if (opened_to != nullptr) {
    MutexLock lock(&mu_);
    if (id < nodes_.size()) daemon_id = nodes_[id]->daemon_id;
  }
  if (slot && opened_to != nullptr && *opened_to != daemon_id) slot.reset();
  if (!slot) {
    if (!node(id).alive) {
      *error = Unavailable(fmt::format("daemon {} is down", node(id).endpoint.ToString()));
      return nullptr;
    }
    auto opened = OpenChannel(id);
    if (!opened) {
      *error = opened.error();
      ReportFailure(id, opened.error());
      return nullptr;
    }
    slot = std::move(*opened);
    if (opened_to != nullptr) *opened_to = daemon_id;
  }
  return slot.get();
}

Result<std::unique_ptr<transport::Channel>> Cluster::OpenChannel(NodeId id) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  Node* node = FindNode(id);
  if (node == nullptr) {
    return Err(NotFound(fmt::format("no node {}: the cluster has {}", id, node_count())));
  }
  uint32_t features = 0;
  {
    MutexLock lock(&mu_);
    if (!node->alive) {
      return Err(
          Unavailable(fmt::format("{} is down: {}", node->name(), node->last_error.ToString())));
    }
    features = node->features;
  }
  transport::ChannelOptions o;
  o.endpoint = node->endpoint;
  o.credentials = credentials_;
  o.connect_timeout = options_.connect_timeout;
  o.op_timeout = options_.op_timeout;
  o.max_outstanding = options_.channel_depth;
  if (verbs_ && (features & wire::kFeatureVerbs)) {
    auto ch = verbs_->OpenChannel(o);
    if (ch) {
      spdlog::info("farmem client: data channel to {} uses verbs", node->name());
      return CountedIfReported(
          *node, features,
          transport::WithFaults(std::move(*ch), o.endpoint, options_.fault_injector, o.op_timeout),
          /*one_sided=*/true);
    }
    if (options_.transport == "verbs") {
      if (ch.error().code() == StatusCode::kUnavailable ||
          ch.error().code() == StatusCode::kDeadlineExceeded) {
        ReportFailure(id, ch.error());
      }
      return Err(
          ch.error().WithContext(fmt::format("opening a verbs channel to {}", node->name())));
    }
    spdlog::warn("farmem client: verbs to {} failed ({}); using tcp", node->name(),
                 ch.error().ToString());
  } else if (options_.transport == "verbs") {
    return Err(Unavailable(fmt::format("{} does not serve RDMA", node->name())));
  }
  auto channel = transport_->OpenChannel(o);
  if (!channel) {
    if (channel.error().code() == StatusCode::kUnavailable ||
        channel.error().code() == StatusCode::kDeadlineExceeded) {
      ReportFailure(id, channel.error());
    }
    return Err(
        channel.error().WithContext(fmt::format("opening a data channel to {}", node->name())));
  }
  const char* why = options_.transport == "tcp"         ? "transport=tcp"
                    : !verbs_                           ? "no RDMA device here"
                    : !(features & wire::kFeatureVerbs) ? "the daemon serves no RDMA"
                                                        : "verbs failed";
  spdlog::info("farmem client: data channel to {} uses {} ({})", node->name(), transport_->kind(),
               options_.data_transport ? "a test's data_transport" : why);
  return CountedIfReported(
      *node, features,
      transport::WithFaults(std::move(*channel), o.endpoint, options_.fault_injector, o.op_timeout),
      /*one_sided=*/false);
}

std::unique_ptr<transport::Channel> Cluster::CountedIfReported(
    Node& node, uint32_t features, std::unique_ptr<transport::Channel> channel,
    bool one_sided) const {
  // Only what the daemon cannot count itself, and only for a daemon that takes the report.
  if (!(features & wire::kFeatureAccessReports) || !(one_sided || options_.report_tcp_accesses)) {
    return channel;
  }
  return internal::CountAccesses(std::move(channel), node.accesses);
}

void Cluster::ReportFailure(NodeId id, const Status& error) {
  Node* node = FindNode(id);
  if (node == nullptr) return;
  {
    MutexLock lock(&mu_);
    if (closed_ || stopping_ || !node->alive) return;
    // Suspect for a window of twice the failure timeout. A node that fails again soon after its
    // window ended (within one more window) gets twice the window, up to kMaxSuspectWindow;
    // errors while it is suspect change nothing (a dead node reports many at once).
    const Clock::time_point now = Clock::now();
    if (now >= node->suspect_until) {
      const bool again = now < node->suspect_until + node->suspect_window;
      node->suspect_window = again ? std::min(2 * node->suspect_window, kMaxSuspectWindow)
                                   : std::chrono::milliseconds(2 * options_.failure_timeout);
      node->suspect_until = now + node->suspect_window;
      spdlog::info(
          "farmem client: data path error on {}: {}; probing it, and no new slabs there for {} "
          "ms while other daemons can take them",
          node->name(), error.ToString(), node->suspect_window.count());
    } else {
      spdlog::info("farmem client: data path error on {}: {}; probing it", node->name(),
                   error.ToString());
    }
    node->probe = true;
    probe_requested_ = true;
  }
  wake_.SignalAll();
}

wire::HeartbeatRequest Cluster::PendingAccessReport(Node& node) {
  std::vector<uint64_t> held;
  {
    MutexLock lock(&mu_);
    if (!(node.features & wire::kFeatureAccessReports) || node.leases.empty()) return {};
    held.assign(node.leases.begin(), node.leases.end());
  }
  return node.accesses->Pending(held);
}

}  // namespace farmem::client
