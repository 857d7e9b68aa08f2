// Cluster against real farmemd processes on loopback: placement, groups, exhaustion, failure
// detection (kill, hang, restart), authentication, DNS peers, data channels, Close.
#include "farmem/client/cluster.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "cluster_timers.h"
#include "support/daemon_fixture.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;
using testing::DaemonConfig;
using testing::DaemonSet;
using testing::WaitUntil;

using test::kFailureTimeout;
using test::kHeartbeat;
using test::kTimeScale;
constexpr milliseconds kSlack{3000 * kTimeScale};

ClusterOptions OptionsFor(const DaemonSet& daemons) {
  ClusterOptions o;
  o.peers = daemons.endpoints();
  o.secret = daemons.secret();
  o.client_name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  o.heartbeat_interval = kHeartbeat;
  o.failure_timeout = kFailureTimeout;
  o.connect_timeout = milliseconds(5000);  // sanitizer builds of farmemd are slow to answer
  o.op_timeout = milliseconds(5000);
  o.reconnect_interval = 2 * kHeartbeat;
  o.rng_seed = 42;
  return o;
}

// Records events from the background thread; tests wait on it.
class EventLog {
 public:
  void Record(const Event& e) {
    std::lock_guard lock(mu_);
    events_.push_back(e);
    cv_.notify_all();
  }
  std::optional<Event> WaitFor(EventType type, NodeId node, milliseconds timeout, size_t skip = 0) {
    std::unique_lock lock(mu_);
    std::optional<Event> found;
    cv_.wait_for(lock, timeout, [&] {
      size_t seen = 0;
      for (const Event& e : events_) {
        if (e.type == type && e.node == node && seen++ == skip) {
          found = e;
          return true;
        }
      }
      return false;
    });
    return found;
  }
  std::vector<Event> events() const {
    std::lock_guard lock(mu_);
    return events_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Event> events_;
};

std::shared_ptr<EventLog> Record(Cluster& c) {
  auto log = std::make_shared<EventLog>();
  c.Subscribe([log](const Event& e) { log->Record(e); });
  return log;
}

std::map<NodeId, int> CountByNode(const std::vector<Lease>& leases) {
  std::map<NodeId, int> counts;
  for (const Lease& l : leases) ++counts[l.node];
  return counts;
}

std::set<uint64_t> IdsOn(const std::vector<Lease>& leases, NodeId node) {
  std::set<uint64_t> ids;
  for (const Lease& l : leases) {
    if (l.node == node) ids.insert(l.grant.lease_id);
  }
  return ids;
}

uint32_t FreeSlabs(Cluster& c, NodeId node) {
  auto s = c.Stat(node);
  EXPECT_TRUE(s.has_value()) << s.error().ToString();
  return s.has_value() ? s->free_slabs : 0;
}

// Most tests begin alike: daemons, then a client connected to all of them whose events are
// recorded. Call the steps under ASSERT_NO_FATAL_FAILURE: each fails the test when its part does
// not come up. Members: the daemons, the client under test (c_) and its event log (log_); c_ is
// declared after daemons_, so it closes before they stop.
class ClusterTest : public ::testing::Test {
 protected:
  // Starts `n` daemons with `config`.
  void StartDaemons(size_t n, DaemonConfig config = {}) {
    const Status s = TryStartDaemons(n, std::move(config));
    ASSERT_TRUE(s.ok()) << s.ToString() << "\n" << daemons().Logs();
  }
  // For tests that skip where the daemons cannot start (e.g. no IPv6 here).
  Status TryStartDaemons(size_t n, DaemonConfig config = {}) {
    daemons_.emplace(std::move(config));
    return daemons_->Start(n);
  }
  // Connects c_ (with Options() unless told otherwise) and records its events in log_.
  void Connect() { Connect(Options()); }
  void Connect(const ClusterOptions& o) {
    c_ = MustConnect(o);
    ASSERT_TRUE(c_);
    log_ = Record(*c_);
  }
  // StartDaemons, then Connect.
  void StartCluster(size_t n, DaemonConfig config = {}) {
    ASSERT_NO_FATAL_FAILURE(StartDaemons(n, std::move(config)));
    ASSERT_NO_FATAL_FAILURE(Connect());
  }

  DaemonSet& daemons() { return *daemons_; }
  ClusterOptions Options() { return OptionsFor(daemons()); }
  // Another client (the test checks it is not null).
  std::unique_ptr<Cluster> MustConnect(const ClusterOptions& o) {
    auto c = Cluster::Connect(o);
    EXPECT_TRUE(c.has_value()) << c.error().ToString() << "\n" << daemons().Logs();
    return c.has_value() ? std::move(*c) : nullptr;
  }
  // A second client pinned to one daemon, to fill it up behind c_'s back.
  std::unique_ptr<Cluster> PinnedClient(size_t index) {
    ClusterOptions o = Options();
    o.peers = {daemons().endpoints()[index]};
    return MustConnect(o);
  }

