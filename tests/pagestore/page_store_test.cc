// The remote page store against real farmemd processes: every resilience mode checked against a
// local shadow copy, with daemons killed under it.
#include "page_store_fixture.h"

namespace farmem::blockdev {
namespace {

using namespace pstest;

TEST(ResilienceTest, ParsesAndRejects) {
  EXPECT_EQ(Resilience::Parse("ec:4+2")->group_size(), 6);
  EXPECT_EQ(Resilience::Parse("replicate:3")->group_size(), 3);
  EXPECT_EQ(Resilience::Parse("none")->group_size(), 1);
  for (const char* bad : {"ec:3+2", "ec:4", "ec:30+3", "replicate:0", "raid5", "ec:a+b"}) {
    EXPECT_FALSE(Resilience::Parse(bad).has_value()) << bad;
  }
}

class ModeTest : public PageStoreTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(ModeTest, RandomIoMatchesShadowTrimAndZeroes) {
  StartDaemons(std::max(6, Resilience::Parse(GetParam())->group_size()));
  Open(GetParam());
  RandomWrites(300, 1);
  VerifyAll();
  VerifyBatched(50, 2);
  // Ops reported before their batch is over are final when reported (whether any is reported
  // early depends on timing here; OpsOnAnsweringDaemonsAreReportedWhileAnotherIsStopped makes
  // it happen).
  BatchedWrites(30, 7);
  VerifyBatched(50, 8, /*listener=*/true);
  VerifyAll();
  // Never-written space reads as zeroes without being mapped.
  const uint64_t mapped_before = store_->stats().extents_mapped;
  EXPECT_GT(mapped_before, 0u);
  // Zero a range (NO_HOLE) and trim another; both read back as zeroes.
  ASSERT_TRUE(store_->WriteZeroes(4096 * 3 + 512, 100000, /*may_trim=*/false, false).ok());
  std::memset(shadow_.data() + 4096 * 3 + 512, 0, 100000);
  ASSERT_TRUE(store_->WriteZeroes(1 << 20, 3 << 20, /*may_trim=*/true, false).ok());
  std::memset(shadow_.data() + (1 << 20), 0, 3 << 20);
  VerifyAll();
  // Trimming everything gives every lease back.
  ASSERT_TRUE(store_->Trim(0, kExport, false).ok());
  EXPECT_EQ(store_->stats().extents_mapped, 0u);
  std::fill(shadow_.begin(), shadow_.end(), 0);
  VerifyAll();
}

INSTANTIATE_TEST_SUITE_P(Modes, ModeTest,
                         ::testing::Values("none", "replicate:2", "ec:4+2", "ec:8+2"));

TEST_F(PageStoreTest, ErasureSurvivesTwoDaemonsKilled) {
  StartDaemons(6);
  Open("ec:4+2");
  RandomWrites(200, 3);
  (*daemons_)[1].Kill();
  (*daemons_)[4].Kill();
  VerifyAll();  // degraded reads decode from the survivors
  VerifyBatched(20, 4);
  VerifyBatched(20, 9, /*listener=*/true);
  RandomWrites(100, 5);  // writes go on to the four live members of each group
  VerifyAll();
  EXPECT_GT(store_->stats().degraded_reads, 0u);
}

TEST_F(PageStoreTest, ErasureRebuildsOnASpareDaemon) {
  StartDaemons(7);
  Open("ec:4+2");
  RandomWrites(200, 6);
  (*daemons_)[0].Kill();
  // The client core notices, the page store rebuilds every lost member on the spare daemon.
  WaitUntilNoticedDown(0);
  store_->WaitForRebuilds();
  VerifyAll();
  // Whole again: two more losses are still survivable.
  (*daemons_)[2].Kill();
  (*daemons_)[3].Kill();
  VerifyAll();
  EXPECT_GT(store_->stats().rebuilds, 0u);
}

TEST_F(PageStoreTest, ReplicaSurvivesOneDaemonKilled) {
  StartDaemons(3);
  Open("replicate:2");
  RandomWrites(200, 7);
  (*daemons_)[0].Kill();
  VerifyAll();
  RandomWrites(50, 8);
  VerifyAll();
}

TEST_F(PageStoreTest, BackupFileServesWhenEveryDaemonIsGone) {
  StartDaemons(2);
  const std::string backup = daemons_->work_dir() + "/backup.img";
  Open("none", backup);
  RandomWrites(200, 9);
  ASSERT_TRUE(store_->Flush().ok());
  (*daemons_)[0].Kill();
  (*daemons_)[1].Kill();
  VerifyAll();           // every read now comes from the file
  RandomWrites(50, 10);  // and writes still complete (the file holds them)
  VerifyAll();
  EXPECT_GT(store_->stats().backup_reads, 0u);
}

// A batch touching every extent while one daemon is stopped (SIGSTOP): the ops on the daemons
// that answered are reported while the batch still waits, each final when reported; the stopped
// daemon is let go at the first report, and the batch then completes.
TEST_F(PageStoreTest, OpsOnAnsweringDaemonsAreReportedWhileAnotherIsStopped) {
  StartDaemons(3);
  Open("none");
  constexpr uint64_t kExtent = 1 << 20;  // 1 MiB slabs, no erasure coding
  ASSERT_EQ(store_->extent_bytes(), kExtent);
  constexpr int kOps = static_cast<int>(kExport / kExtent);
  // Map every extent first (mapping asks daemons for leases; the stopped one could not answer).
  std::vector<uint8_t> page(4096, 0x5c);
  for (int i = 0; i < kOps; ++i) {
    ASSERT_TRUE(store_->Write(i * kExtent, page, false).ok());
    std::memcpy(shadow_.data() + i * kExtent, page.data(), page.size());
  }
  std::mt19937_64 rng(11);
  uint64_t offsets[kOps];
  for (int i = 0; i < kOps; ++i) offsets[i] = i * kExtent + (1 + rng() % 255) * 4096;
  const pid_t stopped = (*daemons_)[1].pid();
  for (bool write : {true, false}) {
    SCOPED_TRACE(write ? "writes" : "reads");
    std::vector<uint8_t> bufs(kOps * 4096);
    BlockOp ops[kOps];
    for (int i = 0; i < kOps; ++i) {
      uint8_t* b = bufs.data() + i * 4096;
      ops[i].offset = offsets[i];
      ops[i].length = 4096;
      if (write) {
        for (size_t j = 0; j < 4096; ++j) b[j] = static_cast<uint8_t>(rng());
        ops[i].kind = BlockOp::Kind::kWrite;
        ops[i].data = {b, 4096};
      } else {
        ops[i].kind = BlockOp::Kind::kRead;
        ops[i].read_into = {b, 4096};
      }
    }
    CheckingListener l(ops, shadow_);
    l.on_first = [&] { ::kill(stopped, SIGCONT); };
    ASSERT_EQ(0, ::kill(stopped, SIGSTOP));
    // kill() returns before the daemon has stopped: on a loaded machine it may not get a CPU to
    // act on SIGSTOP for a while, and meanwhile it may still answer. Wait until it is stopped.
    ASSERT_TRUE(WaitUntil([&] { return ProcessState(stopped) == 'T'; }, std::chrono::seconds(10)))
        << "the daemon did not stop: state " << ProcessState(stopped);
    store_->ExecuteBatch(ops, &l);
    ::kill(stopped, SIGCONT);  // also when nothing was reported
    EXPECT_GT(l.early, 0) << "nothing reported while a daemon was stopped" << Describe();
    EXPECT_LT(l.early, kOps) << "the last daemon to answer ends the batch: its ops are not early";
    EXPECT_GT(l.progress, 0);
    for (int i = 0; i < kOps; ++i) {
      ASSERT_TRUE(ops[i].status.ok()) << ops[i].status.ToString();
      if (write) {
        std::memcpy(shadow_.data() + offsets[i], bufs.data() + i * 4096, 4096);
      } else {
        ASSERT_EQ(0, std::memcmp(bufs.data() + i * 4096, shadow_.data() + offsets[i], 4096));
      }
    }
  }
  VerifyAll();
}

// Writes whose replica sits on a stopped (SIGSTOP) daemon end once the cluster declares it down
// (failure_timeout, 600 ms here), not after op_timeout (10 s here): the round must not hold the
// request, and the extent against its rebuild, for as long as the daemon stays stopped.
TEST_F(PageStoreTest, WritesToAStoppedDaemonEndWhenItIsDeclaredDownNotAtOpTimeout) {
  StartDaemons(3);
  Open("replicate:2", "", std::chrono::milliseconds(3000),
       [](PageStoreOptions& o) { o.op_timeout = std::chrono::milliseconds(10000); });
  const uint64_t extent = store_->extent_bytes();
  std::vector<uint8_t> page(4096, 0x3c);
  for (uint64_t off = 0; off < kExport; off += extent) {
    ASSERT_TRUE(store_->Write(off, page, false).ok());
    std::memcpy(shadow_.data() + off, page.data(), page.size());
  }
  const pid_t stopped = (*daemons_)[1].pid();
  ASSERT_EQ(0, ::kill(stopped, SIGSTOP));
  ASSERT_TRUE(WaitUntil([&] { return ProcessState(stopped) == 'T'; }, std::chrono::seconds(10)))
      << "the daemon did not stop: state " << ProcessState(stopped);
  std::fill(page.begin(), page.end(), 0xc3);
  const auto t0 = Clock::now();
  for (uint64_t off = 0; off < kExport; off += extent) {
    Status s = store_->Write(off + 4096, page, false);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::memcpy(shadow_.data() + off + 4096, page.data(), page.size());
  }
  const auto took = Clock::now() - t0;
  ::kill(stopped, SIGCONT);
  EXPECT_LT(took, std::chrono::milliseconds(5000))
      << "writes waited for the stopped daemon: "
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  VerifyAll();
}

TEST_F(PageStoreTest, NoneWithoutBackupReportsLostPages) {
  StartDaemons(2);
  Open("none");
  std::vector<uint8_t> page(4096, 0xab);
  // Land one page on each daemon's extent at least: write the whole export's first 8 MiB.
  for (uint64_t off = 0; off < (8 << 20); off += 4096)
    ASSERT_TRUE(store_->Write(off, page, false).ok());
  (*daemons_)[0].Kill();
  WaitUntilNoticedDown(0);
  store_->WaitForRebuilds();
  int errors = 0;
  std::vector<uint8_t> buf(4096);
  for (uint64_t off = 0; off < (8 << 20); off += 4096) {
    Status s = store_->Read(off, buf);
    if (!s.ok()) {
      ++errors;
      EXPECT_EQ(s.code(), StatusCode::kIoError) << s.ToString();
    } else {
      EXPECT_EQ(buf, page);
    }
  }
  EXPECT_GT(errors, 0);  // what lived on the dead daemon is reported, not silently zero
}

// ---- re-protection (issue 11, defects 1 and 6) ----

// ec:2+1 on three daemons: one is killed and comes back empty on the same port (a new daemon
// incarnation). Every degraded extent is rebuilt onto it, so a second daemon killed afterwards
// loses nothing. Before the fix the store ignored the daemon's return and the second kill lost
// every extent.
TEST_F(PageStoreTest, ErasureReprotectsOntoARestartedDaemon) {
  StartDaemons(3, "24M", /*reconnect_ms=*/100);
  Open("ec:2+1");
  RandomWrites(200, 21);
  (*daemons_)[2].Kill();
  WaitUntilDegraded();
  ASSERT_TRUE((*daemons_)[2].Start().ok());
  WaitUntilWhole();
  EXPECT_GT(cluster_->node(2).leases_held, 0u) << Describe();
  EXPECT_GT(store_->stats().reprotected_extents, 0u);
  RandomWrites(50, 22);
  (*daemons_)[0].Kill();
  VerifyAll();
}

// replicate:2 on three daemons of 24 slabs: after a kill the two survivors have room for only a
// few replacement replicas (the rest stay degraded for lack of room); the restarted daemon takes
// the rest, and then a kill of another daemon loses nothing.
TEST_F(PageStoreTest, ReplicaReprotectsOntoARestartedDaemon) {
  StartDaemons(3, "24M", /*reconnect_ms=*/100);
  Open("replicate:2");
  RandomWrites(200, 23);
  (*daemons_)[1].Kill();
  WaitUntilDegraded();
  ASSERT_TRUE((*daemons_)[1].Start().ok());
  WaitUntilWhole();
  EXPECT_GT(cluster_->node(1).leases_held, 0u) << Describe();
  (*daemons_)[0].Kill();
  VerifyAll();
}

// A daemon the client never reached before (named in the peers, but not running at connect) comes
// up while the store is degraded: it takes the missing members.
TEST_F(PageStoreTest, ReprotectsOntoADaemonThatJoinsLater) {
  StartDaemons(4, "24M", /*reconnect_ms=*/100, /*down_at_connect=*/1);
  Open("ec:2+1");
  RandomWrites(200, 24);
  EXPECT_EQ(store_->stats().degraded_maps, 0u);  // three daemons up: groups are whole
  (*daemons_)[0].Kill();
  WaitUntilDegraded();
  ASSERT_TRUE((*daemons_)[3].Start().ok());
  WaitUntilWhole();
  EXPECT_GT(cluster_->node(3).leases_held, 0u) << Describe();
  (*daemons_)[1].Kill();
  VerifyAll();
}

// ec:4+2 with two of six daemons not yet up: new extents are mapped degraded on the four live ones
// (writes succeed), re-protected once the other two start, and then two others may fail. Before
// the fix every write to a new extent failed with ENOSPC.
TEST_F(PageStoreTest, ErasureMapsDegradedWhileDaemonsAreDownThenReprotects) {
  StartDaemons(6, "24M", /*reconnect_ms=*/100, /*down_at_connect=*/2);
  Open("ec:4+2");
  RandomWrites(200, 25);
  VerifyAll();
  EXPECT_GT(store_->stats().degraded_maps, 0u);
  EXPECT_GT(store_->stats().degraded_extents, 0u);
  ASSERT_TRUE((*daemons_)[4].Start().ok());
  ASSERT_TRUE((*daemons_)[5].Start().ok());
  WaitUntilWhole();
  EXPECT_GT(cluster_->node(4).leases_held, 0u) << Describe();
  EXPECT_GT(cluster_->node(5).leases_held, 0u) << Describe();
  (*daemons_)[0].Kill();
  (*daemons_)[1].Kill();
  VerifyAll();
  // Trimming everything gives every lease back, replaced members included.
  ASSERT_TRUE(store_->Trim(0, kExport, false).ok());
  EXPECT_EQ(store_->stats().extents_mapped, 0u);
  for (const client::NodeInfo& n : cluster_->nodes()) EXPECT_EQ(n.leases_held, 0u) << Describe();
}

// Fewer live daemons than the mode's minimum (k for ec): writes to new extents fail with a clear
// error instead of mapping what could not be read back.
TEST_F(PageStoreTest, ErasureRefusesToMapOnFewerThanKDaemons) {
  StartDaemons(6, "24M", /*reconnect_ms=*/100, /*down_at_connect=*/2);
  Open("ec:4+2");
  (*daemons_)[0].Kill();
  ASSERT_TRUE(WaitUntil([&] { return cluster_->alive_count() == 3; }, std::chrono::seconds(10)));
  std::vector<uint8_t> page(4096, 1);
  Status s = store_->Write(0, page, false);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("at least 4"), std::string::npos) << s.ToString();
  EXPECT_EQ(store_->stats().extents_mapped, 0u);
}

// TRIM gives space back (defect 5: swapon --discard must return what it frees): an extent whose
// pages are all trimmed returns its leases to the daemons; a partly trimmed one keeps them.
TEST_F(PageStoreTest, TrimReturnsLeasesToTheDaemons) {
  StartDaemons(3);
  Open("ec:2+1");
  auto free_slabs = [&] {
    uint64_t sum = 0;
    for (client::NodeId id = 0; id < cluster_->node_count(); ++id) {
      auto st = cluster_->Stat(id);
      EXPECT_TRUE(st.has_value()) << st.error().ToString();
      if (st) sum += st->free_slabs;
    }
    return sum;
  };
  const uint64_t initially = free_slabs();
  const uint64_t extent = store_->extent_bytes();
  std::vector<uint8_t> data(4 * extent, 0x3c);
  ASSERT_TRUE(store_->Write(0, data, false).ok());
  EXPECT_EQ(store_->stats().extents_mapped, 4u);
  EXPECT_EQ(free_slabs(), initially - 4 * 3);
  ASSERT_TRUE(store_->Trim(0, 2 * extent, false).ok());     // two whole extents
  ASSERT_TRUE(store_->Trim(2 * extent, 4096, false).ok());  // one page of the third
  EXPECT_EQ(store_->stats().extents_mapped, 2u);
  EXPECT_EQ(free_slabs(), initially - 2 * 3);
  ASSERT_TRUE(store_->Trim(2 * extent + 4096, 2 * extent - 4096, false).ok());
  EXPECT_EQ(store_->stats().extents_mapped, 0u);
  EXPECT_EQ(free_slabs(), initially);
  for (const client::NodeInfo& n : cluster_->nodes()) EXPECT_EQ(n.leases_held, 0u);
  VerifyAll();  // all zeroes
}

// Defect 5, at run time: a cluster that cannot hold what the export still needs is noticed (and
// warned about in the log) by the periodic check, with both numbers.
TEST_F(PageStoreTest, CapacityCheckSeesAClusterShortOfRoom) {
  StartDaemons(3, "8M");  // 3 x 8 slabs; ec:2+1 over 32 MiB needs 16 extents x 3 slabs
  Open("ec:2+1", "", std::chrono::milliseconds(50));
  ASSERT_TRUE(
      WaitUntil([&] { return store_->stats().slabs_needed > 0; }, std::chrono::seconds(10)));
  EXPECT_EQ(store_->stats().slabs_needed, 48u);
  EXPECT_EQ(store_->stats().cluster_free_slabs, 24u);
  std::vector<uint8_t> data(2 * store_->extent_bytes(), 0x11);
  ASSERT_TRUE(store_->Write(0, data, false).ok());  // two extents mapped: 6 slabs fewer on both
  ASSERT_TRUE(
      WaitUntil([&] { return store_->stats().slabs_needed == 42; }, std::chrono::seconds(10)));
  EXPECT_EQ(store_->stats().cluster_free_slabs, 18u);
}

// ---- Failure interleavings, made deterministic with injected faults
// ------------------------------ (transport/fault_injection.h: the daemons and the client core are
// real; which data op fails or waits is chosen by the test, not by the timing of a kill or a
// SIGSTOP.)

// A replica write that fails on one member: the write still succeeds (the mode tolerates one
// member lost), and that member's now stale copy is never served — not even after the other
// member's daemon is killed once the store says it is whole again.
TEST_F(PageStoreTest, ReplicaWriteFailedOnOneMemberNeverServesItsStaleCopy) {
  faults_ = std::make_shared<transport::FaultInjector>();
  StartDaemons(3, "24M", /*reconnect_ms=*/100);
  Open("replicate:2");
  RandomWrites(200, 31);
  const Endpoint victim = (*daemons_)[1].endpoint();
  faults_->Fail(victim, RemoteAccessError("injected: write refused"), /*count=*/3, /*after=*/1);
  RandomWrites(100, 32);  // newer data everywhere; three of the member writes to daemon 1 fail
  EXPECT_EQ(faults_->ops_failed(victim), 3u) << "the writes never reached daemon 1's channel";
  WaitUntilWhole();
  VerifyAll();
  (*daemons_)[0].Kill();  // the other member of about half of daemon 1's extents
  VerifyAll();
}

// Reads whose member refuses them are served from the other replica, without an error (the
// store takes the refusing member for lost and rebuilds it elsewhere).
TEST_F(PageStoreTest, ReplicaReadRefusedByOneMemberIsServedByTheOther) {
  faults_ = std::make_shared<transport::FaultInjector>();
  StartDaemons(3);
  Open("replicate:2");
  RandomWrites(200, 33);
  const Endpoint victim = (*daemons_)[2].endpoint();
  faults_->Fail(victim, RemoteAccessError("injected: read refused"));  // every op, until Clear
  VerifyAll();
  VerifyBatched(30, 34, /*listener=*/true);
  faults_->Clear(victim);
  EXPECT_GT(faults_->ops_failed(victim), 0u) << "no read went to daemon 2";
  EXPECT_GT(store_->stats().rebuilds, 0u);
}

// ec:2+1: one member's writes stall (the daemon still answers heartbeats on its control
// connection, so the client core never declares it down). The writes complete without it, the
// extents are re-protected, and after the stall ends a second failure loses nothing.
TEST_F(PageStoreTest, ErasureWritesStalledOnOneMemberCompleteAndLoseNothing) {
  faults_ = std::make_shared<transport::FaultInjector>();
  StartDaemons(4, "24M", /*reconnect_ms=*/100);
  Open("ec:2+1");
  RandomWrites(100, 35);
  const Endpoint victim = (*daemons_)[3].endpoint();
  faults_->Hold(victim);
  RandomWrites(15, 36);  // members on daemon 3 stall; the store gives up on them at op_timeout
  EXPECT_GT(faults_->ops_held(victim), 0u) << "no write went to daemon 3";
  faults_->Release(victim);
  RandomWrites(30, 37);  // newer data again, over the same ranges in part
  WaitUntilWhole();
  VerifyAll();
  // Whichever member is killed now, what is left decodes to the newest data.
  (*daemons_)[0].Kill();
  VerifyAll();
}

}  // namespace
}  // namespace farmem::blockdev
