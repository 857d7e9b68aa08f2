// Bad input from the network (docs/wire-protocol.md, "What the daemon does with bad input"): every
// case gets exactly the documented answer, and the connection is closed or kept as documented.
// All the while a well-behaved client works on the same daemon: a thread that writes and reads
// back its own leases without pause. After each case it must have made progress; at the end its
// data must be exactly what it wrote and the daemon must still be running.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "daemon_client.h"
#include "support/daemon_fixture.h"
#include "support/raw_client.h"

namespace farmem::testing {
namespace {

using std::chrono::milliseconds;
using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;
using ::testing::HasSubstr;
using wire::Opcode;

constexpr uint64_t kSlabSize = 1 << 20;
// Long enough that the good client's leases (heartbeat every TTL/5) outlive a scheduling delay on a
// loaded 2-core machine: with 500 ms they expired mid-test under load ("lease ... is not held").
constexpr uint32_t kLeaseTtlMs = 2000;
constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();

uint8_t Op(Opcode op) { return static_cast<uint8_t>(op); }

// The well-behaved client: random writes, each followed by a verified read, on two leases.
class GoodClient {
 public:
  Status Start(const Endpoint& ep, const std::string& secret) {
    FARMEM_ASSIGN_OR_RETURN(auto c, DaemonClient::Connect(ep, secret));
    client_ = std::make_unique<DaemonClient>(std::move(c));
    FARMEM_ASSIGN_OR_RETURN(auto grants, client_->Alloc(2));
    for (const auto& g : grants) {
      slabs_.push_back(transport::RemoteSlab::From(g));
      shadow_.emplace_back(g.length, 0);
    }
    FARMEM_ASSIGN_OR_RETURN(channel_, client_->OpenChannel());
    thread_ = std::thread([this] { Run(); });
    return Status::Ok();
  }

  uint64_t ops() const { return ops_.load(); }
  std::string error() const {
    std::lock_guard lock(mu_);
    return error_;
  }
  const std::vector<transport::RemoteSlab>& slabs() const { return slabs_; }
  const wire::ClientId& client_id() const { return client_->client_id(); }

  // Stops the thread and compares every byte of both leases with what it wrote.
  Status StopAndVerify() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (!error().empty()) return DataLoss(error());
    for (size_t i = 0; i < slabs_.size(); ++i) {
      std::vector<uint8_t> all(slabs_[i].length);
      FARMEM_RETURN_IF_ERROR(channel_->Read(slabs_[i], 0, all));
      if (all != shadow_[i]) return DataLoss("lease " + std::to_string(i) + " changed");
    }
    return Status::Ok();
  }

 private:
  void Fail(const std::string& what) {
    std::lock_guard lock(mu_);
    if (error_.empty()) error_ = what;
    stop_ = true;
  }

  void Run() {
    std::mt19937_64 rng(std::random_device{}());
    std::vector<uint8_t> data(8192), back(8192);
    auto last_heartbeat = std::chrono::steady_clock::now();
    while (!stop_) {
      const size_t i = rng() % slabs_.size();
      const uint32_t len = 1 + static_cast<uint32_t>(rng() % data.size());
      const uint64_t off = rng() % (slabs_[i].length - len + 1);
      for (uint32_t k = 0; k < len; ++k) data[k] = static_cast<uint8_t>(rng());
      Status s = channel_->Write(slabs_[i], off, {data.data(), len});
      if (!s.ok()) return Fail("write: " + s.ToString());
      std::memcpy(shadow_[i].data() + off, data.data(), len);
      // Read back a window around what was written: neighbours must be intact too.
      const uint64_t r_off = off > 512 ? off - 512 : 0;
      const uint32_t r_len =
          static_cast<uint32_t>(std::min<uint64_t>(len + 1024, slabs_[i].length - r_off));
      back.resize(r_len);
      s = channel_->Read(slabs_[i], r_off, back);
      if (!s.ok()) return Fail("read: " + s.ToString());
      if (std::memcmp(back.data(), shadow_[i].data() + r_off, r_len) != 0) {
        return Fail("read back different data at offset " + std::to_string(r_off));
      }
      ops_ += 2;
      if (std::chrono::steady_clock::now() - last_heartbeat > milliseconds(kLeaseTtlMs / 5)) {
        auto hb = client_->Heartbeat();
        if (!hb.has_value()) return Fail("heartbeat: " + hb.error().ToString());
        last_heartbeat = std::chrono::steady_clock::now();
      }
    }
  }

