// ChannelSet against real farmemd processes, with and without the fault injector: every op posted
// comes back through WaitAny; one held daemon does not hold the others' completions; a daemon
// declared down while ops wait on it is reported before the deadline (the down check is due by
// the clock, also when the set spins on channels whose fd readiness is not exact); the deadline
// ends a wait on a daemon that never answers; a channel to an earlier incarnation of a daemon is
// told apart (DropIfStale); RunBatch hands every op's outcome out exactly once, whatever ended it.
#include "farmem/client/channel_set.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <vector>

#include "cluster_timers.h"
#include "farmem/transport/fault_injection.h"
#include "support/daemon_fixture.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;
using testing::DaemonConfig;
using testing::DaemonSet;

using test::kFailureTimeout;
using test::kHeartbeat;
constexpr milliseconds kOpTimeout{20000};  // far beyond failure detection: only it ends a wait
constexpr size_t kLen = 4096;

struct Fixture {
  DaemonSet daemons{DaemonConfig{.capacity = "4M", .slab_size = "1M"}};
  std::shared_ptr<transport::FaultInjector> faults;
  std::unique_ptr<Cluster> cluster;
  std::vector<Lease> leases;  // one per daemon, leases[i] on node i

  // `injector`: wrap every data channel (their kind() is then "fault-injected": the set reaps
  // them with zero-timeout Polls instead of going straight to poll(2)).
  void Start(bool injector, milliseconds channel_op_timeout = kOpTimeout) {
    ASSERT_TRUE(daemons.Start(3).ok()) << daemons.Logs();
    ClusterOptions o;
    o.peers = daemons.endpoints();
    o.secret = daemons.secret();
    o.client_name = "channel-set-test";
    o.heartbeat_interval = kHeartbeat;
    o.failure_timeout = kFailureTimeout;
    o.connect_timeout = milliseconds(5000);
    o.op_timeout = channel_op_timeout;
    o.reconnect_interval = 2 * kHeartbeat;
    if (injector) {
      faults = std::make_shared<transport::FaultInjector>();
      o.fault_injector = faults;
    }
    auto c = Cluster::Connect(o);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    cluster = std::move(*c);
    auto group = cluster->AllocateGroup(3);
    ASSERT_TRUE(group.has_value()) << group.error().ToString();
    leases.resize(3);
    for (const Lease& l : *group) leases[l.node] = l;
  }

  // Opens `set`'s channel to every daemon.
  void OpenAll(ChannelSet& set) {
    for (NodeId n = 0; n < 3; ++n) {
      Status error;
      ASSERT_NE(set.Get(n, &error), nullptr) << error.ToString();
    }
  }

  transport::Op OpOn(NodeId node, transport::OpType type, uint8_t* buf, uint64_t user_data) {
    return {type, leases[node].slab(), 0, buf, kLen, nullptr, user_data};
  }
};

// Waits (WaitAny in a loop) until `want` completions arrived, a node is reported down, or the
// deadline: what a borrower's wait loop does.
struct Outcome {
  std::vector<transport::Completion> completions;
  std::vector<NodeId> down;
  bool deadline = false;
  bool idle = false;
};
Outcome WaitFor(ChannelSet& set, size_t want, Deadline deadline, bool stop_on_down = true) {
  Outcome out;
  while (out.completions.size() < want) {
    const ChannelSet::Waited w = set.WaitAny(deadline);
    out.completions.insert(out.completions.end(), w.completions.begin(), w.completions.end());
    out.down.insert(out.down.end(), w.down.begin(), w.down.end());
    if (w.deadline || w.idle || (stop_on_down && !w.down.empty())) {
      out.deadline = w.deadline;
      out.idle = w.idle;
      break;
    }
  }
  return out;
}

