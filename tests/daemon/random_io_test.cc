// 100,000 random reads and writes across three real farmemd processes, checked against a local
// shadow copy of every lease: single READ/WRITE frames, BATCH frames through Execute (including
// batches larger than the channel window and than one frame may carry), and many single frames
// pipelined on one connection. At the end every byte of every lease is read back and compared,
// and each daemon's STAT counters must match exactly what this client moved.
//
// FARMEM_TEST_SEED=<n> replays a run; FARMEM_RANDOM_IO_OPS=<n> changes the op count.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "daemon_client.h"
#include "support/daemon_fixture.h"

namespace farmem::testing {
namespace {

using transport::Op;
using transport::OpType;
using transport::RemoteSlab;

constexpr uint32_t kLeasesPerDaemon = 4;
constexpr uint32_t kMaxOpSize = 64 << 10;
// Operations a channel keeps in flight. Large enough that one Flush may hold more than one frame
// can carry (300 reads of 64 KiB), so the transport must split it.
constexpr uint32_t kWindow = 512;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 0) : fallback;
}

struct Lease {
  size_t daemon = 0;
  RemoteSlab slab;
  std::vector<uint8_t> shadow;  // what the daemon must hold
};

struct DaemonTotals {  // what this client moved on one daemon, to compare with its STAT
  uint64_t ops = 0, bytes_read = 0, bytes_written = 0;
};

class RandomIo {
 public:
  explicit RandomIo(uint64_t seed) : rng_(seed) {
    pool_.resize(8 << 20);
    for (size_t i = 0; i < pool_.size(); i += 8) {
      const uint64_t v = rng_();
      std::memcpy(&pool_[i], &v, 8);
    }
    read_buf_.resize(24 << 20);
  }

  std::vector<Lease> leases;
  std::vector<std::unique_ptr<transport::Channel>> channels;  // one per daemon
  std::vector<DaemonTotals> totals;
  uint64_t done = 0;

  // One step: a single op, a batch, a pipeline, or (rarely) a read batch of more than 16 MiB.
  // Returns the number of operations it performed.
  size_t Step() {
    const size_t daemon = rng_() % channels.size();
    const uint64_t mode = rng_() % 1000;
    if (mode < 400) return Single(daemon);
    if (mode < 750) return Batch(daemon, 2 + rng_() % 31, /*reads_only=*/false);
    if (mode < 995) return Pipeline(daemon, 2 + rng_() % 15);
    if (mode < 998) return Batch(daemon, kWindow + 1 + rng_() % 100, false);  // over the window
    return Batch(daemon, 300, /*reads_only=*/true, /*size=*/kMaxOpSize);      // > 16 MiB: 2 frames
  }

  // Final pass: every byte of every lease.
  void ReadBackEverything() {
    for (Lease& l : leases) {
      std::vector<uint8_t> all(l.slab.length);
      Status s = channels[l.daemon]->Read(l.slab, 0, all);
      ASSERT_TRUE(s.ok()) << s.ToString();
      totals[l.daemon].ops++;
      totals[l.daemon].bytes_read += all.size();
      ASSERT_EQ(Mismatch(all.data(), l.shadow.data(), all.size()), -1)
          << "final read-back of lease " << std::hex << l.slab.lease_id << std::dec << " on daemon "
          << l.daemon << " differs at byte " << Mismatch(all.data(), l.shadow.data(), all.size());
    }
  }

 private:
  struct Planned {
    Op op;
    Lease* lease;
    size_t read_at = 0;  // where in read_buf_ a read lands
  };

  static long Mismatch(const uint8_t* a, const uint8_t* b, size_t n) {
    if (std::memcmp(a, b, n) == 0) return -1;
    for (size_t i = 0; i < n; ++i) {
      if (a[i] != b[i]) return static_cast<long>(i);
    }
    return -1;
  }

  uint32_t RandomSize() {
    // Log-uniform 1 B .. 64 KiB: as many tiny ops as large ones.
    const uint32_t bits = static_cast<uint32_t>(rng_() % 17);
    return 1 + static_cast<uint32_t>(rng_() % (uint64_t{1} << bits));
  }

  uint64_t RandomOffset(uint64_t slab_len, uint32_t size) {
    const uint64_t last = slab_len - size;
    switch (rng_() % 8) {
      case 0:
        return last;  // ends exactly at the end of the slab
      case 1:
        return last - std::min<uint64_t>(last, rng_() % 64);  // just before the end
      case 2:
        return std::min<uint64_t>(last, rng_() % 64);  // at or near the start
      default:
        return rng_() % (last + 1);
    }
  }

