// far_ptr on an eviction notice (issue 12, item 3): a daemon that wants its memory back (drain,
// host pressure) sends EVICT_NOTICE with a deadline; the runtime copies the span sets it holds to
// other daemons while it still serves them, then frees the leases. In every resilience mode —
// none included — every object comes back intact, the daemon ends up holding none of this
// client's leases well before its deadline, and no member is ever counted failed (no degraded
// episode, no re-protection). Objects are written and evicted by another thread throughout the
// move: whatever lands in a group while it moves is not lost either.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farptr_fixture.h"
#include "support/process.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr size_t kObjects = 3000;
constexpr size_t kObjectSize = 700;  // ~2 MiB of 16 KiB spans: several 1 MiB slab groups
constexpr uint32_t kGraceMs = 30000;

class FarEvictNoticeTest : public FarptrTest {
 protected:
  void Start(size_t n, std::vector<std::string> extra = {}) {
    testing::DaemonConfig cfg;
    cfg.capacity = "16M";
    cfg.slab_size = "1M";
    cfg.log_level = "warn";
    cfg.extra_args = {"--memory-source", "off"};
    cfg.extra_args.insert(cfg.extra_args.end(), extra.begin(), extra.end());
    daemons_ = std::make_unique<testing::DaemonSet>(cfg);
    Status s = daemons_->Start(n);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  void OpenWith(const std::string& resilience) {
    RuntimeOptions o = Options(resilience, 256u << 10);
    o.reconcile_interval = milliseconds(500);
    // Background compaction could empty the drained daemon's groups before the notice (they would
    // go back whole, and nothing would be moved): the writer's churn is what runs concurrently.
    o.auto_compact = false;
    ASSERT_NO_FATAL_FAILURE(Open(o));
    for (size_t i = 0; i < kObjects; ++i) {
      far_bytes b = make_far_bytes_in(*rt_, kObjectSize);
      {
        DerefScope s;
        Fill(b.deref_mut(s), i, 1);
      }
      objs_.push_back(std::move(b));
      versions_.push_back(1);
    }
    const Status evicted = rt_->EvictUntil(0);
    ASSERT_TRUE(evicted.ok()) << evicted.ToString();
  }

  // Leases the runtime holds on daemon d (the client's own bookkeeping).
  size_t LeasesOn(size_t d) {
    for (const client::NodeInfo& n : rt_->cluster().nodes()) {
      if (n.endpoint == (*daemons_)[d].endpoint()) return n.leases_held;
    }
    return 0;
  }

  // A daemon holding the first member of the first slab group: the group the first objects were
  // evicted to, full of rows (later groups may hold only a few, or none yet).
  size_t Busiest() {
    const std::vector<std::vector<Endpoint>> layout = rt_->span_set_layout();
    if (layout.empty() || layout[0].empty()) return 0;
    for (size_t d = 0; d < daemons_->size(); ++d) {
      if ((*daemons_)[d].endpoint() == layout[0][0]) return d;
    }
    return 0;
  }

  // Rewrites every seventh object (a new version each time) and evicts, over and over, until
  // stopped: span sets are written (and rows freed) while members move.
  void StartWriter() {
    writer_ = std::thread([this] {
      uint64_t round = 0;
      while (!stop_.load()) {
        ++round;
        // The same seventh every round: the other objects are only read back at the end, so
        // what the move did not carry over shows.
        for (size_t i = 0; i < objs_.size() && !stop_.load(); i += 7) {
          DerefScope s;
          auto got = objs_[i].try_deref_mut(s);
          if (!got) {
            writer_error_ = "object " + std::to_string(i) + ": " + got.error().ToString();
            return;
          }
          if (!Matches(*got, i, versions_[i])) {
            writer_error_ = "object " + std::to_string(i) + " came back wrong during the move";
            return;
          }
          Fill(*got, i, ++versions_[i]);
        }
        // Best effort: a span the compactor or prefetcher holds right now stays resident
        // (ResourceExhausted); what counts is that span sets keep being written.
        if (Status e = rt_->EvictUntil(0); !e.ok() && e.code() != StatusCode::kResourceExhausted) {
          writer_error_ = "evicting during the move: " + e.ToString();
          return;
        }
        ++writer_rounds_;
      }
    });
  }
  void StopWriter() {
    stop_ = true;
    if (writer_.joinable()) writer_.join();
  }

  void ExpectIntact(const char* when) {
    for (size_t i = 0; i < objs_.size(); ++i) {
      DerefScope s;
      auto got = objs_[i].try_deref(s);
      ASSERT_TRUE(got.has_value()) << when << ": object " << i << ": " << got.error().ToString();
      ASSERT_TRUE(Matches(*got, i, versions_[i])) << when << ": object " << i << " came back wrong";
    }
  }

  testing::CommandResult Farmemctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {testing::BinPath("farmemctl")};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--secret-file", daemons_->work_dir() + "/secret"});
    return testing::RunCommand(argv, std::chrono::seconds(kGraceMs / 1000 + 30));
  }