  std::optional<DaemonSet> daemons_;
  std::unique_ptr<Cluster> c_;
  std::shared_ptr<EventLog> log_;
};

TEST_F(ClusterTest, ConnectsToEveryPeerAndKnowsTheirSlabs) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
  ASSERT_EQ(c_->node_count(), 3u);
  EXPECT_EQ(c_->alive_count(), 3u);
  std::set<uint64_t> daemon_ids;
  for (NodeId i = 0; i < 3; ++i) {
    NodeInfo info = c_->node(i);
    EXPECT_TRUE(info.alive);
    EXPECT_EQ(info.endpoint, daemons()[i].endpoint());
    ASSERT_TRUE(info.stat.has_value());
    EXPECT_EQ(info.stat->total_slabs, 16u);
    EXPECT_EQ(info.stat->slab_size, 1u << 20);
    daemon_ids.insert(info.daemon_id);
  }
  EXPECT_EQ(daemon_ids.size(), 3u);
  EXPECT_FALSE(c_->node(3).last_error.ok());
  auto bad = c_->Stat(7);
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code(), StatusCode::kNotFound);
}

TEST_F(ClusterTest, PlacementSpreadsSingleSlabAllocations) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
  std::vector<Lease> leases;
  for (int i = 0; i < 30; ++i) {
    auto l = c_->Allocate(1);
    ASSERT_TRUE(l.has_value()) << l.error().ToString();
    ASSERT_EQ(l->size(), 1u);
    leases.push_back(l->front());
  }
  auto counts = CountByNode(leases);
  for (NodeId i = 0; i < 3; ++i) {
    // Two-choices keeps equal daemons within a slab or two: 10 +- 2 each.
    EXPECT_GE(counts[i], 8) << "node " << i;
    EXPECT_EQ(c_->node(i).leases_held, static_cast<size_t>(counts[i]));
    EXPECT_EQ(FreeSlabs(*c_, i), 16u - counts[i]);
  }
  std::set<std::pair<NodeId, uint64_t>> unique;
  for (const Lease& l : leases) {
    unique.insert({l.node, l.id()});
    EXPECT_EQ(l.slab().length, 1u << 20);
  }
  EXPECT_EQ(unique.size(), 30u);

  Status st = c_->Free(leases);
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (NodeId i = 0; i < 3; ++i) {
    EXPECT_EQ(FreeSlabs(*c_, i), 16u);
    EXPECT_EQ(c_->node(i).leases_held, 0u);
  }
  // A second Free of the same leases is a caller bug, reported as such.
  Status again = c_->Free(leases);
  EXPECT_EQ(again.code(), StatusCode::kNotFound) << again.ToString();
}

TEST_F(ClusterTest, TwoChoicesAvoidsTheFullerDaemon) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  auto other = PinnedClient(0);
  ASSERT_TRUE(other);
  auto prefill = other->Allocate(12);  // daemon 0: 4 free; daemons 1, 2: 16 free
  ASSERT_TRUE(prefill.has_value()) << prefill.error().ToString();

  ASSERT_NO_FATAL_FAILURE(Connect());
  // Eight more slabs: whichever way they split between daemons 1 and 2, each keeps >= 8 free,
  // more than daemon 0's 4, so no pair ever prefers daemon 0.
  auto l = c_->Allocate(8);
  ASSERT_TRUE(l.has_value()) << l.error().ToString();
  auto counts = CountByNode(*l);
  EXPECT_EQ(counts[0], 0);
  EXPECT_EQ(counts[1] + counts[2], 8);
  EXPECT_EQ(FreeSlabs(*c_, 0), 4u);
}

TEST_F(ClusterTest, AllocateFallsBackToAnyDaemonWithFreeSlabs) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  // Daemons 0 and 1 full: most pairs have no free slab, yet every allocation must succeed on 2.
  auto fill0 = PinnedClient(0);
  auto fill1 = PinnedClient(1);
  ASSERT_TRUE(fill0 && fill1);
  ASSERT_TRUE(fill0->Allocate(16).has_value());
  ASSERT_TRUE(fill1->Allocate(16).has_value());
  ASSERT_NO_FATAL_FAILURE(Connect());
  for (int i = 0; i < 10; ++i) {
    auto l = c_->Allocate(1);
    ASSERT_TRUE(l.has_value()) << l.error().ToString();
    EXPECT_EQ(l->front().node, 2u);
  }
}

TEST_F(ClusterTest, AllocateGroupPutsEachSlabOnADistinctNode) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(4));
  for (size_t n = 1; n <= 4; ++n) {
    for (int round = 0; round < 3; ++round) {
      auto g = c_->AllocateGroup(n);
      ASSERT_TRUE(g.has_value()) << g.error().ToString();
      ASSERT_EQ(g->size(), n);
      std::set<NodeId> nodes;
      for (const Lease& l : *g) nodes.insert(l.node);
      EXPECT_EQ(nodes.size(), n) << "group of " << n << " reused a node";
    }
  }
  auto empty = c_->AllocateGroup(0);
  ASSERT_TRUE(empty.has_value());
  EXPECT_TRUE(empty->empty());
}

TEST_F(ClusterTest, AllocateGroupLargerThanTheClusterFailsClearly) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
  auto g = c_->AllocateGroup(4);
  ASSERT_FALSE(g.has_value());
  EXPECT_EQ(g.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.error().message().find("4 distinct nodes"), std::string::npos) << g.error().message();
  EXPECT_NE(g.error().message().find("only 3"), std::string::npos) << g.error().message();

  daemons()[2].Kill();
  ASSERT_TRUE(log_->WaitFor(EventType::kNodeDown, 2, kFailureTimeout + kSlack));
  auto down = c_->AllocateGroup(3);
  ASSERT_FALSE(down.has_value());
  EXPECT_EQ(down.error().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(down.error().message().find("only 2 of 3 are up"), std::string::npos)
      << down.error().message();
  EXPECT_NE(down.error().message().find(daemons()[2].endpoint().ToString()), std::string::npos)
      << down.error().message();
  auto two = c_->AllocateGroup(2);
  ASSERT_TRUE(two.has_value()) << two.error().ToString();
  EXPECT_EQ(CountByNode(*two), (std::map<NodeId, int>{{0, 1}, {1, 1}}));
}

