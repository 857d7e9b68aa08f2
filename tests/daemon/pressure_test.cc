// Local memory pressure (issue 12), without a daemon process: the memory sources' parsing of
// cgroup v1/v2 and /proc files, the PressurePolicy's grant budget, revocation and hysteresis, the
// choice of victims by access counts, and the Reclaimer driving a real SlabPool from a fake
// memory source.
#include "pressure.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "farmem/common/mutex.h"
#include "memory_source.h"
#include "reclaimer.h"
#include "slab_pool.h"
#include "support/process.h"
#include "support/wait.h"

namespace farmem::daemon {
namespace {

using farmem::testing::WaitUntil;
using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kSlab = 64 * kMiB;

MemorySnapshot Snap(uint64_t limit_mib, uint64_t available_mib) {
  MemorySnapshot s;
  s.limit = limit_mib * kMiB;
  s.available = available_mib * kMiB;
  return s;
}

void WriteFile(const std::filesystem::path& p, const std::string& text) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

TEST(ReserveTest, ParsesSizesAndPercentages) {
  auto a = ParseReserve("2G");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->Of(100 * kMiB), 2ull << 30);
  auto b = ParseReserve("10%");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->Of(1000 * kMiB), 100 * kMiB);
  EXPECT_FALSE(ParseReserve("150%").has_value());
  EXPECT_FALSE(ParseReserve("lots").has_value());
}

TEST(ReserveTest, MustLeaveRoomForOneSlab) {
  EXPECT_TRUE(CheckReserveLeavesRoom(*ParseReserve("10%"), 1024 * kMiB, 64 * kMiB, "host").ok());
  EXPECT_TRUE(CheckReserveLeavesRoom(*ParseReserve("0"), kSlab, kSlab, "host").ok());
  EXPECT_TRUE(CheckReserveLeavesRoom(*ParseReserve("960M"), 1024 * kMiB, 64 * kMiB, "host").ok());
  // All of it, more than all of it, or all but less than one slab.
  const Status all = CheckReserveLeavesRoom(*ParseReserve("1G"), 1024 * kMiB, kSlab, "host");
  EXPECT_FALSE(all.ok());
  EXPECT_NE(all.ToString().find("would never lend"), std::string::npos) << all.ToString();
  EXPECT_FALSE(CheckReserveLeavesRoom(*ParseReserve("2G"), 1024 * kMiB, kSlab, "host").ok());
  EXPECT_FALSE(CheckReserveLeavesRoom(*ParseReserve("961M"), 1024 * kMiB, 64 * kMiB, "x").ok());
  EXPECT_FALSE(CheckReserveLeavesRoom(*ParseReserve("10%"), 64 * kMiB, 64 * kMiB, "x").ok());
}

TEST(PressurePolicyTest, GrantsOnlyWhatLeavesTheReserveFree) {
  PressurePolicy p({.reserve = *ParseReserve("1G")});
  PressureDecision d = p.Update(Snap(8192, 1024 + 3 * 64 + 10), kSlab, 0);
  EXPECT_FALSE(d.holding);
  ASSERT_TRUE(d.grant_budget.has_value());
  EXPECT_EQ(*d.grant_budget, 3u);
  EXPECT_EQ(d.evict, 0u);
}

TEST(PressurePolicyTest, StopsGrantingAtOnceAndRevokesTheDeficitIfItPersists) {
  PressurePolicy p({.reserve = *ParseReserve("1G"), .confirm_polls = 2});
  // 150 MiB short of the reserve: 3 slabs of 64 MiB cover it.
  PressureDecision d = p.Update(Snap(8192, 1024 - 150), kSlab, 0);
  EXPECT_TRUE(d.holding);
  EXPECT_TRUE(d.changed);
  EXPECT_EQ(d.grant_budget, std::optional<uint32_t>(0));
  EXPECT_EQ(d.evict, 0u) << "a single reading below the reserve must not evict yet";
  d = p.Update(Snap(8192, 1024 - 150), kSlab, 0);
  EXPECT_EQ(d.evict, 3u);
  // Those three are under notice: nothing more until their memory comes back.
  d = p.Update(Snap(8192, 1024 - 150), kSlab, 3);
  EXPECT_EQ(d.evict, 0u);
  // A bigger deficit asks only for the difference.
  d = p.Update(Snap(8192, 1024 - 300), kSlab, 3);
  EXPECT_EQ(d.evict, 2u);
}

