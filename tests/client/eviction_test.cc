// Eviction with notice (issue 12), end to end: a real farmemd whose memory source is a cgroup v2
// directory the test writes (so the test decides when the host is short of memory), and three
// client::Cluster borrowers. Under pressure the daemon stops granting, picks the least active
// leases and sends their owners EVICT_NOTICE; a client that frees in time sees no error, a client
// that ignores the notice loses exactly the noticed leases at the deadline (kLeasesLost, reads
// fail with Expired), and a busy client is not touched. When memory is back it grants again.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "client_options.h"
#include "farmem/client/cluster.h"
#include "support/daemon_fixture.h"
#include "support/fake_cgroup.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;
using test::LeaseIds;
using test::OptionsFor;
using testing::DaemonSet;
using testing::WaitUntil;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kLimit = 1024 * kMiB;
constexpr milliseconds kGrace{1500};

class Events {
 public:
  void Record(const Event& e) {
    std::lock_guard lock(mu_);
    events_.push_back(e);
  }
  std::vector<Event> Of(EventType type) {
    std::lock_guard lock(mu_);
    std::vector<Event> out;
    for (const Event& e : events_) {
      if (e.type == type) out.push_back(e);
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<Event> events_;
};

TEST(EvictionTest, IgnoredNoticeLosesTheLeaseFreedInTimeSeesNoErrorOthersUntouched) {
  testing::FakeCgroup cgroup(kLimit);
  DaemonSet daemons({.capacity = "16M",
                     .slab_size = "1M",
                     .extra_args = cgroup.LenderArgs({.reserve = 100 * kMiB,
                                                      .grace = kGrace,
                                                      .interval = milliseconds(50),
                                                      .sample_extra = 2},
                                                     {"--no-mlock"})});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();

  auto ignorer = Cluster::Connect(OptionsFor(daemons, "ignorer"));
  auto mover = Cluster::Connect(OptionsFor(daemons, "mover"));
  auto busy = Cluster::Connect(OptionsFor(daemons, "busy"));
  ASSERT_TRUE(ignorer.has_value() && mover.has_value() && busy.has_value()) << daemons.Logs();
  Events ignorer_events, mover_events, busy_events;
  (*ignorer)->Subscribe([&](const Event& e) { ignorer_events.Record(e); });
  (*busy)->Subscribe([&](const Event& e) { busy_events.Record(e); });

  auto a = (*ignorer)->Allocate(2);
  auto b = (*mover)->Allocate(2);
  auto c = (*busy)->Allocate(2);
  ASSERT_TRUE(a.has_value() && b.has_value() && c.has_value()) << daemons.Logs();

  // The mover "moves" its data and frees the noticed leases: freeing is the acknowledgement.
  std::mutex mover_mu;
  Status mover_free = Unavailable("no notice yet");
  std::set<uint64_t> mover_noticed;
  Cluster* mover_cluster = mover->get();
  const std::vector<Lease> mover_leases = *b;
  (*mover)->Subscribe([&](const Event& e) {
    mover_events.Record(e);
    if (e.type != EventType::kEvictNotice) return;
    std::vector<Lease> to_free;
    for (const Lease& l : mover_leases) {
      if (std::find(e.lease_ids.begin(), e.lease_ids.end(), l.id()) != e.lease_ids.end()) {
        to_free.push_back(l);
      }
    }
    // The fake cgroup does not see the daemon give memory back: the test says it did, before the
    // FREE, so the daemon never sees the deficit with fewer leases under notice (it would then
    // pick more victims). Above the reserve but below reserve + hysteresis: still no grants.
    cgroup.SetAvailable(100 * kMiB + 10 * kMiB);
    Status s = mover_cluster->Free(to_free);
    std::lock_guard lock(mover_mu);
    mover_free = s;
    mover_noticed.insert(e.lease_ids.begin(), e.lease_ids.end());
  });

  // Data everywhere; the busy client's leases see many more operations than the others'.
  std::vector<uint8_t> page(4096, 0x3c), back(4096);
  auto write_all = [&](Cluster& cl, const std::vector<Lease>& leases, int times) {
    auto ch = cl.OpenChannel(0);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    for (const Lease& l : leases) {
      for (int i = 0; i < times; ++i) ASSERT_TRUE((*ch)->Write(l.slab(), 0, page).ok());
    }
  };
  write_all(**ignorer, *a, 1);
  write_all(**mover, *b, 1);
  write_all(**busy, *c, 50);

  // 4 MiB short of the reserve: four 1 MiB slabs, the four least active of a sample of 4 + 2 = 6
  // (all the leases there are): the ignorer's and the mover's. All four are noticed in one round.
  cgroup.SetAvailable(100 * kMiB - 4 * kMiB);
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto st = (*busy)->Stat(0);
        return st.has_value() && (st->features & wire::kStateUnderPressure) != 0 &&
               st->free_slabs == 0;
      },
      milliseconds(5000)))
      << "STAT does not show the pressure\n"
      << daemons.Logs();
  auto refused = (*busy)->Allocate(1);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kResourceExhausted);

  ASSERT_TRUE(WaitUntil([&] { return !ignorer_events.Of(EventType::kLeasesLost).empty(); },
                        kGrace + milliseconds(5000)))
      << daemons.Logs();
  std::vector<Event> notices = ignorer_events.Of(EventType::kEvictNotice);
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(std::set<uint64_t>(notices[0].lease_ids.begin(), notices[0].lease_ids.end()),
            LeaseIds(*a));
  EXPECT_GT(notices[0].grace_ms, 0u);
  EXPECT_NE(notices[0].deadline, Clock::time_point{});
  std::vector<Event> lost = ignorer_events.Of(EventType::kLeasesLost);
  EXPECT_EQ(std::set<uint64_t>(lost[0].lease_ids.begin(), lost[0].lease_ids.end()), LeaseIds(*a));
  EXPECT_EQ(lost[0].reason.code(), StatusCode::kExpired);

  // The ignored leases are gone: a clean error, never data.
  auto ch = (*ignorer)->OpenChannel(0);
  ASSERT_TRUE(ch.has_value());
  for (const Lease& l : *a) {
    ASSERT_TRUE(
        WaitUntil([&] { return !(*ch)->Read(l.slab(), 0, back).ok(); }, milliseconds(3000)));
    Status r = (*ch)->Read(l.slab(), 0, back);
    EXPECT_EQ(r.code(), StatusCode::kExpired) << r.ToString();
  }
  // The mover freed in time: no error, no loss reported.
  {
    std::lock_guard lock(mover_mu);
    EXPECT_TRUE(mover_free.ok()) << mover_free.ToString();
    EXPECT_EQ(mover_noticed, LeaseIds(*b));
  }
  EXPECT_TRUE(mover_events.Of(EventType::kLeasesLost).empty());
  // The busy client was not touched: no notice, its data is there.
  EXPECT_TRUE(busy_events.Of(EventType::kEvictNotice).empty());
  EXPECT_TRUE(busy_events.Of(EventType::kLeasesLost).empty());
  auto bch = (*busy)->OpenChannel(0);
  ASSERT_TRUE(bch.has_value());
  for (const Lease& l : *c) {
    ASSERT_TRUE((*bch)->Read(l.slab(), 0, back).ok());
    EXPECT_EQ(back, page);
  }

  // Memory is back (above reserve + hysteresis): the daemon grants again.
  cgroup.SetAvailable(kLimit / 2);
  ASSERT_TRUE(WaitUntil([&] { return (*busy)->Allocate(1).has_value(); }, milliseconds(5000)))
      << daemons.Logs();
}

}  // namespace
}  // namespace farmem::client
