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

// ---- identities ----

// HKDF-SHA256 per RFC 5869 (no salt: a zero-filled HashLen salt), computed here from HMAC alone.
std::string DocumentedClientKey(std::string_view secret, std::string_view name) {
  unsigned char prk[32], okm[32];
  unsigned int len = 0;
  const unsigned char zeros[32] = {};
  HMAC(EVP_sha256(), zeros, sizeof(zeros), reinterpret_cast<const unsigned char*>(secret.data()),
       secret.size(), prk, &len);
  std::string info = "farmem client key v1";
  info.append(name);
  info.push_back('\x01');
  HMAC(EVP_sha256(), prk, sizeof(prk), reinterpret_cast<const unsigned char*>(info.data()),
       info.size(), okm, &len);
  return std::string(reinterpret_cast<char*>(okm), sizeof(okm));
}

TEST(ClientKey, IsTheDocumentedHkdfOfTheSecretAndTheName) {
  EXPECT_EQ(ClientKey("the cluster secret", "alice"),
            DocumentedClientKey("the cluster secret", "alice"));
  EXPECT_EQ(ClientKey("the cluster secret", "alice").size(), kClientKeyBytes);
  EXPECT_NE(ClientKey("the cluster secret", "alice"), ClientKey("the cluster secret", "alicf"));
  EXPECT_NE(ClientKey("the cluster secret", "alice"), ClientKey("the cluster secreu", "alice"));
  // The built-in identity is the cluster secret itself.
  EXPECT_EQ(ClientKey("the cluster secret", "cluster"), "the cluster secret");
  EXPECT_EQ(ClientKey("the cluster secret", ""), "the cluster secret");
}

TEST(ClientKey, NamedProofBindsTheNameAndClusterProofIsTheV1One) {
  const Inputs in = SampleInputs();
  const std::string key = ClientKey("s3cret-s3cret-s3cret", "alice");
  const wire::Mac a = ClientProof(key, in.server_nonce, in.client_nonce, in.client_id, "alice");
  EXPECT_NE(a, ClientProof(key, in.server_nonce, in.client_nonce, in.client_id, "alicf"));
  EXPECT_NE(a, ClientProof(key, in.server_nonce, in.client_nonce, in.client_id));
  EXPECT_NE(a, ServerProof(key, in.server_nonce, in.client_nonce, in.client_id, "alice"));
  EXPECT_EQ(ClientProof("s3cret", in.server_nonce, in.client_nonce, in.client_id, "cluster"),
            DocumentedProof("farmem-auth-v1 client", "s3cret", in));
}

TEST(LeaseOwner, DependsOnNameAndClientId) {
  wire::ClientId a{}, b{};
  b[0] = 1;
  EXPECT_NE(LeaseOwner("alice", a), LeaseOwner("bob", a));
  EXPECT_NE(LeaseOwner("alice", a), LeaseOwner("alice", b));
  EXPECT_EQ(LeaseOwner("alice", a), LeaseOwner("alice", a));
  EXPECT_EQ(LeaseOwner("", a), LeaseOwner("cluster", a));
  // Length-prefixed: moving bytes between name and id does not collide.
  EXPECT_NE(LeaseOwner("ab", a), LeaseOwner("a", a));
}

TEST(ValidateIdentity, AcceptsNamesAndRefusesTheRest) {
  for (const char* ok : {"alice", "team-7.prod", "svc_a@eu-west", "X"}) {
    EXPECT_TRUE(ValidateIdentity(ok).ok()) << ok;
  }
  for (std::string bad : {std::string(""), std::string(65, 'a'), std::string("a b"),
                          std::string("a/b"), std::string("a\nb"), std::string("\xff")}) {
    EXPECT_EQ(ValidateIdentity(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
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
  // n 'x' and a newline (not `std::string(n, 'x') + "\n"`: GCC 12 at -O1 warns about that
  // expression with a false -Warray-bounds inside char_traits).
  auto line_of = [](size_t n) {
    std::string s(n + 1, 'x');
    s.back() = '\n';
    return s;
  };
  for (const std::string& content :
       {std::string("s"), std::string("s\n"), line_of(kMinSecretBytes - 1)}) {
    const std::string path = Write("short", content);
    auto r = LoadSecretFile(path);
    ASSERT_FALSE(r.has_value()) << content;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.error().message(), HasSubstr("at least 16"));
    EXPECT_THAT(r.error().message(), HasSubstr("head -c 32 /dev/urandom | base64 > " + path));
  }
  auto ok = LoadSecretFile(Write("sixteen", line_of(kMinSecretBytes)));
  ASSERT_TRUE(ok.has_value()) << ok.error().ToString();
  EXPECT_EQ(ok->size(), kMinSecretBytes);
}

}  // namespace
}  // namespace farmem::auth

namespace farmem::auth {
namespace {

TEST_F(SecretFileTest, KeyFileRoundTripsAndIsCheckedLikeASecretFile) {
  const std::string key = ClientKey("the cluster secret", "alice");
  const std::string path = Write("alice.key", FormatClientKeyFile({"alice", key}));
  auto k = LoadClientKeyFile(path);
  ASSERT_TRUE(k.has_value()) << k.error().ToString();
  EXPECT_EQ(k->identity, "alice");
  EXPECT_EQ(k->key, key);

  const std::string loose = Write("loose.key", FormatClientKeyFile({"alice", key}), 0640);
  auto l = LoadClientKeyFile(loose);
  ASSERT_FALSE(l.has_value());
  EXPECT_THAT(l.error().message(), HasSubstr("chmod 600"));

  auto short_key = LoadClientKeyFile(
      Write("short.key", "name alice\nkey 00112233445566778899aabbccddee\n"));  // 15 bytes
  ASSERT_FALSE(short_key.has_value());
  EXPECT_THAT(short_key.error().message(), HasSubstr("at least 16"));
  auto bad_name = LoadClientKeyFile(
      Write("bad.key",
            "name a b\nkey 00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n"));
  ASSERT_FALSE(bad_name.has_value());
  EXPECT_THAT(bad_name.error().message(), HasSubstr("identity name"));
  auto not_hex = LoadClientKeyFile(
      Write("hex.key",
            "name alice\nkey zz112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n"));
  ASSERT_FALSE(not_hex.has_value());
  EXPECT_THAT(not_hex.error().message(), HasSubstr("hexadecimal"));
}

TEST_F(SecretFileTest, ClientCredentialsAreTheSecretOrAKeyNeverBoth) {
  const std::string secret = Write("secret", kSecret);
  const std::string key = Write("k", FormatClientKeyFile({"bob", ClientKey(kSecret, "bob")}));
  auto s = LoadClientCredentials(secret, "");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->identity, "");
  EXPECT_EQ(s->key, kSecret);
  auto k = LoadClientCredentials("", key);
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->identity, "bob");
  EXPECT_FALSE(LoadClientCredentials(secret, key).has_value());
  auto none = LoadClientCredentials("", "");
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->key.empty());
}

}  // namespace
}  // namespace farmem::auth
