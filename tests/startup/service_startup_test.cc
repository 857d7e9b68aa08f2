// The programs as systemd runs them (issue 14): every one answers --version with the build's
// version, and farmemd and farmem-nbd (Type=notify units) send READY=1 only once they accept
// connections, STOPPING=1 on SIGTERM -- checked with a stand-in for systemd's notification socket.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include "farmem/common/version.h"
#include "support/notify_socket.h"
#include "support/process.h"

namespace farmem::testing {
namespace {

using std::chrono::seconds;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Connects to 127.0.0.1:port (TCP) or a Unix socket path: true if the connection is accepted.
bool ConnectTcp(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}
bool ConnectUnix(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

TEST(ServiceStartupTest, EveryProgramPrintsItsVersion) {
  for (const std::string program : {"farmemd", "farmem-nbd", "farmemctl"}) {
    const CommandResult r = RunCommand({BinPath(program), "--version"}, seconds(20));
    EXPECT_EQ(r.exit_code, 0) << program << ": " << r.err;
    EXPECT_EQ(r.out, program + " " + std::string(kVersionString) + "\n");
    EXPECT_THAT(r.out, StartsWith(program + " " + std::string(kVersion)));
  }
}

TEST(ServiceStartupTest, FarmemdIsReadyOnlyOnceItListensAndSaysWhenItStops) {
  TempDir dir("svc");
  NotifySocket notify(dir.File("notify"));
  ASSERT_TRUE(notify.ok());
  ScopedEnv env("NOTIFY_SOCKET", notify.path());
  auto daemon = ChildProcess::Spawn(
      {BinPath("farmemd"), "--listen", "127.0.0.1:0", "--port-file", dir.File("port"), "--capacity",
       "4M", "--slab-size", "1M", "--no-mlock", "--no-prefault"},
      {.stderr_path = dir.File("farmemd.log"), .kill_with_parent = true});
  ASSERT_TRUE(daemon.has_value()) << daemon.error().ToString();
  auto ready = notify.ReceiveContaining("READY=1", seconds(30));
  ASSERT_TRUE(ready.has_value()) << "no READY=1; log:\n" << ReadFile(dir.File("farmemd.log"));
  // READY=1 means serving: the listener is up (and the port file written) by then.
  const std::string port = ReadFile(dir.File("port"));
  ASSERT_FALSE(port.empty()) << "READY=1 before the port file";
  EXPECT_TRUE(ConnectTcp(std::stoi(port))) << "READY=1 but port " << port << " refuses";
  EXPECT_THAT(*ready, HasSubstr("STATUS=lending 4194304 bytes on 127.0.0.1:" +
                                std::to_string(std::stoi(port))));
  daemon->Signal(SIGTERM);
  auto stopping = notify.ReceiveContaining("STOPPING=1", seconds(30));
  EXPECT_TRUE(stopping.has_value());
  const auto status = daemon->WaitExit(seconds(30));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << DescribeExit(*status);
}

TEST(ServiceStartupTest, FarmemNbdIsReadyOnlyOnceItListens) {
  TempDir dir("svc");
  NotifySocket notify(dir.File("notify"));
  ASSERT_TRUE(notify.ok());
  ScopedEnv env("NOTIFY_SOCKET", notify.path());
  const std::string sock = dir.File("nbd.sock");
  auto nbd = ChildProcess::Spawn({BinPath("farmem-nbd"), "--backend", "memory", "--size", "1M",
                                  "--no-swap-safe", "--unix", sock},
                                 {.stderr_path = dir.File("nbd.log"), .kill_with_parent = true});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  auto ready = notify.ReceiveContaining("READY=1", seconds(30));
  ASSERT_TRUE(ready.has_value()) << "no READY=1; log:\n" << ReadFile(dir.File("nbd.log"));
  EXPECT_TRUE(ConnectUnix(sock)) << "READY=1 but " << sock << " refuses";
  EXPECT_THAT(*ready, HasSubstr("STATUS=serving 1048576 bytes from the memory backend"));
  nbd->Signal(SIGTERM);
  EXPECT_TRUE(notify.ReceiveContaining("STOPPING=1", seconds(30)).has_value());
  const auto status = nbd->WaitExit(seconds(30));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << DescribeExit(*status);
}

}  // namespace
}  // namespace farmem::testing
