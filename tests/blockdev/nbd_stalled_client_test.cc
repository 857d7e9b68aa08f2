// Clients that stop reading their replies, against the real farmem-nbd program (issue 11, defect
// 2). Such a client may only ever stall its own connection: the backend batch must not wait on its
// socket (extent locks held, remote reads in flight), so that every other client keeps working,
// no healthy daemon misses the page store's operation timeout and is blamed for it, and the
// rebuild after a real failure does not wait for the stuck client to leave. And the stuck
// connection is dropped after --reply-timeout.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nbd_test_client.h"
#include "support/daemon_fixture.h"
#include "support/wait.h"
#include "test_process.h"

namespace farmem::blockdev {
namespace {

using namespace farmem::blockdev::nbd;  // NOLINT(build/namespaces)
using testing::Count;
using testing::FarmemNbd;
using testing::NbdTestClient;
using testing::Pattern;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kChunk = 1u << 20;

// Polls `done` until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  return farmem::testing::WaitUntil(done, timeout, std::chrono::milliseconds(10));
}

// Lines of `text` that contain both `a` and `b`.
size_t CountLines(const std::string& text, const std::string& a, const std::string& b) {
  size_t n = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    n += line.find(a) != std::string::npos && line.find(b) != std::string::npos ? 1 : 0;
  }
  return n;
}

// Bytes received by the socket and not read yet.
int Unread(int fd) {
  int n = 0;
  return ::ioctl(fd, FIONREAD, &n) == 0 ? n : -1;
}

// A client that pipelines `reads` READs of 1 MiB over the first `chunks` MiB of the export and
// never reads a reply. Returns once farmem-nbd has started answering (its socket holds replies).
Result<NbdTestClient> StuckClient(const std::string& socket, int reads, uint64_t chunks) {
  FARMEM_ASSIGN_OR_RETURN(NbdTestClient c, NbdTestClient::Connect(socket));
  std::vector<uint8_t> stream;
  for (int i = 0; i < reads; ++i) {
    const auto req = testing::RequestBytes(kCmdRead, 0, 1000 + i, (i % chunks) * kChunk, kChunk);
    stream.insert(stream.end(), req.begin(), req.end());
  }
  FARMEM_RETURN_IF_ERROR(c.SendRaw(stream));
  if (!WaitFor([&] { return Unread(c.fd()) > 0; }, std::chrono::seconds(20))) {
    return Err(DeadlineExceeded("farmem-nbd never answered the stuck client's reads"));
  }
  return c;
}

// Number of lease ids in "leases lost: [0x1, 0x2 and 5 more]" of the "is down" line naming
// `endpoint`, or -1 while there is none.
int LeasesLostOn(const std::string& log, const std::string& endpoint) {
  const std::regex down("\\(" + std::regex_replace(endpoint, std::regex("\\."), "\\.") +
                        "\\) is down .*leases (?:lost|unreachable, kept[^:]*): \\[([^\\]]*)\\]");
  std::smatch m;
  if (!std::regex_search(log, m, down)) return -1;
  const std::string ids = m[1].str();
  int n = ids.empty() ? 0 : 1 + static_cast<int>(Count(ids, ", "));
  std::smatch more;
  if (std::regex_search(ids, more, std::regex(" and (\\d+) more"))) n += std::stoi(more[1].str());
  return n;
}

// Reads the first `chunks` MiB and compares them with what `expected` says each chunk holds.
void VerifyAll(NbdTestClient& c, const std::vector<uint64_t>& expected, const char* when) {
  for (size_t i = 0; i < expected.size(); ++i) {
    auto back = c.Read(i * kChunk, kChunk);
    ASSERT_TRUE(back.has_value()) << when << ": reading MiB " << i << ": "
                                  << back.error().ToString();
    ASSERT_TRUE(*back == Pattern(kChunk, expected[i])) << when << ": MiB " << i << " is wrong";
  }
}

