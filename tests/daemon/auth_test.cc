// Authentication between real clients and real daemons (docs/wire-protocol.md, "AUTH"): the right
// secret works and the daemon proves it knows it too; a wrong or missing secret fails with
// PermissionDenied and a message that says what to do; a client with a secret refuses a daemon
// that does not ask for one, or that cannot prove it knows the secret; proofs cannot be replayed
// or moved to another client id.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <thread>

#include "daemon_client.h"
#include "farmem/common/version.h"
#include "support/daemon_fixture.h"
#include "support/raw_client.h"
#include "support/wait.h"

namespace farmem::testing {
namespace {

using ::testing::HasSubstr;
using wire::Opcode;

// No leases are held here: the short TTL only makes farmemd's housekeeping (which is what closes
// finished connections, see regression_test.cc) run every 100 ms, so "then closed" checks are
// quick.
DaemonConfig Daemon(const std::string& secret) {
  return {.capacity = "4M",
          .slab_size = "1M",
          .secret = secret,
          .lease_ttl_ms = 400,
          .extra_args = {"--no-mlock"}};
}

Result<transport::TcpConnection> Dial(const Endpoint& ep, const std::string& secret,
                                      const wire::ClientId& id = RandomClientId()) {
  return transport::TcpConnection::Connect(ClientOptions(ep, secret, id, "auth_test"));
}

class AuthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemons_ = new DaemonSet(Daemon("correct horse battery staple"));
    Status s = daemons_->Start(1);
    if (!s.ok()) setup_error_ = s.ToString() + "\n" + daemons_->Logs();
  }
  static void TearDownTestSuite() {
    delete daemons_;
    daemons_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(setup_error_.empty()) << setup_error_; }
  void TearDown() override { EXPECT_TRUE(ProcessAlive((*daemons_)[0].pid())) << daemons_->Logs(); }

  static Endpoint endpoint() { return (*daemons_)[0].endpoint(); }
  static const std::string& secret() { return daemons_->secret(); }

  static inline DaemonSet* daemons_ = nullptr;
  static inline std::string setup_error_;
};

TEST_F(AuthTest, RightSecretWorks) {
  auto c = Dial(endpoint(), secret());
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_TRUE(c->hello().features & wire::kFeatureAuthRequired);
  auto st = c->Call(Opcode::kStat, {}, kCallTimeout);
  ASSERT_TRUE(st.has_value()) << st.error().ToString();
  auto stat = wire::DecodeStatReply(*st);
  ASSERT_TRUE(stat.has_value());
  EXPECT_TRUE(stat->features & wire::kFeatureAuthRequired);
  EXPECT_EQ(stat->node_id, c->hello().node_id);
}

// Versions in the handshake (issue 14): the client learns the daemon's version from HELLO, and
// the daemon, which asked for AUTH, learns the client's from AUTH's trailer (it logs it at debug
// level when it admits the connection).
TEST(HelloVersion, ClientAndDaemonLearnEachOthersVersion) {
  DaemonConfig config = Daemon("hello version secret");
  config.log_level = "debug";
  DaemonSet daemons(config);
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto c = Dial(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_NE(c->hello().features & wire::kFeatureVersion, 0u);
  EXPECT_EQ(c->hello().daemon_version, std::string(kVersionString));
  const std::string admitted =
      fmt::format("(auth_test, identity 'cluster', farmem {})", kVersionString);
  EXPECT_TRUE(WaitUntil([&] { return daemons.Logs(1 << 20).find(admitted) != std::string::npos; },
                        std::chrono::seconds(10)))
      << "no '" << admitted << "' in\n"
      << daemons.Logs(1 << 20);
}

TEST_F(AuthTest, DaemonProvesItKnowsTheSecret) {
  auto c = RawClient::Connect(endpoint());
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->Hello(RandomClientId(), /*secret=*/"").ok());  // HELLO only
  const wire::Mac client_proof =
      auth::ClientProof(secret(), c->hello().server_nonce, c->client_nonce(), c->client_id());
  std::vector<uint8_t> body;
  wire::EncodeAuth({.client_mac = client_proof, .client_version = {}}, &body);
  auto f = c->Call(Opcode::kAuth, body);
  ASSERT_TRUE(f.has_value()) << f.error().ToString();
  ASSERT_TRUE(f->status().ok()) << f->status().ToString();
  auto reply = wire::DecodeAuthReply(f->body);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->server_mac, auth::ServerProof(secret(), c->hello().server_nonce,
                                                 c->client_nonce(), c->client_id()));
  EXPECT_NE(reply->server_mac, client_proof) << "the daemon echoed the client's proof";
  EXPECT_TRUE(c->Stat().has_value());
}

