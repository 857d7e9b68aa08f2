// WriteCache (write_cache.h) over a recording in-memory backend: partial writes merge into cached
// pages (one backend read at most, none when a batch covers the page), reads see the cache, dirty
// pages go back on eviction (least recently used first), FLUSH, FUA and the dirty-age deadline (a
// fake clock, no sleeps), and a failed write-back is kept and surfaces at the next FLUSH.
#include "farmem/blockdev/write_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include "test_backends.h"

namespace farmem::blockdev {
namespace {

using testing::RecordedOp;
using testing::RecordingBackend;
constexpr uint64_t kPage = 4096;

struct Fixture {
  RecordingBackend* backend = nullptr;  // owned by cache
  std::unique_ptr<WriteCache> cache;
  std::chrono::steady_clock::time_point now{std::chrono::hours(1)};

  // `multiple`, `absorb`: writeback_multiple, absorb_writes_below_pages (the stripe layout's).
  explicit Fixture(size_t pages = 16, size_t batch = 64, uint64_t size = 1u << 20,
                   size_t multiple = 1, size_t absorb = 0) {
    auto mem = MemoryBackend::Create(size);
    EXPECT_TRUE(mem.has_value());
    auto rec = std::make_unique<RecordingBackend>(std::move(*mem));
    backend = rec.get();
    WriteCacheOptions o;
    o.pages = pages;
    o.writeback_batch = batch;
    o.writeback_multiple = multiple;
    o.absorb_writes_below_pages = absorb;
    o.flusher_thread = false;
    o.now = [this] { return now; };
    auto c = WriteCache::Create(std::move(rec), o);
    EXPECT_TRUE(c.has_value()) << c.error().ToString();
    cache = std::move(*c);
  }
  // What the backend holds (bypassing the cache), recorded ops cleared afterwards.
  std::vector<uint8_t> Backing(uint64_t offset, uint64_t len) {
    std::vector<uint8_t> out(len);
    EXPECT_TRUE(backend->Read(offset, out).ok());
    return out;
  }
  std::vector<RecordedOp> Ops(BlockOp::Kind kind) {
    std::vector<RecordedOp> out;
    for (const RecordedOp& op : backend->ops()) {
      if (op.kind == kind) out.push_back(op);
    }
    return out;
  }
};

std::vector<uint8_t> Bytes(size_t n, uint8_t v) { return std::vector<uint8_t>(n, v); }

TEST(WriteCache, PartialWritesMergeInTheCacheAndTheRestIsReadOnceAtWriteBack) {
  Fixture f;
  ASSERT_TRUE(f.backend->Write(8192, Bytes(kPage, 0xaa), false).ok());
  f.backend->clear();
  ASSERT_TRUE(f.cache->Write(8192 + 1024, Bytes(1024, 1), false).ok());
  ASSERT_TRUE(f.cache->Write(8192 + 3072, Bytes(512, 2), false).ok());
  // Nothing read, nothing written yet.
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kRead).empty());
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty());
  EXPECT_EQ(f.cache->stats().dirty, 1u);
  std::vector<uint8_t> part(1536);
  ASSERT_TRUE(f.cache->Read(8192 + 1024, {part.data(), 1024}).ok());
  EXPECT_EQ(std::vector<uint8_t>(part.begin(), part.begin() + 1024), Bytes(1024, 1));
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kRead).empty()) << "sectors the page holds: from the cache";

  std::vector<uint8_t> want = Bytes(kPage, 0xaa);
  std::fill_n(want.begin() + 1024, 1024, 1);
  std::fill_n(want.begin() + 3072, 512, 2);
  std::vector<uint8_t> got(kPage);
  ASSERT_TRUE(f.cache->Read(8192, got).ok());  // backend bytes, the cached sectors over them
  EXPECT_EQ(got, want);
  EXPECT_EQ(f.Ops(BlockOp::Kind::kRead).size(), 1u);

  ASSERT_TRUE(f.cache->Flush().ok());
  auto reads = f.Ops(BlockOp::Kind::kRead);
  ASSERT_EQ(reads.size(), 2u) << "one read of the page to complete it for the write-back";
  EXPECT_EQ(reads[1].offset, 8192u);
  EXPECT_EQ(reads[1].length, kPage);
  auto writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].offset, 8192u);
  EXPECT_EQ(writes[0].length, kPage);
  EXPECT_EQ(f.Ops(BlockOp::Kind::kFlush).size(), 1u) << "the backend's flush runs after";
  EXPECT_EQ(f.Backing(8192, kPage), want);
  EXPECT_EQ(f.cache->stats().dirty, 0u);
}

