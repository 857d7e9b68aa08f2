// ChannelSet: one thread's data channels to the daemons, by node, and the one place where a
// borrower waits on many of them at once.
//
// A borrower's I/O (a page-store round over k + r members, a far_ptr span set) posts operations
// to several daemons, rings each daemon's doorbell once (FlushAll), and then takes completions
// from whichever daemon answers first (WaitAny) until a deadline:
//   - channels whose fd readiness is exact (tcp) are left to one poll(2) over all their fds;
//     the others (verbs, fault-injected) are reaped with a zero-timeout Poll first, and when one
//     of them has no fd at all the wait spins on zero-timeout Polls instead of poll(2). A channel
//     is never polled with a timeout of its own while nothing has arrived: a tcp channel whose
//     receive times out is broken, and a slow but healthy daemon must not be failed that way.
//   - the wait is cut in slices of client::kDownCheckInterval, due by the clock (not when a wait
//     times out: a spin returns at once, and a slice renewed on every return would never end).
//     At the end of a slice, channels with operations in flight to a daemon the cluster has
//     declared down (a gray failure: SIGSTOP, a partition) are dropped and their nodes returned,
//     so the caller fails those operations now instead of waiting out the op timeout; nothing
//     can land in the caller's buffers afterwards.
//   - past the deadline, the fds are still looked at once (without waiting) before the wait gives
//     up: replies that waited while this thread was held up must not be blamed on the daemon.
//   - optionally (SetBusyPoll), a wait on a single tcp daemon first spins for a bounded time
//     (zero-timeout poll(2) and sched_yield) before it sleeps: a depth-1 request's reply usually
//     comes within tens of µs, and a thread that slept must be woken, which on a VM with idle
//     vCPUs halted costs an IPI to the host. The spin yields, so a daemon woken onto this CPU
//     still runs; it is off while several daemons are awaited or the batch flushed more than
//     kBusyPollMaxOps ops (a deep queue keeps the CPUs busy anyway, and there a spinning thread
//     takes CPU from the daemons it waits for). The spin's policy (when it ends, how it backs
//     off where replies take longer than the budget or the CPUs are busy) is AdaptiveSpin's.
//
// RunBatch is the whole of that for one batch (post, flush, wait, fail what a down daemon or the
// deadline leaves): the page store's rounds and member copies and far_ptr's span-set I/O run on it.
//
// Channels are opened lazily through client::Cluster::EnsureChannel, and replaced when broken or
// opened to an earlier incarnation of the daemon (it restarted on the same address).
//
// Threads: a ChannelSet belongs to one thread at a time, like the channels it holds.
#pragma once

#include <poll.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/adaptive_spin.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"
#include "farmem/transport/transport.h"

namespace farmem::client {

// One operation of a batch (ChannelSet::RunBatch): the daemon it goes to, the op, and whether its
// outcome was handed out. A caller's own op type works too if it has these three members.
struct BatchOp {
  NodeId node = 0;
  transport::Op op;
  bool done = false;
};

class ChannelSet {
 public:
  // `op_timeout`: the longest one reply may take to arrive once it has begun to (and the longest
  // DrainStragglers waits). `completions`: how many completions one WaitAny hands out at most
  // (it grows to what is outstanding).
  ChannelSet(Cluster* cluster, std::chrono::milliseconds op_timeout, size_t completions = 256);
  ChannelSet(const ChannelSet&) = delete;
  ChannelSet& operator=(const ChannelSet&) = delete;

  // Sizes the scratch for `nodes` daemons up front (no allocation on the request path after).
  void Reserve(size_t nodes);
  // How long a wait on one daemon's tcp channel spins before it sleeps (0: never, the default).
  // At most kMaxBusyPoll. Starts afresh: no backoff from earlier spins. The policy (yield,
  // busy-CPU exit, backoff) is AdaptiveSpin's.
  static constexpr std::chrono::microseconds kMaxBusyPoll = AdaptiveSpin::kMaxBudget;
  // Only a shallow batch spins: at most this many ops outstanding when it was flushed.
  static constexpr size_t kBusyPollMaxOps = 2;
  void SetBusyPoll(std::chrono::microseconds budget) { spin_.set_budget(budget); }
  // Waits that spun (SetBusyPoll), of those the ones whose reply came while spinning, and waits
  // that slept without spinning because earlier spins ran out (the backoff above).
  using BusyPollStats = AdaptiveSpin::Stats;
  BusyPollStats busy_poll_stats() const { return spin_.stats(); }

  // The channel to `node`, opened or reopened as needed; nullptr (and *error) when it cannot be
  // had (the node is down, the open failed).
  transport::Channel* Get(NodeId node, Status* error);
  // Posts `op` on the channel to `node`. Not OK: nothing was posted (no channel, window full,
  // malformed op); the op will not complete.
  Status Post(NodeId node, const transport::Op& op);
  // Rings the doorbell of every channel with operations posted (a failure completes them with
  // errors), and starts the down-check clock of the wait that follows.
  void FlushAll();
  bool AnyOutstanding() const;

