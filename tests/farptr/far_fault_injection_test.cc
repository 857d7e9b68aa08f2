// far_ptr failure interleavings made deterministic with the fault injector
// (transport/fault_injection.h): the daemons, leases and failure detection stay real; only which
// data op of which daemon fails or waits is decided by the test. Each test asserts on the
// runtime's state (degraded reads, re-protected members, nothing lost), not on timing.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/far_hash_map.h"
#include "farmem/transport/fault_injection.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

class FarFaultInjectionTest : public FarptrTest {
 protected:
  // ec:2+1 over four daemons (one spare), every data channel through `faults_`; `n` objects
  // {i, i % 7}, all evicted, so every read below is a remote one. The budget (8 MiB) holds them
  // all once read back: reading them evicts nothing, so no span is written out meanwhile and the
  // first op to reach a faulty daemon is a read. (With 1 MiB, a gathered span written out during
  // the reads could meet the refusal first: its set is then committed degraded and the member
  // re-protected from the others within milliseconds, before any read needed it degraded.)
  void StartRemote(uint64_t n) {
    ASSERT_NO_FATAL_FAILURE(StartDaemons(4));
    RuntimeOptions o = Options("ec:2+1", 8 << 20);
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

// A gathering miss reads only its object's bytes (a piece of the cell, into a small scratch
// area rather than a frame); when the member is refused, the piece comes from the cell rebuilt
// from the other two members. One object of each of many spans is read, so every miss gathers:
// the objects read back right, some of them degraded, and none lost.
TEST_F(FarFaultInjectionTest, GatheringMissOnARefusedMemberReadsItsObjectDegraded) {
  ASSERT_NO_FATAL_FAILURE(StartRemote(20000));
  const Endpoint victim = FirstDataMember();
  ASSERT_NE(victim.port, 0);
  faults_->Fail(victim, RemoteAccessError("injected: data ops refused"));  // until Clear
  const RuntimeStats before = rt_->stats();
  uint64_t read = 0;
  for (uint64_t i = 0; i < objs_.size(); i += 997, ++read) {
    DerefScope s;
    auto p = objs_[i].try_deref(s);
    ASSERT_TRUE(p.has_value()) << "object " << i << ": " << p.error().ToString();
    ASSERT_EQ((*p)->id, i);
    ASSERT_EQ((*p)->version, i % 7);
  }
  const RuntimeStats st = rt_->stats();
  EXPECT_EQ(st.objects_gathered - before.objects_gathered, read) << "a miss did not gather";
  EXPECT_GT(faults_->ops_failed(victim), 0u) << "no read went to the refusing daemon";
  EXPECT_GT(st.degraded_reads, before.degraded_reads);
  EXPECT_EQ(st.spans_lost, 0u);
  faults_->Clear(victim);
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

// A far_hash_map whose every read can be held at its one daemon: 4096 keys {k, k * 10} in 1024
// buckets of 4 entries (a few spans), every bucket evicted but key 0's, local and already written
// to (dirty): a writer to key 0 needs no I/O. Bucket b is guarded by stripe b % 256, so keys 0,
// 256, 512 and 768 share stripe 0 in different buckets.
class FarHashMapHeldReadTest : public FarFaultInjectionTest {
 protected:
  static constexpr uint64_t kKeys = 4096;
  static constexpr uint64_t kLocalKey = 0;

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
    RuntimeOptions o = Options("none", 1 << 20);
    o.fault_injector = faults_;
    o.op_timeout = std::chrono::seconds(60);  // the held reads wait for Release, not for a timeout
    ASSERT_NO_FATAL_FAILURE(Open(o));
    m_ = std::make_unique<far_hash_map<uint64_t, uint64_t>>(*rt_, kKeys);
    for (uint64_t k = 0; k < kKeys; ++k) m_->insert_or_assign(k, k * 10);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    m_->insert_or_assign(kLocalKey, 1);
  }
  void TearDown() override {
    m_.reset();
    FarFaultInjectionTest::TearDown();
  }

  // Runs `op` on a thread of its own with the daemon's data ops held; once one of its reads is
  // held, another thread writes 2 to key 0. Asserts that `op` reached the daemon and that the
  // write completed while its read was held (the bound is generous: the write is a few
  // microseconds of local work), then lets the reads go and waits for `op`.
  void ExpectWriteToKey0WhileHeld(const std::function<void()>& op, const char* what) {
    const Endpoint daemon = (*daemons_)[0].endpoint();
    faults_->Hold(daemon);
    std::thread reader(op);
    const bool reading = farmem::testing::WaitUntil([&] { return faults_->ops_held(daemon) > 0; },
                                                    std::chrono::seconds(30));
    std::atomic<bool> wrote{false};
    std::thread writer([&] {
      m_->insert_or_assign(kLocalKey, 2);
      wrote = true;
    });
    const bool written =
        farmem::testing::WaitUntil([&] { return wrote.load(); }, std::chrono::seconds(10));
    faults_->Release(daemon);
    reader.join();
    writer.join();
    ASSERT_TRUE(reading) << what << ": its reads never reached the daemon";
    EXPECT_TRUE(written) << "a write to another key of the stripe that " << what
                         << " reads waited for its round trip";
    EXPECT_EQ(m_->find(kLocalKey), std::optional<uint64_t>(2));
  }

  std::unique_ptr<far_hash_map<uint64_t, uint64_t>> m_;
};

// far_hash_map::get_many holds no bucket lock across its reads (issue 13, item 5: threads that
// share a map must not wait for each other's round trips). While the batch's reads are held at
// the daemon, a writer to a key in one of the batch's buckets completes — it waited for the whole
// round trip while get_many kept the batch's stripes read-locked over its reads — and the batch
// then returns the right values.
TEST_F(FarHashMapHeldReadTest, GetManyHoldsNoBucketLockAcrossItsReads) {
  // The batch: key 0 and keys whose buckets are remote (each in a bucket of its own).
  const std::vector<uint64_t> keys = {kLocalKey, 101, 202, 303, 404, 505, 606, 707, 808};
  std::vector<std::optional<uint64_t>> got(keys.size());
  ASSERT_NO_FATAL_FAILURE(ExpectWriteToKey0WhileHeld([&] { m_->get_many(keys, got); }, "get_many"));
  ASSERT_TRUE(got[0].has_value());
  EXPECT_TRUE(*got[0] == 1 || *got[0] == 2) << *got[0];
  for (size_t i = 1; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].has_value()) << "key " << keys[i];
    EXPECT_EQ(*got[i], keys[i] * 10) << "key " << keys[i];
  }
}

