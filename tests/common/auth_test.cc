// Shared-secret authentication (docs/wire-protocol.md, "AUTH"): the proofs are the documented
// HMACs, bind every input, differ between the two directions; secret files are read strictly.
#include "farmem/common/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/process.h"

namespace farmem::auth {
namespace {

using ::testing::HasSubstr;

struct Inputs {
  wire::Nonce server_nonce{};
  wire::Nonce client_nonce{};
  wire::ClientId client_id{};
};

Inputs SampleInputs() {
  Inputs in;
  for (size_t i = 0; i < in.server_nonce.size(); ++i) {
    in.server_nonce[i] = static_cast<uint8_t>(i);
    in.client_nonce[i] = static_cast<uint8_t>(0x80 + i);
  }
  for (size_t i = 0; i < in.client_id.size(); ++i) in.client_id[i] = static_cast<uint8_t>(7 * i);
  return in;
}

// The document's formula, computed here independently of auth.cc.
wire::Mac DocumentedProof(std::string_view label, std::string_view secret, const Inputs& in) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(in.server_nonce.data()), in.server_nonce.size());
  msg.append(reinterpret_cast<const char*>(in.client_nonce.data()), in.client_nonce.size());
  msg.append(reinterpret_cast<const char*>(in.client_id.data()), in.client_id.size());
  wire::Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac.data(), &len);
  EXPECT_EQ(len, wire::kMacSize);
  return mac;
}

TEST(AuthProof, MatchesTheDocumentedHmac) {
  const Inputs in = SampleInputs();
  EXPECT_EQ(ClientProof("s3cret", in.server_nonce, in.client_nonce, in.client_id),
            DocumentedProof("farmem-auth-v1 client", "s3cret", in));
  EXPECT_EQ(ServerProof("s3cret", in.server_nonce, in.client_nonce, in.client_id),
            DocumentedProof("farmem-auth-v1 server", "s3cret", in));
}

TEST(AuthProof, ClientAndServerProofsDiffer) {
  // Otherwise a daemon could answer AUTH by echoing the client's proof without the secret.
  const Inputs in = SampleInputs();
  EXPECT_NE(ClientProof("s", in.server_nonce, in.client_nonce, in.client_id),
            ServerProof("s", in.server_nonce, in.client_nonce, in.client_id));
}

TEST(AuthProof, IsDeterministicAndBindsEveryInput) {
  const Inputs in = SampleInputs();
  const wire::Mac base = ClientProof("secret", in.server_nonce, in.client_nonce, in.client_id);
  EXPECT_EQ(base, ClientProof("secret", in.server_nonce, in.client_nonce, in.client_id));
  EXPECT_NE(base, ClientProof("secreT", in.server_nonce, in.client_nonce, in.client_id));
  EXPECT_NE(base, ClientProof("secret ", in.server_nonce, in.client_nonce, in.client_id));
  Inputs changed = in;
  changed.server_nonce[31] ^= 1;
  EXPECT_NE(base, ClientProof("secret", changed.server_nonce, in.client_nonce, in.client_id));
  changed = in;
  changed.client_nonce[0] ^= 0x80;
  EXPECT_NE(base, ClientProof("secret", in.server_nonce, changed.client_nonce, in.client_id));
  changed = in;
  changed.client_id[15] ^= 4;
  EXPECT_NE(base, ClientProof("secret", in.server_nonce, in.client_nonce, changed.client_id));
  // Swapping the nonces (a reflection) gives a different proof.
  EXPECT_NE(base, ClientProof("secret", in.client_nonce, in.server_nonce, in.client_id));
}

TEST(AuthProof, SecretsWithZeroBytesAndLongSecretsWork) {
  const Inputs in = SampleInputs();
  const std::string with_nul("ab\0cd", 5);
  const std::string truncated("ab", 2);
  EXPECT_NE(ClientProof(with_nul, in.server_nonce, in.client_nonce, in.client_id),
            ClientProof(truncated, in.server_nonce, in.client_nonce, in.client_id));
  const std::string long_secret(4096, 'k');  // longer than the HMAC block: hashed first
  EXPECT_EQ(ClientProof(long_secret, in.server_nonce, in.client_nonce, in.client_id),
            DocumentedProof("farmem-auth-v1 client", long_secret, in));
}

TEST(AuthMacEqual, ComparesEveryByte) {
  wire::Mac a{};
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 13);
  wire::Mac b = a;
  EXPECT_TRUE(MacEqual(a, b));
  for (size_t i = 0; i < a.size(); ++i) {
    b = a;
    b[i] ^= 0x01;
    EXPECT_FALSE(MacEqual(a, b)) << i;
  }
  EXPECT_TRUE(MacEqual(wire::Mac{}, wire::Mac{}));
}

