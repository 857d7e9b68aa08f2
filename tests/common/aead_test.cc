// AES-256-GCM of the data on lenders (common/aead.h), by intel-ipsec-mb and by OpenSSL: known
// answers from the GCM specification, each opens what the other sealed, every tampering is
// refused with DataLoss and leaves no plaintext, FARMEM_AEAD_IMPL chooses and refuses junk, key
// files are strict.
#include "farmem/common/aead.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "farmem/common/auth.h"

namespace farmem::aead {
namespace {

std::string ToHex(std::span<const uint8_t> b) { return auth::EncodeHex(b); }

// Both implementations (intel-ipsec-mb and OpenSSL) run every test; ipsec-mb's are skipped where
// the library finds no architecture it can run on (not where it merely lacks AES-NI: its
// software AES must still be right).
std::string ImplParamName(const testing::TestParamInfo<Impl>& info) {
  return info.param == Impl::kIpsecMb ? "IpsecMb" : "OpenSsl";
}
#define FARMEM_SKIP_IF_UNUSABLE(impl)                      \
  if ((impl) == Impl::kIpsecMb && IpsecMbArch() == "none") \
  GTEST_SKIP() << "intel-ipsec-mb finds no CPU architecture it can run on here (arch none)"

std::vector<uint8_t> FromHex(std::string_view hex) {
  auto b = auth::DecodeHex(hex);
  EXPECT_TRUE(b.has_value()) << hex;
  return b ? std::vector<uint8_t>(b->begin(), b->end()) : std::vector<uint8_t>{};
}

class AeadImplTest : public testing::TestWithParam<Impl> {};
INSTANTIATE_TEST_SUITE_P(Both, AeadImplTest, testing::Values(Impl::kIpsecMb, Impl::kOpenSsl),
                         ImplParamName);

// McGrew & Viega, "The Galois/Counter Mode of Operation", test cases 13 and 14 (256-bit key of
// zeros, 96-bit IV of zeros) and 16 (60 bytes, not a multiple of the block, with 20 bytes of AAD).
TEST_P(AeadImplTest, KnownAnswersFromTheGcmSpecification) {
  FARMEM_SKIP_IF_UNUSABLE(GetParam());
  Key zero{};
  auto c = Cipher::Create(zero, GetParam());
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_EQ(c->impl(), GetParam());
  Tag tag{};
  std::vector<uint8_t> none;
  ASSERT_TRUE(c->Seal(Nonce{}, {}, none, none, &tag).ok());
  EXPECT_EQ(ToHex(tag), "530f8afbc74536b9a963b4f1c4cb738b");
  ASSERT_TRUE(c->Open(Nonce{}, {}, none, none, tag).ok());
  std::vector<uint8_t> block(16, 0);
  ASSERT_TRUE(c->Seal(Nonce{}, {}, block, block, &tag).ok());  // in place
  EXPECT_EQ(ToHex(block), "cea7403d4d606b6e074ec5d3baf39d18");
  EXPECT_EQ(ToHex(tag), "d0d1c8a799996bf0265b98b5d48ab919");
  ASSERT_TRUE(c->Open(Nonce{}, {}, block, block, tag).ok());
  EXPECT_EQ(block, std::vector<uint8_t>(16, 0));

  const auto key16 = FromHex("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308");
  Key k{};
  ASSERT_EQ(key16.size(), k.size());
  std::copy(key16.begin(), key16.end(), k.begin());
  auto c16 = Cipher::Create(k, GetParam());
  ASSERT_TRUE(c16.has_value());
  const auto iv = FromHex("cafebabefacedbaddecaf888");
  Nonce n{};
  std::copy(iv.begin(), iv.end(), n.begin());
  const auto aad = FromHex("feedfacedeadbeeffeedfacedeadbeefabaddad2");
  const auto plain = FromHex(
      "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449"
      "a6b525b16aedf5aa0de657ba637b39");
  std::vector<uint8_t> sealed(plain.size());
  ASSERT_TRUE(c16->Seal(n, aad, plain, sealed, &tag).ok());
  EXPECT_EQ(ToHex(sealed),
            "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b"
            "1056828838c5f61e6393ba7a0abcc9f662");
  EXPECT_EQ(ToHex(tag), "76fc6ece0f4e1768cddf8853bb2d551b");
  std::vector<uint8_t> out(plain.size());
  ASSERT_TRUE(c16->Open(n, aad, sealed, out, tag).ok());
  EXPECT_EQ(out, plain);
}

// What one implementation seals the other opens, to the byte (the lenders' data does not depend
// on which ran), at sizes around the block and the page.
TEST(AeadCrossTest, EachOpensWhatTheOtherSealed) {
  FARMEM_SKIP_IF_UNUSABLE(Impl::kIpsecMb);
  auto k = GenerateKey();
  ASSERT_TRUE(k.has_value());
  auto imb = Cipher::Create(*k, Impl::kIpsecMb);
  auto ossl = Cipher::Create(*k, Impl::kOpenSsl);
  ASSERT_TRUE(imb.has_value() && ossl.has_value());
  const std::vector<uint8_t> aad = {9, 8, 7, 6, 5};
  for (size_t size : {size_t{0}, size_t{1}, size_t{511}, size_t{4096}, size_t{16 * 1024 + 3}}) {
    SCOPED_TRACE(size);
    std::vector<uint8_t> plain(size);
    for (size_t i = 0; i < size; ++i) plain[i] = static_cast<uint8_t>(i * 31 + size);
    const Nonce n = MakeNonce(3, size);
    std::vector<uint8_t> by_imb(size), by_ossl(size);
    Tag tag_imb{}, tag_ossl{};
    ASSERT_TRUE(imb->Seal(n, aad, plain, by_imb, &tag_imb).ok());
    ASSERT_TRUE(ossl->Seal(n, aad, plain, by_ossl, &tag_ossl).ok());
    EXPECT_EQ(by_imb, by_ossl);
    EXPECT_EQ(tag_imb, tag_ossl);
    std::vector<uint8_t> out(size, 0xAA);
    ASSERT_TRUE(ossl->Open(n, aad, by_imb, out, tag_imb).ok());
    EXPECT_EQ(out, plain);
    std::fill(out.begin(), out.end(), 0xAA);
    ASSERT_TRUE(imb->Open(n, aad, by_ossl, out, tag_ossl).ok());
    EXPECT_EQ(out, plain);
    // And in place, the way the page store decrypts.
    std::vector<uint8_t> inplace = by_ossl;
    ASSERT_TRUE(imb->Open(n, aad, inplace, inplace, tag_ossl).ok());
    EXPECT_EQ(inplace, plain);
  }
}

// A scoped FARMEM_AEAD_IMPL.
class ImplEnv {
 public:
  explicit ImplEnv(const char* value) {
    const char* old = std::getenv("FARMEM_AEAD_IMPL");
    if (old != nullptr) old_ = old;
    if (value == nullptr) {
      ::unsetenv("FARMEM_AEAD_IMPL");
    } else {
      ::setenv("FARMEM_AEAD_IMPL", value, 1);
    }
  }
  ~ImplEnv() {
    if (old_) {
      ::setenv("FARMEM_AEAD_IMPL", old_->c_str(), 1);
    } else {
      ::unsetenv("FARMEM_AEAD_IMPL");
    }
  }