// Random sub-page writes need the rest of nearly every page at write-back: the fills of a whole
// write-back batch (64 pages) go to the backend as one batch (one round to the daemons), not one
// batch per 16 pages, then the pages as one more.
TEST(WriteCache, AWriteBackReadsTheRestOfAllItsPartlyWrittenPagesInOneBatch) {
  constexpr size_t kPages = 64;
  Fixture f(/*pages=*/2 * kPages, /*batch=*/kPages);
  for (size_t p = 0; p < kPages; ++p) {
    ASSERT_TRUE(f.backend->Write(p * 2 * kPage, Bytes(kPage, 0xaa), false).ok());
  }
  for (size_t p = 0; p < kPages; ++p) {  // every other page: no two of them adjacent
    ASSERT_TRUE(
        f.cache->Write(p * 2 * kPage + 1024, Bytes(1024, static_cast<uint8_t>(p)), false).ok());
  }
  f.backend->clear();
  const uint64_t batches = f.backend->batches_finished();
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_EQ(f.backend->batches_finished() - batches, 2u)
      << "one batch of fills, one of write-backs";
  EXPECT_EQ(f.Ops(BlockOp::Kind::kRead).size(), kPages);
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), kPages);
  EXPECT_EQ(f.cache->stats().fills, kPages);
  for (size_t p = 0; p < kPages; ++p) {
    std::vector<uint8_t> want = Bytes(kPage, 0xaa);
    std::fill_n(want.begin() + 1024, 1024, static_cast<uint8_t>(p));
    ASSERT_EQ(f.Backing(p * 2 * kPage, kPage), want) << "page " << p * 2;
  }
}

TEST(WriteCache, SmallWritesThatFillAPageNeedNoRead) {
  Fixture f;
  std::vector<std::vector<uint8_t>> data;
  std::vector<BlockOp> ops(8);
  for (size_t i = 0; i < ops.size(); ++i) {
    data.push_back(Bytes(512, static_cast<uint8_t>(i + 1)));
    ops[i].kind = BlockOp::Kind::kWrite;
    ops[i].offset = kPage + i * 512;
    ops[i].length = 512;
    ops[i].data = data[i];
  }
  f.cache->ExecuteBatch(ops);
  for (const BlockOp& op : ops) EXPECT_TRUE(op.status.ok()) << op.status.ToString();
  ASSERT_TRUE(f.cache->Write(3 * kPage, Bytes(1024, 9), false).ok());  // and one at a time
  ASSERT_TRUE(f.cache->Write(3 * kPage + 1024, Bytes(3072, 9), false).ok());
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kRead).empty());
  EXPECT_EQ(f.cache->stats().fills, 0u);
  EXPECT_EQ(f.Backing(3 * kPage, kPage), Bytes(kPage, 9));
  const auto back = f.Backing(kPage, kPage);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(back[i * 512], i + 1);
}