void RoundTrip(bool injector) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(injector));
  ChannelSet set(f.cluster.get(), kOpTimeout, /*completions=*/2);  // grows to what is outstanding
  set.Reserve(3);
  std::vector<std::vector<uint8_t>> out(3, std::vector<uint8_t>(kLen));
  std::vector<std::vector<uint8_t>> in(3, std::vector<uint8_t>(kLen));
  for (NodeId n = 0; n < 3; ++n) {
    std::memset(out[n].data(), 0x40 + static_cast<int>(n), kLen);
    ASSERT_TRUE(set.Post(n, f.OpOn(n, transport::OpType::kWrite, out[n].data(), n)).ok());
  }
  EXPECT_TRUE(set.AnyOutstanding());
  set.FlushAll();
  Outcome w = WaitFor(set, 3, DeadlineIn(kOpTimeout));
  ASSERT_EQ(w.completions.size(), 3u);
  for (const transport::Completion& c : w.completions)
    EXPECT_TRUE(c.status.ok()) << c.status.ToString();
  EXPECT_FALSE(set.AnyOutstanding());
  EXPECT_TRUE(set.WaitAny(DeadlineIn(kOpTimeout)).idle);

  for (NodeId n = 0; n < 3; ++n) {
    ASSERT_TRUE(set.Post(n, f.OpOn(n, transport::OpType::kRead, in[n].data(), 10 + n)).ok());
  }
  set.FlushAll();
  w = WaitFor(set, 3, DeadlineIn(kOpTimeout));
  ASSERT_EQ(w.completions.size(), 3u);
  std::vector<bool> seen(3);
  for (const transport::Completion& c : w.completions) {
    ASSERT_TRUE(c.status.ok()) << c.status.ToString();
    ASSERT_GE(c.user_data, 10u);
    seen[c.user_data - 10] = true;
  }
  EXPECT_EQ(seen, std::vector<bool>(3, true));
  EXPECT_EQ(in, out);
}

TEST(ChannelSetTest, EveryPostedOpCompletesTcp) { RoundTrip(false); }
TEST(ChannelSetTest, EveryPostedOpCompletesFaultInjected) { RoundTrip(true); }

TEST(ChannelSetTest, HeldDaemonDoesNotHoldTheOthers) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(true));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(3 * kLen);
  f.faults->Hold(f.daemons[1].endpoint());
  for (NodeId n = 0; n < 3; ++n) {
    ASSERT_TRUE(set.Post(n, f.OpOn(n, transport::OpType::kRead, buf.data() + n * kLen, n)).ok());
  }
  set.FlushAll();
  Outcome w = WaitFor(set, 2, DeadlineIn(kOpTimeout));
  ASSERT_EQ(w.completions.size(), 2u) << "deadline " << w.deadline;
  for (const transport::Completion& c : w.completions) {
    EXPECT_NE(c.user_data, 1u);
    EXPECT_TRUE(c.status.ok()) << c.status.ToString();
  }
  EXPECT_TRUE(set.AnyOutstanding());  // the held one
  f.faults->Release(f.daemons[1].endpoint());
  w = WaitFor(set, 1, DeadlineIn(kOpTimeout));
  ASSERT_EQ(w.completions.size(), 1u);
  EXPECT_EQ(w.completions[0].user_data, 1u);
  EXPECT_TRUE(w.completions[0].status.ok()) << w.completions[0].status.ToString();
}

TEST(ChannelSetTest, InjectedFailureCompletesWithItsStatus) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(true));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(kLen);
  f.faults->Fail(f.daemons[2].endpoint(), RemoteAccessError("injected"), 1);
  ASSERT_TRUE(set.Post(2, f.OpOn(2, transport::OpType::kRead, buf.data(), 7)).ok());
  set.FlushAll();
  const Outcome w = WaitFor(set, 1, DeadlineIn(kOpTimeout));
  ASSERT_EQ(w.completions.size(), 1u);
  EXPECT_EQ(w.completions[0].user_data, 7u);
  EXPECT_EQ(w.completions[0].status.code(), StatusCode::kRemoteAccessError);
}