TEST(PressurePolicyTest, HysteresisKeepsItFromFlapping) {
  PressurePolicy p({.reserve = *ParseReserve("1G"), .confirm_polls = 2});
  // hysteresis = max(slab, reserve / 4) = 256 MiB
  (void)p.Update(Snap(8192, 1000), kSlab, 0);
  ASSERT_TRUE(p.holding());
  int flips = 0;
  for (int i = 0; i < 20; ++i) {  // memory wobbles around the reserve
    PressureDecision d = p.Update(Snap(8192, i % 2 == 0 ? 1030 : 1200), kSlab, 0);
    flips += d.changed ? 1 : 0;
    EXPECT_EQ(d.grant_budget, std::optional<uint32_t>(0));
    EXPECT_EQ(d.evict, 0u) << "above the reserve nothing is evicted";
  }
  EXPECT_EQ(flips, 0);
  PressureDecision d = p.Update(Snap(8192, 1024 + 256), kSlab, 0);
  EXPECT_TRUE(d.changed);
  EXPECT_FALSE(d.holding);
  EXPECT_EQ(d.grant_budget, std::optional<uint32_t>(4));
}

TEST(PressurePolicyTest, PsiAndLimitHitsArePressureToo) {
  PressurePolicy p({.reserve = *ParseReserve("0"), .psi_full_threshold = 10, .confirm_polls = 1});
  MemorySnapshot s = Snap(8192, 4096);
  s.psi_full_avg10 = 25.0;
  PressureDecision d = p.Update(s, kSlab, 0);
  EXPECT_TRUE(d.holding);
  EXPECT_EQ(d.evict, 1u);
  EXPECT_THAT(d.why, HasSubstr("PSI"));

  PressurePolicy q({.reserve = *ParseReserve("0"), .confirm_polls = 1});
  s = Snap(8192, 4096);
  s.limit_hits = 5;
  EXPECT_FALSE(q.Update(s, kSlab, 0).holding) << "the first reading is the baseline";
  s.limit_hits = 6;
  d = q.Update(s, kSlab, 0);
  EXPECT_TRUE(d.holding);
  EXPECT_THAT(d.why, HasSubstr("limit hit"));
  EXPECT_EQ(d.evict, 0u) << "a cgroup at its limit reclaims cache: that alone evicts nothing";
}

// Regression (cgroup v2 in the guest evicted every lease): PSI avg10 stays high for seconds after
// a stall has ended; with PSI totals only the stall of the last interval counts.
TEST(PressurePolicyTest, AStallThatEndedEvictsNoMore) {
  PressurePolicy p({.reserve = *ParseReserve("0"), .psi_full_threshold = 10, .confirm_polls = 1});
  const auto t0 = std::chrono::steady_clock::now();
  MemorySnapshot s = Snap(8192, 4096);
  s.psi_full_avg10 = 0;
  s.psi_full_total_us = 1'000'000;
  s.taken = t0;
  EXPECT_FALSE(p.Update(s, kSlab, 0).holding) << "the first reading is the baseline";
  s.psi_full_total_us = 1'500'000;  // stalled half of the last second
  s.psi_full_avg10 = 45;
  s.taken = t0 + std::chrono::seconds(1);
  PressureDecision d = p.Update(s, kSlab, 0);
  EXPECT_TRUE(d.holding);
  EXPECT_EQ(d.evict, 1u);
  for (int i = 2; i < 10; ++i) {  // the stall is over; avg10 decays slowly
    s.psi_full_avg10 = 45 - i;
    s.taken = t0 + std::chrono::seconds(i);
    d = p.Update(s, kSlab, 0);
    EXPECT_EQ(d.evict, 0u) << "second " << i << ": evicting for a stall that has ended";
  }
}

