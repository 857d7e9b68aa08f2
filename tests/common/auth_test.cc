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
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/farmem-auth-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& content, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    ::chmod(path.c_str(), mode);
    return path;
  }

  std::string dir_;
};

TEST_F(SecretFileTest, StripsOneTrailingNewline) {
  EXPECT_EQ(LoadSecretFile(Write("a", "hunter2")).value_or("?"), "hunter2");
  EXPECT_EQ(LoadSecretFile(Write("b", "hunter2\n")).value_or("?"), "hunter2");
  EXPECT_EQ(LoadSecretFile(Write("c", "hunter2\r\n")).value_or("?"), "hunter2");
  EXPECT_EQ(LoadSecretFile(Write("d", "hunter2\n\n")).value_or("?"), "hunter2\n");
  EXPECT_EQ(LoadSecretFile(Write("e", " spaces kept ")).value_or("?"), " spaces kept ");
}

TEST_F(SecretFileTest, KeepsBinaryContent) {
  const std::string binary("\x00\x01\xff\n\x7f", 5);
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
  auto r = LoadSecretFile(Write("locked", "secret", 0000));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kIoError);
}

TEST_F(SecretFileTest, LooseModeStillLoads) {
  // Group/other access earns a warning in the log, not a failure.
  EXPECT_EQ(LoadSecretFile(Write("loose", "s", 0644)).value_or("?"), "s");
}

}  // namespace
}  // namespace farmem::auth