// A daemon that stops answering with its sockets open (SIGSTOP) is declared down by the cluster
// after failure_timeout; the set reports it within a down-check slice of that, long before the
// op timeout, and drops its channel, while the other daemons' ops complete normally.
void DownDaemonIsReported(bool injector) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(injector));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(3 * kLen);
  ASSERT_NO_FATAL_FAILURE(f.OpenAll(set));  // first: a paused daemon takes no channel
  f.daemons[1].Pause();
  const Clock::time_point start = Clock::now();
  for (NodeId n = 0; n < 3; ++n) {
    ASSERT_TRUE(set.Post(n, f.OpOn(n, transport::OpType::kRead, buf.data() + n * kLen, n)).ok());
  }
  set.FlushAll();
  const Outcome w = WaitFor(set, 3, DeadlineIn(kOpTimeout));
  f.daemons[1].Resume();
  EXPECT_FALSE(w.deadline);
  ASSERT_EQ(w.down, std::vector<NodeId>{1});
  EXPECT_FALSE(f.cluster->node(1).alive);
  EXPECT_LT(Clock::now() - start, kOpTimeout / 2);
  EXPECT_EQ(w.completions.size(), 2u);
  for (const transport::Completion& c : w.completions) EXPECT_NE(c.user_data, 1u);
  EXPECT_FALSE(set.AnyOutstanding());  // its channel went with the down node
}

TEST(ChannelSetTest, DownDaemonIsReportedTcp) { DownDaemonIsReported(false); }
TEST(ChannelSetTest, DownDaemonIsReportedFaultInjected) { DownDaemonIsReported(true); }

// A daemon that is up but never answers this op (held by the injector; heartbeats still pass):
// the wait ends at its deadline, and ResetStuck gives the buffers back.
TEST(ChannelSetTest, DeadlineEndsTheWait) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(true));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(kLen);
  f.faults->Hold(f.daemons[0].endpoint());
  ASSERT_TRUE(set.Post(0, f.OpOn(0, transport::OpType::kRead, buf.data(), 0)).ok());
  set.FlushAll();
  const milliseconds wait{300};
  const Clock::time_point start = Clock::now();
  const Outcome w = WaitFor(set, 1, start + wait);
  EXPECT_TRUE(w.deadline);
  EXPECT_TRUE(w.completions.empty());
  EXPECT_GE(Clock::now() - start, wait);
  EXPECT_TRUE(set.AnyOutstanding());
  set.ResetStuck();
  EXPECT_FALSE(set.AnyOutstanding());
  f.faults->Release(f.daemons[0].endpoint());
  // The node is fine: the next op reopens the channel and completes.
  ASSERT_TRUE(set.Post(0, f.OpOn(0, transport::OpType::kRead, buf.data(), 1)).ok());
  set.FlushAll();
  const Outcome again = WaitFor(set, 1, DeadlineIn(kOpTimeout));
  ASSERT_EQ(again.completions.size(), 1u);
  EXPECT_TRUE(again.completions[0].status.ok()) << again.completions[0].status.ToString();
}

