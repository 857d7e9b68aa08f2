// systemd::Notify* and ServiceMonitor (common/service_notify.h) against a stand-in for systemd's
// notification socket: what they send, that the watchdog pings only while the probe succeeds and
// only when WatchdogSec= asked for it, and that nothing happens outside systemd.
#include "farmem/common/service_notify.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>

#include "support/notify_socket.h"
#include "support/process.h"

namespace farmem::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::HasSubstr;
using ::testing::Not;

class ServiceNotifyTest : public ::testing::Test {
 protected:
  TempDir dir_{"notify"};
  NotifySocket notify_{dir_.File("notify")};
};

TEST_F(ServiceNotifyTest, ReadyStatusAndStoppingReachTheSocket) {
  ASSERT_TRUE(notify_.ok());
  ScopedEnv env("NOTIFY_SOCKET", notify_.path());
  EXPECT_TRUE(systemd::NotifyEnabled());
  systemd::NotifyReady("lending 4 MiB\non two lines");
  EXPECT_EQ(notify_.Receive(seconds(5)), "READY=1\nSTATUS=lending 4 MiB on two lines");
  systemd::NotifyStatus("3 clients");
  EXPECT_EQ(notify_.Receive(seconds(5)), "STATUS=3 clients");
  systemd::NotifyStopping("SIGTERM");
  EXPECT_EQ(notify_.Receive(seconds(5)), "STOPPING=1\nSTATUS=SIGTERM");
}

TEST_F(ServiceNotifyTest, OutsideSystemdNothingIsSentAndNoThreadStarts) {
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_FALSE(systemd::NotifyEnabled());
  systemd::NotifyReady("x");  // must not crash or block
  EXPECT_EQ(systemd::ServiceMonitor::Start([] { return Result<std::string>("up"); }), nullptr);
}

TEST_F(ServiceNotifyTest, WatchdogPingsWhileTheProbeSucceedsAndTriggersWhenItFails) {
  ASSERT_TRUE(notify_.ok());
  ScopedEnv env("NOTIFY_SOCKET", notify_.path());
  ScopedEnv usec("WATCHDOG_USEC", "100000");  // 100 ms: pinged every 50 ms
  ScopedEnv pid("WATCHDOG_PID", std::to_string(::getpid()));
  EXPECT_EQ(systemd::WatchdogInterval(), std::chrono::microseconds(100000));
  std::atomic<bool> healthy{true};
  auto monitor = systemd::ServiceMonitor::Start([&]() -> Result<std::string> {
    if (!healthy) return std::unexpected(Status(StatusCode::kInternal, "server lock stuck"));
    return std::string("2 clients");
  });
  ASSERT_NE(monitor, nullptr);
  // The first round says the status and pings; later rounds only ping (the status is unchanged).
  EXPECT_EQ(notify_.Receive(seconds(5)), "STATUS=2 clients\nWATCHDOG=1");
  EXPECT_EQ(notify_.Receive(seconds(5)), "WATCHDOG=1");
  EXPECT_EQ(notify_.Receive(seconds(5)), "WATCHDOG=1");
  healthy = false;
  auto trigger = notify_.ReceiveContaining("WATCHDOG=trigger", seconds(5));
  ASSERT_TRUE(trigger.has_value());
  EXPECT_THAT(*trigger, HasSubstr("STATUS=unhealthy: "));
  EXPECT_THAT(*trigger, HasSubstr("server lock stuck"));
  EXPECT_THAT(*trigger, Not(HasSubstr("WATCHDOG=1")));
  monitor.reset();  // joins: nothing more is sent
  while (auto msg = notify_.Receive(milliseconds(0))) {
    EXPECT_THAT(*msg, Not(HasSubstr("WATCHDOG=1"))) << "pinged while unhealthy";
  }
}

TEST_F(ServiceNotifyTest, WithoutWatchdogSecOnlyStatusIsSent) {
  ASSERT_TRUE(notify_.ok());
  ScopedEnv env("NOTIFY_SOCKET", notify_.path());
  ::unsetenv("WATCHDOG_USEC");
  EXPECT_EQ(systemd::WatchdogInterval(), std::chrono::microseconds(0));
  std::atomic<int> round{0};
  auto monitor = systemd::ServiceMonitor::Start(
      [&]() -> Result<std::string> { return "round " + std::to_string(round++ / 2); },
      milliseconds(10));
  ASSERT_NE(monitor, nullptr);
  EXPECT_EQ(notify_.Receive(seconds(5)), "STATUS=round 0");
  EXPECT_EQ(notify_.Receive(seconds(5)), "STATUS=round 1");  // round 0 again was not re-sent
  EXPECT_EQ(notify_.Receive(seconds(5)), "STATUS=round 2");
}

// systemd may name an abstract socket ("@name"); the datagram goes to that name, not to a file.
TEST_F(ServiceNotifyTest, AbstractSocketNameIsReached) {
  const std::string name = "farmem-notify-test-" + std::to_string(::getpid());
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  ScopedEnv env("NOTIFY_SOCKET", "@" + name);
  systemd::NotifyStatus("abstract");
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1) << "nothing arrived on @" << name;
  char buf[256];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  ::close(fd);
  EXPECT_EQ(std::string(buf, static_cast<size_t>(std::max<ssize_t>(n, 0))), "STATUS=abstract");
}

TEST_F(ServiceNotifyTest, WatchdogMeantForAnotherProcessIsIgnored) {
  ScopedEnv usec("WATCHDOG_USEC", "100000");
  ScopedEnv pid("WATCHDOG_PID", std::to_string(::getpid() + 1));
  EXPECT_EQ(systemd::WatchdogInterval(), std::chrono::microseconds(0));
}

}  // namespace
}  // namespace farmem::testing
