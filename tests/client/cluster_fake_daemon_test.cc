// Cluster against a scripted in-process daemon: the daemon behaviours a real farmemd rarely shows
// on demand (eviction notices, malformed pushes, replies that grant the wrong thing).
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "farmem/client/cluster.h"
#include "farmem/common/socket.h"
#include "farmem/common/version.h"
#include "farmem/common/wire.h"
#include "support/log_capture.h"
#include "support/wait.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;

// Speaks just enough of the protocol (no authentication) on 127.0.0.1; one thread per connection.
// Tests script it through the public members, which the connection threads read under mu.
class FakeDaemon {
 public:
  FakeDaemon() {
    auto s = ListenTcp(Endpoint{"127.0.0.1", 0});
    EXPECT_TRUE(s.has_value());
    listener_ = std::move(*s);
    port_ = *LocalPort(listener_);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~FakeDaemon() {
    stop_ = true;
    listener_.Shutdown();
    acceptor_.join();
    {
      std::lock_guard lock(mu);
      for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : connections_) t.join();
  }

  Endpoint endpoint() const { return {"127.0.0.1", port_}; }

  std::mutex mu;
  std::vector<std::vector<uint8_t>> pushes_before_next_heartbeat;  // bodies of EVICT_NOTICE
  std::vector<wire::NoticedLease> noticed;  // listed in every HEARTBEAT reply
  size_t heartbeats = 0;
  std::function<std::vector<wire::LeaseGrant>()> alloc_reply = [this] {
    return std::vector<wire::LeaseGrant>{Grant(next_slab_++)};
  };
  std::vector<uint64_t> freed;
  size_t held = 0;  // leases granted and not freed
  uint32_t free_slabs = 4;
  std::string hello_version;  // sent in HELLO (kFeatureVersion) when not empty

  static wire::LeaseGrant Grant(uint32_t slab) {
    return {wire::MakeLeaseId(7, slab), 1u << 20, 0, 0};
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      std::lock_guard lock(mu);
      open_fds_.push_back(fd);
      connections_.emplace_back([this, fd] {
        Serve(fd);
        std::lock_guard done(mu);
        std::erase(open_fds_, fd);
        ::close(fd);
      });
    }
  }

  static Status Send(int fd, wire::Opcode op, uint16_t flags, uint64_t id,
                     const std::vector<uint8_t>& body) {
    wire::FrameHeader h;
    h.opcode = static_cast<uint8_t>(op);
    h.flags = flags;
    h.request_id = id;
    h.body_len = static_cast<uint32_t>(body.size());
    std::vector<uint8_t> frame(wire::kHeaderSize);
    wire::EncodeHeader(h, frame.data());
    frame.insert(frame.end(), body.begin(), body.end());
    return SendAll(fd, frame, DeadlineIn(milliseconds(2000)));
  }

