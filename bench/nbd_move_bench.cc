// Pressure to return for farmem-nbd (issue 12, docs/benchmarks.md "Lender pressure to return"):
// the NBD counterpart of farptr_move_bench. A lender (farmemd, --capacity = --lent-mib, mlocked)
// runs in a real memory cgroup (tests/support/memory_cgroup.h; v1 on these hosts, v2 in the
// guest) and lends about --lent-mib to one farmem-nbd export of the given resilience; seven other
// daemons hold the rest of each group and have room to take what the lender holds. A reader
// reads (and checks) random 4 KiB blocks of the export through the repo's NBD client. Then a
// memory hog starts in the lender's cgroup, taking enough that the lender is short of --reserve
// by more than all it lends. Printed per resilience mode, from the hog's onset (fork):
//   - the cgroup short of the reserve, the hog holding its memory, the lender's first EVICT_NOTICE,
//   every lease moved off the
//     lender (the export freed them), 90% of the lent memory back out of the lender's RSS;
//     notice -> moved on its own; the notice's grace;
//   - the reader's reads/s, p50/p99/max and longest gap over a steady window before the hog (the
//     baseline, same run), from onset to moved, and after.
// To make the lender hold --lent-mib, a filler client takes the other daemons' room while the
// export is written (they keep only what the other members of each group need), then frees it.
//   nbd_move_bench [--resilience none,replicate:2,ec-split:4+2] [--lent-mib 1024] [--slab-mib 16]
// (ec-split: the split layout, whose moves it counts in farmem-nbd's log, "moved off").
//                  [--grace-ms 30000] [--interval-ms 250] [--seconds 3]
// Needs root (a memory cgroup); says so and exits 2 where none can be made.
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "bench_main.h"
#include "farmem/common/command_line.h"
#include "farmem/common/metrics.h"
#include "farmem/common/wire.h"
#include "farmem/transport/tcp_connection.h"
#include "latency_window.h"
#include "nbd_test_client.h"
#include "support/daemon_fixture.h"
#include "support/memory_cgroup.h"
#include "support/process.h"
#include "test_process.h"

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr uint32_t kBlock = 4096;
constexpr uint32_t kFillUnit = 1 << 20;
constexpr size_t kOthers = 7;  // enough for ec:4+2 to move a member to a node not in its group

[[noreturn]] void Die(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "nbd_move_bench: %s\n", msg.c_str());
  std::exit(code);
}

struct Args {
  std::vector<std::string> modes = {"none", "replicate:2", "ec-split:4+2"};
  uint64_t lent_mib = 1024;
  uint64_t slab_mib = 16;
  uint32_t grace_ms = 30000;
  uint32_t interval_ms = 250;
  int seconds = 3;
};

// Group size g and data width k of a resilience mode (page_store.h): the lender holds one member
// of a group of g slabs carrying k slabs of data.
std::pair<uint64_t, uint64_t> Shape(const std::string& mode) {
  unsigned a = 0, b = 0;
  if (mode == "none") return {1, 1};
  if (std::sscanf(mode.c_str(), "replicate:%u", &a) == 1) return {a, 1};
  if (std::sscanf(mode.c_str(), "ec:%u+%u", &a, &b) == 2) return {a + b, a};
  if (std::sscanf(mode.c_str(), "ec-split:%u+%u", &a, &b) == 2) return {a + b, a};
  Die("unknown resilience " + mode);
}

// The content of 4 KiB block `i`: cheap to make for any block, different for every block.
void Block(uint64_t i, uint8_t* out) {
  for (uint32_t w = 0; w < kBlock / 8; ++w) {
    const uint64_t v = (i * 512 + w) * 0x9e3779b97f4a7c15ull;
    std::memcpy(out + w * 8, &v, 8);
  }
}

uint16_t ReadPortFile(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return static_cast<uint16_t>(port);
}

std::vector<farmem::metrics::Sample> Scrape(uint16_t port) {
  auto r = farmem::metrics::HttpGet({"127.0.0.1", port}, "/metrics",
                                    farmem::DeadlineIn(milliseconds(5000)));
  if (!r.has_value() || r->status != 200) return {};
  auto s = farmem::metrics::ParseExposition(r->body);
  return s.has_value() ? *s : std::vector<farmem::metrics::Sample>{};
}
double Value(const std::vector<farmem::metrics::Sample>& s, const char* name) {
  return farmem::metrics::Find(s, name, {}).value_or(-1);
}