  // What one WaitAny saw. The spans are the set's own, valid until its next call.
  struct Waited {
    // Reaped completions (a channel that broke completes its operations with errors).
    std::span<const transport::Completion> completions;
    // Nodes declared down whose channels were dropped with operations outstanding: those will
    // never complete, the caller fails them.
    std::span<const NodeId> down;
    bool idle = false;      // nothing is outstanding
    bool deadline = false;  // `deadline` passed with operations outstanding, none reaped
  };
  // Waits until some channel has completions, a slice ends (then looks for down nodes), or the
  // deadline passes. Called in a loop until the caller has what it waits for; an empty result
  // (no completions, no down nodes, not idle, not deadline) is the end of a slice.
  Waited WaitAny(Deadline deadline);

  // Runs one batch to its end. Posts ops[i].op to ops[i].node (as user_data i), rings the
  // doorbells, and hands each op's outcome to on_done(i, status) exactly once, marking it done:
  // its completion; the Post error if it could not be posted; Unavailable if its daemon was
  // declared down while it was in flight; DeadlineExceeded if `deadline` passed first, or
  // Unavailable if its channel was dropped (those two end the batch and ResetStuck: nothing lands
  // in the ops' buffers afterwards). Waits until every op is done or enough() says the caller has
  // what it needs (asked before every wait; ops left outstanding then are stragglers, see
  // DrainStragglers). Op is BatchOp or a type with the same members.
  template <typename Op, typename OnDone, typename Enough>
  void RunBatch(std::span<Op> ops, Deadline deadline, OnDone&& on_done, Enough&& enough);
  template <typename Op, typename OnDone>
  void RunBatch(std::span<Op> ops, Deadline deadline, OnDone&& on_done) {
    RunBatch(ops, deadline, on_done, [] { return false; });
  }

  // Drops the channels that still have operations outstanding: their buffers are the caller's
  // again, nothing can land in them now.
  void ResetStuck();
  // Reaps, and discards, whatever is still outstanding (ops nobody waits for any more, such as
  // an ec read's slowest fragments), so that their buffers can be reused; up to op_timeout, and
  // not for daemons declared down; what is left then is dropped.
  void DrainStragglers();
  // True if a failure seen on the channel to `node` was the channel's own: it was opened to an
  // earlier incarnation of the daemon (which restarted since) and broke. That says nothing of
  // what lives on the daemon there now; the channel is dropped, so a retry reopens it.
  bool DropIfStale(NodeId node);

 private:
  // Drops the channels with operations outstanding to daemons the cluster has declared down;
  // their nodes go to down_.
  void DropDown();
  // RunBatch's outcomes for an op that never completed on `node`.
  Status DeclaredDown(NodeId node) const;
  Status NoAnswer(NodeId node, bool dropped) const;
  // The bounded spin before a blocking poll(2) of pfds_ (see SetBusyPoll): poll(2)'s result,
  // 0 if nothing came by `limit` or the budget's end.
  int SpinPoll(Deadline limit);

  Cluster* const cluster_;
  const std::chrono::milliseconds op_timeout_;
  std::vector<std::unique_ptr<transport::Channel>> channels_;  // by NodeId
  std::vector<uint64_t> channel_daemon_;  // by NodeId: the daemon (HELLO node id) it was opened to
  std::vector<transport::Completion> comps_;
  std::vector<pollfd> pfds_;
  std::vector<NodeId> pfd_nodes_;
  std::vector<NodeId> down_;
  Deadline next_down_check_{};
  size_t flushed_ops_ = 0;  // ops outstanding at the last FlushAll
  AdaptiveSpin spin_;       // SetBusyPoll's
};

template <typename Op, typename OnDone, typename Enough>
void ChannelSet::RunBatch(std::span<Op> ops, Deadline deadline, OnDone&& on_done, Enough&& enough) {
  size_t left = ops.size();
  auto finish = [&](size_t i, const Status& s) {
    if (i >= ops.size() || ops[i].done) return;
    ops[i].done = true;
    --left;
    on_done(i, s);
  };
  for (Op& o : ops) o.done = false;
  for (size_t i = 0; i < ops.size(); ++i) {
    transport::Op op = ops[i].op;
    op.user_data = i;
    if (Status s = Post(ops[i].node, op); !s.ok()) finish(i, s);
  }
  FlushAll();  // a failure completes the ops with errors
  while (left > 0 && !enough()) {
    const Waited got = WaitAny(deadline);
    for (const transport::Completion& c : got.completions) {
      finish(static_cast<size_t>(c.user_data), c.status);
    }
    // A gray failure (a daemon paused or cut off with its sockets open) breaks nothing: once the
    // cluster has declared such a daemon down, the ops still waiting on it end here, and the set
    // dropped their channel: nothing may land in their buffers afterwards.
    for (NodeId n : got.down) {
      for (size_t i = 0; i < ops.size(); ++i) {
        if (!ops[i].done && ops[i].node == n) finish(i, DeclaredDown(n));
      }
    }
    if (got.deadline || got.idle) {
      for (size_t i = 0; i < ops.size(); ++i) {
        if (!ops[i].done) finish(i, NoAnswer(ops[i].node, got.idle));
      }
      ResetStuck();
      return;
    }
  }
}

}  // namespace farmem::client
