// ChannelSet (channel_set.h): a thread's channels by node and the wait on many of them.
#include "farmem/client/channel_set.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>

namespace farmem::client {

ChannelSet::ChannelSet(Cluster* cluster, std::chrono::milliseconds op_timeout, size_t completions)
    : cluster_(cluster), op_timeout_(op_timeout), comps_(std::max<size_t>(completions, 1)) {}

void ChannelSet::Reserve(size_t nodes) {
  channels_.reserve(nodes);
  channel_daemon_.reserve(nodes);
  pfds_.reserve(nodes);
  pfd_nodes_.reserve(nodes);
  down_.reserve(nodes);
}

transport::Channel* ChannelSet::Get(NodeId node, Status* error) {
  if (channels_.size() <= node) channels_.resize(node + 1);
  if (channel_daemon_.size() <= node) channel_daemon_.resize(node + 1, 0);
  auto& ch = channels_[node];
  if (ch && ch->broken() && ch->outstanding() > 0) {
    transport::Completion c[64];
    while (ch->outstanding() > 0) {
      auto n = ch->Poll(c, std::chrono::milliseconds(0));
      if (!n || *n == 0) break;
    }
  }
  // A channel to an earlier incarnation of the daemon (it restarted on the same address) is dead
  // even if no error was seen on it yet: EnsureChannel replaces it instead of failing an op on it.
  return cluster_->EnsureChannel(ch, node, error, &channel_daemon_[node]);
}

Status ChannelSet::Post(NodeId node, const transport::Op& op) {
  Status error;
  transport::Channel* ch = Get(node, &error);
  if (ch == nullptr) return error;
  return ch->Post(op);
}

void ChannelSet::FlushAll() {
  flushed_ops_ = 0;
  for (auto& ch : channels_) {
    if (ch && ch->outstanding() > 0) {
      flushed_ops_ += ch->outstanding();
      (void)ch->Flush();  // a failure completes the ops with errors
    }
  }
  next_down_check_ = DeadlineIn(kDownCheckInterval);
}

bool ChannelSet::AnyOutstanding() const {
  return std::any_of(channels_.begin(), channels_.end(),
                     [](const auto& ch) { return ch && ch->outstanding() > 0; });
}

ChannelSet::Waited ChannelSet::WaitAny(Deadline deadline) {
  Waited w;
  down_.clear();
  if (Clock::now() >= next_down_check_) {
    next_down_check_ = DeadlineIn(kDownCheckInterval);
    DropDown();
    if (!down_.empty()) {
      w.down = down_;
      return w;
    }
  }
  size_t outstanding = 0;
  for (const auto& ch : channels_) {
    if (ch) outstanding += ch->outstanding();
  }
  if (outstanding == 0) {
    w.idle = true;
    return w;
  }
  // Room for every completion that can come (a tcp channel hands out all of a reply frame's).
  if (comps_.size() < outstanding) comps_.resize(outstanding);
  const std::span<transport::Completion> comps(comps_);
  size_t got = 0;
  pfds_.clear();
  pfd_nodes_.clear();
  for (NodeId n = 0; n < channels_.size(); ++n) {
    auto& ch = channels_[n];
    if (!ch || ch->outstanding() == 0) continue;
    // A channel whose fd turning readable is exactly "a reply is there" (tcp) is left to the one
    // poll(2) below instead of probing every socket with a recv first (that probe was about a
    // quarter of the system calls of an ec:4+2 batch). Other channels (verbs: a completion may
    // land before the event fd is armed; fault-injected; broken ones) are reaped first.
    if (ch->wait_fd() >= 0 && ch->fd_readiness_is_exact()) {
      pfds_.push_back({ch->wait_fd(), POLLIN, 0});
      pfd_nodes_.push_back(n);
      continue;
    }
    auto r = ch->Poll(comps.subspan(got), std::chrono::milliseconds(0));
    if (r && *r > 0) {
      got += *r;
      continue;
    }
    pfds_.push_back({ch->wait_fd(), POLLIN, 0});
    pfd_nodes_.push_back(n);
  }
  if (got > 0 || pfds_.empty()) {
    w.completions = comps.first(got);
    return w;
  }
  // One slice: to the deadline or the next down check, whichever is first.
  const bool pollable =
      std::all_of(pfds_.begin(), pfds_.end(), [](const pollfd& p) { return p.fd >= 0; });
  // A reply that comes while spinning is taken without this thread having slept.
  const bool spun = pollable && spin_.budget().count() > 0 && pfds_.size() == 1 &&
                    flushed_ops_ <= kBusyPollMaxOps &&
                    SpinPoll(std::min(deadline, next_down_check_)) > 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(
      std::min(deadline, next_down_check_) - Clock::now());
  if (spun) {
    // pfds_[0].revents is set: reaped below.
  } else if (pollable) {
    // Past the deadline, still look (without waiting) before giving up: if this thread was held
    // up (descheduled, a slow caller) the replies may have been waiting here all along, and a
    // daemon that answered in time must not be blamed for our own stall.
    const int rc =
        ::poll(pfds_.data(), pfds_.size(), static_cast<int>(std::max<int64_t>(0, left.count())));
    if (rc <= 0) {  // the slice ended (or a signal came): the caller calls again
      w.deadline = rc == 0 && Clock::now() >= deadline;
      return w;
    }
  } else if (left.count() <= 0) {
    // The channels without a pollable fd were reaped (without waiting) above.
    w.deadline = Clock::now() >= deadline;
    return w;
  }
  for (size_t i = 0; i < pfds_.size(); ++i) {
    if (pollable && pfds_[i].revents == 0) continue;
    auto& ch = channels_[pfd_nodes_[i]];
    // The reply has begun to arrive: receiving the rest of it may take up to the operation
    // timeout. (A fixed value: a channel sets its socket's receive timeout only when it changes.)
    // Without a pollable fd: a zero-timeout Poll, spinning until the slice ends.
    auto r = ch->Poll(comps.subspan(got), pollable ? op_timeout_ : std::chrono::milliseconds(0));
    if (r) got += *r;
  }
  w.completions = comps.first(got);
  return w;
}

int ChannelSet::SpinPoll(Deadline limit) {
  // poll(2)'s error ends the spin without a backoff: the blocking poll after it reports it.
  const int rc = spin_.Spin([&] { return ::poll(pfds_.data(), pfds_.size(), 0); }, limit);
  return std::max(rc, 0);
}

void ChannelSet::DropDown() {
  for (NodeId n = 0; n < channels_.size(); ++n) {
    auto& ch = channels_[n];
    if (!ch || ch->outstanding() == 0 || cluster_->alive(n)) continue;
    down_.push_back(n);
    ch.reset();
  }
}

void ChannelSet::ResetStuck() {
  for (auto& ch : channels_) {
    if (ch && ch->outstanding() > 0) ch.reset();  // its buffers are ours; nothing can land now
  }
}

void ChannelSet::DrainStragglers() {
  const Deadline deadline = DeadlineIn(op_timeout_);
  next_down_check_ = DeadlineIn(kDownCheckInterval);
  for (;;) {
    // Stragglers on a daemon declared down are dropped by WaitAny: not worth waiting for.
    const Waited w = WaitAny(deadline);
    if (w.idle) return;
    if (w.deadline) {
      ResetStuck();
      return;
    }
  }
}

Status ChannelSet::DeclaredDown(NodeId node) const {
  const NodeInfo info = cluster_->node(node);
  return Unavailable(fmt::format("daemon {} was declared down while the op was in flight ({})",
                                 info.endpoint.ToString(), info.last_error.ToString()));
}

Status ChannelSet::NoAnswer(NodeId node, bool dropped) const {
  const std::string ep = cluster_->node(node).endpoint.ToString();
  if (dropped) return Unavailable(fmt::format("the channel to daemon {} was dropped", ep));
  return DeadlineExceeded(fmt::format("daemon {} did not answer in time", ep));
}

bool ChannelSet::DropIfStale(NodeId node) {
  if (node >= channels_.size() || !channels_[node] || !channels_[node]->broken()) return false;
  const uint64_t current = cluster_->node(node).daemon_id;
  if (current == 0 || current == channel_daemon_[node]) return false;
  channels_[node].reset();
  return true;
}

}  // namespace farmem::client