  void Serve(int fd) {
    for (;;) {
      uint8_t hdr[wire::kHeaderSize];
      if (!RecvExact(fd, hdr, kNoDeadline).ok()) return;
      auto h = wire::DecodeHeader(hdr);
      if (!h) return;
      std::vector<uint8_t> body(h->body_len);
      if (!RecvExact(fd, body, kNoDeadline).ok()) return;
      std::vector<uint8_t> reply;
      const auto op = static_cast<wire::Opcode>(h->opcode);
      std::vector<std::vector<uint8_t>> pushes;
      {
        std::lock_guard lock(mu);
        switch (op) {
          case wire::Opcode::kHello:
            wire::EncodeHelloReply(
                {.version = wire::kVersion,
                 .features = hello_version.empty() ? 0u : uint32_t{wire::kFeatureVersion},
                 .node_id = 0xfeed,
                 .server_nonce = {},
                 .daemon_version = hello_version},
                &reply);
            break;
          case wire::Opcode::kStat: {
            wire::StatReply s;
            s.node_id = 0xfeed;
            s.slab_size = 1u << 20;
            s.total_slabs = 4;
            s.free_slabs = free_slabs;
            wire::EncodeStatReply(s, &reply);
            break;
          }
          case wire::Opcode::kAlloc: {
            std::vector<wire::LeaseGrant> grants = alloc_reply();
            held += grants.size();
            wire::EncodeAllocReply({std::move(grants)}, &reply);
            break;
          }
          case wire::Opcode::kFree:
            if (auto f = wire::DecodeFree(body)) {
              freed.insert(freed.end(), f->lease_ids.begin(), f->lease_ids.end());
              held -= std::min<size_t>(held, f->lease_ids.size());
            }
            break;
          case wire::Opcode::kHeartbeat:
            pushes.swap(pushes_before_next_heartbeat);
            // What it granted and was not freed: fewer would tell the client that the daemon
            // ended leases (it then checks each with a READ, which this fake does not serve).
            ++heartbeats;
            wire::EncodeHeartbeatReply({.leases_held = static_cast<uint32_t>(held),
                                        .lease_ttl_ms = 10000,
                                        .noticed = noticed},
                                       &reply);
            break;
          default:
            return;
        }
      }
      for (const auto& p : pushes) {
        if (!Send(fd, wire::Opcode::kEvictNotice, wire::kFlagPush, 0, p).ok()) return;
      }
      if (!Send(fd, op, wire::kFlagReply, h->request_id, reply).ok()) return;
    }
  }

  Socket listener_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::vector<std::thread> connections_;  // guarded by mu (appended by the acceptor)
  std::vector<int> open_fds_;
  uint32_t next_slab_ = 0;
};

ClusterOptions FakeOptions(const FakeDaemon& d) {
  ClusterOptions o;
  o.peers = {d.endpoint()};
  o.heartbeat_interval = milliseconds(50);
  o.failure_timeout = milliseconds(1000);
  o.op_timeout = milliseconds(1000);
  return o;
}

TEST(ClusterWithFakeDaemon, EvictNoticeBecomesAnEventAndBadPushesAreIgnored) {
  FakeDaemon daemon;
  auto c = Cluster::Connect(FakeOptions(daemon));
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  auto leases = (*c)->Allocate(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Event> events;
  (*c)->Subscribe([&](const Event& e) {
    std::lock_guard lock(mu);
    events.push_back(e);
    cv.notify_all();
  });
  {
    std::lock_guard lock(daemon.mu);
    daemon.pushes_before_next_heartbeat.push_back({1, 2, 3});  // truncated: must be ignored
    std::vector<uint8_t> body;
    wire::EncodeEvictNotice({.lease_ids = {(*leases)[1].id()}, .grace_ms = 750}, &body);
    daemon.pushes_before_next_heartbeat.push_back(body);
  }
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, milliseconds(3000), [&] { return !events.empty(); }));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, EventType::kEvictNotice);
  EXPECT_EQ(events[0].node, 0u);
  EXPECT_EQ(events[0].lease_ids, std::vector<uint64_t>{(*leases)[1].id()});
  EXPECT_EQ(events[0].grace_ms, 750u);
  EXPECT_TRUE((*c)->node(0).alive);
}

// A notice the client learns only from HEARTBEAT's list (it was pushed on a connection that has
// closed since: a reconnect, or a restarted process that adopted the leases): one kEvictNotice
// for the held lease, with the grace the list gives, not repeated while every later heartbeat
// lists it again; a listed lease the client does not hold is shown as noticed_not_held.
TEST(ClusterWithFakeDaemon, NoticedLeasesInHeartbeatRepliesBecomeOneEvent) {
  FakeDaemon daemon;
  auto c = Cluster::Connect(FakeOptions(daemon));
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  auto leases = (*c)->Allocate(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  std::mutex mu;
  std::vector<Event> events;
  (*c)->Subscribe([&](const Event& e) {
    std::lock_guard lock(mu);
    events.push_back(e);
  });
  const uint64_t stranger = FakeDaemon::Grant(99).lease_id;
  size_t listed_from = 0;
  {
    std::lock_guard lock(daemon.mu);
    daemon.noticed = {{(*leases)[0].id(), 40000}, {stranger, 40000}};
    listed_from = daemon.heartbeats;
  }
  ASSERT_TRUE(testing::WaitUntil(
      [&] { return (*c)->node(0).noticed_not_held == std::vector<uint64_t>{stranger}; },
      milliseconds(3000)));
  // Five more heartbeats list the same leases: still one event.
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        std::lock_guard lock(daemon.mu);
        return daemon.heartbeats >= listed_from + 6;
      },
      milliseconds(3000)));
  std::lock_guard lock(mu);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, EventType::kEvictNotice);
  EXPECT_EQ(events[0].lease_ids, std::vector<uint64_t>{(*leases)[0].id()});
  EXPECT_EQ(events[0].grace_ms, 40000u);
  EXPECT_TRUE((*c)->node(0).alive);
}

