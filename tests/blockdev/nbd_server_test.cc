// The NBD server in-process: a real NbdServer served over socketpairs and sockets, driven by the
// test client (nbd_test_client.h). Covers transmission-phase behaviour the external tools do not
// let us control: exact reply shapes, pipelining, batching limits, errors, shutdown.
#include "farmem/blockdev/nbd_server.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <thread>

#include "farmem/common/adaptive_spin.h"
#include "nbd_test_client.h"
#include "support/wait.h"
#include "test_backends.h"
#include "test_process.h"

namespace farmem::blockdev {
namespace {

using namespace farmem::blockdev::nbd;  // NOLINT(build/namespaces)
using farmem::testing::WaitUntil;
using testing::ClientOptions;
using testing::NbdReply;
using testing::NbdTestClient;
using testing::Pattern;
using testing::RecordingBackend;

constexpr uint64_t kSize = 64u << 20;

class NbdServerTest : public ::testing::Test {
 protected:
  void SetUp() override { MakeServer({}); }

  void MakeServer(NbdServerOptions opts) {
    server_.reset();
    auto mem = MemoryBackend::Create(kSize);
    ASSERT_TRUE(mem.has_value());
    backend_ = std::make_unique<RecordingBackend>(std::move(*mem));
    auto s = NbdServer::Create(backend_.get(), std::move(opts));
    ASSERT_TRUE(s.has_value()) << s.error().ToString();
    server_ = std::move(*s);
  }

  // A socketpair whose server end is handed to the server.
  Socket RawConnection() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    EXPECT_TRUE(server_->Serve(fds[0]).ok());
    return Socket(fds[1]);
  }

  NbdTestClient Connect(const ClientOptions& o = {}) {
    auto c = NbdTestClient::Handshake(RawConnection(), o);
    EXPECT_TRUE(c.has_value()) << c.error().ToString();
    return std::move(*c);
  }

  std::unique_ptr<RecordingBackend> backend_;
  std::unique_ptr<NbdServer> server_;
};

TEST_F(NbdServerTest, StructuredReadIsOneOffsetDataChunkEvenWithDf) {
  NbdTestClient c = Connect();
  ASSERT_TRUE(c.structured());
  EXPECT_EQ(c.size(), kSize);
  EXPECT_TRUE(c.transmission_flags() & kTxSendDf);
  const auto data = Pattern(65536, 1);
  ASSERT_TRUE(c.Write(4096, data).ok());
  auto r = c.Call(kCmdRead, kCmdFlagDf, 4096, 65536);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_TRUE(r->structured);
  EXPECT_EQ(r->chunks, 1);
  EXPECT_EQ(r->error, 0u);
  EXPECT_EQ(r->data, data);
}

TEST_F(NbdServerTest, SimpleRepliesWhenStructuredRepliesWereNotNegotiated) {
  ClientOptions o;
  o.structured_replies = false;
  NbdTestClient c = Connect(o);
  EXPECT_FALSE(c.structured());
  EXPECT_FALSE(c.transmission_flags() & kTxSendDf);
  const auto data = Pattern(8192, 2);
  ASSERT_TRUE(c.Write(0, data).ok());
  auto r = c.Call(kCmdRead, 0, 0, 8192);
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->structured);
  EXPECT_EQ(r->data, data);
  // DF was not advertised, so it is refused — with a simple error reply and no payload, after
  // which the stream is still in sync.
  auto bad = c.Call(kCmdRead, kCmdFlagDf, 0, 512);
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->error, kEinval);
  auto again = c.Read(0, 8192);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, data);
}

TEST_F(NbdServerTest, ExportNameFallbackWithAndWithoutZeroes) {
  for (bool no_zeroes : {true, false}) {
    ClientOptions o;
    o.use_go = false;
    o.structured_replies = false;
    o.no_zeroes = no_zeroes;
    NbdTestClient c = Connect(o);
    EXPECT_EQ(c.size(), kSize);
    EXPECT_TRUE(c.transmission_flags() & kTxHasFlags);
    ASSERT_TRUE(c.Write(0, Pattern(512, 3)).ok());
    ASSERT_TRUE(c.Disconnect().ok());
  }
}

