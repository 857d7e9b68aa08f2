// farmem-nbd's write cache (write_cache.h) through NBD clients nobody here wrote: qemu-io sends
// 512 B, 1 KiB and 4 KiB writes, 16 in flight at a time, to a replicate:2 export on three farmemd
// daemons with a cache much smaller than the range written (pages are evicted all the time), then
// FLUSH; the flush leaves no dirty page. Then one daemon is killed and nbdcopy reads the whole
// range back: it must be exactly the reference buffer. Run with the cache (16 pages) and without
// (--write-cache-pages 0); nbdinfo must see FLUSH and FUA offered either way. The same with the
// stripe layout (ec:2+1, --ec-layout stripe) on the three daemons, cache on and off.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "farmem/common/metrics.h"
#include "support/daemon_fixture.h"
#include "support/wait.h"
#include "test_process.h"

namespace farmem::blockdev {
namespace {

using std::chrono::milliseconds;
using testing::CommandResult;
using testing::FarmemNbd;
using testing::RunCommand;

constexpr uint64_t kExportMiB = 8;
constexpr uint64_t kRange = 1u << 20;  // written with mixed sizes

double Metric(uint16_t port, const char* name) {
  auto r = metrics::HttpGet({"127.0.0.1", port}, "/metrics", DeadlineIn(milliseconds(5000)));
  if (!r.has_value() || r->status != 200) return -1;
  auto samples = metrics::ParseExposition(r->body);
  if (!samples.has_value()) return -1;
  return metrics::Find(*samples, name, {}).value_or(-1);
}

uint16_t ReadPortFile(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return static_cast<uint16_t>(port);
}

std::string Describe(const CommandResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

// The cache on or off, over the page store (replicate:2) or the stripe layout (ec:2+1,
// --ec-layout stripe: with the cache off its own read-modify-write of partial pages is what runs).
struct CacheCase {
  const char* cache_pages;
  const char* resilience;
  const char* layout;  // --ec-layout; "" (replicate): none
  const char* name;
};

class NbdWriteCacheTest : public ::testing::TestWithParam<CacheCase> {};

TEST_P(NbdWriteCacheTest, MixedSizeWritesFlushedSurviveADaemonKilled) {
  for (const char* tool : {"qemu-io", "nbdcopy", "nbdinfo"}) {
    if (!testing::HaveProgram(tool)) GTEST_SKIP() << tool << " missing";
  }
  const std::string cache_pages = GetParam().cache_pages;
  farmem::testing::DaemonSet daemons({.capacity = "40M",
                                      .slab_size = "1M",
                                      .extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(3).ok()) << daemons.Logs();
  std::string peers;
  for (const Endpoint& ep : daemons.endpoints()) {
    peers += (peers.empty() ? "" : ",") + ep.ToString();
  }
  testing::TempDir tmp;
  const std::string port_file = tmp.File("metrics-port");
  // A long dirty age: only eviction and FLUSH write back here, not the flusher (the age is
  // refused with the cache off).
  std::vector<std::string> args = {"--backend",
                                   "farmem",
                                   "--peers",
                                   peers,
                                   "--secret-file",
                                   daemons.work_dir() + "/secret",
                                   "--resilience",
                                   GetParam().resilience,
                                   "--size",
                                   std::to_string(kExportMiB) + "M",
                                   "--heartbeat-ms",
                                   "100",
                                   "--failure-timeout-ms",
                                   "1000",
                                   "--write-cache-pages",
                                   cache_pages,
                                   "--metrics-listen",
                                   "127.0.0.1:0",
                                   "--metrics-port-file",
                                   port_file};
  if (cache_pages != "0") args.insert(args.end(), {"--write-cache-max-age-ms", "60000"});
  // --ec-layout is refused with replicate (there is no layout to choose).
  if (*GetParam().layout != '\0') args.insert(args.end(), {"--ec-layout", GetParam().layout});
  auto nbd = FarmemNbd::Launch(args);
  ASSERT_TRUE(nbd.has_value()) << nbd.error().ToString();
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return ReadPortFile(port_file) != 0; },
                                         std::chrono::seconds(10)));
  const uint16_t port = ReadPortFile(port_file);

