// far_ptr encryption (issue 16, item 2): what the lenders hold is ciphertext, corruption there is
// detected and served around, and no nonce is ever sealed under twice.
//
// 1. LenderMemoryHoldsNoPlaintext: objects with a recognisable text (64 B and 4 KiB ones, many
//    times the local budget, so they live on the daemons; compacted with offload, so GATHER_CELL
//    moved some) are searched for in the whole writable memory of every farmemd, read as root
//    through /proc/PID/mem. We read the daemons' memory rather than the leases through a second
//    client: that is what a lender's root (or a crash dump) sees, and it covers more than the
//    slabs — the daemon's receive buffers and GATHER_CELL / PARITY_ENCODE scratch too. The same
//    scan with encryption off must find the text (PlaintextIsVisibleWithoutEncryption): the scan
//    can see what it looks for.
// 2. FlippedBit*, FlippedTagBit*: one bit flipped in a daemon's slab under an object, in its
//    ciphertext or in the GCM tag stored after it (written through the runtime's own lease, as a
//    corrupting lender would) is detected: replicate:2 and ec:2+1 serve the right bytes and
//    re-protect the member, none gives DataLoss for exactly that object; the counters say so.
//    ReplayedOrSwappedSealedFormFailsAuthentication: an older sealed form of the object, or
//    another object's, put in its slot fails too (the nonce is the seal number kept locally).
// 3. NoncesNeverRepeat: a recording hook sees every nonce sealed across overwrites, eviction
//    cycles, compaction with offload on and off, relocations and moves on an eviction notice;
//    none repeats under one key, moves and compaction seal nothing, and two runtimes given the
//    same data key file seal under different keys.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "farmem/internal/seal_observer.h"
#include "farptr_fixture.h"
#include "support/memory_scan.h"
#include "support/process.h"

namespace farmem::farptr_test {
namespace {

constexpr char kMarker[] = "FARPTR-PLAINTEXT-";
constexpr uint32_t kSpan = 16384;

using testing::kNoScanUnderSanitizer;
using testing::kSanitized;

// Text that shows in a memory dump: "FARPTR-PLAINTEXT-<id>-<version>." repeated.
void FillText(std::span<std::byte> out, uint64_t id, uint64_t version) {
  const std::string unit =
      std::string(kMarker) + std::to_string(id) + "-" + std::to_string(version) + ".";
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(unit[i % unit.size()]);
}
bool TextMatches(std::span<const std::byte> got, uint64_t id, uint64_t version) {
  std::vector<std::byte> want(got.size());
  FillText(want, id, version);
  return std::memcmp(want.data(), got.data(), got.size()) == 0;
}

class FarEncryptionTest : public FarptrTest {
 protected:
  // 64-byte and 4 KiB objects, ~2.5 MiB in all, with a 256 KiB budget: nearly all of it remote.
  void WriteObjects(size_t small, size_t large) {
    for (size_t i = 0; i < small + large; ++i) {
      objs_.push_back(make_far_bytes_in(*rt_, i < small ? 64 : 4096));
      versions_.push_back(0);
      DerefScope s;
      FillText(objs_.back().deref_mut(s), i, 0);
    }
  }
  void Overwrite(size_t i) {
    if (!objs_[i]) return;  // freed
    DerefScope s;
    FillText(objs_[i].deref_mut(s), i, ++versions_[i]);
  }
  void ExpectIntact(const char* when) {
    for (size_t i = 0; i < objs_.size(); ++i) {
      if (!objs_[i]) continue;
      DerefScope s;
      auto got = objs_[i].try_deref(s);
      ASSERT_TRUE(got.has_value()) << when << ": object " << i << ": " << got.error().ToString();
      ASSERT_TRUE(TextMatches(*got, i, versions_[i])) << when << ": object " << i << " is wrong";
    }
  }
  size_t MarkersOnDaemons() {
    size_t found = 0;
    for (size_t d = 0; d < daemons_->size(); ++d) {
      uint64_t scanned = 0;
      auto found_here = testing::CountMarkerInProcess((*daemons_)[d].pid(), kMarker, &scanned);
      EXPECT_TRUE(found_here.has_value()) << found_here.error().ToString();
      const size_t n = found_here.value_or(0);
      std::fprintf(stderr, "daemon %zu: %zu plaintext markers in %.1f MiB of writable memory\n", d,
                   n, static_cast<double>(scanned) / (1 << 20));
      EXPECT_GT(scanned, 16u << 20) << "the scan did not read the slabs of daemon " << d;
      found += n;
    }
    return found;
  }
  // Writes, evicts everything, frees every third object and compacts (offload on: the daemons
  // gather the survivors), overwrites some, evicts again.
  void Churn() {
    WriteObjects(24000, 200);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    for (size_t i = 0; i < objs_.size(); i += 3) objs_[i] = far_bytes();
    ASSERT_TRUE(rt_->Compact().ok());
    for (size_t i = 1; i < objs_.size(); i += 7) Overwrite(i);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    const RuntimeStats st = rt_->stats();
    ASSERT_GT(st.remote_object_bytes, 1u << 20);
    std::fprintf(stderr, "remote %lu B of objects, %lu sets offloaded by compaction\n",
                 static_cast<unsigned long>(st.remote_object_bytes),
                 static_cast<unsigned long>(st.compaction_offloaded_sets));
  }

