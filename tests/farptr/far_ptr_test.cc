// far_ptr / DerefScope / Runtime against real farmemd daemons: objects go out as span sets and
// come back right, in every resilience mode; scopes pin; a dead daemon is survived (ec,
// replicate) or named (none).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/internal/budget_gate.h"
#include "farmem/internal/object.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

TEST(FarPtrLayout, PointerIsEightBytes) {
  static_assert(sizeof(far_ptr<Point>) == 8);
  static_assert(sizeof(far_bytes) == 8);
  EXPECT_EQ(sizeof(far_ptr<std::array<char, 3000>>), 8u);
}

TEST(SpanResilienceTest, Parses) {
  EXPECT_EQ(SpanResilience::Parse("ec:4+2")->ToString(), "ec:4+2");
  EXPECT_EQ(SpanResilience::Parse("replicate:3")->width(), 3);
  EXPECT_EQ(SpanResilience::Parse("none")->width(), 1);
  EXPECT_FALSE(SpanResilience::Parse("ec:4").has_value());
  EXPECT_FALSE(SpanResilience::Parse("ec:10+10").has_value());
  EXPECT_FALSE(SpanResilience::Parse("mirror").has_value());
}

class FarPtrTest : public FarptrTest, public ::testing::WithParamInterface<std::string> {};

// Allocate 8x the budget in objects of many sizes (16 B .. 3 spans' worth capped at a span),
// read every one back, mutate, read again.
TEST_P(FarPtrTest, ObjectsOfManySizesSurviveEviction) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  ASSERT_NO_FATAL_FAILURE(Open(Options(GetParam(), 1 << 20)));
  std::mt19937_64 rng(7);
  std::vector<far_bytes> objs;
  std::vector<uint64_t> version;
  uint64_t total = 0;
  while (total < (8u << 20)) {
    size_t size = 1 + rng() % 200;
    if (rng() % 8 == 0) size = 1 + rng() % 16384;  // up to one span, many larger than a page
    far_bytes b = make_far_bytes_in(*rt_, size);
    {
      DerefScope s;
      Fill(b.deref_mut(s), objs.size(), 0);
    }
    total += size;
    objs.push_back(std::move(b));
    version.push_back(0);
  }
  RuntimeStats st = rt_->stats();
  EXPECT_GT(st.spans_evicted, 0u);
  EXPECT_LE(st.local_bytes, st.local_budget + (256u << 10));
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < objs.size(); ++i) {
      DerefScope s;
      ASSERT_TRUE(Matches(objs[i].deref(s), i, version[i])) << "object " << i << " pass " << pass;
      if (i % 3 == 0) Fill(objs[i].deref_mut(s), i, ++version[i]);
    }
  }
  st = rt_->stats();
  EXPECT_GT(st.swap_ins, 0u);
  EXPECT_EQ(st.objects, objs.size());
  objs.clear();
  EXPECT_EQ(rt_->stats().objects, 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, FarPtrTest,
                         ::testing::Values("ec:4+2", "replicate:2", "none", "ec:2+1"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return n;
                         });

TEST_F(FarptrTest, MakeFarConstructsAndDerefIsLocalAfterwards) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", 1 << 20)));
  far_ptr<Point> p = make_far<Point>(Point{1, 2, 3.5, 4.5});
  EXPECT_TRUE(p.is_local());
  {
    DerefScope s;
    EXPECT_EQ(p.deref(s).x, 3.5);
    p.deref_mut(s).y = 9;
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  EXPECT_FALSE(p.is_local());
  EXPECT_EQ(p.read().y, 9);
  EXPECT_TRUE(p.is_local());
  far_ptr<Point> q = std::move(p);
  EXPECT_FALSE(p);
  EXPECT_EQ(q.read().id, 1u);
}