TEST_F(NbdServerTest, ManyPipelinedRequestsAreAllAnsweredWithTheirHandles) {
  NbdTestClient c = Connect();
  // 600 requests sent back to back without reading a reply: more than one batch (256), with a
  // bad request in the middle that must fail alone.
  constexpr int kWrites = 300;
  std::vector<uint8_t> stream;
  auto add = [&](uint16_t type, uint64_t handle, uint64_t offset, uint32_t length,
                 const std::vector<uint8_t>& payload) {
    c.Expect(type, handle, offset, length);
    auto hdr = testing::RequestBytes(type, 0, handle, offset, length);
    stream.insert(stream.end(), hdr.begin(), hdr.end());
    stream.insert(stream.end(), payload.begin(), payload.end());
  };
  for (int i = 0; i < kWrites; ++i) {
    add(kCmdWrite, 1000 + i, uint64_t(i) * 4096, 4096, Pattern(4096, 100 + i));
  }
  add(0x55, 5000, 0, 512, {});  // unknown command
  for (int i = 0; i < kWrites; ++i) add(kCmdRead, 2000 + i, uint64_t(i) * 4096, 4096, {});
  // Like a real client, keep sending while replies come back (a client that does not read can
  // deadlock against any server once the socket buffers are full).
  Status sent;
  std::thread sender([&] { sent = c.SendRaw(stream); });
  std::set<uint64_t> seen;
  for (int i = 0; i < 2 * kWrites + 1; ++i) {
    auto r = c.Receive();
    if (!r.has_value()) {
      ADD_FAILURE() << r.error().ToString();
      break;
    }
    EXPECT_TRUE(seen.insert(r->handle).second) << "duplicate reply " << r->handle;
    if (r->handle == 5000) {
      EXPECT_EQ(r->error, kEinval);
      EXPECT_FALSE(r->message.empty());
    } else {
      EXPECT_EQ(r->error, 0u) << r->handle;
    }
    if (r->handle >= 2000 && r->handle < 5000) {
      EXPECT_EQ(r->data, Pattern(4096, 100 + (r->handle - 2000))) << r->handle;
    }
  }
  sender.join();
  EXPECT_TRUE(sent.ok());
  EXPECT_EQ(seen.size(), 2u * kWrites + 1);
}

TEST_F(NbdServerTest, MaximumSizeWriteAndReadRoundTrip) {
  NbdTestClient c = Connect();
  const auto data = Pattern(kMaxPayload, 4);
  ASSERT_TRUE(c.Write(kSize - kMaxPayload, data).ok());
  auto back = c.Read(kSize - kMaxPayload, kMaxPayload);
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(*back == data);
  // Two reads that together exceed the data buffer, pipelined: split over two batches.
  ASSERT_TRUE(c.Send(kCmdRead, 0, 1, kSize - kMaxPayload, kMaxPayload).ok());
  ASSERT_TRUE(c.Send(kCmdRead, 0, 2, kSize - kMaxPayload, kMaxPayload).ok());
  for (int i = 0; i < 2; ++i) {
    auto r = c.Receive();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->error, 0u);
    EXPECT_TRUE(r->data == data);
  }
}