  std::unique_ptr<DaemonClient> client_;
  std::unique_ptr<transport::Channel> channel_;
  std::vector<transport::RemoteSlab> slabs_;
  std::vector<std::vector<uint8_t>> shadow_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> ops_{0};
  mutable std::mutex mu_;
  std::string error_;  // GUARDED_BY(mu_)
};

class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A short lease TTL also makes farmemd's housekeeping run every 500 ms, and only then does
    // it close the sockets of connections it has finished with (see regression_test.cc,
    // ClosesTheConnectionRightAfterAFramingError): this keeps the many "then closed" checks fast.
    daemons_ = new DaemonSet({.capacity = "64M",
                              .slab_size = "1M",
                              .lease_ttl_ms = kLeaseTtlMs,
                              .log_level = "warn",
                              .extra_args = {"--no-mlock"}});
    Status s = daemons_->Start(1);
    if (!s.ok()) {
      setup_error_ = s.ToString();
      return;
    }
    good_ = new GoodClient();
    s = good_->Start((*daemons_)[0].endpoint(), daemons_->secret());
    if (!s.ok()) setup_error_ = s.ToString();
  }

  static void TearDownTestSuite() {
    if (good_ != nullptr) {
      const uint64_t ops = good_->ops();
      Status s = good_->StopAndVerify();
      EXPECT_TRUE(s.ok()) << "the good client's data: " << s.ToString();
      EXPECT_GT(ops, 1000u) << "the good client hardly ran";
      std::printf("good client: %llu verified operations alongside the bad input\n",
                  static_cast<unsigned long long>(ops));
    }
    if (daemons_ != nullptr) {
      EXPECT_TRUE(ProcessAlive((*daemons_)[0].pid())) << daemons_->Logs();
      EXPECT_TRUE((*daemons_)[0].Stop().ok()) << "farmemd did not stop cleanly\n"
                                              << daemons_->Logs();
    }
    delete good_;
    delete daemons_;
    good_ = nullptr;
    daemons_ = nullptr;
  }

  void SetUp() override {
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
    ops_before_ = good_->ops();
  }

  // After every case: the daemon runs, and the good client kept working through it.
  void TearDown() override {
    if (good_ == nullptr) return;
    WaitUntil([&] { return good_->ops() >= ops_before_ + 20 || !good_->error().empty(); },
              milliseconds(5000), milliseconds(1));
    EXPECT_EQ(good_->error(), "");
    EXPECT_GE(good_->ops(), ops_before_ + 20) << "the good client stalled";
    EXPECT_TRUE(ProcessAlive((*daemons_)[0].pid())) << "farmemd died\n" << daemons_->Logs();
  }

  static const Endpoint& endpoint() {
    static Endpoint ep = (*daemons_)[0].endpoint();
    return ep;
  }
  static const std::string& secret() { return daemons_->secret(); }

  // A connection that has done nothing yet.
  static RawClient Fresh() {
    auto c = RawClient::Connect(endpoint());
    if (!c.has_value()) {  // nothing sensible to return: stop here, loudly
      std::fprintf(stderr, "cannot connect to farmemd: %s\n%s", c.error().ToString().c_str(),
                   daemons_->Logs().c_str());
      std::abort();
    }
    return std::move(*c);
  }
  // A connection past HELLO and AUTH, as a new client unless an id is given.
  static RawClient Authed(const wire::ClientId& id = RandomClientId()) {
    RawClient c = Fresh();
    Status s = c.Hello(id, secret());
    EXPECT_TRUE(s.ok()) << s.ToString();
    return c;
  }

  static inline DaemonSet* daemons_ = nullptr;
  static inline GoodClient* good_ = nullptr;
  static inline std::string setup_error_;
  uint64_t ops_before_ = 0;
};

// The next frame is an error reply with `code` (to request `id`, when given).
AssertionResult RepliesError(RawClient& c, StatusCode code, std::optional<uint64_t> id = {}) {
  auto f = c.Receive();
  if (!f.has_value()) return AssertionFailure() << "no reply: " << f.error().ToString();
  if (!f->header.is_reply()) return AssertionFailure() << "not a reply frame";
  if (id.has_value() && f->header.request_id != *id) {
    return AssertionFailure() << "reply to request " << f->header.request_id << ", not " << *id;
  }
  if (f->code() != code) {
    return AssertionFailure() << "got " << f->status().ToString() << ", expected "
                              << StatusCodeName(code);
  }
  if (f->body.empty()) return AssertionFailure() << "error reply without a message";
  return AssertionSuccess() << f->status().ToString();
}

// The connection still answers: a STAT on it works.
AssertionResult StillServes(RawClient& c) {
  auto st = c.Stat();
  if (!st.has_value()) return AssertionFailure() << "STAT failed: " << st.error().ToString();
  return AssertionSuccess();
}

AssertionResult Closes(RawClient& c) {
  if (c.WaitClosed()) return AssertionSuccess();
  return AssertionFailure() << "the daemon kept the connection open";
}

// Sends a raw frame (header fields as given, body_len = body size unless set) on a connection.
Status SendOp(RawClient& c, uint8_t opcode, std::span<const uint8_t> body, uint64_t id = 7,
              std::optional<uint32_t> body_len = {}) {
  return c.SendRaw({.opcode = opcode,
                    .request_id = id,
                    .body_len = body_len.value_or(static_cast<uint32_t>(body.size()))},
                   body);
}

std::vector<uint8_t> WithPayload(std::vector<uint8_t> fixed, size_t n, uint8_t byte) {
  fixed.resize(fixed.size() + n, byte);
  return fixed;
}

// ------------------------------------------------------------ frames cut short

TEST_F(BadInputTest, TruncatedHeaderThenDisconnect) {
  for (size_t cut : {1, 10, 23}) {
    RawClient c = Authed();
    const auto hdr = EncodeRawHeader({.opcode = Op(Opcode::kStat), .request_id = 1});
    ASSERT_TRUE(c.Send(std::span(hdr).first(cut)).ok());
    EXPECT_TRUE(c.Silent(milliseconds(100))) << "answered half a header";
    c.Close();
  }
  // Before HELLO too.
  RawClient c = Fresh();
  const auto hdr = EncodeRawHeader({.opcode = Op(Opcode::kHello), .request_id = 1});
  ASSERT_TRUE(c.Send(std::span(hdr).first(12)).ok());
  c.Close();
  RawClient after = Authed();
  EXPECT_TRUE(StillServes(after));
}

TEST_F(BadInputTest, TruncatedBodyThenDisconnect) {
  {  // a control body
    RawClient c = Authed();
    std::vector<uint8_t> alloc;
    wire::EncodeAlloc({1}, &alloc);
    ASSERT_TRUE(SendOp(c, Op(Opcode::kAlloc), std::span(alloc).first(4), 1, 8).ok());
    EXPECT_TRUE(c.Silent(milliseconds(100)));
  }
  {  // a READ's data op
    RawClient c = Authed();
    auto body = DataOpBody(good_->slabs()[0].lease_id, 0, 16);
    ASSERT_TRUE(SendOp(c, Op(Opcode::kRead), std::span(body).first(20), 1, 24).ok());
    EXPECT_TRUE(c.Silent(milliseconds(100)));
  }
  {  // a WRITE's payload, on the writer's own lease
    RawClient c = Authed();
    auto lease = c.Alloc(1);
    ASSERT_TRUE(lease.has_value()) << lease.error().ToString();
    auto body = WithPayload(DataOpBody((*lease)[0].lease_id, 0, 65536), 1000, 0xab);
    ASSERT_TRUE(SendOp(c, Op(Opcode::kWrite), body, 1, 24 + 65536).ok());
    EXPECT_TRUE(c.Silent(milliseconds(100)));
  }
  {  // a BATCH: descriptor table cut, then payload cut
    RawClient c = Authed();
    auto lease = c.Alloc(1);
    ASSERT_TRUE(lease.has_value());
    const RawBatchOp ops[] = {{Op(Opcode::kWrite), 4096, (*lease)[0].lease_id, 0},
                              {Op(Opcode::kRead), 4096, (*lease)[0].lease_id, 8192}};
    auto table = BatchTable(ops, 2);
    ASSERT_TRUE(SendOp(c, Op(Opcode::kBatch), std::span(table).first(30), 1,
                       static_cast<uint32_t>(table.size() + 4096))
                    .ok());
    EXPECT_TRUE(c.Silent(milliseconds(100)));
    RawClient d = Authed();
    auto body = WithPayload(table, 100, 0xcd);
    ASSERT_TRUE(
        SendOp(d, Op(Opcode::kBatch), body, 1, static_cast<uint32_t>(table.size() + 4096)).ok());
    EXPECT_TRUE(d.Silent(milliseconds(100)));
  }
}

