// The page store under eviction notices and slow rebuilds (issue 12 item 3, issue 11): a daemon
// that is drained (EVICT_NOTICE for every lease) loses the page store nothing in any resilience
// mode, none included, when the notice leaves time to move; a notice too short loses exactly the
// noticed range (IoError), never returns wrong data; a rebuild does not hold its extent for the
// whole copy and is abandoned as soon as its target is declared down.
#include <thread>

#include "page_store_fixture.h"

namespace farmem::blockdev {
namespace {

using namespace pstest;
using std::chrono::milliseconds;

class EvictionTest : public PageStoreTest {
 protected:
  // Writes every page of the export (random bytes), then random writes over it.
  void FillExport(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> buf(1 << 20);
    for (uint64_t off = 0; off < kExport; off += buf.size()) {
      for (auto& b : buf) b = static_cast<uint8_t>(rng());
      Status s = store_->Write(off, buf, false);
      ASSERT_TRUE(s.ok()) << s.ToString();
      std::memcpy(shadow_.data() + off, buf.data(), buf.size());
    }
    RandomWrites(50, seed + 1);
  }

  // The daemon holding the most leases of this client.
  client::NodeId Busiest() {
    client::NodeId best = 0;
    for (const client::NodeInfo& n : cluster_->nodes()) {
      if (n.leases_held > cluster_->node(best).leases_held) best = n.id;
    }
    return best;
  }

  // Extents with a member on `node`.
  std::vector<uint64_t> ExtentsOn(client::NodeId node) {
    std::vector<uint64_t> out;
    for (uint64_t i = 0; i * store_->extent_bytes() < kExport; ++i) {
      for (const client::Lease& l : store_->extent_members(i)) {
        if (l.node == node) out.push_back(i);
      }
    }
    return out;
  }
};

struct DrainCase {
  const char* mode;
  size_t daemons;
  const char* capacity;  // the others must hold what the drained one held
};

class DrainMovesTest : public EvictionTest, public ::testing::WithParamInterface<DrainCase> {};

// A daemon holding members is drained with a 20 s notice while writes go on: every member there
// is moved to the other daemons (from the leaving member itself) and freed well before the
// deadline, every byte reads back as written, and the store never ran degraded. Before the fix a
// notice was handled as a lost member: `none` lost every page on the drained daemon (IoError),
// replicate and ec ran degraded and rebuilt from the other members.
TEST_P(DrainMovesTest, EveryMemberIsMovedBeforeTheDeadlineAndNothingIsLost) {
  const DrainCase& c = GetParam();
  StartDaemons(c.daemons, c.capacity);
  Open(c.mode);
  FillExport(41);
  const client::NodeId drained = Busiest();
  const size_t held = cluster_->node(drained).leases_held;
  ASSERT_GT(held, 0u);
  ASSERT_EQ(store_->stats().degraded_episodes, 0u) << Describe();

  constexpr uint32_t kGraceMs = 20000;
  const auto deadline = Clock::now() + milliseconds(kGraceMs);
  auto noticed = Drain(drained, kGraceMs);
  ASSERT_TRUE(noticed.has_value()) << noticed.error().ToString();
  EXPECT_EQ(noticed->leases_noticed, held);
  // Writes during the move (to every extent, moving ones included) must not be lost.
  RandomWrites(150, 42);
  ASSERT_TRUE(
      WaitUntil([&] { return cluster_->node(drained).leases_held == 0; }, milliseconds(kGraceMs)))
      << "leases still on the drained daemon: " << Describe();
  const auto drained_in =
      std::chrono::duration_cast<milliseconds>(Clock::now() - (deadline - milliseconds(kGraceMs)));
  EXPECT_LT(Clock::now(), deadline);
  // The client forgets a lease before its FREE reaches the daemon (on the data connection; DRAIN
  // goes on a control connection), so the daemon's own count is waited on, not read once. A
  // repeated DRAIN notices nothing and tells what is held.
  size_t daemon_held = held;
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto after = Drain(drained, kGraceMs);
        if (!after.has_value()) return false;
        daemon_held = after->leases_held;
        return daemon_held == 0;
      },
      milliseconds(5000)))
      << "the daemon still holds " << daemon_held << " lease(s) of this client";
  VerifyAll();
  RandomWrites(50, 43);
  VerifyAll();
  const PageStoreStats s = store_->stats();
  EXPECT_EQ(s.moved_members, held) << Describe();
  EXPECT_EQ(s.degraded_episodes, 0u) << "a noticed member was handled as lost: " << Describe();
  EXPECT_EQ(s.rebuilds, 0u) << "members were rebuilt from the others instead of moved";
  EXPECT_EQ(s.moves_missed, 0u);
  EXPECT_TRUE(ExtentsOn(drained).empty());
  // Not an assertion (the machine is shared): the figures docs/reliability.md records.
  std::printf(
      "[ measure  ] %s: %llu members (%.1f MiB) moved in %llu ms from the first notice; DRAIN "
      "sent to 0 leases held: %lld ms\n",
      c.mode, static_cast<unsigned long long>(s.moved_members),
      static_cast<double>(s.last_move_bytes) / (1 << 20),
      static_cast<unsigned long long>(s.last_move_ms), static_cast<long long>(drained_in.count()));
}