  std::vector<far_bytes> objs_;
  std::vector<uint64_t> versions_;
};

TEST_F(FarEncryptionTest, LenderMemoryHoldsNoPlaintext) {
  if (kSanitized) GTEST_SKIP() << kNoScanUnderSanitizer;
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "32M", "1M"));
  ASSERT_NO_FATAL_FAILURE(Open(Options("ec:2+1", 256 << 10, kSpan)));
  ASSERT_NO_FATAL_FAILURE(Churn());
  EXPECT_GT(rt_->stats().compaction_offloaded_sets, 0u) << "GATHER_CELL moved nothing";
  EXPECT_EQ(MarkersOnDaemons(), 0u) << "plaintext of far objects sits in a lender's memory";
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the scan"));
  objs_.clear();
}

// The control for the test above: the same scan finds the objects when they go out in plaintext.
TEST_F(FarEncryptionTest, PlaintextIsVisibleWithoutEncryption) {
  if (kSanitized) GTEST_SKIP() << kNoScanUnderSanitizer;
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "32M", "1M"));
  RuntimeOptions o = Options("ec:2+1", 256 << 10, kSpan);
  o.encrypt = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  ASSERT_NO_FATAL_FAILURE(Churn());
  EXPECT_GT(MarkersOnDaemons(), 1000u);
  objs_.clear();
}

// Where the GCM tag of a small object lies, from the start of its slot: right after its
// ciphertext (span_crypto.h).
uint32_t TagByteOf(const far_bytes& obj) {
  auto places = farptr_internal::LocateObjectForTest(obj.entry());
  EXPECT_TRUE(places.has_value() && !places->empty());
  if (!places.has_value() || places->empty()) return 0;
  EXPECT_EQ(places->front().sealed_length, places->front().length + aead::kTagBytes)
      << "the object's tag is not in its slot";
  return places->front().length;
}