  Lease* LeaseOn(size_t daemon) {
    const size_t i = daemon * kLeasesPerDaemon + rng_() % kLeasesPerDaemon;
    return &leases[i];
  }

  // An op on `daemon` that does not overlap a write already in `plan` (and, if it is a write,
  // overlaps nothing in `plan`): ops in flight together may run in any order.
  Planned Plan(size_t daemon, const std::vector<Planned>& plan, bool reads_only, uint32_t size,
               size_t* read_cursor) {
    for (;;) {
      Lease* l = LeaseOn(daemon);
      const uint32_t n = size != 0 ? size : RandomSize();
      const uint64_t off = RandomOffset(l->slab.length, n);
      const bool write = !reads_only && rng_() % 2 == 0;
      bool conflict = false;
      for (const Planned& p : plan) {
        if (p.lease != l || (!write && p.op.type == OpType::kRead)) continue;
        if (off < p.op.offset + p.op.length && p.op.offset < off + n) conflict = true;
      }
      if (conflict) continue;
      Planned p;
      p.lease = l;
      p.op.slab = l->slab;
      p.op.offset = off;
      p.op.length = n;
      if (write) {
        p.op.type = OpType::kWrite;
        p.op.local = &pool_[rng_() % (pool_.size() - n)];
      } else {
        p.op.type = OpType::kRead;
        p.read_at = *read_cursor;
        p.op.local = &read_buf_[*read_cursor];
        *read_cursor += n;
      }
      return p;
    }
  }

  // Checks reads against the shadow as it was before the group, then applies the writes.
  void Settle(size_t daemon, const std::vector<Planned>& plan) {
    for (const Planned& p : plan) {
      if (p.op.type != OpType::kRead) continue;
      const uint8_t* want = p.lease->shadow.data() + p.op.offset;
      const long bad = Mismatch(read_buf_.data() + p.read_at, want, p.op.length);
      ASSERT_EQ(bad, -1) << "after " << done << " ops: read of " << p.op.length
                         << " bytes at offset " << p.op.offset << " of lease " << std::hex
                         << p.lease->slab.lease_id << std::dec << " on daemon " << daemon
                         << " differs at byte " << bad;
    }
    for (const Planned& p : plan) {
      DaemonTotals& t = totals[daemon];
      t.ops++;
      if (p.op.type == OpType::kWrite) {
        std::memcpy(p.lease->shadow.data() + p.op.offset, p.op.local, p.op.length);
        t.bytes_written += p.op.length;
      } else {
        t.bytes_read += p.op.length;
      }
    }
    done += plan.size();
  }

  size_t Single(size_t daemon) {
    size_t cursor = 0;
    std::vector<Planned> plan = {Plan(daemon, {}, false, 0, &cursor)};
    const Op& op = plan[0].op;
    Status s = op.type == OpType::kRead
                   ? channels[daemon]->Read(op.slab, op.offset,
                                            {static_cast<uint8_t*>(op.local), op.length})
                   : channels[daemon]->Write(op.slab, op.offset,
                                             {static_cast<const uint8_t*>(op.local), op.length});
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (!s.ok()) return 0;
    Settle(daemon, plan);
    return 1;
  }

  size_t Batch(size_t daemon, size_t n, bool reads_only, uint32_t size = 0) {
    std::vector<Planned> plan;
    size_t cursor = 0;
    for (size_t i = 0; i < n; ++i) plan.push_back(Plan(daemon, plan, reads_only, size, &cursor));
    std::vector<Op> ops;
    for (const Planned& p : plan) ops.push_back(p.op);
    std::vector<Status> results(ops.size());
    Status s = channels[daemon]->Execute(ops, results);
    EXPECT_TRUE(s.ok()) << s.ToString();
    for (size_t i = 0; i < results.size(); ++i) {
      EXPECT_TRUE(results[i].ok()) << "op " << i << ": " << results[i].ToString();
    }
    if (!s.ok()) return 0;
    Settle(daemon, plan);
    return n;
  }

