// Per-client identities (issue 16, docs/operations.md "Security"): a client authenticates as a
// name with that name's key (derived from the cluster secret), and every lease is bound to the
// name. Covers the attack from the issue (an authenticated client that sends another client's id
// and lease ids reads nothing of it), the key-file path end to end through farmemctl, wrong keys,
// revocation on SIGHUP while other names continue, and the old secret of a rotation window.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "daemon_client.h"
#include "farmem/common/auth.h"
#include "support/daemon_fixture.h"
#include "support/process.h"
#include "support/wait.h"

namespace farmem::testing {
namespace {

using ::testing::HasSubstr;
using wire::Opcode;
constexpr uint64_t kSlab = 1 << 20;

// One client of one daemon as `identity` ("" = the cluster secret itself).
class Tenant {
 public:
  static Result<Tenant> Connect(const Endpoint& ep, const std::string& key,
                                const std::string& identity, const wire::ClientId& id) {
    Tenant t;
    t.options_ = ClientOptions(ep, key, id, "identity_test");
    t.options_.credentials.identity = identity;
    FARMEM_ASSIGN_OR_RETURN(auto conn, transport::TcpConnection::Connect(t.options_));
    t.control_ = std::make_unique<transport::TcpConnection>(std::move(conn));
    FARMEM_ASSIGN_OR_RETURN(t.channel_, t.transport_->OpenChannel(t.options_));
    return t;
  }
  transport::TcpConnection& control() { return *control_; }
  transport::Channel& channel() { return *channel_; }

  Result<std::vector<wire::LeaseGrant>> Alloc(uint32_t count) {
    std::vector<uint8_t> req;
    wire::EncodeAlloc({count}, &req);
    FARMEM_ASSIGN_OR_RETURN(auto body, control_->Call(Opcode::kAlloc, req, kCallTimeout));
    FARMEM_ASSIGN_OR_RETURN(wire::AllocReply reply, wire::DecodeAllocReply(body));
    return std::move(reply.leases);
  }
  Status Free(uint64_t lease_id) {
    std::vector<uint8_t> req;
    wire::EncodeFree({{lease_id}}, &req);
    auto r = control_->Call(Opcode::kFree, req, kCallTimeout);
    return r.has_value() ? Status::Ok() : r.error();
  }
  Result<wire::HeartbeatReply> Heartbeat() {
    FARMEM_ASSIGN_OR_RETURN(auto body, control_->Call(Opcode::kHeartbeat, {}, kCallTimeout));
    return wire::DecodeHeartbeatReply(body);
  }
  Status Stat() {
    auto r = control_->Call(Opcode::kStat, {}, kCallTimeout);
    return r.has_value() ? Status::Ok() : r.error();
  }