// The first `len` bytes of the object's slot in the first daemon that holds it.
std::vector<uint8_t> ReadUnder(Runtime& rt, const far_bytes& obj, uint32_t len) {
  auto places = farptr_internal::LocateObjectForTest(obj.entry());
  EXPECT_TRUE(places.has_value() && !places->empty());
  std::vector<uint8_t> out(len);
  if (!places.has_value() || places->empty()) return out;
  const farptr_internal::ObjectPlace& p = places->front();
  auto ch = rt.cluster().OpenChannel(p.lease.node);
  EXPECT_TRUE(ch.has_value());
  if (ch.has_value()) {
    EXPECT_TRUE((*ch)->Read(p.lease.slab(), p.offset, out).ok());
  }
  return out;
}
void WriteUnder(Runtime& rt, const far_bytes& obj, std::span<const uint8_t> bytes) {
  auto places = farptr_internal::LocateObjectForTest(obj.entry());
  ASSERT_TRUE(places.has_value() && !places->empty());
  const farptr_internal::ObjectPlace& p = places->front();
  auto ch = rt.cluster().OpenChannel(p.lease.node);
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  ASSERT_TRUE((*ch)->Write(p.lease.slab(), p.offset, bytes).ok());
}

// One bit of object `victim`'s bytes flipped in the first daemon that holds them.
void FlipBitUnder(Runtime& rt, const far_bytes& obj, uint32_t byte) {
  auto places = farptr_internal::LocateObjectForTest(obj.entry());
  ASSERT_TRUE(places.has_value()) << places.error().ToString();
  ASSERT_FALSE(places->empty());
  const farptr_internal::ObjectPlace& p = places->front();
  auto ch = rt.cluster().OpenChannel(p.lease.node);
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  uint8_t b = 0;
  ASSERT_TRUE((*ch)->Read(p.lease.slab(), p.offset + byte, {&b, 1}).ok());
  b ^= 0x10;
  ASSERT_TRUE((*ch)->Write(p.lease.slab(), p.offset + byte, {&b, 1}).ok());
}

class FarBitFlipTest : public FarEncryptionTest, public ::testing::WithParamInterface<const char*> {
 protected:
  // Three daemons, the parameter's resilience, 4000 small objects, all evicted; compaction off:
  // an object must stay where a test located it.
  // gather: RuntimeOptions::gather_on_miss (off where the test needs a miss to bring the whole
  // span, its other objects sealed; on, a flipped object's own miss finds the flip).
  void StartEvicted(bool gather = true) {
    ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "32M", "1M"));
    RuntimeOptions o = Options(GetParam(), 256 << 10, kSpan);
    o.auto_compact = false;
    o.gather_on_miss = gather;
    ASSERT_NO_FATAL_FAILURE(Open(o));
    WriteObjects(4000, 0);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
  }

  // Reads every object after a bit of `victim`'s slot was flipped on a daemon: with redundancy
  // all come back right and the member is re-protected, without it exactly `victim` is lost.
  void ExpectFlipDetected(size_t victim);
};

TEST_P(FarBitFlipTest, FlippedBitIsDetected) {
  ASSERT_NO_FATAL_FAILURE(StartEvicted());
  const size_t victim = 1234;
  ASSERT_NO_FATAL_FAILURE(FlipBitUnder(*rt_, objs_[victim], 17));
  ASSERT_NO_FATAL_FAILURE(ExpectFlipDetected(victim));
}

// The tag lies on the lender, after the ciphertext: a bit flipped in it is caught the same way.
TEST_P(FarBitFlipTest, FlippedTagBitIsDetected) {
  ASSERT_NO_FATAL_FAILURE(StartEvicted());
  const size_t victim = 1234;
  const uint32_t tag = TagByteOf(objs_[victim]);
  ASSERT_GT(tag, 0u);
  ASSERT_NO_FATAL_FAILURE(FlipBitUnder(*rt_, objs_[victim], tag + 5));
  ASSERT_NO_FATAL_FAILURE(ExpectFlipDetected(victim));
}