TEST_F(BadInputTest, WritePayloadThatNeverArrivesOnlyStallsItsConnection) {
  // The daemon gives a frame 10 s to arrive; meanwhile everyone else is served (TearDown checks
  // the good client) and so is another connection of the same client.
  const wire::ClientId id = RandomClientId();
  RawClient stalled = Authed(id);
  auto lease = stalled.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  auto body = WithPayload(DataOpBody((*lease)[0].lease_id, 4096, 8192), 100, 0x77);
  ASSERT_TRUE(SendOp(stalled, Op(Opcode::kWrite), body, 1, 24 + 8192).ok());
  RawClient same_client = Authed(id);
  EXPECT_TRUE(StillServes(same_client));
  auto other = same_client.Read((*lease)[0].lease_id, 0, 4096);
  ASSERT_TRUE(other.has_value()) << other.error().ToString();
  EXPECT_TRUE(stalled.Silent(milliseconds(200))) << "a WRITE was answered before its payload";
  stalled.Close();  // and the daemon copes with the writer vanishing mid-payload
  EXPECT_TRUE(StillServes(same_client));
}

// ------------------------------------------------------------ framing errors: answer, then close

TEST_F(BadInputTest, GarbageBytesGetProtocolErrorAndClose) {
  std::mt19937 rng(42);
  for (bool authed : {false, true}) {
    RawClient c = authed ? Authed() : Fresh();
    std::vector<uint8_t> junk(64);
    for (uint8_t& b : junk) b = static_cast<uint8_t>(rng());
    junk[0] = 'X';  // surely not the magic
    ASSERT_TRUE(c.Send(junk).ok());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError, /*request id unknown:*/ 0));
    EXPECT_TRUE(Closes(c));
  }
  RawClient c = Authed();
  const std::string http = "GET / HTTP/1.1\r\nHost: farmem\r\n\r\n";
  ASSERT_TRUE(c.Send({reinterpret_cast<const uint8_t*>(http.data()), http.size()}).ok());
  EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError));
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, WrongMagicGetsProtocolErrorAndClose) {
  for (uint32_t magic : {0u, 0x12345678u, 0x464D454Du /* byte-swapped */}) {
    RawClient c = Authed();
    ASSERT_TRUE(c.SendRaw({.magic = magic, .opcode = Op(Opcode::kStat), .request_id = 5}).ok());
    // A valid frame right behind it is never looked at: the stream is out of sync.
    ASSERT_TRUE(c.SendFrame(Opcode::kStat).has_value());
    auto f = c.Receive();
    ASSERT_TRUE(f.has_value()) << f.error().ToString();
    EXPECT_EQ(f->code(), StatusCode::kProtocolError) << f->status().ToString();
    EXPECT_THAT(f->status().message(), HasSubstr("magic"));
    EXPECT_EQ(f->header.request_id, 0u);
    EXPECT_TRUE(Closes(c));
  }
}

TEST_F(BadInputTest, WrongVersionGetsProtocolErrorAndClose) {
  for (uint8_t version : {0, 2, 255}) {
    for (bool authed : {false, true}) {
      RawClient c = authed ? Authed() : Fresh();
      ASSERT_TRUE(c.SendRaw({.version = version, .opcode = Op(Opcode::kStat)}).ok());
      auto f = c.Receive();
      ASSERT_TRUE(f.has_value()) << f.error().ToString();
      EXPECT_EQ(f->code(), StatusCode::kProtocolError);
      EXPECT_THAT(f->status().message(), HasSubstr("version"));
      EXPECT_EQ(f->header.version, wire::kVersion);  // the answer is in the daemon's version
      EXPECT_TRUE(Closes(c));
    }
  }
}

TEST_F(BadInputTest, ReservedBitsAndUnknownFlagsGetProtocolErrorAndClose) {
  const RawHeader bad[] = {
      {.opcode = Op(Opcode::kStat), .request_id = 3, .reserved = 1},
      {.opcode = Op(Opcode::kStat), .request_id = 3, .reserved = 0x8000},
      {.opcode = Op(Opcode::kStat), .flags = 1u << 2, .request_id = 3},
      {.opcode = Op(Opcode::kStat), .flags = 0x8000, .request_id = 3},
  };
  for (const RawHeader& h : bad) {
    RawClient c = Authed();
    ASSERT_TRUE(c.SendRaw(h).ok());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError));
    EXPECT_TRUE(Closes(c));
  }
}

TEST_F(BadInputTest, RequestsFlaggedAsReplyOrPushGetProtocolErrorAndClose) {
  for (uint16_t flags : {uint16_t{wire::kFlagReply}, uint16_t{wire::kFlagPush}}) {
    RawClient c = Authed();
    ASSERT_TRUE(c.SendRaw({.opcode = Op(Opcode::kStat), .flags = flags, .request_id = 9}).ok());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError, 9));
    EXPECT_TRUE(Closes(c));
  }
}