// The budget gate checks its own reason to hold a thread. A GetFrame crossing the budget sets
// the runtime's over-budget flag; a PutFrame going back under it at the same moment can find the
// flag still clear, and then the flag stays set with the frames within the budget: the evictor
// has nothing to do, no PutFrame comes to clear it, and every outermost scope entry waited out
// the gate's full second (far_list_queue_test then ran at a second per element until ctest killed
// it: seen twice in CI, under ASan and TSan). Played here by setting the flag directly: the next
// outermost scope entry must clear it.
TEST_F(FarptrTest, AStaleOverBudgetFlagIsClearedAtTheGate) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 1 << 20)));
  far_ptr<Point> p = make_far<Point>(Point{1, 2, 3.5, 4.5});
  ASSERT_TRUE(p.is_local());
  farptr_internal::SetOverBudgetForTest(p.entry());
  ASSERT_TRUE(farptr_internal::OverBudgetForTest(p.entry()));
  {
    DerefScope s;  // this thread holds no scope: an outermost entry, through the gate
    EXPECT_EQ(p.deref(s).id, 1u);
  }
  EXPECT_FALSE(farptr_internal::OverBudgetForTest(p.entry()))
      << "the flag outlived the gate: every scope entry would wait a second";
  EXPECT_EQ(p.read().x, 3.5);
}

// A span that keeps one hot object among cold ones gives it up to the class's hot span; when the
// second sweep takes the span as a victim after all, the relocation is called off and the new hot
// span stays empty. It must not keep its frame: EvictUntil(0) must still empty local memory.
// Which of the two spans the second sweep takes first depends on the clock hand, so the scene is
// played several times (before the fix, about every second round failed).
TEST_F(FarptrTest, AnEmptyHotSpanLeftByACalledOffRelocationIsGivenBack) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  RuntimeOptions o = Options("none", 1 << 20);
  o.auto_compact = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  constexpr size_t kSize = 1024;  // 16 objects fill a 16 KiB span
  std::vector<far_bytes> objs;
  for (size_t i = 0; i < 32; ++i) {
    objs.push_back(make_far_bytes_in(*rt_, kSize));
    DerefScope s;
    std::memset(objs.back().deref_mut(s).data(), static_cast<int>(i + 1), kSize);
  }
  for (int round = 0; round < 8; ++round) {
    Status st = rt_->EvictUntil(0);
    ASSERT_TRUE(st.ok()) << "round " << round << ": " << st.ToString();
    {
      DerefScope s;
      (void)objs[0].deref(s);  // span A comes back with one hot object of 16
      for (size_t i = 16; i < 32; ++i) (void)objs[i].deref(s);  // span B, all hot
    }
    // One frame may stay: the sweep relocates A's hot object and then takes one span.
    st = rt_->EvictUntil(kSize * 16);
    ASSERT_TRUE(st.ok()) << "round " << round << ": " << st.ToString();
  }
  const Status st = rt_->EvictUntil(0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(rt_->stats().local_bytes, 0u);
  for (size_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    const std::span<const std::byte> b = objs[i].deref(s);
    ASSERT_EQ(b.size(), kSize);
    for (std::byte c : b) ASSERT_EQ(c, static_cast<std::byte>(i + 1)) << "object " << i;
  }
}

// Object i's bytes in MakeFilledBytes.
std::byte ByteOf(size_t i) { return static_cast<std::byte>(i % 251 + 1); }

// n objects of `size` bytes, object i filled with ByteOf(i).
std::vector<far_bytes> MakeFilledBytes(Runtime& rt, size_t n, size_t size) {
  std::vector<far_bytes> objs;
  for (size_t i = 0; i < n; ++i) {
    objs.push_back(make_far_bytes_in(rt, size));
    DerefScope s;
    std::memset(objs.back().deref_mut(s).data(), static_cast<int>(ByteOf(i)), size);
  }
  return objs;
}