 private:
  Tenant() : transport_(transport::MakeTcpTransport()) {}
  transport::ChannelOptions options_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::TcpConnection> control_;
  std::unique_ptr<transport::Channel> channel_;
};

std::vector<uint8_t> Pattern(uint8_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 13);
  return v;
}

DaemonConfig Config(std::vector<std::string> extra = {}) {
  extra.push_back("--no-mlock");
  return {.capacity = "8M", .slab_size = "1M", .extra_args = std::move(extra)};
}

// Waits until the daemon has logged `what` `count` times (a SIGHUP reload is asynchronous).
bool WaitForLog(const DaemonProcess& d, const std::string& what, size_t count = 1) {
  return WaitUntil(
      [&] {
        const std::string log = ReadFile(d.log_path());
        size_t n = 0;
        for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
        return n >= count;
      },
      std::chrono::milliseconds(10000));
}

// The attack from issue 16: B, authenticated as "bob", sends alice's client id and alice's
// lease id. Before identities every client shared one secret and the client id was all the
// daemon checked, so B read alice's data.
TEST(IdentityTest, AnotherNameCannotTouchALeaseEvenWithItsClientId) {
  DaemonSet daemons(Config());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  const wire::ClientId shared_id = RandomClientId();
  auto alice = Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "alice"), "alice", shared_id);
  ASSERT_TRUE(alice.has_value()) << alice.error().ToString();
  auto bob = Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "bob"), "bob", shared_id);
  ASSERT_TRUE(bob.has_value()) << bob.error().ToString();

  auto leases = alice->Alloc(1);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  const transport::RemoteSlab slab = transport::RemoteSlab::From((*leases)[0]);
  const std::vector<uint8_t> secret_data = Pattern(0x5a, 4096);
  ASSERT_TRUE(alice->channel().Write(slab, 0, secret_data).ok());

  // READ: refused, nothing of alice's comes back.
  std::vector<uint8_t> got(4096, 0);
  Status r = bob->channel().Read(slab, 0, got);
  EXPECT_EQ(r.code(), StatusCode::kPermissionDenied) << r.ToString();
  EXPECT_THAT(r.message(), HasSubstr("belongs to another client"));
  EXPECT_NE(got, secret_data) << "bob read alice's data";
  // WRITE: refused, alice's data unchanged.
  const std::vector<uint8_t> junk(4096, 0xee);
  EXPECT_EQ(bob->channel().Write(slab, 0, junk).code(), StatusCode::kPermissionDenied);
  // FREE: refused, the lease stays.
  EXPECT_EQ(bob->Free(slab.lease_id).code(), StatusCode::kPermissionDenied);
  // HEARTBEAT renews bob's own leases only: he holds none.
  auto hb = bob->Heartbeat();
  ASSERT_TRUE(hb.has_value());
  EXPECT_EQ(hb->leases_held, 0u);
  auto hb_alice = alice->Heartbeat();
  ASSERT_TRUE(hb_alice.has_value());
  EXPECT_EQ(hb_alice->leases_held, 1u);

  std::vector<uint8_t> back(4096);
  ASSERT_TRUE(alice->channel().Read(slab, 0, back).ok());
  EXPECT_EQ(back, secret_data);
  // The refusals are counted and logged (rate-limited).
  EXPECT_TRUE(WaitForLog(daemons[0], "lease operation(s) refused")) << daemons.Logs();
  EXPECT_TRUE(alice->Free(slab.lease_id).ok());
}

// A second process of the same name keeps its own leases (per (name, client id)), and a new
// connection of the same name and client id (a restarted client) reaches its leases again.
TEST(IdentityTest, SameNameSameClientIdReattaches) {
  DaemonSet daemons(Config());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  const std::string key = auth::ClientKey(daemons.secret(), "alice");
  const wire::ClientId id = RandomClientId();
  auto first = Tenant::Connect(ep, key, "alice", id);
  ASSERT_TRUE(first.has_value()) << first.error().ToString();
  auto leases = first->Alloc(1);
  ASSERT_TRUE(leases.has_value());
  const transport::RemoteSlab slab = transport::RemoteSlab::From((*leases)[0]);
  const std::vector<uint8_t> data = Pattern(3, 4096);
  ASSERT_TRUE(first->channel().Write(slab, 0, data).ok());

  auto again = Tenant::Connect(ep, key, "alice", id);
  ASSERT_TRUE(again.has_value());
  std::vector<uint8_t> back(4096);
  ASSERT_TRUE(again->channel().Read(slab, 0, back).ok());
  EXPECT_EQ(back, data);
  auto other_process = Tenant::Connect(ep, key, "alice", RandomClientId());
  ASSERT_TRUE(other_process.has_value());
  EXPECT_EQ(other_process->channel().Read(slab, 0, back).code(), StatusCode::kPermissionDenied);
  // The cluster secret's identity is a name like any other for leases.
  auto admin = Tenant::Connect(ep, daemons.secret(), "", id);
  ASSERT_TRUE(admin.has_value());
  EXPECT_EQ(admin->channel().Read(slab, 0, back).code(), StatusCode::kPermissionDenied);
}