TEST_F(ClusterTest, AllocateGroupWithAFullNodeFailsAndGivesBackWhatItTook) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  auto filler = PinnedClient(1);
  ASSERT_TRUE(filler);
  ASSERT_TRUE(filler->Allocate(16).has_value());
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto g = c_->AllocateGroup(3);
  ASSERT_FALSE(g.has_value());
  EXPECT_EQ(g.error().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(g.error().message().find("no daemon has a free slab"), std::string::npos)
      << g.error().message();
  EXPECT_NE(g.error().message().find(daemons()[1].endpoint().ToString() + " free=0"),
            std::string::npos)
      << g.error().message();
  // All or nothing: the slabs taken on 0 and 2 before the failure went back.
  EXPECT_EQ(FreeSlabs(*c_, 0), 16u);
  EXPECT_EQ(FreeSlabs(*c_, 2), 16u);
  EXPECT_EQ(c_->node(0).leases_held + c_->node(2).leases_held, 0u);
}

TEST_F(ClusterTest, AllocateExcludingNeverUsesAnExcludedNode) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
  const std::vector<NodeId> survivors = {0, 2};
  for (int i = 0; i < 5; ++i) {
    auto l = c_->AllocateExcluding(survivors);
    ASSERT_TRUE(l.has_value()) << l.error().ToString();
    EXPECT_EQ(l->node, 1u);
  }
  const std::vector<NodeId> everyone = {0, 1, 2};
  auto none = c_->AllocateExcluding(everyone);
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.error().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(none.error().message().find("already in the group"), std::string::npos)
      << none.error().message();
}

TEST_F(ClusterTest, EveryDaemonDownIsUnavailableNotFull) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  daemons()[0].Kill();
  daemons()[1].Kill();
  ASSERT_TRUE(log_->WaitFor(EventType::kNodeDown, 0, kFailureTimeout + kSlack));
  ASSERT_TRUE(log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack));
  auto l = c_->Allocate(1);
  ASSERT_FALSE(l.has_value());
  EXPECT_EQ(l.error().code(), StatusCode::kUnavailable) << l.error().ToString();
  EXPECT_NE(l.error().message().find(daemons()[0].endpoint().ToString() + " down"),
            std::string::npos)
      << l.error().message();
}

TEST_F(ClusterTest, FullClusterFailsWithResourceExhaustedNamingFreeCounts) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3, DaemonConfig{.capacity = "4M"}));
  // All or nothing: 13 slabs do not fit in 12, and the 12 taken on the way are given back.
  auto too_many = c_->Allocate(13);
  ASSERT_FALSE(too_many.has_value());
  EXPECT_EQ(too_many.error().code(), StatusCode::kResourceExhausted);
  for (NodeId i = 0; i < 3; ++i) EXPECT_EQ(FreeSlabs(*c_, i), 4u) << "node " << i;

  auto all = c_->Allocate(12);
  ASSERT_TRUE(all.has_value()) << all.error().ToString();
  EXPECT_EQ(CountByNode(*all), (std::map<NodeId, int>{{0, 4}, {1, 4}, {2, 4}}));
  auto none = c_->Allocate(1);
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.error().code(), StatusCode::kResourceExhausted);
  const std::string& msg = none.error().message();
  EXPECT_NE(msg.find("no daemon has a free slab"), std::string::npos) << msg;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NE(msg.find(daemons()[i].endpoint().ToString() + " free=0"), std::string::npos) << msg;
  }
}

TEST_F(ClusterTest, KillingADaemonReportsNodeDownWithItsLeasesThenNodeUpOnRestart) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
  auto leases = c_->AllocateGroup(3);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  auto more = c_->Allocate(6);
  ASSERT_TRUE(more.has_value()) << more.error().ToString();
  leases->insert(leases->end(), more->begin(), more->end());
  const std::set<uint64_t> on_1 = IdsOn(*leases, 1);
  ASSERT_FALSE(on_1.empty());
  const uint64_t old_daemon_id = c_->node(1).daemon_id;

  const auto killed_at = Clock::now();
  daemons()[1].Kill();
  auto down = log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack);
  ASSERT_TRUE(down.has_value()) << "no kNodeDown for " << daemons()[1].endpoint().ToString();
  EXPECT_LE(Clock::now() - killed_at, kFailureTimeout + kSlack);
  EXPECT_EQ(std::set<uint64_t>(down->lease_ids.begin(), down->lease_ids.end()), on_1);
  EXPECT_EQ(down->endpoint, daemons()[1].endpoint());
  EXPECT_FALSE(down->reason.ok());
  EXPECT_FALSE(c_->node(1).alive);
  EXPECT_EQ(c_->node(1).leases_held, 0u);
  EXPECT_TRUE(c_->node(0).alive);
  EXPECT_TRUE(c_->node(2).alive);
  for (const Event& e : log_->events()) {
    EXPECT_FALSE(e.type == EventType::kNodeDown && e.node != 1) << "node " << e.node << " down";
  }
  // New slabs avoid the dead node; a channel to it is refused at once.
  auto after = c_->Allocate(4);
  ASSERT_TRUE(after.has_value()) << after.error().ToString();
  EXPECT_EQ(CountByNode(*after).count(1), 0u);
  auto channel = c_->OpenChannel(1);
  ASSERT_FALSE(channel.has_value());
  EXPECT_EQ(channel.error().code(), StatusCode::kUnavailable);

  ASSERT_TRUE(daemons()[1].Restart().ok()) << daemons().Logs();
  auto up = log_->WaitFor(EventType::kNodeUp, 1, kSlack * 2);
  ASSERT_TRUE(up.has_value()) << "no kNodeUp after restart";
  EXPECT_TRUE(c_->node(1).alive);
  EXPECT_NE(c_->node(1).daemon_id, old_daemon_id);
  auto group = c_->AllocateGroup(3);
  ASSERT_TRUE(group.has_value()) << group.error().ToString();

  // The lost leases are accepted by Free (nothing to do) along with the live ones.
  Status st = c_->Free(*leases);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(c_->Free(*after).ok());
  EXPECT_TRUE(c_->Free(*group).ok());
  for (NodeId i = 0; i < 3; ++i) EXPECT_EQ(FreeSlabs(*c_, i), 16u) << "node " << i;
}

