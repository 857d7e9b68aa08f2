// Regression tests for daemon bugs found by this suite, each named after what broke. They run
// against a real farmemd like the other integration tests. (Kept in their own binary so a
// regression shows up by name in ctest's summary.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "daemon_client.h"
#include "support/daemon_fixture.h"
#include "support/raw_client.h"

namespace farmem::testing {
namespace {

using std::chrono::milliseconds;
using wire::Opcode;

constexpr uint64_t kSlabSize = 1 << 20;

DaemonConfig SmallDaemon() {
  return {.capacity = "4M", .slab_size = "1M", .log_level = "warn", .extra_args = {"--no-mlock"}};
}

// Lease id 0 is epoch 0 / slab 0, and a free slab's lease id is 0 too: a client whose id is all
// zeros (the default of transport::Credentials) must still not reach free slab 0, and FREE of
// lease 0 must not put slab 0 on the free list a second time (it would then be granted twice).
TEST(DaemonRegression, LeaseIdZeroNeverReachesAFreeSlab) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto zero = RawClient::Connect(daemons[0].endpoint());
  ASSERT_TRUE(zero.has_value());
  ASSERT_TRUE(zero->Hello(wire::ClientId{}, daemons.secret()).ok());

  const std::vector<uint8_t> planted(64, 0x5e);
  Status w = zero->Write(0, 0, planted);
  EXPECT_FALSE(w.ok()) << "wrote into free slab 0 through lease id 0";
  auto r = zero->Read(0, 0, 64);
  EXPECT_FALSE(r.has_value()) << "read free slab 0 through lease id 0";
  Status f = zero->Free({0, 0});
  EXPECT_FALSE(f.ok()) << "freed a slab that was already free";

  auto st = zero->Stat();
  ASSERT_TRUE(st.has_value());
  EXPECT_LE(st->free_slabs, st->total_slabs) << "free list holds a slab twice";

  // Every slab handed out exactly once, and reading as zeros.
  auto other = DaemonClient::Connect(daemons[0].endpoint(), daemons.secret());
  ASSERT_TRUE(other.has_value());
  auto all = other->Alloc(st->total_slabs);
  ASSERT_TRUE(all.has_value()) << all.error().ToString();
  std::vector<uint32_t> slabs;
  for (const auto& g : *all) slabs.push_back(wire::LeaseSlab(g.lease_id));
  std::sort(slabs.begin(), slabs.end());
  EXPECT_TRUE(std::adjacent_find(slabs.begin(), slabs.end()) == slabs.end())
      << "a slab was granted twice";
  EXPECT_EQ(CodeOf(other->Alloc(1)), StatusCode::kResourceExhausted)
      << "more slabs granted than the daemon has";
  auto ch = other->OpenChannel();
  ASSERT_TRUE(ch.has_value());
  for (const auto& g : *all) {
    std::vector<uint8_t> head(64);
    ASSERT_TRUE((*ch)->Read(transport::RemoteSlab::From(g), 0, head).ok());
    EXPECT_EQ(head, std::vector<uint8_t>(64, 0))
        << "slab " << wire::LeaseSlab(g.lease_id) << " was handed out with someone's data";
  }
}

// A WRITE (or BATCH) whose body_len is smaller than its fixed part: the daemon must answer it
// from the frame alone, not wait for bytes that belong to no frame (the client would wait for
// the answer forever, and the daemon for the bytes).
TEST(DaemonRegression, DataFrameShorterThanItsFixedPartIsAnsweredAtOnce) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  struct Case {
    Opcode op;
    uint32_t body_len;
  };
  for (const Case& k : {Case{Opcode::kWrite, 0}, Case{Opcode::kWrite, 23}, Case{Opcode::kBatch, 0},
                        Case{Opcode::kBatch, 4}}) {
    auto c = RawClient::Connect(daemons[0].endpoint());
    ASSERT_TRUE(c.has_value());
    ASSERT_TRUE(c->Hello(RandomClientId(), daemons.secret()).ok());
    ASSERT_TRUE(
        c->SendRaw({.opcode = static_cast<uint8_t>(k.op), .request_id = 11, .body_len = k.body_len},
                   std::vector<uint8_t>(k.body_len, 0))
            .ok());
    auto f = c->Receive(milliseconds(2000));
    ASSERT_TRUE(f.has_value()) << wire::OpcodeName(static_cast<uint8_t>(k.op)) << " with body_len "
                               << k.body_len << " was never answered: " << f.error().ToString();
    EXPECT_EQ(f->header.request_id, 11u);
    EXPECT_NE(f->code(), StatusCode::kOk);
    auto st = c->Stat();
    EXPECT_TRUE(st.has_value()) << "connection unusable after the error";
  }
}