long RssKiB(pid_t pid) { return farmem::testing::ProcStatus(pid, "VmRSS"); }

// Takes all but `keep` free slabs of a daemon under a client id of its own; Release() frees them.
class Filler {
 public:
  Filler(const farmem::Endpoint& ep, const std::string& secret, uint32_t keep) {
    farmem::transport::ChannelOptions o;
    o.endpoint = ep;
    o.credentials.client_id.fill(0xf1);
    o.credentials.client_name = "nbd_move_bench-filler";
    o.credentials.secret = secret;
    auto c = farmem::transport::TcpConnection::Connect(o);
    if (!c) Die("filler: " + c.error().ToString());
    conn_.emplace(std::move(*c));
    auto body = conn_->Call(farmem::wire::Opcode::kStat, {}, milliseconds(5000));
    if (!body) Die("filler STAT: " + body.error().ToString());
    auto st = farmem::wire::DecodeStatReply(*body);
    if (!st) Die("filler STAT: " + st.error().ToString());
    uint32_t take = st->free_slabs > keep ? st->free_slabs - keep : 0;
    while (take > 0) {
      const uint32_t n = std::min<uint32_t>(take, 1024);
      std::vector<uint8_t> req;
      farmem::wire::EncodeAlloc({n}, &req);
      auto r = conn_->Call(farmem::wire::Opcode::kAlloc, req, milliseconds(30000));
      if (!r) Die("filler ALLOC: " + r.error().ToString());
      auto a = farmem::wire::DecodeAllocReply(*r);
      if (!a) Die("filler ALLOC: " + a.error().ToString());
      for (const auto& l : a->leases) ids_.push_back(l.lease_id);
      take -= n;
    }
  }
  void Release() {
    if (ids_.empty()) return;
    std::vector<uint8_t> req;
    farmem::wire::EncodeFree({ids_}, &req);
    auto r = conn_->Call(farmem::wire::Opcode::kFree, req, milliseconds(30000));
    if (!r) Die("filler FREE: " + r.error().ToString());
    ids_.clear();
  }

 private:
  std::optional<farmem::transport::TcpConnection> conn_;
  std::vector<uint64_t> ids_;
};

