// The page store tests' fixture: real farmemd processes on loopback, a client::Cluster (with a
// fault injector on its data channels), a PageStore, and a local shadow copy of the export that
// every read is checked against.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "farmem/common/wire.h"
#include "farmem/transport/fault_injection.h"
#include "page_store.h"
#include "support/daemon_fixture.h"
#include "support/wait.h"

namespace farmem::blockdev::pstest {

using farmem::testing::DaemonConfig;
using farmem::testing::DaemonSet;
using farmem::testing::ProcessState;
using farmem::testing::WaitUntil;

constexpr uint64_t kExport = 32 << 20;

class PageStoreTest : public ::testing::Test {
 protected:
  // reconnect_ms: how often the client core retries a daemon that is down (the re-protection
  // tests restart daemons and want them noticed soon).
  void StartDaemons(size_t n, const std::string& capacity = "24M", int reconnect_ms = 10000,
                    size_t down_at_connect = 0) {
    DaemonConfig cfg;
    cfg.capacity = capacity;
    cfg.slab_size = "1M";
    cfg.log_level = "warn";
    cfg.lease_ttl_ms = lease_ttl_ms_;
    daemons_ = std::make_unique<DaemonSet>(cfg);
    Status started = daemons_->Start(n);
    ASSERT_TRUE(started.ok()) << started.ToString();
    // The last `down_at_connect` daemons are known by address but not running when the client
    // connects (still booting, or down): they have their port, and Start() reuses it.
    for (size_t i = n - down_at_connect; i < n; ++i) (*daemons_)[i].Kill();
    client::ClusterOptions o;
    o.peers = daemons_->endpoints();
    o.secret = daemons_->secret();
    o.heartbeat_interval = std::chrono::milliseconds(100);
    o.failure_timeout = std::chrono::milliseconds(600);
    o.reconnect_interval = std::chrono::milliseconds(reconnect_ms);
    o.op_timeout = op_timeout_;
    o.fault_injector = faults_;  // set by the fault tests: the data channels take their faults
    auto c = client::Cluster::Connect(o);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    cluster_ = std::move(*c);
  }

  // Opens a store of kExport bytes over the cluster; `more` sets what else a test needs in the
  // options (encryption, ...) before the store is made.
  void Open(const std::string& mode, const std::string& backup = "",
            std::chrono::milliseconds reconcile = std::chrono::milliseconds(3000),
            const std::function<void(PageStoreOptions&)>& more = nullptr) {
    ASSERT_NE(cluster_, nullptr) << "no cluster: StartDaemons failed above";
    PageStoreOptions o;
    o.size = kExport;
    auto r = Resilience::Parse(mode);
    ASSERT_TRUE(r.has_value()) << r.error().ToString();
    o.resilience = *r;
    o.backup_path = backup;
    o.op_timeout = op_timeout_;
    o.reconcile_interval = reconcile;
    if (more) more(o);
    auto ps = PageStore::Create(cluster_.get(), o);
    ASSERT_TRUE(ps.has_value()) << ps.error().ToString();
    store_ = std::move(*ps);
    shadow_.assign(kExport, 0);
  }

  // Random writes (aligned and not), each mirrored into the shadow.
  void RandomWrites(int n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> buf(256 << 10);
    for (int i = 0; i < n; ++i) {
      const bool aligned = rng() % 4 != 0;
      uint64_t len = aligned ? 4096 * (1 + rng() % 64) : 512 * (1 + rng() % 20);
      uint64_t off = aligned ? (rng() % (kExport / 4096)) * 4096 : (rng() % (kExport / 512)) * 512;
      if (off + len > kExport) off = kExport - len;
      for (uint64_t j = 0; j < len; ++j) buf[j] = static_cast<uint8_t>(rng());
      Status s = Target().Write(off, {buf.data(), len}, rng() % 8 == 0);
      ASSERT_TRUE(s.ok()) << s.ToString() << " writing " << len << " at " << off;
      std::memcpy(shadow_.data() + off, buf.data(), len);
    }
  }