// A request larger than the connection's buffers (256 KiB of write data and 1 MiB of read data
// per batch, nbd_connection.h: they are locked memory under --swap-safe) is served in pieces no
// larger than those: the data round-trips, FUA reaches every piece, and a small request pipelined
// behind a large one is answered after it, in sync. WRITE_ZEROES and TRIM carry no payload and
// reach the backend whole.
TEST_F(NbdServerTest, RequestsLargerThanTheBuffersAreServedInPieces) {
  constexpr uint64_t kWritePiece = 256u << 10;
  constexpr uint64_t kReadPiece = 1u << 20;
  constexpr uint64_t kAt = kSize - kMaxPayload;
  for (const bool structured : {true, false}) {
    SCOPED_TRACE(structured ? "structured replies" : "simple replies");
    ClientOptions o;
    o.structured_replies = structured;
    NbdTestClient c = Connect(o);
    backend_->clear();
    const auto data = Pattern(kMaxPayload, structured ? 11 : 12);
    ASSERT_TRUE(c.Write(kAt, data, kCmdFlagFua).ok());
    ASSERT_TRUE(c.Send(kCmdRead, 0, 1, kAt, kMaxPayload).ok());
    ASSERT_TRUE(c.Send(kCmdRead, 0, 2, kAt + 4096, 4096).ok());
    auto big = c.Receive();
    ASSERT_TRUE(big.has_value()) << big.error().ToString();
    EXPECT_EQ(big->handle, 1u);
    EXPECT_EQ(big->error, 0u);
    EXPECT_TRUE(big->data == data);
    if (structured) {
      EXPECT_EQ(big->chunks, static_cast<int>(kMaxPayload / kReadPiece));
    }
    auto small = c.Receive();
    ASSERT_TRUE(small.has_value()) << small.error().ToString();
    EXPECT_EQ(small->handle, 2u);
    EXPECT_TRUE(std::equal(small->data.begin(), small->data.end(), data.begin() + 4096));
    uint64_t written = 0, read = 0;
    for (const auto& op : backend_->ops()) {
      if (op.kind == BlockOp::Kind::kWrite) {
        EXPECT_LE(op.length, kWritePiece);
        EXPECT_TRUE(op.fua) << "FUA must reach every piece of a FUA write";
        EXPECT_EQ(op.offset, kAt + written) << "pieces in order, none left out";
        written += op.length;
      } else if (op.kind == BlockOp::Kind::kRead) {
        EXPECT_LE(op.length, kReadPiece);
        read += op.length;
      }
    }
    EXPECT_EQ(written, kMaxPayload);
    EXPECT_EQ(read, kMaxPayload + 4096);
    if (structured) {
      // DF (advertised): one chunk whatever the size, its data still read in pieces.
      auto df = c.Call(kCmdRead, kCmdFlagDf, kAt, kMaxPayload);
      ASSERT_TRUE(df.has_value()) << df.error().ToString();
      EXPECT_EQ(df->chunks, 1);
      EXPECT_TRUE(df->data == data);
    }
  }

  NbdTestClient c = Connect();
  ASSERT_TRUE(c.Write(0, Pattern(kMaxPayload, 13)).ok());
  auto z = c.Call(kCmdWriteZeroes, kCmdFlagNoHole, 0, kMaxPayload);
  ASSERT_TRUE(z.has_value());
  EXPECT_EQ(z->error, 0u);
  auto zeros = c.Read(0, kMaxPayload);
  ASSERT_TRUE(zeros.has_value());
  EXPECT_TRUE(*zeros == std::vector<uint8_t>(kMaxPayload, 0));
  auto t = c.Call(kCmdTrim, 0, 0, kMaxPayload);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->error, 0u);
}

// A read served in pieces that fails after its first piece went out: with structured replies the
// data chunks are followed by an error chunk and the connection goes on; a simple reply's header,
// or a DF read's one chunk header, already said success, so the connection is closed (the client
// sees the request fail). A write
// failing in a middle piece gets EIO, its later pieces are not written, and the stream stays in
// sync.
TEST_F(NbdServerTest, LargeRequestFailingAfterItsFirstPiece) {
  NbdTestClient c = Connect();
  backend_->set_fail_after(1);
  auto r = c.Call(kCmdRead, 0, 0, kMaxPayload);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(r->error, kEio);
  EXPECT_EQ(r->chunks, 2) << "one data chunk, then the error chunk";
  backend_->set_fail(false);
  EXPECT_TRUE(c.Read(0, 4096).has_value());

  backend_->clear();
  backend_->set_fail_after(2);
  auto w = c.Call(kCmdWrite, 0, 0, kMaxPayload, Pattern(kMaxPayload, 14));
  ASSERT_TRUE(w.has_value()) << w.error().ToString();
  EXPECT_EQ(w->error, kEio);
  backend_->set_fail(false);
  EXPECT_EQ(backend_->ops().size(), 3u) << "two pieces written, the third failed, no more tried";
  EXPECT_TRUE(c.Read(0, 4096).has_value());

  backend_->set_fail_after(1);
  ASSERT_TRUE(c.Send(kCmdRead, kCmdFlagDf, 6, 0, kMaxPayload).ok());
  EXPECT_TRUE(c.WaitForClose(std::chrono::seconds(10))) << "DF: one chunk, already begun";
  backend_->set_fail(false);

  ClientOptions o;
  o.structured_replies = false;
  NbdTestClient s = Connect(o);
  backend_->set_fail_after(1);
  ASSERT_TRUE(s.Send(kCmdRead, 0, 7, 0, kMaxPayload).ok());
  EXPECT_TRUE(s.WaitForClose(std::chrono::seconds(10)));
  backend_->set_fail(false);
}