// Issue 13 ("hot objects stay local"): a miss on a small object brings that object, not its span.
// It joins its class's hot span and the span it was read from stays remote, so 64 objects read
// from 64 different spans take one frame (two while a hot span fills), not 64. Without gathering
// every miss kept its whole span local: local_bytes was 64 frames.
TEST_F(FarptrTest, MissesGatherObjectsOfManySpansIntoOneHotSpan) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  RuntimeOptions o = Options("none", 4 << 20);
  o.auto_compact = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  // 240 B: with the GCM tag after it (encryption is on) a slot of 256 B, 64 objects a span.
  constexpr size_t kSize = 240;
  constexpr size_t kPerSpan = 16384 / 256, kSpans = 64;
  std::vector<far_bytes> objs = MakeFilledBytes(*rt_, kSpans * kPerSpan, kSize);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const RuntimeStats before = rt_->stats();
  ASSERT_EQ(before.local_bytes, 0u);
  auto hot = [&](size_t span) { return span * kPerSpan + 7; };  // one object of each span
  for (size_t span = 0; span < kSpans; ++span) {
    DerefScope s;
    ASSERT_EQ(objs[hot(span)].deref(s)[0], ByteOf(hot(span)));
  }
  const RuntimeStats after = rt_->stats();
  EXPECT_EQ(after.swap_ins - before.swap_ins, kSpans);
  EXPECT_EQ(after.objects_gathered - before.objects_gathered, kSpans);
  EXPECT_LE(after.local_bytes, 2u * 16384) << "the spans read stayed local";
  for (size_t span = 0; span < kSpans; ++span) {
    EXPECT_TRUE(objs[hot(span)].is_local()) << "object " << hot(span);
    EXPECT_FALSE(objs[hot(span) + 1].is_local()) << "object " << hot(span) + 1;
  }
  // The gathered objects (now in a span that has no remote copy) and the rest of their old spans
  // (cells with a hole where the gathered object was) all survive another eviction.
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  for (size_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    const std::span<const std::byte> b = objs[i].deref(s);
    ASSERT_EQ(b[0], ByteOf(i)) << "object " << i;
    ASSERT_EQ(b[kSize - 1], ByteOf(i)) << "object " << i;
  }
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// The prefetcher reads ahead above the high watermark, up to halfway to the budget: the evictor,
// woken above the high watermark, makes room behind it. Regression: it read ahead only below the
// high watermark, so with the evictor keeping local memory near it (a narrow band) a scan's
// prefetches found no room (far_vector: 758-849 of 1,024 swap-ins prefetched at 25% local, and
// 57 with the band at 0.85-0.90).
TEST_F(FarptrTest, PrefetchReadsAheadAboveTheHighWatermark) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  constexpr size_t kSpan = 16384, kBudgetFrames = 100, kHighFrames = 90;
  RuntimeOptions o = Options("none", kBudgetFrames * kSpan, kSpan);
  o.high_watermark = 0.90;  // 90 frames; the prefetcher's ceiling halfway to 100
  o.low_watermark = 0.80;
  o.gather_on_miss = false;  // a miss brings its whole span: one frame each
  o.auto_compact = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  // 240 B: with the GCM tag after it (encryption is on) a slot of 256 B, 64 objects a span.
  constexpr size_t kSize = 240, kPerSpan = kSpan / 256, kSpans = 2 * kBudgetFrames;
  std::vector<far_bytes> objs = MakeFilledBytes(*rt_, kSpans * kPerSpan, kSize);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_EQ(rt_->stats().local_bytes, 0u);
  // Exactly at the high watermark, where the evictor does not start: one span in per miss.
  for (size_t span = 0; span < kHighFrames; ++span) {
    DerefScope s;
    ASSERT_EQ(objs[span * kPerSpan].deref(s)[0], ByteOf(span * kPerSpan));
  }
  ASSERT_EQ(rt_->stats().local_bytes, kHighFrames * kSpan);
  const size_t hinted = (kSpans - 1) * kPerSpan;
  ASSERT_FALSE(objs[hinted].is_local());
  const uint64_t prefetched_before = rt_->stats().prefetches;
  objs[hinted].prefetch();
  EXPECT_TRUE(farmem::testing::WaitUntil(
      [&] { return rt_->stats().prefetches > prefetched_before; }, std::chrono::seconds(10)))
      << "a hint at the high watermark was not read ahead";
  DerefScope s;
  EXPECT_EQ(objs[hinted].deref(s)[0], ByteOf(hinted));
}

// A high watermark set alone below the default low one (0.88) is refused, saying which to set.
TEST_F(FarptrTest, WatermarksOutOfOrderAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  RuntimeOptions o = Options("none", 1 << 20);
  o.high_watermark = 0.85;
  auto rt = Runtime::Create(o);
  ASSERT_FALSE(rt.has_value());
  EXPECT_EQ(rt.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rt.error().message().find("low_watermark"), std::string::npos) << rt.error().ToString();
}

