// Cluster::Connect rejects bad options and reports unreachable peers one by one (no daemons).
#include <gtest/gtest.h>

#include "farmem/client/cluster.h"
#include "farmem/common/socket.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;

// A port on 127.0.0.1 that nobody listens on: bound, then closed.
uint16_t DeadPort() {
  auto s = ListenTcp(Endpoint{"127.0.0.1", 0});
  EXPECT_TRUE(s.has_value());
  auto port = LocalPort(*s);
  EXPECT_TRUE(port.has_value());
  return *port;
}

TEST(ClusterOptions, NeedsPeers) {
  auto c = Cluster::Connect(ClusterOptions{});
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.error().message().find("peers"), std::string::npos) << c.error().message();
}

TEST(ClusterOptions, FailureTimeoutMustExceedHeartbeatInterval) {
  ClusterOptions o;
  o.peers = {Endpoint{"127.0.0.1", 1}};
  o.heartbeat_interval = milliseconds(500);
  o.failure_timeout = milliseconds(500);
  auto c = Cluster::Connect(o);
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.error().message().find("failure_timeout"), std::string::npos);
}

TEST(ClusterOptions, UnknownTransportIsRejected) {
  ClusterOptions o;
  o.peers = {Endpoint{"127.0.0.1", 1}};
  o.transport = "carrier-pigeon";
  auto c = Cluster::Connect(o);
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.error().message().find("carrier-pigeon"), std::string::npos);
}

TEST(ClusterOptions, BadDnsPeerIsRejected) {
  ClusterOptions o;
  o.peers_dns = "[::1";
  auto c = Cluster::Connect(o);
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message().find("peers_dns"), std::string::npos) << c.error().message();
}

TEST(ClusterConnect, NoReachablePeerFailsNamingEachPeer) {
  ClusterOptions o;
  const Endpoint a{"127.0.0.1", DeadPort()};
  const Endpoint b{"127.0.0.1", DeadPort()};
  o.peers = {a, b};
  o.connect_timeout = milliseconds(500);
  auto c = Cluster::Connect(o);
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kUnavailable);
  EXPECT_NE(c.error().message().find(a.ToString()), std::string::npos) << c.error().message();
  EXPECT_NE(c.error().message().find(b.ToString()), std::string::npos) << c.error().message();
}

TEST(ClusterConnect, UnresolvableDnsNameFailsClearly) {
  ClusterOptions o;
  o.peers_dns = "no-such-host.invalid:7411";
  o.connect_timeout = milliseconds(500);
  auto c = Cluster::Connect(o);
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message().find("no-such-host.invalid"), std::string::npos)
      << c.error().message();
}

TEST(EventTypeName, NamesEveryType) {
  EXPECT_STREQ(EventTypeName(EventType::kNodeDown), "NodeDown");
  EXPECT_STREQ(EventTypeName(EventType::kNodeUp), "NodeUp");
  EXPECT_STREQ(EventTypeName(EventType::kLeasesLost), "LeasesLost");
  EXPECT_STREQ(EventTypeName(EventType::kEvictNotice), "EvictNotice");
}

}  // namespace
}  // namespace farmem::client
