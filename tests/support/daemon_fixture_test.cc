// The fixture other integration tests stand on: daemons start, listen, die, come back on the same
// port as a new incarnation, and stop cleanly.
#include "support/daemon_fixture.h"

#include <gtest/gtest.h>

#include "farmem/transport/tcp_connection.h"
#include "support/process.h"

namespace farmem::testing {
namespace {

using std::chrono::milliseconds;

Result<transport::TcpConnection> Dial(const Endpoint& ep, const std::string& secret,
                                      milliseconds timeout = milliseconds(2000)) {
  transport::ChannelOptions o;
  o.endpoint = ep;
  o.credentials.secret = secret;
  o.credentials.client_name = "daemon_fixture_test";
  o.connect_timeout = timeout;
  o.op_timeout = timeout;
  return transport::TcpConnection::Connect(o);
}

TEST(DaemonFixture, StartsDistinctDaemonsThatAcceptAuthenticatedClients) {
  DaemonSet daemons;
  ASSERT_TRUE(daemons.Start(2).ok());
  ASSERT_EQ(daemons.size(), 2u);
  EXPECT_NE(daemons[0].port(), daemons[1].port());
  auto a = Dial(daemons[0].endpoint(), daemons.secret());
  auto b = Dial(daemons[1].endpoint(), daemons.secret());
  ASSERT_TRUE(a.has_value()) << a.error().ToString() << daemons.Logs();
  ASSERT_TRUE(b.has_value()) << b.error().ToString() << daemons.Logs();
  EXPECT_NE(a->hello().node_id, b->hello().node_id);
}

TEST(DaemonFixture, KilledDaemonRefusesAndRestartsOnSamePortAsNewIncarnation) {
  DaemonSet daemons;
  ASSERT_TRUE(daemons.Start(1).ok());
  const Endpoint ep = daemons[0].endpoint();
  auto before = Dial(ep, daemons.secret());
  ASSERT_TRUE(before.has_value()) << before.error().ToString();

  daemons[0].Kill();
  EXPECT_FALSE(daemons[0].running());
  EXPECT_FALSE(Dial(ep, daemons.secret()).has_value());

  ASSERT_TRUE(daemons[0].Restart().ok()) << daemons.Logs();
  EXPECT_EQ(daemons[0].endpoint(), ep);
  auto after = Dial(ep, daemons.secret());
  ASSERT_TRUE(after.has_value()) << after.error().ToString();
  EXPECT_NE(after->hello().node_id, before->hello().node_id);
}

TEST(DaemonFixture, PausedDaemonDoesNotAnswerUntilResumed) {
  DaemonSet daemons;
  ASSERT_TRUE(daemons.Start(1).ok());
  daemons[0].Pause();
  auto hung = Dial(daemons[0].endpoint(), daemons.secret(), milliseconds(300));
  EXPECT_FALSE(hung.has_value());
  daemons[0].Resume();
  auto ok = Dial(daemons[0].endpoint(), daemons.secret());
  EXPECT_TRUE(ok.has_value()) << ok.error().ToString();
}

TEST(DaemonFixture, StopsCleanlyOnSigterm) {
  DaemonSet daemons;
  ASSERT_TRUE(daemons.Start(1).ok());
  Status st = daemons[0].Stop();
  EXPECT_TRUE(st.ok()) << st.ToString() << daemons.Logs();
  EXPECT_FALSE(daemons[0].running());
}

TEST(DaemonFixture, BadOptionFailsStartWithTheDaemonsLog) {
  DaemonSet daemons(DaemonConfig{.capacity = "not-a-size"});
  Status st = daemons.Start(1);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("capacity"), std::string::npos) << st.message();
}

// support/fatal_failure_ends_test.cc: a helper's failed ASSERT ends the test that called it. The
// disabled test below is run as a child (this binary, filtered to it): the helper fails, and the
// line after the call must not run.
void HelperThatFailsFatally() { ASSERT_TRUE(false) << "the helper's own failure"; }

TEST(FatalFailure, DISABLED_InAHelperEndsTheTest) {
  HelperThatFailsFatally();
  std::printf("the test went on after its helper failed\n");
  std::fflush(stdout);
}

TEST(FatalFailure, InAHelperEndsTheTestNotJustTheHelper) {
  const CommandResult r = RunCommand({"/proc/self/exe", "--gtest_also_run_disabled_tests",
                                      "--gtest_filter=FatalFailure.DISABLED_InAHelperEndsTheTest"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("the helper's own failure"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[  FAILED  ] FatalFailure.DISABLED_InAHelperEndsTheTest"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("went on"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace farmem::testing
