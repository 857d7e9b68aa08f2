// Page encryption of the page store (issue 16 item 2, docs/security.md): what a lender holds is
// ciphertext in every resilience mode and in the backup file; a bit flipped in a lender's slab is
// detected on read and served from the other members (replicate, ec), the backup file, or answered
// with an error for exactly that page (none), and counted; nonces never repeat across overwrites,
// sub-page writes, rebuilds, moves and re-attach.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "page_store_fixture.h"
#include "support/memory_scan.h"

namespace farmem::blockdev::pstest {
namespace {

using std::chrono::milliseconds;

using testing::kNoScanUnderSanitizer;
using testing::kSanitized;

// A recognisable pattern: each 64-byte line of page p says which page it belongs to.
constexpr std::string_view kMark = "FARMEM-PLAINTEXT-MARK:";
void FillPattern(uint64_t page, uint8_t* out) {
  for (size_t at = 0; at < 4096; at += 64) {
    char line[65];
    std::snprintf(line, sizeof line, "%s%016llx-%022zu", kMark.data(),
                  static_cast<unsigned long long>(page), at);
    std::memcpy(out + at, line, 64);
  }
}

size_t CountMarks(std::string_view hay) { return testing::CountMarker(hay, kMark); }

class CryptoTest : public PageStoreTest {
 protected:
  void OpenWith(const std::string& mode, bool encrypt, const std::string& backup = "",
                std::optional<aead::Key> key = std::nullopt) {
    Open(mode, backup, milliseconds(500), [&](PageStoreOptions& o) {
      o.encrypt = encrypt;
      o.data_key = key;
      o.seal_observer = [this](uint32_t domain, uint64_t counter, uint64_t page) {
        MutexLock lock(&seals_mu_);
        seals_.push_back({domain, counter, page});
      };
    });
  }

