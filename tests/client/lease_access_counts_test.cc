// The client's per-lease access counts for the HEARTBEAT access report (client/src/
// lease_access_counts.h): what a report holds, that it is sent again until the daemon took it,
// that a slab's next lease starts from zero, that growing the table keeps the counts, and that
// the counting channel counts exactly the operations posted.
#include "lease_access_counts.h"

#include <gtest/gtest.h>

#include <map>
#include <thread>
#include <vector>

namespace farmem::client::internal {
namespace {

uint64_t Lease(uint32_t epoch, uint32_t slab) { return (uint64_t{epoch} << 32) | slab; }

std::map<uint64_t, uint64_t> AsMap(const wire::HeartbeatRequest& r) {
  std::map<uint64_t, uint64_t> out;
  for (const wire::AccessReport& a : r.reports) out[a.lease_id] = a.accesses;
  return out;
}

TEST(LeaseAccessCountsTest, ReportsWhatWasCountedSinceTheLastCommittedReport) {
  LeaseAccessCounts c;
  const uint64_t a = Lease(7, 0), b = Lease(7, 3), idle = Lease(7, 5);
  c.Track(a);
  c.Track(b);
  c.Track(idle);
  for (int i = 0; i < 10; ++i) c.Count(a);
  c.Count(b);
  c.Count(Lease(9, 1));  // never tracked: not counted anywhere
  const std::vector<uint64_t> held{a, b, idle};
  wire::HeartbeatRequest r = c.Pending(held);
  EXPECT_EQ(AsMap(r), (std::map<uint64_t, uint64_t>{{a, 10}, {b, 1}}))
      << "an idle lease is left out of the report";

  // The heartbeat failed (not committed): the same counts, and what came since, go again.
  c.Count(a);
  r = c.Pending(held);
  EXPECT_EQ(AsMap(r), (std::map<uint64_t, uint64_t>{{a, 11}, {b, 1}}));
  c.Commit(r);
  EXPECT_EQ(c.reported(), 12u);
  EXPECT_TRUE(c.Pending(held).reports.empty()) << "nothing new since the committed report";

  c.Count(b);
  c.Count(b);
  EXPECT_EQ(AsMap(c.Pending(held)), (std::map<uint64_t, uint64_t>{{b, 2}}));
  // Only held leases are reported: the client freed b.
  EXPECT_TRUE(c.Pending(std::vector<uint64_t>{a, idle}).reports.empty());
}

TEST(LeaseAccessCountsTest, TheNextLeaseOfASlabStartsFromZero) {
  LeaseAccessCounts c;
  const uint64_t old_lease = Lease(1, 2), new_lease = Lease(2, 2);
  c.Track(old_lease);
  for (int i = 0; i < 5; ++i) c.Count(old_lease);
  c.Track(new_lease);  // the daemon granted slab 2 again, to us
  c.Count(old_lease);  // a late operation on the ended lease: counted nowhere
  c.Count(new_lease);
  const std::vector<uint64_t> held{old_lease, new_lease};
  EXPECT_EQ(AsMap(c.Pending(held)), (std::map<uint64_t, uint64_t>{{new_lease, 1}}));
}

TEST(LeaseAccessCountsTest, GrowingToAHigherSlabKeepsEveryCount) {
  LeaseAccessCounts c;
  std::vector<uint64_t> held;
  for (uint32_t slab = 0; slab < 8; ++slab) {
    held.push_back(Lease(3, slab));
    c.Track(held.back());
    for (uint32_t i = 0; i <= slab; ++i) c.Count(held.back());
  }
  wire::HeartbeatRequest first = c.Pending(held);
  c.Commit(first);
  c.Count(held[0]);
  // Slab 5000 needs a table of 8192 slots: the counts (and what was committed of them) move.
  held.push_back(Lease(3, 5000));
  c.Track(held.back());
  c.Count(held.back());
  c.Count(held.back());
  EXPECT_EQ(AsMap(c.Pending(held)),
            (std::map<uint64_t, uint64_t>{{held[0], 1}, {Lease(3, 5000), 2}}));
  // Beyond the largest table, slabs share slots by their low bits: the later grant takes it.
  const uint64_t far = Lease(3, LeaseAccessCounts::kMaxSlots + 1);
  c.Track(far);
  c.Count(far);
  c.Count(held[1]);  // slab 1: its slot is far's now
  EXPECT_EQ(AsMap(c.Pending(std::vector<uint64_t>{held[1], far})),
            (std::map<uint64_t, uint64_t>{{far, 1}}));
}

TEST(LeaseAccessCountsTest, AtMostMaxLeasesTheBusiestFirst) {
  LeaseAccessCounts c;
  std::vector<uint64_t> held;
  for (uint32_t slab = 0; slab < 20; ++slab) {
    held.push_back(Lease(4, slab));
    c.Track(held.back());
    for (uint32_t i = 0; i < slab + 1; ++i) c.Count(held.back());
  }
  wire::HeartbeatRequest r = c.Pending(held, 5);
  EXPECT_EQ(AsMap(r),
            (std::map<uint64_t, uint64_t>{
                {held[15], 16}, {held[16], 17}, {held[17], 18}, {held[18], 19}, {held[19], 20}}));
  c.Commit(r);
  // The rest go with the next heartbeats.
  EXPECT_EQ(c.Pending(held, 5).reports.size(), 5u);
  EXPECT_EQ(c.Pending(held).reports.size(), 15u);
  // And the whole report fits one HEARTBEAT body.
  std::vector<uint8_t> body;
  wire::EncodeHeartbeat(c.Pending(held), &body);
  auto back = wire::DecodeHeartbeat(body);
  ASSERT_TRUE(back.has_value()) << back.error().ToString();
  EXPECT_EQ(AsMap(*back), AsMap(c.Pending(held)));
}

TEST(LeaseAccessCountsTest, ThreadsCountingWhileTheTableGrowsAndReportsAreTaken) {
  // Counted on several threads while the control path grows the table and the heartbeat commits
  // reports: no crash, no count reported twice, and no more reported than was counted.
  LeaseAccessCounts c;
  const uint64_t hot = Lease(5, 1);
  c.Track(hot);
  constexpr int kThreads = 3, kOps = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kOps; ++i) c.Count(hot);
    });
  }
  std::vector<uint64_t> held{hot};
  for (uint32_t slab = 2; slab < 40000; slab += 997) {
    held.push_back(Lease(5, slab));
    c.Track(held.back());
    c.Commit(c.Pending(held));
  }
  for (std::thread& t : threads) t.join();
  c.Commit(c.Pending(held));
  EXPECT_LE(c.reported(), uint64_t{kThreads} * kOps);
  EXPECT_GT(c.reported(), 0u);
  EXPECT_TRUE(c.Pending(held).reports.empty());
}

