// A failed write leaves its page readable (issue 11, none-gray-stop): the remote copy of a page
// whose write failed holds the version before it or the failed one (a write can reach a paused
// lender and be applied after its op timed out, or never), and NBD leaves a failed write's range
// unspecified, not unreadable. Before the fix, Seal's new (counter, tag) replaced the page's entry
// for good, so the old ciphertext that stayed on the lender failed authentication: a whole
// none-gray-stop run lost 7 MiB this way.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "page_crypto.h"

namespace farmem::blockdev {
namespace {

std::vector<uint8_t> Page(uint8_t fill) { return std::vector<uint8_t>(4096, fill); }

class PageCryptoFailedWriteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    aead::Key key{};
    for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(i * 7 + 1);
    auto c = PageCrypto::Create(key, 64);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    crypto_ = std::move(*c);
    auto cipher = crypto_->NewCipher();
    ASSERT_TRUE(cipher.has_value());
    cipher_.emplace(std::move(*cipher));
  }
  // Seals `plain` as the next version of `page`, ends the write as `written`: the ciphertext.
  std::vector<uint8_t> Write(uint64_t page, const std::vector<uint8_t>& plain, bool written) {
    std::vector<uint8_t> out(4096);
    EXPECT_TRUE(crypto_->Seal(*cipher_, page, plain.data(), out.data()).ok());
    crypto_->EndWrite(page, written);
    return out;
  }
  // Whether `stored` opens as page `page`, to `want`.
  bool Opens(uint64_t page, std::vector<uint8_t> stored, const std::vector<uint8_t>& want) {
    if (!crypto_->Open(*cipher_, page, stored.data()).ok()) return false;
    return stored == want;
  }
  std::unique_ptr<PageCrypto> crypto_;
  std::optional<aead::Cipher> cipher_;
};

TEST_F(PageCryptoFailedWriteTest, PageReadsAsEitherVersionUntilAWriteSucceeds) {
  const auto v1 = Page(1), v2 = Page(2), v3 = Page(3), v4 = Page(4);
  const auto c1 = Write(5, v1, true);
  ASSERT_TRUE(Opens(5, c1, v1));
  // v2 fails: the lender holds c1 (never reached it) or c2 (applied late). Both read.
  const auto c2 = Write(5, v2, false);
  EXPECT_TRUE(Opens(5, c1, v1)) << "the version before a failed write no longer reads";
  EXPECT_TRUE(Opens(5, c2, v2));
  // Another failed write: any of the three.
  const auto c3 = Write(5, v3, false);
  EXPECT_TRUE(Opens(5, c1, v1));
  EXPECT_TRUE(Opens(5, c2, v2));
  EXPECT_TRUE(Opens(5, c3, v3));
  // A write that succeeds settles the page: only its version reads; old ones are replays.
  const auto c4 = Write(5, v4, true);
  EXPECT_TRUE(Opens(5, c4, v4));
  EXPECT_FALSE(Opens(5, c1, v1));
  EXPECT_FALSE(Opens(5, c2, v2));
  EXPECT_FALSE(Opens(5, c3, v3));
  // Other pages never took part; a ciphertext cannot move to another page.
  EXPECT_FALSE(Opens(6, c4, v4));
}

TEST_F(PageCryptoFailedWriteTest, SuccessfulWritesKeepReplayProtection) {
  const auto v1 = Page(9), v2 = Page(10);
  const auto c1 = Write(7, v1, true);
  const auto c2 = Write(7, v2, true);
  EXPECT_TRUE(Opens(7, c2, v2));
  EXPECT_FALSE(Opens(7, c1, v1)) << "an old ciphertext replayed by a lender must fail";
}

}  // namespace
}  // namespace farmem::blockdev