// SetBusyPoll: a wait on one tcp channel spins before it sleeps. A spin that runs out (a paused
// daemon cannot answer) makes the next wait sleep at once, then two, ...; replies taken while
// spinning land where they should; a spin that catches its reply ends the backoff.
TEST(ChannelSetTest, BusyPollSpinsBacksOffAndDeliversReplies) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(false));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  set.SetBusyPoll(std::chrono::microseconds(1000));
  ASSERT_NO_FATAL_FAILURE(f.OpenAll(set));
  std::vector<uint8_t> out(kLen, 0x5a), in(kLen);
  ASSERT_TRUE(set.Post(0, f.OpOn(0, transport::OpType::kWrite, out.data(), 0)).ok());
  set.FlushAll();
  ASSERT_EQ(WaitFor(set, 1, DeadlineIn(kOpTimeout)).completions.size(), 1u);
  EXPECT_GE(set.busy_poll_stats().spins, 1u);  // the write's wait spun (caught or not)

  // Paused well within the failure timeout: nothing can answer, every spin runs out.
  f.daemons[0].Pause();
  set.SetBusyPoll(std::chrono::microseconds(1000));  // no backoff left from the write's wait
  const ChannelSet::BusyPollStats before = set.busy_poll_stats();
  ASSERT_TRUE(set.Post(0, f.OpOn(0, transport::OpType::kRead, in.data(), 1)).ok());
  set.FlushAll();
  auto stats = [&] {
    const ChannelSet::BusyPollStats s = set.busy_poll_stats();
    return std::array<uint64_t, 3>{s.spins - before.spins, s.hits - before.hits,
                                   s.skipped - before.skipped};
  };
  using Counts = std::array<uint64_t, 3>;  // spins, hits, skipped
  const milliseconds slice{20};
  EXPECT_TRUE(set.WaitAny(DeadlineIn(slice)).completions.empty());
  EXPECT_EQ(stats(), (Counts{1, 0, 0}));  // spun, ran out, slept
  EXPECT_TRUE(set.WaitAny(DeadlineIn(slice)).completions.empty());
  EXPECT_EQ(stats(), (Counts{1, 0, 1}));  // slept at once
  EXPECT_TRUE(set.WaitAny(DeadlineIn(slice)).completions.empty());
  EXPECT_EQ(stats(), (Counts{2, 0, 1}));  // spun again, ran out
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(set.WaitAny(DeadlineIn(slice)).completions.empty());
  EXPECT_EQ(stats(), (Counts{2, 0, 3}));  // then two waits slept at once
  EXPECT_TRUE(set.WaitAny(DeadlineIn(slice)).completions.empty());
  EXPECT_EQ(stats(), (Counts{3, 0, 3}));
  f.daemons[0].Resume();
  const Outcome w = WaitFor(set, 1, DeadlineIn(kOpTimeout));
  ASSERT_EQ(w.completions.size(), 1u);
  ASSERT_TRUE(w.completions[0].status.ok()) << w.completions[0].status.ToString();
  EXPECT_EQ(in, out);

  // Replies caught while spinning are delivered whole. How many are caught depends on the
  // machine's load; with a 1 ms budget one of a few hundred is (a loop on state, not time).
  for (int i = 0; i < 500 && set.busy_poll_stats().hits == before.hits; ++i) {
    std::fill(in.begin(), in.end(), 0);
    ASSERT_TRUE(set.Post(0, f.OpOn(0, transport::OpType::kRead, in.data(), 2)).ok());
    set.FlushAll();
    const Outcome r = WaitFor(set, 1, DeadlineIn(kOpTimeout));
    ASSERT_EQ(r.completions.size(), 1u);
    ASSERT_TRUE(r.completions[0].status.ok()) << r.completions[0].status.ToString();
    ASSERT_EQ(in, out);
  }
  EXPECT_GT(set.busy_poll_stats().hits, before.hits);
}

// Stragglers (ops nobody waits for any more) are reaped before their buffers are reused.
TEST(ChannelSetTest, DrainStragglersReapsWhatIsLeft) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(false));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(3 * kLen);
  for (NodeId n = 0; n < 3; ++n) {
    ASSERT_TRUE(set.Post(n, f.OpOn(n, transport::OpType::kRead, buf.data() + n * kLen, n)).ok());
  }
  set.FlushAll();
  set.DrainStragglers();
  EXPECT_FALSE(set.AnyOutstanding());
}