  // What must hold after a move: every object intact, nothing counted failed, lost or degraded.
  void ExpectMovedCleanly(size_t drained, size_t leases_before) {
    ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the drain"));
    const RuntimeStats s = rt_->stats();
    std::fprintf(stderr,
                 "moved %lu member(s) off daemon %zu (%zu leases): last %lu ms, longest %lu ms "
                 "from the notice to the freed lease, at least %lu ms before the deadline; "
                 "writer rounds during the drain: %lu\n",
                 static_cast<unsigned long>(s.members_moved), drained, leases_before,
                 static_cast<unsigned long>(s.move_last_ms),
                 static_cast<unsigned long>(s.move_max_ms),
                 static_cast<unsigned long>(s.move_min_slack_ms),
                 static_cast<unsigned long>(writer_rounds_.load()));
    // Some groups may empty (compaction, rewrites) and go back whole instead of moving.
    EXPECT_GT(s.members_moved, 0u);
    EXPECT_EQ(s.members_failed, 0u) << "a noticed member was treated as failed";
    EXPECT_EQ(s.members_reprotected, 0u) << "rebuilt from redundancy instead of moved";
    EXPECT_EQ(s.degraded_reads, 0u);
    EXPECT_EQ(s.degraded_span_sets, 0u);
    EXPECT_EQ(s.unrecoverable_span_sets, 0u);
    EXPECT_EQ(s.spans_lost, 0u);
    EXPECT_EQ(s.moves_pending, 0u);
    EXPECT_EQ(LeasesOn(drained), 0u);
  }

  // `farmemctl drain --wait` on the busiest daemon while the writer runs: it must return (the
  // daemon holds no lease) well before the grace period ends.
  void DrainBusiest(const std::string& resilience) {
    ASSERT_NO_FATAL_FAILURE(OpenWith(resilience));
    const size_t d = Busiest();
    const size_t before = LeasesOn(d);
    ASSERT_GT(before, 0u);
    StartWriter();
    const auto t0 = steady_clock::now();
    testing::CommandResult r = Farmemctl({"drain", (*daemons_)[d].endpoint().ToString(),
                                          "--grace-ms", std::to_string(kGraceMs), "--wait"});
    const auto took = std::chrono::duration_cast<milliseconds>(steady_clock::now() - t0);
    StopWriter();
    ASSERT_TRUE(writer_error_.empty()) << writer_error_ << "\n" << daemons_->Logs(1500);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err << daemons_->Logs(1500);
    std::fprintf(stderr, "%s: drain of %zu lease(s) done in %ld ms (grace %u ms)\n",
                 resilience.c_str(), before, static_cast<long>(took.count()), kGraceMs);
    EXPECT_LT(took, milliseconds(kGraceMs / 2)) << "the drain waited for the deadline";
    ASSERT_NO_FATAL_FAILURE(ExpectMovedCleanly(d, before));
  }