  // Each op its own READ/WRITE frame, all in flight at once; replies matched by request id.
  size_t Pipeline(size_t daemon, size_t n) {
    transport::Channel& ch = *channels[daemon];
    std::vector<Planned> plan;
    size_t cursor = 0;
    for (size_t i = 0; i < n; ++i) {
      plan.push_back(Plan(daemon, plan, false, 0, &cursor));
      plan.back().op.user_data = i;
      Status s = ch.Post(plan.back().op);
      EXPECT_TRUE(s.ok()) << s.ToString();
      s = ch.Flush();
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    std::vector<bool> seen(n, false);
    size_t completed = 0;
    transport::Completion comps[16];
    while (completed < n) {
      auto got = ch.Poll(comps, std::chrono::milliseconds(5000));
      EXPECT_TRUE(got.has_value()) << got.error().ToString();
      if (!got.has_value() || *got == 0) return 0;
      for (size_t i = 0; i < *got; ++i) {
        EXPECT_TRUE(comps[i].status.ok()) << comps[i].status.ToString();
        EXPECT_LT(comps[i].user_data, n);
        if (comps[i].user_data >= n || seen[comps[i].user_data]) return 0;
        seen[comps[i].user_data] = true;
        ++completed;
      }
    }
    EXPECT_EQ(ch.outstanding(), 0u);
    Settle(daemon, plan);
    return n;
  }

  std::mt19937_64 rng_;
  std::vector<uint8_t> pool_;      // random bytes that writes are taken from
  std::vector<uint8_t> read_buf_;  // where reads of one group land
};

TEST(RandomIo, HundredThousandOpsOnThreeDaemonsMatchTheShadowCopy) {
  const uint64_t seed = EnvOr("FARMEM_TEST_SEED", std::random_device{}());
  const uint64_t target = EnvOr("FARMEM_RANDOM_IO_OPS", 100000);
  SCOPED_TRACE("FARMEM_TEST_SEED=" + std::to_string(seed));
  RecordProperty("seed", std::to_string(seed));

  DaemonSet daemons({.capacity = "8M", .slab_size = "1M", .extra_args = {"--no-mlock"}});
  ASSERT_TRUE(daemons.Start(3).ok()) << daemons.Logs();

  RandomIo io(seed);
  const wire::ClientId id = RandomClientId();
  std::vector<DaemonClient> clients;
  for (size_t d = 0; d < daemons.size(); ++d) {
    auto c = DaemonClient::Connect(daemons[d].endpoint(), daemons.secret(), id);
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    auto grants = c->Alloc(kLeasesPerDaemon);
    ASSERT_TRUE(grants.has_value()) << grants.error().ToString();
    for (const wire::LeaseGrant& g : *grants) {
      ASSERT_EQ(g.length, 1u << 20);
      // A new lease reads as zeros: the shadow starts out that way.
      io.leases.push_back({d, RemoteSlab::From(g), std::vector<uint8_t>(g.length, 0)});
    }
    auto ch = c->OpenChannel(kWindow);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    io.channels.push_back(std::move(*ch));
    clients.push_back(std::move(*c));
  }
  io.totals.resize(daemons.size());

  const auto start = std::chrono::steady_clock::now();
  auto last_heartbeat = start;
  while (io.done < target) {
    const size_t before = io.done;
    io.Step();
    ASSERT_FALSE(::testing::Test::HasFailure()) << "stopped after " << io.done << " ops";
    ASSERT_GT(io.done, before);
    // Data ops do not renew leases: heartbeat like a real client does.
    if (std::chrono::steady_clock::now() - last_heartbeat > std::chrono::milliseconds(500)) {
      for (DaemonClient& c : clients) {
        auto hb = c.Heartbeat();
        ASSERT_TRUE(hb.has_value()) << hb.error().ToString();
        EXPECT_EQ(hb->leases_held, kLeasesPerDaemon);
      }
      last_heartbeat = std::chrono::steady_clock::now();
    }
  }
  io.ReadBackEverything();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%llu ops in %.2f s (seed %llu)\n", static_cast<unsigned long long>(io.done), secs,
              static_cast<unsigned long long>(seed));

  // The daemons saw exactly what this client did: no op lost, none duplicated.
  for (size_t d = 0; d < daemons.size(); ++d) {
    auto st = clients[d].Stat();
    ASSERT_TRUE(st.has_value()) << st.error().ToString();
    EXPECT_EQ(st->ops, io.totals[d].ops) << "daemon " << d;
    EXPECT_EQ(st->bytes_written, io.totals[d].bytes_written) << "daemon " << d;
    EXPECT_EQ(st->bytes_read, io.totals[d].bytes_read) << "daemon " << d;
    EXPECT_EQ(st->free_slabs, st->total_slabs - kLeasesPerDaemon);
    const transport::ChannelStats cs = io.channels[d]->stats();
    EXPECT_EQ(cs.ops, io.totals[d].ops);
    EXPECT_EQ(cs.bytes_written, io.totals[d].bytes_written);
    EXPECT_TRUE(ProcessAlive(daemons[d].pid()));
  }
}

}  // namespace
}  // namespace farmem::testing
