// TcpConnection's pipelined Send/Receive against a scripted in-process daemon: the reply orders
// and reply shapes a real farmemd does not produce on demand (replies out of order, a push in
// between, an unknown request id), checked request by request.
#include "farmem/transport/tcp_connection.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <functional>
#include <thread>

namespace farmem::transport {
namespace {

using std::chrono::milliseconds;

struct Frame {
  wire::FrameHeader header;
  std::vector<uint8_t> body;
};

Frame ReadFrame(int fd) {
  Frame f;
  uint8_t hdr[wire::kHeaderSize];
  EXPECT_TRUE(RecvExact(fd, hdr, DeadlineIn(milliseconds(5000))).ok());
  auto h = wire::DecodeHeader(hdr);
  EXPECT_TRUE(h.has_value());
  if (!h.has_value()) return f;
  f.header = *h;
  f.body.resize(h->body_len);
  EXPECT_TRUE(RecvExact(fd, f.body, DeadlineIn(milliseconds(5000))).ok());
  return f;
}

void WriteFrame(int fd, uint8_t opcode, uint16_t flags, uint64_t id, uint16_t status,
                std::span<const uint8_t> body) {
  wire::FrameHeader h;
  h.opcode = opcode;
  h.flags = flags;
  h.request_id = id;
  h.status = status;
  h.body_len = static_cast<uint32_t>(body.size());
  std::vector<uint8_t> frame(wire::kHeaderSize);
  wire::EncodeHeader(h, frame.data());
  frame.insert(frame.end(), body.begin(), body.end());
  EXPECT_TRUE(SendAll(fd, frame, DeadlineIn(milliseconds(5000))).ok());
}

void Answer(int fd, const Frame& req, std::span<const uint8_t> body, uint16_t status = 0) {
  WriteFrame(fd, req.header.opcode, wire::kFlagReply, req.header.request_id, status, body);
}

// Accepts one connection, answers HELLO (no authentication), then runs the script.
class ScriptedDaemon {
 public:
  explicit ScriptedDaemon(std::function<void(int fd)> script) {
    auto s = ListenTcp(Endpoint{"127.0.0.1", 0});
    EXPECT_TRUE(s.has_value());
    listener_ = std::move(*s);
    port_ = *LocalPort(listener_);
    thread_ = std::thread([this, script = std::move(script)] {
      Socket conn(::accept(listener_.fd(), nullptr, nullptr));
      if (!conn.valid()) return;
      Frame hello = ReadFrame(conn.fd());
      std::vector<uint8_t> reply;
      wire::EncodeHelloReply({.version = wire::kVersion,
                              .features = 0,
                              .node_id = 1,
                              .server_nonce = {},
                              .daemon_version = {}},
                             &reply);
      Answer(conn.fd(), hello, reply);
      script(conn.fd());
      // Hold the connection until the client is done with it.
      uint8_t byte;
      while (::recv(conn.fd(), &byte, 1, 0) > 0) {
      }
    });
  }
  ~ScriptedDaemon() { thread_.join(); }

  Result<TcpConnection> Connect() const {
    ChannelOptions o;
    o.endpoint = {"127.0.0.1", port_};
    return TcpConnection::Connect(o);
  }