void FarBitFlipTest::ExpectFlipDetected(size_t victim) {
  const std::string res = GetParam();
  const bool redundant = res != "none";
  for (size_t i = 0; i < objs_.size(); ++i) {
    DerefScope s;
    auto got = objs_[i].try_deref(s);
    if (i == victim && !redundant) {
      ASSERT_FALSE(got.has_value()) << "a corrupted object came back";
      EXPECT_EQ(got.error().code(), StatusCode::kDataLoss) << got.error().ToString();
      EXPECT_NE(got.error().message().find("failed authentication"), std::string::npos)
          << got.error().ToString();
      continue;
    }
    ASSERT_TRUE(got.has_value()) << "object " << i << ": " << got.error().ToString();
    ASSERT_TRUE(TextMatches(*got, i, 0)) << "object " << i << " came back wrong";
  }
  RuntimeStats st = rt_->stats();
  EXPECT_EQ(st.auth_failures, 1u);
  EXPECT_EQ(st.auth_failed_objects, 1u);
  if (redundant) {
    EXPECT_EQ(st.auth_lost_objects, 0u);
    EXPECT_GE(st.degraded_reads, 1u);
    ASSERT_TRUE(rt_->WaitForRecovery(std::chrono::seconds(30)).ok());
    st = rt_->stats();
    EXPECT_GE(st.members_reprotected, 1u) << "the corrupted member was not re-protected";
    // After re-protection everything reads right again, from healthy members.
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectIntact("after re-protection"));
  } else {
    EXPECT_EQ(st.auth_lost_objects, 1u);
    objs_[victim] = far_bytes();  // a lost object can still be freed
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the loss"));
  }
  EXPECT_EQ(rt_->stats().auth_failures, 1u) << "more than the flipped cell failed";
  objs_.clear();
}

// The lender keeps an object's sealed form (ciphertext and tag) and, after the object was
// written and sealed anew, puts the old one back where the new one lies: a replay. The nonce
// comes from the seal number in the local entry, which the old form was not sealed under, so
// the object fails authentication rather than coming back old. The same for another object's
// sealed form (same size) put in its place.
TEST_F(FarEncryptionTest, ReplayedOrSwappedSealedFormFailsAuthentication) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2, "32M", "1M"));
  RuntimeOptions o = Options("none", 256 << 10, kSpan);
  o.auto_compact = false;  // the objects must stay where they were located
  ASSERT_NO_FATAL_FAILURE(Open(o));
  WriteObjects(4000, 0);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const size_t replayed = 1234, other = 2345, swapped = 3456;
  const uint32_t len = TagByteOf(objs_[replayed]) + aead::kTagBytes;
  ASSERT_GT(len, aead::kTagBytes);
  const std::vector<uint8_t> old_form = ReadUnder(*rt_, objs_[replayed], len);
  Overwrite(replayed);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NE(ReadUnder(*rt_, objs_[replayed], len), old_form) << "sealed again to the same bytes";
  ASSERT_NO_FATAL_FAILURE(WriteUnder(*rt_, objs_[replayed], old_form));
  ASSERT_NO_FATAL_FAILURE(WriteUnder(*rt_, objs_[swapped], ReadUnder(*rt_, objs_[other], len)));
  for (const size_t victim : {replayed, swapped}) {
    DerefScope s;
    auto got = objs_[victim].try_deref(s);
    ASSERT_FALSE(got.has_value()) << "object " << victim << " came back from a replayed form";
    EXPECT_EQ(got.error().code(), StatusCode::kDataLoss) << got.error().ToString();
    EXPECT_NE(got.error().message().find("failed authentication"), std::string::npos)
        << got.error().ToString();
  }
  EXPECT_EQ(rt_->stats().auth_failed_objects, 2u);
  EXPECT_EQ(rt_->stats().auth_lost_objects, 2u);
  objs_[replayed] = far_bytes();
  objs_[swapped] = far_bytes();
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the replay"));
  objs_.clear();
}

// Objects a and b lie in the same cell (same span, so one swap-in brings both).
void ExpectSameCell(const far_bytes& a, const far_bytes& b) {
  auto pa = farptr_internal::LocateObjectForTest(a.entry());
  auto pb = farptr_internal::LocateObjectForTest(b.entry());
  ASSERT_TRUE(pa.has_value() && pb.has_value());
  ASSERT_FALSE(pa->empty() || pb->empty());
  ASSERT_EQ(pa->front().lease.id(), pb->front().lease.id());
  ASSERT_EQ(pa->front().offset / kSpan, pb->front().offset / kSpan) << "not in the same cell";
}

