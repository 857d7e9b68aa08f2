// Leases on real daemons: a client that dies (SIGKILL, no goodbye) loses its slabs after the TTL,
// the slabs come back zeroed, and its lease ids stay dead; heartbeats keep a lease alive; full
// daemons refuse ALLOC with ResourceExhausted saying how many slabs are free; FREE is all or
// nothing and only for the owner.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "daemon_client.h"
#include "support/daemon_fixture.h"

namespace farmem::testing {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr uint32_t kSlabs = 8;
constexpr uint64_t kSlabSize = 1 << 20;
constexpr uint32_t kTtlMs = 500;

DaemonConfig SmallDaemon(std::optional<uint32_t> ttl_ms = std::nullopt) {
  return {
      .capacity = "8M", .slab_size = "1M", .lease_ttl_ms = ttl_ms, .extra_args = {"--no-mlock"}};
}

// Waits until `pred` holds (polling every 20 ms) or the timeout passes.
template <typename Pred>
bool WaitFor(Pred pred, milliseconds timeout) {
  return WaitUntil(pred, timeout, milliseconds(20));
}

uint8_t PatternByte(uint64_t lease_id, uint64_t offset) {
  return static_cast<uint8_t>((lease_id * 131 + offset * 7 + 1) | 1);  // never zero
}

// What the doomed client reports to the test through a pipe before it is killed.
struct ChildReport {
  wire::ClientId client_id;
  uint64_t lease_ids[kSlabs];
  int ok;
};

// The child: takes every slab, fills each with a non-zero pattern, reports, then heartbeats until
// it is killed. It heartbeats while it fills too, as a live client does: eight 1 MiB patterns
// made and written under ASan beside a TSan run took longer than the 500 ms TTL once (a
// fresh-clone CI), and the daemon rightly expired the leases before the child reported.
// Runs between fork and _exit: no gtest here.
[[noreturn]] void DoomedClient(const Endpoint& ep, const std::string& secret, int fd) {
  ChildReport report{};
  report.client_id = RandomClientId();
  auto c = DaemonClient::Connect(ep, secret, report.client_id);
  Result<std::vector<wire::LeaseGrant>> grants = Err(Unavailable("not connected"));
  if (c.has_value()) grants = c->Alloc(kSlabs);
  bool ok = grants.has_value();
  if (ok) {
    auto ch = c->OpenChannel();
    ok = ch.has_value();
    std::vector<uint8_t> buf(kSlabSize);
    for (size_t i = 0; ok && i < kSlabs; ++i) {
      const wire::LeaseGrant& g = (*grants)[i];
      report.lease_ids[i] = g.lease_id;
      for (uint64_t off = 0; off < kSlabSize; ++off) buf[off] = PatternByte(g.lease_id, off);
      ok = c->Heartbeat().has_value() && (*ch)->Write(transport::RemoteSlab::From(g), 0, buf).ok();
    }
  }
  report.ok = ok ? 1 : 0;
  (void)!::write(fd, &report, sizeof(report));
  ::close(fd);
  for (;;) {
    if (ok) (void)c->Heartbeat();
    std::this_thread::sleep_for(milliseconds(50));  // time is the subject: the heartbeat period
  }
}

TEST(LeaseReclaim, KilledClientsSlabsReturnZeroedAndItsLeaseIdsStayExpired) {
  DaemonSet daemons(SmallDaemon(kTtlMs));
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();

  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipefd[0]);
    DoomedClient(ep, daemons.secret(), pipefd[1]);
  }
  ::close(pipefd[1]);
  ChildReport report{};
  const ssize_t n = ::read(pipefd[0], &report, sizeof(report));
  ::close(pipefd[0]);
  auto kill_child = [&] {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  };
  if (n != sizeof(report) || report.ok != 1) {
    kill_child();
    FAIL() << "the doomed client could not set up its leases\n" << daemons.Logs();
  }

  auto observer = DaemonClient::Connect(ep, daemons.secret());
  ASSERT_TRUE(observer.has_value()) << observer.error().ToString();
  // While the child heartbeats, its leases outlive the TTL several times over (time is the
  // subject: the TTL must pass).
  std::this_thread::sleep_for(milliseconds(3 * kTtlMs));
  auto st = observer->Stat();
  ASSERT_TRUE(st.has_value()) << st.error().ToString();
  EXPECT_EQ(st->free_slabs, 0u);
  EXPECT_EQ(st->total_slabs, kSlabs);
  EXPECT_EQ(st->clients, 2u);

  kill_child();
  const auto killed_at = std::chrono::steady_clock::now();
  const bool freed = WaitFor(
      [&] {
        auto s = observer->Stat();
        return s.has_value() && s->free_slabs == kSlabs;
      },
      milliseconds(10 * kTtlMs));
  const auto took =
      std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - killed_at);
  ASSERT_TRUE(freed) << "slabs of the dead client were not reclaimed\n" << daemons.Logs();
  // Not before the TTL ran out (the child's last heartbeat was at most 50 ms before the kill).
  EXPECT_GE(took.count(), kTtlMs - 150) << "reclaimed too early";

  // The dead client's ids fail with Expired, for anyone, including its own client id coming back.
  auto same_id = RawClient::Connect(ep);
  ASSERT_TRUE(same_id.has_value());
  ASSERT_TRUE(same_id->Hello(report.client_id, daemons.secret()).ok());
  for (uint64_t id : report.lease_ids) {
    auto r = same_id->Read(id, 0, 64);
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code(), StatusCode::kExpired) << r.error().ToString();
    const std::vector<uint8_t> junk(64, 0xee);
    EXPECT_EQ(same_id->Write(id, kSlabSize - 64, junk).code(), StatusCode::kExpired);
    EXPECT_EQ(same_id->Free({id}).code(), StatusCode::kExpired);
  }

  // A new client gets every slab again, with new lease ids, and reads zeros everywhere.
  auto grants = observer->Alloc(kSlabs);
  ASSERT_TRUE(grants.has_value()) << grants.error().ToString();
  auto ch = observer->OpenChannel();
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  std::vector<uint8_t> data(kSlabSize);
  for (const wire::LeaseGrant& g : *grants) {
    EXPECT_EQ(std::count(std::begin(report.lease_ids), std::end(report.lease_ids), g.lease_id), 0)
        << "lease id reused";
    // The observer's leases have the same short TTL: renewed before each read, or eight 1 MiB
    // reads under ASan on a loaded machine outlast it (CI: a read failed, the lease expired).
    auto beat = observer->Heartbeat();
    ASSERT_TRUE(beat.has_value()) << beat.error().ToString();
    const Status read = (*ch)->Read(transport::RemoteSlab::From(g), 0, data);
    ASSERT_TRUE(read.ok()) << read.ToString();
    const auto nonzero = std::find_if(data.begin(), data.end(), [](uint8_t b) { return b != 0; });
    EXPECT_EQ(nonzero, data.end())
        << "slab " << wire::LeaseSlab(g.lease_id)
        << " still holds the dead client's byte at offset " << (nonzero - data.begin());
  }
  // And the old ids do not reach the new leases, even on the slabs they named.
  for (uint64_t id : report.lease_ids) {
    EXPECT_EQ(CodeOf(same_id->Read(id, 0, 1)), StatusCode::kExpired);
  }
}

