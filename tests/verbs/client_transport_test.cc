// The client core's choice of transport, on real soft-RoCE in the qemu guest (ctest label `vm`:
// deploy/vm/run --addrs 2 -- client_transport_test). Not the raw transport: a client::Cluster,
// the object every borrower (farmem-nbd, far_ptr) goes through, with transport=auto.
//
// What a user would check: against daemons that serve RDMA the cluster's data channels are verbs;
// against a daemon started with --rdma off the same client falls back to tcp for that node only;
// either way the bytes written read back exactly, and the client says (in its log and through
// Channel::kind()) which one it chose. transport=tcp and transport=verbs are obeyed. Verbs
// operations reach the daemon's victim choice through the client's HEARTBEAT access reports.
// Outside a guest with an RDMA device every test skips.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

#include "farmem/client/cluster.h"
#include "farmem/transport/verbs.h"
#include "guest_addrs.h"
#include "support/daemon_fixture.h"
#include "support/fake_cgroup.h"
#include "support/log_capture.h"

namespace farmem {
namespace {

using std::chrono::milliseconds;
using transport::Channel;
using transport::Op;
using transport::OpType;

constexpr char kSecret[] = "farmem-client-transport-test-secret";

using testing::GuestAddrs;

class ClientTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    addrs_ = GuestAddrs();
    if (addrs_.size() < 3) {
      GTEST_SKIP() << "not in the test guest with 3 addresses (FARMEM_VM_ADDRS='"
                   << (std::getenv("FARMEM_VM_ADDRS") ? std::getenv("FARMEM_VM_ADDRS") : "")
                   << "')";
    }
    if (auto t = transport::MakeVerbsTransport(); !t.has_value()) {
      GTEST_SKIP() << "no RDMA device here: " << t.error().ToString();
    }
    work_dir_ = std::make_unique<testing::TempDir>("farmem-client-transport");
    ASSERT_TRUE(work_dir_->ok()) << work_dir_->status().ToString();
    // The client logs which transport each channel took; keep those lines to check them.
    log_ = std::make_unique<testing::LogCapture>();
  }

  void TearDown() override {
    for (auto& d : daemons_) (void)d->Stop();
    daemons_.clear();
    work_dir_.reset();  // after the daemons that log into it
  }

  // A farmemd on guest address `addr_index` with --rdma on or --rdma off.
  testing::DaemonProcess& StartDaemon(size_t addr_index, bool rdma,
                                      const std::vector<std::string>& extra = {},
                                      const std::string& capacity = "8M") {
    testing::DaemonConfig config;
    config.listen_host = addrs_.at(addr_index);
    config.secret = kSecret;
    config.capacity = capacity;
    config.slab_size = "2M";
    config.start_timeout = milliseconds(60000);  // an emulated guest on a busy host is slow
    // --handshake-timeout-ms: the 5 s default is for real machines; under emulation on a loaded
    // host the client took longer than that from connect to AUTH, and the daemon closed on it.
    config.extra_args = {"--rdma", rdma ? "on" : "off", "--handshake-timeout-ms", "60000"};
    config.extra_args.insert(config.extra_args.end(), extra.begin(), extra.end());
    daemons_.push_back(std::make_unique<testing::DaemonProcess>(
        config, work_dir_->path(), "farmemd-" + std::to_string(daemons_.size())));
    Status s = daemons_.back()->Start();
    EXPECT_TRUE(s.ok()) << s.ToString();
    return *daemons_.back();
  }

  Result<std::unique_ptr<client::Cluster>> Connect(const std::string& transport) {
    client::ClusterOptions o;
    for (auto& d : daemons_) o.peers.push_back(d->endpoint());
    o.secret = kSecret;
    o.client_name = "client_transport_test";
    o.transport = transport;
    o.channel_depth = 16;
    o.connect_timeout = milliseconds(10000);
    o.op_timeout = milliseconds(10000);
    o.failure_timeout = milliseconds(10000);  // TCG is slow; no false node-down here
    o.heartbeat_interval = milliseconds(500);
    return client::Cluster::Connect(std::move(o));
  }