  void TearDown() override {
    StopWriter();
    FarptrTest::TearDown();
  }

  std::vector<far_bytes> objs_;
  std::vector<uint64_t> versions_;  // the writer's (joined before the main thread reads them)
  std::thread writer_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> writer_rounds_{0};
  std::string writer_error_;
};

// No redundancy: today's failure mode was to lose every object on the drained daemon.
TEST_F(FarEvictNoticeTest, DrainWithoutRedundancyMovesEverySpanAndLosesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(3));
  ASSERT_NO_FATAL_FAILURE(DrainBusiest("none"));
}

TEST_F(FarEvictNoticeTest, DrainWithReplicationMovesWithoutADegradedEpisode) {
  ASSERT_NO_FATAL_FAILURE(Start(3));
  ASSERT_NO_FATAL_FAILURE(DrainBusiest("replicate:2"));
}

TEST_F(FarEvictNoticeTest, DrainWithErasureCodingMovesWithoutADegradedEpisode) {
  ASSERT_NO_FATAL_FAILURE(Start(4));  // ec:2+1 groups use 3: the fourth takes the moved members
  ASSERT_NO_FATAL_FAILURE(DrainBusiest("ec:2+1"));
}

// SIGTERM with --drain-timeout runs the same path: the daemon exits as soon as the runtime has
// moved everything, long before its timeout; nothing is lost or degraded.
TEST_F(FarEvictNoticeTest, SigtermDrainOfAnErasureCodedMemberExitsEarlyLosesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(4, {"--drain-timeout", std::to_string(kGraceMs)}));
  ASSERT_NO_FATAL_FAILURE(OpenWith("ec:2+1"));
  const size_t d = Busiest();
  const size_t before = LeasesOn(d);
  ASSERT_GT(before, 0u);
  StartWriter();
  const auto t0 = steady_clock::now();
  Status stopped = (*daemons_)[d].Stop(milliseconds(kGraceMs + 5000));
  const auto took = std::chrono::duration_cast<milliseconds>(steady_clock::now() - t0);
  StopWriter();
  ASSERT_TRUE(writer_error_.empty()) << writer_error_;
  EXPECT_TRUE(stopped.ok()) << stopped.ToString();
  std::fprintf(stderr, "SIGTERM drain of %zu lease(s): the daemon exited after %ld ms\n", before,
               static_cast<long>(took.count()));
  EXPECT_LT(took, milliseconds(kGraceMs / 2)) << "the daemon waited for its drain timeout";
  ASSERT_NO_FATAL_FAILURE(ExpectMovedCleanly(d, before));
}

// Nowhere to go: ec:2+1 on exactly three daemons (every group uses all of them). The drained
// member cannot be moved, so the group runs degraded at once — saying so — and its lease goes
// back; reads still work, and nothing is lost.
TEST_F(FarEvictNoticeTest, NoRoomElsewhereRunsDegradedAndGivesTheMemoryBack) {
  ASSERT_NO_FATAL_FAILURE(Start(3));
  ASSERT_NO_FATAL_FAILURE(OpenWith("ec:2+1"));
  const size_t d = Busiest();
  ASSERT_GT(LeasesOn(d), 0u);
  const auto t0 = steady_clock::now();
  testing::CommandResult r =
      Farmemctl({"drain", (*daemons_)[d].endpoint().ToString(), "--grace-ms", "60000", "--wait"});
  const auto took = std::chrono::duration_cast<milliseconds>(steady_clock::now() - t0);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_LT(took, milliseconds(30000)) << "the lease was not given back before the deadline";
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("degraded after a drain with no room elsewhere"));
  const RuntimeStats s = rt_->stats();
  EXPECT_EQ(s.members_moved, 0u);
  EXPECT_GT(s.members_failed, 0u);
  EXPECT_EQ(s.spans_lost, 0u);
  EXPECT_EQ(LeasesOn(d), 0u);
}

