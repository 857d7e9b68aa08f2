// FakeFabric (fake_fabric.h): in-process daemons, and data channels that serve their slabs from
// memory under a script of faults.
#include "support/fake_fabric.h"

#include <fmt/format.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>

#include "farmem/common/auth.h"
#include "server.h"
#include "slab_pool.h"

namespace farmem::testing {

namespace {

using SteadyClock = std::chrono::steady_clock;

class FakeChannel;

enum class Action { kPass, kFail, kDropReply, kBreak, kStall };

struct Rule {
  Action action = Action::kPass;
  Status status;
  std::function<void()> hook;
};

// A rule for the first op that `match` accepts (FailFirst, DropReplyFirst, AtFirst).
struct MatchRule {
  FakeFabric::OpMatch match;
  Action action = Action::kPass;
  Status status;
  std::function<void(size_t node)> hook;
};

}  // namespace

struct FakeFabric::State {
  struct Node {
    uint16_t port = 0;
    std::unique_ptr<daemon::SlabPool> pool;
    std::unique_ptr<daemon::Server> server;
    bool alive = false;
    uint64_t incarnation = 0;  // bumped by Kill and Restart: older channels are dead
    // The incarnation ops may be served on (0: none); read by Apply without `mu`.
    std::atomic<uint64_t> serving_incarnation{0};
    uint64_t ops = 0, writes = 0;
    std::map<uint64_t, Rule> rules;  // by op number
    uint64_t stall_from = 0;         // 0: no stall
    std::set<FakeChannel*> channels;
    // Held shared while an op touches the pool's memory; Kill takes it exclusively before the
    // pool goes away.
    std::shared_mutex serving;
  };

  FakeFabricConfig config;
  mutable std::mutex mu;  // before any channel's mutex
  std::vector<std::unique_ptr<Node>> nodes;
  std::vector<MatchRule> match_rules;  // in the order made; each fires once

  Status StartNode(size_t i);
  void KillNode(size_t i);
  std::optional<size_t> NodeOf(const Endpoint& ep) const;
  // Reads or writes the op's bytes on node i's pool (incarnation `inc`).
  Status Apply(size_t i, uint64_t inc, const wire::ClientId& owner, const transport::Op& op);
};

namespace {

class FakeChannel final : public transport::Channel {
 public:
  FakeChannel(std::shared_ptr<FakeFabric::State> fabric, size_t node, uint64_t incarnation,
              const transport::ChannelOptions& o)
      : fabric_(std::move(fabric)),
        node_(node),
        incarnation_(incarnation),
        // The owner the daemon binds leases to (as its handshake computes it).
        owner_(auth::LeaseOwner(auth::CanonicalIdentity(o.credentials.identity),
                                o.credentials.client_id)),
        peer_(o.endpoint.ToString()),
        op_timeout_(o.op_timeout),
        max_outstanding_(o.max_outstanding),
        efd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

  ~FakeChannel() override {
    {
      std::lock_guard lock(fabric_->mu);
      fabric_->nodes[node_]->channels.erase(this);
    }
    if (efd_ >= 0) ::close(efd_);
  }

  Status Post(const transport::Op& op) override {
    std::lock_guard lock(mu_);
    if (broken_) return Unavailable(fmt::format("fake channel to {} is broken", peer_));
    if (op.local == nullptr || op.length == 0) {
      return InvalidArgument("fake channel: an op needs a buffer and a length");
    }
    if (OutstandingLocked() >= max_outstanding_) {
      return ResourceExhausted(
          fmt::format("fake channel to {}: {} ops in flight", peer_, max_outstanding_));
    }
    queued_.push_back(op);
    return Status::Ok();
  }

  Status Flush() override {
    std::vector<transport::Op> ops;
    {
      std::lock_guard lock(mu_);
      ops.swap(queued_);
      if (!ops.empty()) ++stats_.doorbells;
    }
    for (const transport::Op& op : ops) Serve(op);
    return Status::Ok();
  }

  Result<size_t> Poll(std::span<transport::Completion> out,
                      std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    ExpireHeldLocked();
    if (done_.empty() && timeout.count() > 0 && OutstandingLocked() > 0) {
      cv_.wait_for(lock, timeout, [&] { return !done_.empty(); });
      ExpireHeldLocked();
    }
    size_t n = 0;
    while (n < out.size() && !done_.empty()) {
      out[n++] = std::move(done_.front());
      done_.pop_front();
    }
    if (done_.empty() && efd_ >= 0) {
      uint64_t v;
      (void)!::read(efd_, &v, sizeof v);
    }
    return n;
  }

