// PageCrypto on its own: which seal a page opens with after writes that failed or overlapped.
#include "page_crypto.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include "support/counting_new.h"

namespace farmem::blockdev {
namespace {

using Page = std::array<uint8_t, 4096>;

Page Pattern(uint8_t v) {
  Page p;
  p.fill(v);
  return p;
}

class PageCryptoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    aead::Key key{};
    for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(i * 7 + 1);
    auto c = PageCrypto::Create(key, 4096);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    crypto_ = std::move(*c);
    auto cipher = crypto_->NewCipher();
    ASSERT_TRUE(cipher.has_value());
    cipher_.emplace(std::move(*cipher));
  }

  // What a member would hold after a write of `plain` to `page`.
  Page Seal(uint64_t page, const Page& plain) {
    Page out;
    EXPECT_TRUE(crypto_->Seal(*cipher_, page, plain.data(), out.data()).ok());
    return out;
  }
  // Whether `stored` opens as `plain`.
  bool Opens(uint64_t page, Page stored, const Page& plain) {
    if (!crypto_->Open(*cipher_, page, stored.data()).ok()) return false;
    return stored == plain;
  }

  std::unique_ptr<PageCrypto> crypto_;
  std::optional<aead::Cipher> cipher_;
};

TEST_F(PageCryptoTest, AFailedWriteLeavesTheOldVersionReadable) {
  const Page a = Pattern(0xa1), b = Pattern(0xb2);
  const Page sa = Seal(7, a);
  crypto_->EndWrite(7, true);
  const Page sb = Seal(7, b);
  crypto_->EndWrite(7, false);  // e.g. its round stopped before posting it
  EXPECT_TRUE(Opens(7, sa, a)) << "the members still hold the acknowledged write";
  EXPECT_TRUE(Opens(7, sb, b)) << "a failed write may have reached some members";
  // The next lone acknowledged write settles the page: older versions no longer open.
  const Page c = Pattern(0xc3);
  const Page sc = Seal(7, c);
  crypto_->EndWrite(7, true);
  EXPECT_TRUE(Opens(7, sc, c));
  EXPECT_FALSE(Opens(7, sa, a)) << "an old version replayed by a lender must fail";
  EXPECT_FALSE(Opens(7, sb, b));
}

TEST_F(PageCryptoTest, OverlappingWritesOpenWhicheverLanded) {
  const Page a = Pattern(1), b = Pattern(2);
  const Page sa = Seal(3, a);
  const Page sb = Seal(3, b);
  crypto_->EndWrite(3, true);  // acknowledgements in either order
  crypto_->EndWrite(3, true);
  EXPECT_TRUE(Opens(3, sa, a));
  EXPECT_TRUE(Opens(3, sb, b));
  const Page c = Pattern(3);
  const Page sc = Seal(3, c);
  crypto_->EndWrite(3, true);
  EXPECT_TRUE(Opens(3, sc, c));
  EXPECT_FALSE(Opens(3, sa, a));
  EXPECT_FALSE(Opens(3, sb, b));
}

TEST_F(PageCryptoTest, AWriteInFlightOpensWithEitherVersion) {
  const Page a = Pattern(9), b = Pattern(10);
  const Page sa = Seal(100, a);
  crypto_->EndWrite(100, true);
  const Page sb = Seal(100, b);
  EXPECT_TRUE(PageCrypto::InFlight(crypto_->Word(100)));
  EXPECT_TRUE(Opens(100, sa, a));
  EXPECT_TRUE(Opens(100, sb, b));
  crypto_->EndWrite(100, true);
  EXPECT_FALSE(PageCrypto::InFlight(crypto_->Word(100)));
  EXPECT_TRUE(Opens(100, sb, b));
  EXPECT_FALSE(Opens(100, sa, a));
}