TEST(WriteCache, ReadsSeeCachedBytesAlsoWhenTheyOverlapCachedPagesPartly) {
  Fixture f;
  ASSERT_TRUE(f.backend->Write(0, Bytes(4 * kPage, 7), false).ok());
  ASSERT_TRUE(f.cache->Write(kPage + 512, Bytes(1024, 9), false).ok());
  std::vector<uint8_t> got(2 * kPage);
  ASSERT_TRUE(f.cache->Read(512, got).ok());  // pages 0 (backend), 1 (cache), 2 (backend)
  std::vector<uint8_t> want = Bytes(2 * kPage, 7);
  std::fill_n(want.begin() + kPage, 1024, 9);
  EXPECT_EQ(got, want);
}

TEST(WriteCache, EvictionWritesBackTheLeastRecentlyUsedDirtyPageFirst) {
  Fixture f(/*pages=*/8, /*batch=*/1);
  for (uint64_t p = 0; p < 8; ++p)
    ASSERT_TRUE(f.cache->Write(p * kPage, Bytes(512, 1), false).ok());
  ASSERT_TRUE(f.cache->Write(0, Bytes(512, 2), false).ok());  // page 0 used again: page 1 is LRU
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty());
  ASSERT_TRUE(f.cache->Write(8 * kPage, Bytes(512, 3), false).ok());  // needs a page
  auto writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].offset, 1 * kPage);
  ASSERT_TRUE(f.cache->Write(9 * kPage, Bytes(512, 3), false).ok());
  writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[1].offset, 2 * kPage);
  // Evicted pages still read back right (from the backend now).
  std::vector<uint8_t> got(512);
  ASSERT_TRUE(f.cache->Read(1 * kPage, got).ok());
  EXPECT_EQ(got, Bytes(512, 1));
}

// The flusher's pass ahead of need (WriteBackAhead): once half the cache is dirty, least recently
// used dirty pages go back a batch at a time until fewer are dirty, so the writes after it find
// pages without a write-back of their own.
TEST(WriteCache, DirtyPagesGoBackAheadOfNeedOnceHalfTheCacheIsDirty) {
  Fixture f(/*pages=*/16, /*batch=*/4);
  ASSERT_EQ(f.cache->ahead_dirty_pages(), 8u);  // max(16 / 2, 16 - 2 * 4)
  for (uint64_t p = 0; p < 7; ++p)
    ASSERT_TRUE(f.cache->Write(p * kPage, Bytes(512, static_cast<uint8_t>(p + 1)), false).ok());
  ASSERT_TRUE(f.cache->WriteBackAhead().ok());  // 7 dirty: below the threshold
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty());
  ASSERT_TRUE(f.cache->Write(7 * kPage, Bytes(512, 8), false).ok());
  ASSERT_TRUE(f.cache->WriteBackAhead().ok());  // 8 dirty: one batch of 4 goes back, 4 stay
  auto writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 4u);
  for (uint64_t p = 0; p < 4; ++p) EXPECT_EQ(writes[p].offset, p * kPage);
  EXPECT_EQ(f.cache->stats().dirty, 4u);
  EXPECT_EQ(f.cache->stats().fills, 4u);
  // 8 free and 4 clean pages: the next 12 pages written need no write-back.
  for (uint64_t p = 8; p < 20; ++p)
    ASSERT_TRUE(f.cache->Write(p * kPage, Bytes(512, 9), false).ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 4u);
  for (uint64_t p = 0; p < 4; ++p) {
    EXPECT_EQ(f.Backing(p * kPage, 512), Bytes(512, static_cast<uint8_t>(p + 1)));
  }
  std::vector<uint8_t> got(512);
  ASSERT_TRUE(f.cache->Read(0, got).ok());  // page 0 was evicted by page 19: from the backend
  EXPECT_EQ(got, Bytes(512, 1));
}

TEST(WriteCache, FuaWriteIsInTheBackendWhenItReturnsAndTakesOnlyItsPages) {
  Fixture f;
  ASSERT_TRUE(f.cache->Write(0, Bytes(1024, 1), false).ok());
  ASSERT_TRUE(f.cache->Write(5 * kPage + 2048, Bytes(1024, 2), /*fua=*/true).ok());
  auto writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].offset, 5 * kPage);
  EXPECT_TRUE(writes[0].fua);
  EXPECT_EQ(f.Backing(5 * kPage + 2048, 1024), Bytes(1024, 2));
  EXPECT_EQ(f.cache->stats().dirty, 1u);  // page 0 is still only cached
}