  // The client's log line for `ep` saying which transport a channel to it uses, or "".
  std::string ChoiceLogged(const Endpoint& ep) {
    std::string found;
    for (const std::string& line : log_->Matching("data channel to")) {
      if (line.find("(" + ep.ToString() + ")") != std::string::npos) found = line;
    }
    return found;
  }

  std::string Logs() {
    std::string out;
    for (auto& d : daemons_) out += "---- " + d->name() + " ----\n" + d->LogTail(2000) + "\n";
    return out;
  }

  std::vector<std::string> addrs_;
  std::unique_ptr<testing::TempDir> work_dir_;
  std::vector<std::unique_ptr<testing::DaemonProcess>> daemons_;
  std::unique_ptr<testing::LogCapture> log_;
};

constexpr size_t kRounds = 32, kBatch = 16;  // per channel: 512 verified operations

void Fill(std::span<uint8_t> buf, std::mt19937_64& rng) {
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
}

// kRounds batches of kBatch random 4 KiB / 64 KiB reads and writes on one channel, checked
// against `shadow` (what the lease must hold), then the whole lease read back.
void RandomVerifiedIo(Channel& ch, const client::Lease& lease, std::vector<uint8_t>& shadow,
                      std::mt19937_64& rng) {
  constexpr uint32_t kBig = 64 << 10, kSmall = 4 << 10;
  const uint64_t slab = lease.grant.length;
  ASSERT_EQ(shadow.size(), slab);
  std::vector<uint8_t> bufs(kBatch * kBig);
  for (size_t round = 0; round < kRounds; ++round) {
    std::vector<Op> ops;
    std::vector<std::pair<uint64_t, uint64_t>> taken;  // ops of one batch may run in any order
    for (size_t k = 0; k < kBatch; ++k) {
      const uint32_t len = rng() % 8 == 0 ? kBig : kSmall;
      uint64_t off;
      do {
        off = (rng() % ((slab - len) / 4096 + 1)) * 4096;
      } while (std::any_of(taken.begin(), taken.end(),
                           [&](auto r) { return off < r.second && r.first < off + len; }));
      taken.push_back({off, off + len});
      Op op;
      op.type = rng() % 2 ? OpType::kWrite : OpType::kRead;
      op.slab = lease.slab();
      op.offset = off;
      op.local = bufs.data() + k * kBig;
      op.length = len;
      op.user_data = k;
      if (op.type == OpType::kWrite) {
        Fill({bufs.data() + k * kBig, len}, rng);
        std::memcpy(shadow.data() + off, op.local, len);
      } else {
        std::memset(op.local, 0x5a, len);
      }
      ops.push_back(op);
    }
    std::vector<Status> results(ops.size());
    Status s = ch.Execute(ops, results);
    ASSERT_TRUE(s.ok()) << ch.kind() << " channel to " << ch.peer() << ": " << s.ToString();
    for (const Op& op : ops) {
      if (op.type != OpType::kRead) continue;
      ASSERT_EQ(0, std::memcmp(op.local, shadow.data() + op.offset, op.length))
          << ch.kind() << " read of " << op.length << " bytes at " << op.offset << " of lease "
          << lease.id() << " differs from what was written (round " << round << ")";
    }
  }
  std::vector<uint8_t> back(kBig);
  for (uint64_t off = 0; off < slab; off += kBig) {
    ASSERT_TRUE(ch.Read(lease.slab(), off, back).ok());
    ASSERT_EQ(0, std::memcmp(back.data(), shadow.data() + off, kBig))
        << ch.kind() << " lease " << lease.id() << " offset " << off;
  }
}

