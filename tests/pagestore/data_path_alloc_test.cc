// farmem-nbd is a swap device: in swap-safe mode its memory is locked and everything the request
// path needs is allocated at start, because an allocation made while the kernel reclaims memory by
// swapping out through farmem-nbd can wait for that very reclaim (issue 13; docs/nbd.md "Swap
// safety"). This test counts the heap allocations (global operator new, replaced by
// tests/support/counting_new.cc, which counts per thread while the test switches it on) made by
// the thread that runs the requests — the page store's and the stripe store's workers run on the
// caller's thread, and so does the write cache's write-back when the test drives it instead of the
// flusher thread — over real farmemd daemons on loopback, in every layout (none, replicate, the
// split ec layout, the stripe layout), after a warm-up: full-page writes, sub-page writes (the
// cache's merge and fill), reads, FUA and flush, write-backs, a degraded read with a daemon
// killed and a compaction pass. Each must allocate nothing.
//
// What may allocate (and is not measured here): setup, the first request of a kind on a thread
// (thread_local state), error Status messages, re-protection after a failure (the recovery
// thread), the first read of a failed member (its failure is logged and noted once), leasing a
// slab group (the stripe layout's calls that leased one are counted apart, see InPhase).
#include "farmem/blockdev/write_cache.h"
#include "page_store_fixture.h"
#include "stripe_store.h"
#include "support/counting_new.h"

namespace farmem::blockdev::pstest {
namespace {

using farmem::testing::ThreadAllocationCount;
using CountAllocs = farmem::testing::ThreadAllocationScope;

class DataPathAllocTest : public PageStoreTest, public ::testing::WithParamInterface<std::string> {
 protected:
  static constexpr size_t kBatch = 16;

  void SetUp() override {
    faults_ = nullptr;  // no fault-injecting wrapper around the channels: farmem-nbd has none
    bufs_.assign(kBatch * 4 * 4096, 0);
    reads_.assign(kBatch * 4 * 4096, 0);
  }

  void OpenLayout(const std::string& layout) {
    if (layout == "stripe") {
      StripeStoreOptions o;
      o.size = kExport;
      auto r = client::Resilience::Parse("ec:4+2");
      ASSERT_TRUE(r.has_value());
      o.resilience = *r;
      o.op_timeout = op_timeout_;
      o.reconcile_interval = std::chrono::milliseconds(200);
      o.compact_trigger = 0;  // the test runs the compaction pass itself
      auto s = StripeStore::Create(cluster_.get(), o);
      ASSERT_TRUE(s.has_value()) << s.error().ToString();
      stripe_ = s->get();
      stats_ = [this] { return stripe_->stats(); };
      inner_ = std::move(*s);
    } else {
      Open(layout);  // the fixture's page store, then handed to the write cache below
      if (HasFatalFailure()) return;
      PageStore* p = store_.get();
      stats_ = [p] { return p->stats(); };
      inner_ = std::move(store_);
    }
    WriteCacheOptions wo;
    wo.flusher_thread = false;  // the test runs the write-backs on its own (counted) thread
    wo.now = [this] { return now_; };
    if (stripe_ != nullptr) stripe_->TuneWriteCache(wo);
    auto c = WriteCache::Create(std::move(inner_), wo);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    cache_ = std::move(*c);
    target_ = cache_.get();
    shadow_.assign(kExport, 0);
  }

  void TearDown() override {
    target_ = nullptr;
    cache_.reset();
  }

  // A batch of kBatch writes of 1..4 whole pages (or, `sub`, of 512..3584 bytes inside a page) at
  // distinct places, and the FUA flag on the last when `fua`; mirrored into the shadow.
  void WriteBatch(bool sub, bool fua) {
    BlockOp ops[kBatch];
    for (size_t i = 0; i < kBatch; ++i) {
      const uint64_t slice = kExport / kBatch / 4096;
      const uint64_t pages = sub ? 1 : 1 + rng_() % 4;
      uint64_t off = (i * slice + rng_() % (slice - pages)) * 4096;
      uint64_t len = pages * 4096;
      if (sub) {
        len = 512 * (1 + rng_() % 7);
        off += 512 * (rng_() % (8 - len / 512));
      }
      uint8_t* data = bufs_.data() + i * 4 * 4096;
      for (uint64_t j = 0; j < len; ++j) data[j] = static_cast<uint8_t>(rng_());
      ops[i].kind = BlockOp::Kind::kWrite;
      ops[i].offset = off;
      ops[i].length = len;
      ops[i].data = {data, len};
      ops[i].fua = fua && i == kBatch - 1;
    }
    Target().ExecuteBatch(ops);
    for (const BlockOp& op : ops) {
      ASSERT_TRUE(op.status.ok()) << op.status.ToString();
      std::memcpy(shadow_.data() + op.offset, op.data.data(), op.length);
    }
  }