TEST(WriteCache, DirtyPagesGoBackWhenTheyReachTheirDeadline) {
  Fixture f;  // the fake clock: time moves only when the test says so
  ASSERT_TRUE(f.cache->Write(0, Bytes(512, 1), false).ok());
  f.now += std::chrono::milliseconds(60);
  ASSERT_TRUE(f.cache->Write(kPage, Bytes(512, 2), false).ok());
  f.now += std::chrono::milliseconds(39);  // page 0 dirty 99 ms
  ASSERT_TRUE(f.cache->WriteBackExpired().ok());
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty());
  f.now += std::chrono::milliseconds(1);  // 100 ms
  ASSERT_TRUE(f.cache->WriteBackExpired().ok());
  auto writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].offset, 0u);
  f.now += std::chrono::milliseconds(60);  // page 1 dirty 100 ms
  ASSERT_TRUE(f.cache->WriteBackExpired().ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 2u);
  EXPECT_EQ(f.cache->stats().expired, 2u);
  EXPECT_EQ(f.cache->stats().dirty, 0u);
}

// The stripe layout's setting (StripeStore::TuneWriteCache, k = 4): whole-page writes of fewer
// than 16 pages are held, whole groups of 4 too; write-backs by deadline, FUA and Flush are
// topped up to whole groups of 4 with other dirty pages; writes of 16 pages and more pass
// straight through.
TEST(WriteCache, HeldWholePageWritesGoBackInWholeGroups) {
  Fixture f(/*pages=*/64, /*batch=*/64, 1u << 20, /*multiple=*/4, /*absorb=*/16);
  ASSERT_TRUE(f.cache->Write(0, Bytes(kPage, 1), false).ok());
  f.now += std::chrono::milliseconds(60);
  for (uint64_t p = 1; p <= 5; ++p)
    ASSERT_TRUE(f.cache->Write(p * kPage, Bytes(kPage, 2), false).ok());
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty()) << "single whole pages are held";
  EXPECT_EQ(f.cache->stats().dirty, 6u);
  f.now += std::chrono::milliseconds(40);  // page 0 is due, pages 1..5 are not
  ASSERT_TRUE(f.cache->WriteBackExpired().ok());
  auto writes = f.Ops(BlockOp::Kind::kWrite);
  ASSERT_EQ(writes.size(), 4u) << "the due page, topped up to a group of 4";
  EXPECT_EQ(writes[0].offset, 0u);
  EXPECT_EQ(f.cache->stats().dirty, 2u);
  // A FUA write of one page: back before it returns, with the two held pages and one more.
  f.backend->clear();
  ASSERT_TRUE(f.cache->Write(20 * kPage, Bytes(kPage, 3), false).ok());
  ASSERT_TRUE(f.cache->Write(21 * kPage, Bytes(kPage, 4), /*fua=*/true).ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 4u);
  EXPECT_EQ(f.Backing(21 * kPage, kPage), Bytes(kPage, 4));
  EXPECT_EQ(f.cache->stats().dirty, 0u);
  // Large writes pass straight through; two whole groups (8 pages) and 5 pages are held.
  f.backend->clear();
  ASSERT_TRUE(f.cache->Write(32 * kPage, Bytes(8 * kPage, 5), false).ok());
  ASSERT_TRUE(f.cache->Write(64 * kPage, Bytes(17 * kPage, 6), false).ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 1u);
  ASSERT_TRUE(f.cache->Write(100 * kPage, Bytes(5 * kPage, 7), false).ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 1u);
  EXPECT_EQ(f.cache->stats().dirty, 13u);
  std::vector<uint8_t> got(5 * kPage);
  ASSERT_TRUE(f.cache->Read(100 * kPage, got).ok());
  EXPECT_EQ(got, Bytes(5 * kPage, 7));
  // Flush: the 13 held pages go back (no more dirty pages to top up with).
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 14u);
  EXPECT_EQ(f.Backing(32 * kPage, 8 * kPage), Bytes(8 * kPage, 5));
  EXPECT_EQ(f.Backing(100 * kPage, 5 * kPage), Bytes(5 * kPage, 7));
  EXPECT_EQ(f.cache->stats().dirty, 0u);
}