TEST(LeaseReclaim, HeartbeatsKeepLeasesAndDataAlive) {
  // A TTL long enough that a loaded machine does not starve the heartbeat loop past it: with
  // 500 ms, a CI run beside other builds (load 10-13) once went a whole TTL between two beats
  // and the daemon rightly expired the leases.
  constexpr uint32_t kBeatTtlMs = 2000;
  DaemonSet daemons(SmallDaemon(kBeatTtlMs));
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto c = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  auto grants = c->Alloc(2);
  ASSERT_TRUE(grants.has_value()) << grants.error().ToString();
  auto ch = c->OpenChannel();
  ASSERT_TRUE(ch.has_value());
  const transport::RemoteSlab slab = transport::RemoteSlab::From((*grants)[0]);
  const std::vector<uint8_t> data(4096, 0x3c);
  ASSERT_TRUE((*ch)->Write(slab, kSlabSize - 4096, data).ok());

  // Data traffic alone does not renew a lease; heartbeats do. Keep both up for 3 TTLs.
  const auto until = std::chrono::steady_clock::now() + milliseconds(3 * kBeatTtlMs);
  while (std::chrono::steady_clock::now() < until) {
    auto hb = c->Heartbeat();
    ASSERT_TRUE(hb.has_value()) << hb.error().ToString();
    EXPECT_EQ(hb->leases_held, 2u);
    EXPECT_EQ(hb->lease_ttl_ms, kBeatTtlMs);
    std::this_thread::sleep_for(
        milliseconds(kBeatTtlMs / 10));  // time is the subject: heartbeat period
  }
  std::vector<uint8_t> back(4096);
  ASSERT_TRUE((*ch)->Read(slab, kSlabSize - 4096, back).ok());
  EXPECT_EQ(back, data);

  // Stop heartbeating: the same connection, still open, loses its leases after the TTL.
  ASSERT_TRUE(WaitFor(
      [&] {
        auto s = c->Stat();
        return s.has_value() && s->free_slabs == kSlabs;
      },
      milliseconds(10 * kBeatTtlMs)));
  Status s = (*ch)->Read(slab, 0, back);
  EXPECT_EQ(s.code(), StatusCode::kExpired) << s.ToString();
  auto hb = c->Heartbeat();
  ASSERT_TRUE(hb.has_value());
  EXPECT_EQ(hb->leases_held, 0u);
}

