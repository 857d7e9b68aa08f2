// AES-256-GCM of the data on lenders (common/aead.h): known answers from the GCM specification,
// every tampering is refused with DataLoss and leaves no plaintext, key files are strict.
#include "farmem/common/aead.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "farmem/common/auth.h"

namespace farmem::aead {
namespace {

std::string ToHex(std::span<const uint8_t> b) { return auth::EncodeHex(b); }

// McGrew & Viega, "The Galois/Counter Mode of Operation", test cases 13 and 14 (256-bit key of
// zeros, 96-bit IV of zeros).
TEST(AeadTest, KnownAnswersFromTheGcmSpecification) {
  Key zero{};
  auto c = Cipher::Create(zero);
  ASSERT_TRUE(c.has_value());
  Tag tag{};
  std::vector<uint8_t> none;
  ASSERT_TRUE(c->Seal(Nonce{}, {}, none, none, &tag).ok());
  EXPECT_EQ(ToHex(tag), "530f8afbc74536b9a963b4f1c4cb738b");
  std::vector<uint8_t> block(16, 0);
  ASSERT_TRUE(c->Seal(Nonce{}, {}, block, block, &tag).ok());  // in place
  EXPECT_EQ(ToHex(block), "cea7403d4d606b6e074ec5d3baf39d18");
  EXPECT_EQ(ToHex(tag), "d0d1c8a799996bf0265b98b5d48ab919");
  ASSERT_TRUE(c->Open(Nonce{}, {}, block, block, tag).ok());
  EXPECT_EQ(block, std::vector<uint8_t>(16, 0));
}

class AeadTamperTest : public testing::Test {
 protected:
  void SetUp() override {
    auto k = GenerateKey();
    ASSERT_TRUE(k.has_value());
    key_ = *k;
    auto c = Cipher::Create(key_);
    ASSERT_TRUE(c.has_value());
    cipher_.emplace(std::move(*c));
    plain_.resize(4096);
    for (size_t i = 0; i < plain_.size(); ++i) plain_[i] = static_cast<uint8_t>(i * 7 + 3);
    sealed_.resize(plain_.size());
    ASSERT_TRUE(cipher_->Seal(nonce_, aad_, plain_, sealed_, &tag_).ok());
  }
  // Opens (nonce, aad, data, tag) and expects DataLoss with a zeroed output.
  void ExpectRefused(const Nonce& n, std::span<const uint8_t> aad, std::span<const uint8_t> data,
                     const Tag& tag) {
    std::vector<uint8_t> out(data.size(), 0xAA);
    const Status s = cipher_->Open(n, aad, data, out, tag);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
    EXPECT_EQ(out, std::vector<uint8_t>(data.size(), 0));
  }
  Key key_{};
  std::optional<Cipher> cipher_;
  Nonce nonce_ = MakeNonce(7, 0x0102030405060708ull);
  std::vector<uint8_t> aad_ = {1, 2, 3};
  std::vector<uint8_t> plain_, sealed_;
  Tag tag_{};
};

TEST_F(AeadTamperTest, RoundTripsAndHidesThePlaintext) {
  EXPECT_NE(sealed_, plain_);
  // No 16-byte run of the plaintext appears in the ciphertext.
  const std::string hay(sealed_.begin(), sealed_.end());
  for (size_t off = 0; off + 16 <= plain_.size(); off += 512) {
    EXPECT_EQ(hay.find(std::string(plain_.begin() + off, plain_.begin() + off + 16)),
              std::string::npos);
  }
  std::vector<uint8_t> out(plain_.size());
  ASSERT_TRUE(cipher_->Open(nonce_, aad_, sealed_, out, tag_).ok());
  EXPECT_EQ(out, plain_);
  // A clone decrypts too (same key, own contexts).
  auto clone = cipher_->Clone();
  ASSERT_TRUE(clone.has_value());
  ASSERT_TRUE(clone->Open(nonce_, aad_, sealed_, out, tag_).ok());
  EXPECT_EQ(out, plain_);
}

TEST_F(AeadTamperTest, EveryTamperingIsRefused) {
  for (size_t bit : {0ul, 8ul * 2048 + 5, 8ul * 4095 + 7}) {
    std::vector<uint8_t> flipped = sealed_;
    flipped[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ExpectRefused(nonce_, aad_, flipped, tag_);
  }
  Tag bad_tag = tag_;
  bad_tag[15] ^= 1;
  ExpectRefused(nonce_, aad_, sealed_, bad_tag);
  ExpectRefused(MakeNonce(7, 0x0102030405060709ull), aad_, sealed_, tag_);  // another version
  ExpectRefused(MakeNonce(8, 0x0102030405060708ull), aad_, sealed_, tag_);  // another domain
  const std::vector<uint8_t> other_aad = {1, 2, 4};
  ExpectRefused(nonce_, other_aad, sealed_, tag_);
  // Another key.
  auto k2 = GenerateKey();
  ASSERT_TRUE(k2.has_value());
  ASSERT_NE(*k2, key_);
  auto c2 = Cipher::Create(*k2);
  ASSERT_TRUE(c2.has_value());
  std::vector<uint8_t> out(sealed_.size());
  EXPECT_EQ(c2->Open(nonce_, aad_, sealed_, out, tag_).code(), StatusCode::kDataLoss);
  // The cipher still works after refusals.
  ASSERT_TRUE(cipher_->Open(nonce_, aad_, sealed_, out, tag_).ok());
  EXPECT_EQ(out, plain_);
}

TEST(AeadNonceTest, LayoutIsDomainThenValueBigEndian) {
  EXPECT_EQ(ToHex(MakeNonce(0x01020304u, 0x05060708090a0b0cull)), "0102030405060708090a0b0c");
  std::set<Nonce> seen;
  for (uint32_t d = 0; d < 4; ++d) {
    for (uint64_t x = 0; x < 256; ++x) EXPECT_TRUE(seen.insert(MakeNonce(d, x << 40 | x)).second);
  }
}

class DataKeyFileTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("farmem-aead-" + std::to_string(::getpid()) + "-" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const char* name) { return (dir_ / name).string(); }
  void WriteFile(const std::string& path, const std::string& text, mode_t mode) {
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
  }
  std::filesystem::path dir_;
};

TEST_F(DataKeyFileTest, CreatedOnceWithMode600AndLoadedBack) {
  bool created = false;
  auto k1 = LoadOrCreateDataKeyFile(Path("k"), &created);
  ASSERT_TRUE(k1.has_value()) << k1.error().ToString();
  EXPECT_TRUE(created);
  struct stat st {};
  ASSERT_EQ(::stat(Path("k").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto k2 = LoadOrCreateDataKeyFile(Path("k"), &created);
  ASSERT_TRUE(k2.has_value()) << k2.error().ToString();
  EXPECT_FALSE(created);
  EXPECT_EQ(*k1, *k2);
  // Never overwritten.
  const Status again = WriteDataKeyFile(Path("k"), Key{});
  EXPECT_FALSE(again.ok());
  auto k3 = LoadDataKeyFile(Path("k"));
  ASSERT_TRUE(k3.has_value());
  EXPECT_EQ(*k3, *k1);
}

TEST_F(DataKeyFileTest, BadFilesAreRefusedWithTheFix) {
  const std::string good = "data-key " + std::string(64, 'a') + "\n";
  WriteFile(Path("open"), good, 0644);
  auto r = LoadDataKeyFile(Path("open"));
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("chmod 600"), std::string::npos) << r.error().ToString();
  WriteFile(Path("short"), "data-key " + std::string(62, 'a') + "\n", 0600);
  r = LoadDataKeyFile(Path("short"));
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("32 hexadecimal bytes"), std::string::npos);
  WriteFile(Path("junk"), good + "more stuff here\n", 0600);
  EXPECT_FALSE(LoadDataKeyFile(Path("junk")).has_value());
  WriteFile(Path("twice"), good + good, 0600);
  EXPECT_FALSE(LoadDataKeyFile(Path("twice")).has_value());
  WriteFile(Path("nothex"), "data-key " + std::string(63, 'a') + "g\n", 0600);
  EXPECT_FALSE(LoadDataKeyFile(Path("nothex")).has_value());
  WriteFile(Path("ok"), "# comment\n" + good, 0600);
  auto ok = LoadDataKeyFile(Path("ok"));
  ASSERT_TRUE(ok.has_value()) << ok.error().ToString();
  EXPECT_EQ((*ok)[0], 0xaa);
}

TEST(HexTest, RoundTripsAndRefusesJunk) {
  const std::vector<uint8_t> b = {0x00, 0x7f, 0x80, 0xff};
  EXPECT_EQ(auth::EncodeHex(b), "007f80ff");
  auto back = auth::DecodeHex("007F80ff");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, std::string("\x00\x7f\x80\xff", 4));
  EXPECT_FALSE(auth::DecodeHex("abc").has_value());
  EXPECT_FALSE(auth::DecodeHex("zz").has_value());
}

}  // namespace
}  // namespace farmem::aead