TEST(VictimTest, TheLeastActiveOfTheSampleGo) {
  std::vector<LeaseActivity> sample = {
      {0, 100, 50}, {1, 101, 3}, {2, 102, 900}, {3, 103, 0}, {4, 104, 7}};
  EXPECT_THAT(ChooseVictims(sample, 2), ::testing::ElementsAre(103u, 101u));
  EXPECT_THAT(ChooseVictims(sample, 9), ::testing::SizeIs(5));
}

TEST(MemorySourceTest, ReadsCgroupV2) {
  testing::TempDir dir;
  const std::filesystem::path cg = std::filesystem::path(dir.path()) / "cg";
  WriteFile(cg / "memory.max", "1073741824\n");
  WriteFile(cg / "memory.current", "805306368\n");                     // 768 MiB
  WriteFile(cg / "memory.stat", "anon 1\ninactive_file 134217728\n");  // 128 MiB reclaimable
  WriteFile(cg / "memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n");
  WriteFile(cg / "memory.pressure",
            "some avg10=1.00 avg60=0 avg300=0 total=1\n"
            "full avg10=0.50 avg60=0 avg300=0 total=1\n");
  auto src = OpenMemorySource("cgroup:" + cg.string(), dir.path());
  ASSERT_TRUE(src.has_value()) << src.error().ToString();
  auto s = (*src)->Read();
  ASSERT_TRUE(s.has_value()) << s.error().ToString();
  EXPECT_EQ(s->limit, 1024 * kMiB);
  EXPECT_EQ(s->available, (1024 - 768 + 128) * kMiB);
  EXPECT_EQ(s->limit_hits, 5u);
  EXPECT_EQ(s->psi_full_avg10, std::optional<double>(0.5));
  EXPECT_THAT((*src)->name(), HasSubstr("v2"));
}

TEST(MemorySourceTest, ReadsCgroupV1AndFindsItsOwnCgroup) {
  testing::TempDir dir;
  const std::filesystem::path root = std::filesystem::path(dir.path()) / "sys";
  const std::filesystem::path proc = std::filesystem::path(dir.path()) / "proc";
  const std::filesystem::path cg = root / "memory" / "farmem";
  WriteFile(cg / "memory.limit_in_bytes", "536870912\n");
  WriteFile(cg / "memory.usage_in_bytes", "268435456\n");
  WriteFile(cg / "memory.stat", "cache 0\ntotal_inactive_file 67108864\n");
  WriteFile(cg / "memory.failcnt", "2\n");
  WriteFile(proc / "self" / "cgroup", "5:devices:/\n4:memory:/farmem\n0::/\n");
  WriteFile(proc / "meminfo", "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n");
  WriteFile(proc / "pressure" / "memory", "some avg10=0.00\nfull avg10=3.25 avg60=0.00\n");
  auto src = OpenMemorySource("auto", proc, root);
  ASSERT_TRUE(src.has_value()) << src.error().ToString();
  EXPECT_THAT((*src)->name(), HasSubstr("v1"));
  auto s = (*src)->Read();
  ASSERT_TRUE(s.has_value()) << s.error().ToString();
  EXPECT_EQ(s->limit, 512 * kMiB);
  EXPECT_EQ(s->available, (512 - 256 + 64) * kMiB);
  EXPECT_EQ(s->limit_hits, 2u);
  EXPECT_EQ(s->psi_full_avg10, std::optional<double>(3.25));

  // Without a limit (v1's default is about 2^63) the host is the source.
  WriteFile(cg / "memory.limit_in_bytes", "9223372036854771712\n");
  auto host = OpenMemorySource("auto", proc, root);
  ASSERT_TRUE(host.has_value());
  EXPECT_THAT((*host)->name(), HasSubstr("host"));
  auto h = (*host)->Read();
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->available, 20000000ull * 1024);
  EXPECT_FALSE(OpenMemorySource("cgroup", proc, root).has_value())
      << "cgroup was asked for explicitly, and it has no limit";
}

// Records what the Reclaimer sends, in place of the Server's connections.
class RecordingSink final : public NoticeSink {
 public:
  void DeliverNotice(const EvictionNotice& n) override {
    MutexLock lock(&mu_);
    notices_.push_back(n);
  }
  std::vector<EvictionNotice> notices() {
    MutexLock lock(&mu_);
    return notices_;
  }

