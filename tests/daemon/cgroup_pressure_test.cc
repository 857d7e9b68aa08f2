// Memory pressure for real (issue 12): farmemd runs in a memory cgroup of its own with a limit
// (cgroup v1 on these hosts, v2 in the test guest), a client leases and fills slabs, then a memory
// hog starts in the same cgroup. The daemon must stop granting, send EVICT_NOTICE, give the
// memory of the (ignored) noticed leases back — its RSS drops — and, once the hog is gone, grant
// again and grow. Skipped where no memory cgroup can be made (not root, no controller).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "daemon_client.h"
#include "support/daemon_fixture.h"

namespace farmem::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kLimit = 512 * kMiB;
constexpr uint64_t kSlab = 16 * kMiB;

uint64_t RssBytes(pid_t pid) {
  return static_cast<uint64_t>(std::max(0L, ProcStatus(pid, "VmRSS"))) * 1024;
}

// A child memory cgroup of this process's own, removed at the end.
class TestCgroup {
 public:
  TestCgroup() {
    std::ifstream in("/proc/self/cgroup");
    std::string line, v1, v2;
    while (std::getline(in, line)) {
      const size_t a = line.find(':'), b = line.find(':', a + 1);
      const std::string ctl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
      if (line.rfind("0::", 0) == 0) v2 = path;
      if (ctl == "memory") v1 = path;
    }
    const std::string name = "farmem-pressure-" + std::to_string(::getpid());
    std::error_code ec;
    if (!v1.empty() && fs::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes")) {
      dir_ = fs::path("/sys/fs/cgroup/memory") / fs::path(v1).relative_path() / name;
      limit_file_ = "memory.limit_in_bytes";
    } else if (fs::exists("/sys/fs/cgroup/cgroup.controllers")) {
      dir_ = fs::path("/sys/fs/cgroup") / fs::path(v2).relative_path() / name;
      limit_file_ = "memory.max";
    } else {
      why_ = "no memory cgroup controller";
      return;
    }
    if (!fs::create_directory(dir_, ec) && ec) {
      why_ = "cannot create " + dir_.string() + ": " + ec.message();
      dir_.clear();
      return;
    }
    if (!Write(limit_file_, std::to_string(kLimit))) {
      why_ = "cannot set " + (dir_ / limit_file_).string();
    }
  }
  ~TestCgroup() {
    if (dir_.empty()) return;
    std::error_code ec;
    fs::remove(dir_, ec);  // rmdir: every process has left it by now
  }
  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  const fs::path& dir() const { return dir_; }
  bool Join(pid_t pid) { return Write("cgroup.procs", std::to_string(pid)); }

 private:
  bool Write(const std::string& file, const std::string& value) {
    std::ofstream out(dir_ / file);
    out << value << "\n";
    out.flush();
    return out.good();
  }
  fs::path dir_;
  std::string limit_file_;
  std::string why_;
};

// A process in the cgroup that takes `bytes` and holds them until killed.
pid_t StartHog(TestCgroup& cg, uint64_t bytes, int ready_fd_out[2]) {
  if (::pipe(ready_fd_out) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready_fd_out[0]);
    if (!cg.Join(::getpid())) _exit(2);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) _exit(3);
    std::memset(p, 1, bytes);
    const char ok = 1;
    (void)!::write(ready_fd_out[1], &ok, 1);
    for (;;) ::pause();
  }
  ::close(ready_fd_out[1]);
  return pid;
}

TEST(CgroupPressureTest, HogMakesTheDaemonStopGrantingEvictAndShrinkThenGrowBack) {
  TestCgroup cg;
  if (!cg.ok()) GTEST_SKIP() << cg.why();
  DaemonSet daemons(
      {.capacity = "256M",
       .slab_size = "16M",
       .lease_ttl_ms = 600000,  // the client heartbeats only at the end
       .extra_args = {"--memory-source", "cgroup:" + cg.dir().string(), "--reserve", "96M",
                      "--evict-grace-ms", "1000", "--pressure-interval-ms", "100"}});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const pid_t daemon = daemons[0].pid();
  ASSERT_TRUE(cg.Join(daemon)) << "cannot move farmemd into " << cg.dir();

  auto c = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  auto leases = c->Alloc(8);  // 128 MiB, populated at grant, charged to the cgroup
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString() << daemons.Logs();
  const uint64_t rss_leased = RssBytes(daemon);
  EXPECT_GE(rss_leased, 8 * kSlab);

  // 512 MiB limit: 128 MiB lent + 300 MiB hog leaves < 96 MiB (the reserve) available.
  int ready[2];
  pid_t hog = StartHog(cg, 300 * kMiB, ready);
  ASSERT_GT(hog, 0);
  struct Reaper {  // the hog must not outlive a failed assertion (it would pin the cgroup)
    pid_t* pid;
    ~Reaper() {
      if (*pid > 0) {
        ::kill(*pid, SIGKILL);
        ::waitpid(*pid, nullptr, 0);
      }
    }
  } reaper{&hog};
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1) << "the hog did not start";
  ::close(ready[0]);

  // Stops granting, then (this client ignores notices) evicts and gives memory back.
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto st = c->Stat();
        return st.has_value() && (st->features & wire::kStateUnderPressure) != 0;
      },
      milliseconds(10000)))
      << daemons.Logs();
  auto refused = c->Alloc(1);
  EXPECT_FALSE(refused.has_value()) << "granted a slab under memory pressure";
  ASSERT_TRUE(
      WaitUntil([&] { return RssBytes(daemon) <= rss_leased - kSlab + kMiB; }, milliseconds(15000)))
      << "RSS did not drop: " << RssBytes(daemon) << " (leased: " << rss_leased << ")\n"
      << daemons.Logs();
  (void)c->Heartbeat();  // reads the EVICT_NOTICE pushed ahead of the reply
  const auto pushes = c->control().TakePushes();
  EXPECT_FALSE(pushes.empty()) << "no EVICT_NOTICE reached the client";
  auto hb = c->Heartbeat();
  ASSERT_TRUE(hb.has_value());
  EXPECT_LT(hb->leases_held, 8u);
  EXPECT_GT(hb->leases_held, 0u) << "evicted more than the deficit\n" << daemons.Logs();

  // The hog leaves: the daemon grants again, and grows with what it lends.
  ::kill(hog, SIGKILL);
  ::waitpid(hog, nullptr, 0);
  hog = -1;
  const uint64_t rss_low = RssBytes(daemon);
  ASSERT_TRUE(WaitUntil([&] { return c->Alloc(2).has_value(); }, milliseconds(10000)))
      << daemons.Logs();
  EXPECT_GE(RssBytes(daemon), rss_low + 2 * kSlab - 4 * kMiB);
  (void)daemons[0].Stop();
}

}  // namespace
}  // namespace farmem::testing