  const CommandResult info = RunCommand({"nbdinfo", "--json", (*nbd)->uri()});
  ASSERT_EQ(info.exit_code, 0) << Describe(info);
  EXPECT_NE(info.out.find("\"can_flush\": true"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("\"can_fua\": true"), std::string::npos) << info.out;

  // Groups of up to 16 non-overlapping writes in flight (aio_write), each group waited for
  // (aio_flush, itself an NBD FLUSH), a last flush at the end.
  std::vector<uint8_t> ref(kRange, 0);
  std::mt19937_64 rng(7);
  const uint64_t sizes[] = {512, 1024, 4096};
  std::vector<std::string> argv = {"qemu-io", "-f", "raw"};
  for (int group = 0; group < 40; ++group) {
    std::vector<std::pair<uint64_t, uint64_t>> taken;
    for (int k = 0; k < 16; ++k) {
      const uint64_t len = sizes[rng() % 3];
      const uint64_t off = (rng() % ((kRange - len) / 512 + 1)) * 512;
      bool overlaps = false;
      for (auto [a, b] : taken) overlaps = overlaps || (off < b && a < off + len);
      if (overlaps) continue;
      taken.push_back({off, off + len});
      const uint8_t v = static_cast<uint8_t>(1 + rng() % 255);
      std::fill_n(ref.begin() + static_cast<std::ptrdiff_t>(off), len, v);
      argv.push_back("-c");
      argv.push_back("aio_write " + std::string(rng() % 8 == 0 ? "-f " : "") + "-P " +
                     std::to_string(v) + " " + std::to_string(off) + " " + std::to_string(len));
    }
    argv.push_back("-c");
    argv.push_back("aio_flush");
  }
  argv.push_back("-c");
  argv.push_back("flush");
  argv.push_back((*nbd)->uri());
  const CommandResult w = RunCommand(argv);
  ASSERT_EQ(w.exit_code, 0) << Describe(w);
  ASSERT_EQ(w.err.find("rror"), std::string::npos) << w.err;

  if (cache_pages != "0") {
    EXPECT_EQ(Metric(port, "farmem_write_cache_dirty_pages"), 0) << "dirty pages after FLUSH";
    EXPECT_GT(Metric(port, "farmem_write_cache_writebacks_total"), 0);
    EXPECT_EQ(Metric(port, "farmem_write_cache_writeback_failures_total"), 0);
  } else {
    EXPECT_EQ(Metric(port, "farmem_write_cache_pages"), -1) << "no cache, no cache metrics";
  }

  daemons[1].Kill();
  const std::string out = tmp.File("out.bin");
  const CommandResult r = RunCommand({"nbdcopy", (*nbd)->uri(), out});
  ASSERT_EQ(r.exit_code, 0) << Describe(r) << (*nbd)->log();
  std::ifstream f(out, std::ios::binary);
  std::vector<uint8_t> back(kRange);
  f.read(reinterpret_cast<char*>(back.data()), static_cast<std::streamsize>(kRange));
  ASSERT_EQ(f.gcount(), static_cast<std::streamsize>(kRange));
  size_t wrong = 0, first_wrong = kRange;
  for (size_t i = 0; i < kRange; ++i) {
    if (back[i] != ref[i]) {
      ++wrong;
      first_wrong = std::min(first_wrong, i);
    }
  }
  EXPECT_EQ(wrong, 0u) << "first wrong byte at " << first_wrong << "\n" << (*nbd)->log();
  EXPECT_TRUE((*nbd)->process().Alive());
}

INSTANTIATE_TEST_SUITE_P(CacheOnOff, NbdWriteCacheTest,
                         ::testing::Values(CacheCase{"16", "replicate:2", "", "on"},
                                           CacheCase{"0", "replicate:2", "", "off"},
                                           CacheCase{"16", "ec:2+1", "stripe", "stripe_on"},
                                           CacheCase{"0", "ec:2+1", "stripe", "stripe_off"}),
                         [](const ::testing::TestParamInfo<CacheCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace farmem::blockdev