  void VerifyAll() {
    std::vector<uint8_t> buf(1 << 20);
    for (uint64_t off = 0; off < kExport; off += buf.size()) {
      Status s = Target().Read(off, buf);
      ASSERT_TRUE(s.ok()) << s.ToString() << " reading at " << off;
      ASSERT_EQ(0, std::memcmp(buf.data(), shadow_.data() + off, buf.size()))
          << "mismatch in the MiB at " << off;
    }
  }

  // Checks every op the store reports early, at the moment it is reported: final status, and for
  // reads the data already in place (the NBD server sends it right away).
  class CheckingListener final : public BatchListener {
   public:
    CheckingListener(std::span<BlockOp> ops, const std::vector<uint8_t>& shadow)
        : ops_(ops), shadow_(shadow), seen_(ops.size(), false) {}
    void OpDone(size_t i) override {
      if (early == 0 && on_first) on_first();
      ASSERT_LT(i, ops_.size());
      EXPECT_FALSE(seen_[i]) << "op " << i << " reported twice";
      seen_[i] = true;
      ++early;
      const BlockOp& op = ops_[i];
      EXPECT_TRUE(op.status.ok()) << op.status.ToString();
      if (op.kind == BlockOp::Kind::kRead) {
        EXPECT_EQ(0, std::memcmp(op.read_into.data(), shadow_.data() + op.offset, op.length))
            << "early read of " << op.length << " bytes at " << op.offset;
      }
    }
    void Progress() override { ++progress; }
    int early = 0, progress = 0;
    std::function<void()> on_first;  // called at the first OpDone

   private:
    std::span<BlockOp> ops_;
    const std::vector<uint8_t>& shadow_;
    std::vector<bool> seen_;
  };

  // Batched 4 KiB reads at random offsets, as the NBD server hands them over; with `listener`,
  // the ops reported early are checked when reported. Returns how many were.
  int VerifyBatched(int batches, uint64_t seed, bool listener = false) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> bufs(16 * 4096);
    int early = 0;
    for (int b = 0; b < batches; ++b) {
      BlockOp ops[16];
      for (int i = 0; i < 16; ++i) {
        ops[i].kind = BlockOp::Kind::kRead;
        ops[i].offset = (rng() % (kExport / 4096)) * 4096;
        ops[i].length = 4096;
        ops[i].read_into = {bufs.data() + i * 4096, 4096};
      }
      CheckingListener l(ops, shadow_);
      Target().ExecuteBatch(ops, listener ? &l : nullptr);
      early += l.early;
      for (int i = 0; i < 16; ++i) {
        EXPECT_TRUE(ops[i].status.ok()) << ops[i].status.ToString();
        EXPECT_EQ(0, std::memcmp(bufs.data() + i * 4096, shadow_.data() + ops[i].offset, 4096));
      }
    }
    return early;
  }

  // Batches of 16 page writes (distinct pages, some runs of several pages) with a listener: every
  // op reported early has succeeded; the shadow follows.
  int BatchedWrites(int batches, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> bufs(16 * 4 * 4096);
    int early = 0;
    for (int b = 0; b < batches; ++b) {
      BlockOp ops[16];
      for (int i = 0; i < 16; ++i) {
        const uint64_t pages = 1 + rng() % 4;
        // Slot i of 16 equal slices of the export: batches never overlap themselves.
        const uint64_t slice = kExport / 16 / 4096;
        ops[i].kind = BlockOp::Kind::kWrite;
        ops[i].offset = (i * slice + rng() % (slice - pages)) * 4096;
        ops[i].length = pages * 4096;
        uint8_t* data = bufs.data() + i * 4 * 4096;
        for (uint64_t j = 0; j < ops[i].length; ++j) data[j] = static_cast<uint8_t>(rng());
        ops[i].data = {data, ops[i].length};
      }
      CheckingListener l(ops, shadow_);
      Target().ExecuteBatch(ops, &l);
      early += l.early;
      for (int i = 0; i < 16; ++i) {
        EXPECT_TRUE(ops[i].status.ok()) << ops[i].status.ToString();
        std::memcpy(shadow_.data() + ops[i].offset, ops[i].data.data(), ops[i].length);
      }
    }
    return early;
  }