TEST_F(PageCryptoTest, ANeverWrittenPageAndAnotherPagesCiphertextDoNotOpen) {
  const Page a = Pattern(5);
  const Page sa = Seal(1, a);
  crypto_->EndWrite(1, true);
  EXPECT_FALSE(Opens(2, sa, a)) << "never sealed";
  const Page sb = Seal(2, Pattern(6));
  crypto_->EndWrite(2, true);
  EXPECT_FALSE(Opens(2, sa, a)) << "page 1's ciphertext moved to page 2";
  (void)sb;
}

TEST_F(PageCryptoTest, RepeatedFailuresKeepABoundedNumberOfAlternatives) {
  const Page a = Pattern(0x11);
  const Page sa = Seal(9, a);
  crypto_->EndWrite(9, true);
  Page last;
  for (int i = 0; i < 100; ++i) {
    last = Seal(9, Pattern(static_cast<uint8_t>(i)));
    crypto_->EndWrite(9, false);
  }
  EXPECT_TRUE(Opens(9, sa, a)) << "the acknowledged version is never dropped";
  EXPECT_TRUE(Opens(9, last, Pattern(99)));
}

TEST_F(PageCryptoTest, PagesOfOneStripeSettleInAnyOrder) {
  // Pages 0..7 and 2048 share a lock stripe (8 consecutive pages in every 2048 do): all in flight
  // at once, then acknowledged out of order, each must open with its own version only.
  const std::array<uint64_t, 9> pages = {0, 1, 2, 3, 4, 5, 6, 7, 2048};
  std::array<Page, 9> first, second;
  for (size_t i = 0; i < pages.size(); ++i) {
    first[i] = Seal(pages[i], Pattern(static_cast<uint8_t>(i)));
    crypto_->EndWrite(pages[i], true);
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    second[i] = Seal(pages[i], Pattern(static_cast<uint8_t>(100 + i)));
  }
  for (size_t i : {3, 0, 8, 7, 1}) crypto_->EndWrite(pages[i], true);
  for (size_t i : {2, 6}) crypto_->EndWrite(pages[i], false);
  for (size_t i = 0; i < pages.size(); ++i) {
    const Page want_new = Pattern(static_cast<uint8_t>(100 + i));
    const Page want_old = Pattern(static_cast<uint8_t>(i));
    EXPECT_TRUE(Opens(pages[i], second[i], want_new)) << "page " << pages[i];
    const bool acked = i == 3 || i == 0 || i == 8 || i == 7 || i == 1;
    EXPECT_EQ(Opens(pages[i], first[i], want_old), !acked)
        << "page " << pages[i] << ": the old version opens only while the new one is unsettled";
  }
  for (size_t i : {4, 5}) crypto_->EndWrite(pages[i], true);
  EXPECT_FALSE(Opens(pages[4], first[4], Pattern(4)));
  EXPECT_TRUE(Opens(pages[5], second[5], Pattern(105)));
}

TEST_F(PageCryptoTest, WritesAndReadsAllocateNothingOnceWarm) {
  Page plain = Pattern(0x42), out;
  auto cycle = [&](uint64_t page) {
    ASSERT_TRUE(crypto_->Seal(*cipher_, page, plain.data(), out.data()).ok());
    crypto_->EndWrite(page, true);
    ASSERT_TRUE(crypto_->Open(*cipher_, page, out.data()).ok());
  };
  for (uint64_t p = 0; p < 1024; ++p) cycle(p);  // the table's chunk and each stripe's entries
  // The page write and read paths must not allocate per page (issue 16: per-write map nodes and
  // vectors cost more than the bookkeeping they hold). This binary counts every operator new
  // (tests/support/counting_new.h).
  const long before = testing::AllocationCount();
  for (int round = 0; round < 4; ++round) {
    for (uint64_t p = 0; p < 1024; ++p) cycle((p * 37) % 1024);
  }
  EXPECT_EQ(testing::AllocationCount() - before, 0);
}

}  // namespace
}  // namespace farmem::blockdev