// A channel that broke on a daemon that then restarted (same address, new HELLO node id) is the
// channel's failure, not the new daemon's: DropIfStale says so once and drops it.
TEST(ChannelSetTest, ChannelToAnEarlierIncarnationIsStale) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(false));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(kLen);
  Status error;
  transport::Channel* ch = set.Get(2, &error);
  ASSERT_NE(ch, nullptr) << error.ToString();
  const uint64_t before = f.cluster->node(2).daemon_id;
  EXPECT_FALSE(set.DropIfStale(2));  // healthy
  f.daemons[2].Kill();
  ASSERT_TRUE(f.cluster->WaitForNode(2, NodeState::kDown, milliseconds(10000)).ok());
  EXPECT_FALSE(ch->Read(f.leases[2].slab(), 0, buf).ok());
  ASSERT_TRUE(ch->broken());
  EXPECT_FALSE(set.DropIfStale(2));  // broken, but the daemon has not come back as another one
  ASSERT_TRUE(f.daemons[2].Restart().ok()) << f.daemons.Logs();
  ASSERT_TRUE(f.cluster->WaitForNode(2, NodeState::kUp, milliseconds(10000)).ok());
  ASSERT_NE(f.cluster->node(2).daemon_id, before);
  EXPECT_TRUE(set.DropIfStale(2));
  EXPECT_FALSE(set.DropIfStale(2));  // dropped
}

// RunBatch, the borrowers' one wait loop: every op's outcome is handed out exactly once (a
// completion, a daemon declared down, the deadline), and nothing is outstanding afterwards.
TEST(ChannelSetTest, RunBatchEndsEveryOpOnceDownDaemonAndDeadlineIncluded) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start(true));
  ChannelSet set(f.cluster.get(), kOpTimeout);
  std::vector<uint8_t> buf(3 * kLen);
  ASSERT_NO_FATAL_FAILURE(f.OpenAll(set));  // first: a paused daemon takes no channel
  std::vector<BatchOp> ops(3);
  for (NodeId n = 0; n < 3; ++n) {
    ops[n] = {n, f.OpOn(n, transport::OpType::kRead, buf.data() + n * kLen, 99)};
  }
  std::vector<int> calls(3, 0);
  std::vector<Status> got(3);
  auto on_done = [&](size_t i, const Status& s) {
    ++calls[i];
    got[i] = s;
  };

  // Node 1 stops answering with its sockets open: its op ends when the cluster declares it
  // down, long before the op timeout; the others complete.
  f.daemons[1].Pause();
  const Clock::time_point start = Clock::now();
  set.RunBatch(std::span<BatchOp>(ops), DeadlineIn(kOpTimeout), on_done);
  f.daemons[1].Resume();
  EXPECT_LT(Clock::now() - start, kOpTimeout / 2);
  EXPECT_EQ(calls, std::vector<int>(3, 1));
  EXPECT_TRUE(got[0].ok()) << got[0].ToString();
  EXPECT_TRUE(got[2].ok()) << got[2].ToString();
  EXPECT_EQ(got[1].code(), StatusCode::kUnavailable) << got[1].ToString();
  EXPECT_NE(got[1].message().find("declared down"), std::string::npos) << got[1].ToString();
  for (const BatchOp& o : ops) EXPECT_TRUE(o.done);
  EXPECT_FALSE(set.AnyOutstanding());
  ASSERT_TRUE(f.cluster->WaitForNode(1, NodeState::kUp, milliseconds(10000)).ok());

  // Node 0 is up but never answers this op (held): the deadline ends it, and its buffer is ours.
  f.faults->Hold(f.daemons[0].endpoint());
  calls.assign(3, 0);
  set.RunBatch(std::span<BatchOp>(ops.data(), 1), DeadlineIn(milliseconds(300)), on_done);
  f.faults->Release(f.daemons[0].endpoint());
  EXPECT_EQ(calls[0], 1);
  EXPECT_EQ(got[0].code(), StatusCode::kDeadlineExceeded) << got[0].ToString();
  EXPECT_FALSE(set.AnyOutstanding());

  // enough() ends the wait early: what is left stays outstanding (stragglers).
  calls.assign(3, 0);
  set.RunBatch(std::span<BatchOp>(ops), DeadlineIn(kOpTimeout), on_done,
               [&] { return calls[0] + calls[1] + calls[2] >= 1; });
  EXPECT_GE(calls[0] + calls[1] + calls[2], 1);
  set.DrainStragglers();
  EXPECT_FALSE(set.AnyOutstanding());
}

}  // namespace
}  // namespace farmem::client