  size_t outstanding() const override {
    std::lock_guard lock(mu_);
    return OutstandingLocked();
  }
  size_t max_outstanding() const override { return max_outstanding_; }
  const char* kind() const override { return "fake"; }
  std::string peer() const override { return peer_; }
  bool broken() const override {
    std::lock_guard lock(mu_);
    return broken_;
  }
  transport::ChannelStats stats() const override {
    std::lock_guard lock(mu_);
    return stats_;
  }
  int wait_fd() const override { return efd_; }
  // Held ops time out only when looked at (Poll), so a waiter reaps before it waits.
  bool fd_readiness_is_exact() const override { return false; }

  // Breaks the channel: everything queued, held or in flight completes with `why`.
  void BreakWith(const Status& why) {
    std::lock_guard lock(mu_);
    BreakLocked(why);
  }
  // The ops held by a stall, served now (fabric mu held: the channel stays alive meanwhile).
  void ServeHeld() {
    std::vector<transport::Op> ops;
    {
      std::lock_guard lock(mu_);
      for (auto it = held_.begin(); it != held_.end();) {
        if (it->applied) {
          ++it;
          continue;
        }
        ops.push_back(it->op);
        it = held_.erase(it);
      }
    }
    for (const transport::Op& op : ops) {
      Complete(op, fabric_->Apply(node_, incarnation_, owner_, op));
    }
  }

 private:
  struct Held {
    transport::Op op;
    SteadyClock::time_point since;
    bool applied = false;  // DropReply: it took effect, its reply never comes
  };

  void Serve(const transport::Op& op) {
    Rule rule;
    bool dead = false;
    {
      std::lock_guard lock(fabric_->mu);
      FakeFabric::State::Node& n = *fabric_->nodes[node_];
      dead = !n.alive || n.incarnation != incarnation_;
      if (!dead) {
        const uint64_t number = ++n.ops;
        if (op.type == transport::OpType::kWrite) ++n.writes;
        auto& pending = fabric_->match_rules;
        auto match = std::find_if(pending.begin(), pending.end(),
                                  [&](const MatchRule& r) { return r.match(node_, op); });
        if (match != pending.end()) {
          rule.action = match->action;
          rule.status = std::move(match->status);
          if (match->hook) {
            rule.hook = [hook = std::move(match->hook), node = node_] { hook(node); };
          }
          pending.erase(match);
        } else if (auto it = n.rules.find(number); it != n.rules.end()) {
          rule = std::move(it->second);
          n.rules.erase(it);
        }
        if (rule.action == Action::kPass && n.stall_from != 0 && number >= n.stall_from) {
          rule.action = Action::kStall;
        }
      }
    }
    if (rule.hook) rule.hook();  // no lock held: it may Kill, Restart, script
    switch (dead ? Action::kBreak : rule.action) {
      case Action::kPass:
        Complete(op, fabric_->Apply(node_, incarnation_, owner_, op));
        return;
      case Action::kFail:
        Complete(op, rule.status);
        return;
      case Action::kBreak: {
        std::lock_guard lock(mu_);
        held_.push_back({op, SteadyClock::now(), false});  // completes with the rest
        BreakLocked(Unavailable(fmt::format("fake channel to {}: connection reset{}", peer_,
                                            dead ? " (the daemon is gone)" : " (scripted)")));
        return;
      }
      case Action::kDropReply:
        (void)fabric_->Apply(node_, incarnation_, owner_, op);  // takes effect; no reply comes
        Hold(op, /*applied=*/true);
        return;
      case Action::kStall:
        Hold(op, /*applied=*/false);
        return;
    }
  }

  // Keeps the op unanswered (until a Resume, a break or its timeout), or fails it at once if the
  // channel is already broken.
  void Hold(const transport::Op& op, bool applied) {
    std::lock_guard lock(mu_);
    if (broken_) {
      done_.push_back({op.user_data, Unavailable("fake channel broke")});
      Signal();
    } else {
      held_.push_back({op, SteadyClock::now(), applied});
    }
  }

  void Complete(const transport::Op& op, Status status) {
    std::lock_guard lock(mu_);
    if (broken_ && status.ok()) status = Unavailable("fake channel broke");
    if (status.ok()) {
      ++stats_.ops;
      (op.type == transport::OpType::kRead ? stats_.bytes_read : stats_.bytes_written) += op.length;
    }
    done_.push_back({op.user_data, std::move(status)});
    Signal();
  }

  void ExpireHeldLocked() {
    const auto now = SteadyClock::now();
    for (const Held& h : held_) {
      if (now - h.since >= op_timeout_) {
        BreakLocked(DeadlineExceeded(
            fmt::format("fake channel to {}: no reply within {} ms", peer_, op_timeout_.count())));
        return;
      }
    }
  }

  void BreakLocked(const Status& why) {
    broken_ = true;
    for (const transport::Op& op : queued_) done_.push_back({op.user_data, why});
    for (const Held& h : held_) done_.push_back({h.op.user_data, why});
    queued_.clear();
    held_.clear();
    Signal();
  }