TEST_F(BadInputTest, FourGigabyteBodyLengthIsRefusedBeforeAnythingIsAllocated) {
  for (uint8_t opcode : {Op(Opcode::kWrite), Op(Opcode::kBatch), Op(Opcode::kStat), uint8_t{77}}) {
    for (bool authed : {false, true}) {
      RawClient c = authed ? Authed() : Fresh();
      ASSERT_TRUE(c.SendRaw({.opcode = opcode, .request_id = 1, .body_len = 0xffffffff}).ok());
      auto f = c.Receive();
      ASSERT_TRUE(f.has_value()) << f.error().ToString();
      EXPECT_EQ(f->code(), StatusCode::kResourceExhausted) << f->status().ToString();
      EXPECT_THAT(f->status().message(), HasSubstr("4294967295"));
      EXPECT_TRUE(Closes(c));
    }
  }
  // Just over the frame limit.
  RawClient c = Authed();
  ASSERT_TRUE(
      c.SendRaw({.opcode = Op(Opcode::kWrite), .request_id = 1, .body_len = wire::kMaxBodyLen + 1})
          .ok());
  EXPECT_TRUE(RepliesError(c, StatusCode::kResourceExhausted));
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, ControlBodyOverItsLimitGetsProtocolErrorAndClose) {
  for (Opcode op : {Opcode::kAlloc, Opcode::kFree, Opcode::kStat, Opcode::kRead}) {
    RawClient c = Authed();
    ASSERT_TRUE(
        c.SendRaw({.opcode = Op(op), .request_id = 4, .body_len = wire::kMaxControlBodyLen + 1})
            .ok());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError, 4));
    EXPECT_TRUE(Closes(c));
  }
}

// ------------------------------------------------------------ before authentication

TEST_F(BadInputTest, OpsBeforeHelloGetUnauthenticatedAndClose) {
  for (Opcode op : {Opcode::kStat, Opcode::kAlloc, Opcode::kFree, Opcode::kHeartbeat, Opcode::kRead,
                    Opcode::kWrite, Opcode::kBatch, Opcode::kRdmaToken}) {
    RawClient c = Fresh();
    std::vector<uint8_t> body;
    if (op == Opcode::kRead) body = DataOpBody(good_->slabs()[0].lease_id, 0, 8);
    if (op == Opcode::kWrite)
      body = WithPayload(DataOpBody(good_->slabs()[0].lease_id, 0, 8), 8, 1);
    auto id = c.SendFrame(op, body);
    ASSERT_TRUE(id.has_value());
    EXPECT_TRUE(RepliesError(c, StatusCode::kUnauthenticated, *id)) << wire::OpcodeName(Op(op));
    EXPECT_TRUE(Closes(c));
  }
  // An unknown opcode before HELLO is not "skipped": nothing but HELLO comes first.
  RawClient c = Fresh();
  ASSERT_TRUE(SendOp(c, 200, std::vector<uint8_t>(10, 0)).ok());
  EXPECT_TRUE(RepliesError(c, StatusCode::kUnauthenticated));
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, OpsAfterHelloButBeforeAuthGetUnauthenticatedAndClose) {
  for (Opcode op : {Opcode::kStat, Opcode::kAlloc, Opcode::kRead}) {
    RawClient c = Fresh();
    ASSERT_TRUE(c.Hello(RandomClientId(), /*secret=*/"").ok());  // HELLO only
    EXPECT_TRUE(c.hello().features & wire::kFeatureAuthRequired);
    std::vector<uint8_t> body;
    if (op == Opcode::kAlloc) wire::EncodeAlloc({1}, &body);
    if (op == Opcode::kRead) body = DataOpBody(good_->slabs()[0].lease_id, 0, 8);
    auto id = c.SendFrame(op, body);
    ASSERT_TRUE(id.has_value());
    auto f = c.Receive();
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->code(), StatusCode::kUnauthenticated);
    EXPECT_THAT(f->status().message(), HasSubstr("AUTH"));
    EXPECT_TRUE(Closes(c));
  }
}

TEST_F(BadInputTest, AuthBeforeHelloGetsProtocolErrorAndClose) {
  RawClient c = Fresh();
  std::vector<uint8_t> body;
  wire::EncodeAuth({}, &body);
  auto id = c.SendFrame(Opcode::kAuth, body);
  ASSERT_TRUE(id.has_value());
  auto f = c.Receive();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kProtocolError);
  EXPECT_THAT(f->status().message(), HasSubstr("AUTH before HELLO"));
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, HelloTwiceGetsProtocolErrorAndClose) {
  for (bool authed : {false, true}) {
    RawClient c = Fresh();
    ASSERT_TRUE(c.Hello(RandomClientId(), authed ? secret() : "").ok());
    wire::HelloRequest again;
    again.client_id = RandomClientId();  // e.g. trying to take over another client's identity
    std::vector<uint8_t> body;
    wire::EncodeHello(again, &body);
    auto id = c.SendFrame(Opcode::kHello, body);
    ASSERT_TRUE(id.has_value());
    auto f = c.Receive();
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->code(), StatusCode::kProtocolError);
    EXPECT_THAT(f->status().message(), HasSubstr("twice"));
    EXPECT_TRUE(Closes(c));
  }
}

TEST_F(BadInputTest, AuthTwiceGetsProtocolErrorAndClose) {
  RawClient c = Authed();
  ASSERT_FALSE(
      c.Auth(auth::ClientProof(secret(), c.hello().server_nonce, c.client_nonce(), c.client_id()))
          .ok());
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, WrongSecretGetsPermissionDeniedAndClose) {
  RawClient c = Fresh();
  Status s = c.Hello(RandomClientId(), "not-the-secret");
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("wrong secret"));
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, MalformedHelloOrAuthGetsAnErrorAndClose) {
  {  // name_len says more than there is
    RawClient c = Fresh();
    wire::HelloRequest h;
    h.client_id = RandomClientId();
    h.client_name = "abc";
    std::vector<uint8_t> body;
    wire::EncodeHello(h, &body);
    body[2] = 60;
    ASSERT_TRUE(c.SendFrame(Opcode::kHello, body).has_value());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError));
    EXPECT_TRUE(Closes(c));
  }
  {  // a version range without version 1
    RawClient c = Fresh();
    wire::HelloRequest h;
    h.min_version = 2;
    h.max_version = 5;
    std::vector<uint8_t> body;
    wire::EncodeHello(h, &body);
    ASSERT_TRUE(c.SendFrame(Opcode::kHello, body).has_value());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError));
    EXPECT_TRUE(Closes(c));
  }
  {  // AUTH of 31 bytes
    RawClient c = Fresh();
    ASSERT_TRUE(c.Hello(RandomClientId(), "").ok());
    ASSERT_TRUE(c.SendFrame(Opcode::kAuth, std::vector<uint8_t>(31, 1)).has_value());
    EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError));
    EXPECT_TRUE(Closes(c));
  }
}