TEST_F(ClusterTest, QuickRestartReportsEveryLeaseThereAsLost) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  auto leases = c_->Allocate(8);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  const std::set<uint64_t> on_0 = IdsOn(*leases, 0);
  ASSERT_FALSE(on_0.empty());
  const uint64_t old_daemon_id = c_->node(0).daemon_id;

  ASSERT_TRUE(daemons()[0].Restart().ok()) << daemons().Logs();
  // Depending on timing the client sees a restart (kLeasesLost) or a death then a return
  // (kNodeDown, kNodeUp); either way every lease on daemon 0 is reported lost, exactly once.
  std::set<uint64_t> lost;
  WaitUntil(
      [&] {
        lost.clear();
        for (const Event& e : log_->events()) {
          if (e.node == 0 && (e.type == EventType::kLeasesLost || e.type == EventType::kNodeDown)) {
            lost.insert(e.lease_ids.begin(), e.lease_ids.end());
          }
        }
        return lost == on_0 && c_->node(0).alive && c_->node(0).daemon_id != old_daemon_id;
      },
      kFailureTimeout + kSlack * 2);
  EXPECT_EQ(lost, on_0);
  EXPECT_TRUE(c_->node(0).alive);
  EXPECT_NE(c_->node(0).daemon_id, old_daemon_id);
  EXPECT_EQ(c_->node(0).leases_held, 0u);
  EXPECT_EQ(FreeSlabs(*c_, 0), 16u);
}

// A false down is not a loss (issue #11): the same daemon (same node id) answering again still
// holds the leases reported in kNodeDown, so the client keeps them (kLeasesReturned) rather than
// FREEing them; the borrower frees them only if it replaced them meanwhile.
TEST_F(ClusterTest, HungDaemonIsDeclaredDownAndKeepsItsLeasesWhenItWakes) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  auto leases = c_->AllocateGroup(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  const std::set<uint64_t> on_1 = IdsOn(*leases, 1);
  const Lease& lease_1 = (*leases)[0].node == 1 ? (*leases)[0] : (*leases)[1];

  daemons()[1].Pause();  // accepts TCP connections, answers nothing
  auto down = log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack);
  EXPECT_EQ(c_->GetLeaseState(lease_1), LeaseState::kRetained);
  daemons()[1].Resume();
  ASSERT_TRUE(down.has_value()) << "no kNodeDown for a hung daemon";
  EXPECT_EQ(std::set<uint64_t>(down->lease_ids.begin(), down->lease_ids.end()), on_1);
  EXPECT_TRUE(c_->node(0).alive);

  // Same daemon (same node id) comes back: its leases are this client's again, contents intact.
  auto back = log_->WaitFor(EventType::kLeasesReturned, 1, kSlack * 2);
  ASSERT_TRUE(back.has_value()) << "no kLeasesReturned after SIGCONT";
  EXPECT_EQ(std::set<uint64_t>(back->lease_ids.begin(), back->lease_ids.end()), on_1);
  EXPECT_EQ(c_->GetLeaseState(lease_1), LeaseState::kHeld);
  EXPECT_EQ(c_->node(1).leases_held, on_1.size());
  EXPECT_EQ(FreeSlabs(*c_, 1), 16u - on_1.size());
  // And they are freed like any other.
  ASSERT_TRUE(c_->Free({&lease_1, 1}).ok());
  EXPECT_EQ(FreeSlabs(*c_, 1), 16u);
}