// A miss opens only the object dereferenced; its neighbours stay sealed (not local) until their
// own first deref, which opens them. Regression: every swap-in used to open all the objects of
// the span (256 EVP calls for a span of 64-byte objects), so a miss cost ~65 µs to 1.9 ms more
// with encryption (docs/benchmarks-farptr.md).
TEST_F(FarEncryptionTest, AMissOpensOnlyTheObjectDereferenced) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "32M", "1M"));
  RuntimeOptions o = Options("ec:2+1", 256 << 10, kSpan);
  o.auto_compact = false;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  WriteObjects(4000, 0);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  const size_t a = 2000, b = 2001;
  ASSERT_NO_FATAL_FAILURE(ExpectSameCell(objs_[a], objs_[b]));
  {
    DerefScope s;
    ASSERT_TRUE(TextMatches(objs_[a].deref(s), a, 0));
  }
  EXPECT_TRUE(objs_[a].is_local());
  EXPECT_FALSE(objs_[b].is_local()) << "the miss on object " << a << " opened its neighbour too";
  {
    DerefScope s;
    ASSERT_TRUE(TextMatches(objs_[b].deref(s), b, 0)) << "a lazily opened object came back wrong";
  }
  EXPECT_TRUE(objs_[b].is_local());
  // A first write into the swapped-in span opens what is still sealed before the span gives its
  // cell up; written out and read back, everything is intact.
  Overwrite(a);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after a write into a lazily opened span"));
  EXPECT_EQ(rt_->stats().auth_failures, 0u);
  objs_.clear();
}

// A bit flipped under an object that is still sealed when another object of its span is first
// written: the write makes the span give its cell up, so everything still sealed is opened first
// and the flip is answered from the cell's other members (or the object is lost, with none),
// never sealed again as if it were plaintext.
TEST_P(FarBitFlipTest, FlipUnderASealedNeighbourIsFoundBeforeTheSpanIsWritten) {
  const std::string res = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartEvicted(/*gather=*/false));  // the writer's miss brings the span
  const size_t victim = 1234, writer = 1235;
  ASSERT_NO_FATAL_FAILURE(ExpectSameCell(objs_[victim], objs_[writer]));
  ASSERT_NO_FATAL_FAILURE(FlipBitUnder(*rt_, objs_[victim], 17));
  Overwrite(writer);  // swaps the span in, opens `writer` only, then the write opens the rest
  RuntimeStats st = rt_->stats();
  EXPECT_EQ(st.auth_failures, 1u) << "the write did not open the sealed neighbour first";
  EXPECT_EQ(st.auth_failed_objects, 1u);
  const bool redundant = res != "none";
  EXPECT_EQ(st.auth_lost_objects, redundant ? 0u : 1u);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());  // the span goes out anew
  if (!redundant) {
    DerefScope s;
    auto got = objs_[victim].try_deref(s);
    ASSERT_FALSE(got.has_value()) << "a corrupted object came back";
    EXPECT_EQ(got.error().code(), StatusCode::kDataLoss) << got.error().ToString();
    objs_[victim] = far_bytes();
  }
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the write"));
  EXPECT_EQ(rt_->stats().auth_failures, 1u) << "more than the flipped cell failed";
  objs_.clear();
}