// The page store's setting (PageStore::TuneWriteCache: no groups, 16 pages): every whole-page
// write of fewer than 16 pages is held, and they go back together in one write-back batch; 16
// pages and more pass straight through.
TEST(WriteCache, WithoutGroupsSmallWholePageWritesAreHeldAndGoBackInOneBatch) {
  Fixture f(/*pages=*/64, /*batch=*/64, 1u << 20, /*multiple=*/1, /*absorb=*/16);
  ASSERT_TRUE(f.cache->Write(0, Bytes(kPage, 1), false).ok());
  ASSERT_TRUE(f.cache->Write(8 * kPage, Bytes(4 * kPage, 2), false).ok());
  ASSERT_TRUE(f.cache->Write(20 * kPage, Bytes(15 * kPage, 3), false).ok());
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty()) << "writes under 16 pages are held";
  EXPECT_EQ(f.cache->stats().dirty, 20u);
  std::vector<uint8_t> got(4 * kPage);
  ASSERT_TRUE(f.cache->Read(8 * kPage, got).ok());
  EXPECT_EQ(got, Bytes(4 * kPage, 2));
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kRead).empty()) << "held pages are read from the cache";
  ASSERT_TRUE(f.cache->Write(40 * kPage, Bytes(16 * kPage, 4), false).ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 1u) << "16 pages pass straight through";
  f.backend->clear();
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 20u);
  EXPECT_EQ(f.Backing(0, kPage), Bytes(kPage, 1));
  EXPECT_EQ(f.Backing(8 * kPage, 4 * kPage), Bytes(4 * kPage, 2));
  EXPECT_EQ(f.Backing(20 * kPage, 15 * kPage), Bytes(15 * kPage, 3));
  EXPECT_EQ(f.cache->stats().dirty, 0u);
  // A FUA write of one page: held, and back before it returns.
  f.backend->clear();
  ASSERT_TRUE(f.cache->Write(60 * kPage, Bytes(kPage, 5), /*fua=*/true).ok());
  EXPECT_EQ(f.Ops(BlockOp::Kind::kWrite).size(), 1u);
  EXPECT_EQ(f.Backing(60 * kPage, kPage), Bytes(kPage, 5));
  EXPECT_EQ(f.cache->stats().dirty, 0u);
}