 private:
  Mutex mu_;
  std::vector<EvictionNotice> notices_ GUARDED_BY(mu_);
};

wire::ClientId Client(uint8_t b) {
  wire::ClientId id{};
  id.fill(b);
  return id;
}

// A pool of `slabs` slabs of 1 MiB, nothing mlocked, leases that outlive the test; null (and a
// failure) if it cannot be made.
std::unique_ptr<SlabPool> SmallPool(uint64_t slabs, const char* max_client_share) {
  auto p = SlabPool::Create({.capacity = slabs * kMiB,
                             .slab_size = kMiB,
                             .lease_ttl = milliseconds(60000),
                             .mlock = false,
                             .max_client_share = *ParseClientShare(max_client_share)});
  EXPECT_TRUE(p.has_value()) << p.error().ToString();
  return p.has_value() ? std::move(*p) : nullptr;
}

class ReclaimerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = SmallPool(8, "1");
    ASSERT_NE(pool_, nullptr);
    source_ = std::make_shared<FakeMemorySource>();
    source_->Set(Snap(1024, 900));
  }
  std::unique_ptr<Reclaimer> Make(milliseconds grace) {
    return std::make_unique<Reclaimer>(
        ReclaimOptions{.source = source_,
                       .pressure = {.reserve = *ParseReserve("100M"), .confirm_polls = 2},
                       .evict_grace = grace,
                       .sample_extra = 2},
        pool_.get(), &sink_);
  }
  std::unique_ptr<SlabPool> pool_;
  std::shared_ptr<FakeMemorySource> source_;
  RecordingSink sink_;
};

TEST_F(ReclaimerTest, PressureStopsGrantsNoticesTheLeastActiveAndEvictsAtTheDeadline) {
  auto r = Make(milliseconds(0));  // deadline at once: this test is not about waiting
  auto busy = pool_->Grant(4, Client(1));
  auto idle = pool_->Grant(2, Client(2));
  ASSERT_TRUE(busy.has_value() && idle.has_value());
  for (const wire::LeaseGrant& g : *busy) {
    for (int i = 0; i < 10; ++i)
      ASSERT_TRUE(pool_->Acquire(g.lease_id, Client(1), 0, 1).has_value());
  }
  EXPECT_EQ(r->Poll(), 0u);
  EXPECT_TRUE(pool_->Grant(1, Client(3)).has_value()) << "no pressure yet";

  source_->Set(Snap(1024, 100 - 2));  // 2 MiB below the reserve: two 1 MiB slabs
  EXPECT_EQ(r->Poll(), 0u) << "the first reading below the reserve only stops grants";
  auto refused = pool_->Grant(1, Client(3));
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.error().message(), HasSubstr("short of memory"));
  EXPECT_EQ(pool_->stats().free_slabs, 0u) << "STAT must not advertise slabs it will not grant";

  // Still below at the next reading: E = 2 leases are noticed (chosen from a sample of 4).
  EXPECT_EQ(r->Poll(), 2u);
  std::vector<EvictionNotice> notices = sink_.notices();
  std::set<uint64_t> noticed;
  for (const EvictionNotice& n : notices) {
    for (uint64_t id : n.lease_ids) noticed.insert(id);
  }
  ASSERT_EQ(noticed.size(), 2u);
  // Grouped by owner: one notice per client.
  std::set<wire::ClientId> owners;
  for (const EvictionNotice& n : notices) EXPECT_TRUE(owners.insert(n.owner).second);

  // The next round ends them (deadline passed): their data operations fail cleanly.
  (void)r->Poll();
  for (uint64_t id : noticed) {
    for (const wire::ClientId& c : {Client(1), Client(2), Client(3)}) {
      auto pin = pool_->Acquire(id, c, 0, 1);
      ASSERT_FALSE(pin.has_value());
      EXPECT_EQ(pin.error().code(), StatusCode::kExpired);
    }
  }
  EXPECT_EQ(pool_->stats().leased_slabs, 5u);

  // Memory is back above reserve + hysteresis (max(1 MiB, 25 MiB)): grants resume.
  source_->Set(Snap(1024, 100 + 30));
  (void)r->Poll();
  EXPECT_TRUE(pool_->Grant(1, Client(3)).has_value());
}