// A call that holds a node's connection while its daemon hangs must not hold off the daemon's
// detection until the call's op_timeout: the heartbeat, finding the connection busy past the
// failure window, asks on a connection of its own and declares the node down when that goes
// unanswered too. Regression: the heartbeat skipped a busy node ("its failure reports itself"),
// so a call in flight when the daemon stopped kept it up for op_timeout — the far_ptr
// gray-failure test's 10 s deref, about 1 run in 8, with placement's STAT in flight at the pause.
// (A STAT now gives up after failure_timeout itself; a FREE, as an ALLOC, waits op_timeout.)
// And the call itself ends with the down: before, it waited out its op_timeout while the node was
// already down, and its caller with it.
TEST_F(ClusterTest, HungDaemonIsDeclaredDownWhileACallWaitsOnIt) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  ClusterOptions o = Options();
  o.op_timeout = milliseconds(30000 * kTimeScale);  // far beyond the detection asked for below
  ASSERT_NO_FATAL_FAILURE(Connect(o));
  // A heartbeat that takes the connection at the pause detects the daemon the usual way (its own
  // timeout, then a re-probe); the case here is the call holding it. Paused again until a down
  // names the busy connection (the call was first), at most five times.
  bool while_busy = false;
  for (size_t attempt = 0; attempt < 5 && !while_busy; ++attempt) {
    // A lease on node 1 to free while it hangs. Granted: the node's worker is also done with its
    // own calls after a return (they hold the connection too).
    auto leases = c_->AllocateGroup(2);
    ASSERT_TRUE(leases.has_value()) << "attempt " << attempt << ": " << leases.error().ToString();
    const Lease on_1 = (*leases)[0].node == 1 ? (*leases)[0] : (*leases)[1];
    daemons()[1].Pause();  // accepts TCP connections, answers nothing
    const auto paused_at = Clock::now();
    std::atomic<bool> call_done{false};
    std::thread call([&] {
      (void)c_->Free({&on_1, 1});  // FREE: holds the connection, waiting
      call_done = true;
    });
    auto down = log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack, attempt);
    const auto took = Clock::now() - paused_at;
    // The call itself must end with the down, not at its op_timeout: its caller (placement, a
    // span set's allocation, a page write) waits on it. Checked before the daemon resumes.
    const bool call_ended = WaitUntil([&] { return call_done.load(); }, kSlack);
    daemons()[1].Resume();
    call.join();
    ASSERT_TRUE(down.has_value()) << "attempt " << attempt
                                  << ": the hung daemon was not declared down while a call waited";
    EXPECT_LT(took, o.op_timeout / 4) << down->reason.ToString();
    while_busy =
        down->reason.message().find("while a call held its connection") != std::string::npos;
    if (while_busy) {
      EXPECT_TRUE(call_ended) << "attempt " << attempt
                              << ": the FREE stuck on the hung daemon still waited after its down";
    }
    ASSERT_TRUE(log_->WaitFor(EventType::kNodeUp, 1, kSlack * 2, attempt))
        << "attempt " << attempt << ": the daemon did not come back up after SIGCONT";
  }
  EXPECT_TRUE(while_busy) << "in five pauses a heartbeat always took the connection first";
  EXPECT_TRUE(c_->node(0).alive);
}

// A slow daemon never costs the leases on healthy ones: four of six daemons stop (SIGSTOP: they
// accept TCP connections and answer nothing), and each costs about failure_timeout to detect plus
// a connect timeout per reconnect. One after another, that exceeds the healthy daemons' lease TTL
// (fc7: ec:4+2 lost a span although no daemon died). Heartbeats to every responsive daemon must
// still arrive within its TTL, however many others hang.
TEST_F(ClusterTest, StoppedDaemonsDoNotDelayLeaseRenewalOnHealthyOnes) {
  constexpr size_t kDaemons = 6, kHealthy = 2;
  constexpr milliseconds kTtl{1200 * kTimeScale};
  ASSERT_NO_FATAL_FAILURE(StartDaemons(kDaemons, DaemonConfig{.lease_ttl_ms = kTtl.count()}));
  ClusterOptions o = Options();
  o.failure_timeout = milliseconds(600 * kTimeScale);
  o.connect_timeout = milliseconds(600 * kTimeScale);
  // The property only bites when the stopped daemons' timeouts add up past the TTL.
  ASSERT_GT((kDaemons - kHealthy) * o.failure_timeout, kTtl);
  ASSERT_NO_FATAL_FAILURE(Connect(o));
  ASSERT_TRUE(
      WaitUntil([&] { return c_->node(0).lease_ttl_ms == uint64_t(kTtl.count()); }, kSlack));
  auto leases = c_->AllocateGroup(kDaemons);  // one slab on each daemon
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();

  for (size_t i = kHealthy; i < kDaemons; ++i) daemons()[i].Pause();
  // Stopped long enough for the healthy daemons to reclaim everything twice over if no
  // heartbeat reached them: detection of all four, then two TTLs (plus the daemon's reaper
  // period, TTL/4).
  const auto paused_at = Clock::now();
  for (NodeId n = kHealthy; n < kDaemons; ++n) {
    EXPECT_TRUE(log_->WaitFor(EventType::kNodeDown, n, kDaemons * (o.failure_timeout + kSlack)))
        << "no kNodeDown for stopped node " << n;
  }
  const auto hold_until = std::max(Clock::now(), paused_at + 2 * kTtl + kTtl / 4) + kTtl / 4;
  auto lost_on_healthy = [&] {
    for (const Event& e : log_->events()) {
      if (e.type == EventType::kLeasesLost && e.node < kHealthy) return true;
    }
    return false;
  };
  (void)WaitUntil(lost_on_healthy,
                  std::chrono::duration_cast<milliseconds>(hold_until - Clock::now()));
  // Ask the healthy daemons themselves (STAT) while the others are still stopped.
  std::vector<uint32_t> free_on_healthy;
  for (NodeId n = 0; n < kHealthy; ++n) free_on_healthy.push_back(FreeSlabs(*c_, n));
  const bool lost = lost_on_healthy();
  for (size_t i = kHealthy; i < kDaemons; ++i) daemons()[i].Resume();

  EXPECT_FALSE(lost) << "kLeasesLost on a healthy daemon while others were stopped";
  for (NodeId n = 0; n < kHealthy; ++n) {
    EXPECT_TRUE(c_->node(n).alive) << "healthy node " << n << " declared down";
    EXPECT_EQ(free_on_healthy[n], 15u)
        << "healthy daemon " << n << " reclaimed this client's lease (no heartbeat within "
        << kTtl.count() << " ms)\n"
        << daemons().Logs();
    for (const Lease& l : *leases) {
      if (l.node == n) {
        EXPECT_EQ(c_->GetLeaseState(l), LeaseState::kHeld) << "node " << n;
      }
    }
  }
}