// No redundancy and, at the notice, no room anywhere else (the other daemon is full of another
// client's slabs): the move waits. When that client frees memory before the deadline the member
// is moved and nothing is lost; in a second round nobody frees, the deadline passes, and exactly
// the objects that lived there fail with DataLoss — never wrong bytes.
TEST_F(FarEvictNoticeTest, NoneWaitsForRoomUntilTheDeadlineThenLosesOnlyWhatLivedThere) {
  ASSERT_NO_FATAL_FAILURE(Start(2));
  // Fill daemon 1 from another client, so the runtime's groups all land on daemon 0.
  std::unique_ptr<client::Cluster> filler = ConnectFiller(1);
  ASSERT_TRUE(filler);
  std::vector<client::Lease> held;
  TakeAllRoom(*filler, &held);
  ASSERT_GT(held.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(OpenWith("none"));
  ASSERT_EQ(LeasesOn(1), 0u);
  const size_t before = LeasesOn(0);
  ASSERT_GT(before, 0u);

  // Round 1: room appears (the filler frees) before the deadline.
  testing::CommandResult r =
      Farmemctl({"drain", (*daemons_)[0].endpoint().ToString(), "--grace-ms", "60000"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  ASSERT_TRUE(
      testing::WaitUntil([&] { return rt_->stats().moves_pending > 0; }, std::chrono::seconds(10)));
  EXPECT_EQ(rt_->stats().members_moved, 0u) << "moved to where?";
  ASSERT_TRUE(filler->Free(held).ok());
  held.clear();
  ASSERT_TRUE(testing::WaitUntil([&] { return LeasesOn(0) == 0; }, std::chrono::seconds(20)))
      << "not moved once the other daemon had room: " << daemons_->Logs(1500);
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after waiting for room"));
  EXPECT_EQ(rt_->stats().members_failed, 0u);
  EXPECT_EQ(rt_->stats().spans_lost, 0u);

  // Round 2: everything now lives on daemon 1. Daemon 0 grants again, but only to another
  // client, which takes all its room; the objects are written anew (on daemon 1, the only one with
  // room for the runtime), and then daemon 1 gives a short notice that runs out.
  r = Farmemctl({"undrain", (*daemons_)[0].endpoint().ToString()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::unique_ptr<client::Cluster> filler0 = ConnectFiller(0);
  ASSERT_TRUE(filler0);
  std::vector<client::Lease> held0;
  TakeAllRoom(*filler0, &held0);
  ASSERT_GT(held0.size(), 0u);
  for (size_t i = 0; i < objs_.size(); ++i) {  // a new version of everything, written anew
    DerefScope s;
    Fill(objs_[i].deref_mut(s), i, ++versions_[i]);
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_EQ(LeasesOn(0), 0u);
  ASSERT_GT(LeasesOn(1), 0u);
  r = Farmemctl({"drain", (*daemons_)[1].endpoint().ToString(), "--grace-ms", "1500"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  ASSERT_TRUE(testing::WaitUntil([&] { return rt_->stats().unrecoverable_span_sets > 0; },
                                 std::chrono::seconds(15)))
      << "the deadline passed without the member being given up";
  size_t lost = 0;
  for (size_t i = 0; i < objs_.size(); ++i) {
    DerefScope s;
    auto got = objs_[i].try_deref(s);
    if (!got) {
      EXPECT_EQ(got.error().code(), StatusCode::kDataLoss) << got.error().ToString();
      ++lost;
      continue;
    }
    ASSERT_TRUE(Matches(*got, i, versions_[i])) << "object " << i << " came back wrong";
  }
  EXPECT_GT(lost, 0u);
  std::fprintf(stderr, "deadline passed with no room: %zu of %zu objects lost (DataLoss)\n", lost,
               objs_.size());
}

}  // namespace
}  // namespace farmem::farptr_test
