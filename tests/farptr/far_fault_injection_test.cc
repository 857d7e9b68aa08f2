// far_ptr failure interleavings made deterministic with the fault injector
// (transport/fault_injection.h): the daemons, leases and failure detection stay real; only which
// data op of which daemon fails or waits is decided by the test. Each test asserts on the
// runtime's state (degraded reads, re-protected members, nothing lost), not on timing.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/transport/fault_injection.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

class FarFaultInjectionTest : public FarptrTest {
 protected:
  // ec:2+1 over four daemons (one spare), every data channel through `faults_`; `n` objects
  // {i, i % 7}, all evicted, so every read below is a remote one.
  void StartRemote(uint64_t n) {
    ASSERT_NO_FATAL_FAILURE(StartDaemons(4));
    RuntimeOptions o = Options("ec:2+1", 1 << 20);
    o.fault_injector = faults_;
    ASSERT_NO_FATAL_FAILURE(Open(o));
    objs_ = MakePoints(n);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    ASSERT_EQ(rt_->stats().local_bytes, 0u);
  }

  // The daemon of data member 0 of the first slab group.
  Endpoint FirstDataMember() const {
    const auto layout = rt_->span_set_layout();
    return layout.empty() ? Endpoint{} : layout[0][0];
  }

  void ExpectAllRight(const char* when) { farptr_test::ExpectAllRight(objs_, when); }

  std::shared_ptr<transport::FaultInjector> faults_ = std::make_shared<transport::FaultInjector>();
  std::vector<far_ptr<Point>> objs_;
};

// Every data op to one member's daemon is refused (its control connection, and so the cluster's
// view of it, stays healthy): the member is marked failed on the first refusal, every span that
// lived there is rebuilt from the other two members (degraded reads, right bytes), and once the
// daemon serves data again the member is re-protected and the store is whole.
TEST_F(FarFaultInjectionTest, RefusedMemberIsReadDegradedThenReprotected) {
  ASSERT_NO_FATAL_FAILURE(StartRemote(20000));
  const Endpoint victim = FirstDataMember();
  ASSERT_NE(victim.port, 0);
  faults_->Fail(victim, RemoteAccessError("injected: data ops refused"));  // until Clear
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("with one member's daemon refusing data"));
  RuntimeStats st = rt_->stats();
  EXPECT_GT(faults_->ops_failed(victim), 0u) << "no read went to the refusing daemon";
  EXPECT_GT(st.degraded_reads, 0u);
  EXPECT_EQ(st.spans_lost, 0u);
  faults_->Clear(victim);
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return rt_->stats().members_reprotected >= 1; },
                                         std::chrono::seconds(30)))
      << "the failed member was not re-protected";
  ASSERT_TRUE(rt_->WaitForRecovery().ok());
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("after re-protection"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// A member's daemon that takes data ops but never answers them (held: a gray failure the
// heartbeats do not see, so the cluster never declares it down): the read waits for the op
// timeout once, then the member is failed and its spans are read degraded, right.
TEST_F(FarFaultInjectionTest, HeldMemberTimesOutOnceThenIsReadDegraded) {
  ASSERT_NO_FATAL_FAILURE(StartRemote(20000));
  const Endpoint victim = FirstDataMember();
  ASSERT_NE(victim.port, 0);
  faults_->Hold(victim);
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("with one member's daemon holding data ops"));
  const RuntimeStats st = rt_->stats();
  EXPECT_GT(faults_->ops_held(victim), 0u) << "no read went to the holding daemon";
  EXPECT_GT(st.degraded_reads, 0u);
  EXPECT_EQ(st.spans_lost, 0u);
  for (const client::NodeInfo& n : rt_->cluster().nodes()) {
    if (n.endpoint == victim) {
      EXPECT_TRUE(n.alive) << "the held daemon was declared down";
    }
  }
  faults_->Release(victim);
  ASSERT_TRUE(rt_->WaitForRecovery().ok());
}

}  // namespace
}  // namespace farmem::farptr_test