// A lease the borrower replaced (and freed) while its daemon was down is FREEd when the same
// daemon answers again; the others come back.
TEST_F(ClusterTest, LeaseFreedWhileItsDaemonIsDownIsFreedWhenItAnswers) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  std::vector<Lease> on_1;
  while (on_1.size() < 2) {
    auto got = c_->Allocate(1);
    ASSERT_TRUE(got.has_value()) << got.error().ToString();
    if (got->front().node == 1) on_1.push_back(got->front());
  }
  daemons()[1].Pause();
  ASSERT_TRUE(log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack).has_value());
  Status freed = c_->Free({&on_1[0], 1});  // replaced elsewhere by its borrower, say
  EXPECT_EQ(c_->GetLeaseState(on_1[0]), LeaseState::kGone);
  daemons()[1].Resume();
  auto back = log_->WaitFor(EventType::kLeasesReturned, 1, kSlack * 2);
  ASSERT_TRUE(back.has_value()) << "no kLeasesReturned after SIGCONT (" << freed.ToString() << ")";
  EXPECT_EQ(back->lease_ids, std::vector<uint64_t>{on_1[1].id()});
  WaitUntil([&] { return FreeSlabs(*c_, 1) == 15u; }, kSlack);
  EXPECT_EQ(FreeSlabs(*c_, 1), 15u);
}

// Freeing a lease lost with a hung (SIGSTOPped) daemon has nothing to send: it must not wait for
// the background thread's reconnect attempt to that daemon (up to connect_timeout, 5 s here). The
// page store frees the old member of a rebuilt extent while it holds the extent: waiting here
// held requests and the rest of the re-protection until the daemon woke up (chaos replicate2-gray).
TEST_F(ClusterTest, FreeingLeasesLostWithAHungDaemonDoesNotWaitForItsReconnect) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  auto leases = c_->AllocateGroup(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  const Lease lost = (*leases)[0].node == 1 ? (*leases)[0] : (*leases)[1];
  ASSERT_EQ(lost.node, 1u);

  daemons()[1].Pause();  // accepts TCP connections, answers nothing: a reconnect waits it out
  auto down = log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack);
  ASSERT_TRUE(down.has_value()) << "no kNodeDown for a hung daemon";
  // Reconnects start every reconnect_interval (200 ms) after the node is down and each waits up
  // to connect_timeout: free (again and again: the later calls find the lease already gone)
  // through several of those windows.
  const auto until = Clock::now() + 6 * Options().reconnect_interval;
  auto slowest = Clock::duration::zero();
  int calls = 0;
  while (Clock::now() < until) {
    const auto t0 = Clock::now();
    Status s = c_->Free({&lost, 1});
    slowest = std::max(slowest, Clock::now() - t0);
    if (calls++ == 0) {
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  daemons()[1].Resume();
  EXPECT_LT(slowest, milliseconds(500))
      << "Free of a lost lease waited " << std::chrono::duration_cast<milliseconds>(slowest).count()
      << " ms for the hung daemon (" << calls << " calls)";
}

TEST_F(ClusterTest, ReportFailureProbesAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  ClusterOptions o = Options();
  o.heartbeat_interval = milliseconds(3000);  // a heartbeat would not notice for seconds
  o.failure_timeout = milliseconds(10000);
  ASSERT_NO_FATAL_FAILURE(Connect(o));
  // The first heartbeat round has passed once a reply told the client the lease TTL.
  ASSERT_TRUE(WaitUntil([&] { return c_->node(0).lease_ttl_ms != 0; }, kSlack));
  daemons()[0].Kill();
  const auto reported_at = Clock::now();
  c_->ReportFailure(0, Unavailable("read on lease 1 failed: connection reset"));
  auto down = log_->WaitFor(EventType::kNodeDown, 0, milliseconds(2000 * kTimeScale));
  ASSERT_TRUE(down.has_value()) << "ReportFailure did not lead to a probe";
  EXPECT_LT(Clock::now() - reported_at, milliseconds(2000 * kTimeScale));
}

TEST_F(ClusterTest, ConnectWithOnePeerDownStillWorks) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  daemons()[2].Kill();
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_EQ(c_->node_count(), 3u);
  EXPECT_EQ(c_->alive_count(), 2u);
  NodeInfo dead = c_->node(2);
  EXPECT_FALSE(dead.alive);
  EXPECT_FALSE(dead.last_error.ok());
  EXPECT_EQ(dead.endpoint, daemons()[2].endpoint());

  auto l = c_->Allocate(6);
  ASSERT_TRUE(l.has_value()) << l.error().ToString();
  EXPECT_EQ(CountByNode(*l).count(2), 0u);

  ASSERT_TRUE(daemons()[2].Restart().ok()) << daemons().Logs();
  ASSERT_TRUE(log_->WaitFor(EventType::kNodeUp, 2, kSlack * 2)) << "late peer never joined";
  EXPECT_EQ(c_->alive_count(), 3u);
  auto g = c_->AllocateGroup(3);
  EXPECT_TRUE(g.has_value()) << g.error().ToString();
}

