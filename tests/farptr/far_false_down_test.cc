// A false down is not a loss under far_ptr (issue #11): with resilience none, a daemon holding
// span sets is SIGSTOPped for longer than the failure timeout, so the client declares it down,
// then SIGCONTed: the same process, with every lease and its contents. Before the fix the
// runtime gave its members up as LOST at once (no other copy) and the client FREEd its leases
// when it answered again; now the members wait for it, come back, and every object reads back.
#include <gtest/gtest.h>

#include <chrono>

#include "farmem/client/cluster.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

using namespace std::chrono_literals;

class FarFalseDownTest : public FarptrTest {};

TEST_F(FarFalseDownTest, NoneSurvivesPauseLongerThanFailureTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "16M"));
  RuntimeOptions o = Options("none", 64u << 10);
  o.failure_timeout = 600ms;
  o.reconcile_interval = 200ms;  // a pass that would give the members up runs soon
  ASSERT_NO_FATAL_FAILURE(Open(o));
  auto objs = MakePoints(20000);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_GT(rt_->stats().remote_spans, 0u);

  const size_t victim = DaemonOfFirstMember();
  ASSERT_LT(victim, daemons_->size());
  client::Cluster& cluster = rt_->cluster();
  client::NodeId node = 0;
  for (const client::NodeInfo& n : cluster.nodes()) {
    if (n.endpoint == (*daemons_)[victim].endpoint()) node = n.id;
  }
  auto daemon_leases = [&] {
    auto st = cluster.Stat(node);
    EXPECT_TRUE(st.has_value()) << st.error().ToString();
    return st ? st->total_slabs - st->free_slabs : 0u;
  };
  const size_t held_before = cluster.node(node).leases_held;
  const uint32_t leases_before = daemon_leases();
  ASSERT_GT(held_before, 0u);

  (*daemons_)[victim].Pause();
  ASSERT_TRUE(cluster.WaitForNode(node, client::NodeState::kDown, 20s).ok());
  // The runtime has marked the members there failed (and, before the fix, given them up).
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return rt_->stats().members_failed > 0; }, 10s));
  (*daemons_)[victim].Resume();
  ASSERT_TRUE(cluster.WaitForNode(node, client::NodeState::kUp, 20s).ok());
  ASSERT_TRUE(farmem::testing::WaitUntil(
      [&] { return cluster.node(node).leases_held == held_before; }, 10s))
      << "the leases on the paused daemon did not come back (held "
      << cluster.node(node).leases_held << ", had " << held_before << ")";
  Status rec = rt_->WaitForRecovery(10s);
  ASSERT_TRUE(rec.ok()) << rec.ToString();

  ExpectAllRight(objs, "after the paused daemon resumed");
  const RuntimeStats s = rt_->stats();
  EXPECT_EQ(s.spans_lost, 0u);
  EXPECT_EQ(s.unrecoverable_span_sets, 0u);
  EXPECT_EQ(daemon_leases(), leases_before) << "leases were freed on the resumed daemon";
}

}  // namespace
}  // namespace farmem::farptr_test