 private:
  std::optional<std::string> old_;
};

TEST(AeadChoiceTest, AutoIsIpsecMbWhereTheCpuHasAesNi) {
  ImplEnv unset(nullptr);
  if (!IpsecMbHasAesNi()) {
    GTEST_SKIP() << "this CPU has no AES-NI for intel-ipsec-mb (arch " << IpsecMbArch()
                 << "): auto is OpenSSL here";
  }
  auto impl = ChosenImpl();
  ASSERT_TRUE(impl.has_value());
  EXPECT_EQ(*impl, Impl::kIpsecMb);
  auto c = Cipher::Create(Key{});
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->impl(), Impl::kIpsecMb);
  auto clone = c->Clone();
  ASSERT_TRUE(clone.has_value());
  EXPECT_EQ(clone->impl(), Impl::kIpsecMb);
  EXPECT_NE(DescribeChosenImpl().find("AES-256-GCM by ipsec-mb"), std::string::npos)
      << DescribeChosenImpl();
  ImplEnv empty("auto");
  EXPECT_EQ(ChosenImpl().value_or(Impl::kOpenSsl), Impl::kIpsecMb);
}

TEST(AeadChoiceTest, TheEnvironmentForcesOneAndRefusesOtherValues) {
  {
    ImplEnv e("openssl");
    auto c = Cipher::Create(Key{});
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->impl(), Impl::kOpenSsl);
    EXPECT_EQ(c->Clone()->impl(), Impl::kOpenSsl);
    EXPECT_NE(DescribeChosenImpl().find("by openssl (FARMEM_AEAD_IMPL=openssl"), std::string::npos)
        << DescribeChosenImpl();
  }
  if (IpsecMbArch() != "none") {
    ImplEnv e("ipsec-mb");
    auto c = Cipher::Create(Key{});
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->impl(), Impl::kIpsecMb);
  }
  for (const char* bad : {"OpenSSL", "aesni", "ipsec_mb"}) {
    ImplEnv e(bad);
    auto c = Cipher::Create(Key{});
    ASSERT_FALSE(c.has_value()) << bad;
    EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.error().message().find("accepted values are auto"), std::string::npos)
        << c.error().ToString();
    EXPECT_NE(c.error().message().find("openssl and ipsec-mb"), std::string::npos);
  }
}