// replicate:2 on three daemons; three clients pipeline large READs and never read the replies.
TEST(NbdStalledClient, StuckReadersBlameNoDaemonAndDelayNoRebuild) {
  farmem::testing::DaemonSet daemons({.capacity = "64M", .slab_size = "2M"});
  ASSERT_TRUE(daemons.Start(3).ok());
  std::string peers;
  for (const Endpoint& ep : daemons.endpoints())
    peers += (peers.empty() ? "" : ",") + ep.ToString();
  constexpr uint64_t kChunks = 32;  // the export: 32 MiB, 16 extents (one per 2 MiB slab)
  auto nbd = FarmemNbd::Launch({"--backend", "farmem", "--peers", peers, "--secret-file",
                                daemons.work_dir() + "/secret", "--resilience", "replicate:2",
                                "--size", std::to_string(kChunks) + "M", "--heartbeat-ms", "100",
                                "--failure-timeout-ms", "600", "--reply-timeout", "600"});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  FarmemNbd& server = **nbd;

  // The well-behaved client maps and fills the whole export.
  testing::ClientOptions good_options;
  good_options.timeout = std::chrono::seconds(20);
  auto good = NbdTestClient::Connect(server.socket_path(), good_options);
  ASSERT_TRUE(good.has_value()) << good.error().ToString();
  std::vector<uint64_t> expected(kChunks);
  for (uint64_t i = 0; i < kChunks; ++i) {
    expected[i] = i;
    ASSERT_TRUE(good->Write(i * kChunk, Pattern(kChunk, i)).ok());
  }

  // Three clients ask for 128 MiB each and read nothing.
  std::vector<NbdTestClient> stuck;
  for (int i = 0; i < 3; ++i) {
    auto c = StuckClient(server.socket_path(), 128, kChunks);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    stuck.push_back(std::move(*c));
  }

  // Meanwhile the good client writes and reads verified data, each round promptly, for longer
  // than the page store's 5 s operation timeout (long enough for a read held up behind a stuck
  // reply to be counted against its daemon).
  const auto start = Clock::now();
  auto longest = Clock::duration::zero();
  uint64_t rounds = 0;
  for (uint64_t gen = 100; Clock::now() - start < std::chrono::seconds(7); ++gen, ++rounds) {
    const uint64_t i = gen % kChunks;
    const auto t0 = Clock::now();
    ASSERT_TRUE(good->Write(i * kChunk, Pattern(kChunk, gen)).ok()) << "round " << rounds;
    expected[i] = gen;
    auto back = good->Read(i * kChunk, kChunk);
    ASSERT_TRUE(back.has_value()) << "round " << rounds << ": " << back.error().ToString();
    ASSERT_TRUE(*back == Pattern(kChunk, gen)) << "round " << rounds;
    longest = std::max(longest, Clock::now() - t0);
  }
  const auto longest_ms = std::chrono::duration_cast<std::chrono::milliseconds>(longest).count();
  std::printf(
      "good client: %llu write+read rounds of 1 MiB beside 3 stuck clients, longest %lld ms\n",
      static_cast<unsigned long long>(rounds), static_cast<long long>(longest_ms));
  EXPECT_LT(longest_ms, 4000) << "the good client waited behind the stuck ones (op timeout: 5 s)";
  {
    const std::string log = server.log();
    EXPECT_EQ(Count(log, "is down"), 0u) << log;
    EXPECT_EQ(Count(log, "data path error"), 0u) << log;
    EXPECT_EQ(Count(log, "rebuilt on"), 0u) << log;
  }

  // A real failure while the three are still stuck: its extents are re-protected at once.
  const Endpoint killed = daemons[0].endpoint();
  const auto kill_time = Clock::now();
  daemons[0].Kill();
  int lost = -1;
  ASSERT_TRUE(WaitFor([&] { return (lost = LeasesLostOn(server.log(), killed.ToString())) >= 0; },
                      std::chrono::seconds(20)))
      << server.log();
  ASSERT_GT(lost, 0);
  const bool reprotected =
      WaitFor([&] { return Count(server.log(), "rebuilt on") >= static_cast<size_t>(lost); },
              std::chrono::seconds(30));
  const auto reprotect_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - kill_time).count();
  std::printf("killed %s: %d members lost, re-protected %s %lld ms after the kill\n",
              killed.ToString().c_str(), lost, reprotected ? "in" : "NOT within",
              static_cast<long long>(reprotect_ms));
  EXPECT_TRUE(reprotected) << "the rebuild waited (for the stuck clients?)\n" << server.log();
  // The stuck clients are still connected and still stuck: nothing above waited for them.
  for (NbdTestClient& c : stuck) EXPECT_GT(Unread(c.fd()), 0);
  ASSERT_TRUE(server.process().Alive());
  VerifyAll(*good, expected, "after the first kill");

  // The stuck clients leave. Whatever they held up must not now be blamed on a healthy daemon.
  stuck.clear();
  ASSERT_TRUE(
      WaitFor([&] { return Count(server.log(), "closed after") >= 3; }, std::chrono::seconds(20)))
      << server.log();
  ASSERT_TRUE(
      WaitFor([&] { return Count(server.log(), "rebuilt on") >= static_cast<size_t>(lost); },
              std::chrono::seconds(30)))
      << server.log();
  {
    const std::string log = server.log();
    EXPECT_EQ(Count(log, "is down"), 1u) << "a healthy daemon was declared down\n" << log;
    for (size_t d = 1; d < 3; ++d) {
      EXPECT_EQ(CountLines(log, "data path error on", "(" + daemons[d].endpoint().ToString() + ")"),
                0u)
          << "healthy " << daemons[d].endpoint().ToString() << " was blamed\n"
          << log;
    }
    EXPECT_EQ(Count(log, "did not answer in time"), 0u) << log;
    EXPECT_EQ(Count(log, "rebuilt on"), static_cast<size_t>(lost))
        << "members on healthy daemons were rebuilt\n"
        << log;
  }
  // Re-protection really happened: every extent now has both copies on the two survivors, so
  // losing one more daemon loses nothing.
  daemons[1].Kill();
  ASSERT_TRUE(
      WaitFor([&] { return LeasesLostOn(server.log(), daemons[1].endpoint().ToString()) >= 0; },
              std::chrono::seconds(20)));
  VerifyAll(*good, expected, "after the second kill");
  EXPECT_EQ(Count(server.log(), "LOST"), 0u) << server.log();
}