INSTANTIATE_TEST_SUITE_P(Modes, DrainMovesTest,
                         ::testing::Values(DrainCase{"none", 3, "24M"},
                                           DrainCase{"replicate:2", 3, "40M"},
                                           DrainCase{"ec:2+1", 4, "24M"}),
                         [](const auto& info) {
                           std::string n = info.param.mode;
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

// A notice whose deadline passes before anything can be moved (1 ms): the noticed extents' pages
// read as IoError, every other page reads back as written, and no read returns wrong data.
// A member whose pages fail authentication while it is being moved (an eviction notice) is not
// swapped in with the bad bytes copied. ec:2+1 on four daemons, one extent written (64 pages): a
// bit of every page's fragment on member 0 is flipped, member 0's daemon drained, and the move's
// writes to the fourth daemon (the only one outside the extent) held once its first run of pages
// (read from member 0 itself, flips and all) is copied. The pages are read meanwhile: served
// from the other members, member 0 marked failed and stale. Released, the move finished and,
// before the fix, swapped the copy in and cleared the marks: the new member held the flipped
// fragments as good (reads of the pages failed authentication again). Now the copy is dropped
// and the member rebuilt from the others.
TEST_F(EvictionTest, PagesFoundCorruptWhileTheirMemberIsMovedAreRebuiltNotMoved) {
  op_timeout_ = std::chrono::milliseconds(20000);  // the held writes wait, they do not time out
  StartDaemons(4, "24M");
  Open("ec:2+1");
  constexpr size_t kPages = 64;
  std::vector<uint8_t> data(kPages * 4096);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 13 + i / 4096);
  ASSERT_TRUE(store_->Write(0, data, false).ok());
  std::memcpy(shadow_.data(), data.data(), data.size());
  const std::vector<client::Lease> members = store_->extent_members(0);
  ASSERT_EQ(members.size(), 3u);
  const client::Lease lease = members[0];
  client::NodeId outside = 0;
  for (const client::NodeInfo& n : cluster_->nodes()) {
    if (n.leases_held == 0) outside = n.id;
  }
  ASSERT_EQ(cluster_->node(outside).leases_held, 0u) << "one extent, on three of four daemons";
  // Member 0 holds the first 2 KiB of each page's ciphertext, page after page.
  std::vector<uint8_t> frags(kPages * 2048);
  const uint32_t len = static_cast<uint32_t>(frags.size());
  ASSERT_TRUE(RawOp(*cluster_, lease, transport::OpType::kRead, 0, frags.data(), len).ok());
  for (size_t p = 0; p < kPages; ++p) frags[p * 2048 + 100] ^= 0x10;
  ASSERT_TRUE(RawOp(*cluster_, lease, transport::OpType::kWrite, 0, frags.data(), len).ok());

  const Endpoint target = (*daemons_)[outside].endpoint();
  faults_->Hold(target);
  auto noticed = Drain(lease.node, 20000);
  ASSERT_TRUE(noticed.has_value()) << noticed.error().ToString();
  ASSERT_TRUE(WaitUntil([&] { return faults_->ops_held(target) > 0; }, std::chrono::seconds(10)))
      << "the move did not start writing to the daemon outside the extent: " << Describe();
  auto read_each_page = [&] {
    std::vector<uint8_t> back(4096);
    for (size_t p = 0; p < kPages; ++p) {
      ASSERT_TRUE(store_->Read(p * 4096, back).ok());
      ASSERT_TRUE(std::equal(back.begin(), back.end(), shadow_.begin() + p * 4096)) << p;
    }
  };
  read_each_page();
  const uint64_t found = store_->stats().integrity_failures;
  faults_->Release(target);
  ASSERT_GT(found, 0u) << "no read used member 0: " << Describe();

  ASSERT_TRUE(WaitUntil(
      [&] {
        return cluster_->node(lease.node).leases_held == 0 && store_->stats().degraded_extents == 0;
      },
      std::chrono::seconds(20)))
      << "the member did not leave the drained daemon: " << Describe();
  store_->WaitForRebuilds();
  // The member 0 in place now holds the fragments as written, none of the flipped ones.
  const client::Lease now = store_->extent_members(0)[0];
  ASSERT_NE(now.node, lease.node);
  std::vector<uint8_t> held(frags.size());
  ASSERT_TRUE(RawOp(*cluster_, now, transport::OpType::kRead, 0, held.data(), len).ok());
  size_t flipped = 0;
  for (size_t p = 0; p < kPages; ++p) flipped += held[p * 2048 + 100] == frags[p * 2048 + 100];
  EXPECT_EQ(flipped, 0u) << "flipped fragments were moved to the new member: " << Describe();
  read_each_page();
  EXPECT_EQ(store_->stats().integrity_failures, found)
      << "flipped fragments were moved to the new member and taken for good: " << Describe();
  VerifyAll();
  EXPECT_EQ(store_->stats().lost_bytes, 0u);
}

TEST_F(EvictionTest, NoticeTooShortLosesExactlyThatRangeNeverWrongData) {
  StartDaemons(3);
  Open("none");
  FillExport(51);
  const client::NodeId drained = Busiest();
  const std::vector<uint64_t> on_drained = ExtentsOn(drained);
  ASSERT_FALSE(on_drained.empty());
  auto noticed = Drain(drained, 1);
  ASSERT_TRUE(noticed.has_value()) << noticed.error().ToString();
  // The lease ends at the daemon's deadline; the client core reports it lost by its own.
  ASSERT_TRUE(
      WaitUntil([&] { return cluster_->node(drained).leases_held == 0; }, std::chrono::seconds(10)))
      << Describe();
  store_->WaitForRebuilds();
  std::vector<uint8_t> page(4096);
  uint64_t errors = 0;
  for (uint64_t off = 0; off < kExport; off += page.size()) {
    const uint64_t extent = off / store_->extent_bytes();
    const bool was_there =
        std::find(on_drained.begin(), on_drained.end(), extent) != on_drained.end();
    Status s = store_->Read(off, page);
    if (!s.ok()) {
      ++errors;
      EXPECT_EQ(s.code(), StatusCode::kIoError) << s.ToString();
      EXPECT_TRUE(was_there) << "a read failed outside the noticed range, at " << off;
      continue;
    }
    ASSERT_EQ(0, std::memcmp(page.data(), shadow_.data() + off, page.size()))
        << "wrong data at " << off << (was_there ? " (a noticed extent)" : "");
  }
  EXPECT_GT(errors, 0u) << "nothing was lost although the notice left no time to move";
  EXPECT_GT(store_->stats().moves_missed + store_->stats().copies_abandoned, 0u) << Describe();
}

// No daemon has room for the members of a drained daemon (the other one is full): the store says
// so, keeps the members until the deadline, and then reads their pages from the backup file;
// nothing is lost.
TEST_F(EvictionTest, NoRoomToMoveFallsBackToTheBackupFile) {
  StartDaemons(2, "16M");  // 32 slabs in all, and the export needs all 32
  Open("none", daemons_->work_dir() + "/backup.img");
  FillExport(71);
  ASSERT_TRUE(store_->Flush().ok());
  auto noticed = Drain(0, 1000);
  ASSERT_TRUE(noticed.has_value()) << noticed.error().ToString();
  ASSERT_GT(noticed->leases_noticed, 0u);
  ASSERT_TRUE(
      WaitUntil([&] { return cluster_->node(0).leases_held == 0; }, std::chrono::seconds(10)))
      << Describe();
  store_->WaitForRebuilds();
  VerifyAll();
  const PageStoreStats s = store_->stats();
  EXPECT_EQ(s.moved_members, 0u);
  EXPECT_GT(s.moves_missed, 0u) << Describe();
  EXPECT_GT(s.backup_reads, 0u);
}

// ec:2+1 on three daemons plus a spare that joins later: a daemon is killed and its members are
// rebuilt onto the spare, whose data path the fault injector holds. While that copy is stuck,
// reads of every extent complete (the rebuild does not hold the extent exclusively for the
// copy); once the spare is declared down (SIGSTOP), the rebuild is abandoned within the
// client's down check, not after op_timeout (30 s here). Before the fix reads of the extent being
// rebuilt, and the rebuild thread, waited out the op_timeout.
TEST_F(EvictionTest, RebuildDoesNotHoldItsExtentAndIsAbandonedWhenItsTargetIsDown) {
  op_timeout_ = milliseconds(30000);
  StartDaemons(4, "24M", /*reconnect_ms=*/100, /*down_at_connect=*/1);
  Open("ec:2+1");
  FillExport(61);
  ASSERT_TRUE((*daemons_)[3].Start().ok());
  ASSERT_TRUE(cluster_->WaitForNode(3, client::NodeState::kUp, std::chrono::seconds(10)).ok());
  const Endpoint spare = (*daemons_)[3].endpoint();
  faults_->Hold(spare);
  (*daemons_)[0].Kill();
  ASSERT_TRUE(cluster_->WaitForNode(0, client::NodeState::kDown, std::chrono::seconds(10)).ok());
  ASSERT_TRUE(WaitUntil([&] { return faults_->ops_held(spare) > 0; }, std::chrono::seconds(10)))
      << "no rebuild wrote to the spare: " << Describe();

  // Reads of everything, the extent being rebuilt included, while the copy is stuck.
  std::atomic<bool> read_all{false};
  std::thread reader([&] {
    VerifyAll();
    read_all = true;
  });
  const bool reads_done = WaitUntil([&] { return read_all.load(); }, std::chrono::seconds(10));
  EXPECT_TRUE(reads_done) << "reads waited for the rebuild's copy";

  // The spare stops answering: declared down, the stuck copy is given up.
  const pid_t spare_pid = (*daemons_)[3].pid();
  ASSERT_EQ(0, ::kill(spare_pid, SIGSTOP));
  ASSERT_TRUE(cluster_->WaitForNode(3, client::NodeState::kDown, std::chrono::seconds(10)).ok());
  std::atomic<bool> idle{false};
  std::thread waiter([&] {
    store_->WaitForRebuilds();
    idle = true;
  });
  const bool abandoned =
      WaitUntil([&] { return idle.load() && store_->stats().copies_abandoned > 0; },
                std::chrono::seconds(10));
  EXPECT_TRUE(abandoned) << "the rebuild still waits on a daemon declared down: " << Describe();
  faults_->Release(spare);
  ::kill(spare_pid, SIGCONT);
  reader.join();
  waiter.join();
  VerifyAll();  // degraded reads decode from the two survivors
}

}  // namespace
}  // namespace farmem::blockdev