TEST_F(NbdServerTest, WriteLongerThanMaxPayloadIsDrainedAndRefused) {
  NbdTestClient c = Connect();
  const uint32_t len = kMaxPayload + 4096;
  auto r = c.Call(kCmdWrite, 0, 0, len, Pattern(len, 5));
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(r->error, kEinval);
  // Nothing was written, and the connection is still in sync.
  auto back = c.Read(0, 4096);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, std::vector<uint8_t>(4096, 0));
  for (const auto& op : backend_->ops()) EXPECT_NE(op.kind, BlockOp::Kind::kWrite);
}

TEST_F(NbdServerTest, ReadLongerThanMaxPayloadIsEoverflowWithStructuredReplies) {
  NbdTestClient c = Connect();
  auto r = c.Call(kCmdRead, 0, 0, kMaxPayload + 512);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->error, kEoverflow);
  EXPECT_TRUE(r->data.empty());
}

TEST_F(NbdServerTest, RangeErrorsFollowTheSpec) {
  NbdTestClient c = Connect();
  const auto block = Pattern(4096, 6);
  auto w = c.Call(kCmdWrite, 0, kSize, 4096, block);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->error, kEnospc);
  auto rd = c.Call(kCmdRead, 0, kSize - 512, 1024);
  ASSERT_TRUE(rd.has_value());
  EXPECT_EQ(rd->error, kEinval);
  auto ov = c.Call(kCmdWrite, 0, UINT64_MAX - 4095, 4096, block);
  ASSERT_TRUE(ov.has_value());
  EXPECT_EQ(ov->error, kEnospc);
  auto tr = c.Call(kCmdTrim, 0, UINT64_MAX - 511, 1024);
  ASSERT_TRUE(tr.has_value());
  EXPECT_EQ(tr->error, kEnospc);
  auto un = c.Call(kCmdWrite, 0, 100, 512, Pattern(512, 7));
  ASSERT_TRUE(un.has_value());
  EXPECT_EQ(un->error, kEinval);
  auto zero_len = c.Call(kCmdRead, 0, 0, 0);
  ASSERT_TRUE(zero_len.has_value());
  EXPECT_EQ(zero_len->error, kEinval);
  EXPECT_TRUE(backend_->ops().empty()) << "invalid requests must not reach the backend";
}

TEST_F(NbdServerTest, BackendFailuresBecomeEioWithAMessage) {
  NbdTestClient c = Connect();
  backend_->set_fail(true);
  auto r = c.Call(kCmdRead, 0, 0, 4096);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->error, kEio);
  EXPECT_FALSE(r->message.empty());
  auto w = c.Call(kCmdWrite, 0, 0, 4096, Pattern(4096, 8));
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->error, kEio);
  backend_->set_fail(false);
  EXPECT_TRUE(c.Read(0, 4096).has_value());

  // With simple replies a failed READ carries no payload; the next reply must still parse.
  ClientOptions o;
  o.structured_replies = false;
  NbdTestClient s = Connect(o);
  backend_->set_fail(true);
  auto sr = s.Call(kCmdRead, 0, 0, 4096);
  ASSERT_TRUE(sr.has_value());
  EXPECT_EQ(sr->error, kEio);
  backend_->set_fail(false);
  EXPECT_TRUE(s.Read(0, 4096).has_value());
}