TEST(IdentityTest, WrongKeyIsRefused) {
  DaemonSet daemons(Config());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  struct Case {
    std::string key, identity, why;
  } cases[] = {
      {auth::ClientKey("some other cluster secret", "alice"), "alice", "key of another cluster"},
      {auth::ClientKey(daemons.secret(), "bob"), "alice", "bob's key presented as alice"},
      {daemons.secret(), "alice", "the cluster secret presented as alice's key"},
      {auth::ClientKey(daemons.secret(), "alice"), "", "alice's key presented as the cluster"},
  };
  for (const Case& c : cases) {
    auto t = Tenant::Connect(ep, c.key, c.identity, RandomClientId());
    ASSERT_FALSE(t.has_value()) << c.why << " was accepted";
    EXPECT_EQ(t.error().code(), StatusCode::kPermissionDenied)
        << c.why << ": " << t.error().ToString();
    EXPECT_THAT(t.error().message(), HasSubstr("wrong secret")) << c.why;
  }
  auto ok =
      Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "alice"), "alice", RandomClientId());
  EXPECT_TRUE(ok.has_value()) << ok.error().ToString();
}

// The documented path: farmemctl key issue writes a key file; farmemctl demo with --key-file
// borrows, writes, reads back verified and frees as that name.
TEST(IdentityTest, IssuedKeyFileWorksEndToEnd) {
  DaemonSet daemons(Config());
  ASSERT_TRUE(daemons.Start(2).ok()) << daemons.Logs();
  const std::string key_file = daemons.work_dir() + "/carol.key";
  CommandResult issue = RunCommand({BinPath("farmemctl"), "key", "issue", "carol", "--secret-file",
                                    daemons.work_dir() + "/secret", "--out", key_file});
  ASSERT_EQ(issue.exit_code, 0) << issue.out << issue.err;
  EXPECT_EQ(std::filesystem::status(key_file).permissions(),
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  auto loaded = auth::LoadClientKeyFile(key_file);
  ASSERT_TRUE(loaded.has_value()) << loaded.error().ToString();
  EXPECT_EQ(loaded->identity, "carol");
  EXPECT_EQ(loaded->key, auth::ClientKey(daemons.secret(), "carol"));

  std::string peers = daemons[0].endpoint().ToString() + "," + daemons[1].endpoint().ToString();
  CommandResult demo = RunCommand({BinPath("farmemctl"), "demo", "--peers", peers, "--key-file",
                                   key_file, "--size", "4M", "--transport", "tcp"},
                                  std::chrono::seconds(60));
  EXPECT_EQ(demo.exit_code, 0) << demo.out << demo.err << daemons.Logs();
  EXPECT_THAT(ReadFile(daemons[0].log_path()) + ReadFile(daemons[1].log_path()),
              HasSubstr("to carol/"));

  // A key file others may read is refused before anything is sent.
  ASSERT_EQ(::chmod(key_file.c_str(), 0640), 0);
  CommandResult loose =
      RunCommand({BinPath("farmemctl"), "stat", "--peers", peers, "--key-file", key_file});
  EXPECT_NE(loose.exit_code, 0);
  EXPECT_THAT(loose.err, HasSubstr("chmod 600"));
  // And farmemctl drain is for the administrator.
  ASSERT_EQ(::chmod(key_file.c_str(), 0600), 0);
  CommandResult drain = RunCommand(
      {BinPath("farmemctl"), "drain", daemons[0].endpoint().ToString(), "--key-file", key_file});
  EXPECT_NE(drain.exit_code, 0) << drain.out;
  EXPECT_THAT(drain.err, HasSubstr("cluster administrator"));
}

TEST(IdentityTest, RevokedNameIsClosedAndRefusedAfterSighupWhileOthersContinue) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string revoked = dir.path() + "/revoked";
  ASSERT_TRUE(WritePrivateFile(revoked, "# nobody yet\n").ok());
  DaemonSet daemons(Config({"--revoked-file", revoked, "--lease-ttl-ms", "500"}));
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  const std::string alice_key = auth::ClientKey(daemons.secret(), "alice");
  auto alice = Tenant::Connect(ep, alice_key, "alice", RandomClientId());
  auto bob = Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "bob"), "bob", RandomClientId());
  ASSERT_TRUE(alice.has_value() && bob.has_value());
  auto leases = alice->Alloc(2);
  ASSERT_TRUE(leases.has_value());
  ASSERT_TRUE(alice->Stat().ok());

  ASSERT_TRUE(WritePrivateFile(revoked, "# revoked 2026-12-01\nalice\n").ok());
  ASSERT_EQ(::kill(daemons[0].pid(), SIGHUP), 0);
  ASSERT_TRUE(WaitForLog(daemons[0], "authentication policy reloaded")) << daemons.Logs();
  // alice's connections are closed; a new handshake is refused and says why.
  EXPECT_TRUE(WaitUntil([&] { return !alice->Stat().ok(); }, std::chrono::milliseconds(5000)));
  auto again = Tenant::Connect(ep, alice_key, "alice", RandomClientId());
  ASSERT_FALSE(again.has_value());
  EXPECT_EQ(again.error().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(again.error().message(), HasSubstr("revoked"));
  // bob continues, on his old connection and on new ones.
  EXPECT_TRUE(bob->Stat().ok());
  EXPECT_TRUE(bob->Alloc(1).has_value());
  auto bob2 =
      Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "bob"), "bob", RandomClientId());
  EXPECT_TRUE(bob2.has_value());
  // alice can no longer heartbeat: her leases expire and are reclaimed.
  EXPECT_TRUE(WaitForLog(daemons[0], "expired: its client stopped heartbeating", 2))
      << daemons.Logs();
}