void RunOne(const Args& a, const std::string& mode) {
  namespace bt = farmem::blockdev::testing;
  const auto [g, k] = Shape(mode);
  const uint64_t slab = a.slab_mib * kMiB;
  const uint64_t lent = a.lent_mib * kMiB;
  const uint64_t lender_slabs = lent / slab;
  const uint64_t export_bytes = lent * k;  // one member of each group on the lender
  // The lender's cgroup: room for what it lends + a reserve larger than that (so the hog can
  // make it short of all of it without reaching the limit) + 512 MiB.
  const uint64_t reserve = lent + 512 * kMiB;
  const uint64_t limit = lent + reserve + 512 * kMiB;
  farmem::testing::MemoryCgroup cg("farmem-nbd-move-bench", limit);
  if (!cg.ok()) Die("no memory cgroup: " + cg.why() + " (run as root)", 2);
  farmem::testing::TempDir tmp("nbd-move-bench");

  const std::string lender_port_file = tmp.File("lender-metrics");
  farmem::testing::DaemonConfig lender_cfg;
  lender_cfg.capacity = std::to_string(a.lent_mib) + "M";
  lender_cfg.slab_size = std::to_string(a.slab_mib) + "M";
  lender_cfg.log_level = "warn";
  lender_cfg.extra_args = {"--memory-source",
                           "cgroup:" + cg.dir().string(),
                           "--reserve",
                           std::to_string(reserve / kMiB) + "M",
                           "--evict-grace-ms",
                           std::to_string(a.grace_ms),
                           "--pressure-interval-ms",
                           std::to_string(a.interval_ms),
                           "--metrics-listen",
                           "127.0.0.1:0",
                           "--metrics-port-file",
                           lender_port_file};
  farmem::testing::DaemonSet lender(lender_cfg);
  if (auto s = lender.Start(1); !s.ok()) Die(s.ToString());
  const pid_t lender_pid = lender[0].pid();
  if (!cg.Join(lender_pid)) Die("cannot move farmemd into " + cg.dir().string());
  // The metrics port file may come a moment after the daemon listens.
  uint16_t lender_port = 0;
  for (int i = 0; i < 10000 && (lender_port = ReadPortFile(lender_port_file)) == 0; ++i) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  if (lender_port == 0) Die("farmemd wrote no metrics port");
  const farmem::Endpoint lender_ep = lender[0].endpoint();

  // The others hold the other g-1 members of each group, and then what the lender gives back.
  const uint64_t others_slabs = ((g - 1) * lender_slabs + lender_slabs) * 5 / 4 / kOthers + 4;
  farmem::testing::DaemonConfig others_cfg;
  others_cfg.capacity = std::to_string(others_slabs * a.slab_mib) + "M";
  others_cfg.slab_size = lender_cfg.slab_size;
  others_cfg.log_level = "warn";
  others_cfg.lease_ttl_ms = 600000;  // the filler does not heartbeat
  others_cfg.extra_args = {"--no-mlock", "--memory-source", "off"};
  farmem::testing::DaemonSet others(others_cfg);
  if (auto s = others.Start(kOthers); !s.ok()) Die(s.ToString());
  std::string peers = lender_ep.ToString();
  for (const farmem::Endpoint& ep : others.endpoints()) peers += "," + ep.ToString();

  const uint32_t keep = static_cast<uint32_t>((g - 1) * lender_slabs * 11 / 10 / kOthers + 1);
  std::vector<std::unique_ptr<Filler>> fillers;
  for (const farmem::Endpoint& ep : others.endpoints()) {
    fillers.push_back(std::make_unique<Filler>(ep, others.secret(), keep));
  }

  const std::string nbd_port_file = tmp.File("nbd-metrics");
  auto nbd = bt::FarmemNbd::Launch(
      {"--backend", "farmem", "--peers", peers, "--secret-file", lender.work_dir() + "/secret",
       "--resilience", mode, "--size", std::to_string(export_bytes / kMiB) + "M", "--overcommit",
       "--heartbeat-ms", "100", "--failure-timeout-ms", "5000", "--metrics-listen", "127.0.0.1:0",
       "--metrics-port-file", nbd_port_file});
  if (!nbd) Die(nbd.error().ToString());
  bt::ClientOptions co;
  co.timeout = std::chrono::seconds(60);
  auto client = bt::NbdTestClient::Connect((*nbd)->socket_path(), co);
  if (!client) Die(client.error().ToString());
  const auto fill_start = Clock::now();
  std::vector<uint8_t> unit(kFillUnit);
  for (uint64_t off = 0; off < export_bytes; off += kFillUnit) {
    for (uint32_t b = 0; b < kFillUnit / kBlock; ++b) {
      Block(off / kBlock + b, unit.data() + uint64_t{b} * kBlock);
    }
    if (auto s = client->Write(off, unit); !s.ok()) Die("fill: " + s.ToString());
  }
  const double fill_s = std::chrono::duration<double>(Clock::now() - fill_start).count();
  for (auto& f : fillers) f->Release();

  const auto before = Scrape(lender_port);
  const double lent_now = Value(before, "farmem_daemon_lent_bytes");
  const long rss_before_kib = RssKiB(lender_pid);
  const uint64_t usage = cg.Usage();
  if (lent_now <= 0) Die(fmt::format("the export put nothing on the lender (lent {})", lent_now));
  const uint64_t lent_bytes = static_cast<uint64_t>(lent_now);
  if (limit < usage + reserve - lent_bytes) Die("the cgroup is already short of the reserve");
  const uint64_t hog_bytes = limit - usage - reserve + lent_bytes + 64 * kMiB;

  // The reader: random blocks, each checked.
  const uint64_t blocks = export_bytes / kBlock;
  farmem::bench::ReadSampler reader(
      blocks, 1 << 22,
      [&, want = std::vector<uint8_t>(kBlock)](uint64_t i, Clock::time_point& end) mutable {
        auto got = client->Read(i * kBlock, kBlock);
        end = Clock::now();
        if (!got) return fmt::format("block {}: {}", i, got.error().ToString());
        Block(i, want.data());
        if (*got != want) return fmt::format("block {} came back wrong", i);
        return std::string();
      });
  std::this_thread::sleep_for(std::chrono::seconds(a.seconds));  // the steady window: time itself

  // The hog, on a thread of its own: the onset is its fork.
  farmem::testing::MemoryHog hog;
  Clock::time_point hog_ready{};
  const Clock::time_point onset = Clock::now();
  std::thread hog_thread([&] {
    if (!hog.Start(cg, hog_bytes)) Die("the hog did not start");
    hog_ready = Clock::now();
  });
  Clock::time_point short_of_reserve{}, noticed{}, moved{}, returned{};
  long rss_after_kib = rss_before_kib;
  const Clock::time_point give_up = onset + milliseconds(a.grace_ms) + std::chrono::seconds(30);
  Clock::time_point next_scrape{};
  while (Clock::now() < give_up &&
         (moved == Clock::time_point{} || returned == Clock::time_point{})) {
    const Clock::time_point now = Clock::now();
    if (now >= next_scrape && moved == Clock::time_point{}) {
      next_scrape = now + milliseconds(5);
      const auto m = Scrape(lender_port);
      if (noticed == Clock::time_point{} && Value(m, "farmem_daemon_leases_noticed_total") > 0) {
        noticed = Clock::now();
      }
      if (noticed != Clock::time_point{} && Value(m, "farmem_daemon_leases") == 0) {
        moved = Clock::now();
      }
    }
    if (short_of_reserve == Clock::time_point{} && cg.Usage() + reserve > limit) {
      short_of_reserve = Clock::now();
    }
    rss_after_kib = RssKiB(lender_pid);
    if (returned == Clock::time_point{} &&
        static_cast<uint64_t>(std::max(0L, rss_before_kib - rss_after_kib)) * 1024 >=
            lent_bytes * 9 / 10) {
      returned = Clock::now();
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  const Clock::time_point end_of_move = moved == Clock::time_point{} ? Clock::now() : moved;
  std::this_thread::sleep_for(std::chrono::seconds(a.seconds));  // the window after the move
  const std::string reader_error = reader.Stop();
  hog_thread.join();
  const auto after = Scrape(lender_port);
  const auto export_m = Scrape(ReadPortFile(nbd_port_file));
  hog.Stop();
  if (!reader_error.empty()) Die(mode + ": the reader failed: " + reader_error);

  auto ms = [&](Clock::time_point from, Clock::time_point t) {
    return t == Clock::time_point{} || from == Clock::time_point{}
               ? std::string("never")
               : fmt::format("{:.0f} ms",
                             std::chrono::duration<double, std::milli>(t - from).count());
  };
  const std::string log = (*nbd)->log();
  size_t moved_members = 0;
  for (size_t p = log.find("moved off " + lender_ep.ToString()); p != std::string::npos;
       p = log.find("moved off " + lender_ep.ToString(), p + 1)) {
    ++moved_members;
  }
  fmt::print(
      "{}: lender lends {} MiB in {} slabs of {} MiB (RSS {} MiB; export {} MiB written in {:.1f} "
      "s); hog {} MiB; --reserve {} MiB; grace {} ms, --pressure-interval-ms {}\n",
      mode, lent_bytes / kMiB, lent_bytes / slab, a.slab_mib, rss_before_kib / 1024,
      export_bytes / kMiB, fill_s, hog_bytes / kMiB, reserve / kMiB, a.grace_ms, a.interval_ms);
  fmt::print(
      "    onset -> cgroup short of --reserve {}, -> hog holds its memory {}, -> first notice {}, "
      "-> every lease moved {}, -> 90% "
      "of lent RSS returned {} (RSS {} -> {} MiB); notice -> moved {}\n",
      ms(onset, short_of_reserve), ms(onset, hog_ready), ms(onset, noticed), ms(onset, moved),
      ms(onset, returned), rss_before_kib / 1024, rss_after_kib / 1024, ms(noticed, moved));
  fmt::print(
      "    lender: leases evicted at the deadline {}; export: members moved off the lender {}, "
      "degraded reads {}, lost bytes {}\n",
      Value(after, "farmem_daemon_leases_evicted_total"), moved_members,
      farmem::metrics::Find(export_m, "farmem_export_degraded_reads_total", {}).value_or(-1),
      farmem::metrics::Find(export_m, "farmem_export_lost_bytes_total", {}).value_or(-1));
  reader.PrintWindows(onset, noticed, end_of_move, a.seconds);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"farmem-nbd while a lender under memory pressure asks its memory back"};
  farmem::cli::AddVersionOption(app, "nbd_move_bench");
  farmem::bench::AddMoveOptions(app, a.modes, a.grace_ms, a.seconds);
  app.add_option("--lent-mib", a.lent_mib, "MiB the lender lends")->capture_default_str();
  app.add_option("--slab-mib", a.slab_mib, "slab size in MiB")->capture_default_str();
  app.add_option("--interval-ms", a.interval_ms, "lender's pressure check interval")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  farmem::bench::UseBinariesBeside(argv[0]);
  for (const std::string& m : a.modes) RunOne(a, m);
  return 0;
}