// ------------------------------------------------------------ errors that keep the connection

TEST_F(BadInputTest, UnknownOpcodeIsSkippedAndTheConnectionContinues) {
  RawClient c = Authed();
  for (uint8_t opcode : {uint8_t{0}, uint8_t{15}, uint8_t{200}, uint8_t{255},
                         Op(Opcode::kEvictNotice) /* daemon-to-client only */}) {
    for (size_t body_size : {size_t{0}, size_t{100}, size_t{300000}}) {
      ASSERT_TRUE(SendOp(c, opcode, std::vector<uint8_t>(body_size, 0x46), 1234).ok());
      auto f = c.Receive();
      ASSERT_TRUE(f.has_value()) << f.error().ToString();
      EXPECT_EQ(f->code(), StatusCode::kUnimplemented) << int{opcode};
      EXPECT_EQ(f->header.request_id, 1234u);
      EXPECT_EQ(f->header.opcode, opcode);
      ASSERT_TRUE(StillServes(c)) << int{opcode} << " with a body of " << body_size;
    }
  }
  // Pipelined: an unknown op between two STATs, all in one send; answers come in order.
  std::vector<uint8_t> bytes = EncodeRawHeader({.opcode = Op(Opcode::kStat), .request_id = 1});
  auto mid = EncodeRawHeader({.opcode = 99, .request_id = 2, .body_len = 5});
  bytes.insert(bytes.end(), mid.begin(), mid.end());
  bytes.insert(bytes.end(), 5, 0x46);  // 'F': looks like the start of a magic
  auto last = EncodeRawHeader({.opcode = Op(Opcode::kStat), .request_id = 3});
  bytes.insert(bytes.end(), last.begin(), last.end());
  ASSERT_TRUE(c.Send(bytes).ok());
  for (uint64_t id : {1, 2, 3}) {
    auto f = c.Receive();
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->header.request_id, id);
    EXPECT_EQ(f->code(), id == 2 ? StatusCode::kUnimplemented : StatusCode::kOk);
  }
}

// Compaction offload (PARITY_ENCODE, GATHER_CELL): another client's lease as target, a source
// nobody serves, garbage bodies: each gets an error reply and the connection goes on; a body
// over the control limit breaks the framing like any control body. The good client's data (it
// is both the target and a source here) must come out untouched (checked at the end).
TEST_F(BadInputTest, OffloadRequestsAgainstOthersLeasesOrDeadSourcesAreRefused) {
  RawClient c = Authed();
  const uint64_t theirs = good_->slabs()[0].lease_id;
  auto mine = c.Alloc(1);
  ASSERT_TRUE(mine.has_value()) << mine.error().ToString();
  const uint64_t own = (*mine)[0].lease_id;
  const uint16_t port = endpoint().port;

  wire::ParityEncodeRequest p;
  p.length = 4096;
  p.k = 2;
  p.r = 1;
  p.timeout_ms = 1000;
  p.sources = {{"127.0.0.1", port, theirs, 0}, {"127.0.0.1", port, theirs, 4096}};
  wire::GatherCellRequest g;
  g.length = 4096;
  g.timeout_ms = 1000;
  g.sources = p.sources;
  g.copies = {{0, 0, 0, 4096}};
  auto send = [&](wire::Opcode op, uint64_t target) {
    std::vector<uint8_t> body;
    if (op == Opcode::kParityEncode) {
      p.lease_id = target;
      wire::EncodeParityEncode(p, &body);
    } else {
      g.lease_id = target;
      wire::EncodeGatherCell(g, &body);
    }
    return SendOp(c, Op(op), body);
  };
  for (Opcode op : {Opcode::kParityEncode, Opcode::kGatherCell}) {
    // Another client's lease as the target.
    ASSERT_TRUE(send(op, theirs).ok());
    EXPECT_TRUE(RepliesError(c, StatusCode::kPermissionDenied)) << wire::OpcodeName(Op(op));
    // Our own target, but the sources are the good client's: this daemon reads them as us, and
    // they are not ours.
    ASSERT_TRUE(send(op, own).ok());
    EXPECT_TRUE(RepliesError(c, StatusCode::kUnavailable)) << wire::OpcodeName(Op(op));
    ASSERT_TRUE(StillServes(c));
  }
  // A source where nothing listens.
  p.sources[1] = {"127.0.0.1", 1, own, 0};
  ASSERT_TRUE(send(Opcode::kParityEncode, own).ok());
  EXPECT_TRUE(RepliesError(c, StatusCode::kUnavailable));
  // Garbage bodies of many sizes: an error reply each, the connection goes on.
  std::mt19937_64 rng(99);
  for (Opcode op : {Opcode::kParityEncode, Opcode::kGatherCell}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{57}, size_t{4000}}) {
      std::vector<uint8_t> junk(n);
      for (auto& b : junk) b = static_cast<uint8_t>(rng());
      ASSERT_TRUE(SendOp(c, Op(op), junk).ok());
      auto f = c.Receive();
      ASSERT_TRUE(f.has_value()) << f.error().ToString();
      EXPECT_NE(f->code(), StatusCode::kOk) << wire::OpcodeName(Op(op)) << " of " << n;
      ASSERT_TRUE(StillServes(c)) << wire::OpcodeName(Op(op)) << " of " << n;
    }
  }
  // Over the control body limit: ProtocolError, closed.
  ASSERT_TRUE(
      SendOp(c, Op(Opcode::kGatherCell), std::vector<uint8_t>(wire::kMaxControlBodyLen + 1)).ok());
  EXPECT_TRUE(RepliesError(c, StatusCode::kProtocolError));
  EXPECT_TRUE(Closes(c));
}

