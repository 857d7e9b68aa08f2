// far_ptr failure interleavings on the fake transport (tests/support/fake_fabric.h): in-process
// daemons whose data ops are served from memory under a script. Which daemons a span set or a
// swap-in reaches first is placement's choice, so the faults are scripted by predicate (the first
// write to a second daemon, the first read) rather than by op number, and every case checks that
// its fault was reached. Compaction is off, and with it its offload: the offload's GATHER_CELL and
// PARITY_ENCODE go over the control connection, which the fake serves for real but cannot script,
// and none of these cases needs them. Each case runs in well under a second and waits on state;
// the real-daemon tests (far_fault_injection_test.cc, far_reprotect_test.cc) cover the same paths
// over TCP.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

#include "farmem/client/cluster.h"
#include "farptr_fixture.h"
#include "support/fake_fabric.h"

namespace farmem::farptr_test {
namespace {

using farmem::testing::FakeFabric;
using std::chrono::milliseconds;
using transport::OpType;

constexpr size_t kNoNode = ~size_t{0};

class FarPtrFakeTest : public ::testing::Test {
 protected:
  // ec:2+1 over `nodes` in-process daemons, and `n` objects {i, i % 7}, all still local.
  void Start(size_t nodes, uint64_t n) {
    fabric_ = std::make_unique<FakeFabric>(farmem::testing::FakeFabricConfig{.nodes = nodes});
    ASSERT_TRUE(fabric_->Start().ok());
    const client::ClusterOptions fast = fabric_->ClusterOptionsForTest();
    RuntimeOptions o = farmem::testing::TestRuntimeOptions(fabric_->endpoints(), fabric_->secret(),
                                                           "ec:2+1", 1 << 20);
    o.data_transport = fabric_->transport();
    o.heartbeat_interval = fast.heartbeat_interval;
    o.failure_timeout = fast.failure_timeout;
    // What a read whose reply is lost waits before its member is failed.
    o.op_timeout = milliseconds(500);
    o.reconcile_interval = milliseconds(100);
    o.auto_compact = false;
    o.parity_offload = false;
    o.prefetch_threads = 0;
    auto rt = Runtime::Create(o);
    ASSERT_TRUE(rt.has_value()) << rt.error().ToString();
    rt_ = std::move(*rt);
    objs_ = MakePoints(n);
  }

  void TearDown() override {
    objs_.clear();
    rt_.reset();
    fabric_.reset();
  }

  void ExpectAllRight(const char* when) { farptr_test::ExpectAllRight(objs_, when); }

  // Re-protection has caught up: nothing degraded, nothing waiting.
  void WaitWhole(const char* when) {
    const Status s = rt_->WaitForRecovery(std::chrono::seconds(10));
    ASSERT_TRUE(s.ok()) << when << ": " << s.ToString();
    EXPECT_EQ(rt_->stats().degraded_span_sets, 0u) << when;
  }

  std::unique_ptr<FakeFabric> fabric_;
  std::unique_ptr<Runtime> rt_;
  std::vector<far_ptr<Point>> objs_;
};

// ec:2+1 over four daemons. Half the spans are out (two span sets in the first slab group); while
// the rest are written, the second daemon to receive a member write dies just before it is served
// (the first daemon took its member of the set). The objects read back right, the member is
// rebuilt on the spare (decoded from the two survivors) and the set written there, and what the
// spare holds is right: with the daemon that took the first write killed afterwards, every object
// still reads back.
TEST_F(FarPtrFakeTest, MemberDiesInTheMiddleOfASpanSetWrite) {
  ASSERT_NO_FATAL_FAILURE(Start(4, 4000));  // 8 spans of 16 KiB
  ASSERT_TRUE(rt_->EvictUntil(rt_->stats().local_bytes / 2).ok());
  ASSERT_GE(rt_->stats().span_sets, 1u);
  std::atomic<size_t> first{kNoNode}, victim{kNoNode};
  fabric_->AtFirst(FakeFabric::OfType(OpType::kWrite), [&](size_t node) {
    first = node;
    fabric_->AtFirst(
        [node](size_t n, const transport::Op& op) {
          return n != node && op.type == OpType::kWrite;
        },
        [&](size_t n) {
          victim = n;
          fabric_->Kill(n);
        });
  });
  const Status evicted = rt_->EvictUntil(0);
  ASSERT_NE(victim.load(), kNoNode) << "no span set reached a second daemon";
  EXPECT_TRUE(evicted.ok()) << evicted.ToString();
  EXPECT_EQ(rt_->stats().local_bytes, 0u);
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("after a member died mid-write"));
  EXPECT_GE(rt_->stats().members_failed, 1u);
  ASSERT_NO_FATAL_FAILURE(WaitWhole("after the member died"));
  EXPECT_GE(rt_->stats().members_reprotected, 1u);
  // The three live daemons hold every group now; without the one that took the first member
  // write, each span is produced by the other two, one of them the spare.
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  fabric_->Kill(first);
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("without the first member's daemon"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// Every object is remote; the reply to the first swap-in read is lost (the daemon serves it, its
// answer never comes, the daemon stays up). The read gives up at the op timeout, the member is
// failed, and the span is read again, right: degraded from the other two members, or from the
// member's replacement when the recovery thread rebuilt it first (four span sets: under a
// millisecond), so the test does not ask which. The heap is whole again afterwards.
TEST_F(FarPtrFakeTest, ReplyDroppedDuringSwapIn) {
  ASSERT_NO_FATAL_FAILURE(Start(4, 4000));
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_EQ(rt_->stats().local_bytes, 0u);
  std::atomic<size_t> dropped_on{kNoNode};
  fabric_->DropReplyFirst([&](size_t n, const transport::Op& op) {
    if (op.type != OpType::kRead) return false;
    dropped_on = n;
    return true;
  });
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("with one swap-in reply lost"));
  ASSERT_NE(dropped_on.load(), kNoNode) << "no swap-in read reached a daemon";
  RuntimeStats st = rt_->stats();
  EXPECT_GE(st.members_failed, 1u);
  EXPECT_EQ(st.spans_lost, 0u);
  EXPECT_TRUE(fabric_->alive(dropped_on));
  ASSERT_NO_FATAL_FAILURE(WaitWhole("after the lost reply"));
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight("after re-protection"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

}  // namespace
}  // namespace farmem::farptr_test