// Ending a lease waits until no operation uses its slab. A client that stalls a WRITE payload
// (the daemon allows 10 s) and FREEs that lease from another connection must not freeze the
// daemon's control plane for everyone else in the meantime.
TEST(DaemonRegression, FreeingAStalledWritesLeaseDoesNotBlockOtherClients) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  const wire::ClientId id = RandomClientId();
  auto stalled = RawClient::Connect(ep);
  ASSERT_TRUE(stalled.has_value());
  ASSERT_TRUE(stalled->Hello(id, daemons.secret()).ok());
  auto lease = stalled->Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t lease_id = (*lease)[0].lease_id;
  std::vector<uint8_t> body = DataOpBody(lease_id, 0, 65536);
  body.resize(body.size() + 100, 0xaa);  // the rest of the payload never comes
  ASSERT_TRUE(stalled
                  ->SendRaw({.opcode = static_cast<uint8_t>(Opcode::kWrite),
                             .request_id = 1,
                             .body_len = 24 + 65536},
                            body)
                  .ok());
  ASSERT_TRUE(stalled->Silent(milliseconds(100)));

  auto freer = RawClient::Connect(ep);
  ASSERT_TRUE(freer.has_value());
  ASSERT_TRUE(freer->Hello(id, daemons.secret()).ok());
  std::vector<uint8_t> free_body;
  wire::EncodeFree({{lease_id}}, &free_body);
  auto free_id = freer->SendFrame(Opcode::kFree, free_body);
  ASSERT_TRUE(free_id.has_value()) << free_id.error().ToString();
  // Wait until the daemon has the FREE in hand: its reply has come (the slab is reclaimed once
  // the write lets go), or, where ending the lease waits for the slab, none comes for 100 ms.
  std::optional<RawFrame> freed;
  if (!freer->Silent(milliseconds(100))) {
    auto r = freer->Receive(milliseconds(5000));
    ASSERT_TRUE(r.has_value()) << r.error().ToString();
    freed = std::move(*r);
  }

  // Someone else entirely: STAT and ALLOC must answer promptly.
  auto bystander = RawClient::Connect(ep);
  ASSERT_TRUE(bystander.has_value());
  ASSERT_TRUE(bystander->Hello(RandomClientId(), daemons.secret()).ok());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(bystander->SendFrame(Opcode::kStat).has_value());
  auto f = bystander->Receive(milliseconds(1000));
  const auto took =
      std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start);
  EXPECT_TRUE(f.has_value()) << "STAT of an unrelated client blocked for " << took.count()
                             << " ms behind the stalled write's lease";

  stalled->Close();  // unpins the slab; everything must now complete
  if (!freed) {
    auto r = freer->Receive(milliseconds(5000));
    ASSERT_TRUE(r.has_value()) << "FREE never answered: " << r.error().ToString();
    freed = std::move(*r);
  }
  EXPECT_EQ(freed->header.request_id, *free_id);
  EXPECT_TRUE(freed->status().ok()) << freed->status().ToString();
}

// "One error reply, then close" (docs/wire-protocol.md): the peer must see the close right after
// the reply, not when the daemon's housekeeping next reaps finished connections (every
// lease_ttl / 4: 2.5 s by default, 15 min with the longest TTL). Until then the client hangs and
// the connection still counts against --max-connections and in STAT's client count.
TEST(DaemonRegression, ClosesTheConnectionRightAfterAFramingError) {
  DaemonSet daemons(SmallDaemon());  // default lease TTL: housekeeping every 2.5 s
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto c = RawClient::Connect(daemons[0].endpoint());
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->SendRaw({.magic = 0xdeadbeef}).ok());
  auto f = c->Receive();
  ASSERT_TRUE(f.has_value()) << f.error().ToString();
  EXPECT_EQ(f->code(), StatusCode::kProtocolError);
  const auto start = std::chrono::steady_clock::now();
  const bool closed = c->WaitClosed(milliseconds(5000));
  const auto took =
      std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start);
  EXPECT_TRUE(closed);
  EXPECT_LT(took.count(), 500) << "the daemon closed the connection only after " << took.count()
                               << " ms";
}

// A client that disconnects is no longer counted in STAT's `clients`.
TEST(DaemonRegression, StatStopsCountingAClientThatLeft) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto observer = RawClient::Connect(daemons[0].endpoint());
  ASSERT_TRUE(observer.has_value());
  ASSERT_TRUE(observer->Hello(RandomClientId(), daemons.secret()).ok());
  {
    auto leaving = RawClient::Connect(daemons[0].endpoint());
    ASSERT_TRUE(leaving.has_value());
    ASSERT_TRUE(leaving->Hello(RandomClientId(), daemons.secret()).ok());
    auto st = observer->Stat();
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->clients, 2u);
  }
  // The daemon notices the close on the connection's thread: wait for the count to drop, but not
  // as long as housekeeping's reaping (every 2.5 s), which would hide the bug.
  uint32_t clients = 0;
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto st = observer->Stat();
        clients = st.has_value() ? st->clients : 0;
        return st.has_value() && st->clients == 1;
      },
      milliseconds(1500)))
      << "STAT still counts " << clients << " clients";
}