TEST_F(NbdServerTest, FuaNoHoleFlushAndTrimReachTheBackend) {
  NbdTestClient c = Connect();
  backend_->clear();
  ASSERT_TRUE(c.Write(0, Pattern(4096, 9), kCmdFlagFua).ok());
  ASSERT_EQ(c.Call(kCmdWriteZeroes, kCmdFlagNoHole, 4096, 8192)->error, 0u);
  ASSERT_EQ(c.Call(kCmdWriteZeroes, 0, 4096, 8192)->error, 0u);
  ASSERT_EQ(c.Call(kCmdTrim, kCmdFlagFua, 65536, 4096)->error, 0u);
  ASSERT_EQ(c.Call(kCmdFlush, 0, 0, 0)->error, 0u);
  const auto ops = backend_->ops();
  ASSERT_EQ(ops.size(), 5u);
  EXPECT_EQ(ops[0].kind, BlockOp::Kind::kWrite);
  EXPECT_TRUE(ops[0].fua);
  EXPECT_EQ(ops[1].kind, BlockOp::Kind::kWriteZeroes);
  EXPECT_FALSE(ops[1].may_trim);
  EXPECT_EQ(ops[1].length, 8192u);
  EXPECT_TRUE(ops[2].may_trim);
  EXPECT_EQ(ops[3].kind, BlockOp::Kind::kTrim);
  EXPECT_TRUE(ops[3].fua);
  EXPECT_EQ(ops[4].kind, BlockOp::Kind::kFlush);
}

TEST_F(NbdServerTest, DisconnectAnswersOutstandingRequestsThenCloses) {
  NbdTestClient c = Connect();
  std::vector<uint8_t> stream;
  for (int i = 0; i < 3; ++i) {
    auto hdr = testing::RequestBytes(kCmdWrite, 0, 10 + i, uint64_t(i) * 512, 512);
    auto data = Pattern(512, 20 + i);
    stream.insert(stream.end(), hdr.begin(), hdr.end());
    stream.insert(stream.end(), data.begin(), data.end());
  }
  auto disc = testing::RequestBytes(kCmdDisc, 0, 99, 0, 0);
  stream.insert(stream.end(), disc.begin(), disc.end());
  ASSERT_TRUE(c.SendRaw(stream).ok());
  for (int i = 0; i < 3; ++i) {
    uint8_t reply[16];
    ASSERT_TRUE(c.RecvRaw(reply).ok());
    EXPECT_EQ(LoadBe32(reply), kSimpleReplyMagic);
    EXPECT_EQ(LoadBe32(reply + 4), 0u);
    EXPECT_EQ(LoadBe64(reply + 8), 10u + i);
  }
  EXPECT_TRUE(c.WaitForClose(std::chrono::seconds(5)));
  NbdTestClient d = Connect();
  auto back = d.Read(1024, 512);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, Pattern(512, 22));
}

TEST_F(NbdServerTest, BadRequestMagicClosesOnlyThatConnection) {
  NbdTestClient good = Connect();
  NbdTestClient bad = Connect();
  auto bytes = testing::RequestBytes(kCmdRead, 0, 1, 0, 512);
  bytes[0] = 0;
  ASSERT_TRUE(bad.SendRaw(bytes).ok());
  EXPECT_TRUE(bad.WaitForClose(std::chrono::seconds(5)));
  ASSERT_TRUE(good.Write(0, Pattern(4096, 30)).ok());
  EXPECT_EQ(*good.Read(0, 4096), Pattern(4096, 30));
}

TEST_F(NbdServerTest, WritesOnOneConnectionAreSeenOnAnotherAfterFlush) {
  NbdTestClient a = Connect();
  NbdTestClient b = Connect();
  EXPECT_TRUE(a.transmission_flags() & kTxCanMultiConn);
  ASSERT_TRUE(a.Write(8192, Pattern(4096, 31)).ok());
  ASSERT_EQ(a.Call(kCmdFlush, 0, 0, 0)->error, 0u);
  EXPECT_EQ(*b.Read(8192, 4096), Pattern(4096, 31));
}

TEST_F(NbdServerTest, MultiConnIsOnlyAdvertisedWhenTheBackendSaysSo) {
  backend_->set_multi_conn(false);
  auto s = NbdServer::Create(backend_.get(), {});
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(TransmissionFlags((*s)->export_info(), true) & kTxCanMultiConn);
}