  void Signal() {
    cv_.notify_all();
    if (efd_ >= 0 && !done_.empty()) {
      const uint64_t one = 1;
      (void)!::write(efd_, &one, sizeof one);
    }
  }

  size_t OutstandingLocked() const { return queued_.size() + held_.size() + done_.size(); }

  const std::shared_ptr<FakeFabric::State> fabric_;
  const size_t node_;
  const uint64_t incarnation_;
  const wire::ClientId owner_;
  const std::string peer_;
  const std::chrono::milliseconds op_timeout_;
  const size_t max_outstanding_;
  const int efd_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<transport::Op> queued_;
  std::vector<Held> held_;
  std::deque<transport::Completion> done_;
  bool broken_ = false;
  transport::ChannelStats stats_;
};

class FakeTransport final : public transport::Transport {
 public:
  explicit FakeTransport(std::shared_ptr<FakeFabric::State> fabric)
      : fabric_(std::move(fabric)), tcp_(transport::MakeTcpTransport()) {}
  const char* kind() const override { return "fake"; }

  Result<std::unique_ptr<transport::Channel>> OpenChannel(
      const transport::ChannelOptions& o) override {
    std::lock_guard lock(fabric_->mu);
    auto i = fabric_->NodeOf(o.endpoint);
    if (!i) return Err(NotFound(fmt::format("fake fabric: no node at {}", o.endpoint.ToString())));
    FakeFabric::State::Node& n = *fabric_->nodes[*i];
    if (!n.alive) {
      return Err(Unavailable(
          fmt::format("fake fabric: connecting to {}: connection refused", o.endpoint.ToString())));
    }
    auto ch = std::make_unique<FakeChannel>(fabric_, *i, n.incarnation, o);
    n.channels.insert(ch.get());
    return std::unique_ptr<transport::Channel>(std::move(ch));
  }

  Result<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr,
                                                                 size_t length) override {
    return tcp_->RegisterMemory(addr, length);  // plain memory, as on tcp
  }

 private:
  std::shared_ptr<FakeFabric::State> fabric_;
  std::unique_ptr<transport::Transport> tcp_;
};

}  // namespace

Status FakeFabric::State::StartNode(size_t i) {
  Node& n = *nodes[i];
  daemon::PoolOptions po;
  po.capacity = config.capacity;
  po.slab_size = config.slab_size;
  po.lease_ttl = config.lease_ttl;
  po.mlock = false;
  po.prefault = false;
  po.max_client_share = {.fraction = 1.0, .bytes = 0, .text = "1"};
  auto pool = daemon::SlabPool::Create(po);
  if (!pool) return pool.error().WithContext(fmt::format("fake node {}", i));
  daemon::ServerOptions so;
  so.listen = {"127.0.0.1", n.port};
  so.secret = config.secret;
  so.rdma = daemon::RdmaMode::kOff;
  so.batch_scheduling = false;
  auto server = std::make_unique<daemon::Server>(so, pool->get());
  if (Status s = server->Start(); !s.ok()) {
    return s.WithContext(fmt::format("fake node {} on port {}", i, n.port));
  }
  std::unique_lock serving(n.serving);
  std::lock_guard lock(mu);
  n.port = server->port();
  n.pool = std::move(*pool);
  n.server = std::move(server);
  n.alive = true;
  n.serving_incarnation = ++n.incarnation;
  return Status::Ok();
}

void FakeFabric::State::KillNode(size_t i) {
  Node& n = *nodes[i];
  {
    std::lock_guard lock(mu);
    if (!n.alive) return;
    n.alive = false;
    ++n.incarnation;
    n.serving_incarnation = 0;
    for (FakeChannel* c : n.channels) {
      c->BreakWith(Unavailable(fmt::format("fake channel to node {}: the daemon died", i)));
    }
  }
  // No op touches the pool from here on (they check the incarnation under `serving`).
  std::unique_lock serving(n.serving);
  n.server->Stop();
  n.server.reset();
  n.pool.reset();
}

std::optional<size_t> FakeFabric::State::NodeOf(const Endpoint& ep) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (ep.port == nodes[i]->port && (ep.host == "127.0.0.1" || ep.host == "localhost")) return i;
  }
  return std::nullopt;
}

Status FakeFabric::State::Apply(size_t i, uint64_t inc, const wire::ClientId& owner,
                                const transport::Op& op) {
  Node& n = *nodes[i];
  std::shared_lock serving(n.serving);  // not `mu`: Resume serves held ops with it held
  if (n.serving_incarnation.load() != inc || !n.pool) {
    return Unavailable(fmt::format("fake node {}: the daemon is gone", i));
  }
  auto pin = n.pool->Acquire(op.slab.lease_id, owner, op.offset, op.length);
  if (!pin) return pin.error();
  uint8_t* remote = pin->data() + op.offset;
  if (op.type == transport::OpType::kRead) {
    std::memcpy(op.local, remote, op.length);
  } else {
    std::memcpy(remote, op.local, op.length);
  }
  return Status::Ok();
}

