// Re-protection of span sets against real farmemd daemons (issue 11, defects 1 and 6):
//   - a daemon restarted empty on its port is used to rebuild the members it lost, so a second
//     failure afterwards loses nothing;
//   - span sets are written degraded while fewer than k + r (but at least k) daemons are up, and
//     re-protected as soon as the others start;
//   - a daemon that frees memory (no event says so) is found by the periodic reconcile;
//   - a set beyond what its resilience survives gives DataLoss for exactly its objects, never
//     wrong bytes.
// Each test prints how long re-protection took (FARPTR_TEST_STATS=1 prints the runtime's stats).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr size_t kObjects = 3000;
constexpr size_t kObjectSize = 700;  // 3000 x 720 B slots: ~2 MiB, several slab groups' rows

class FarReprotectTest : public FarptrTest {
 protected:
  // ec:k+r with a budget far below the objects, so EvictUntil(0) leaves them all remote.
  void OpenEc(const std::string& resilience, bool auto_compact = true) {
    RuntimeOptions o = Options(resilience, 256u << 10);
    o.reconcile_interval = milliseconds(500);
    o.auto_compact = auto_compact;
    ASSERT_NO_FATAL_FAILURE(Open(o));
  }

  void MakeObjects() {
    for (size_t i = 0; i < kObjects; ++i) {
      far_bytes b = make_far_bytes_in(*rt_, kObjectSize);
      {
        DerefScope s;
        Fill(b.deref_mut(s), i, 1);
      }
      objs_.push_back(std::move(b));
    }
  }

  // Every object reads back with its own bytes.
  void ExpectIntact(const char* when) {
    for (size_t i = 0; i < objs_.size(); ++i) {
      DerefScope s;
      auto got = objs_[i].try_deref(s);
      ASSERT_TRUE(got.has_value()) << when << ": object " << i << ": " << got.error().ToString();
      ASSERT_TRUE(Matches(*got, i, 1)) << when << ": object " << i << " came back wrong";
    }
  }

  // Polls `done` (state, not time) until it holds or `limit` passes; true if it held.
  template <class Pred>
  bool WaitFor(Pred done, std::chrono::seconds limit) {
    return farmem::testing::WaitUntil(done, limit, milliseconds(10));
  }

  // Leases the runtime holds on daemon d (by the client's own bookkeeping).
  size_t LeasesOn(size_t d) {
    for (const client::NodeInfo& n : rt_->cluster().nodes()) {
      if (n.endpoint == (*daemons_)[d].endpoint()) return n.leases_held;
    }
    return 0;
  }

  std::string Describe(const RuntimeStats& s) {
    return "degraded sets " + std::to_string(s.degraded_span_sets) + ", unrecoverable sets " +
           std::to_string(s.unrecoverable_span_sets) + ", members re-protected " +
           std::to_string(s.members_reprotected) + ", sets " + std::to_string(s.span_sets) + "\n" +
           daemons_->Logs(600);
  }

  std::vector<far_bytes> objs_;
};