TEST_F(BadInputTest, RdmaTokenWithABodyOrWithoutRdmaIsRefused) {
  RawClient c = Authed();
  auto st = c.Stat();
  ASSERT_TRUE(st.has_value());
  auto f = c.Call(Opcode::kRdmaToken, std::vector<uint8_t>{1, 2, 3});
  ASSERT_TRUE(f.has_value()) << f.error().ToString();
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument) << f->status().ToString();
  ASSERT_TRUE(StillServes(c));
  f = c.Call(Opcode::kRdmaToken);
  ASSERT_TRUE(f.has_value()) << f.error().ToString();
  if (st->features & wire::kFeatureVerbs) {  // this machine has an RDMA device
    ASSERT_EQ(f->code(), StatusCode::kOk) << f->status().ToString();
    auto token = wire::DecodeRdmaTokenReply(f->body);
    ASSERT_TRUE(token.has_value()) << token.error().ToString();
    EXPECT_EQ(token->rdma_port, st->rdma_port);
  } else {
    EXPECT_EQ(f->code(), StatusCode::kUnavailable) << f->status().ToString();
    EXPECT_THAT(f->status().message(), HasSubstr("tcp"));
  }
  EXPECT_TRUE(StillServes(c));
}

TEST_F(BadInputTest, UnknownLeaseGetsNotFoundOrExpired) {
  RawClient c = Authed();
  auto st = c.Stat();
  ASSERT_TRUE(st.has_value());
  // A slab index the daemon does not have: NotFound.
  for (uint64_t id :
       {wire::MakeLeaseId(1, st->total_slabs), wire::MakeLeaseId(77, 0xffffffff), kU64Max}) {
    auto r = c.Read(id, 0, 8);
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code(), StatusCode::kNotFound) << r.error().ToString();
    EXPECT_EQ(c.Write(id, 0, std::vector<uint8_t>(100, 1)).code(), StatusCode::kNotFound);
    ASSERT_TRUE(StillServes(c));  // the WRITE's payload was skipped, not parsed as frames
  }
  // A slab that exists, under an epoch that was never granted: Expired.
  const uint64_t good = good_->slabs()[0].lease_id;
  const uint64_t wrong_epoch =
      wire::MakeLeaseId(wire::LeaseEpoch(good) ^ 0x5a5a, wire::LeaseSlab(good));
  auto r = c.Read(wrong_epoch, 0, 8);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kExpired);
  EXPECT_EQ(c.Write(wrong_epoch, 0, std::vector<uint8_t>(4096, 0xee)).code(), StatusCode::kExpired);
  EXPECT_EQ(c.Free({wrong_epoch}).code(), StatusCode::kExpired);
  EXPECT_TRUE(StillServes(c));
}

TEST_F(BadInputTest, FreedLeaseGetsExpired) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  ASSERT_TRUE(c.Write(id, 0, std::vector<uint8_t>(64, 9)).ok());
  ASSERT_TRUE(c.Free({id}).ok());
  auto r = c.Read(id, 0, 64);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kExpired);
  EXPECT_THAT(r.error().message(), HasSubstr("not held"));
  EXPECT_EQ(c.Write(id, 0, std::vector<uint8_t>(64, 1)).code(), StatusCode::kExpired);
  EXPECT_EQ(c.Free({id}).code(), StatusCode::kExpired);
  // The slab goes to the next ALLOC under a new epoch; the old id stays dead.
  auto again = c.Alloc(1);
  ASSERT_TRUE(again.has_value());
  EXPECT_NE((*again)[0].lease_id, id);
  EXPECT_EQ(CodeOf(c.Read(id, 0, 1)), StatusCode::kExpired);
  EXPECT_TRUE(c.Free({(*again)[0].lease_id}).ok());
}

TEST_F(BadInputTest, RangesOutsideTheLeaseGetOutOfRange) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  const std::vector<uint8_t> tail(64, 0x11);
  ASSERT_TRUE(c.Write(id, kSlabSize - 64, tail).ok());
  struct Range {
    uint64_t offset;
    uint32_t length;
  };
  for (const Range& r : {Range{kSlabSize, 1}, Range{kSlabSize - 1, 2}, Range{0, kSlabSize + 1},
                         Range{kSlabSize + 4096, 4096}, Range{1ull << 40, 1}}) {
    auto rd = c.Read(id, r.offset, r.length);
    ASSERT_FALSE(rd.has_value());
    EXPECT_EQ(rd.error().code(), StatusCode::kOutOfRange) << r.offset << "+" << r.length;
    EXPECT_EQ(c.Write(id, r.offset, std::vector<uint8_t>(r.length, 0xee)).code(),
              StatusCode::kOutOfRange);
  }
  // The last byte is inside.
  auto last = c.Read(id, kSlabSize - 1, 1);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ((*last)[0], 0x11);
  // None of the refused writes landed anywhere in the lease.
  auto whole = c.Read(id, 0, kSlabSize);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(std::count(whole->begin(), whole->end(), 0xee), 0);
  EXPECT_TRUE(c.Free({id}).ok());
}

TEST_F(BadInputTest, OffsetPlusLengthOverflowing64BitsGetsOutOfRange) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  struct Range {
    uint64_t offset;
    uint32_t length;
  };
  // Each wraps around to a small number that would fit a naive `offset + length <= size`.
  for (const Range& r : {Range{kU64Max, 1}, Range{kU64Max - 15, 32}, Range{kU64Max - 4095, 8192},
                         Range{1ull << 63, 1}}) {
    auto rd = c.Read(id, r.offset, r.length);
    ASSERT_FALSE(rd.has_value());
    EXPECT_EQ(rd.error().code(), StatusCode::kOutOfRange);
    EXPECT_EQ(c.Write(id, r.offset, std::vector<uint8_t>(r.length, 0xee)).code(),
              StatusCode::kOutOfRange);
  }
  const RawBatchOp ops[] = {{Op(Opcode::kWrite), 32, id, kU64Max - 15},
                            {Op(Opcode::kRead), 16, id, kU64Max}};
  auto body = WithPayload(BatchTable(ops, 2), 32, 0xee);
  auto f = c.Call(Opcode::kBatch, body);
  ASSERT_TRUE(f.has_value()) << f.error().ToString();
  ASSERT_EQ(f->code(), StatusCode::kOk);
  wire::Reader r(f->body);
  EXPECT_EQ(r.U32(), 2u);
  r.U32();
  EXPECT_EQ(r.U32(), static_cast<uint32_t>(StatusCode::kOutOfRange));
  EXPECT_EQ(r.U32(), static_cast<uint32_t>(StatusCode::kOutOfRange));
  EXPECT_EQ(r.remaining(), 0u);
  auto whole = c.Read(id, 0, kSlabSize);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(std::count(whole->begin(), whole->end(), 0xee), 0) << "a wrapped write landed";
  EXPECT_TRUE(c.Free({id}).ok());
}