class AeadTamperTest : public testing::TestWithParam<Impl> {
 protected:
  void SetUp() override {
    FARMEM_SKIP_IF_UNUSABLE(GetParam());
    auto k = GenerateKey();
    ASSERT_TRUE(k.has_value());
    key_ = *k;
    auto c = Cipher::Create(key_, GetParam());
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
    EXPECT_NE(s.message().find("failed authentication (AES-GCM tag mismatch)"), std::string::npos)
        << s.ToString();
    EXPECT_EQ(out, std::vector<uint8_t>(data.size(), 0));
  }
  Key key_{};
  std::optional<Cipher> cipher_;
  Nonce nonce_ = MakeNonce(7, 0x0102030405060708ull);
  std::vector<uint8_t> aad_ = {1, 2, 3};
  std::vector<uint8_t> plain_, sealed_;
  Tag tag_{};
};
INSTANTIATE_TEST_SUITE_P(Both, AeadTamperTest, testing::Values(Impl::kIpsecMb, Impl::kOpenSsl),
                         ImplParamName);

TEST_P(AeadTamperTest, RoundTripsAndHidesThePlaintext) {
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
  // A clone decrypts too (same key, own contexts), and so does a moved-to cipher.
  auto clone = cipher_->Clone();
  ASSERT_TRUE(clone.has_value());
  EXPECT_EQ(clone->impl(), GetParam());
  ASSERT_TRUE(clone->Open(nonce_, aad_, sealed_, out, tag_).ok());
  EXPECT_EQ(out, plain_);
  Cipher moved = std::move(*clone);
  ASSERT_TRUE(moved.Open(nonce_, aad_, sealed_, out, tag_).ok());
  EXPECT_EQ(out, plain_);
}

TEST_P(AeadTamperTest, EveryTamperingIsRefused) {
  for (size_t bit : {0ul, 8ul * 2048 + 5, 8ul * 4095 + 7}) {
    std::vector<uint8_t> flipped = sealed_;
    flipped[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ExpectRefused(nonce_, aad_, flipped, tag_);
  }
  for (size_t bit : {0ul, 64ul, 127ul}) {
    Tag bad_tag = tag_;
    bad_tag[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ExpectRefused(nonce_, aad_, sealed_, bad_tag);
  }
  ExpectRefused(MakeNonce(7, 0x0102030405060709ull), aad_, sealed_, tag_);  // another version
  ExpectRefused(MakeNonce(8, 0x0102030405060708ull), aad_, sealed_, tag_);  // another domain
  const std::vector<uint8_t> other_aad = {1, 2, 4};
  ExpectRefused(nonce_, other_aad, sealed_, tag_);
  ExpectRefused(nonce_, {}, sealed_, tag_);  // the AAD dropped
  // A truncated message.
  ExpectRefused(nonce_, aad_, std::span<const uint8_t>(sealed_).first(4095), tag_);
  // Another key.
  auto k2 = GenerateKey();
  ASSERT_TRUE(k2.has_value());
  ASSERT_NE(*k2, key_);
  auto c2 = Cipher::Create(*k2, GetParam());
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