// Defect 1: ec:2+1 on three daemons. Kill one and restart it empty on the same port: the members
// it held are rebuilt there (the only daemon outside each group's survivors). Then kill another:
// every object still reads back right.
TEST_F(FarReprotectTest, RestartedDaemonIsUsedForReprotectionSoASecondKillLosesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "16M"));
  ASSERT_NO_FATAL_FAILURE(OpenEc("ec:2+1"));
  ASSERT_NO_FATAL_FAILURE(MakeObjects());
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const RuntimeStats before = rt_->stats();
  ASSERT_GT(before.remote_spans, 0u);
  ASSERT_EQ(before.degraded_span_sets, 0u);
  const uint64_t groups = rt_->span_set_layout().size();
  ASSERT_GT(groups, 0u);

  (*daemons_)[0].Kill();
  ASSERT_TRUE((*daemons_)[0].Start().ok());  // same port, no leases: a new incarnation
  const auto restarted = steady_clock::now();
  // Every group had a member on daemon 0 (three members on three daemons): each is rebuilt.
  const bool reprotected = WaitFor(
      [&] {
        const RuntimeStats s = rt_->stats();
        return s.members_reprotected >= before.members_reprotected + groups &&
               s.degraded_span_sets == 0;
      },
      std::chrono::seconds(15));
  ASSERT_TRUE(reprotected) << "not re-protected onto the restarted daemon: "
                           << Describe(rt_->stats());
  const auto took = std::chrono::duration_cast<milliseconds>(steady_clock::now() - restarted);
  std::fprintf(stderr,
               "re-protected %lu slab group(s) onto the restarted daemon %ld ms after it "
               "started (runtime: last %lu ms, max %lu ms from loss to re-protection)\n",
               static_cast<unsigned long>(groups), static_cast<long>(took.count()),
               static_cast<unsigned long>(rt_->stats().reprotect_last_ms),
               static_cast<unsigned long>(rt_->stats().reprotect_max_ms));
  EXPECT_GT(LeasesOn(0), 0u) << "the restarted daemon holds nothing";

  (*daemons_)[1].Kill();
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the second kill"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// Defect 6 (and 1): ec:2+1 with one of three daemons down when the runtime starts (still booting).
// Span sets are written degraded on the two that are up; once the third starts they are
// re-protected onto it, and a kill afterwards loses nothing.
TEST_F(FarReprotectTest, WritesDegradedWhileADaemonIsDownAndReprotectsWhenItStarts) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "16M"));
  (*daemons_)[2].Kill();  // known port, not running: a daemon that has not started yet
  ASSERT_NO_FATAL_FAILURE(OpenEc("ec:2+1"));
  ASSERT_NO_FATAL_FAILURE(MakeObjects());
  Status evicted = rt_->EvictUntil(0);
  ASSERT_TRUE(evicted.ok()) << "span sets were not written with 2 of 3 daemons up: "
                            << evicted.ToString();
  const RuntimeStats degraded = rt_->stats();
  ASSERT_GT(degraded.remote_spans, 0u);
  EXPECT_GT(degraded.degraded_sets_written, 0u);
  EXPECT_GT(degraded.degraded_span_sets, 0u);

  ASSERT_TRUE((*daemons_)[2].Start().ok());
  const auto started = steady_clock::now();
  const bool reprotected = WaitFor(
      [&] {
        const RuntimeStats s = rt_->stats();
        return s.members_reprotected > 0 && s.degraded_span_sets == 0;
      },
      std::chrono::seconds(15));
  ASSERT_TRUE(reprotected) << "not re-protected onto the daemon that started late: "
                           << Describe(rt_->stats());
  const auto took = std::chrono::duration_cast<milliseconds>(steady_clock::now() - started);
  std::fprintf(stderr, "re-protected onto the late daemon %ld ms after it started\n",
               static_cast<long>(took.count()));
  EXPECT_GT(LeasesOn(2), 0u);

  (*daemons_)[0].Kill();  // a data member of every group
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after a kill following re-protection"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// No event announces a daemon that frees memory: the periodic reconcile finds it. ec:2+1 on four
// daemons, the fourth filled by another client. A member's daemon dies: nowhere to re-protect.
// The other client frees its slabs: the degraded groups are re-protected there, and a second kill
// loses nothing.
TEST_F(FarReprotectTest, DaemonThatFreedMemoryIsFoundByTheReconcile) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(4, "16M"));
  std::unique_ptr<client::Cluster> filler = ConnectFiller(3);
  ASSERT_TRUE(filler);
  std::vector<client::Lease> held;
  TakeAllRoom(*filler, &held);
  ASSERT_GT(held.size(), 0u);
  ASSERT_NO_FATAL_FAILURE(OpenEc("ec:2+1"));
  ASSERT_NO_FATAL_FAILURE(MakeObjects());
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const uint64_t reprotected_before = rt_->stats().members_reprotected;

  (*daemons_)[0].Kill();
  ASSERT_TRUE(
      WaitFor([&] { return rt_->stats().degraded_span_sets > 0; }, std::chrono::seconds(15)))
      << "the kill was not noticed";
  EXPECT_EQ(rt_->stats().members_reprotected, reprotected_before) << "re-protected onto what?";
  ASSERT_TRUE(filler->Free(held).ok());
  const auto freed = steady_clock::now();
  ASSERT_TRUE(
      WaitFor([&] { return rt_->stats().degraded_span_sets == 0; }, std::chrono::seconds(15)))
      << "not re-protected onto the daemon that freed memory: " << Describe(rt_->stats());
  std::fprintf(stderr, "re-protected onto the daemon that freed memory %ld ms after it did\n",
               static_cast<long>(
                   std::chrono::duration_cast<milliseconds>(steady_clock::now() - freed).count()));
  EXPECT_GT(LeasesOn(3), 0u);
  (*daemons_)[1].Kill();
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after a second kill"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// Beyond tolerance: ec:2+1 written degraded on two daemons (the third never starts), then one of
// the two dies. Nothing can rebuild the spans that lived there: each of their objects says
// DataLoss, naming that daemon — none comes back with wrong bytes — while spans on the surviving
// daemon and objects that stayed local read back intact. (No background compaction: which
// objects are remote must not change under the test.)
TEST_F(FarReprotectTest, SetsBeyondToleranceFailCleanlyForExactlyTheirObjects) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "16M"));
  (*daemons_)[2].Kill();
  ASSERT_NO_FATAL_FAILURE(OpenEc("ec:2+1", /*auto_compact=*/false));
  ASSERT_NO_FATAL_FAILURE(MakeObjects());
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  for (size_t i = 0; i < objs_.size(); ++i) ASSERT_FALSE(objs_[i].is_local()) << i;
  // Objects made after the eviction stay local (well under the budget).
  std::vector<far_bytes> local;
  for (size_t i = 0; i < 50; ++i) {
    local.push_back(make_far_bytes_in(*rt_, kObjectSize));
    DerefScope s;
    Fill(local.back().deref_mut(s), 100000 + i, 1);
  }
  (*daemons_)[0].Kill();
  const std::string dead = (*daemons_)[0].endpoint().ToString();
  size_t lost = 0;
  for (size_t i = 0; i < objs_.size(); ++i) {
    DerefScope s;
    auto got = objs_[i].try_deref(s);
    if (!got.has_value()) {
      EXPECT_EQ(got.error().code(), StatusCode::kDataLoss) << got.error().ToString();
      EXPECT_NE(got.error().message().find(dead), std::string::npos) << got.error().ToString();
      ++lost;
      continue;
    }
    ASSERT_TRUE(Matches(*got, i, 1)) << "object " << i << " came back wrong";
  }
  // Every set lived on daemons 0 and 1 only: the spans on daemon 0 are gone, those on daemon 1
  // (the other data member) are not.
  EXPECT_GT(lost, 0u);
  EXPECT_LT(lost, objs_.size());
  for (size_t i = 0; i < local.size(); ++i) {
    DerefScope s;
    auto got = local[i].try_deref(s);
    ASSERT_TRUE(got.has_value()) << got.error().ToString();
    EXPECT_TRUE(Matches(*got, 100000 + i, 1));
  }
  EXPECT_GT(rt_->stats().unrecoverable_span_sets + rt_->stats().spans_lost, 0u);
}

}  // namespace
}  // namespace farmem::farptr_test