TEST_F(AuthTest, EveryConnectionGetsAFreshChallenge) {
  auto a = RawClient::Connect(endpoint());
  auto b = RawClient::Connect(endpoint());
  ASSERT_TRUE(a.has_value() && b.has_value());
  ASSERT_TRUE(a->Hello(RandomClientId(), "").ok());
  ASSERT_TRUE(b->Hello(RandomClientId(), "").ok());
  EXPECT_NE(a->hello().server_nonce, b->hello().server_nonce);
  EXPECT_NE(a->hello().server_nonce, wire::Nonce{});
  EXPECT_EQ(a->hello().node_id, b->hello().node_id);
}

TEST_F(AuthTest, WrongSecretIsPermissionDenied) {
  for (const std::string& wrong :
       {std::string("correct horse battery stapl"), std::string("correct horse battery staple "),
        std::string("CORRECT HORSE BATTERY STAPLE"), std::string("x")}) {
    auto c = Dial(endpoint(), wrong);
    ASSERT_FALSE(c.has_value()) << "'" << wrong << "' was accepted";
    EXPECT_EQ(c.error().code(), StatusCode::kPermissionDenied) << c.error().ToString();
    EXPECT_THAT(c.error().message(), HasSubstr("wrong secret"));
    EXPECT_THAT(c.error().message(), HasSubstr(endpoint().ToString()));
  }
}

TEST_F(AuthTest, ClientWithoutSecretGetsAClearMessage) {
  auto c = Dial(endpoint(), "");
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(c.error().message(), HasSubstr("requires authentication"));
  EXPECT_THAT(c.error().message(), HasSubstr("secret"));
  EXPECT_THAT(c.error().message(), HasSubstr(endpoint().ToString()));
}

TEST_F(AuthTest, ReplayedProofIsRefused) {
  // Record a successful exchange, then replay the client's HELLO and AUTH on a new connection.
  const wire::ClientId id = RandomClientId();
  wire::HelloRequest hello;
  hello.client_id = id;
  ASSERT_TRUE(auth::RandomBytes(hello.client_nonce).ok());
  std::vector<uint8_t> hello_body;
  wire::EncodeHello(hello, &hello_body);

  auto first = RawClient::Connect(endpoint());
  ASSERT_TRUE(first.has_value());
  auto r = first->Call(Opcode::kHello, hello_body);
  ASSERT_TRUE(r.has_value() && r->status().ok());
  auto challenge = wire::DecodeHelloReply(r->body);
  ASSERT_TRUE(challenge.has_value());
  std::vector<uint8_t> auth_body;
  wire::EncodeAuth(
      {.client_mac = auth::ClientProof(secret(), challenge->server_nonce, hello.client_nonce, id),
       .client_version = {}},
      &auth_body);
  r = first->Call(Opcode::kAuth, auth_body);
  ASSERT_TRUE(r.has_value());
  ASSERT_TRUE(r->status().ok()) << r->status().ToString();

  auto replay = RawClient::Connect(endpoint());
  ASSERT_TRUE(replay.has_value());
  r = replay->Call(Opcode::kHello, hello_body);
  ASSERT_TRUE(r.has_value() && r->status().ok());
  r = replay->Call(Opcode::kAuth, auth_body);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(replay->WaitClosed());
}

TEST_F(AuthTest, ProofIsBoundToTheClientId) {
  auto c = RawClient::Connect(endpoint());
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->Hello(RandomClientId(), "").ok());
  // The secret is right, but the proof names another client: that client's leases are not ours.
  const wire::Mac proof =
      auth::ClientProof(secret(), c->hello().server_nonce, c->client_nonce(), RandomClientId());
  Status s = c->Auth(proof);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  EXPECT_TRUE(c->WaitClosed());
}

TEST_F(AuthTest, ServerProofOfferedAsClientProofIsRefused) {
  auto c = RawClient::Connect(endpoint());
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->Hello(RandomClientId(), "").ok());
  Status s = c->Auth(
      auth::ServerProof(secret(), c->hello().server_nonce, c->client_nonce(), c->client_id()));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
}