// A request the cache serves whole is answered when its batch has been planned, not after the
// backend ops of the other requests of the batch (a write passing straight through): the NBD
// connection sends its reply while those are in flight. A held FUA write still waits for its
// write-back, and the write passing through for the backend.
TEST(WriteCache, RequestsServedFromTheCacheAreAnsweredBeforeTheBackendOpsOfTheirBatch) {
  Fixture f(/*pages=*/64, /*batch=*/64, 1u << 20, /*multiple=*/1, /*absorb=*/16);
  struct Listener : BatchListener {
    RecordingBackend* backend = nullptr;
    std::vector<std::pair<size_t, size_t>> done;  // (op, backend ops recorded by then)
    size_t progress = 0;
    void OpDone(size_t i) override { done.emplace_back(i, backend->ops().size()); }
    void Progress() override { ++progress; }
  } l;
  l.backend = f.backend;
  std::vector<uint8_t> small = Bytes(1024, 1), large = Bytes(16 * kPage, 2), fua = Bytes(kPage, 3);
  std::vector<uint8_t> got(1024);
  std::vector<BlockOp> ops(4);
  ops[0].kind = BlockOp::Kind::kWrite;  // held: part of page 0
  ops[0].offset = 512;
  ops[0].data = small;
  ops[1].kind = BlockOp::Kind::kWrite;  // 16 pages: straight through
  ops[1].offset = 16 * kPage;
  ops[1].data = large;
  ops[2].kind = BlockOp::Kind::kRead;  // what op 0 wrote, from the cache
  ops[2].offset = 512;
  ops[2].read_into = got;
  ops[3].kind = BlockOp::Kind::kWrite;  // held, FUA: goes back before its reply
  ops[3].offset = 40 * kPage;
  ops[3].data = fua;
  ops[3].fua = true;
  for (BlockOp& op : ops)
    op.length = op.kind == BlockOp::Kind::kRead ? op.read_into.size() : op.data.size();
  f.cache->ExecuteBatch(ops, &l);
  for (const BlockOp& op : ops) ASSERT_TRUE(op.status.ok()) << op.status.ToString();
  EXPECT_EQ(got, small);
  ASSERT_EQ(l.done.size(), 4u);
  EXPECT_EQ(l.done[0], std::make_pair(size_t{0}, size_t{0})) << "before any backend op";
  EXPECT_EQ(l.done[1], std::make_pair(size_t{2}, size_t{0})) << "before any backend op";
  EXPECT_GE(l.progress, 1u) << "the early replies are offered to the client";
  EXPECT_EQ(l.done[2].first, 1u);
  EXPECT_EQ(l.done[2].second, 1u) << "after its write";
  EXPECT_EQ(l.done[3].first, 3u);
  EXPECT_EQ(l.done[3].second, 2u) << "after its write-back";
  EXPECT_EQ(f.Backing(40 * kPage, kPage), fua);
  EXPECT_EQ(f.cache->stats().dirty, 1u) << "page 0 is still held";
}

TEST(WriteCache, FailedWriteBackIsKeptAndFailsTheNextFlush) {
  Fixture f;
  ASSERT_TRUE(f.cache->Write(kPage, Bytes(1024, 5), false).ok());
  f.backend->set_fail(true);
  f.now += std::chrono::milliseconds(100);
  EXPECT_FALSE(f.cache->WriteBackExpired().ok());  // the flusher's write-back fails
  f.backend->set_fail(false);
  // The data is still there for readers, and the next flush reports the failure although its
  // own retry of the page succeeds (reported once, like fsync).
  std::vector<uint8_t> got(1024);
  ASSERT_TRUE(f.cache->Read(kPage, got).ok());
  EXPECT_EQ(got, Bytes(1024, 5));
  const Status first = f.cache->Flush();
  EXPECT_FALSE(first.ok());
  EXPECT_NE(first.message().find("write-back"), std::string::npos) << first.ToString();
  EXPECT_EQ(f.Backing(kPage, 1024), Bytes(1024, 5)) << "the failed page was retried, not dropped";
  EXPECT_TRUE(f.cache->Flush().ok());

  // A flush whose own write-backs fail fails, and so does the next until they succeed.
  ASSERT_TRUE(f.cache->Write(2 * kPage, Bytes(512, 6), false).ok());
  f.backend->set_fail(true);
  EXPECT_FALSE(f.cache->Flush().ok());
  EXPECT_FALSE(f.cache->Flush().ok());
  f.backend->set_fail(false);
  EXPECT_TRUE(f.cache->Flush().ok());
  EXPECT_EQ(f.Backing(2 * kPage, 512), Bytes(512, 6));
  EXPECT_GE(f.cache->stats().writeback_failures, 3u);
}