// A span missed again right after a gathering miss shows locality (a scan, objects used
// together): the second miss brings it whole, and its other objects are local from then on.
TEST_F(FarptrTest, ASpanMissedTwiceInARowComesInWhole) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  RuntimeOptions o = Options("none", 4 << 20);
  o.auto_compact = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  // 240 B: with the GCM tag after it (encryption is on) a slot of 256 B, 64 objects a span.
  constexpr size_t kSize = 240, kPerSpan = 16384 / 256;
  std::vector<far_bytes> objs;
  for (size_t i = 0; i < kPerSpan; ++i) {
    objs.push_back(make_far_bytes_in(*rt_, kSize));
    DerefScope s;
    std::memset(objs.back().deref_mut(s).data(), static_cast<int>(i + 1), kSize);
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const RuntimeStats before = rt_->stats();
  for (size_t i = 0; i < kPerSpan; ++i) {
    DerefScope s;
    ASSERT_EQ(objs[i].deref(s)[0], static_cast<std::byte>(i + 1)) << "object " << i;
  }
  const RuntimeStats after = rt_->stats();
  EXPECT_EQ(after.swap_ins - before.swap_ins, 2u) << "one gathering miss, then the whole span";
  EXPECT_EQ(after.objects_gathered - before.objects_gathered, 1u);
}

// A batched fetch (FetchObjects, what far_hash_map::get_many reads with) may be handed the entry
// of an object freed since its caller looked it up: get_many holds no lock across its reads. The
// entry still points at its old span, a remote one here that keeps other objects; fetching it
// must not gather it (that freed its slot again and counted the span's last object gone: the
// span was retired with its other objects, whose derefs then failed as a use after free).
TEST_F(FarptrTest, FetchingAFreedObjectLeavesItsSpanAlone) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(1));
  RuntimeOptions o = Options("none", 4 << 20);
  o.auto_compact = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  constexpr size_t kSize = 256;
  std::vector<far_bytes> objs;
  for (size_t i = 0; i < 2; ++i) {  // two objects of one span
    objs.push_back(make_far_bytes_in(*rt_, kSize));
    DerefScope s;
    std::memset(objs.back().deref_mut(s).data(), static_cast<int>(i + 1), kSize);
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  farptr_internal::ObjectEntry* stale = objs[0].entry();
  objs[0].reset();  // freed; its span stays remote with objs[1]
  {
    DerefScope s;
    farptr_internal::FetchObjects(rt_.get(), {&stale, 1});
  }
  EXPECT_EQ(rt_->stats().objects_gathered, 0u) << "the freed object was gathered";
  DerefScope s;
  auto b = objs[1].try_deref(s);
  ASSERT_TRUE(b.has_value()) << b.error().ToString();
  EXPECT_EQ((*b)[0], std::byte{2});
  EXPECT_EQ((*b)[kSize - 1], std::byte{2});
}

// A pointer obtained inside a scope stays valid (same address, same bytes) while another thread
// allocates far past the budget and the evictor runs; the pinned objects are never evicted.
TEST_F(FarptrTest, ScopePinsAgainstTheEvictor) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", 1 << 20)));
  std::vector<far_ptr<Point>> pinned;
  for (uint64_t i = 0; i < 200; ++i) pinned.push_back(make_far<Point>(Point{i, 0, 1.0 * i, 0}));
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  std::atomic<bool> stop{false};
  std::thread pressure([&] {
    std::vector<far_bytes> junk;
    uint64_t n = 0;
    while (!stop.load()) {
      junk.push_back(make_far_bytes_in(*rt_, 1000));
      if (++n % 64 == 0) std::this_thread::yield();
      if (junk.size() > 20000) junk.erase(junk.begin(), junk.begin() + 10000);
    }
  });
  const uint64_t evicted_before = rt_->stats().spans_evicted;
  {
    DerefScope s;
    std::vector<const Point*> addrs;
    for (auto& p : pinned) addrs.push_back(&p.deref(s));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (std::chrono::steady_clock::now() < deadline) {
      for (size_t i = 0; i < pinned.size(); ++i) {
        ASSERT_EQ(addrs[i]->id, i);
        ASSERT_EQ(addrs[i]->x, 1.0 * i);
        ASSERT_TRUE(pinned[i].is_local());
        ASSERT_EQ(&pinned[i].deref(s), addrs[i]) << "object " << i << " moved inside a scope";
      }
    }
  }
  stop = true;
  pressure.join();
  // The evictor waited for the scope above; once it ended, eviction goes on.
  farmem::testing::WaitUntil([&] { return rt_->stats().spans_evicted > evicted_before; },
                             std::chrono::seconds(10));
  EXPECT_GT(rt_->stats().spans_evicted, evicted_before) << "the evictor never ran";
}