  // Waits until the client core has declared daemon `i` down and the page store has been told
  // (its reaction is then queued: WaitForRebuilds waits for it).
  void WaitUntilNoticedDown(client::NodeId i) {
    Status s = cluster_->WaitForNode(i, client::NodeState::kDown, std::chrono::seconds(10));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  // Sends DRAIN (what `farmemctl drain` sends) to daemon `id`: it grants nothing more and sends
  // EVICT_NOTICE with `grace_ms` for every lease it holds.
  Result<wire::DrainReply> Drain(client::NodeId id, uint32_t grace_ms) {
    FARMEM_ASSIGN_OR_RETURN(transport::TcpConnection conn, cluster_->ControlConnection(id));
    std::vector<uint8_t> body;
    wire::EncodeDrain({.drain = true, .grace_ms = grace_ms}, &body);
    FARMEM_ASSIGN_OR_RETURN(std::vector<uint8_t> reply,
                            conn.Call(wire::Opcode::kDrain, body, std::chrono::seconds(5)));
    return wire::DecodeDrainReply(reply);
  }

  std::string Describe() {
    const PageStoreStats s = store_->stats();
    std::string out = "degraded_extents=" + std::to_string(s.degraded_extents) +
                      " rebuilds=" + std::to_string(s.rebuilds) +
                      " degraded_maps=" + std::to_string(s.degraded_maps) + "; nodes:";
    for (const client::NodeInfo& n : cluster_->nodes()) {
      out += " " + n.endpoint.ToString() + (n.alive ? " up" : " down") +
             " leases=" + std::to_string(n.leases_held);
    }
    return out + "\n" + daemons_->Logs();
  }

  // Waits until the client core has noticed a failure (some extent lost a member), then until
  // every extent is whole again (re-protected).
  void WaitUntilDegraded() {
    ASSERT_TRUE(
        WaitUntil([&] { return store_->stats().degraded_extents > 0; }, std::chrono::seconds(10)))
        << "the killed daemon's members were never reported lost: " << Describe();
  }
  void WaitUntilWhole() {
    ASSERT_TRUE(
        WaitUntil([&] { return store_->stats().degraded_extents == 0; }, std::chrono::seconds(20)))
        << "degraded extents were not re-protected: " << Describe();
  }

  // The data ops' timeout, in the client core (its channels) and in the store; set before
  // StartDaemons.
  std::chrono::milliseconds op_timeout_{2000};
  // The daemons' --lease-ttl-ms (unset: farmemd's 10 s): how long a dead daemon's leases are
  // kept before the client may give them up (beyond-tolerance tests).
  std::optional<uint32_t> lease_ttl_ms_;
  std::shared_ptr<transport::FaultInjector> faults_ = std::make_shared<transport::FaultInjector>();
  std::unique_ptr<DaemonSet> daemons_;
  std::unique_ptr<client::Cluster> cluster_;
  std::unique_ptr<PageStore> store_;
  std::vector<uint8_t> shadow_;
  // What the helpers above write and verify: store_, unless a test sets another backend here
  // (the stripe layout's tests).
  BlockBackend* target_ = nullptr;
  BlockBackend& Target() { return target_ != nullptr ? *target_ : *store_; }
};

// One synchronous raw operation on a lease, on a channel of our own (the test's identity owns the
// lease): how a lender's root, or a bad NIC, would change the bytes behind the client's back.
// Channel::Read/Write wait up to 10 s (a tcp channel breaks when a Poll's timeout passes before
// the reply: a short poll loop here failed the raw read at load 17, transport.h).
inline Status RawOp(client::Cluster& cluster, const client::Lease& lease, transport::OpType type,
                    uint64_t offset, uint8_t* buf, uint32_t len) {
  FARMEM_ASSIGN_OR_RETURN(auto ch, cluster.OpenChannel(lease.node));
  return type == transport::OpType::kRead ? ch->Read(lease.slab(), offset, {buf, len})
                                          : ch->Write(lease.slab(), offset, {buf, len});
}

}  // namespace farmem::blockdev::pstest
