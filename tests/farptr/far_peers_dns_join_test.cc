// --peers-dns join (issue 11, gap 5): a daemon added to the DNS name while a client runs is used
// for re-protection. The name is resolved by getaddrinfo, which reads /etc/hosts first
// (nsswitch "hosts: files dns") on every lookup; so the test runs in its own user and mount
// namespace (no root needed: unprivileged user namespaces) with a private file bind-mounted over
// /etc/hosts, and adds the new daemon's loopback address to it. Every daemon listens on the same
// port at its own 127.0.0.x address, as the pods behind a headless service do. If the kernel
// refuses unprivileged user namespaces, the test is skipped and says why.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "farmem/client/cluster.h"
#include "farptr_fixture.h"
#include "support/test_runtime.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr char kName[] = "farmem-peers.test";

bool WriteAll(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);  // in place: the bind mount follows the inode
  out << text;
  return static_cast<bool>(out);
}

// Enters a new user + mount namespace and bind-mounts `hosts` over /etc/hosts. Must run while
// the process has one thread. Returns why not, or "".
std::string PrivateHostsFile(const std::string& hosts) {
  const uid_t uid = getuid();
  const gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) {
    return std::string("unshare(CLONE_NEWUSER | CLONE_NEWNS): ") + std::strerror(errno);
  }
  if (!WriteAll("/proc/self/setgroups", "deny") ||
      !WriteAll("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
      !WriteAll("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
    return "cannot write the namespace's uid/gid maps";
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return std::string("making / private: ") + std::strerror(errno);
  }
  if (mount(hosts.c_str(), "/etc/hosts", nullptr, MS_BIND, nullptr) != 0) {
    return std::string("bind-mounting over /etc/hosts: ") + std::strerror(errno);
  }
  return "";
}

class FarPeersDnsJoinTest : public FarptrTest {
 protected:
  static void SetUpTestSuite() {
    hosts_dir_ = new testing::TempDir();
    hosts_ = hosts_dir_->File("hosts");
    if (!WriteAll(hosts_, "127.0.0.1 localhost\n")) {
      skip_why_ = new std::string("cannot write " + hosts_);
      return;
    }
    skip_why_ = new std::string(PrivateHostsFile(hosts_));
  }

  void SetHosts(const std::vector<std::string>& addrs) {
    std::string text = "127.0.0.1 localhost\n";
    for (const std::string& a : addrs) text += a + " " + kName + "\n";
    ASSERT_TRUE(WriteAll(hosts_, text));
  }

  std::unique_ptr<testing::DaemonProcess> Daemon(const std::string& addr, uint16_t port,
                                                 const std::string& name) {
    testing::DaemonConfig cfg;
    cfg.capacity = "16M";
    cfg.slab_size = "1M";
    cfg.log_level = "warn";
    cfg.listen_host = addr;
    cfg.port = port;
    auto d = std::make_unique<testing::DaemonProcess>(cfg, dir_.path(), name);
    Status s = d->Start();
    EXPECT_TRUE(s.ok()) << s.ToString();
    return s.ok() ? std::move(d) : nullptr;
  }

  static testing::TempDir* hosts_dir_;
  static std::string hosts_;
  static std::string* skip_why_;
  testing::TempDir dir_;
};
testing::TempDir* FarPeersDnsJoinTest::hosts_dir_ = nullptr;
std::string FarPeersDnsJoinTest::hosts_;
std::string* FarPeersDnsJoinTest::skip_why_ = nullptr;

// replicate:2 behind a name that first resolves to two daemons. One dies: every span set runs
// degraded (no third daemon). A third daemon starts and is added to the name: the client finds it
// at its next re-resolve, re-protects every set onto it, and a second failure loses nothing.
TEST_F(FarPeersDnsJoinTest, DaemonAddedToTheNameIsUsedForReprotection) {
  if (!skip_why_->empty()) GTEST_SKIP() << "no private /etc/hosts: " << *skip_why_;
  auto a = Daemon("127.0.0.2", 0, "farmemd-a");
  ASSERT_TRUE(a);
  const uint16_t port = a->port();
  auto b = Daemon("127.0.0.3", port, "farmemd-b");
  ASSERT_TRUE(b);
  ASSERT_NO_FATAL_FAILURE(SetHosts({"127.0.0.2", "127.0.0.3"}));

  RuntimeOptions o =
      testing::TestRuntimeOptions({}, testing::DaemonConfig{}.secret, "replicate:2", 256u << 10);
  o.peers_dns = std::string(kName) + ":" + std::to_string(port);
  o.reconcile_interval = milliseconds(500);
  ASSERT_NO_FATAL_FAILURE(Open(o));
  ASSERT_EQ(rt_->cluster().node_count(), 2u);

  std::vector<far_bytes> objs;
  for (size_t i = 0; i < 2000; ++i) {
    objs.push_back(make_far_bytes_in(*rt_, 700));
    DerefScope s;
    Fill(objs.back().deref_mut(s), i, 1);
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_GT(rt_->stats().remote_spans, 0u);

  a->Kill();
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return rt_->stats().degraded_span_sets > 0; },
                                         std::chrono::seconds(15)))
      << "the kill was not noticed";

  auto c = Daemon("127.0.0.4", port, "farmemd-c");
  ASSERT_TRUE(c);
  ASSERT_NO_FATAL_FAILURE(SetHosts({"127.0.0.3", "127.0.0.4"}));
  const auto added = steady_clock::now();
  // The client re-resolves the name every dns_refresh_interval (10 s by default).
  const bool reprotected = farmem::testing::WaitUntil(
      [&] {
        const RuntimeStats s = rt_->stats();
        return s.degraded_span_sets == 0 && s.members_reprotected > 0;
      },
      std::chrono::seconds(40));
  ASSERT_TRUE(reprotected) << "the daemon added to " << kName << " was not used: nodes "
                           << rt_->cluster().node_count() << ", degraded sets "
                           << rt_->stats().degraded_span_sets;
  std::fprintf(stderr, "re-protected onto the daemon added to the name %ld ms after it was added\n",
               static_cast<long>(
                   std::chrono::duration_cast<milliseconds>(steady_clock::now() - added).count()));
  size_t on_c = 0;
  for (const client::NodeInfo& n : rt_->cluster().nodes()) {
    if (n.endpoint.host == "127.0.0.4") on_c = n.leases_held;
  }
  EXPECT_GT(on_c, 0u);

  b->Kill();  // the second failure: every set still has its copy on c
  for (size_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    auto got = objs[i].try_deref(s);
    ASSERT_TRUE(got.has_value()) << "object " << i << ": " << got.error().ToString();
    ASSERT_TRUE(Matches(*got, i, 1)) << "object " << i;
  }
  // Every far object dies before its runtime (farmem/runtime.h). This test once ended with
  // rt_.reset() alone: `objs` was destroyed after it, and each far_bytes freed itself into the
  // destroyed heap, locking a mutex in freed memory: a hang on a lock nobody holds, or glibc's
  // "Assertion `e != ESRCH || !robust'" when the reused bytes looked like a robust PI mutex.
  objs.clear();
  rt_.reset();  // before the daemons (locals) stop, so their exit is not taken for a failure
}

}  // namespace
}  // namespace farmem::farptr_test
