// Handshake (daemon/src/handshake.h), the HELLO/AUTH state machine the admission loop runs
// without a thread per connection: fed a byte at a time it waits, then admits; bytes after the
// authenticating frame are left for the connection; every way of breaking it is refused with one
// error reply.
#include "handshake.h"

#include <gtest/gtest.h>

#include "farmem/common/auth.h"
#include "farmem/common/version.h"
#include "support/raw_client.h"

namespace farmem::daemon {
namespace {

using testing::EncodeRawHeader;

std::vector<uint8_t> Frame(wire::Opcode op, const std::vector<uint8_t>& body, uint64_t id) {
  std::vector<uint8_t> f = EncodeRawHeader({.opcode = static_cast<uint8_t>(op),
                                            .request_id = id,
                                            .body_len = static_cast<uint32_t>(body.size())});
  f.insert(f.end(), body.begin(), body.end());
  return f;
}

// Splits `out` into frames (header + body) and decodes the headers.
std::vector<wire::FrameHeader> Replies(const std::vector<uint8_t>& out) {
  std::vector<wire::FrameHeader> hs;
  for (size_t at = 0; at + wire::kHeaderSize <= out.size();) {
    auto h = wire::DecodeHeader({out.data() + at, wire::kHeaderSize});
    EXPECT_TRUE(h.has_value());
    if (!h) break;
    hs.push_back(*h);
    at += wire::kHeaderSize + h->body_len;
  }
  return hs;
}

const std::string kSecret = "handshake-test-secret";

TEST(Handshake, ByteByByteThenAdmittedLeavingTheFirstRequestUnread) {
  HandshakeConfig config{
      .secret = kSecret, .node_id = 7, .features = 0, .old_secrets = {}, .revoked = {}};
  Handshake hs(&config);
  wire::HelloRequest hello;
  hello.client_id = testing::RandomClientId();
  hello.client_nonce.fill(3);
  hello.client_name = "t";
  std::vector<uint8_t> body;
  wire::EncodeHello(hello, &body);
  std::vector<uint8_t> in = Frame(wire::Opcode::kHello, body, 1);
  size_t consumed = 0;
  std::vector<uint8_t> buf;
  for (uint8_t b : in) {  // one byte at a time: never more than "need more" until it is all there
    buf.push_back(b);
    const auto o = hs.Feed(buf, &consumed);
    if (buf.size() < in.size()) {
      ASSERT_EQ(o, Handshake::Outcome::kNeedMore);
      ASSERT_EQ(consumed, 0u);
    } else {
      ASSERT_EQ(o, Handshake::Outcome::kNeedMore);  // AUTH still due
      ASSERT_EQ(consumed, in.size());
    }
  }
  auto hello_reply = Replies(hs.output());
  ASSERT_EQ(hello_reply.size(), 1u);
  EXPECT_EQ(hello_reply[0].request_id, 1u);
  EXPECT_EQ(hello_reply[0].status, 0);
  auto decoded = wire::DecodeHelloReply(
      std::span(hs.output()).subspan(wire::kHeaderSize, hello_reply[0].body_len));
  ASSERT_TRUE(decoded.has_value());
  EXPECT_TRUE(decoded->features & wire::kFeatureAuthRequired);
  hs.output().clear();

  // AUTH and a STAT pipelined behind it in one read.
  wire::AuthRequest auth;
  auth.client_mac =
      auth::ClientProof(kSecret, decoded->server_nonce, hello.client_nonce, hello.client_id);
  body.clear();
  wire::EncodeAuth(auth, &body);
  std::vector<uint8_t> two = Frame(wire::Opcode::kAuth, body, 2);
  const size_t auth_len = two.size();
  const std::vector<uint8_t> stat = Frame(wire::Opcode::kStat, {}, 3);
  two.insert(two.end(), stat.begin(), stat.end());
  ASSERT_EQ(hs.Feed(two, &consumed), Handshake::Outcome::kAuthenticated);
  EXPECT_EQ(consumed, auth_len) << "the STAT after AUTH belongs to the connection";
  auto auth_reply = Replies(hs.output());
  ASSERT_EQ(auth_reply.size(), 1u);
  EXPECT_EQ(auth_reply[0].request_id, 2u);
  EXPECT_EQ(auth_reply[0].status, 0);
  EXPECT_EQ(hs.client_id(), hello.client_id);
  EXPECT_EQ(hs.client_name(), "t");
}

// Versions (issue 14): the HELLO reply carries the daemon's (kFeatureVersion), and AUTH may carry
// the client's; a client that sends none (one that predates it) is admitted all the same.
TEST(Handshake, HelloReplyCarriesTheDaemonsVersionAndAuthTheClients) {
  HandshakeConfig config{
      .secret = kSecret, .node_id = 7, .features = 0, .old_secrets = {}, .revoked = {}};
  for (const std::string client_version : {"3.2.1 (git v3.2.1)", ""}) {
    Handshake hs(&config);
    wire::HelloRequest hello;
    hello.client_id = testing::RandomClientId();
    hello.client_nonce.fill(5);
    std::vector<uint8_t> body;
    wire::EncodeHello(hello, &body);
    size_t consumed = 0;
    ASSERT_EQ(hs.Feed(Frame(wire::Opcode::kHello, body, 1), &consumed),
              Handshake::Outcome::kNeedMore);
    auto reply = Replies(hs.output());
    ASSERT_EQ(reply.size(), 1u);
    auto decoded = wire::DecodeHelloReply(
        std::span(hs.output()).subspan(wire::kHeaderSize, reply[0].body_len));
    ASSERT_TRUE(decoded.has_value());
    EXPECT_NE(decoded->features & wire::kFeatureVersion, 0u);
    EXPECT_EQ(decoded->daemon_version, std::string(kVersionString));
    hs.output().clear();
    wire::AuthRequest auth;
    auth.client_mac =
        auth::ClientProof(kSecret, decoded->server_nonce, hello.client_nonce, hello.client_id);
    auth.client_version = client_version;
    body.clear();
    wire::EncodeAuth(auth, &body);
    ASSERT_EQ(hs.Feed(Frame(wire::Opcode::kAuth, body, 2), &consumed),
              Handshake::Outcome::kAuthenticated)
        << hs.failure().ToString();
    EXPECT_EQ(hs.client_version(), client_version);
  }
}

TEST(Handshake, EveryBrokenHandshakeIsRefusedWithOneErrorReply) {
  HandshakeConfig config{
      .secret = kSecret, .node_id = 7, .features = 0, .old_secrets = {}, .revoked = {}};
  wire::HelloRequest hello;
  hello.client_id = testing::RandomClientId();
  std::vector<uint8_t> hello_body;
  wire::EncodeHello(hello, &hello_body);
  struct Case {
    const char* what;
    std::vector<uint8_t> in;
    StatusCode code;
  };
  std::vector<uint8_t> wrong_mac_body(wire::kMacSize, 9);
  std::vector<uint8_t> hello_then_wrong = Frame(wire::Opcode::kHello, hello_body, 1);
  const auto wrong = Frame(wire::Opcode::kAuth, wrong_mac_body, 2);
  hello_then_wrong.insert(hello_then_wrong.end(), wrong.begin(), wrong.end());
  const std::vector<uint8_t> one_hello = Frame(wire::Opcode::kHello, hello_body, 1);
  std::vector<uint8_t> hello_twice = one_hello;
  hello_twice.insert(hello_twice.end(), one_hello.begin(), one_hello.end());
  const std::vector<Case> cases = {
      {"STAT first", Frame(wire::Opcode::kStat, {}, 1), StatusCode::kUnauthenticated},
      {"AUTH first", Frame(wire::Opcode::kAuth, wrong_mac_body, 1), StatusCode::kProtocolError},
      {"wrong proof", hello_then_wrong, StatusCode::kPermissionDenied},
      {"HELLO twice", hello_twice, StatusCode::kProtocolError},
      {"oversized HELLO",
       EncodeRawHeader({.opcode = static_cast<uint8_t>(wire::Opcode::kHello),
                        .body_len = kMaxHandshakeBody + 1}),
       StatusCode::kProtocolError},
      {"bad magic", EncodeRawHeader({.magic = 0xdeadbeef}), StatusCode::kProtocolError},
  };
  for (const Case& c : cases) {
    Handshake hs(&config);
    size_t consumed = 0;
    EXPECT_EQ(hs.Feed(c.in, &consumed), Handshake::Outcome::kRefused) << c.what;
    EXPECT_EQ(hs.failure().code(), c.code) << c.what << ": " << hs.failure().ToString();
    auto replies = Replies(hs.output());
    ASSERT_FALSE(replies.empty()) << c.what;
    EXPECT_EQ(StatusCodeFromWire(replies.back().status), c.code) << c.what;
  }
}

TEST(Handshake, WithoutASecretHelloAloneAdmits) {
  HandshakeConfig config{.secret = "",
                         .node_id = 7,
                         .features = wire::kFeatureVerbs,
                         .old_secrets = {},
                         .revoked = {}};
  Handshake hs(&config);
  wire::HelloRequest hello;
  std::vector<uint8_t> body;
  wire::EncodeHello(hello, &body);
  size_t consumed = 0;
  ASSERT_EQ(hs.Feed(Frame(wire::Opcode::kHello, body, 1), &consumed),
            Handshake::Outcome::kAuthenticated);
  // Refused at --max-connections after all: the HELLO reply is replaced by the error.
  hs.Refuse(ResourceExhausted("--max-connections"));
  auto replies = Replies(hs.output());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(StatusCodeFromWire(replies[0].status), StatusCode::kResourceExhausted);
  EXPECT_EQ(replies[0].request_id, 1u);
}

// Identities: the name in HELLO picks the key the proof is checked against (derived from the
// current or an old secret); a revoked or malformed name is refused at HELLO; the lease owner
// depends on the name.
struct HelloResult {
  Handshake::Outcome outcome;
  wire::Nonce server_nonce{};
};
HelloResult SendHello(Handshake& hs, const wire::HelloRequest& hello) {
  std::vector<uint8_t> body;
  wire::EncodeHello(hello, &body);
  size_t consumed = 0;
  HelloResult r{hs.Feed(Frame(wire::Opcode::kHello, body, 1), &consumed)};
  auto replies = Replies(hs.output());
  if (r.outcome == Handshake::Outcome::kNeedMore && replies.size() == 1) {
    auto d = wire::DecodeHelloReply(
        std::span(hs.output()).subspan(wire::kHeaderSize, replies[0].body_len));
    if (d) r.server_nonce = d->server_nonce;
  }
  hs.output().clear();
  return r;
}
Handshake::Outcome SendAuth(Handshake& hs, const wire::Mac& mac) {
  std::vector<uint8_t> body;
  wire::EncodeAuth({.client_mac = mac, .client_version = {}}, &body);
  size_t consumed = 0;
  return hs.Feed(Frame(wire::Opcode::kAuth, body, 2), &consumed);
}

TEST(Handshake, IdentityKeysFromCurrentAndOldSecretsAdmitAndRevokedNamesAreRefused) {
  HandshakeConfig config{.secret = kSecret,
                         .node_id = 7,
                         .features = 0,
                         .old_secrets = {"the-old-handshake-secret"},
                         .revoked = {"mallory"}};
  for (const std::string& secret : {kSecret, std::string("the-old-handshake-secret")}) {
    Handshake hs(&config);
    wire::HelloRequest hello;
    hello.client_id = testing::RandomClientId();
    hello.identity = "alice";
    HelloResult h = SendHello(hs, hello);
    ASSERT_EQ(h.outcome, Handshake::Outcome::kNeedMore);
    const wire::Mac mac = auth::ClientProof(auth::ClientKey(secret, "alice"), h.server_nonce,
                                            hello.client_nonce, hello.client_id, "alice");
    ASSERT_EQ(SendAuth(hs, mac), Handshake::Outcome::kAuthenticated) << secret;
    EXPECT_EQ(hs.identity(), "alice");
    EXPECT_EQ(hs.owner(), auth::LeaseOwner("alice", hello.client_id));
    EXPECT_NE(hs.owner(), hello.client_id);
  }
  {  // bob's key for alice's name
    Handshake hs(&config);
    wire::HelloRequest hello;
    hello.identity = "alice";
    HelloResult h = SendHello(hs, hello);
    const wire::Mac mac = auth::ClientProof(auth::ClientKey(kSecret, "bob"), h.server_nonce,
                                            hello.client_nonce, hello.client_id, "alice");
    EXPECT_EQ(SendAuth(hs, mac), Handshake::Outcome::kRefused);
    EXPECT_EQ(hs.failure().code(), StatusCode::kPermissionDenied);
  }
  for (const std::string& name : {std::string("mallory"), std::string("a b")}) {
    Handshake hs(&config);
    wire::HelloRequest hello;
    hello.identity = name;
    EXPECT_EQ(SendHello(hs, hello).outcome, Handshake::Outcome::kRefused) << name;
  }
  {  // no name: the cluster secret, as before identities
    Handshake hs(&config);
    wire::HelloRequest hello;
    HelloResult h = SendHello(hs, hello);
    const wire::Mac mac =
        auth::ClientProof(kSecret, h.server_nonce, hello.client_nonce, hello.client_id);
    ASSERT_EQ(SendAuth(hs, mac), Handshake::Outcome::kAuthenticated);
    EXPECT_EQ(hs.identity(), "cluster");
  }
}

}  // namespace
}  // namespace farmem::daemon