TEST(AuthRandomBytes, FillsWithFreshBytes) {
  wire::Nonce a{}, b{};
  ASSERT_TRUE(RandomBytes(a).ok());
  ASSERT_TRUE(RandomBytes(b).ok());
  EXPECT_NE(a, b);
  EXPECT_NE(a, wire::Nonce{});
  std::vector<uint8_t> empty;
  EXPECT_TRUE(RandomBytes(empty).ok());
}

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok()) << tmp_.status().ToString();
    dir_ = tmp_.path();
  }

  std::string Write(const std::string& name, const std::string& content, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    ::chmod(path.c_str(), mode);
    return path;
  }

  farmem::testing::TempDir tmp_{"farmem-auth-test"};  // removed with its files
  std::string dir_;
};

constexpr char kSecret[] = "hunter2-hunter2-hunter2";  // 23 bytes: long enough

TEST_F(SecretFileTest, StripsOneTrailingNewline) {
  const std::string s = kSecret;
  EXPECT_EQ(LoadSecretFile(Write("a", s)).value_or("?"), s);
  EXPECT_EQ(LoadSecretFile(Write("b", s + "\n")).value_or("?"), s);
  EXPECT_EQ(LoadSecretFile(Write("c", s + "\r\n")).value_or("?"), s);
  EXPECT_EQ(LoadSecretFile(Write("d", s + "\n\n")).value_or("?"), s + "\n");
  EXPECT_EQ(LoadSecretFile(Write("e", " spaces kept " + s)).value_or("?"), " spaces kept " + s);
}

TEST_F(SecretFileTest, KeepsBinaryContent) {
  const std::string binary("\x00\x01\xff\n\x7f\x00\x01\xff\n\x7f\x00\x01\xff\n\x7f\x00", 16);
  auto r = LoadSecretFile(Write("bin", binary + "\n"));
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(*r, binary);
}

TEST_F(SecretFileTest, AcceptsUpTo4096Bytes) {
  auto r = LoadSecretFile(Write("max", std::string(4096, 'x')));
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(r->size(), 4096u);
}

TEST_F(SecretFileTest, MissingFileIsNotFoundAndNamesThePath) {
  const std::string path = dir_ + "/does-not-exist";
  auto r = LoadSecretFile(path);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.error().message(), HasSubstr(path));
}

TEST_F(SecretFileTest, RejectsEmptyBlankAndOversizedFiles) {
  for (const auto& [name, content] : std::vector<std::pair<std::string, std::string>>{
           {"empty", ""}, {"newline", "\n"}, {"crlf", "\r\n"}, {"big", std::string(4097, 'x')}}) {
    const std::string path = Write(name, content);
    auto r = LoadSecretFile(path);
    ASSERT_FALSE(r.has_value()) << name;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(r.error().message(), HasSubstr(path)) << name;
  }
}

TEST_F(SecretFileTest, UnreadableFileFails) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files whatever their mode";
  auto r = LoadSecretFile(Write("locked", kSecret, 0000));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kIoError);
}

// Regression (issue 11, defect 4): a world-readable secret file only earned a warning.
TEST_F(SecretFileTest, GroupOrOtherAccessIsRefusedWithTheChmodThatFixesIt) {
  for (mode_t mode : {0644, 0640, 0604, 0620, 0602, 0610, 0601, 0660, 0666}) {
    const std::string path = Write("loose", kSecret, mode);
    auto r = LoadSecretFile(path);
    ASSERT_FALSE(r.has_value()) << std::oct << mode;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.error().message(), HasSubstr("chmod 600 " + path)) << std::oct << mode;
  }
  EXPECT_TRUE(LoadSecretFile(Write("owner-only", kSecret, 0400)).has_value());
  EXPECT_TRUE(LoadSecretFile(Write("owner-rw", kSecret, 0600)).has_value());
}

// Regression (issue 11, defect 4): a 1-byte secret was accepted.
TEST_F(SecretFileTest, ShortSecretIsRefusedWithTheCommandThatMakesAGoodOne) {
  for (const std::string& content :
       {std::string("s"), std::string("s\n"), std::string(kMinSecretBytes - 1, 'x') + "\n"}) {
    const std::string path = Write("short", content);
    auto r = LoadSecretFile(path);
    ASSERT_FALSE(r.has_value()) << content;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.error().message(), HasSubstr("at least 16"));
    EXPECT_THAT(r.error().message(), HasSubstr("head -c 32 /dev/urandom | base64 > " + path));
  }
  auto ok = LoadSecretFile(Write("sixteen", std::string(kMinSecretBytes, 'x') + "\n"));
  ASSERT_TRUE(ok.has_value()) << ok.error().ToString();
  EXPECT_EQ(ok->size(), kMinSecretBytes);
}

}  // namespace
}  // namespace farmem::auth