TEST_F(ReclaimerTest, VictimsAreTheLeastActiveOfTheSample) {
  auto r = Make(milliseconds(60000));
  // 8 leases; the sample is all of them when E + extra >= 8: E = 6 of 8 here.
  auto leases = pool_->Grant(8, Client(1));
  ASSERT_TRUE(leases.has_value());
  for (size_t i = 0; i < leases->size(); ++i) {
    for (size_t k = 0; k < i * 3; ++k) {
      ASSERT_TRUE(pool_->Acquire((*leases)[i].lease_id, Client(1), 0, 1).has_value());
    }
  }
  source_->Set(Snap(1024, 100 - 6));
  (void)r->Poll();
  EXPECT_EQ(r->Poll(), 6u);
  std::vector<EvictionNotice> n = sink_.notices();
  ASSERT_EQ(n.size(), 1u);
  std::set<uint64_t> got(n[0].lease_ids.begin(), n[0].lease_ids.end());
  std::set<uint64_t> want;
  for (size_t i = 0; i < 6; ++i) want.insert((*leases)[i].lease_id);  // the 6 least used
  EXPECT_EQ(got, want);
  EXPECT_GT(n[0].grace_ms, 59000u);
}

TEST_F(ReclaimerTest, FreedInTimeIsNoEvictionAndDrainNoticesEverything) {
  auto r = Make(milliseconds(60000));
  auto a = pool_->Grant(3, Client(1));
  auto b = pool_->Grant(2, Client(2));
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(r->Drain(milliseconds(60000)), 5u);
  EXPECT_EQ(sink_.notices().size(), 2u);
  auto refused = pool_->Grant(1, Client(3));
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(pool_->stats().draining);
  // Client 1 moves its data and frees: fine, no error.
  std::vector<uint64_t> ids;
  for (const wire::LeaseGrant& g : *a) ids.push_back(g.lease_id);
  EXPECT_TRUE(pool_->Release(ids, Client(1)).ok());
  (void)r->Poll();
  EXPECT_EQ(pool_->stats().leased_slabs, 2u) << "client 2's deadline has not passed";
  r->Undrain();
  EXPECT_EQ(pool_->stats().noticed_slabs, 0u);
  EXPECT_TRUE(pool_->Grant(1, Client(3)).has_value());
}

// A registrar whose RegisterLease waits at a gate: a grant in progress, held there.
class GatedRegistrar : public LeaseRegistrar {
 public:
  Result<uint32_t> RegisterLease(uint32_t slab, const wire::ClientId&, void*, uint64_t) override {
    MutexLock lock(&mu_);
    ++entered_;
    cv_.SignalAll();
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return open_; });
    return 1000 + slab;
  }
  void DeregisterLease(uint32_t) override {}
  void WaitEntered(int n) {
    MutexLock lock(&mu_);
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return entered_ >= n; });
  }
  void Open() {
    MutexLock lock(&mu_);
    open_ = true;
    cv_.SignalAll();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  int entered_ GUARDED_BY(mu_) = 0;
  bool open_ GUARDED_BY(mu_) = false;
};