// Regression (issue 16, farptr-ec21-flip): two cells of one member corrupted, and the second one
// read (its span swapped in, the flipped object still sealed) before the first one's failed tag
// marked the member failed. When the sealed object is opened, its member is failed already;
// ReportCorrupt took that to mean the cell came from a degraded read and the object was lost,
// although the other members could still rebuild it (1 run in 17 of the chaos scenario).
TEST_F(FarEncryptionTest, SecondFlipInAMemberFailedMeanwhileIsRebuilt) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "32M", "1M"));
  RuntimeOptions o = Options("ec:2+1", 256 << 10, kSpan);
  o.auto_compact = false;    // the objects must stay where they were located
  o.gather_on_miss = false;  // the miss on y brings its span, z still sealed in it
  ASSERT_NO_FATAL_FAILURE(Open(o));
  WriteObjects(4000, 0);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  // x and y in two cells (rows) of the same member's slab; z beside y in its cell.
  auto where = [&](size_t i) {
    auto p = farptr_internal::LocateObjectForTest(objs_[i].entry());
    EXPECT_TRUE(p.has_value() && !p->empty());
    return std::pair<uint64_t, uint64_t>{p->front().lease.id(), p->front().offset / kSpan};
  };
  const size_t x = 100;
  const auto [lease, row_x] = where(x);
  size_t y = objs_.size();
  for (size_t i = x + 1; i + 1 < objs_.size(); ++i) {
    const auto [l, r] = where(i);
    if (l == lease && r != row_x && where(i + 1) == std::pair{l, r}) {
      y = i;
      break;
    }
  }
  ASSERT_LT(y, objs_.size()) << "no second cell on the member of object " << x;
  const size_t z = y + 1;
  ASSERT_NO_FATAL_FAILURE(FlipBitUnder(*rt_, objs_[x], 17));
  ASSERT_NO_FATAL_FAILURE(FlipBitUnder(*rt_, objs_[y], 17));
  {
    DerefScope s;
    ASSERT_TRUE(TextMatches(objs_[z].deref(s), z, 0));  // y's cell read; y stays sealed
  }
  ASSERT_FALSE(objs_[y].is_local());
  {
    DerefScope s;  // x's tag fails: its member is marked failed, x rebuilt from the others
    auto got = objs_[x].try_deref(s);
    ASSERT_TRUE(got.has_value()) << got.error().ToString();
    ASSERT_TRUE(TextMatches(*got, x, 0));
  }
  {
    DerefScope s;  // y's tag fails on a member failed meanwhile: rebuilt all the same
    auto got = objs_[y].try_deref(s);
    ASSERT_TRUE(got.has_value()) << "lost: " << got.error().ToString();
    ASSERT_TRUE(TextMatches(*got, y, 0)) << "object " << y << " came back wrong";
  }
  const RuntimeStats st = rt_->stats();
  EXPECT_EQ(st.auth_failures, 2u);
  EXPECT_EQ(st.auth_lost_objects, 0u);
  ASSERT_TRUE(rt_->WaitForRecovery(std::chrono::seconds(30)).ok());
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after re-protection"));
  objs_.clear();
}

// Regression (issue 16, farptr-ec21-flip-compact): compaction moves a cell whose bytes were
// flipped on its daemon. It used to move the ciphertext unopened (the daemons gathering it have
// no key), compute the new set's parity over it and free the old set: the object was lost. Now
// each source cell is checked against the CRC-32C it was written with — by the gathering daemon
// (offload) or by the client — and a corrupted one is repaired from the other members first.
class FarCompactFlipTest : public FarEncryptionTest, public ::testing::WithParamInterface<bool> {};