TEST_F(NbdServerTest, StopClosesIdleConnectionsAndRefusesNewOnes) {
  NbdTestClient c = Connect();
  ASSERT_TRUE(c.Write(0, Pattern(512, 32)).ok());
  server_->Stop();
  EXPECT_TRUE(c.WaitForClose(std::chrono::seconds(5)));
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  EXPECT_FALSE(server_->Serve(fds[0]).ok());
  ::close(fds[1]);
  server_->Stop();  // idempotent
}

TEST_F(NbdServerTest, ConnectionsBeyondTheLimitAreRefused) {
  NbdServerOptions o;
  o.max_connections = 1;
  MakeServer(o);
  NbdTestClient first = Connect();
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  EXPECT_EQ(server_->Serve(fds[0]).code(), StatusCode::kResourceExhausted);
  Socket refused(fds[1]);
  uint8_t b;
  EXPECT_EQ(::recv(refused.fd(), &b, 1, 0), 0);  // closed without a greeting
  ASSERT_TRUE(first.Write(0, Pattern(512, 33)).ok());
  // Once the first leaves, there is room again.
  ASSERT_TRUE(first.Disconnect().ok());
  ASSERT_TRUE(
      WaitUntil([&] { return server_->active_connections() == 0; }, std::chrono::seconds(2)));
  NbdTestClient second = Connect();
  EXPECT_EQ(*second.Read(0, 512), Pattern(512, 33));
}