// Populating and registering a slab can take seconds (mlock while the kernel compacts memory;
// an RDMA registration pins every page): a grant does it without the pool's lock, so that every
// other client's heartbeat, STAT and FREE goes on meanwhile — a heartbeat stuck behind a grant
// made a healthy daemon look dead. While it is in progress its slabs count against the client's
// share, and nobody else can be granted them.
TEST(SlabPoolTest, AGrantInProgressBlocksNeitherHeartbeatsNorOtherClients) {
  std::unique_ptr<SlabPool> p = SmallPool(4, "50%");
  ASSERT_NE(p, nullptr);
  SlabPool& pool = *p;
  GatedRegistrar registrar;
  pool.SetRegistrar(&registrar);
  Result<std::vector<wire::LeaseGrant>> first = Err(Internal("not run"));
  std::thread granting([&] { first = pool.Grant(2, Client(1)); });
  registrar.WaitEntered(1);
  // Held at the registrar, the grant holds no lock: these return (they would hang otherwise).
  EXPECT_EQ(pool.Renew(Client(2)), 0u);
  EXPECT_EQ(pool.stats().total_slabs, 4u);
  // Client 1's share (2 of 4) is taken by the grant in progress.
  Result<std::vector<wire::LeaseGrant>> more = pool.Grant(1, Client(1));
  ASSERT_FALSE(more.has_value());
  EXPECT_THAT(more.error().ToString(), HasSubstr("already holds 2"));
  registrar.Open();  // client 2's grant below registers at once
  Result<std::vector<wire::LeaseGrant>> other = pool.Grant(2, Client(2));
  granting.join();
  ASSERT_TRUE(first.has_value()) << first.error().ToString();
  ASSERT_TRUE(other.has_value()) << other.error().ToString();
  std::set<uint64_t> addrs;
  for (const auto* g : {&*first, &*other}) {
    for (const wire::LeaseGrant& l : *g) addrs.insert(l.remote_addr);
  }
  EXPECT_EQ(addrs.size(), 4u) << "no slab granted twice";
  EXPECT_EQ(pool.Renew(Client(1)), 2u);
  EXPECT_EQ(pool.Renew(Client(2)), 2u);
  pool.SetRegistrar(nullptr);
}

// Huge pages (PoolOptions::huge_pages): a leased slab is collapsed in the background, but not
// while the pool holds memory back (the host is short of memory: a collapse may reclaim and
// compact, and such leases may be evicted) — that slab keeps its 4 KiB pages and is counted as
// skipped; once the pressure is gone, the next lease is collapsed again.
TEST(SlabPoolTest, NoSlabIsCollapsedIntoHugePagesWhileThePoolHoldsMemoryBack) {
  auto made = SlabPool::Create({.capacity = 8 * 4 * kMiB,
                                .slab_size = 4 * kMiB,  // two huge pages
                                .lease_ttl = milliseconds(60000),
                                .mlock = false,  // populated by MADV_POPULATE_WRITE
                                .huge_pages = true});
  ASSERT_TRUE(made.has_value()) << made.error().ToString();
  SlabPool& pool = **made;
  const auto handled = [&] {
    const PoolStats st = pool.stats();
    return st.huge_page_slabs + st.huge_page_failures + st.huge_page_skips;
  };
  ASSERT_TRUE(pool.Grant(1, Client(1)).has_value());
  ASSERT_TRUE(WaitUntil([&] { return handled() == 1; }, milliseconds(30000)));
  if (pool.stats().huge_page_failures != 0) {
    GTEST_SKIP() << "this kernel did not collapse a slab into huge pages (MADV_COLLAPSE: Linux "
                    "6.1+, transparent huge pages not disabled)";
  }
  EXPECT_EQ(pool.stats().huge_page_slabs, 1u) << "no pressure: the slab is collapsed";

  pool.SetGrantBudget(2);  // 7 slabs free, 2 grantable: holding memory back
  ASSERT_TRUE(pool.stats().holding);
  ASSERT_TRUE(pool.Grant(1, Client(1)).has_value());
  ASSERT_TRUE(WaitUntil([&] { return handled() == 2; }, milliseconds(30000)));
  EXPECT_EQ(pool.stats().huge_page_skips, 1u) << "under pressure the slab keeps its 4 KiB pages";
  EXPECT_EQ(pool.stats().huge_page_slabs, 1u);

  pool.SetGrantBudget(std::nullopt);  // the pressure is over
  ASSERT_TRUE(pool.Grant(1, Client(1)).has_value());
  ASSERT_TRUE(WaitUntil([&] { return handled() == 3; }, milliseconds(30000)));
  EXPECT_EQ(pool.stats().huge_page_slabs, 2u);
  EXPECT_EQ(pool.stats().huge_page_skips, 1u);
}

}  // namespace
}  // namespace farmem::daemon