TEST(LeaseAlloc, FullDaemonsRefuseWithResourceExhaustedAndSayHowManyAreFree) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(2).ok()) << daemons.Logs();
  for (size_t d = 0; d < daemons.size(); ++d) {
    auto c = DaemonClient::Connect(daemons[d].endpoint(), daemons.secret());
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    ASSERT_TRUE(c->Alloc(5).has_value());

    auto too_many = c->Alloc(4);
    ASSERT_FALSE(too_many.has_value());
    EXPECT_EQ(too_many.error().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(too_many.error().message(), HasSubstr("only 3 of 8 are free"));
    // All or nothing: the refused request took nothing.
    auto st = c->Stat();
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->free_slabs, 3u);

    ASSERT_TRUE(c->Alloc(3).has_value());
    auto full = c->Alloc(1);
    ASSERT_FALSE(full.has_value());
    EXPECT_EQ(full.error().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(full.error().message(), HasSubstr("only 0 of 8 are free"));

    // Another client of the same full daemon is refused the same way.
    auto other = DaemonClient::Connect(daemons[d].endpoint(), daemons.secret());
    ASSERT_TRUE(other.has_value());
    auto refused = other->Alloc(1);
    ASSERT_FALSE(refused.has_value());
    EXPECT_EQ(refused.error().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.error().message(), HasSubstr("0 of 8"));
  }
}

TEST(LeaseAlloc, CountsOutsideOneTo1024AreInvalid) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto c = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(CodeOf(c->Alloc(0)), StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(c->Alloc(1025)), StatusCode::kInvalidArgument);
  // More than the daemon has, but a valid count: ResourceExhausted, not InvalidArgument.
  EXPECT_EQ(CodeOf(c->Alloc(1024)), StatusCode::kResourceExhausted);
  auto st = c->Stat();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->free_slabs, kSlabs);
}

TEST(LeaseFree, IsAllOrNothingAndOnlyForTheOwner) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto a = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  auto b = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(a.has_value() && b.has_value());
  auto la = a->Alloc(3);
  auto lb = b->Alloc(1);
  ASSERT_TRUE(la.has_value() && lb.has_value());

  // One foreign id in the list: PermissionDenied, and none of the list is freed.
  Status s = a->Free({(*la)[0].lease_id, (*lb)[0].lease_id});
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  // One unknown id: Expired, and nothing freed either.
  s = a->Free({(*la)[0].lease_id, wire::MakeLeaseId(12345, 1)});
  EXPECT_EQ(s.code(), StatusCode::kExpired) << s.ToString();
  auto st = a->Stat();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->free_slabs, kSlabs - 4);

  // The same id twice in one list frees it once.
  ASSERT_TRUE(a->Free({(*la)[0].lease_id, (*la)[0].lease_id}).ok());
  st = a->Stat();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->free_slabs, kSlabs - 3);
  // Freed means gone: a second FREE and any access fail with Expired.
  EXPECT_EQ(a->Free({(*la)[0].lease_id}).code(), StatusCode::kExpired);
  auto ch = a->OpenChannel();
  ASSERT_TRUE(ch.has_value());
  std::vector<uint8_t> buf(16);
  EXPECT_EQ((*ch)->Read(transport::RemoteSlab::From((*la)[0]), 0, buf).code(),
            StatusCode::kExpired);
  // An empty FREE is fine and frees nothing.
  EXPECT_TRUE(a->Free({}).ok());
  ASSERT_TRUE(a->Free({(*la)[1].lease_id, (*la)[2].lease_id}).ok());
  ASSERT_TRUE(b->Free({(*lb)[0].lease_id}).ok());
  st = a->Stat();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->free_slabs, kSlabs);
}

TEST(LeaseAlloc, GrantsDistinctSlabsWithFreshEpochs) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto c = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(c.has_value());
  auto first = c->Alloc(kSlabs);
  ASSERT_TRUE(first.has_value());
  std::vector<uint32_t> slabs;
  for (const auto& g : *first) {
    EXPECT_EQ(g.length, kSlabSize);
    EXPECT_NE(wire::LeaseEpoch(g.lease_id), 0u);
    slabs.push_back(wire::LeaseSlab(g.lease_id));
  }
  std::sort(slabs.begin(), slabs.end());
  EXPECT_EQ(std::unique(slabs.begin(), slabs.end()), slabs.end()) << "a slab granted twice";
  EXPECT_LT(slabs.back(), kSlabs);
  // Free and take again: the same slabs come back under new ids.
  std::vector<uint64_t> ids;
  for (const auto& g : *first) ids.push_back(g.lease_id);
  ASSERT_TRUE(c->Free(ids).ok());
  auto second = c->Alloc(kSlabs);
  ASSERT_TRUE(second.has_value());
  for (const auto& g : *second) {
    EXPECT_EQ(std::count(ids.begin(), ids.end(), g.lease_id), 0) << "lease id reused";
  }
}

}  // namespace
}  // namespace farmem::testing