TEST(IdentityTest, OldSecretAcceptedDuringRotationAndRefusedAfter) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string old_secret = "the secret of last quarter";
  const std::string old_file = dir.path() + "/old-secret";
  ASSERT_TRUE(WritePrivateFile(old_file, old_secret).ok());
  DaemonSet daemons(Config({"--old-secret-file", old_file}));
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  // During the window: old and new cluster secret, and keys derived from either.
  EXPECT_TRUE(Tenant::Connect(ep, old_secret, "", RandomClientId()).has_value());
  EXPECT_TRUE(Tenant::Connect(ep, daemons.secret(), "", RandomClientId()).has_value());
  EXPECT_TRUE(Tenant::Connect(ep, auth::ClientKey(old_secret, "dave"), "dave", RandomClientId())
                  .has_value());
  EXPECT_TRUE(
      Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "dave"), "dave", RandomClientId())
          .has_value());
  // The operator ends the window: removes the file, SIGHUP.
  ASSERT_EQ(::unlink(old_file.c_str()), 0);
  ASSERT_EQ(::kill(daemons[0].pid(), SIGHUP), 0);
  ASSERT_TRUE(WaitForLog(daemons[0], "authentication policy reloaded")) << daemons.Logs();
  auto old = Tenant::Connect(ep, old_secret, "", RandomClientId());
  ASSERT_FALSE(old.has_value());
  EXPECT_EQ(old.error().code(), StatusCode::kPermissionDenied);
  EXPECT_FALSE(Tenant::Connect(ep, auth::ClientKey(old_secret, "dave"), "dave", RandomClientId())
                   .has_value());
  EXPECT_TRUE(
      Tenant::Connect(ep, auth::ClientKey(daemons.secret(), "dave"), "dave", RandomClientId())
          .has_value());
}

// A daemon never given the old secret refuses it (the control for the test above).
TEST(IdentityTest, OldSecretRefusedWithoutOldSecretFile) {
  DaemonSet daemons(Config());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto old =
      Tenant::Connect(daemons[0].endpoint(), "the secret of last quarter", "", RandomClientId());
  ASSERT_FALSE(old.has_value());
  EXPECT_EQ(old.error().code(), StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace farmem::testing
