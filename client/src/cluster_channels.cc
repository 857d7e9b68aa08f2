// Data channels: opening one to a node (verbs where both ends can, else tcp), keeping a caller's
// channel current across daemon restarts, and hearing of data-path failures.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "farmem/client/cluster.h"
#include "farmem/transport/verbs.h"
#include "node.h"

namespace farmem::client {

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
      return ch;
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
  spdlog::info("farmem client: data channel to {} uses tcp ({})", node->name(), why);
  return channel;
}

void Cluster::ReportFailure(NodeId id, const Status& error) {
  Node* node = FindNode(id);
  if (node == nullptr) return;
  {
    MutexLock lock(&mu_);
    if (closed_ || stopping_ || !node->alive) return;
    spdlog::info("farmem client: data path error on {}: {}; probing it", node->name(),
                 error.ToString());
    node->probe = true;
    probe_requested_ = true;
  }
  wake_.SignalAll();
}

}  // namespace farmem::client