// A client that never reads is disconnected after --reply-timeout, with a log line, while another
// client keeps working.
TEST(NbdStalledClient, ClientThatDoesNotReadIsDroppedAfterTheReplyTimeout) {
  auto nbd = FarmemNbd::Start("64M", {"--reply-timeout", "1"});
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  FarmemNbd& server = **nbd;
  auto stuck = StuckClient(server.socket_path(), 64, 64);
  ASSERT_TRUE(stuck.has_value()) << stuck.error().ToString();
  const auto stalled_at = Clock::now();

  auto good = NbdTestClient::Connect(server.socket_path());
  ASSERT_TRUE(good.has_value());
  ASSERT_TRUE(good->Write(0, Pattern(65536, 7)).ok());
  auto back = good->Read(0, 65536);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, Pattern(65536, 7));

  ASSERT_TRUE(WaitFor([&] { return Count(server.log(), "did not read its replies") > 0; },
                      std::chrono::seconds(20)))
      << "the stuck client was never dropped\n"
      << server.log();
  const auto dropped_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - stalled_at).count();
  std::printf("stuck client dropped %lld ms after it stopped reading (--reply-timeout 1)\n",
              static_cast<long long>(dropped_ms));
  // Its socket ends with EOF after far less than the 64 MiB it asked for.
  uint64_t got = 0;
  std::vector<uint8_t> buf(1 << 20);
  for (;;) {
    pollfd p{stuck->fd(), POLLIN, 0};
    ASSERT_GT(::poll(&p, 1, 10000), 0) << "no EOF after the drop";
    const ssize_t n = ::recv(stuck->fd(), buf.data(), buf.size(), 0);
    if (n <= 0) break;
    got += static_cast<uint64_t>(n);
  }
  EXPECT_LT(got, 64ull << 20);
  EXPECT_TRUE(good->Read(0, 4096).has_value());
  EXPECT_TRUE(good->Disconnect().ok());
  EXPECT_TRUE(server.process().Alive());
}

}  // namespace
}  // namespace farmem::blockdev