// The same for a single find: a miss on bucket 256 (stripe 0, as key 0's bucket) read-locked
// stripe 0 for its round trip, so a writer to key 0 waited for it; the miss is now read holding no
// lock, then looked up under the stripe.
TEST_F(FarHashMapHeldReadTest, FindHoldsNoBucketLockAcrossItsMiss) {
  std::optional<uint64_t> got;
  ASSERT_NO_FATAL_FAILURE(ExpectWriteToKey0WhileHeld([&] { got = m_->find(256); }, "find"));
  EXPECT_EQ(got, std::optional<uint64_t>(2560));
}

// And for a write: update on key 512 (stripe 0) write-locked the stripe across its bucket's
// miss; now the bucket is read first, holding no lock, and changed under the write lock.
TEST_F(FarHashMapHeldReadTest, UpdateHoldsNoBucketLockAcrossItsMiss) {
  bool inserted = true;
  ASSERT_NO_FATAL_FAILURE(ExpectWriteToKey0WhileHeld(
      [&] { inserted = m_->update(512, [](uint64_t& v) { v += 1; }); }, "update"));
  EXPECT_FALSE(inserted);
  EXPECT_EQ(m_->find(512), std::optional<uint64_t>(5121));
}

}  // namespace
}  // namespace farmem::farptr_test