// "A frame that stops arriving midway: closed after 10 s" (docs/wire-protocol.md). That held for
// write payloads only: a cut header, control body or BATCH descriptor table held its connection
// (and one of --max-connections' slots) forever. Takes the daemon's 10 s frame timeout to run.
TEST(DaemonRegression, FrameCutShortAnywhereIsClosedAfterTheFrameTimeout) {
  DaemonSet daemons(SmallDaemon());
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  const Endpoint ep = daemons[0].endpoint();
  std::vector<RawClient> cut;
  {  // half a header, before HELLO
    auto c = RawClient::Connect(ep);
    ASSERT_TRUE(c.has_value());
    const auto hdr = EncodeRawHeader({.opcode = static_cast<uint8_t>(Opcode::kHello)});
    ASSERT_TRUE(c->Send(std::span(hdr).first(6)).ok());
    cut.push_back(std::move(*c));
  }
  {  // a control body cut short
    auto c = RawClient::Connect(ep);
    ASSERT_TRUE(c.has_value());
    ASSERT_TRUE(c->Hello(RandomClientId(), daemons.secret()).ok());
    ASSERT_TRUE(c->SendRaw({.opcode = static_cast<uint8_t>(Opcode::kFree), .body_len = 16},
                           std::vector<uint8_t>{1, 0, 0})
                    .ok());
    cut.push_back(std::move(*c));
  }
  {  // a BATCH descriptor table cut short
    auto c = RawClient::Connect(ep);
    ASSERT_TRUE(c.has_value());
    ASSERT_TRUE(c->Hello(RandomClientId(), daemons.secret()).ok());
    const RawBatchOp ops[] = {{static_cast<uint8_t>(Opcode::kRead), 8, 1, 0},
                              {static_cast<uint8_t>(Opcode::kRead), 8, 1, 0}};
    const auto table = BatchTable(ops, 2);
    ASSERT_TRUE(c->SendRaw({.opcode = static_cast<uint8_t>(Opcode::kBatch),
                            .body_len = static_cast<uint32_t>(table.size())},
                           std::span(table).first(20))
                    .ok());
    cut.push_back(std::move(*c));
  }
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < cut.size(); ++i) {
    const auto left = milliseconds(13000) - std::chrono::duration_cast<milliseconds>(
                                                std::chrono::steady_clock::now() - start);
    EXPECT_TRUE(cut[i].WaitClosed(std::max(left, milliseconds(1))))
        << "connection " << i << " with a cut frame still open after 13 s";
  }
}

// Poll(0) on a TCP channel whose daemon closed the connection cleanly (FIN) must complete the
// outstanding operations with an error. recv() returning 0 leaves errno as it was, so deciding
// "nothing yet" from errno == EAGAIN after it reports 0 whenever an earlier call on this thread
// left EAGAIN behind, and a caller waiting on wait_fd() (readable at EOF) spins forever.
TEST(TransportRegression, ZeroTimeoutPollNoticesADaemonThatClosedTheConnection) {
  // A stand-in daemon: answers HELLO (no authentication), takes one READ, then closes cleanly.
  auto listener = ListenTcp({"127.0.0.1", 0});
  ASSERT_TRUE(listener.has_value());
  const uint16_t port = LocalPort(*listener).value_or(0);
  std::thread daemon([&] {
    pollfd p{listener->fd(), POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
    Socket s(::accept(listener->fd(), nullptr, nullptr));
    const Deadline deadline = DeadlineIn(milliseconds(5000));
    auto hello = RecvFrame(s.fd(), deadline);
    if (!hello.has_value()) return;
    std::vector<uint8_t> reply_body;
    wire::EncodeHelloReply({}, &reply_body);
    if (!SendReply(s.fd(), hello->header, reply_body, deadline).ok()) return;
    std::vector<uint8_t> read_req(wire::kHeaderSize + wire::kDataOpSize);
    (void)RecvExact(s.fd(), read_req, deadline);
    // Closing with nothing unread sends FIN, not RST.
  });

  auto transport = transport::MakeTcpTransport();
  auto ch = transport->OpenChannel(ClientOptions({"127.0.0.1", port}, "", RandomClientId()));
  ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
  std::vector<uint8_t> buf(16);
  transport::Op op;
  op.slab.lease_id = wire::MakeLeaseId(1, 0);
  op.slab.length = 1 << 20;
  op.local = buf.data();
  op.length = 16;
  ASSERT_TRUE((*ch)->Post(op).ok());
  ASSERT_TRUE((*ch)->Flush().ok());
  daemon.join();
  pollfd p{(*ch)->wait_fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1) << "the close never reached the client";

  transport::Completion comps[4];
  size_t reaped = 0;
  for (int i = 0; i < 3 && reaped == 0; ++i) {
    errno = EAGAIN;  // as an earlier non-blocking send or receive on this thread leaves it
    auto n = (*ch)->Poll(comps, milliseconds(0));
    ASSERT_TRUE(n.has_value()) << n.error().ToString();
    reaped += *n;
  }
  ASSERT_EQ(reaped, 1u) << "Poll(0) kept reporting nothing on a connection the daemon closed";
  EXPECT_FALSE(comps[0].status.ok());
  EXPECT_TRUE((*ch)->broken());
  EXPECT_EQ((*ch)->outstanding(), 0u);
}

}  // namespace
}  // namespace farmem::testing