// Two daemons serve RDMA, one runs with --rdma off: one client (transport=auto) gets verbs
// channels to the first two and a tcp channel to the third, and every byte checks out on all.
TEST_F(ClientTransportTest, AutoUsesVerbsWhereTheDaemonServesRdmaAndFallsBackToTcpElsewhere) {
  const bool rdma[] = {true, true, false};
  for (size_t i = 0; i < 3; ++i) StartDaemon(i, rdma[i]);
  if (HasFailure()) return;
  auto cluster = Connect("auto");
  ASSERT_TRUE(cluster.has_value()) << cluster.error().ToString() << Logs();
  ASSERT_EQ((*cluster)->alive_count(), 3u);
  auto group = (*cluster)->AllocateGroup(3);  // one lease on each node
  ASSERT_TRUE(group.has_value()) << group.error().ToString();

  std::mt19937_64 rng(20261130);
  for (const client::Lease& lease : *group) {
    const client::NodeInfo info = (*cluster)->node(lease.node);
    size_t d = 0;
    while (d < daemons_.size() && !(daemons_[d]->endpoint() == info.endpoint)) ++d;
    ASSERT_LT(d, daemons_.size()) << "lease on an unknown node " << info.endpoint.ToString();
    const char* want = rdma[d] ? "verbs" : "tcp";
    ASSERT_TRUE(info.stat.has_value());
    EXPECT_EQ(bool(info.stat->features & wire::kFeatureVerbs), rdma[d]) << info.endpoint.ToString();

    auto ch = (*cluster)->OpenChannel(lease.node);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString() << Logs();
    EXPECT_STREQ((*ch)->kind(), want) << "channel to " << info.endpoint.ToString();
    const std::string line = ChoiceLogged(info.endpoint);
    EXPECT_NE(line.find(std::string("uses ") + want), std::string::npos)
        << "the client did not say it chose " << want << " for " << info.endpoint.ToString()
        << "; its line: '" << line << "'";
    if (!rdma[d]) {
      EXPECT_NE(line.find("the daemon serves no RDMA"), std::string::npos) << line;
    }

    std::vector<uint8_t> shadow(lease.grant.length, 0);
    RandomVerifiedIo(**ch, lease, shadow, rng);
    if (HasFailure()) return;
    const transport::ChannelStats st = (*ch)->stats();
    std::printf("%s channel to %s: %llu ops, %llu doorbells\n", (*ch)->kind(),
                info.endpoint.ToString().c_str(), static_cast<unsigned long long>(st.ops),
                static_cast<unsigned long long>(st.doorbells));
    EXPECT_GE(st.ops, kRounds * kBatch);  // the batches (the read-back adds more)
  }
  EXPECT_TRUE((*cluster)->Free(*group).ok());
  EXPECT_TRUE((*cluster)->Close().ok());
}

// transport=tcp keeps to tcp even where verbs would work; transport=verbs uses verbs where it
// can and refuses a daemon without RDMA (Unavailable, not a silent tcp channel).
TEST_F(ClientTransportTest, TransportOptionIsObeyed) {
  auto& with = StartDaemon(0, true);
  auto& without = StartDaemon(1, false);
  if (HasFailure()) return;

  auto tcp_only = Connect("tcp");
  ASSERT_TRUE(tcp_only.has_value()) << tcp_only.error().ToString() << Logs();
  auto leases = (*tcp_only)->AllocateGroup(2);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  for (const client::Lease& lease : *leases) {
    auto ch = (*tcp_only)->OpenChannel(lease.node);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    EXPECT_STREQ((*ch)->kind(), "tcp");
    std::vector<uint8_t> w(4096, 0xc3), r(4096, 0);
    ASSERT_TRUE((*ch)->Write(lease.slab(), 4096, w).ok());
    ASSERT_TRUE((*ch)->Read(lease.slab(), 4096, r).ok());
    EXPECT_EQ(r, w);
  }
  EXPECT_NE(ChoiceLogged(with.endpoint()).find("uses tcp (transport=tcp)"), std::string::npos);
  EXPECT_TRUE((*tcp_only)->Close().ok());

  auto verbs_only = Connect("verbs");
  ASSERT_TRUE(verbs_only.has_value()) << verbs_only.error().ToString() << Logs();
  for (const client::NodeInfo& n : (*verbs_only)->nodes()) {
    auto ch = (*verbs_only)->OpenChannel(n.id);
    if (n.endpoint == with.endpoint()) {
      ASSERT_TRUE(ch.has_value()) << ch.error().ToString() << Logs();
      EXPECT_STREQ((*ch)->kind(), "verbs");
    } else {
      ASSERT_EQ(n.endpoint, without.endpoint());
      ASSERT_FALSE(ch.has_value()) << "transport=verbs gave a " << (*ch)->kind() << " channel";
      EXPECT_EQ(ch.error().code(), StatusCode::kUnavailable) << ch.error().ToString();
      EXPECT_NE(ch.error().message().find("does not serve RDMA"), std::string::npos)
          << ch.error().ToString();
    }
  }
  EXPECT_TRUE((*verbs_only)->Close().ok());
}