 private:
  Socket listener_;
  uint16_t port_ = 0;
  std::thread thread_;
};

std::vector<uint8_t> Bytes(size_t n, uint8_t value) { return std::vector<uint8_t>(n, value); }

// Sends n READ requests (the scripted daemon does not look at their bodies); their ids.
std::vector<uint64_t> SendReads(TcpConnection& conn, size_t n, Deadline deadline) {
  const uint8_t op[wire::kDataOpSize] = {};
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < n; ++i) {
    auto sent = conn.Send(wire::Opcode::kRead, op, deadline);
    EXPECT_TRUE(sent.has_value()) << sent.error().ToString();
    ids.push_back(sent.value_or(0));
  }
  return ids;
}

TEST(TcpConnectionPipelined, RepliesOutOfOrderReachTheirOwnReceive) {
  ScriptedDaemon daemon([](int fd) {
    Frame a = ReadFrame(fd), b = ReadFrame(fd), c = ReadFrame(fd);
    Answer(fd, c, Bytes(300, 0xcc));
    std::vector<uint8_t> notice;
    wire::EncodeEvictNotice({{7}, 100}, &notice);
    WriteFrame(fd, static_cast<uint8_t>(wire::Opcode::kEvictNotice), wire::kFlagPush, 0, 0, notice);
    Answer(fd, a, Bytes(100, 0xaa));
    Answer(fd, b, Bytes(200, 0xbb));
  });
  auto conn = daemon.Connect();
  ASSERT_TRUE(conn.has_value()) << conn.error().ToString();
  const Deadline deadline = DeadlineIn(milliseconds(5000));
  const std::vector<uint64_t> ids = SendReads(*conn, 3, deadline);
  // a's reply comes second: c's, which comes first, is kept for its own Receive.
  std::vector<uint8_t> a(100), b(200), c(300);
  auto r = conn->Receive(ids[0], a, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_TRUE(r->in_place);
  EXPECT_EQ(a, Bytes(100, 0xaa));
  EXPECT_EQ(conn->ArrivedReply(), ids[2]);
  r = conn->Receive(ids[2], c, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_TRUE(r->in_place);
  EXPECT_EQ(c, Bytes(300, 0xcc));
  r = conn->Receive(ids[1], b, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(b, Bytes(200, 0xbb));
  EXPECT_FALSE(conn->broken());
  auto pushes = conn->TakePushes();
  ASSERT_EQ(pushes.size(), 1u);
  auto notice = wire::DecodeEvictNotice(pushes[0]);
  ASSERT_TRUE(notice.has_value());
  EXPECT_EQ(notice->lease_ids, std::vector<uint64_t>{7});
  conn->Shutdown();
}

TEST(TcpConnectionPipelined, ErrorReplyIsThatRequestsResultAndTheConnectionGoesOn) {
  ScriptedDaemon daemon([](int fd) {
    Frame a = ReadFrame(fd), b = ReadFrame(fd);
    std::vector<uint8_t> msg;
    wire::EncodeError(NotFound("lease 7 is not held"), &msg);
    Answer(fd, a, msg, static_cast<uint16_t>(StatusCode::kNotFound));
    Answer(fd, b, Bytes(64, 0x42));
  });
  auto conn = daemon.Connect();
  ASSERT_TRUE(conn.has_value()) << conn.error().ToString();
  const Deadline deadline = DeadlineIn(milliseconds(5000));
  const std::vector<uint64_t> ids = SendReads(*conn, 2, deadline);
  std::vector<uint8_t> dst(64);
  auto r = conn->Receive(ids[0], dst, deadline);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kNotFound) << r.error().ToString();
  EXPECT_EQ(r.error().message(), "lease 7 is not held");
  EXPECT_FALSE(conn->broken());
  r = conn->Receive(ids[1], dst, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(dst, Bytes(64, 0x42));
  conn->Shutdown();
}

TEST(TcpConnectionPipelined, ReplyOfAnotherSizeIsReadPieceByPiece) {
  ScriptedDaemon daemon([](int fd) {
    Frame a = ReadFrame(fd), b = ReadFrame(fd), c = ReadFrame(fd);
    std::vector<uint8_t> body = Bytes(10, 1);
    body.resize(30, 2);
    Answer(fd, a, body);          // shorter than expected: the caller reads it itself
    Answer(fd, b, Bytes(50, 3));  // its caller leaves part of it: the next Receive drops it
    Answer(fd, c, Bytes(5, 4));
  });
  auto conn = daemon.Connect();
  ASSERT_TRUE(conn.has_value()) << conn.error().ToString();
  const Deadline deadline = DeadlineIn(milliseconds(5000));
  const std::vector<uint64_t> ids = SendReads(*conn, 3, deadline);
  std::vector<uint8_t> expected(100, 0xee);
  auto r = conn->Receive(ids[0], expected, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_FALSE(r->in_place);
  EXPECT_EQ(r->body_len, 30u);
  std::vector<uint8_t> first(10), rest(20);
  ASSERT_TRUE(conn->ReadBody(first).ok());
  ASSERT_TRUE(conn->ReadBody(rest).ok());
  EXPECT_EQ(first, Bytes(10, 1));
  EXPECT_EQ(rest, Bytes(20, 2));
  EXPECT_FALSE(conn->ReadBody(first).ok()) << "past the end of the body";
  r = conn->Receive(ids[1], expected, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(r->body_len, 50u);
  ASSERT_TRUE(conn->ReadBody(first).ok());
  EXPECT_EQ(first, Bytes(10, 3));
  // The other 40 bytes are dropped: the stream stays in step for the next reply.
  std::vector<uint8_t> five(5);
  r = conn->Receive(ids[2], five, deadline);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_TRUE(r->in_place);
  EXPECT_EQ(five, Bytes(5, 4));
  EXPECT_FALSE(conn->broken());
  conn->Shutdown();
}

TEST(TcpConnectionPipelined, ReplyToNoOutstandingRequestBreaksTheConnection) {
  ScriptedDaemon daemon([](int fd) {
    Frame a = ReadFrame(fd);
    WriteFrame(fd, a.header.opcode, wire::kFlagReply, a.header.request_id + 99, 0, {});
  });
  auto conn = daemon.Connect();
  ASSERT_TRUE(conn.has_value()) << conn.error().ToString();
  const Deadline deadline = DeadlineIn(milliseconds(5000));
  auto a = conn->Send(wire::Opcode::kStat, {}, deadline);
  ASSERT_TRUE(a.has_value());
  auto r = conn->Receive(*a, {}, deadline);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kProtocolError) << r.error().ToString();
  EXPECT_TRUE(conn->broken());
  auto again = conn->Send(wire::Opcode::kStat, {}, deadline);
  ASSERT_FALSE(again.has_value());
  EXPECT_EQ(again.error().code(), StatusCode::kUnavailable);
  conn->Shutdown();
}

}  // namespace
}  // namespace farmem::transport
