// farmem-nbd against NBD clients nobody here wrote: nbdinfo, nbdcopy (libnbd), qemu-io (qemu's
// NBD client) and fio's nbd engine. Runs the real farmem-nbd program (memory backend), except
// where a test has to see what reached the backend (then the server runs in-process and only the
// client is external).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <thread>

#include "farmem/blockdev/nbd_server.h"
#include "nbd_test_client.h"
#include "support/sanitizer.h"
#include "support/wait.h"
#include "test_backends.h"
#include "test_process.h"

namespace farmem::blockdev {
namespace {

using testing::CommandResult;
using testing::FarmemNbd;
using testing::RunCommand;

#define REQUIRE_PROGRAM(name)                                         \
  do {                                                                \
    if (!testing::HaveProgram(name)) GTEST_SKIP() << name " missing"; \
  } while (0)

// Value of the first "key": in nbdinfo's or fio's JSON (flat scalar fields only; no JSON library
// is a dependency of farmem). Strings keep their quotes.
std::string JsonField(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\"";
  size_t p = json.find(needle);
  if (p == std::string::npos) return "<missing>";
  p = json.find(':', p + needle.size());
  if (p == std::string::npos) return "<missing>";
  p = json.find_first_not_of(" \t", p + 1);
  if (p == std::string::npos) return "<missing>";
  if (json[p] == '"') return json.substr(p, json.find('"', p + 1) - p + 1);
  const size_t end = json.find_first_of(",\n}", p);
  std::string v = json.substr(p, end - p);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\r')) v.pop_back();
  return v;
}

// "VmLck:     16400 kB" from /proc/PID/status; -1 if absent.
long LockedKb(pid_t pid) {
  const std::string status = testing::ReadFile("/proc/" + std::to_string(pid) + "/status");
  const size_t p = status.find("VmLck:");
  if (p == std::string::npos) return -1;
  return std::strtol(status.c_str() + p + 6, nullptr, 10);
}

// "Threads:  5" from /proc/PID/status; -1 if absent.
// Threads of `pid` named `name` (farmem-nbd names its connection threads "nbd-conn").
long ThreadsNamed(pid_t pid, std::string_view name) {
  long n = 0;
  std::error_code ec;
  for (const auto& t :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    if (testing::ReadFile((t.path() / "comm").string()) == std::string(name) + "\n") ++n;
  }
  return n;
}

std::string Describe(const CommandResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

TEST(NbdInterop, NbdinfoSeesSizeBlockSizesAndTruthfulFlags) {
  REQUIRE_PROGRAM("nbdinfo");
  auto srv = FarmemNbd::Start("96M", {"--export-name", "swap0", "--description", "farmem test"});
  ASSERT_TRUE(srv.has_value()) << srv.error().ToString();
  const CommandResult r =
      RunCommand({"nbdinfo", "--json", "nbd+unix:///swap0?socket=" + (*srv)->socket_path()});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(JsonField(r.out, "protocol"), "\"newstyle-fixed\"");
  EXPECT_EQ(JsonField(r.out, "structured"), "true");
  EXPECT_EQ(JsonField(r.out, "export-size"), std::to_string(96u << 20));
  EXPECT_EQ(JsonField(r.out, "block_size_minimum"), "512");
  EXPECT_EQ(JsonField(r.out, "block_size_preferred"), "4096");
  EXPECT_EQ(JsonField(r.out, "block_size_maximum"), "33554432");
  EXPECT_EQ(JsonField(r.out, "is_read_only"), "false");
  EXPECT_EQ(JsonField(r.out, "can_flush"), "true");
  EXPECT_EQ(JsonField(r.out, "can_fua"), "true");
  EXPECT_EQ(JsonField(r.out, "can_trim"), "true");
  EXPECT_EQ(JsonField(r.out, "can_zero"), "true");
  EXPECT_EQ(JsonField(r.out, "can_multi_conn"), "true");
  EXPECT_EQ(JsonField(r.out, "can_df"), "true");
  EXPECT_EQ(JsonField(r.out, "can_cache"), "false");      // NBD_CMD_CACHE not offered
  EXPECT_EQ(JsonField(r.out, "can_fast_zero"), "false");  // zeroing is not faster than writing
  EXPECT_EQ(JsonField(r.out, "export-name"), "\"swap0\"");
  EXPECT_EQ(JsonField(r.out, "description"), "\"farmem test\"");

  // NBD_OPT_LIST through nbdinfo --list.
  const CommandResult list =
      RunCommand({"nbdinfo", "--list", "--json", "nbd+unix:///?socket=" + (*srv)->socket_path()});
  ASSERT_EQ(list.exit_code, 0) << Describe(list);
  EXPECT_NE(list.out.find("\"swap0\""), std::string::npos) << list.out;

  // An export that does not exist is refused (NBD_REP_ERR_UNKNOWN), and the server lives on.
  const CommandResult unknown =
      RunCommand({"nbdinfo", "nbd+unix:///nope?socket=" + (*srv)->socket_path()});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_TRUE((*srv)->process().Alive());
}

TEST(NbdInterop, NbdcopyRoundTripsA256MiBRandomFile) {
  REQUIRE_PROGRAM("nbdcopy");
  auto srv = FarmemNbd::Start("256M");
  ASSERT_TRUE(srv.has_value()) << srv.error().ToString();
  testing::TempDir dir;
  const std::string in = dir.File("in.bin");
  const std::string out = dir.File("out.bin");
  {
    std::ofstream f(in, std::ios::binary);
    for (int i = 0; i < 256; ++i) {
      const auto chunk = testing::Pattern(1u << 20, 1000 + i);
      f.write(reinterpret_cast<const char*>(chunk.data()), chunk.size());
    }
  }
  // nbdcopy uses several connections when the server offers multi-conn.
  const CommandResult up = RunCommand({"nbdcopy", "--flush", in, (*srv)->uri()});
  ASSERT_EQ(up.exit_code, 0) << Describe(up);
  const CommandResult down = RunCommand({"nbdcopy", (*srv)->uri(), out});
  ASSERT_EQ(down.exit_code, 0) << Describe(down);

  std::ifstream a(in, std::ios::binary), b(out, std::ios::binary);
  std::vector<char> ba(1u << 20), bb(1u << 20);
  for (int i = 0; i < 256; ++i) {
    a.read(ba.data(), ba.size());
    b.read(bb.data(), bb.size());
    ASSERT_EQ(b.gcount(), static_cast<std::streamsize>(bb.size())) << "short copy at MiB " << i;
    ASSERT_TRUE(ba == bb) << "data differs in MiB " << i;
  }
  b.peek();
  EXPECT_TRUE(b.eof()) << "copy is longer than the source";
}

TEST(NbdInterop, QemuIoWriteReadZeroDiscardFlushFua) {
  REQUIRE_PROGRAM("qemu-io");
  auto srv = FarmemNbd::Start("64M");
  ASSERT_TRUE(srv.has_value()) << srv.error().ToString();
  const std::vector<std::string> cmds = {
      "write -P 0x55 0 64k",      "read -P 0x55 0 64k",   "write -P 0xaa 1M 1M",
      "read -P 0xaa 1M 1M",       "write -z 16k 16k",     "read -P 0 16k 16k",
      "read -P 0x55 0 16k",       "read -P 0x55 32k 32k", "write -z -u 1M 4k",
      "read -P 0 1M 4k",          "discard 1052672 4096", "flush",
      "write -f -P 0x11 8M 128k", "read -P 0x11 8M 128k", "write -P 0x77 63M 1M",
      "read -P 0x77 63M 1M",
  };
  std::vector<std::string> argv = {"qemu-io", "-f", "raw"};
  for (const auto& c : cmds) {
    argv.push_back("-c");
    argv.push_back(c);
  }
  argv.push_back((*srv)->uri());
  const CommandResult r = RunCommand(argv);
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out.find("verification failed"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("rror"), std::string::npos) << r.err;

  // Past the end: qemu refuses it itself, or the server answers with an error; either way the
  // command fails and the server keeps running.
  const CommandResult past =
      RunCommand({"qemu-io", "-f", "raw", "-c", "read 64M 4k", (*srv)->uri()});
  EXPECT_NE(past.exit_code, 0) << Describe(past);
  EXPECT_TRUE((*srv)->process().Alive());
}

// qemu-io's flags must arrive at the backend as the NBD flags they stand for: write -f as FUA,
// write -z as WRITE_ZEROES with NO_HOLE (without -u) or without it (with -u), discard as TRIM.
TEST(NbdInterop, QemuIoFlagsArriveAtTheBackend) {
  REQUIRE_PROGRAM("qemu-io");
  auto mem = MemoryBackend::Create(16u << 20);
  ASSERT_TRUE(mem.has_value());
  testing::RecordingBackend backend(std::move(*mem));
  testing::TempDir dir;
  NbdServerOptions o;
  o.unix_paths = {dir.File("s.sock")};
  auto server = NbdServer::Create(&backend, o);
  ASSERT_TRUE(server.has_value());
  ASSERT_TRUE((*server)->Start().ok());
  const CommandResult r =
      RunCommand({"qemu-io", "-f", "raw", "-c", "write -f -P 1 0 4k", "-c", "write -z 8k 8k", "-c",
                  "write -z -u 64k 64k", "-c", "discard 1M 1M", "-c", "flush",
                  "nbd+unix:///?socket=" + dir.File("s.sock")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  (*server)->Stop();
  bool fua_write = false, zero_no_hole = false, zero_may_trim = false, trim = false, flush = false;
  for (const auto& op : backend.ops()) {
    if (op.kind == BlockOp::Kind::kWrite && op.offset == 0 && op.fua) fua_write = true;
    if (op.kind == BlockOp::Kind::kWriteZeroes && op.offset == 8192 && !op.may_trim) {
      zero_no_hole = true;
    }
    if (op.kind == BlockOp::Kind::kWriteZeroes && op.offset == 65536 && op.may_trim) {
      zero_may_trim = true;
    }
    if (op.kind == BlockOp::Kind::kTrim && op.offset == (1u << 20)) trim = true;
    if (op.kind == BlockOp::Kind::kFlush) flush = true;
  }
  EXPECT_TRUE(fua_write);
  EXPECT_TRUE(zero_no_hole);
  EXPECT_TRUE(zero_may_trim);
  EXPECT_TRUE(trim);
  EXPECT_TRUE(flush);
}

TEST(NbdInterop, FioRandomWritesVerifyOverFourConnectionsAtDepth16) {
  REQUIRE_PROGRAM("fio");
  auto srv = FarmemNbd::Start("128M");
  ASSERT_TRUE(srv.has_value()) << srv.error().ToString();
  testing::TempDir dir;
  const CommandResult r =
      RunCommand({"fio", "--name=verify", "--ioengine=nbd", "--uri=" + (*srv)->uri(),
                  "--rw=randwrite", "--bs=4k", "--iodepth=16", "--numjobs=4", "--size=24m",
                  "--offset_increment=32m", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
                  "--group_reporting", "--output-format=json", "--output=" + dir.File("fio.json")});
  const std::string json = testing::ReadFile(dir.File("fio.json"));
  ASSERT_EQ(r.exit_code, 0) << Describe(r) << json;
  EXPECT_EQ(JsonField(json, "error"), "0");
  // 4 jobs x 24 MiB written, then read back and verified.
  EXPECT_EQ(JsonField(json, "io_bytes"), std::to_string(96u << 20)) << json.substr(0, 2000);
  // fio's nbd engine opens one connection per job.
  const std::string log = (*srv)->log();
  size_t connections = 0;
  for (size_t p = 0; (p = log.find("entered transmission", p)) != std::string::npos; ++p) {
    ++connections;
  }
  EXPECT_GE(connections, 4u) << log;
}

TEST(NbdInterop, TcpListenerAndSystemdSocketActivation) {
  REQUIRE_PROGRAM("nbdinfo");
  // --listen on a port chosen by the kernel, found again through a fresh bind-and-release.
  uint16_t port = 0;
  {
    auto probe = ListenTcp(Endpoint{"127.0.0.1", 0});
    ASSERT_TRUE(probe.has_value());
    port = *LocalPort(*probe);
  }
  testing::TempDir dir;
  testing::SpawnOptions so;
  so.stderr_path = dir.File("tcp.log");
  auto tcp = testing::ChildProcess::Spawn({testing::FarmemNbdPath(), "--size", "8M", "--listen",
                                           "127.0.0.1:" + std::to_string(port), "--no-swap-safe"},
                                          so);
  ASSERT_TRUE(tcp.has_value());
  // Wait until it listens (a TCP connect succeeds), then ask once.
  ASSERT_TRUE(farmem::testing::WaitUntil(
      [&] {
        return ConnectTcp(Endpoint{"127.0.0.1", port}, DeadlineIn(std::chrono::seconds(1)))
            .has_value();
      },
      std::chrono::seconds(20)))
      << testing::ReadFile(dir.File("tcp.log"));
  CommandResult r = RunCommand({"nbdinfo", "--size", "nbd://127.0.0.1:" + std::to_string(port)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r) << testing::ReadFile(dir.File("tcp.log"));
  EXPECT_EQ(r.out, std::to_string(8u << 20) + "\n");

  // Socket activation: the listening socket is fd 3, LISTEN_PID/LISTEN_FDS name it.
  auto listener = ListenTcp(Endpoint{"127.0.0.1", 0});
  ASSERT_TRUE(listener.has_value());
  const uint16_t act_port = *LocalPort(*listener);
  so.stderr_path = dir.File("activated.log");
  so.activation_fd = listener->fd();
  auto activated = testing::ChildProcess::Spawn(
      {testing::FarmemNbdPath(), "--size", "4M", "--no-swap-safe"}, so);
  ASSERT_TRUE(activated.has_value());
  listener->Close();  // only the child holds it now
  // No retry loop needed: the socket already listens, connections queue until farmem-nbd
  // accepts them.
  r = RunCommand({"nbdinfo", "--size", "nbd://127.0.0.1:" + std::to_string(act_port)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r) << testing::ReadFile(dir.File("activated.log"));
  EXPECT_EQ(r.out, std::to_string(4u << 20) + "\n");
  EXPECT_NE(testing::ReadFile(dir.File("activated.log")).find("listening on fd:3"),
            std::string::npos);
}

TEST(NbdInterop, SigtermStopsTheServerCleanly) {
  auto srv = FarmemNbd::Start("8M");
  ASSERT_TRUE(srv.has_value()) << srv.error().ToString();
  auto c = testing::NbdTestClient::Connect((*srv)->socket_path());
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->Write(0, testing::Pattern(4096, 1)).ok());
  const int status = (*srv)->process().Stop(SIGTERM, std::chrono::seconds(10));
  ASSERT_NE(status, -1) << "farmem-nbd did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(c->WaitForClose(std::chrono::seconds(5)));
  struct stat st;
  EXPECT_NE(::stat((*srv)->socket_path().c_str(), &st), 0) << "socket file left behind";
  EXPECT_NE((*srv)->log().find("SIGTERM received"), std::string::npos) << (*srv)->log();
}

TEST(NbdInterop, SwapSafeModeLocksMemoryOrSaysWhyNot) {
  testing::TempDir dir;
  testing::SpawnOptions so;
  so.stderr_path = dir.File("log");
  const std::string sock = dir.File("s.sock");
  auto p = testing::ChildProcess::Spawn({testing::FarmemNbdPath(), "--size", "16M", "--unix", sock},
                                        so);  // --swap-safe default
  ASSERT_TRUE(p.has_value());
  ASSERT_TRUE(testing::WaitForUnixSocket(sock, std::chrono::seconds(20)))
      << testing::ReadFile(dir.File("log"));
  const std::string log = testing::ReadFile(dir.File("log"));
  const long locked_kb = LockedKb(p->pid());
  ASSERT_GE(locked_kb, 0);
#if FARMEM_SANITIZED
  // The sanitizers intercept mlockall() and turn it into a no-op that reports success.
  GTEST_LOG_(INFO) << "sanitizer build: not checking VmLck (" << locked_kb << " kB)";
#else
  if (log.find("mlockall") == std::string::npos) {
    EXPECT_GE(locked_kb, 16 * 1024) << "no mlockall warning, yet the 16 MiB backend is not locked";
    // Everything a new thread maps is locked and populated under MCL_FUTURE: connection threads
    // must not bring glibc's 8 MiB default stacks (regression: 8.3 MB locked per connection).
    std::vector<Socket> idle;
    for (int i = 0; i < 4; ++i) idle.push_back(std::move(*testing::ConnectUnix(sock)));
    // Measure once the four connection threads exist (their stacks are mapped by then). Counted
    // by name: the total thread count also sees threads that come and go at start-up.
    EXPECT_TRUE(farmem::testing::WaitUntil([&] { return ThreadsNamed(p->pid(), "nbd-conn") >= 4; },
                                           std::chrono::seconds(10)))
        << "connection threads: " << ThreadsNamed(p->pid(), "nbd-conn");
    EXPECT_LT(LockedKb(p->pid()) - locked_kb, 4 * 2048) << "4 idle connections lock too much";
  } else {
    EXPECT_EQ(locked_kb, 0);
  }
#endif
  // Each step either worked or was reported.
  const std::string adj = testing::ReadFile("/proc/" + std::to_string(p->pid()) + "/oom_score_adj");
  if (adj != "-1000\n") {
    EXPECT_NE(log.find("oom_score_adj"), std::string::npos) << log;
  }
  auto c = testing::NbdTestClient::Connect(sock);
  ASSERT_TRUE(c.has_value());
  EXPECT_TRUE(c->Write(0, testing::Pattern(4096, 2)).ok());
}

TEST(NbdInterop, CommandLineIsDocumentedAndValidated) {
  const CommandResult help = RunCommand({testing::FarmemNbdPath(), "--help"});
  ASSERT_EQ(help.exit_code, 0) << Describe(help);
  for (const char* opt : {"--backend", "--size", "--unix", "--listen", "--export-name",
                          "--description", "--max-connections", "--handshake-timeout",
                          "--reply-timeout", "--swap-safe", "--log-level"}) {
    EXPECT_NE(help.out.find(opt), std::string::npos) << opt << " not in --help";
  }
  const CommandResult bad_size = RunCommand(
      {testing::FarmemNbdPath(), "--size", "1000", "--unix", "/tmp/x", "--no-swap-safe"});
  EXPECT_NE(bad_size.exit_code, 0);
  EXPECT_NE(bad_size.err.find("multiple of 512"), std::string::npos) << bad_size.err;
  const CommandResult bad_backend = RunCommand({testing::FarmemNbdPath(), "--backend", "disk"});
  EXPECT_NE(bad_backend.exit_code, 0);
  const CommandResult no_listener =
      RunCommand({testing::FarmemNbdPath(), "--size", "1M", "--no-swap-safe"});
  EXPECT_NE(no_listener.exit_code, 0);
  EXPECT_NE(no_listener.err.find("nothing to listen on"), std::string::npos) << no_listener.err;
}

}  // namespace
}  // namespace farmem::blockdev