TEST_F(ClusterTest, WrongSecretIsPermissionDenied) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  ClusterOptions o = Options();
  o.secret = "not-the-secret";
  auto c = Cluster::Connect(o);
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kPermissionDenied) << c.error().ToString();
  EXPECT_NE(c.error().message().find(daemons()[0].endpoint().ToString()), std::string::npos)
      << c.error().message();
  EXPECT_NE(c.error().message().find(daemons()[1].endpoint().ToString()), std::string::npos)
      << c.error().message();
}

TEST_F(ClusterTest, DnsNameResolvesToPeers) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  ClusterOptions o = Options();
  o.peers.clear();
  o.peers_dns = "localhost:" + std::to_string(daemons()[0].port());
  ASSERT_NO_FATAL_FAILURE(Connect(o));
  // localhost may also give ::1, where this daemon does not listen: only answering addresses
  // become nodes.
  ASSERT_EQ(c_->node_count(), 1u);
  EXPECT_TRUE(c_->node(0).alive);
  EXPECT_EQ(c_->node(0).endpoint.port, daemons()[0].port());
  auto l = c_->Allocate(2);
  ASSERT_TRUE(l.has_value()) << l.error().ToString();
}

TEST_F(ClusterTest, DnsAndExplicitPeerForTheSameDaemonAreOneNode) {
  // Reachable as 127.0.0.1 and ::1.
  Status started = TryStartDaemons(1, DaemonConfig{.listen_host = "::"});
  if (!started.ok()) GTEST_SKIP() << "no IPv6 wildcard listen here: " << started.ToString();
  ClusterOptions o = Options();
  o.peers_dns = "localhost:" + std::to_string(daemons()[0].port());
  ASSERT_NO_FATAL_FAILURE(Connect(o));
  // 127.0.0.1 (explicit, and again from DNS) and ::1 (from DNS, if resolved) are one daemon.
  EXPECT_EQ(c_->node_count(), 1u);
  auto g = c_->AllocateGroup(2);
  ASSERT_FALSE(g.has_value()) << "a group of 2 landed twice on one daemon";
  EXPECT_EQ(g.error().code(), StatusCode::kInvalidArgument);
}

TEST_F(ClusterTest, TwoAddressesOfOneDaemonAreOneNode) {
  // Reachable as 127.0.0.1 and ::1.
  Status started = TryStartDaemons(2, DaemonConfig{.listen_host = "::"});
  if (!started.ok()) GTEST_SKIP() << "no IPv6 wildcard listen here: " << started.ToString();
  ClusterOptions o = Options();
  const Endpoint v6{"::1", daemons()[0].port()};
  o.peers = {daemons()[0].endpoint(), v6, daemons()[1].endpoint()};
  ASSERT_NO_FATAL_FAILURE(Connect(o));
  if (c_->node_count() == 3 && !c_->node(1).alive) GTEST_SKIP() << "::1 unreachable here";
  // Same HELLO node id through both addresses: one node, so groups stay on distinct daemons.
  ASSERT_EQ(c_->node_count(), 2u);
  EXPECT_EQ(c_->node(0).endpoint, daemons()[0].endpoint());
  EXPECT_EQ(c_->node(1).endpoint, daemons()[1].endpoint());
  EXPECT_FALSE(c_->AllocateGroup(3).has_value());
  auto g = c_->AllocateGroup(2);
  ASSERT_TRUE(g.has_value()) << g.error().ToString();
}

TEST_F(ClusterTest, DataChannelReadsWhatItWroteToALease) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  auto g = c_->AllocateGroup(2);
  ASSERT_TRUE(g.has_value()) << g.error().ToString();
  for (const Lease& lease : *g) {
    auto ch = c_->OpenChannel(lease.node);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    std::vector<uint8_t> out(4096);
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i * 7 + lease.node);
    const uint64_t offset = lease.slab().length - out.size();  // the last page of the slab
    Status w = (*ch)->Write(lease.slab(), offset, out);
    ASSERT_TRUE(w.ok()) << w.ToString();
    std::vector<uint8_t> in(out.size());
    Status r = (*ch)->Read(lease.slab(), offset, in);
    ASSERT_TRUE(r.ok()) << r.ToString();
    EXPECT_EQ(in, out);
  }
}