TEST(AuthOpenDaemon, ClientWithSecretRefusesADaemonWithoutOne) {
  DaemonSet open(Daemon(""));
  ASSERT_TRUE(open.Start(1).ok()) << open.Logs();
  auto c = Dial(open[0].endpoint(), "a secret");
  ASSERT_FALSE(c.has_value()) << "trusted a daemon that does not know the secret";
  EXPECT_EQ(c.error().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(c.error().message(), HasSubstr("does not require authentication"));
  // Without a secret the open daemon serves (and says it is open).
  auto ok = Dial(open[0].endpoint(), "");
  ASSERT_TRUE(ok.has_value()) << ok.error().ToString();
  EXPECT_FALSE(ok->hello().features & wire::kFeatureAuthRequired);
  EXPECT_TRUE(ok->Call(Opcode::kStat, {}, kCallTimeout).has_value());
  EXPECT_THAT(open[0].LogTail(), HasSubstr("NO AUTHENTICATION"));
}

TEST(AuthSecretFile, TrailingNewlineInTheFileIsNotPartOfTheSecret) {
  // `echo secret > file` writes a newline; the daemon strips one.
  DaemonSet daemons(Daemon("secret-from-echo\n"));  // 16 bytes: the least accepted
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto c = Dial(daemons[0].endpoint(), "secret-from-echo");
  EXPECT_TRUE(c.has_value()) << c.error().ToString();
}

// A daemon impostor: asks for authentication, then answers AUTH with a proof of its choosing.
class ImpostorDaemon {
 public:
  enum class Answer { kRandomProof, kEchoClientProof, kClientProofFormula };

  explicit ImpostorDaemon(Answer answer) : answer_(answer) {
    auto l = ListenTcp({"127.0.0.1", 0});
    if (!l.has_value()) return;
    listener_ = std::move(*l);
    port_ = LocalPort(listener_).value_or(0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ImpostorDaemon() {
    listener_.Shutdown();
    if (thread_.joinable()) thread_.join();
  }
  Endpoint endpoint() const { return {"127.0.0.1", port_}; }

 private:
  void Serve() {
    pollfd p{listener_.fd(), POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
    Socket s(::accept(listener_.fd(), nullptr, nullptr));
    if (!s.valid()) return;
    const Deadline deadline = DeadlineIn(std::chrono::milliseconds(5000));
    auto hello_frame = RecvFrame(s.fd(), deadline);
    if (!hello_frame.has_value()) return;
    auto hello = wire::DecodeHello(hello_frame->body);
    if (!hello.has_value()) return;
    wire::HelloReply reply;
    reply.features = wire::kFeatureAuthRequired;
    (void)auth::RandomBytes(reply.server_nonce);
    std::vector<uint8_t> body;
    wire::EncodeHelloReply(reply, &body);
    if (!SendReply(s.fd(), hello_frame->header, body, deadline).ok()) return;

    auto auth_frame = RecvFrame(s.fd(), deadline);
    if (!auth_frame.has_value()) return;
    auto client = wire::DecodeAuth(auth_frame->body);
    if (!client.has_value()) return;
    wire::AuthReply proof;
    switch (answer_) {
      case Answer::kRandomProof:
        (void)auth::RandomBytes(proof.server_mac);
        break;
      case Answer::kEchoClientProof:  // a reflection: the client's own proof back
        proof.server_mac = client->client_mac;
        break;
      case Answer::kClientProofFormula:  // right inputs, wrong label, no secret
        proof.server_mac =
            auth::ServerProof("", reply.server_nonce, hello->client_nonce, hello->client_id);
        break;
    }
    body.clear();
    wire::EncodeAuthReply(proof, &body);
    (void)SendReply(s.fd(), auth_frame->header, body, deadline);
    // Hold the connection until the client hangs up.
    uint8_t byte;
    (void)RecvExact(s.fd(), {&byte, 1}, deadline);
  }

  Answer answer_;
  Socket listener_;
  uint16_t port_ = 0;
  std::thread thread_;
};

TEST(AuthImpostor, DaemonThatCannotProveTheSecretIsRefused) {
  for (auto answer :
       {ImpostorDaemon::Answer::kRandomProof, ImpostorDaemon::Answer::kEchoClientProof,
        ImpostorDaemon::Answer::kClientProofFormula}) {
    ImpostorDaemon impostor(answer);
    auto c = Dial(impostor.endpoint(), "the real secret");
    ASSERT_FALSE(c.has_value()) << "trusted an impostor (answer " << static_cast<int>(answer)
                                << ")";
    EXPECT_EQ(c.error().code(), StatusCode::kPermissionDenied) << c.error().ToString();
    EXPECT_THAT(c.error().message(), HasSubstr("failed to prove"));
  }
}

}  // namespace
}  // namespace farmem::testing