// The index of a daemon on which the runtime holds leases (size() if none).
size_t DaemonHoldingLeases(testing::DaemonSet& daemons, Runtime& rt) {
  size_t victim = daemons.size();
  for (const client::NodeInfo& n : rt.cluster().nodes()) {
    if (n.leases_held == 0) continue;
    for (size_t d = 0; d < daemons.size(); ++d) {
      if (daemons[d].endpoint() == n.endpoint) victim = d;
    }
  }
  return victim;
}

// ec:4+2 over 8 daemons: kill two real daemons; every object still reads back right and the lost
// members are re-protected on the two spare daemons; then kill two more: still nothing lost.
TEST_F(FarptrTest, EcSurvivesTwoKilledDaemonsTwice) {
  // Kills the daemons holding members a and b of the first slab group (as it is now).
  auto KillMembers = [&](size_t a, size_t b) {
    const auto layout = rt_->span_set_layout();
    ASSERT_FALSE(layout.empty());
    for (size_t m : {a, b}) {
      for (size_t d = 0; d < daemons_->size(); ++d) {
        if ((*daemons_)[d].endpoint() == layout[0][m]) (*daemons_)[d].Kill();
      }
    }
  };
  ASSERT_NO_FATAL_FAILURE(StartDaemons(8));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", 1 << 20)));
  std::vector<far_ptr<Point>> objs = MakePoints(40000);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  KillMembers(0, 1);
  // Let the failures be noticed and re-protected while the data is still remote (reading it
  // back first would swap every span in and leave nothing to rebuild).
  farmem::testing::WaitUntil([&] { return rt_->stats().members_reprotected >= 2; },
                             std::chrono::seconds(60));
  ASSERT_GE(rt_->stats().members_reprotected, 2u) << "the two lost members were not rebuilt";
  ASSERT_TRUE(rt_->WaitForRecovery().ok());
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "after the first two kills"));
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  KillMembers(2, 3);
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "after the second two kills"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// ec:4+2 over exactly 6 daemons: after two die there is nowhere to re-protect, so every span
// whose daemon died is read degraded (k survivors, decode) — and right.
TEST_F(FarptrTest, EcReadsDegradedWithoutSpareDaemons) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:4+2", 1 << 20)));
  std::vector<far_ptr<Point>> objs = MakePoints(40000);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  // Kill the daemons of two data members (a parity member's death needs no decoding).
  const auto layout = rt_->span_set_layout();
  ASSERT_FALSE(layout.empty());
  for (int m = 0; m < 2; ++m) {
    for (size_t d = 0; d < daemons_->size(); ++d) {
      if ((*daemons_)[d].endpoint() == layout[0][static_cast<size_t>(m)]) (*daemons_)[d].Kill();
    }
  }
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "after two kills"));
  RuntimeStats st = rt_->stats();
  EXPECT_GT(st.degraded_reads, 0u);
  EXPECT_EQ(st.spans_lost, 0u);
}