// A borrower's channel to a daemon that then restarted on the same address is dead, though no op
// has failed on it yet. EnsureChannel with `opened_to` replaces it, so the first op on a lease from
// the new incarnation succeeds instead of failing and getting that healthy daemon blamed.
TEST_F(ClusterTest, EnsureChannelReplacesAChannelToARestartedDaemon) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  std::unique_ptr<transport::Channel> slot;
  uint64_t opened_to = 0;
  std::vector<uint8_t> out(4096, 0x5a), in(4096);
  const NodeId other[] = {0};
  auto lease = c_->AllocateExcluding(other);
  ASSERT_TRUE(lease.has_value()) << lease.error().ToString();
  Status err;
  transport::Channel* ch = c_->EnsureChannel(slot, 1, &err, &opened_to);
  ASSERT_NE(ch, nullptr) << err.ToString();
  ASSERT_TRUE(ch->Write(lease->slab(), 0, out).ok());
  EXPECT_EQ(opened_to, c_->node(1).daemon_id);

  ASSERT_TRUE(daemons()[1].Restart().ok()) << daemons().Logs();
  // Wait (on state, with a deadline) until the client knows the new incarnation and has it up.
  WaitUntil([&] { return c_->node(1).alive && c_->node(1).daemon_id != opened_to; },
            kFailureTimeout + 2 * kSlack);
  ASSERT_TRUE(c_->node(1).alive) << daemons().Logs();
  ASSERT_NE(c_->node(1).daemon_id, opened_to);
  auto fresh = c_->AllocateExcluding(other);
  ASSERT_TRUE(fresh.has_value()) << fresh.error().ToString();
  ch = c_->EnsureChannel(slot, 1, &err, &opened_to);
  ASSERT_NE(ch, nullptr) << err.ToString();
  Status w = ch->Write(fresh->slab(), 0, out);
  ASSERT_TRUE(w.ok()) << w.ToString();
  ASSERT_TRUE(ch->Read(fresh->slab(), 0, in).ok());
  EXPECT_EQ(in, out);
  EXPECT_EQ(opened_to, c_->node(1).daemon_id);
}

// WaitForNode returns once the node is in the state asked for and subscribers have been handed
// the event that says so; it times out (saying what the node is) otherwise.
TEST_F(ClusterTest, WaitForNodeWaitsForTheStateAndItsEvent) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  auto leases = c_->AllocateGroup(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  EXPECT_TRUE(c_->WaitForNode(1, NodeState::kUp, kSlack).ok());
  Status early = c_->WaitForNode(0, NodeState::kDown, milliseconds(50));
  EXPECT_EQ(early.code(), StatusCode::kDeadlineExceeded) << early.ToString();
  EXPECT_EQ(c_->WaitForNode(7, NodeState::kUp, milliseconds(0)).code(), StatusCode::kNotFound);

  daemons()[1].Kill();
  Status down = c_->WaitForNode(1, NodeState::kDown, kFailureTimeout + kSlack);
  ASSERT_TRUE(down.ok()) << down.ToString();
  // Already delivered: no waiting here.
  EXPECT_TRUE(log_->WaitFor(EventType::kNodeDown, 1, milliseconds(0)).has_value());

  ASSERT_TRUE(daemons()[1].Restart().ok()) << daemons().Logs();
  Status up = c_->WaitForNode(1, NodeState::kUp, kFailureTimeout + kSlack * 2);
  EXPECT_TRUE(up.ok()) << up.ToString();
}

TEST_F(ClusterTest, HeartbeatsKeepLeasesAlivePastTheLeaseTtl) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, DaemonConfig{.lease_ttl_ms = 1000 * kTimeScale}));
  auto l = c_->Allocate(3);
  ASSERT_TRUE(l.has_value()) << l.error().ToString();
  // Time is the subject: the leases must outlive 2.5 TTLs on heartbeats alone.
  std::this_thread::sleep_for(milliseconds(2500 * kTimeScale));
  EXPECT_EQ(FreeSlabs(*c_, 0), 13u);
  EXPECT_EQ(c_->node(0).lease_ttl_ms, 1000u * kTimeScale);
  auto ch = c_->OpenChannel(0);
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  std::vector<uint8_t> page(4096, 0xab);
  Status w = (*ch)->Write(l->front().slab(), 0, page);
  EXPECT_TRUE(w.ok()) << w.ToString();
  EXPECT_TRUE(c_->Free(*l).ok());
}

TEST_F(ClusterTest, CloseFreesEveryLeaseAndStopsTheClient) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  auto observer = MustConnect(Options());
  ASSERT_TRUE(observer);
  ASSERT_NO_FATAL_FAILURE(Connect());
  EXPECT_NE(observer->client_id(), c_->client_id());
  auto l = c_->Allocate(10);
  ASSERT_TRUE(l.has_value()) << l.error().ToString();
  EXPECT_EQ(FreeSlabs(*observer, 0) + FreeSlabs(*observer, 1), 22u);
  Status st = c_->Close();
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(FreeSlabs(*observer, 0) + FreeSlabs(*observer, 1), 32u);
  EXPECT_TRUE(c_->Close().ok());  // idempotent
  auto after = c_->Allocate(1);
  ASSERT_FALSE(after.has_value());
  EXPECT_EQ(after.error().code(), StatusCode::kAborted);
  EXPECT_EQ(c_->Free(*l).code(), StatusCode::kAborted);
}

TEST_F(ClusterTest, ConcurrentAllocateAndFreeFromManyThreads) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        auto l = (i % 2 == 0) ? c_->Allocate(2) : c_->AllocateGroup(3);
        if (!l.has_value() || !c_->Free(*l).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (NodeId i = 0; i < 3; ++i) {
    EXPECT_EQ(FreeSlabs(*c_, i), 16u);
    EXPECT_EQ(c_->node(i).leases_held, 0u);
  }
}

TEST_F(ClusterTest, UnsubscribedCallbackIsNotCalledAgain) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  std::atomic<int> calls{0};
  SubscriptionId id = c_->Subscribe([&](const Event&) { ++calls; });
  c_->Unsubscribe(id);
  daemons()[1].Kill();
  ASSERT_TRUE(log_->WaitFor(EventType::kNodeDown, 1, kFailureTimeout + kSlack));
  EXPECT_EQ(calls.load(), 0);
}

}  // namespace
}  // namespace farmem::client