TEST_P(FarCompactFlipTest, CompactionRepairsAFlippedCellBeforeMovingIt) {
  const bool offload = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartDaemons(3, "32M", "1M"));
  RuntimeOptions o = Options("ec:2+1", 256 << 10, kSpan);
  o.auto_compact = false;  // one explicit pass, after the flip
  o.parity_offload = offload;
  ASSERT_NO_FATAL_FAILURE(Open(o));
  // 16 spans (80-byte slots: 64 B and the tag), what one compaction pass takes at most.
  WriteObjects(3200, 0);
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  // Every span half empty: all of them are compacted.
  for (size_t i = 0; i < objs_.size(); i += 2) objs_[i] = far_bytes();
  const size_t victim = 1235;
  auto before = farptr_internal::LocateObjectForTest(objs_[victim].entry());
  ASSERT_TRUE(before.has_value() && !before->empty());
  ASSERT_NO_FATAL_FAILURE(FlipBitUnder(*rt_, objs_[victim], 17));
  ASSERT_TRUE(rt_->Compact().ok());
  auto after = farptr_internal::LocateObjectForTest(objs_[victim].entry());
  ASSERT_TRUE(after.has_value() && !after->empty());
  ASSERT_TRUE(after->front().lease.id() != before->front().lease.id() ||
              after->front().offset != before->front().offset)
      << "compaction did not move the flipped object";
  RuntimeStats st = rt_->stats();
  EXPECT_GE(st.compaction_corrupt_cells, 1u) << "compaction did not notice the flipped cell";
  if (offload) {
    EXPECT_GE(st.compaction_offload_fallbacks, 1u) << "the daemons did not report the flip";
  }
  ASSERT_NO_FATAL_FAILURE(ExpectIntact("after compaction"));
  st = rt_->stats();
  EXPECT_EQ(st.auth_failures, 0u) << "the flip was moved, not repaired";
  EXPECT_EQ(st.auth_lost_objects, 0u);
  ASSERT_TRUE(rt_->WaitForRecovery(std::chrono::seconds(30)).ok());
  EXPECT_GE(rt_->stats().members_reprotected, 1u) << "the corrupted member was not re-protected";
  objs_.clear();
}

INSTANTIATE_TEST_SUITE_P(Offload, FarCompactFlipTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "offload" : "client"; });

INSTANTIATE_TEST_SUITE_P(Resilience, FarBitFlipTest,
                         ::testing::Values("replicate:2", "ec:2+1", "none"), [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == ':' || c == '+') c = '_';
                           return n;
                         });

// Records every (key id, nonce) sealed; counts repeats.
class NonceRecorder {
 public:
  NonceRecorder() {
    farptr_internal::SetSealObserverForTest([this](uint64_t key, const aead::Nonce& n) {
      std::lock_guard<std::mutex> l(mu_);
      ++seals_;
      keys_.insert(key);
      if (!seen_.insert({key, n}).second) ++repeats_;
    });
  }
  ~NonceRecorder() { farptr_internal::SetSealObserverForTest(nullptr); }
  uint64_t seals() {
    std::lock_guard<std::mutex> l(mu_);
    return seals_;
  }
  uint64_t repeats() {
    std::lock_guard<std::mutex> l(mu_);
    return repeats_;
  }
  size_t keys() {
    std::lock_guard<std::mutex> l(mu_);
    return keys_.size();
  }

 private:
  std::mutex mu_;
  std::set<std::pair<uint64_t, aead::Nonce>> seen_;
  std::set<uint64_t> keys_;
  uint64_t seals_ = 0, repeats_ = 0;
};