// A span swapped in keeps its remote cell while clean: evicting it again writes nothing. The
// first write to it (deref_mut, a new object placed in it) turns the cell into a hole, and the
// next eviction writes the new bytes.
TEST_F(FarptrTest, CleanSpansLeaveWithoutWritingAndWrittenOnesAreWrittenAgain) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(6));
  RuntimeOptions o = Options("ec:4+2", 1 << 20);
  // The subject is the clean copy of a span swapped in. With gathering, the first object a miss
  // reads of each span joins a hot span (the second miss brings the span whole), and that hot
  // span has no copy: it is written when it leaves (MissesGatherObjectsOfManySpansIntoOneHotSpan).
  o.gather_on_miss = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  std::vector<far_ptr<Point>> objs = MakePoints(20000);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  // Read everything back (swap-ins), then evict again: no byte may be written.
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "first read"));
  const RuntimeStats read_back = rt_->stats();
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const RuntimeStats clean = rt_->stats();
  EXPECT_GT(clean.clean_evictions, read_back.clean_evictions);
  EXPECT_EQ(clean.bytes_written, read_back.bytes_written) << "clean spans were written again";
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "after a clean eviction"));
  // Write every third object, free and re-make every fifth (a new object lands in a swapped-in
  // span with a clean copy), evict: the writes must go out, and come back.
  const RuntimeStats before_writes = rt_->stats();
  for (uint64_t i = 0; i < objs.size(); i += 3) {
    DerefScope s;
    objs[i].deref_mut(s).version = i % 7;  // same value: the bytes are rewritten all the same
    objs[i].deref_mut(s).x = static_cast<double>(i);
  }
  for (uint64_t i = 0; i < objs.size(); i += 5) objs[i] = make_far<Point>(Point{i, i % 7, 1, 1});
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const RuntimeStats after_writes = rt_->stats();
  EXPECT_GT(after_writes.copies_dropped, before_writes.copies_dropped);
  EXPECT_GT(after_writes.bytes_written, before_writes.bytes_written);
  for (uint64_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    auto p = objs[i].try_deref(s);
    ASSERT_TRUE(p.has_value()) << "object " << i << ": " << p.error().ToString();
    ASSERT_EQ((*p)->id, i);
    ASSERT_EQ((*p)->version, i % 7);
    if (i % 5 == 0) {
      ASSERT_EQ((*p)->x, 1.0) << "object " << i;
    } else if (i % 3 == 0) {
      ASSERT_EQ((*p)->x, static_cast<double>(i)) << "object " << i;
    } else {
      ASSERT_EQ((*p)->x, 0.0) << "object " << i;
    }
  }
  // Remote usage still tracks live data once the written spans' old cells are compacted away.
  ASSERT_TRUE(rt_->Compact().ok());
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// none: objects that were local (clean, with their copy on a daemon) when that daemon died are
// not lost: their spans are written anew instead of being evicted onto the dead copy.
TEST_F(FarptrTest, NoneKeepsLocalObjectsWhoseCopyDied) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("none", 1 << 20)));
  std::vector<far_ptr<Point>> objs = MakePoints(8000);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "read back"));  // all local again, clean
  const size_t victim = DaemonHoldingLeases(*daemons_, *rt_);
  ASSERT_LT(victim, daemons_->size());
  (*daemons_)[victim].Kill();
  std::optional<client::NodeId> node;
  for (const client::NodeInfo& n : rt_->cluster().nodes()) {
    if (n.endpoint == (*daemons_)[victim].endpoint()) node = n.id;
  }
  ASSERT_TRUE(node.has_value());
  // Down, and the store has been handed the kNodeDown event.
  Status noticed =
      rt_->cluster().WaitForNode(*node, client::NodeState::kDown, std::chrono::seconds(20));
  ASSERT_TRUE(noticed.ok()) << "the killed daemon was not noticed: " << noticed.ToString();
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectAllRight(objs, "after the daemon holding the copies died"));
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

// none: a killed daemon loses what lived there, and the error says what and where.
TEST_F(FarptrTest, NoneNamesWhatWasLost) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3));
  ASSERT_NO_FATAL_FAILURE(Open(Options("none", 1 << 20)));
  std::vector<far_ptr<Point>> objs;
  for (uint64_t i = 0; i < 40000; ++i) objs.push_back(make_far<Point>(Point{i, 1, 0, 0}));
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  // Kill a daemon that holds some of the data.
  const size_t victim = DaemonHoldingLeases(*daemons_, *rt_);
  ASSERT_LT(victim, daemons_->size());
  (*daemons_)[victim].Kill();
  size_t lost = 0;
  std::string message;
  for (uint64_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    auto p = objs[i].try_deref(s);
    if (!p) {
      ++lost;
      EXPECT_EQ(p.error().code(), StatusCode::kDataLoss);
      message = p.error().message();
    } else {
      ASSERT_EQ((*p)->id, i);
    }
  }
  EXPECT_GT(lost, 0u);
  EXPECT_NE(message.find((*daemons_)[victim].endpoint().ToString()), std::string::npos) << message;
  EXPECT_NE(message.find("none"), std::string::npos) << message;
  EXPECT_NE(message.find("size class"), std::string::npos) << message;
  EXPECT_GT(rt_->stats().spans_lost, 0u);
}

}  // namespace
}  // namespace farmem::farptr_test