  // A batch of kBatch reads (whole pages, or `sub` 512-byte pieces), checked against the shadow.
  void ReadBatch(bool sub) {
    BlockOp ops[kBatch];
    for (size_t i = 0; i < kBatch; ++i) {
      const uint64_t len = sub ? 512 : 4096 * (1 + rng_() % 4);
      ops[i].kind = BlockOp::Kind::kRead;
      ops[i].offset =
          sub ? (rng_() % (kExport / 512)) * 512 : (rng_() % (kExport / 4096 - 4)) * 4096;
      ops[i].length = len;
      ops[i].read_into = {reads_.data() + i * 4 * 4096, len};
    }
    Target().ExecuteBatch(ops);
    for (const BlockOp& op : ops) {
      ASSERT_TRUE(op.status.ok()) << op.status.ToString();
      ASSERT_EQ(0, std::memcmp(op.read_into.data(), shadow_.data() + op.offset, op.length))
          << "read of " << op.length << " at " << op.offset;
    }
  }

  // Write-backs of every dirty page, as the flusher does them when they age.
  void WriteBackAll() {
    now_ += std::chrono::seconds(10);
    Status s = cache_->WriteBackExpired();
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  uint64_t DegradedReads() { return stats_().degraded_reads; }
  uint64_t Leased() { return stripe_ != nullptr ? stripe_->stripe_stats().leased_bytes : 0; }

  // What a round does, by kind; each kind's allocations are counted apart.
  enum Phase { kFullPageWrites, kSubPageWrites, kReads, kWriteBacks, kPhases };
  static constexpr const char* kPhaseNames[kPhases] = {
      "full-page writes (and FUA)", "sub-page writes (merged in the cache)",
      "reads (whole and sub-page)", "write-backs and flushes"};
  // Leasing a slab group allocates (client::Cluster::AllocateGroup; docs/nbd.md "Swap safety":
  // once per k + r slabs, a documented gap). The stripe layout writes every stripe to a new row
  // and the test runs no compaction until the end, so its rows in use grow through the rounds and
  // now and then a write leases a group: a call that did is counted apart (printed, not asserted).
  template <class F>
  void InPhase(Phase p, F&& f) {
    const uint64_t leased = Leased();
    const uint64_t before = ThreadAllocationCount();  // grows only while counting
    f();
    const uint64_t allocs = ThreadAllocationCount() - before;
    if (Leased() != leased) {
      ++leasing_calls_[p];
      leasing_allocs_[p] += allocs;
    } else {
      phase_allocs_[p] += allocs;
    }
  }

  // One round of everything the steady state does.
  void Round() {
    InPhase(kFullPageWrites, [&] {
      for (int i = 0; i < 4; ++i) WriteBatch(false, false);
      WriteBatch(false, true);
    });
    InPhase(kSubPageWrites, [&] {
      WriteBatch(true, false);
      WriteBatch(true, true);
    });
    InPhase(kReads, [&] {
      ReadBatch(false);
      ReadBatch(true);
    });
    InPhase(kWriteBacks, [&] {
      WriteBackAll();
      Status s = Target().Flush();
      ASSERT_TRUE(s.ok()) << s.ToString();
    });
    InPhase(kSubPageWrites, [&] { WriteBatch(true, false); });
    InPhase(kWriteBacks, [&] { ASSERT_TRUE(Target().Flush().ok()); });
  }

  std::mt19937_64 rng_{7};
  std::vector<uint8_t> bufs_, reads_;
  std::unique_ptr<BatchBackend> inner_;
  std::unique_ptr<WriteCache> cache_;
  StripeStore* stripe_ = nullptr;
  uint64_t phase_allocs_[kPhases] = {};
  uint64_t leasing_calls_[kPhases] = {};
  uint64_t leasing_allocs_[kPhases] = {};
  std::function<PageStoreStats()> stats_;
  std::chrono::steady_clock::time_point now_ = std::chrono::steady_clock::now();
};

TEST_P(DataPathAllocTest, SteadyStateAllocatesNothing) {
  StartDaemons(6);
  OpenLayout(GetParam());
  // Warm-up: every page written once (with encryption the page table of seals has an entry for
  // each page written: it grows until the whole export was; docs/security.md), every slab
  // leased, every thread_local made; then a few rounds of everything.
  for (uint64_t off = 0; off < kExport; off += bufs_.size()) {
    ASSERT_TRUE(Target().Write(off, bufs_, false).ok());
  }
  ASSERT_TRUE(Target().Flush().ok());
  for (int i = 0; i < 4; ++i) Round();
  if (HasFatalFailure()) return;
  for (int p = 0; p < kPhases; ++p) leasing_calls_[p] = 0;  // the warm-up's leases
  {
    CountAllocs c;
    for (int i = 0; i < 4; ++i) Round();
  }
  if (HasFatalFailure()) return;
  // Every layout, every phase: the stripe layout's writes take their span sets from their slab
  // group's (RemoteStore: made with the group) and copy its members onto the stack; ec decode
  // plans are built when the codec is made.
  for (int p = 0; p < kPhases; ++p) {
    if (leasing_calls_[p] > 0) {
      std::printf("%s, %s: %llu allocations in %llu calls that leased a slab group (not counted)\n",
                  GetParam().c_str(), kPhaseNames[p],
                  static_cast<unsigned long long>(leasing_allocs_[p]),
                  static_cast<unsigned long long>(leasing_calls_[p]));
    }
    EXPECT_EQ(phase_allocs_[p], 0u)
        << "allocations on the request thread in the steady state, " << kPhaseNames[p] << " ("
        << GetParam() << "; FARMEM_ALLOC_TRACE=1 prints where)";
  }
  if (stripe_ != nullptr) {
    uint64_t moved = 0;
    ASSERT_TRUE(stripe_->CompactOnce(&moved).ok());  // warm-up
    for (int i = 0; i < 4; ++i) Round();
    Status s;
    uint64_t allocs = 0;
    const uint64_t leased = Leased();
    {
      CountAllocs c;
      s = stripe_->CompactOnce(&moved);
      allocs = c.count();
    }
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_GT(moved, 0u) << "the compaction pass moved nothing: it did not test anything";
    std::printf("stripe, a compaction pass moving %llu pages: %llu allocations (%llu sets)\n",
                static_cast<unsigned long long>(moved), static_cast<unsigned long long>(allocs),
                static_cast<unsigned long long>(stripe_->stripe_stats().sets));
    if (Leased() == leased) {  // it writes stripes: their sets come with their group
      EXPECT_EQ(allocs, 0u)
          << "allocations in a compaction pass (FARMEM_ALLOC_TRACE=1 prints where)";
    }
  }
  if (GetParam() == "none") return;  // nothing to read degraded
  // A degraded read: daemon 0 killed and noticed; the first reads that meet it may allocate
  // (its failure is noted and logged once), the ones after must not.
  (*daemons_)[0].Kill();
  WaitUntilNoticedDown(0);
  for (int i = 0; i < 8; ++i) ReadBatch(false);
  if (HasFatalFailure()) return;
  const uint64_t degraded_before = DegradedReads();
  uint64_t allocs = 0;
  {
    CountAllocs c;
    for (int i = 0; i < 8; ++i) ReadBatch(false);
    allocs = c.count();
  }
  if (GetParam() != "replicate:2") {  // replicate reads a live copy: not counted as degraded
    EXPECT_GT(DegradedReads(), degraded_before) << "no read was degraded: nothing was tested";
  }
  EXPECT_EQ(allocs, 0u) << "allocations in degraded reads (" << GetParam()
                        << "; FARMEM_ALLOC_TRACE=1 prints where)";
}

INSTANTIATE_TEST_SUITE_P(Layouts, DataPathAllocTest,
                         ::testing::Values("none", "replicate:2", "ec:4+2", "stripe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

}  // namespace
}  // namespace farmem::blockdev::pstest