FakeFabric::FakeFabric(FakeFabricConfig config) : state_(std::make_shared<State>()) {
  state_->config = std::move(config);
  for (size_t i = 0; i < state_->config.nodes; ++i) {
    state_->nodes.push_back(std::make_unique<State::Node>());
  }
}

FakeFabric::~FakeFabric() {
  for (size_t i = 0; i < state_->nodes.size(); ++i) state_->KillNode(i);
}

Status FakeFabric::Start() {
  for (size_t i = 0; i < state_->nodes.size(); ++i) {
    FARMEM_RETURN_IF_ERROR(state_->StartNode(i));
  }
  return Status::Ok();
}

size_t FakeFabric::size() const { return state_->nodes.size(); }

std::vector<Endpoint> FakeFabric::endpoints() const {
  std::lock_guard lock(state_->mu);
  std::vector<Endpoint> eps;
  for (const auto& n : state_->nodes) eps.push_back({"127.0.0.1", n->port});
  return eps;
}

const std::string& FakeFabric::secret() const { return state_->config.secret; }

std::shared_ptr<transport::Transport> FakeFabric::transport() const {
  return std::make_shared<FakeTransport>(state_);
}

client::ClusterOptions FakeFabric::ClusterOptionsForTest() const {
  client::ClusterOptions o;
  o.peers = endpoints();
  o.secret = secret();
  o.data_transport = transport();
  o.heartbeat_interval = std::chrono::milliseconds(50);
  o.failure_timeout = std::chrono::milliseconds(500);
  o.reconnect_interval = std::chrono::milliseconds(50);
  o.connect_timeout = std::chrono::milliseconds(500);
  o.op_timeout = std::chrono::milliseconds(2000);
  o.rng_seed = 1;
  return o;
}

void FakeFabric::Kill(size_t i) { state_->KillNode(i); }

Status FakeFabric::Restart(size_t i) {
  state_->KillNode(i);
  return state_->StartNode(i);
}

bool FakeFabric::alive(size_t i) const {
  std::lock_guard lock(state_->mu);
  return state_->nodes[i]->alive;
}

void FakeFabric::Fail(size_t i, uint64_t n, Status status) {
  std::lock_guard lock(state_->mu);
  state_->nodes[i]->rules[n] = {Action::kFail, std::move(status), nullptr};
}

void FakeFabric::DropReply(size_t i, uint64_t n) {
  std::lock_guard lock(state_->mu);
  state_->nodes[i]->rules[n] = {Action::kDropReply, Status::Ok(), nullptr};
}

void FakeFabric::Break(size_t i, uint64_t n) {
  std::lock_guard lock(state_->mu);
  state_->nodes[i]->rules[n] = {Action::kBreak, Status::Ok(), nullptr};
}

void FakeFabric::Stall(size_t i, uint64_t n) {
  std::lock_guard lock(state_->mu);
  state_->nodes[i]->stall_from = n;
}

void FakeFabric::At(size_t i, uint64_t n, std::function<void()> fn) {
  std::lock_guard lock(state_->mu);
  Rule& r = state_->nodes[i]->rules[n];
  r.hook = std::move(fn);
}

void FakeFabric::FailFirst(OpMatch match, Status status) {
  std::lock_guard lock(state_->mu);
  state_->match_rules.push_back({std::move(match), Action::kFail, std::move(status), nullptr});
}

void FakeFabric::DropReplyFirst(OpMatch match) {
  std::lock_guard lock(state_->mu);
  state_->match_rules.push_back({std::move(match), Action::kDropReply, Status::Ok(), nullptr});
}

void FakeFabric::AtFirst(OpMatch match, std::function<void(size_t node)> fn) {
  std::lock_guard lock(state_->mu);
  state_->match_rules.push_back({std::move(match), Action::kPass, Status::Ok(), std::move(fn)});
}

void FakeFabric::Resume(size_t i) {
  std::lock_guard lock(state_->mu);
  State::Node& n = *state_->nodes[i];
  n.stall_from = 0;
  for (FakeChannel* c : n.channels) c->ServeHeld();
}

void FakeFabric::ClearScript(size_t i) {
  std::lock_guard lock(state_->mu);
  state_->nodes[i]->rules.clear();
  state_->nodes[i]->stall_from = 0;
}

uint64_t FakeFabric::ops(size_t i) const {
  std::lock_guard lock(state_->mu);
  return state_->nodes[i]->ops;
}

uint64_t FakeFabric::writes(size_t i) const {
  std::lock_guard lock(state_->mu);
  return state_->nodes[i]->writes;
}

}  // namespace farmem::testing