namespace farmem::daemon {
namespace {

// RDMA accesses in victim choice: one-sided reads and writes never reach the daemon's CPU, so a
// client that uses verbs reports its per-lease counts on HEARTBEAT (wire::AccessReport,
// kFeatureAccessReports) and the daemon credits them to its leases.
TEST(AccessReportTest, HeartbeatBodyRoundTripsAndMalformedOnesAreRefused) {
  std::vector<uint8_t> empty;
  wire::EncodeHeartbeat({}, &empty);
  EXPECT_TRUE(empty.empty()) << "no reports: the empty HEARTBEAT every daemon accepts";
  auto none = wire::DecodeHeartbeat(empty);
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->reports.empty());

  std::vector<uint8_t> body;
  wire::EncodeHeartbeat({{{0x100000002ull, 7}, {0x300000004ull, 1ull << 40}}}, &body);
  EXPECT_EQ(body.size(), 8u + 2 * 16);
  auto back = wire::DecodeHeartbeat(body);
  ASSERT_TRUE(back.has_value()) << back.error().ToString();
  ASSERT_EQ(back->reports.size(), 2u);
  EXPECT_EQ(back->reports[1].lease_id, 0x300000004ull);
  EXPECT_EQ(back->reports[1].accesses, 1ull << 40);

  std::vector<uint8_t> short_body = body;
  short_body.pop_back();
  EXPECT_EQ(wire::DecodeHeartbeat(short_body).error().code(), StatusCode::kProtocolError);
  std::vector<uint8_t> says_three = body;
  says_three[0] = 3;
  EXPECT_FALSE(wire::DecodeHeartbeat(says_three).has_value());
  std::vector<uint8_t> zero(8, 0);
  EXPECT_FALSE(wire::DecodeHeartbeat(zero).has_value()) << "a report of no leases is malformed";
  std::vector<uint8_t> too_many(8 + size_t{wire::kMaxLeasesPerCall + 1} * 16, 0);
  too_many[0] = static_cast<uint8_t>((wire::kMaxLeasesPerCall + 1) & 0xff);
  too_many[1] = static_cast<uint8_t>((wire::kMaxLeasesPerCall + 1) >> 8);
  EXPECT_FALSE(wire::DecodeHeartbeat(too_many).has_value());
}

TEST_F(ReclaimerTest, RdmaAccessesReportedOnHeartbeatCountForVictimChoice) {
  auto r = Make(milliseconds(60000));
  // Client 1 works on its 2 leases over RDMA only: the daemon sees no operation of it. Client 2
  // touches its 6 over TCP, 5 operations each. With 6 to evict (the sample, E + 2, is all 8),
  // the idle-looking RDMA leases would go first unless their reported accesses count.
  auto rdma = pool_->Grant(2, Client(1));
  auto tcp = pool_->Grant(6, Client(2));
  ASSERT_TRUE(rdma.has_value() && tcp.has_value());
  for (const wire::LeaseGrant& g : *tcp) {
    for (int i = 0; i < 5; ++i) {
      ASSERT_TRUE(pool_->Acquire(g.lease_id, Client(2), 0, 1).has_value());
    }
  }
  wire::HeartbeatRequest report;
  for (const wire::LeaseGrant& g : *rdma) report.reports.push_back({g.lease_id, 100});
  EXPECT_EQ(pool_->CreditAccesses(Client(1), report.reports), 2u);
  // Reports for leases the reporter does not hold are ignored: someone else's (which would make
  // client 2's look busy) and one that never existed.
  wire::HeartbeatRequest foreign;
  for (const wire::LeaseGrant& g : *tcp) foreign.reports.push_back({g.lease_id, 1000000});
  foreign.reports.push_back({0, 1000000});
  EXPECT_EQ(pool_->CreditAccesses(Client(3), foreign.reports), 0u);
  EXPECT_EQ(pool_->CreditAccesses(Client(1), foreign.reports), 0u);

  source_->Set(Snap(1024, 100 - 6));
  (void)r->Poll();
  EXPECT_EQ(r->Poll(), 6u);
  std::vector<EvictionNotice> n = sink_.notices();
  ASSERT_EQ(n.size(), 1u) << "only client 2 is noticed";
  EXPECT_EQ(n[0].owner, Client(2));
  std::set<uint64_t> got(n[0].lease_ids.begin(), n[0].lease_ids.end());
  std::set<uint64_t> want;
  for (const wire::LeaseGrant& g : *tcp) want.insert(g.lease_id);
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace farmem::daemon