// A channel that accepts every post and completes nothing: what the counting channel wraps.
class AcceptingChannel final : public transport::Channel {
 public:
  Status Post(const transport::Op& op) override {
    if (op.length == 0) return InvalidArgument("empty op");
    ++posted_;
    return Status::Ok();
  }
  Status Flush() override { return Status::Ok(); }
  Result<size_t> Poll(std::span<transport::Completion>, std::chrono::milliseconds) override {
    return size_t{0};
  }
  size_t outstanding() const override { return 0; }
  size_t max_outstanding() const override { return 64; }
  const char* kind() const override { return "verbs"; }
  std::string peer() const override { return "test"; }
  bool broken() const override { return false; }
  transport::ChannelStats stats() const override { return {.ops = posted_}; }

 private:
  uint64_t posted_ = 0;
};

TEST(CountingChannelTest, CountsEveryOperationPostedAndNothingRefused) {
  auto counts = std::make_shared<LeaseAccessCounts>();
  const uint64_t a = Lease(6, 0), b = Lease(6, 1);
  counts->Track(a);
  counts->Track(b);
  auto ch = CountAccesses(std::make_unique<AcceptingChannel>(), counts);
  EXPECT_STREQ(ch->kind(), "verbs") << "callers still see the channel they opened";
  uint8_t buf[8] = {};
  transport::Op op;
  op.type = transport::OpType::kWrite;
  op.local = buf;
  op.length = 8;
  op.slab.lease_id = a;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(ch->Post(op).ok());
  op.type = transport::OpType::kRead;
  op.slab.lease_id = b;
  ASSERT_TRUE(ch->Post(op).ok());
  op.length = 0;
  EXPECT_FALSE(ch->Post(op).ok());  // refused: not an access
  EXPECT_EQ(ch->stats().ops, 4u);
  EXPECT_EQ(AsMap(counts->Pending(std::vector<uint64_t>{a, b})),
            (std::map<uint64_t, uint64_t>{{a, 3}, {b, 1}}));
}

}  // namespace
}  // namespace farmem::client::internal