TEST_F(BadInputTest, ZeroLengthOpsGetInvalidArgument) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  // READ of 0 bytes.
  auto f = c.Call(Opcode::kRead, DataOpBody(id, 0, 0));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  // WRITE of 0 bytes (a body of just the data op).
  f = c.Call(Opcode::kWrite, DataOpBody(id, 0, 0));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(StillServes(c));
  // BATCH of 0 operations.
  f = c.Call(Opcode::kBatch, BatchTable({}, 0));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(StillServes(c));
  // BATCH with one operation of 0 bytes: the whole batch is refused, its payload skipped.
  const RawBatchOp ops[] = {{Op(Opcode::kWrite), 8, id, 0}, {Op(Opcode::kRead), 0, id, 0}};
  f = c.Call(Opcode::kBatch, WithPayload(BatchTable(ops, 2), 8, 0xee));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(StillServes(c));
  auto head = c.Read(id, 0, 8);
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(*head, std::vector<uint8_t>(8, 0)) << "a refused batch wrote";
  // Lengths over 16 MiB are refused the same way.
  f = c.Call(Opcode::kRead, DataOpBody(id, 0, wire::kMaxDataLen + 1));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.Free({id}).ok());
}

TEST_F(BadInputTest, MalformedDataAndControlBodiesKeepTheConnection) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  struct Case {
    Opcode op;
    std::vector<uint8_t> body;
    StatusCode want;
  };
  std::vector<uint8_t> free_mismatch;
  wire::EncodeFree({{id}}, &free_mismatch);
  free_mismatch[0] = 2;  // says two ids, carries one
  std::vector<uint8_t> free_too_many(8, 0);
  free_too_many[0] = 0x01;  // 1025 ids
  free_too_many[1] = 0x04;
  const Case cases[] = {
      {Opcode::kAlloc, {1, 0, 0, 0}, StatusCode::kProtocolError},
      {Opcode::kAlloc, std::vector<uint8_t>(12, 0), StatusCode::kProtocolError},
      {Opcode::kFree, free_mismatch, StatusCode::kProtocolError},
      {Opcode::kFree, free_too_many, StatusCode::kProtocolError},
      {Opcode::kHeartbeat, {1}, StatusCode::kProtocolError},  // not an access report
      {Opcode::kRead, std::vector<uint8_t>(25, 0), StatusCode::kInvalidArgument},
      {Opcode::kRead, DataOpBody(id, 0, 8, /*reserved=*/1), StatusCode::kProtocolError},
      {Opcode::kWrite, WithPayload(DataOpBody(id, 0, 8, /*reserved=*/1), 8, 0xee),
       StatusCode::kProtocolError},
      // WRITE whose data op says 8 bytes but whose body carries 16: body skipped by body_len.
      {Opcode::kWrite, WithPayload(DataOpBody(id, 0, 8), 16, 0xee), StatusCode::kProtocolError},
      {Opcode::kWrite, WithPayload(DataOpBody(id, 0, 16), 8, 0xee), StatusCode::kProtocolError},
  };
  for (const Case& k : cases) {
    auto f = c.Call(k.op, k.body);
    ASSERT_TRUE(f.has_value()) << f.error().ToString();
    EXPECT_EQ(f->code(), k.want) << wire::OpcodeName(Op(k.op)) << ": " << f->status().ToString();
    ASSERT_TRUE(StillServes(c)) << wire::OpcodeName(Op(k.op));
  }
  auto head = c.Read(id, 0, 64);
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(std::count(head->begin(), head->end(), 0xee), 0) << "a refused WRITE wrote";
  EXPECT_TRUE(c.Free({id}).ok());
}

TEST_F(BadInputTest, AnotherClientsLeaseGetsPermissionDenied) {
  RawClient c = Authed();  // a different client id from the good client's
  const uint64_t theirs = good_->slabs()[0].lease_id;
  auto r = c.Read(theirs, 0, 4096);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(r.error().message(), HasSubstr("another client"));
  EXPECT_EQ(c.Write(theirs, 0, std::vector<uint8_t>(4096, 0xee)).code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(c.Free({theirs}).code(), StatusCode::kPermissionDenied);
  const RawBatchOp ops[] = {{Op(Opcode::kWrite), 4096, theirs, 8192},
                            {Op(Opcode::kRead), 4096, theirs, 0}};
  auto f = c.Call(Opcode::kBatch, WithPayload(BatchTable(ops, 2), 4096, 0xee));
  ASSERT_TRUE(f.has_value());
  ASSERT_EQ(f->code(), StatusCode::kOk);
  ASSERT_EQ(f->body.size(), 16u) << "a refused READ returned data";
  wire::Reader rd(f->body);
  rd.Skip(8);
  EXPECT_EQ(rd.U32(), static_cast<uint32_t>(StatusCode::kPermissionDenied));
  EXPECT_EQ(rd.U32(), static_cast<uint32_t>(StatusCode::kPermissionDenied));
  EXPECT_TRUE(StillServes(c));
  // The good client's data is checked continuously and at the end of the suite.
}

TEST_F(BadInputTest, BatchWithInconsistentLengthsGetsAnErrorAndIsSkipped) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  const RawBatchOp ops[] = {{Op(Opcode::kWrite), 50, id, 0}, {Op(Opcode::kRead), 50, id, 100}};
  const auto table = BatchTable(ops, 2);
  // body_len larger, and smaller, than the descriptors account for; the body really is that long.
  for (size_t payload : {size_t{100}, size_t{10}, size_t{0}}) {
    auto f = c.Call(Opcode::kBatch, WithPayload(table, payload, 0xee));
    ASSERT_TRUE(f.has_value()) << f.error().ToString();
    EXPECT_EQ(f->code(), StatusCode::kProtocolError) << payload;
    ASSERT_TRUE(StillServes(c)) << payload;
  }
  // body_len shorter than the descriptor table itself.
  auto f = c.Call(Opcode::kBatch, std::span(table).first(8 + 24));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kProtocolError);
  ASSERT_TRUE(StillServes(c));
  // A count of 1025 descriptors, and a descriptor that is neither READ nor WRITE.
  f = c.Call(Opcode::kBatch, BatchTable(ops, 1025));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(StillServes(c));
  const RawBatchOp bad_code[] = {{Op(Opcode::kAlloc), 50, id, 0}};
  f = c.Call(Opcode::kBatch, BatchTable(bad_code, 1));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(StillServes(c));
  // Writes adding up to more than 16 MiB: refused, and the 16 MiB body skipped.
  const RawBatchOp big[] = {{Op(Opcode::kWrite), wire::kMaxDataLen, id, 0},
                            {Op(Opcode::kWrite), 1, id, 0}};
  f = c.Call(Opcode::kBatch, WithPayload(BatchTable(big, 2), wire::kMaxDataLen + 1, 0xee));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(StillServes(c));
  auto head = c.Read(id, 0, 4096);
  ASSERT_TRUE(head.has_value()) << head.error().ToString();
  EXPECT_EQ(std::count(head->begin(), head->end(), 0xee), 0) << "a refused BATCH wrote";
  EXPECT_TRUE(c.Free({id}).ok());
}