// Access reports (issue 12): the daemon never sees one-sided RDMA reads and writes, so a lease
// used only over verbs looks idle to its victim choice unless the client reports its operations
// on HEARTBEAT. One client hammers four of its eight leases over verbs and leaves the other four
// alone; under memory pressure (a cgroup directory the test writes) the daemon, counting as it
// does in production (--access-counts all), evicts the four cold ones. Without the report all
// eight look idle and the four are picked at random.
TEST_F(ClientTransportTest, VerbsOperationsAreReportedAndColdLeasesAreEvictedFirst) {
  constexpr uint64_t kMiB = 1 << 20;
  testing::FakeCgroup cgroup(1024 * kMiB);
  StartDaemon(0, true,
              cgroup.LenderArgs({.reserve = 100 * kMiB,
                                 .grace = std::chrono::milliseconds(600000),
                                 .interval = std::chrono::milliseconds(100),
                                 .sample_extra = 4},
                                {"--no-mlock"}),
              "16M");
  if (HasFailure()) return;
  auto cluster = Connect("verbs");
  ASSERT_TRUE(cluster.has_value()) << cluster.error().ToString() << Logs();
  std::mutex mu;
  std::set<uint64_t> noticed;
  (*cluster)->Subscribe([&](const client::Event& e) {
    if (e.type != client::EventType::kEvictNotice) return;
    std::lock_guard lock(mu);
    noticed.insert(e.lease_ids.begin(), e.lease_ids.end());
  });
  auto leases = (*cluster)->Allocate(8);
  ASSERT_TRUE(leases.has_value()) << leases.error().ToString();
  auto ch = (*cluster)->OpenChannel(0);
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString() << Logs();
  ASSERT_STREQ((*ch)->kind(), "verbs");
  constexpr int kOpsPerLease = 64;
  std::vector<uint8_t> page(4096, 0x3c), back(4096);
  for (size_t i = 0; i < 4; ++i) {
    for (int k = 0; k < kOpsPerLease / 2; ++k) {
      ASSERT_TRUE((*ch)->Write((*leases)[i].slab(), 4096 * k, page).ok());
      ASSERT_TRUE((*ch)->Read((*leases)[i].slab(), 4096 * k, back).ok());
      ASSERT_EQ(back, page);
    }
  }
  constexpr uint64_t kTotal = 4 * kOpsPerLease;
  ASSERT_TRUE(testing::WaitUntil([&] { return (*cluster)->node(0).accesses_reported >= kTotal; },
                                 milliseconds(30000)))
      << "reported " << (*cluster)->node(0).accesses_reported << " of " << kTotal;
  EXPECT_EQ((*cluster)->node(0).accesses_reported, kTotal);

  cgroup.SetAvailable(100 * kMiB - 8 * kMiB);  // four 2 MiB slabs short of the reserve
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        std::lock_guard lock(mu);
        return noticed.size() >= 4;
      },
      milliseconds(60000)))
      << Logs();
  std::set<uint64_t> cold;
  for (size_t i = 4; i < 8; ++i) cold.insert((*leases)[i].id());
  std::lock_guard lock(mu);
  EXPECT_EQ(noticed, cold) << "leases busy over verbs were noticed\n" << Logs();
}

}  // namespace
}  // namespace farmem