TEST(WriteCache, FuaWriteFailsWhenItsPageCannotGoBack) {
  Fixture f;
  ASSERT_TRUE(f.cache->Write(0, Bytes(512, 1), false).ok());  // page 0 cached (filled)
  f.backend->set_fail(true);
  EXPECT_FALSE(f.cache->Write(512, Bytes(512, 2), /*fua=*/true).ok());
  f.backend->set_fail(false);
  EXPECT_FALSE(f.cache->Flush().ok()) << "the failed write-back is reported once more";
  EXPECT_TRUE(f.cache->Flush().ok());
  EXPECT_EQ(f.Backing(512, 512), Bytes(512, 2));
  std::vector<uint8_t> got(1024);
  ASSERT_TRUE(f.cache->Read(0, got).ok());
  EXPECT_EQ(got[0], 1);
  EXPECT_EQ(got[512], 2);
}

TEST(WriteCache, WhenEveryPageFailedToGoBackWritesThatNeedAPageFail) {
  Fixture f(/*pages=*/8);
  for (uint64_t p = 0; p < 8; ++p)
    ASSERT_TRUE(f.cache->Write(p * kPage, Bytes(512, 1), false).ok());
  f.backend->set_fail(true);
  EXPECT_FALSE(f.cache->Flush().ok());
  const Status st = f.cache->Write(8 * kPage, Bytes(512, 2), false);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("write-back failed"), std::string::npos) << st.ToString();
  f.backend->set_fail(false);
  EXPECT_TRUE(f.cache->Flush().ok());
  EXPECT_TRUE(f.cache->Write(8 * kPage, Bytes(512, 2), false).ok());
}

TEST(WriteCache, WriteZeroesAndTrimDropOrPatchCachedPages) {
  Fixture f;
  ASSERT_TRUE(f.cache->Write(0, Bytes(2 * kPage, 3), false).ok());  // whole pages: backend
  ASSERT_TRUE(f.cache->Write(512, Bytes(512, 4), false).ok());      // page 0 cached
  ASSERT_TRUE(f.cache->Write(kPage + 512, Bytes(512, 4), false).ok());
  ASSERT_TRUE(f.cache->WriteZeroes(1024, 2 * kPage - 1024, false, false).ok());
  std::vector<uint8_t> got(2 * kPage);
  ASSERT_TRUE(f.cache->Read(0, got).ok());
  std::vector<uint8_t> want(2 * kPage, 0);
  std::fill_n(want.begin(), 512, 3);
  std::fill_n(want.begin() + 512, 512, 4);
  EXPECT_EQ(got, want);
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_EQ(f.Backing(0, 2 * kPage), want);
  // A trim of a cached page drops it: nothing of it is written back later.
  ASSERT_TRUE(f.cache->Write(4 * kPage, Bytes(512, 8), false).ok());
  ASSERT_TRUE(f.cache->Trim(4 * kPage, kPage, false).ok());
  f.backend->clear();
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_TRUE(f.Ops(BlockOp::Kind::kWrite).empty());
}