  // Writes the pattern over the first `pages` pages (aligned, and a few sub-page writes).
  void WritePatterns(uint64_t pages) {
    std::vector<uint8_t> buf(pages * 4096);
    for (uint64_t p = 0; p < pages; ++p) FillPattern(p, buf.data() + p * 4096);
    ASSERT_TRUE(store_->Write(0, buf, false).ok());
    std::memcpy(shadow_.data(), buf.data(), buf.size());
    // Sub-page writes go through read-modify-write: their pages leave sealed too.
    for (uint64_t p = 0; p < pages; p += 7) {
      Status s = store_->Write(p * 4096 + 512, {buf.data() + p * 4096 + 512, 1024}, false);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
  }

  size_t MarksOnLenders() {
    size_t marks = 0, scanned = 0;
    for (size_t i = 0; i < daemons_->size(); ++i) {
      const pid_t pid = (*daemons_)[i].pid();
      if (pid <= 0) continue;
      uint64_t s = 0;
      auto m = testing::CountMarkerInProcess(pid, kMark, &s);
      EXPECT_TRUE(m.has_value()) << m.error().ToString();
      marks += m.value_or(0);
      scanned += s;
    }
    EXPECT_GT(scanned, kExport / 2) << "the scan read too little of the daemons' memory";
    return marks;
  }

  // Flips one bit of member `member`'s copy of export page `page` on its daemon.
  void FlipBit(uint64_t page, size_t member) {
    const uint64_t extent = page * 4096 / store_->extent_bytes();
    const uint64_t in_extent = page - extent * (store_->extent_bytes() / 4096);
    const auto members = store_->extent_members(extent);
    ASSERT_LT(member, members.size());
    const uint32_t frag = static_cast<uint32_t>(4096 / store_->resilience().k);
    std::vector<uint8_t> bytes(frag);
    const client::Lease& l = members[member];
    Status s = RawOp(*cluster_, l, transport::OpType::kRead, in_extent * frag, bytes.data(), frag);
    ASSERT_TRUE(s.ok()) << "reading the cell to flip: " << s.ToString();
    bytes[100] ^= 0x10;
    s = RawOp(*cluster_, l, transport::OpType::kWrite, in_extent * frag, bytes.data(), frag);
    ASSERT_TRUE(s.ok()) << "writing the flipped cell: " << s.ToString();
  }

  struct Seal {
    uint32_t domain;
    uint64_t counter;
    uint64_t page;
  };
  size_t SealCount() {
    MutexLock lock(&seals_mu_);
    return seals_.size();
  }
  // Every (domain, counter) sealed so far is distinct: no nonce was used twice.
  void ExpectNoncesUnique() {
    MutexLock lock(&seals_mu_);
    std::set<std::pair<uint32_t, uint64_t>> seen;
    for (const Seal& s : seals_) {
      EXPECT_TRUE(seen.insert({s.domain, s.counter}).second)
          << "nonce (" << s.domain << ", " << s.counter << ") used twice (page " << s.page << ")";
    }
  }

  Mutex seals_mu_;
  std::vector<Seal> seals_;
};

// ---- (1) the lenders hold no plaintext ------------------------------------------------------

struct ModeCase {
  const char* mode;
  size_t daemons;
  bool backup;
  size_t daemons_in_group = 1;
};
class NoPlaintextTest : public CryptoTest, public ::testing::WithParamInterface<ModeCase> {};

TEST_P(NoPlaintextTest, LendersAndBackupFileHoldNoneOfThePatterns) {
  const ModeCase c = GetParam();
  // With a backup file the file is still checked; without, the scan is the whole case.
  if (kSanitized && !c.backup) GTEST_SKIP() << kNoScanUnderSanitizer;
  StartDaemons(c.daemons, "16M");
  testing::TempDir dir("crypto");  // private: two runs of this test at once must not share it
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  const std::string backup = c.backup ? dir.File("backup.img") : "";
  OpenWith(c.mode, /*encrypt=*/true, backup);
  constexpr uint64_t kPages = 2048;  // 8 MiB
  WritePatterns(kPages);
  VerifyAll();
  if (!kSanitized) {
    EXPECT_EQ(MarksOnLenders(), 0u) << "plaintext of the export is in a lender's memory";
  }
  if (c.backup) {
    std::ifstream f(backup, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    EXPECT_EQ(ss.str().size(), kExport);
    EXPECT_EQ(CountMarks(ss.str()), 0u) << "plaintext of the export is in the backup file";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, NoPlaintextTest,
                         ::testing::Values(ModeCase{"none", 1, false},
                                           ModeCase{"replicate:2", 2, false},
                                           ModeCase{"ec:2+1", 3, false}, ModeCase{"none", 1, true}),
                         [](const auto& info) {
                           std::string n = info.param.mode;
                           std::replace_if(
                               n.begin(), n.end(), [](char ch) { return !std::isalnum(ch); }, '_');
                           return n + (info.param.backup ? "_backup" : "");
                         });

// The control that makes the test above mean something: the same scan does find the patterns
// when the pages go out in plaintext (--no-encrypt).
TEST_F(CryptoTest, WithoutEncryptionTheScanFindsThePatterns) {
  if (kSanitized) GTEST_SKIP() << kNoScanUnderSanitizer;
  StartDaemons(1, "16M");
  OpenWith("none", /*encrypt=*/false);
  WritePatterns(256);
  EXPECT_GE(MarksOnLenders(), 256u * 64);
}

// ---- (2) a flipped bit is detected, never returned ------------------------------------------

class FlipTest : public CryptoTest, public ::testing::WithParamInterface<ModeCase> {};

TEST_P(FlipTest, IsServedFromTheOtherMembersAndReprotected) {
  const ModeCase c = GetParam();
  StartDaemons(c.daemons, "16M");
  OpenWith(c.mode, /*encrypt=*/true);
  RandomWrites(40, 5);
  WritePatterns(64);
  const uint64_t page = 17;
  // The member a read uses: replicate reads one replica, by page. ec posts to every member and
  // decodes from the first k replies it reaps; when the worker wakes to find every reply there
  // (a loaded machine), ChannelSet::WaitAny reaps them in node order, so a member on the
  // group's highest node could be left out of every read: flip the one on its lowest node.
  size_t member = page % c.daemons_in_group;
  if (store_->resilience().k > 1) {
    const auto members = store_->extent_members(page * 4096 / store_->extent_bytes());
    member = static_cast<size_t>(
        std::min_element(members.begin(), members.end(),
                         [](const auto& a, const auto& b) { return a.node < b.node; }) -
        members.begin());
  }
  FlipBit(page, member);
  std::vector<uint8_t> buf(4096);
  // Each read must be right whether it used the bad member or not: read until one did.
  size_t reads = 0;
  ASSERT_TRUE(WaitUntil(
      [&] {
        ++reads;
        if (!store_->Read(page * 4096, buf).ok()) return true;  // fails the checks below
        if (std::memcmp(buf.data(), shadow_.data() + page * 4096, 4096) != 0) return true;
        return store_->stats().integrity_failures != 0;
      },
      std::chrono::seconds(60)))
      << "the flipped member was left out of " << reads << " reads";
  ASSERT_TRUE(store_->Read(page * 4096, buf).ok());
  ASSERT_EQ(0, std::memcmp(buf.data(), shadow_.data() + page * 4096, 4096));
  EXPECT_EQ(store_->stats().integrity_failures, 1u);
  // The bad member is a failed member: re-protected, after which every page reads right again.
  ASSERT_TRUE(WaitUntil([&] { return store_->stats().rebuilds >= 1; }, std::chrono::seconds(20)))
      << Describe();
  store_->WaitForRebuilds();
  WaitUntilWhole();
  VerifyAll();
  EXPECT_EQ(store_->stats().integrity_failures, 1u);
}

INSTANTIATE_TEST_SUITE_P(Modes, FlipTest,
                         ::testing::Values(ModeCase{"replicate:2", 3, false, 2},
                                           ModeCase{"ec:2+1", 4, false, 3}),
                         [](const auto& info) {
                           std::string n = info.param.mode;
                           std::replace_if(
                               n.begin(), n.end(), [](char ch) { return !std::isalnum(ch); }, '_');
                           return n;
                         });

TEST_F(CryptoTest, FlipInNoneFailsExactlyThatPage) {
  StartDaemons(1, "16M");
  OpenWith("none", /*encrypt=*/true);
  WritePatterns(64);
  FlipBit(17, 0);
  std::vector<uint8_t> buf(4096);
  Status s = store_->Read(17 * 4096, buf);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.ToString();
  EXPECT_EQ(store_->stats().integrity_failures, 1u);
  // A read covering it fails; its neighbours read right.
  std::vector<uint8_t> run(8 * 4096);
  EXPECT_FALSE(store_->Read(12 * 4096, run).ok());
  for (uint64_t p : {16, 18}) {
    ASSERT_TRUE(store_->Read(p * 4096, buf).ok());
    EXPECT_EQ(0, std::memcmp(buf.data(), shadow_.data() + p * 4096, 4096));
  }
  // Written again, it reads right.
  std::vector<uint8_t> fresh(4096, 0x5a);
  ASSERT_TRUE(store_->Write(17 * 4096, fresh, false).ok());
  ASSERT_TRUE(store_->Read(17 * 4096, buf).ok());
  EXPECT_EQ(buf, fresh);
}

TEST_F(CryptoTest, FlipInNoneIsServedFromTheBackupFile) {
  StartDaemons(2, "16M");
  testing::TempDir dir("crypto");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  const std::string backup = dir.File("backup.img");
  OpenWith("none", /*encrypt=*/true, backup);
  WritePatterns(64);
  FlipBit(17, 0);
  std::vector<uint8_t> buf(4096);
  ASSERT_TRUE(store_->Read(17 * 4096, buf).ok());
  EXPECT_EQ(0, std::memcmp(buf.data(), shadow_.data() + 17 * 4096, 4096));
  EXPECT_EQ(store_->stats().integrity_failures, 1u);
  store_->WaitForRebuilds();
  WaitUntilWhole();
  VerifyAll();
}

// ---- (3) nonces never repeat ------------------------------------------------------------------

TEST_F(CryptoTest, NoncesNeverRepeatAcrossOverwritesRebuildsMovesAndReattach) {
  op_timeout_ = milliseconds(2000);
  StartDaemons(5, "24M");
  const aead::Key key = *aead::GenerateKey();
  OpenWith("ec:2+1", /*encrypt=*/true, "", key);
  // Overwrites and sub-page writes (RandomWrites mixes 512-byte-aligned partial writes in).
  RandomWrites(300, 11);
  RandomWrites(300, 12);
  VerifyAll();
  const size_t written = SealCount();
  ASSERT_GT(written, 1000u);
  // Every write took a new counter for every page it sealed: per page, strictly increasing.
  {
    MutexLock lock(&seals_mu_);
    std::map<uint64_t, uint64_t> last;
    for (const Seal& s : seals_) {
      auto it = last.find(s.page);
      if (it != last.end()) {
        EXPECT_GT(s.counter, it->second) << "page " << s.page;
      }
      last[s.page] = s.counter;
    }
  }
  // A rebuild copies ciphertext: no seal at all, and the data still opens.
  const client::NodeId victim = store_->extent_members(0)[0].node;
  (*daemons_)[victim].Kill();
  WaitUntilNoticedDown(victim);
  store_->WaitForRebuilds();
  WaitUntilWhole();
  EXPECT_GE(store_->stats().rebuilds, 1u);
  EXPECT_EQ(SealCount(), written) << "a rebuild re-encrypted pages";
  VerifyAll();
  // A move (DRAIN: EVICT_NOTICE for every lease of a daemon) copies ciphertext too.
  client::NodeId drained = 0;
  for (const client::NodeInfo& n : cluster_->nodes()) {
    if (n.alive && n.leases_held > 0) drained = n.id;
  }
  {
    auto reply = Drain(drained, 20000);
    ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
  }
  ASSERT_TRUE(
      WaitUntil([&] { return store_->stats().moved_members >= 1; }, std::chrono::seconds(20)))
      << Describe();
  store_->WaitForRebuilds();
  EXPECT_EQ(SealCount(), written) << "a move re-encrypted pages";
  VerifyAll();
  // Re-attach under the same data key (--data-key-file): a new store, a new domain; all nonces of
  // both attaches distinct.
  const uint32_t first_domain = store_->crypto()->domain();
  store_.reset();
  OpenWith("ec:2+1", /*encrypt=*/true, "", key);
  EXPECT_NE(store_->crypto()->domain(), first_domain);
  RandomWrites(300, 13);
  VerifyAll();
  ExpectNoncesUnique();
}

}  // namespace
}  // namespace farmem::blockdev::pstest