TEST_F(FarEncryptionTest, NoncesNeverRepeat) {
  NonceRecorder rec;
  ASSERT_NO_FATAL_FAILURE(StartDaemons(4, "32M", "1M"));
  const std::string key_file = daemons_->work_dir() + "/farptr.datakey";
  for (bool offload : {true, false}) {
    SCOPED_TRACE(offload ? "offload on" : "offload off");
    RuntimeOptions o = Options("ec:2+1", 256 << 10, kSpan);
    o.parity_offload = offload;
    o.data_key_file = key_file;  // the same data key for both runtimes
    ASSERT_NO_FATAL_FAILURE(Open(o));
    WriteObjects(6000, 100);
    // Eviction cycles with overwrites in between (the same objects sealed again and again), and
    // reads that swap spans in and evict them clean.
    for (int round = 0; round < 4; ++round) {
      ASSERT_TRUE(rt_->EvictUntil(0).ok());
      for (size_t i = round; i < objs_.size(); i += 5) Overwrite(i);
      ASSERT_TRUE(rt_->EvictUntil(0).ok());
      ASSERT_NO_FATAL_FAILURE(ExpectIntact("eviction cycle"));
    }
    // Hot objects in cold spans: the evictor relocates them (a local copy, sealed afresh later).
    for (int round = 0; round < 20 && rt_->stats().objects_relocated == 0; ++round) {
      ASSERT_TRUE(rt_->EvictUntil(0).ok());
      for (size_t i = 0; i < objs_.size(); i += 97) {
        DerefScope s;
        if (objs_[i]) (void)objs_[i].deref(s);
      }
      for (size_t i = 1; i < objs_.size(); i += 2) {
        DerefScope s;
        if (objs_[i]) (void)objs_[i].deref(s);  // fills the budget: the evictor sweeps
      }
    }
    EXPECT_GT(rt_->stats().objects_relocated, 0u);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    // Compaction moves ciphertext: it seals nothing.
    for (size_t i = 0; i < objs_.size(); i += 3) objs_[i] = far_bytes();
    uint64_t before = rec.seals();
    const RuntimeStats st0 = rt_->stats();
    ASSERT_TRUE(rt_->Compact().ok());
    const RuntimeStats st1 = rt_->stats();
    EXPECT_GT(st1.compactions, st0.compactions);
    if (offload) {
      EXPECT_GT(st1.compaction_offloaded_sets, st0.compaction_offloaded_sets);
    }
    EXPECT_EQ(rec.seals(), before) << "compaction re-encrypted objects";
    ASSERT_NO_FATAL_FAILURE(ExpectIntact("after compaction"));  // swaps everything in
    for (size_t i = 2; i < objs_.size(); i += 3) Overwrite(i);
    ASSERT_TRUE(rt_->EvictUntil(0).ok());
    // A move on an eviction notice copies ciphertext: drain the daemon with the most leases.
    size_t busiest = 0, most = 0;
    const auto layout = rt_->span_set_layout();
    for (size_t d = 0; d < daemons_->size(); ++d) {
      size_t n = 0;
      for (auto& g : layout) {
        for (auto& ep : g) n += ep == (*daemons_)[d].endpoint() ? 1 : 0;
      }
      if (n > most) {
        most = n;
        busiest = d;
      }
    }
    ASSERT_GT(most, 0u);
    before = rec.seals();
    const uint64_t moved0 = rt_->stats().members_moved;
    testing::CommandResult r = testing::RunCommand(
        {testing::BinPath("farmemctl"), "drain", (*daemons_)[busiest].endpoint().ToString(),
         "--grace-ms", "30000", "--wait", "--secret-file", daemons_->work_dir() + "/secret"},
        std::chrono::seconds(60));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    ASSERT_TRUE(rt_->WaitForRecovery(std::chrono::seconds(30)).ok());
    EXPECT_GT(rt_->stats().members_moved, moved0);
    EXPECT_EQ(rec.seals(), before) << "a move re-encrypted objects";
    ASSERT_NO_FATAL_FAILURE(ExpectIntact("after the move"));
    r = testing::RunCommand(
        {testing::BinPath("farmemctl"), "undrain", (*daemons_)[busiest].endpoint().ToString(),
         "--secret-file", daemons_->work_dir() + "/secret"},
        std::chrono::seconds(30));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    objs_.clear();
    versions_.clear();
    rt_.reset();
  }
  std::fprintf(stderr, "%lu seals under %zu keys, %lu repeated nonces\n",
               static_cast<unsigned long>(rec.seals()), rec.keys(),
               static_cast<unsigned long>(rec.repeats()));
  EXPECT_GT(rec.seals(), 20000u);
  EXPECT_EQ(rec.keys(), 2u) << "two runtimes on one data key file sealed under one key";
  EXPECT_EQ(rec.repeats(), 0u) << "a nonce was used twice under one key";
}

}  // namespace
}  // namespace farmem::farptr_test