// Random mixed-size reads, writes and zeroes in batches of non-overlapping ops, against a
// reference buffer; a cache much smaller than the range, so pages are evicted all the time.
TEST(WriteCache, RandomMixedSizesMatchAReferenceBuffer) {
  constexpr uint64_t kRange = 64 * kPage;
  Fixture f(/*pages=*/8, /*batch=*/3);
  std::vector<uint8_t> ref(kRange, 0);
  std::mt19937_64 rng(42);
  const uint64_t sizes[] = {512, 1024, 1536, 4096, 8192, 3072};
  std::vector<std::vector<uint8_t>> bufs(16);
  for (int round = 0; round < 400; ++round) {
    std::vector<BlockOp> ops;
    std::vector<std::pair<uint64_t, uint64_t>> taken;
    const size_t n = 1 + rng() % 12;
    for (size_t k = 0; k < n; ++k) {
      const uint64_t len = sizes[rng() % std::size(sizes)];
      const uint64_t off = (rng() % ((kRange - len) / 512 + 1)) * 512;
      bool overlaps = false;
      for (auto [a, b] : taken) overlaps = overlaps || (off < b && a < off + len);
      if (overlaps) continue;
      taken.push_back({off, off + len});
      BlockOp op;
      op.offset = off;
      op.length = len;
      op.fua = rng() % 16 == 0;
      std::vector<uint8_t>& buf = bufs[ops.size()];
      buf.resize(len);
      const int kind = static_cast<int>(rng() % 10);
      if (kind < 6) {
        op.kind = BlockOp::Kind::kWrite;
        for (auto& b : buf) b = static_cast<uint8_t>(rng());
        op.data = buf;
      } else if (kind < 9) {
        op.kind = BlockOp::Kind::kRead;
        op.read_into = buf;
      } else {
        op.kind = BlockOp::Kind::kWriteZeroes;
      }
      ops.push_back(op);
    }
    f.cache->ExecuteBatch(ops);
    for (BlockOp& op : ops) {
      ASSERT_TRUE(op.status.ok()) << op.status.ToString();
      if (op.kind == BlockOp::Kind::kWrite) {
        std::copy(op.data.begin(), op.data.end(), ref.begin() + op.offset);
      } else if (op.kind == BlockOp::Kind::kWriteZeroes) {
        std::fill_n(ref.begin() + op.offset, op.length, 0);
      } else {
        ASSERT_TRUE(std::equal(op.read_into.begin(), op.read_into.end(), ref.begin() + op.offset))
            << "round " << round << ": read of " << op.length << " at " << op.offset;
      }
    }
    if (round % 50 == 0) {
      f.now += std::chrono::milliseconds(100);
      ASSERT_TRUE(f.cache->WriteBackExpired().ok());
    }
  }
  std::vector<uint8_t> all(kRange);
  ASSERT_TRUE(f.cache->Read(0, all).ok());
  EXPECT_TRUE(all == ref);
  ASSERT_TRUE(f.cache->Flush().ok());
  EXPECT_TRUE(f.Backing(0, kRange) == ref);
  const WriteCacheStats s = f.cache->stats();
  EXPECT_GT(s.fills, 0u);
  EXPECT_GT(s.writebacks, 0u);
}

// Several threads, disjoint regions, small writes each read back at once; then everything.
TEST(WriteCache, ThreadsWritingSmallPiecesReadTheirOwnWrites) {
  constexpr int kThreads = 4;
  constexpr uint64_t kRegion = 32 * kPage;
  Fixture f(/*pages=*/16, /*batch=*/4, kThreads * kRegion);
  std::vector<std::vector<uint8_t>> ref(kThreads, std::vector<uint8_t>(kRegion, 0));
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 300; ++i) {
        const uint64_t len = 512u << (rng() % 3);
        const uint64_t off = (rng() % ((kRegion - len) / 512 + 1)) * 512;
        std::vector<uint8_t> data(len, static_cast<uint8_t>(rng()));
        if (!f.cache->Write(t * kRegion + off, data, false).ok()) ++bad;
        std::copy(data.begin(), data.end(), ref[t].begin() + off);
        std::vector<uint8_t> back(len);
        if (!f.cache->Read(t * kRegion + off, back).ok() || back != data) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  ASSERT_TRUE(f.cache->Flush().ok());
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(f.Backing(t * kRegion, kRegion) == ref[t]);
}

TEST(WriteCache, RefusesBadOptions) {
  auto mem = MemoryBackend::Create(1u << 20);
  ASSERT_TRUE(mem.has_value());
  WriteCacheOptions o;
  o.pages = 4;
  EXPECT_FALSE(WriteCache::Create(std::move(*mem), o).has_value());
  auto odd = MemoryBackend::Create((1u << 20) + 512);
  ASSERT_TRUE(odd.has_value());
  EXPECT_FALSE(WriteCache::Create(std::move(*odd), WriteCacheOptions{}).has_value());
}

}  // namespace
}  // namespace farmem::blockdev