TEST_F(BadInputTest, BatchOpsFailOneByOne) {
  RawClient c = Authed();
  auto lease = c.Alloc(2);
  ASSERT_TRUE(lease.has_value());
  const uint64_t mine = (*lease)[0].lease_id;
  const uint64_t freed = (*lease)[1].lease_id;
  ASSERT_TRUE(c.Free({freed}).ok());
  const uint64_t theirs = good_->slabs()[1].lease_id;
  const RawBatchOp ops[] = {
      {Op(Opcode::kWrite), 4, mine, 0},              // ok
      {Op(Opcode::kWrite), 4, theirs, 0},            // PermissionDenied
      {Op(Opcode::kRead), 4, mine, 0},               // ok
      {Op(Opcode::kWrite), 4, mine, kSlabSize - 2},  // OutOfRange
      {Op(Opcode::kRead), 4, freed, 0},              // Expired
      {Op(Opcode::kRead), 4, kU64Max, 0},            // NotFound
      {Op(Opcode::kWrite), 4, freed, 8},             // Expired
      {Op(Opcode::kRead), 4, mine, 4},               // ok (the next write's target)
      {Op(Opcode::kWrite), 4, mine, 8},              // ok
  };
  std::vector<uint8_t> body = BatchTable(ops, 9);
  for (uint8_t v : {1, 2, 3, 4, 5}) body.insert(body.end(), 4, v);  // the five write payloads
  auto f = c.Call(Opcode::kBatch, body);
  ASSERT_TRUE(f.has_value()) << f.error().ToString();
  ASSERT_EQ(f->code(), StatusCode::kOk);
  wire::Reader r(f->body);
  EXPECT_EQ(r.U32(), 9u);
  r.U32();
  const StatusCode want[] = {StatusCode::kOk,      StatusCode::kPermissionDenied,
                             StatusCode::kOk,      StatusCode::kOutOfRange,
                             StatusCode::kExpired, StatusCode::kNotFound,
                             StatusCode::kExpired, StatusCode::kOk,
                             StatusCode::kOk};
  for (size_t i = 0; i < 9; ++i) {
    EXPECT_EQ(StatusCodeFromWire(static_cast<uint16_t>(r.U32())), want[i]) << "op " << i;
  }
  // Data of the two OK reads, in order (ops in one batch may run in any order, but these two
  // do not overlap any write of the batch except op 0 / op 2, which the daemon runs in order).
  EXPECT_EQ(r.remaining(), 8u);
  auto head = c.Read(mine, 0, 12);
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(*head, (std::vector<uint8_t>{1, 1, 1, 1, 0, 0, 0, 0, 5, 5, 5, 5}));
  EXPECT_TRUE(StillServes(c));
  EXPECT_TRUE(c.Free({mine}).ok());
}

TEST_F(BadInputTest, PipelinedErrorsAndSuccessesAreAnsweredInOrder) {
  RawClient c = Authed();
  auto lease = c.Alloc(1);
  ASSERT_TRUE(lease.has_value());
  const uint64_t id = (*lease)[0].lease_id;
  std::vector<uint8_t> bytes;
  auto add = [&](uint8_t op, uint64_t rid, const std::vector<uint8_t>& body) {
    auto h = EncodeRawHeader(
        {.opcode = op, .request_id = rid, .body_len = static_cast<uint32_t>(body.size())});
    bytes.insert(bytes.end(), h.begin(), h.end());
    bytes.insert(bytes.end(), body.begin(), body.end());
  };
  add(Op(Opcode::kWrite), 1, WithPayload(DataOpBody(id, 0, 3), 3, 7));
  add(Op(Opcode::kRead), 2, DataOpBody(id, kSlabSize, 1));                   // OutOfRange
  add(Op(Opcode::kWrite), 3, WithPayload(DataOpBody(kU64Max, 0, 5), 5, 8));  // NotFound
  add(Op(Opcode::kRead), 4, DataOpBody(id, 0, 3));
  add(42, 5, {1, 2, 3});                            // unknown
  add(Op(Opcode::kRead), 6, DataOpBody(id, 0, 0));  // InvalidArgument
  add(Op(Opcode::kStat), 7, {});
  ASSERT_TRUE(c.Send(bytes).ok());
  const StatusCode want[] = {
      StatusCode::kOk, StatusCode::kOutOfRange,    StatusCode::kNotFound,
      StatusCode::kOk, StatusCode::kUnimplemented, StatusCode::kInvalidArgument,
      StatusCode::kOk};
  for (uint64_t rid = 1; rid <= 7; ++rid) {
    auto f = c.Receive();
    ASSERT_TRUE(f.has_value()) << f.error().ToString();
    EXPECT_EQ(f->header.request_id, rid);
    EXPECT_EQ(f->code(), want[rid - 1]) << rid << ": " << f->status().ToString();
    if (rid == 4) {
      EXPECT_EQ(f->body, (std::vector<uint8_t>{7, 7, 7}));
    }
  }
  EXPECT_TRUE(c.Free({id}).ok());
}

}  // namespace
}  // namespace farmem::testing