// The client learns the daemon's version from HELLO and warns when the major versions differ
// (issue 14); a daemon of the same major version, or one that does not say, is not warned about.
TEST(ClusterWithFakeDaemon, WarnsWhenTheDaemonsMajorVersionDiffers) {
  testing::LogCapture log;
  auto warnings = [&] { return log.Matching("major versions"); };
  const uint32_t ours = *wire::VersionMajor(kVersion);
  const std::string other = std::to_string(ours + 1) + ".0.0 (fake)";
  for (const std::string& version : {other, std::string(kVersionString), std::string()}) {
    const size_t before = warnings().size();
    FakeDaemon daemon;
    {
      std::lock_guard lock(daemon.mu);
      daemon.hello_version = version;
    }
    auto c = Cluster::Connect(FakeOptions(daemon));
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    const std::vector<std::string> w = warnings();
    if (version == other) {
      ASSERT_EQ(w.size(), before + 1);
      EXPECT_NE(w.back().find(daemon.endpoint().ToString() + " runs farmemd " + other),
                std::string::npos)
          << w.back();
      EXPECT_NE(w.back().find(fmt::format("major versions {} and {} differ", ours + 1, ours)),
                std::string::npos)
          << w.back();
    } else {
      EXPECT_EQ(w.size(), before) << "warned about version '" << version << "'";
    }
  }
}

TEST(ClusterWithFakeDaemon, AllocReplyWithExtraLeasesKeepsOneAndFreesTheExtras) {
  FakeDaemon daemon;
  {
    std::lock_guard lock(daemon.mu);
    daemon.alloc_reply = [] {
      return std::vector<wire::LeaseGrant>{FakeDaemon::Grant(1), FakeDaemon::Grant(2)};
    };
  }
  auto c = Cluster::Connect(FakeOptions(daemon));
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  auto l = (*c)->Allocate(1);
  // One lease is used, the unasked-for extra goes back (on the next heartbeat at the latest).
  ASSERT_TRUE(l.has_value()) << l.error().ToString();
  EXPECT_EQ(l->front().id(), FakeDaemon::Grant(1).lease_id);
  ASSERT_TRUE(farmem::testing::WaitUntil(
      [&] {
        std::lock_guard lock(daemon.mu);
        return daemon.freed == std::vector<uint64_t>{FakeDaemon::Grant(2).lease_id};
      },
      milliseconds(3000)))
      << "the extra lease was never freed";
}

TEST(ClusterWithFakeDaemon, EmptyAllocReplyIsAProtocolErrorNotACrash) {
  FakeDaemon daemon;
  {
    std::lock_guard lock(daemon.mu);
    daemon.alloc_reply = [] { return std::vector<wire::LeaseGrant>{}; };
  }
  auto c = Cluster::Connect(FakeOptions(daemon));
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  auto l = (*c)->Allocate(1);
  ASSERT_FALSE(l.has_value());
  EXPECT_EQ(l.error().code(), StatusCode::kUnavailable);  // not "full": the daemon misbehaved
  EXPECT_NE(l.error().message().find("no daemon could grant a slab"), std::string::npos)
      << l.error().message();
  EXPECT_NE(l.error().message().find("granted 0 leases"), std::string::npos) << l.error().message();
}

}  // namespace
}  // namespace farmem::client
