// Issue 13 item 6: the memory a swap-safe farmem-nbd locks. Under --swap-safe every byte it maps
// is locked (mlockall(MCL_CURRENT|MCL_FUTURE)), taken from a host that is short of memory: a
// farmem backend on two farmemd daemons must lock at most 7 MiB of its own (anonymous) memory at
// idle, 16 MiB in all where the libraries are locked on fault, and at most 2 MiB more per
// connection (it locked 120 MiB and 33.5 MiB: 8 MiB thread stacks
// and 32 MiB request buffers). Then a 32 MiB WRITE, READ, WRITE_ZEROES and TRIM (served in pieces
// by the connection and the page store) must be correct and grow nothing per connection.
//
// The program's and its libraries' files (16 MiB on Debian 12) are locked too; they depend on the
// distribution and the build, so the test prints them and bounds only what farmem-nbd allocates.
// Skipped where mlockall is not permitted and in sanitizer builds (their shadow memory cannot be
// locked).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "nbd_test_client.h"
#include "support/daemon_fixture.h"
#include "support/sanitizer.h"
#include "test_process.h"

namespace farmem::blockdev {
namespace {

using namespace farmem::blockdev::nbd;  // NOLINT(build/namespaces)
using farmem::testing::ProcStatus;
using testing::FarmemNbd;
using testing::NbdTestClient;
using testing::Pattern;

// Its own memory at idle: 5.0 MiB measured with these two daemons (the 256-page write cache, 4
// page store workers, 6 threads' stacks, heap); 10.1 MiB before (1024 pages, 8 workers): this
// fails. Together with the files (~10 MiB where the IO-flusher step works) the 16 MiB in
// all.
constexpr long kIdleOwnKiB = 7 << 10;
// Everything, where the libraries are locked on fault (the IO-flusher step worked: the guest).
constexpr long kIdleTotalKiB = 16 << 10;
constexpr long kPerConnectionKiB = 2 << 10;
constexpr long kIdleFileKiB = 13 << 10;

struct Locked {
  long anonymous_kib = 0;  // stacks, heap, buffers: what farmem-nbd allocated
  long file_kib = 0;       // the program and its libraries
};

// Resident memory of the locked mappings (/proc/PID/smaps: Rss where Locked is not 0; Locked
// itself is a proportional share, small for libraries other processes map too).
Locked LockedMemory(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  Locked out;
  bool file = false;
  long rss = 0;
  for (std::string line; std::getline(in, line);) {
    std::istringstream f(line);
    std::string first, second;
    f >> first >> second;
    if (first == "Rss:") {
      rss = std::stol(second);
    } else if (first == "Locked:") {
      if (std::stol(second) > 0) (file ? out.file_kib : out.anonymous_kib) += rss;
    } else if (first.find('-') != std::string::npos && first.back() != ':') {
      std::string offset, dev, inode, path;
      f >> offset >> dev >> inode >> path;
      file = !path.empty() && path[0] == '/';
    }
  }
  return out;
}

TEST(NbdFootprintTest, SwapSafeFarmemBackendLocksLittleAtIdleAndPerConnection) {
#if FARMEM_SANITIZED
  GTEST_SKIP() << "sanitizer build: its shadow memory cannot be locked (mlockall)";
#endif
  farmem::testing::DaemonSet daemons({.capacity = "64M",
                                      .slab_size = "4M",
                                      .extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(2).ok()) << daemons.Logs();
  std::string peers;
  for (const Endpoint& ep : daemons.endpoints()) {
    peers += (peers.empty() ? "" : ",") + ep.ToString();
  }
  // Launch passes --no-swap-safe; the later --swap-safe wins.
  auto nbd = FarmemNbd::Launch({"--backend", "farmem", "--peers", peers, "--secret-file",
                                daemons.work_dir() + "/secret", "--resilience", "none", "--size",
                                "64M", "--swap-safe"});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  const pid_t pid = (*nbd)->process().pid();
  if ((*nbd)->log().find("swap-safe: mlockall") != std::string::npos ||
      ProcStatus(pid, "VmLck") <= 0) {
    GTEST_SKIP() << "mlockall is not permitted here (needs CAP_IPC_LOCK or a larger "
                    "RLIMIT_MEMLOCK):\n"
                 << (*nbd)->log();
  }

  const long idle = ProcStatus(pid, "VmLck");
  const Locked idle_parts = LockedMemory(pid);
  std::cout << "idle: VmLck " << idle << " KiB: " << idle_parts.anonymous_kib << " KiB anonymous, "
            << idle_parts.file_kib << " KiB file-backed\n";
  EXPECT_LE(idle_parts.anonymous_kib, kIdleOwnKiB) << (*nbd)->log();
  // The shared libraries are locked page by page as they are used (MCL_ONFAULT), when the IO
  // flusher step worked (else they are locked whole, ~16 MiB): 10.7 MiB measured, where locking
  // them whole took 16.2.
  if ((*nbd)->log().find("PR_SET_IO_FLUSHER") == std::string::npos) {
    EXPECT_LE(idle_parts.file_kib, kIdleFileKiB) << (*nbd)->log();
    EXPECT_LE(idle_parts.file_kib + idle_parts.anonymous_kib, kIdleTotalKiB) << (*nbd)->log();
  }

  // Four connections, each past its first request (its buffers exist once it has answered).
  constexpr int kConnections = 4;
  std::vector<NbdTestClient> clients;
  for (int i = 0; i < kConnections; ++i) {
    auto c = NbdTestClient::Connect((*nbd)->socket_path());
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    ASSERT_TRUE(c->Read(0, 4096).has_value());
    clients.push_back(std::move(*c));
  }
  const long connected = ProcStatus(pid, "VmLck");
  std::cout << kConnections << " connections: VmLck " << connected << " KiB, "
            << (connected - idle) / kConnections << " KiB per connection\n";
  EXPECT_LE(connected - idle, kConnections * kPerConnectionKiB);

  // Requests of the protocol's maximum size, served in pieces.
  NbdTestClient& c = clients[0];
  const auto data = Pattern(kMaxPayload, 21);
  ASSERT_TRUE(c.Write(0, data, kCmdFlagFua).ok());
  auto back = c.Read(0, kMaxPayload);
  ASSERT_TRUE(back.has_value()) << back.error().ToString();
  EXPECT_TRUE(*back == data) << "a 32 MiB read returned other data than the 32 MiB write";
  auto z = c.Call(kCmdWriteZeroes, kCmdFlagNoHole, 4096, kMaxPayload - 8192);
  ASSERT_TRUE(z.has_value());
  EXPECT_EQ(z->error, 0u) << z->message;
  auto t = c.Call(kCmdTrim, 0, 32u << 20, 32u << 20);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->error, 0u) << t->message;
  back = c.Read(0, kMaxPayload);
  ASSERT_TRUE(back.has_value()) << back.error().ToString();
  std::vector<uint8_t> expected(kMaxPayload, 0);
  std::copy_n(data.begin(), 4096, expected.begin());
  std::copy_n(data.end() - 4096, 4096, expected.end() - 4096);
  EXPECT_TRUE(*back == expected) << "WRITE_ZEROES of all but the first and last pages";
  // What large requests may add: the page store's zero buffer (1 MiB, made on first use), the
  // page table of the 32 MiB written (24 bytes a page, 192 KiB) and some heap (measured: 1.7 MiB
  // in all); no buffer grows to the request (the old request path: +33 MiB).
  const long after = ProcStatus(pid, "VmLck");
  std::cout << "after 32 MiB requests: VmLck " << after << " KiB\n";
  EXPECT_LE(after - connected, 3 << 10);
  for (NbdTestClient& client : clients) EXPECT_TRUE(client.Disconnect().ok());
}

}  // namespace
}  // namespace farmem::blockdev