TEST_F(NbdServerTest, SilentClientIsDroppedAfterTheHandshakeTimeout) {
  NbdServerOptions o;
  o.handshake_timeout = std::chrono::milliseconds(200);
  MakeServer(o);
  Socket s = RawConnection();
  uint8_t greeting[18];
  ASSERT_TRUE(RecvExact(s.fd(), greeting, DeadlineIn(std::chrono::seconds(5))).ok());
  const auto start = std::chrono::steady_clock::now();
  uint8_t b;
  EXPECT_EQ(::recv(s.fd(), &b, 1, 0), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST_F(NbdServerTest, EarlyRepliesNeverHoldUpTheBatchOfAClientThatDoesNotRead) {
  backend_->set_report_early(true);
  NbdTestClient c = Connect();
  // 32 reads of 1 MiB fill one batch (the 32 MiB data buffer); the backend reports them one by
  // one. The client reads nothing, so the socket takes a few hundred KiB: the listener must queue
  // the rest and let the batch end, not wait for the client inside it.
  std::vector<uint8_t> stream;
  for (int i = 0; i < 32; ++i) {
    auto req = testing::RequestBytes(kCmdRead, 0, i, uint64_t(i) << 20, 1u << 20);
    stream.insert(stream.end(), req.begin(), req.end());
  }
  ASSERT_TRUE(c.SendRaw(stream).ok());
  WaitUntil([&] { return backend_->batches_finished() > 0; }, std::chrono::seconds(10));
  EXPECT_EQ(backend_->batches_finished(), 1u) << "the batch waited for the client to read";
}

TEST_F(NbdServerTest, ClientThatDoesNotReadIsDroppedAfterTheReplyTimeout) {
  NbdServerOptions o;
  o.reply_timeout = std::chrono::milliseconds(300);
  MakeServer(o);
  NbdTestClient c = Connect();
  std::vector<uint8_t> stream;
  for (int i = 0; i < 16; ++i) {
    auto req = testing::RequestBytes(kCmdRead, 0, i, uint64_t(i) << 20, 1u << 20);
    stream.insert(stream.end(), req.begin(), req.end());
  }
  ASSERT_TRUE(c.SendRaw(stream).ok());
  // Once dropped, the socket holds what was sent before the drop, then EOF.
  WaitUntil([&] { return server_->active_connections() == 0; }, std::chrono::seconds(10));
  EXPECT_EQ(server_->active_connections(), 0u) << "still connected after the reply timeout";
  EXPECT_TRUE(c.WaitForClose(std::chrono::seconds(5)));
}

TEST_F(NbdServerTest, ListensOnUnixTcpAndInheritedSockets) {
  testing::TempDir dir;
  const std::string path = dir.File("s.sock");
  // An inherited listener, as systemd would pass it.
  auto inherited = ListenTcp(Endpoint{"127.0.0.1", 0});
  ASSERT_TRUE(inherited.has_value());
  const uint16_t inherited_port = *LocalPort(*inherited);
  NbdServerOptions o;
  o.unix_paths = {path};
  o.tcp = {Endpoint{"127.0.0.1", 0}};
  o.inherited_fds = {inherited->release()};
  MakeServer(o);
  ASSERT_TRUE(server_->Start().ok());
  ASSERT_EQ(server_->listening_on().size(), 3u);
  const uint16_t port = server_->tcp_port(0);
  ASSERT_NE(port, 0);

  auto via_unix = NbdTestClient::Connect(path);
  ASSERT_TRUE(via_unix.has_value()) << via_unix.error().ToString();
  ASSERT_TRUE(via_unix->Write(0, Pattern(4096, 40)).ok());
  for (uint16_t p : {port, inherited_port}) {
    auto sock = ConnectTcp(Endpoint{"127.0.0.1", p}, DeadlineIn(std::chrono::seconds(5)));
    ASSERT_TRUE(sock.has_value());
    auto c = NbdTestClient::Handshake(std::move(*sock));
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    EXPECT_EQ(*c->Read(0, 4096), Pattern(4096, 40));
  }
  server_->Stop();
  struct stat st;
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "socket file left behind";
}

// The spin for the next request (request_busy_poll): off and at its largest budget, requests one
// at a time (the spin's recv catches them), a request whose header comes in two sends, and a
// client that goes away while the thread spins or sleeps are served as with the blocking recv.
// The budget's range is checked.
TEST_F(NbdServerTest, SpinningForTheNextRequestServesTheSameStream) {
  for (const auto budget : {std::chrono::microseconds(0), AdaptiveSpin::kMaxBudget}) {
    SCOPED_TRACE(budget.count());
    NbdServerOptions o;
    o.request_busy_poll = budget;
    MakeServer(o);
    NbdTestClient c = Connect();
    for (int i = 0; i < 100; ++i) {
      ASSERT_TRUE(c.Write(uint64_t(i % 16) * 4096, Pattern(4096, i)).ok());
      ASSERT_EQ(*c.Read(uint64_t(i % 16) * 4096, 4096), Pattern(4096, i));
    }
    c.Expect(kCmdRead, 77, 0, 512);
    const auto hdr = testing::RequestBytes(kCmdRead, 0, 77, 0, 512);
    ASSERT_TRUE(c.SendRaw(std::span(hdr).first(10)).ok());
    ASSERT_TRUE(c.SendRaw(std::span(hdr).subspan(10)).ok());
    auto r = c.Receive();
    ASSERT_TRUE(r.has_value()) << r.error().ToString();
    EXPECT_EQ(r->handle, 77u);
    const std::vector<uint8_t> last = Pattern(4096, 96);  // offset 0's last write (i = 96)
    EXPECT_EQ(r->data, std::vector<uint8_t>(last.begin(), last.begin() + 512));
    // Half a header, then the client is gone: the connection ends (its thread was spinning or
    // asleep on the socket).
    ASSERT_TRUE(c.SendRaw(std::span(hdr).first(10)).ok());
    ::shutdown(c.fd(), SHUT_RDWR);
    ASSERT_TRUE(
        WaitUntil([&] { return server_->active_connections() == 0; }, std::chrono::seconds(5)));
  }
  for (const auto bad :
       {std::chrono::microseconds(-1), AdaptiveSpin::kMaxBudget + std::chrono::microseconds(1)}) {
    NbdServerOptions o;
    o.request_busy_poll = bad;
    auto s = NbdServer::Create(backend_.get(), o);
    ASSERT_FALSE(s.has_value()) << bad.count();
    EXPECT_EQ(s.error().code(), StatusCode::kInvalidArgument);
  }
}

TEST_F(NbdServerTest, RefusesToStartWithoutListenersOrWithAFileInTheWay) {
  EXPECT_EQ(server_->Start().code(), StatusCode::kInvalidArgument);
  testing::TempDir dir;
  const std::string path = dir.File("regular-file");
  ::close(::creat(path.c_str(), 0644));
  NbdServerOptions o;
  o.unix_paths = {path};
  MakeServer(o);
  EXPECT_FALSE(server_->Start().ok());
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << "a regular file must not be removed";
}

}  // namespace
}  // namespace farmem::blockdev
