// The wire format (docs/wire-protocol.md): every encoder's output decodes to what went in, and
// every decoder refuses what the document forbids (bad magic/version/flags/lengths, truncation,
// counts over the limits) with the documented code, without reading past what it was given.
#include "farmem/common/wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace farmem::wire {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();

std::vector<uint8_t> HeaderBytes(const FrameHeader& h) {
  std::vector<uint8_t> out(kHeaderSize);
  EncodeHeader(h, out.data());
  return out;
}

void PutU16(std::vector<uint8_t>& b, size_t at, uint16_t v) { std::memcpy(&b[at], &v, 2); }
void PutU32(std::vector<uint8_t>& b, size_t at, uint32_t v) { std::memcpy(&b[at], &v, 4); }

template <typename T>
StatusCode CodeOf(const Result<T>& r) {
  return r.has_value() ? StatusCode::kOk : r.error().code();
}

// ---------------------------------------------------------------- header

TEST(WireHeader, RoundTripsEveryField) {
  FrameHeader h;
  h.opcode = static_cast<uint8_t>(Opcode::kBatch);
  h.flags = kFlagReply;
  h.request_id = 0x0123456789abcdefull;
  h.body_len = kMaxBodyLen;
  h.status = static_cast<uint16_t>(StatusCode::kExpired);
  const std::vector<uint8_t> bytes = HeaderBytes(h);
  // The layout is the document's: magic, version, opcode, flags, id, body_len, status, reserved.
  EXPECT_EQ(bytes[0], 'F');
  EXPECT_EQ(bytes[1], 'M');
  EXPECT_EQ(bytes[2], 'E');
  EXPECT_EQ(bytes[3], 'M');
  EXPECT_EQ(bytes[4], kVersion);
  EXPECT_EQ(bytes[5], static_cast<uint8_t>(Opcode::kBatch));
  EXPECT_EQ(bytes[8], 0xef);  // little-endian request id
  EXPECT_EQ(bytes[15], 0x01);
  EXPECT_EQ(bytes[22], 0);
  EXPECT_EQ(bytes[23], 0);

  auto d = DecodeHeader(bytes);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->version, kVersion);
  EXPECT_EQ(d->opcode, h.opcode);
  EXPECT_EQ(d->flags, h.flags);
  EXPECT_EQ(d->request_id, h.request_id);
  EXPECT_EQ(d->body_len, h.body_len);
  EXPECT_EQ(d->status, h.status);
  EXPECT_TRUE(d->is_reply());
}

TEST(WireHeader, PushFlagAndZeroFieldsRoundTrip) {
  FrameHeader h;
  h.opcode = static_cast<uint8_t>(Opcode::kEvictNotice);
  h.flags = kFlagPush;
  auto d = DecodeHeader(HeaderBytes(h));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->flags, kFlagPush);
  EXPECT_FALSE(d->is_reply());
  EXPECT_EQ(d->request_id, 0u);
  EXPECT_EQ(d->body_len, 0u);
}

TEST(WireHeader, ReadsOnlyTheFirst24Bytes) {
  FrameHeader h;
  h.opcode = static_cast<uint8_t>(Opcode::kStat);
  std::vector<uint8_t> bytes = HeaderBytes(h);
  bytes.resize(100, 0xff);  // whatever follows is body, not header
  EXPECT_TRUE(DecodeHeader(bytes).has_value());
}

TEST(WireHeader, RejectsTruncatedHeaderAtEveryLength) {
  const std::vector<uint8_t> bytes = HeaderBytes(FrameHeader{});
  for (size_t n = 0; n < kHeaderSize; ++n) {
    auto d = DecodeHeader(std::span(bytes).first(n));
    ASSERT_FALSE(d.has_value()) << n;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError) << n;
  }
}

TEST(WireHeader, RejectsBadMagicInEachByte) {
  for (size_t i = 0; i < 4; ++i) {
    std::vector<uint8_t> bytes = HeaderBytes(FrameHeader{});
    bytes[i] ^= 0x20;
    auto d = DecodeHeader(bytes);
    ASSERT_FALSE(d.has_value()) << i;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError);
    EXPECT_THAT(d.error().message(), HasSubstr("magic"));
  }
  // Byte-swapped magic: a big-endian peer.
  std::vector<uint8_t> bytes = HeaderBytes(FrameHeader{});
  std::swap(bytes[0], bytes[3]);
  std::swap(bytes[1], bytes[2]);
  EXPECT_EQ(CodeOf(DecodeHeader(bytes)), StatusCode::kProtocolError);
}

TEST(WireHeader, RejectsEveryOtherVersion) {
  for (int v : {0, 2, 3, 0x7f, 0xff}) {
    FrameHeader h;
    h.version = static_cast<uint8_t>(v);
    auto d = DecodeHeader(HeaderBytes(h));
    ASSERT_FALSE(d.has_value()) << v;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError);
    EXPECT_THAT(d.error().message(), HasSubstr("version"));
  }
}

TEST(WireHeader, RejectsReservedBits) {
  for (uint16_t reserved : {uint16_t{1}, uint16_t{0x8000}, uint16_t{0xffff}}) {
    std::vector<uint8_t> bytes = HeaderBytes(FrameHeader{});
    PutU16(bytes, 22, reserved);
    auto d = DecodeHeader(bytes);
    ASSERT_FALSE(d.has_value()) << reserved;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError);
    EXPECT_THAT(d.error().message(), HasSubstr("reserved"));
  }
}

TEST(WireHeader, RejectsUnknownFlags) {
  for (int bit = 2; bit < 16; ++bit) {
    FrameHeader h;
    h.flags = static_cast<uint16_t>((1u << bit) | kFlagReply);
    auto d = DecodeHeader(HeaderBytes(h));
    ASSERT_FALSE(d.has_value()) << bit;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError) << bit;
  }
  FrameHeader both;
  both.flags = kFlagReply | kFlagPush;  // both known: the header layer accepts it
  EXPECT_TRUE(DecodeHeader(HeaderBytes(both)).has_value());
}

TEST(WireHeader, EnforcesBodyLimit) {
  FrameHeader h;
  h.body_len = kMaxBodyLen;
  EXPECT_TRUE(DecodeHeader(HeaderBytes(h)).has_value());
  for (uint32_t len : {kMaxBodyLen + 1, 0x80000000u, 0xffffffffu}) {
    h.body_len = len;
    auto d = DecodeHeader(HeaderBytes(h));
    ASSERT_FALSE(d.has_value()) << len;
    EXPECT_EQ(d.error().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(d.error().message(), HasSubstr(std::to_string(len)));
  }
  // A caller's tighter limit (control replies).
  h.body_len = kMaxControlBodyLen;
  EXPECT_TRUE(DecodeHeader(HeaderBytes(h), kMaxControlBodyLen).has_value());
  h.body_len = kMaxControlBodyLen + 1;
  EXPECT_EQ(CodeOf(DecodeHeader(HeaderBytes(h), kMaxControlBodyLen)),
            StatusCode::kResourceExhausted);
  h.body_len = 1;
  EXPECT_EQ(CodeOf(DecodeHeader(HeaderBytes(h), 0)), StatusCode::kResourceExhausted);
}

TEST(WireHeader, LimitsAreConsistent) {
  // The biggest BATCH (full descriptor table plus a full payload) fits in one frame.
  EXPECT_EQ(kMaxBodyLen, kMaxDataLen + 8 + kMaxOpsPerBatch * kBatchOpSize);
  EXPECT_EQ(kMaxBodyLen, (16u << 20) + 8 + 24 * 1024);
  EXPECT_EQ(kBatchOpSize, 24u);
  EXPECT_EQ(kDataOpSize, 24u);
}

TEST(WireHeader, OpcodeNames) {
  EXPECT_STREQ(OpcodeName(1), "HELLO");
  EXPECT_STREQ(OpcodeName(2), "AUTH");
  EXPECT_STREQ(OpcodeName(3), "STAT");
  EXPECT_STREQ(OpcodeName(4), "ALLOC");
  EXPECT_STREQ(OpcodeName(5), "FREE");
  EXPECT_STREQ(OpcodeName(6), "HEARTBEAT");
  EXPECT_STREQ(OpcodeName(7), "READ");
  EXPECT_STREQ(OpcodeName(8), "WRITE");
  EXPECT_STREQ(OpcodeName(9), "BATCH");
  EXPECT_STREQ(OpcodeName(10), "EVICT_NOTICE");
  EXPECT_STREQ(OpcodeName(11), "RDMA_TOKEN");
  EXPECT_STREQ(OpcodeName(12), "PARITY_ENCODE");
  EXPECT_STREQ(OpcodeName(13), "GATHER_CELL");
  EXPECT_STREQ(OpcodeName(14), "DRAIN");
  for (int op : {0, 15, 100, 255}) EXPECT_STREQ(OpcodeName(static_cast<uint8_t>(op)), "UNKNOWN");
}

// ---------------------------------------------------------------- Reader / Writer

TEST(WireReader, FailureIsStickyAndYieldsZeros) {
  const std::vector<uint8_t> bytes = {1, 2, 3};
  Reader r(bytes);
  EXPECT_EQ(r.U16(), 0x0201);
  EXPECT_EQ(r.U32(), 0u);  // only one byte left
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.U8(), 0u);  // the one byte is no longer handed out
  EXPECT_TRUE(r.Bytes(0).empty());
  EXPECT_EQ(r.remaining(), 0u);
}

TEST(WireReader, BytesNeverOverflowsTheSpan) {
  const std::vector<uint8_t> bytes(8, 7);
  Reader r(bytes);
  r.Skip(4);
  EXPECT_TRUE(r.Bytes(std::numeric_limits<size_t>::max()).empty());
  EXPECT_FALSE(r.ok());
  Reader r2(bytes);
  EXPECT_EQ(r2.Bytes(8).size(), 8u);
  EXPECT_TRUE(r2.ok());
  EXPECT_EQ(r2.remaining(), 0u);
}

TEST(WireWriter, IsLittleEndian) {
  std::vector<uint8_t> out;
  Writer w(&out);
  w.U16(0x0102);
  w.U32(0x03040506);
  w.U64(0x0708090a0b0c0d0eull);
  w.Zeros(2);
  EXPECT_EQ(out, (std::vector<uint8_t>{2, 1, 6, 5, 4, 3, 0xe, 0xd, 0xc, 0xb, 0xa, 9, 8, 7, 0, 0}));
}

// ---------------------------------------------------------------- HELLO / AUTH

HelloRequest SampleHello() {
  HelloRequest m;
  m.min_version = 1;
  m.max_version = 3;
  for (size_t i = 0; i < m.client_id.size(); ++i) m.client_id[i] = static_cast<uint8_t>(i + 1);
  for (size_t i = 0; i < m.client_nonce.size(); ++i) {
    m.client_nonce[i] = static_cast<uint8_t>(0xa0 + i);
  }
  m.client_name = "blockdev@host-7";
  return m;
}

TEST(WireHello, RoundTrips) {
  const HelloRequest m = SampleHello();
  std::vector<uint8_t> body;
  EncodeHello(m, &body);
  EXPECT_EQ(body.size(), 4 + kClientIdSize + kNonceSize + m.client_name.size());
  auto d = DecodeHello(body);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->min_version, 1);
  EXPECT_EQ(d->max_version, 3);
  EXPECT_EQ(d->client_id, m.client_id);
  EXPECT_EQ(d->client_nonce, m.client_nonce);
  EXPECT_EQ(d->client_name, m.client_name);
}

TEST(WireHello, EmptyNameAndLongestName) {
  HelloRequest m = SampleHello();
  m.client_name = "";
  std::vector<uint8_t> body;
  EncodeHello(m, &body);
  auto d = DecodeHello(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_name, "");

  m.client_name = std::string(kMaxClientName, 'n');
  body.clear();
  EncodeHello(m, &body);
  d = DecodeHello(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_name, m.client_name);
}

TEST(WireHello, EncoderCutsOverlongNames) {
  HelloRequest m = SampleHello();
  m.client_name = std::string(kMaxClientName + 50, 'x');
  std::vector<uint8_t> body;
  EncodeHello(m, &body);
  auto d = DecodeHello(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_name, std::string(kMaxClientName, 'x'));
}

TEST(WireHello, NonPrintableNameBytesAreReplaced) {
  HelloRequest m = SampleHello();
  m.client_name = std::string("a\nb\x1b[31m\x7f\xff", 10);
  std::vector<uint8_t> body;
  EncodeHello(m, &body);
  auto d = DecodeHello(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_name, "a?b?[31m??");
}

TEST(WireHello, RejectsNameLengthOverLimitOrInconsistent) {
  std::vector<uint8_t> body;
  EncodeHello(SampleHello(), &body);
  const size_t fixed = 4 + kClientIdSize + kNonceSize;
  // name_len larger than what follows
  std::vector<uint8_t> b = body;
  PutU16(b, 2, static_cast<uint16_t>(b.size() - fixed + 1));
  EXPECT_EQ(CodeOf(DecodeHello(b)), StatusCode::kProtocolError);
  // trailing bytes after the name
  b = body;
  b.push_back('!');
  EXPECT_EQ(CodeOf(DecodeHello(b)), StatusCode::kProtocolError);
  // name_len over the limit, with that many bytes present
  HelloRequest m = SampleHello();
  m.client_name.clear();
  b.clear();
  EncodeHello(m, &b);
  b.resize(fixed + kMaxClientName + 1, 'y');
  PutU16(b, 2, static_cast<uint16_t>(kMaxClientName + 1));
  EXPECT_EQ(CodeOf(DecodeHello(b)), StatusCode::kProtocolError);
  PutU16(b, 2, 0xffff);
  EXPECT_EQ(CodeOf(DecodeHello(b)), StatusCode::kProtocolError);
}

TEST(WireHello, RejectsEmptyVersionRange) {
  HelloRequest m = SampleHello();
  m.min_version = 2;
  m.max_version = 1;
  std::vector<uint8_t> body;
  EncodeHello(m, &body);
  auto d = DecodeHello(body);
  ASSERT_FALSE(d.has_value());
  EXPECT_EQ(d.error().code(), StatusCode::kProtocolError);
  EXPECT_THAT(d.error().message(), HasSubstr("2..1"));
}

TEST(WireHello, RejectsEveryTruncation) {
  std::vector<uint8_t> body;
  EncodeHello(SampleHello(), &body);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeHello(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
}

TEST(WireHelloReply, RoundTripsAndRejectsTruncation) {
  HelloReply m;
  m.version = 1;
  m.features = kFeatureAuthRequired | kFeatureVerbs;
  m.node_id = 0xfeedfacecafebeefull;
  for (size_t i = 0; i < m.server_nonce.size(); ++i) m.server_nonce[i] = static_cast<uint8_t>(i);
  std::vector<uint8_t> body;
  EncodeHelloReply(m, &body);
  EXPECT_EQ(body.size(), 16 + kNonceSize);
  auto d = DecodeHelloReply(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->version, 1);
  EXPECT_EQ(d->features, m.features);
  EXPECT_EQ(d->node_id, m.node_id);
  EXPECT_EQ(d->server_nonce, m.server_nonce);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeHelloReply(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
}

TEST(WireAuth, RoundTripsAndNeedsExactly32Bytes) {
  AuthRequest m;
  for (size_t i = 0; i < kMacSize; ++i) m.client_mac[i] = static_cast<uint8_t>(3 * i);
  std::vector<uint8_t> body;
  EncodeAuth(m, &body);
  ASSERT_EQ(body.size(), kMacSize);
  auto d = DecodeAuth(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_mac, m.client_mac);
  for (size_t n = 0; n < kMacSize; ++n) {
    EXPECT_EQ(CodeOf(DecodeAuth(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
  body.push_back(0);
  EXPECT_EQ(CodeOf(DecodeAuth(body)), StatusCode::kProtocolError);

  AuthReply r;
  r.server_mac = m.client_mac;
  r.server_mac[31] = 0x99;
  std::vector<uint8_t> rb;
  EncodeAuthReply(r, &rb);
  auto dr = DecodeAuthReply(rb);
  ASSERT_TRUE(dr.has_value());
  EXPECT_EQ(dr->server_mac, r.server_mac);
  for (size_t n = 0; n < kMacSize; ++n) {
    EXPECT_EQ(CodeOf(DecodeAuthReply(std::span(rb).first(n))), StatusCode::kProtocolError) << n;
  }
  rb.push_back(0);
  EXPECT_EQ(CodeOf(DecodeAuthReply(rb)), StatusCode::kProtocolError);
}

// ---------------------------------------------------------------- STAT

TEST(WireStat, RoundTripsEveryField) {
  StatReply m;
  m.node_id = 1;
  m.capacity = 2ull << 40;
  m.slab_size = 64ull << 20;
  m.total_slabs = 32768;
  m.free_slabs = 17;
  m.clients = 3;
  m.features = kFeatureAuthRequired;
  m.ops = kU64Max;
  m.bytes_read = 5;
  m.bytes_written = 6;
  m.rdma_port = 4791;
  std::vector<uint8_t> body;
  EncodeStatReply(m, &body);
  EXPECT_EQ(body.size(), 72u);
  auto d = DecodeStatReply(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->node_id, m.node_id);
  EXPECT_EQ(d->capacity, m.capacity);
  EXPECT_EQ(d->slab_size, m.slab_size);
  EXPECT_EQ(d->total_slabs, m.total_slabs);
  EXPECT_EQ(d->free_slabs, m.free_slabs);
  EXPECT_EQ(d->clients, m.clients);
  EXPECT_EQ(d->features, m.features);
  EXPECT_EQ(d->ops, m.ops);
  EXPECT_EQ(d->bytes_read, m.bytes_read);
  EXPECT_EQ(d->bytes_written, m.bytes_written);
  EXPECT_EQ(d->rdma_port, m.rdma_port);
}

TEST(WireStat, IgnoresAppendedFieldsAndRejectsTruncation) {
  StatReply m;
  m.free_slabs = 9;
  std::vector<uint8_t> body;
  EncodeStatReply(m, &body);
  std::vector<uint8_t> longer = body;
  longer.resize(body.size() + 40, 0xab);  // a newer daemon's fields
  auto d = DecodeStatReply(longer);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->free_slabs, 9u);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeStatReply(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
}

// A client must see what it may still take, not free slabs its --max-client-share keeps from it
// (issue 11 gap 3): appended fields, announced by kFeatureClientShare; a daemon without them is
// read as before (FreeForClient falls back to free_slabs).
TEST(WireStat, CarriesWhatThisClientMayTakeBesideThePoolsFree) {
  StatReply m;
  m.free_slabs = 16;
  m.features = kFeatureClientShare | kFeatureAuthRequired;
  m.client_free_slabs = 5;
  m.client_max_slabs = 8;
  std::vector<uint8_t> body;
  EncodeStatReply(m, &body);
  EXPECT_EQ(body.size(), 80u);
  auto d = DecodeStatReply(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->free_slabs, 16u);
  EXPECT_EQ(d->client_free_slabs, 5u);
  EXPECT_EQ(d->client_max_slabs, 8u);
  EXPECT_EQ(FreeForClient(*d), 5u);
  // Announced but cut off: malformed, not zeros.
  EXPECT_EQ(CodeOf(DecodeStatReply(std::span(body).first(76))), StatusCode::kProtocolError);

  StatReply old;  // a daemon that predates the fields
  old.free_slabs = 16;
  std::vector<uint8_t> old_body;
  EncodeStatReply(old, &old_body);
  EXPECT_EQ(old_body.size(), 72u);
  auto od = DecodeStatReply(old_body);
  ASSERT_TRUE(od.has_value());
  EXPECT_EQ(FreeForClient(*od), 16u);
}

// The version field of STAT, the HELLO reply and AUTH (`version_len u16, version`), one encoding
// for the three: `encode(v)` makes a body ending in version v after `fixed` bytes, `decode` gives
// back the version or the error. Every truncation inside the field is malformed (never a shorter
// version), a length over the limit is refused, bytes that are not printable are shown as '?',
// and the encoder cuts an overlong version to the limit.
template <typename Encode, typename Decode>
void ExpectVersionField(const char* what, size_t fixed, Encode encode, Decode decode) {
  SCOPED_TRACE(what);
  const std::string v = "0.1.0 (git v0.1.0-7-gabcdef0)";
  const std::vector<uint8_t> body = encode(v);
  ASSERT_EQ(body.size(), fixed + 2 + v.size());
  Result<std::string> d = decode(std::span<const uint8_t>(body));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, v);
  for (size_t n = fixed + 1; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(decode(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
  std::vector<uint8_t> bad(body.begin(), body.begin() + static_cast<ptrdiff_t>(fixed));
  Writer w(&bad);
  w.U16(static_cast<uint16_t>(kMaxVersionString + 1));
  w.Zeros(kMaxVersionString + 1);
  EXPECT_EQ(CodeOf(decode(std::span<const uint8_t>(bad))), StatusCode::kProtocolError);
  std::vector<uint8_t> odd(body.begin(), body.begin() + static_cast<ptrdiff_t>(fixed));
  Writer o(&odd);
  o.U16(3);
  o.Bytes(std::vector<uint8_t>{'1', 0x0a, 0xff});
  Result<std::string> od = decode(std::span<const uint8_t>(odd));
  ASSERT_TRUE(od.has_value());
  EXPECT_EQ(*od, "1??");
  const std::vector<uint8_t> long_body = encode(std::string(kMaxVersionString + 50, 'v'));
  Result<std::string> cut = decode(std::span<const uint8_t>(long_body));
  ASSERT_TRUE(cut.has_value());
  EXPECT_EQ(cut->size(), kMaxVersionString);
}

// The decoded version of a message, or its error.
template <typename M>
Result<std::string> VersionOf(const Result<M>& d, std::string M::*field) {
  if (!d.has_value()) return Err(d.error());
  return (*d).*field;
}

// The daemon's version rides at the end of STAT behind kFeatureVersion (issue 14): a reader that
// predates it stops after the CLIENT_SHARE fields, a daemon that predates it sends none.
TEST(WireStat, CarriesTheDaemonsVersionAfterTheClientShare) {
  StatReply m;
  m.free_slabs = 16;
  m.features = kFeatureClientShare | kFeatureVersion;
  m.client_free_slabs = 5;
  m.client_max_slabs = 8;
  m.version = "0.1.0 (git v0.1.0-7-gabcdef0)";
  std::vector<uint8_t> body;
  EncodeStatReply(m, &body);
  auto d = DecodeStatReply(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_free_slabs, 5u);
  // An older reader: the first 80 bytes are all it knows, and they decode the same.
  StatReply older = m;
  older.features &= ~kFeatureVersion;
  std::vector<uint8_t> older_body;
  EncodeStatReply(older, &older_body);
  ASSERT_EQ(older_body.size(), 80u);  // features (offset 36) differ, nothing else
  EXPECT_TRUE(std::equal(older_body.begin(), older_body.begin() + 36, body.begin()));
  EXPECT_TRUE(std::equal(older_body.begin() + 40, older_body.end(), body.begin() + 40));
  // With the bit set, no version at all is malformed too.
  EXPECT_EQ(CodeOf(DecodeStatReply(std::span(body).first(80))), StatusCode::kProtocolError);
  ExpectVersionField(
      "STAT", 80,
      [&](const std::string& v) {
        m.version = v;
        std::vector<uint8_t> b;
        EncodeStatReply(m, &b);
        return b;
      },
      [](std::span<const uint8_t> b) {
        return VersionOf(DecodeStatReply(b), &StatReply::version);
      });
}

// HELLO carries versions both ways behind kFeatureVersion (issue 14): the daemon's at the end of
// its HELLO reply, the client's at the end of AUTH, which a client sends only to a daemon whose
// HELLO reply had the bit. Readers that predate it see what they always saw.
TEST(WireHelloVersion, ReplyCarriesTheDaemonsVersionAndOlderReadersIgnoreIt) {
  HelloReply m;
  m.features = kFeatureAuthRequired | kFeatureVersion;
  m.node_id = 42;
  m.server_nonce.fill(7);
  m.daemon_version = "1.4.2 (git v1.4.2-3-g0123abc)";
  std::vector<uint8_t> body;
  EncodeHelloReply(m, &body);
  constexpr size_t kFixed = 16 + kNonceSize;
  auto d = DecodeHelloReply(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->daemon_version, m.daemon_version);
  EXPECT_EQ(d->node_id, 42u);
  EXPECT_EQ(d->server_nonce, m.server_nonce);
  // Without the bit nothing is appended, and a reply without it decodes with no version.
  HelloReply old = m;
  old.features &= ~kFeatureVersion;
  std::vector<uint8_t> old_body;
  EncodeHelloReply(old, &old_body);
  ASSERT_EQ(old_body.size(), kFixed);
  auto od = DecodeHelloReply(old_body);
  ASSERT_TRUE(od.has_value());
  EXPECT_EQ(od->daemon_version, "");
  // An older client reads the fixed part and ignores the trailer: the fixed part is unchanged
  // but for the feature bit.
  EXPECT_TRUE(std::equal(old_body.begin() + 8, old_body.end(), body.begin() + 8));
  // With the bit set, no version at all is malformed.
  EXPECT_EQ(CodeOf(DecodeHelloReply(std::span(body).first(kFixed))), StatusCode::kProtocolError);
  // Bytes past the trailer are a later version's trailers: ignored.
  std::vector<uint8_t> longer = body;
  longer.insert(longer.end(), {1, 2, 3});
  auto ld = DecodeHelloReply(longer);
  ASSERT_TRUE(ld.has_value());
  EXPECT_EQ(ld->daemon_version, m.daemon_version);
  ExpectVersionField(
      "HELLO reply", kFixed,
      [&](const std::string& v) {
        m.daemon_version = v;
        std::vector<uint8_t> b;
        EncodeHelloReply(m, &b);
        return b;
      },
      [](std::span<const uint8_t> b) {
        return VersionOf(DecodeHelloReply(b), &HelloReply::daemon_version);
      });
}

TEST(WireHelloVersion, AuthCarriesTheClientsVersionAsAnExactTrailer) {
  AuthRequest m;
  m.client_mac.fill(0x5a);
  m.client_version = "1.4.2";
  std::vector<uint8_t> body;
  EncodeAuth(m, &body);
  ASSERT_EQ(body.size(), kMacSize + 2 + 5);
  auto d = DecodeAuth(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->client_mac, m.client_mac);
  EXPECT_EQ(d->client_version, "1.4.2");
  // Without a version, exactly the proof, as older daemons expect.
  AuthRequest bare = m;
  bare.client_version.clear();
  std::vector<uint8_t> bare_body;
  EncodeAuth(bare, &bare_body);
  EXPECT_EQ(bare_body.size(), kMacSize);
  auto bd = DecodeAuth(bare_body);
  ASSERT_TRUE(bd.has_value());
  EXPECT_EQ(bd->client_version, "");
  // A byte after the trailer, or a zero-length trailer: malformed.
  std::vector<uint8_t> extra = body;
  extra.push_back(0);
  EXPECT_EQ(CodeOf(DecodeAuth(extra)), StatusCode::kProtocolError);
  std::vector<uint8_t> empty(body.begin(), body.begin() + kMacSize);
  Writer(&empty).U16(0);
  EXPECT_EQ(CodeOf(DecodeAuth(empty)), StatusCode::kProtocolError);
  ExpectVersionField(
      "AUTH", kMacSize,
      [&](const std::string& v) {
        m.client_version = v;
        std::vector<uint8_t> b;
        EncodeAuth(m, &b);
        return b;
      },
      [](std::span<const uint8_t> b) {
        return VersionOf(DecodeAuth(b), &AuthRequest::client_version);
      });
}

TEST(WireHelloVersion, MajorVersionOfAVersionString) {
  EXPECT_EQ(VersionMajor("0.1.0 (git v0.1.0-7-gabcdef0)"), 0u);
  EXPECT_EQ(VersionMajor("12.3"), 12u);
  EXPECT_EQ(VersionMajor("3"), 3u);
  EXPECT_EQ(VersionMajor(""), std::nullopt);
  EXPECT_EQ(VersionMajor("v1.0"), std::nullopt);
  EXPECT_EQ(VersionMajor("?"), std::nullopt);
  EXPECT_EQ(VersionMajor("99999999999999.0"), 999999999u);  // bounded, no overflow
}

// ---------------------------------------------------------------- ALLOC / FREE / HEARTBEAT

TEST(WireAlloc, RoundTripsCountsAtTheLimits) {
  for (uint32_t count : {1u, 7u, kMaxLeasesPerCall}) {
    std::vector<uint8_t> body;
    EncodeAlloc({count}, &body);
    EXPECT_EQ(body.size(), 8u);
    auto d = DecodeAlloc(body);
    ASSERT_TRUE(d.has_value()) << count;
    EXPECT_EQ(d->count, count);
  }
}

TEST(WireAlloc, RejectsZeroAndTooManyWithInvalidArgument) {
  for (uint32_t count : {0u, kMaxLeasesPerCall + 1, 0xffffffffu}) {
    std::vector<uint8_t> body;
    EncodeAlloc({count}, &body);
    auto d = DecodeAlloc(body);
    ASSERT_FALSE(d.has_value()) << count;
    EXPECT_EQ(d.error().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(d.error().message(), HasSubstr("1 to 1024"));
  }
}

TEST(WireAlloc, RejectsWrongBodySize) {
  std::vector<uint8_t> body;
  EncodeAlloc({3}, &body);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeAlloc(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
  body.push_back(0);
  EXPECT_EQ(CodeOf(DecodeAlloc(body)), StatusCode::kProtocolError);
}

AllocReply SampleAllocReply(size_t n) {
  AllocReply m;
  for (size_t i = 0; i < n; ++i) {
    m.leases.push_back({MakeLeaseId(static_cast<uint32_t>(100 + i), static_cast<uint32_t>(i)),
                        64ull << 20, 0x7f0000000000ull + i * (64ull << 20),
                        static_cast<uint32_t>(0x1000 + i)});
  }
  return m;
}

TEST(WireAllocReply, RoundTrips) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{kMaxLeasesPerCall}}) {
    const AllocReply m = SampleAllocReply(n);
    std::vector<uint8_t> body;
    EncodeAllocReply(m, &body);
    EXPECT_EQ(body.size(), 8 + n * kLeaseGrantSize);
    auto d = DecodeAllocReply(body);
    ASSERT_TRUE(d.has_value()) << n;
    ASSERT_EQ(d->leases.size(), n);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(d->leases[i].lease_id, m.leases[i].lease_id);
      EXPECT_EQ(d->leases[i].length, m.leases[i].length);
      EXPECT_EQ(d->leases[i].remote_addr, m.leases[i].remote_addr);
      EXPECT_EQ(d->leases[i].rkey, m.leases[i].rkey);
    }
  }
}

TEST(WireAllocReply, RejectsCountMismatchOverLimitAndTruncation) {
  std::vector<uint8_t> body;
  EncodeAllocReply(SampleAllocReply(3), &body);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeAllocReply(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
  std::vector<uint8_t> b = body;
  b.push_back(0);
  EXPECT_EQ(CodeOf(DecodeAllocReply(b)), StatusCode::kProtocolError);
  b = body;
  PutU32(b, 0, 2);
  EXPECT_EQ(CodeOf(DecodeAllocReply(b)), StatusCode::kProtocolError);
  // A count over the limit is refused before anything is sized by it.
  b = std::vector<uint8_t>(8, 0);
  PutU32(b, 0, 0xffffffff);
  EXPECT_EQ(CodeOf(DecodeAllocReply(b)), StatusCode::kProtocolError);
  b.clear();
  EncodeAllocReply(SampleAllocReply(kMaxLeasesPerCall + 1), &b);
  EXPECT_EQ(CodeOf(DecodeAllocReply(b)), StatusCode::kProtocolError);
}

TEST(WireFree, RoundTrips) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{kMaxLeasesPerCall}}) {
    FreeRequest m;
    for (size_t i = 0; i < n; ++i) m.lease_ids.push_back(kU64Max - i);
    std::vector<uint8_t> body;
    EncodeFree(m, &body);
    EXPECT_EQ(body.size(), 8 + 8 * n);
    auto d = DecodeFree(body);
    ASSERT_TRUE(d.has_value()) << n;
    EXPECT_EQ(d->lease_ids, m.lease_ids);
  }
}

TEST(WireFree, RejectsCountMismatchOverLimitAndTruncation) {
  FreeRequest m{{1, 2, 3}};
  std::vector<uint8_t> body;
  EncodeFree(m, &body);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeFree(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
  std::vector<uint8_t> b = body;
  PutU32(b, 0, 4);
  EXPECT_EQ(CodeOf(DecodeFree(b)), StatusCode::kProtocolError);
  b = body;
  b.push_back(1);
  EXPECT_EQ(CodeOf(DecodeFree(b)), StatusCode::kProtocolError);
  FreeRequest big;
  big.lease_ids.assign(kMaxLeasesPerCall + 1, 5);
  b.clear();
  EncodeFree(big, &b);
  EXPECT_EQ(CodeOf(DecodeFree(b)), StatusCode::kProtocolError);
  b = std::vector<uint8_t>(8, 0);
  PutU32(b, 0, 0xffffffff);
  EXPECT_EQ(CodeOf(DecodeFree(b)), StatusCode::kProtocolError);
}

TEST(WireHeartbeat, RoundTripsAndRejectsTruncation) {
  HeartbeatReply m{12, 10000};
  std::vector<uint8_t> body;
  EncodeHeartbeatReply(m, &body);
  EXPECT_EQ(body.size(), 16u);
  auto d = DecodeHeartbeatReply(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->leases_held, 12u);
  EXPECT_EQ(d->lease_ttl_ms, 10000u);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeHeartbeatReply(std::span(body).first(n))), StatusCode::kProtocolError)
        << n;
  }
}

// The leases under notice ride after the 16 bytes older readers know (they stop there), and
// only when there are some.
TEST(WireHeartbeat, NoticedLeasesRoundTripAndAreBoundsChecked) {
  HeartbeatReply m{3, 10000, {{0x1'00000002, 59000}, {0x1'00000005, 1}}};
  std::vector<uint8_t> body;
  EncodeHeartbeatReply(m, &body);
  ASSERT_EQ(body.size(), 16u + 8u + 2u * 16u);
  auto d = DecodeHeartbeatReply(body);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->noticed, m.noticed);
  for (size_t n = 17; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeHeartbeatReply(std::span(body).first(n))), StatusCode::kProtocolError)
        << n;
  }
  std::vector<uint8_t> longer = body;  // a later version's bytes after the list are ignored
  longer.insert(longer.end(), 5, 0xee);
  d = DecodeHeartbeatReply(longer);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->noticed, m.noticed);
  std::vector<uint8_t> zero(body.begin(), body.begin() + 16);  // a count of 0 is malformed
  zero.resize(24, 0);
  EXPECT_EQ(CodeOf(DecodeHeartbeatReply(zero)), StatusCode::kProtocolError);
  std::vector<uint8_t> huge = body;
  PutU32(huge, 16, kMaxLeasesPerCall + 1);
  EXPECT_EQ(CodeOf(DecodeHeartbeatReply(huge)), StatusCode::kProtocolError);
}

TEST(WireEvictNotice, RoundTrips) {
  for (size_t n : {size_t{0}, size_t{2}, size_t{kMaxLeasesPerCall}}) {
    EvictNotice m;
    m.grace_ms = 2500;
    for (size_t i = 0; i < n; ++i) m.lease_ids.push_back(MakeLeaseId(9, static_cast<uint32_t>(i)));
    std::vector<uint8_t> body;
    EncodeEvictNotice(m, &body);
    EXPECT_EQ(body.size(), 16 + 8 * n);  // grace, reserved, count, reserved, ids
    auto d = DecodeEvictNotice(body);
    ASSERT_TRUE(d.has_value()) << n;
    EXPECT_EQ(d->grace_ms, 2500u);
    EXPECT_EQ(d->lease_ids, m.lease_ids);
  }
}

TEST(WireEvictNotice, RejectsTruncationAndCountMismatch) {
  EvictNotice m{{7, 8}, 100};
  std::vector<uint8_t> body;
  EncodeEvictNotice(m, &body);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeEvictNotice(std::span(body).first(n))), StatusCode::kProtocolError) << n;
  }
  std::vector<uint8_t> b = body;
  PutU32(b, 8, 3);
  EXPECT_EQ(CodeOf(DecodeEvictNotice(b)), StatusCode::kProtocolError);
  b = body;
  PutU32(b, 8, 0xffffffff);
  EXPECT_EQ(CodeOf(DecodeEvictNotice(b)), StatusCode::kProtocolError);
}

// ---------------------------------------------------------------- RDMA_TOKEN and rdma_cm data

RdmaToken SampleToken() {
  RdmaToken t{};
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(0xf0 - i);
  return t;
}

TEST(WireRdmaToken, ReplyRoundTripsAndIgnoresAppendedBytes) {
  const RdmaTokenReply m{SampleToken(), 7412, 5000};
  std::vector<uint8_t> body;
  EncodeRdmaTokenReply(m, &body);
  EXPECT_EQ(body.size(), kRdmaTokenSize + 8);
  auto d = DecodeRdmaTokenReply(body);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->token, m.token);
  EXPECT_EQ(d->rdma_port, 7412);
  EXPECT_EQ(d->valid_ms, 5000u);
  body.resize(body.size() + 16, 0x99);
  EXPECT_TRUE(DecodeRdmaTokenReply(body).has_value());
}

TEST(WireRdmaToken, ReplyRejectsTruncationAndPortZero) {
  std::vector<uint8_t> body;
  EncodeRdmaTokenReply({SampleToken(), 7412, 5000}, &body);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_EQ(CodeOf(DecodeRdmaTokenReply(std::span(body).first(n))), StatusCode::kProtocolError)
        << n;
  }
  body.clear();
  EncodeRdmaTokenReply({SampleToken(), 0, 5000}, &body);
  EXPECT_EQ(CodeOf(DecodeRdmaTokenReply(body)), StatusCode::kProtocolError);
}

TEST(WireRdmaConnectData, RoundTripsAndToleratesPadding) {
  uint8_t buf[kRdmaConnectDataSize];
  EncodeRdmaConnectData(SampleToken(), buf);
  EXPECT_EQ(buf[0], 'F');
  EXPECT_EQ(buf[1], 'M');
  EXPECT_EQ(buf[2], 'R');
  EXPECT_EQ(buf[3], 'C');
  EXPECT_EQ(buf[4], kVersion);
  auto d = DecodeRdmaConnectData(buf);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, SampleToken());
  std::vector<uint8_t> padded(buf, buf + sizeof(buf));
  padded.resize(56, 0);  // rdma_cm private data comes padded
  EXPECT_EQ(DecodeRdmaConnectData(padded).value_or(RdmaToken{}), SampleToken());
}

TEST(WireRdmaConnectData, WithoutOurMagicOrTooShortIsUnauthenticated) {
  uint8_t buf[kRdmaConnectDataSize];
  EncodeRdmaConnectData(SampleToken(), buf);
  for (size_t n = 0; n < kRdmaConnectDataSize; ++n) {
    EXPECT_EQ(CodeOf(DecodeRdmaConnectData(std::span(buf, n))), StatusCode::kUnauthenticated) << n;
  }
  std::vector<uint8_t> b(buf, buf + sizeof(buf));
  b[0] ^= 1;
  EXPECT_EQ(CodeOf(DecodeRdmaConnectData(b)), StatusCode::kUnauthenticated);
  b = std::vector<uint8_t>(buf, buf + sizeof(buf));
  b[4] = 2;
  EXPECT_EQ(CodeOf(DecodeRdmaConnectData(b)), StatusCode::kProtocolError);
}

TEST(WireRdmaRejectData, CarriesTheStatusCode) {
  for (StatusCode why : {StatusCode::kUnauthenticated, StatusCode::kExpired,
                         StatusCode::kResourceExhausted, StatusCode::kRemoteAccessError}) {
    uint8_t buf[kRdmaRejectDataSize];
    EncodeRdmaRejectData(why, buf);
    EXPECT_EQ(DecodeRdmaRejectData(buf), why);
    std::vector<uint8_t> padded(buf, buf + sizeof(buf));
    padded.resize(148, 0);
    EXPECT_EQ(DecodeRdmaRejectData(padded), why);
  }
}

TEST(WireRdmaRejectData, ForeignOrShortDataIsInternal) {
  uint8_t buf[kRdmaRejectDataSize];
  EncodeRdmaRejectData(StatusCode::kExpired, buf);
  for (size_t n = 0; n < kRdmaRejectDataSize; ++n) {
    EXPECT_EQ(DecodeRdmaRejectData(std::span(buf, n)), StatusCode::kInternal) << n;
  }
  std::vector<uint8_t> b(buf, buf + sizeof(buf));
  b[3] = 0;
  EXPECT_EQ(DecodeRdmaRejectData(b), StatusCode::kInternal);
  b = std::vector<uint8_t>(buf, buf + sizeof(buf));
  PutU16(b, 6, 0xffff);  // a code this build does not know
  EXPECT_EQ(DecodeRdmaRejectData(b), StatusCode::kInternal);
}

// ---------------------------------------------------------------- READ / WRITE data op

TEST(WireDataOp, RoundTripsAtTheLimits) {
  for (const DataOp& m : {DataOp{MakeLeaseId(5, 3), 0, 1}, DataOp{kU64Max, kU64Max, kMaxDataLen},
                          DataOp{1, 4096, 4096}}) {
    uint8_t buf[kDataOpSize];
    EncodeDataOp(m, buf);
    auto d = DecodeDataOp(buf);
    ASSERT_TRUE(d.has_value()) << d.error().ToString();
    EXPECT_EQ(d->lease_id, m.lease_id);
    EXPECT_EQ(d->offset, m.offset);
    EXPECT_EQ(d->length, m.length);
  }
}

TEST(WireDataOp, DecodesOnlyTheFixedPart) {
  std::vector<uint8_t> body(kDataOpSize + 100, 0xcc);  // a WRITE: data op, then payload
  EncodeDataOp({9, 10, 100}, body.data());
  auto d = DecodeDataOp(body);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->length, 100u);
}

TEST(WireDataOp, RejectsZeroAndOversizedLength) {
  for (uint32_t len : {0u, kMaxDataLen + 1, 0xffffffffu}) {
    uint8_t buf[kDataOpSize];
    EncodeDataOp({1, 0, len}, buf);
    auto d = DecodeDataOp(buf);
    ASSERT_FALSE(d.has_value()) << len;
    EXPECT_EQ(d.error().code(), StatusCode::kInvalidArgument) << len;
  }
}

TEST(WireDataOp, RejectsReservedFieldAndTruncation) {
  uint8_t buf[kDataOpSize];
  EncodeDataOp({1, 0, 8}, buf);
  std::vector<uint8_t> b(buf, buf + kDataOpSize);
  PutU32(b, 20, 1);
  EXPECT_EQ(CodeOf(DecodeDataOp(b)), StatusCode::kProtocolError);
  for (size_t n = 0; n < kDataOpSize; ++n) {
    EXPECT_EQ(CodeOf(DecodeDataOp(std::span(buf, n))), StatusCode::kProtocolError) << n;
  }
}

// ---------------------------------------------------------------- BATCH

struct BatchBody {
  std::vector<uint8_t> bytes;
  uint32_t body_len = 0;
};

// A BATCH body as a client builds it: table, then the write payloads.
BatchBody MakeBatch(const std::vector<BatchOp>& ops, uint32_t count_override = 0,
                    bool with_payload = true) {
  BatchBody b;
  Writer w(&b.bytes);
  w.U32(count_override != 0 ? count_override : static_cast<uint32_t>(ops.size()));
  w.U32(0);
  uint64_t payload = 0;
  for (const BatchOp& op : ops) {
    const size_t at = b.bytes.size();
    b.bytes.resize(at + kBatchOpSize);
    EncodeBatchOp(op, b.bytes.data() + at);
    if (op.op == Opcode::kWrite) payload += op.length;
  }
  if (with_payload) b.bytes.resize(b.bytes.size() + payload, 0x5a);
  b.body_len = static_cast<uint32_t>(8 + ops.size() * kBatchOpSize + payload);
  return b;
}

TEST(WireBatch, RoundTripsMixedReadsAndWrites) {
  const std::vector<BatchOp> ops = {
      {Opcode::kWrite, 10, MakeLeaseId(1, 2), 100},
      {Opcode::kRead, 4096, MakeLeaseId(1, 3), 0},
      {Opcode::kWrite, 1, MakeLeaseId(7, 0), kU64Max},
      {Opcode::kRead, 1, kU64Max, 5},
  };
  BatchBody b = MakeBatch(ops);
  auto d = DecodeBatch(b.bytes, b.body_len);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  ASSERT_EQ(d->ops.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(d->ops[i].op, ops[i].op) << i;
    EXPECT_EQ(d->ops[i].length, ops[i].length) << i;
    EXPECT_EQ(d->ops[i].lease_id, ops[i].lease_id) << i;
    EXPECT_EQ(d->ops[i].offset, ops[i].offset) << i;
  }
  EXPECT_EQ(d->payload_offset, 8 + 4 * kBatchOpSize);
  EXPECT_EQ(d->write_bytes, 11u);
  EXPECT_EQ(d->read_bytes, 4097u);
}

TEST(WireBatch, NeedsOnlyTheDescriptorTable) {
  // The daemon decodes the table before the payload has arrived.
  BatchBody b = MakeBatch({{Opcode::kWrite, 1000, 1, 0}}, 0, /*with_payload=*/false);
  ASSERT_EQ(b.bytes.size(), 8 + kBatchOpSize);
  auto d = DecodeBatch(b.bytes, b.body_len);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->write_bytes, 1000u);
}

TEST(WireBatch, MaxOpsAndMaxBytesAreAccepted) {
  std::vector<BatchOp> ops(
      kMaxOpsPerBatch, BatchOp{Opcode::kRead, kMaxDataLen / kMaxOpsPerBatch, MakeLeaseId(1, 1), 0});
  BatchBody b = MakeBatch(ops);
  auto d = DecodeBatch(b.bytes, b.body_len);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->read_bytes, kMaxDataLen);

  // One write of the full 16 MiB plus reads of the full 16 MiB: each direction at its limit.
  b = MakeBatch({{Opcode::kWrite, kMaxDataLen, 1, 0}, {Opcode::kRead, kMaxDataLen, 1, 0}}, 0,
                /*with_payload=*/false);
  EXPECT_EQ(b.body_len, 8 + 2 * kBatchOpSize + kMaxDataLen);
  EXPECT_LE(b.body_len, kMaxBodyLen);
  EXPECT_TRUE(DecodeBatch(b.bytes, b.body_len).has_value());
}

TEST(WireBatch, RejectsCountZeroAndOverLimit) {
  for (uint32_t count : {0u, kMaxOpsPerBatch + 1, 0xffffffffu}) {
    std::vector<uint8_t> body(8, 0);
    PutU32(body, 0, count);
    body.resize(8 + size_t{kMaxOpsPerBatch + 1} * kBatchOpSize, 0);
    auto d = DecodeBatch(body, static_cast<uint32_t>(body.size()));
    ASSERT_FALSE(d.has_value()) << count;
    EXPECT_EQ(d.error().code(), StatusCode::kInvalidArgument) << count;
    EXPECT_THAT(d.error().message(), HasSubstr("1 to 1024"));
  }
}

TEST(WireBatch, RejectsZeroAndOversizedOpLength) {
  for (uint32_t len : {0u, kMaxDataLen + 1, 0xffffffffu}) {
    for (Opcode op : {Opcode::kRead, Opcode::kWrite}) {
      BatchBody b = MakeBatch({{Opcode::kRead, 8, 1, 0}, {op, len, 1, 0}}, 0, false);
      // The length check comes before the body_len check: pass just the table's size.
      auto d = DecodeBatch(b.bytes, static_cast<uint32_t>(b.bytes.size()));
      ASSERT_FALSE(d.has_value()) << len;
      EXPECT_EQ(d.error().code(), StatusCode::kInvalidArgument) << len;
    }
  }
}

TEST(WireBatch, RejectsOpCodesOtherThanReadAndWrite) {
  for (int code : {0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 0x87, 0xff}) {
    BatchBody b = MakeBatch({{Opcode::kRead, 8, 1, 0}, {Opcode::kRead, 8, 1, 0}});
    b.bytes[8 + kBatchOpSize] = static_cast<uint8_t>(code);
    auto d = DecodeBatch(b.bytes, b.body_len);
    ASSERT_FALSE(d.has_value()) << code;
    EXPECT_EQ(d.error().code(), StatusCode::kInvalidArgument) << code;
  }
}

TEST(WireBatch, RejectsTooManyBytesInOneDirection) {
  BatchBody b = MakeBatch({{Opcode::kWrite, kMaxDataLen, 1, 0}, {Opcode::kWrite, 1, 1, 0}}, 0,
                          /*with_payload=*/false);
  auto d = DecodeBatch(b.bytes, b.body_len);
  ASSERT_FALSE(d.has_value());
  EXPECT_EQ(d.error().code(), StatusCode::kResourceExhausted);
  b = MakeBatch({{Opcode::kRead, kMaxDataLen, 1, 0}, {Opcode::kRead, 1, 1, 0}});
  d = DecodeBatch(b.bytes, b.body_len);
  ASSERT_FALSE(d.has_value());
  EXPECT_EQ(d.error().code(), StatusCode::kResourceExhausted);
  // 1024 maximal reads: the sum is computed in 64 bits and still refused.
  std::vector<BatchOp> ops(kMaxOpsPerBatch, BatchOp{Opcode::kRead, kMaxDataLen, 1, 0});
  b = MakeBatch(ops);
  d = DecodeBatch(b.bytes, b.body_len);
  ASSERT_FALSE(d.has_value());
  EXPECT_EQ(d.error().code(), StatusCode::kResourceExhausted);
}

TEST(WireBatch, RejectsBodyLenInconsistentWithDescriptors) {
  const std::vector<BatchOp> ops = {{Opcode::kWrite, 100, 1, 0}, {Opcode::kRead, 50, 1, 0}};
  BatchBody b = MakeBatch(ops);
  for (uint32_t delta : {1u, 99u, 100u}) {  // payload shorter than the writes
    auto d = DecodeBatch(b.bytes, b.body_len - delta);
    ASSERT_FALSE(d.has_value()) << delta;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError) << delta;
  }
  for (uint32_t delta : {1u, 50u, 1000000u}) {  // more body than the writes account for
    auto d = DecodeBatch(b.bytes, b.body_len + delta);
    ASSERT_FALSE(d.has_value()) << delta;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError) << delta;
    EXPECT_THAT(d.error().message(), HasSubstr("account for"));
  }
}

TEST(WireBatch, RejectsBodyLenShorterThanItsTable) {
  BatchBody b = MakeBatch({{Opcode::kRead, 8, 1, 0}, {Opcode::kRead, 8, 1, 0}});
  for (uint32_t len : {0u, 8u, 8u + kBatchOpSize, 8u + 2 * kBatchOpSize - 1}) {
    auto d = DecodeBatch(b.bytes, len);
    ASSERT_FALSE(d.has_value()) << len;
    EXPECT_EQ(d.error().code(), StatusCode::kProtocolError) << len;
  }
}

TEST(WireBatch, RejectsEveryTruncationOfTheTable) {
  BatchBody b = MakeBatch({{Opcode::kRead, 8, 1, 0}, {Opcode::kWrite, 3, 1, 0}}, 0, false);
  for (size_t n = 0; n < b.bytes.size(); ++n) {
    auto d = DecodeBatch(std::span(b.bytes).first(n), b.body_len);
    EXPECT_FALSE(d.has_value()) << n;
  }
}

TEST(WireBatch, CountIsTheTablesFirstEightBytes) {
  uint8_t out[kBatchCountSize];
  std::memset(out, 0xee, sizeof(out));
  EncodeBatchCount(0x01020304, out);
  const uint8_t want[kBatchCountSize] = {4, 3, 2, 1, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(out, want, sizeof(want)), 0);
  EXPECT_EQ(BatchRequestTableSize(3), 8 + 3 * kBatchOpSize);
  // What a client builds from EncodeBatchCount and EncodeBatchOp is what the daemon decodes.
  std::vector<uint8_t> body(BatchRequestTableSize(2));
  EncodeBatchCount(2, body.data());
  EncodeBatchOp({Opcode::kRead, 7, 9, 11}, body.data() + kBatchCountSize);
  EncodeBatchOp({Opcode::kWrite, 5, 9, 13}, body.data() + kBatchCountSize + kBatchOpSize);
  body.resize(body.size() + 5, 0);
  auto d = DecodeBatch(body, static_cast<uint32_t>(body.size()));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->ops.size(), 2u);
  EXPECT_EQ(d->write_bytes, 5u);
  EXPECT_EQ(d->read_bytes, 7u);
}

TEST(WireBatchReply, TableRoundTripsEveryStatus) {
  const uint16_t codes[] = {0, static_cast<uint16_t>(StatusCode::kNotFound), 0, 0xffff};
  std::vector<uint8_t> table(BatchReplyTableSize(std::size(codes)), 0xee);
  ASSERT_EQ(table.size(), 8 + 4 * std::size(codes));
  EncodeBatchReplyTable(static_cast<uint32_t>(std::size(codes)), table.data());
  for (size_t i = 0; i < std::size(codes); ++i) SetBatchReplyStatus(table.data(), i, codes[i]);
  // The layout of docs/wire-protocol.md: count u32, reserved u32, one u32 status per op.
  Reader r(table);
  EXPECT_EQ(r.U32(), std::size(codes));
  EXPECT_EQ(r.U32(), 0u);
  for (uint16_t c : codes) EXPECT_EQ(r.U32(), c);
  uint16_t got[std::size(codes)] = {};
  ASSERT_TRUE(DecodeBatchReplyTable(table, got).ok());
  for (size_t i = 0; i < std::size(codes); ++i) EXPECT_EQ(got[i], codes[i]) << i;
}

TEST(WireBatchReply, FreshTableSaysEveryOpSucceeded) {
  std::vector<uint8_t> table(BatchReplyTableSize(3), 0xee);
  EncodeBatchReplyTable(3, table.data());
  uint16_t got[3] = {1, 1, 1};
  ASSERT_TRUE(DecodeBatchReplyTable(table, got).ok());
  EXPECT_EQ(got[0] | got[1] | got[2], 0);
}

TEST(WireBatchReply, StatusIsTheLowSixteenBits) {
  std::vector<uint8_t> table(BatchReplyTableSize(1));
  EncodeBatchReplyTable(1, table.data());
  const uint32_t raw = 0xabcd0005;
  std::memcpy(table.data() + 8, &raw, 4);
  uint16_t got[1] = {};
  ASSERT_TRUE(DecodeBatchReplyTable(table, got).ok());
  EXPECT_EQ(got[0], 5);
}

TEST(WireBatchReply, RejectsACountOtherThanTheRequests) {
  std::vector<uint8_t> table(BatchReplyTableSize(2));
  EncodeBatchReplyTable(2, table.data());
  uint16_t three[3] = {};
  // A table sized for three ops but counting two.
  std::vector<uint8_t> longer(BatchReplyTableSize(3));
  EncodeBatchReplyTable(2, longer.data());
  Status s = DecodeBatchReplyTable(longer, three);
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
  // A table of the wrong size for the request.
  s = DecodeBatchReplyTable(table, three);
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
  uint16_t one[1] = {};
  s = DecodeBatchReplyTable(table, one);
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
}

// ---------------------------------------------------------------- errors

TEST(WireError, RoundTripsCodeAndMessage) {
  const Status s = Expired("lease 0x1a2b00000003 is not held");
  std::vector<uint8_t> body;
  EncodeError(s, &body);
  const Status d = DecodeError(static_cast<uint16_t>(s.code()), body);
  EXPECT_EQ(d.code(), StatusCode::kExpired);
  EXPECT_EQ(d.message(), s.message());
}

TEST(WireError, TruncatesLongMessagesAndSanitizesBytes) {
  std::vector<uint8_t> body;
  EncodeError(Internal(std::string(5000, 'z')), &body);
  EXPECT_EQ(body.size(), kMaxErrorMessage);
  std::vector<uint8_t> longer(3000, 'q');
  EXPECT_EQ(DecodeError(1, longer).message().size(), kMaxErrorMessage);
  const std::vector<uint8_t> evil = {'o', 'k', '\n', 0, 0x1b, 0xff, '!'};
  EXPECT_EQ(DecodeError(1, evil).message(), "ok" + std::string(4, '?') + "!");
}

TEST(WireError, UntrustedCodesBecomeInternal) {
  EXPECT_EQ(DecodeError(0, {}).code(), StatusCode::kInternal);  // "error" with status OK
  EXPECT_EQ(DecodeError(17, {}).code(), StatusCode::kInternal);
  EXPECT_EQ(DecodeError(0xffff, {}).code(), StatusCode::kInternal);
  EXPECT_EQ(DecodeError(16, {}).code(), StatusCode::kRemoteAccessError);
  EXPECT_FALSE(DecodeError(0, {}).ok());
}

// ---------------------------------------------------------------- ranges and lease ids

TEST(WireRangeFits, InsideAndAtTheEdges) {
  EXPECT_TRUE(RangeFits(0, 0, 0));
  EXPECT_FALSE(RangeFits(0, 1, 0));
  EXPECT_FALSE(RangeFits(1, 0, 0));
  EXPECT_TRUE(RangeFits(0, 4096, 4096));
  EXPECT_TRUE(RangeFits(4095, 1, 4096));
  EXPECT_TRUE(RangeFits(4096, 0, 4096));
  EXPECT_FALSE(RangeFits(4095, 2, 4096));
  EXPECT_FALSE(RangeFits(4096, 1, 4096));
  EXPECT_FALSE(RangeFits(4097, 0, 4096));
}

TEST(WireRangeFits, NeverOverflows64Bits) {
  constexpr uint64_t kSlab = 64ull << 20;
  // offset + length wraps around to something small: must not look like it fits.
  EXPECT_FALSE(RangeFits(kU64Max, 1, kSlab));
  EXPECT_FALSE(RangeFits(kU64Max - 15, 32, kSlab));
  EXPECT_FALSE(RangeFits(1, kU64Max, kSlab));
  EXPECT_FALSE(RangeFits(kU64Max, kU64Max, kSlab));
  EXPECT_FALSE(RangeFits(1ull << 63, 1ull << 63, kSlab));
  // With a limit at the very top of the range.
  EXPECT_TRUE(RangeFits(0, kU64Max, kU64Max));
  EXPECT_TRUE(RangeFits(kU64Max, 0, kU64Max));
  EXPECT_TRUE(RangeFits(kU64Max - 1, 1, kU64Max));
  EXPECT_FALSE(RangeFits(kU64Max, 1, kU64Max));
  EXPECT_FALSE(RangeFits(1, kU64Max, kU64Max));
  EXPECT_TRUE(RangeFits(1ull << 63, (1ull << 63) - 1, kU64Max));
  EXPECT_FALSE(RangeFits(1ull << 63, 1ull << 63, kU64Max));
  EXPECT_FALSE(RangeFits(1ull << 63, 1ull << 63, kU64Max - 1));
}

TEST(WireLeaseId, PacksEpochAndSlab) {
  const uint64_t id = MakeLeaseId(0xdeadbeef, 0x12345678);
  EXPECT_EQ(id, 0xdeadbeef12345678ull);
  EXPECT_EQ(LeaseEpoch(id), 0xdeadbeefu);
  EXPECT_EQ(LeaseSlab(id), 0x12345678u);
  EXPECT_EQ(LeaseSlab(MakeLeaseId(1, 0)), 0u);
  EXPECT_EQ(LeaseEpoch(MakeLeaseId(0xffffffff, 0xffffffff)), 0xffffffffu);
  EXPECT_EQ(MakeLeaseId(0xffffffff, 0xffffffff), kU64Max);
}

// ---- compaction offload requests ----

ParityEncodeRequest SampleParity() {
  ParityEncodeRequest m;
  m.lease_id = MakeLeaseId(7, 3);
  m.offset = 1 << 16;
  m.length = 4096;
  m.k = 3;
  m.r = 2;
  m.parity_index = 1;
  m.timeout_ms = 2500;
  m.sources = {{"10.0.0.1", 7411, 11, 0}, {"fe80::1%eth0", 7412, 12, 4096}, {"node-c", 9, 13, 8}};
  return m;
}

TEST(WireParityEncode, RoundTrips) {
  const ParityEncodeRequest m = SampleParity();
  std::vector<uint8_t> b;
  EncodeParityEncode(m, &b);
  EXPECT_EQ(b.size(), kParityEncodeFixedSize + 3 * 24 + 8 + 12 + 6);
  auto d = DecodeParityEncode(b);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->lease_id, m.lease_id);
  EXPECT_EQ(d->offset, m.offset);
  EXPECT_EQ(d->length, m.length);
  EXPECT_EQ(d->k, 3);
  EXPECT_EQ(d->r, 2);
  EXPECT_EQ(d->parity_index, 1);
  EXPECT_EQ(d->timeout_ms, 2500u);
  ASSERT_EQ(d->sources.size(), 3u);
  EXPECT_EQ(d->sources[1].host, "fe80::1%eth0");
  EXPECT_EQ(d->sources[1].port, 7412);
  EXPECT_EQ(d->sources[1].lease_id, 12u);
  EXPECT_EQ(d->sources[2].offset, 8u);
}

TEST(WireParityEncode, RefusesWhatADaemonMustNotActOn) {
  auto code = [](ParityEncodeRequest m) {
    std::vector<uint8_t> b;
    EncodeParityEncode(m, &b);
    auto d = DecodeParityEncode(b);
    return d.has_value() ? StatusCode::kOk : d.error().code();
  };
  ParityEncodeRequest m = SampleParity();
  m.sources.pop_back();  // k says 3
  EXPECT_EQ(code(m), StatusCode::kProtocolError);
  m = SampleParity();
  m.sources[0].host = "a/b";
  EXPECT_EQ(code(m), StatusCode::kInvalidArgument);
  m = SampleParity();
  m.sources[0].host = "";
  EXPECT_EQ(code(m), StatusCode::kInvalidArgument);
  m = SampleParity();
  m.sources[2].offset = kU64Max - 10;  // offset + length overflows
  EXPECT_EQ(code(m), StatusCode::kInvalidArgument);
  m = SampleParity();
  m.parity_index = 2;
  EXPECT_EQ(code(m), StatusCode::kInvalidArgument);
  m = SampleParity();
  m.k = 31;  // k + r = 33
  EXPECT_EQ(code(m), StatusCode::kInvalidArgument);
}

TEST(WireGatherCell, RoundTripsAndChecksEveryCopy) {
  GatherCellRequest m;
  m.lease_id = 5;
  m.offset = 0;
  m.length = 1000;
  m.timeout_ms = 10;
  m.sources = {{"h1", 1, 2, 3}, {"h2", 4, 5, 6}};
  m.copies = {{1, 0, 999, 1}, {0, 500, 0, 500}};
  std::vector<uint8_t> b;
  EncodeGatherCell(m, &b);
  EXPECT_EQ(b.size(), kGatherFixedSize + 2 * 26 + 2 * kGatherCopySize);
  auto d = DecodeGatherCell(b);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  ASSERT_EQ(d->copies.size(), 2u);
  EXPECT_EQ(d->copies[0].source, 1);
  EXPECT_EQ(d->copies[0].dst_offset, 999u);
  EXPECT_EQ(d->copies[1].src_offset, 500u);
  EXPECT_EQ(d->sources[1].host, "h2");

  for (GatherCopy bad : {GatherCopy{2, 0, 0, 1}, GatherCopy{0, 0, 0, 0}, GatherCopy{0, 1, 0, 1000},
                         GatherCopy{0, 0, 0xffffffff, 2}}) {
    GatherCellRequest x = m;
    x.copies.push_back(bad);
    b.clear();
    EncodeGatherCell(x, &b);
    auto e = DecodeGatherCell(b);
    ASSERT_FALSE(e.has_value());
    EXPECT_EQ(e.error().code(), StatusCode::kInvalidArgument) << e.error().ToString();
  }
  GatherCellRequest big = m;
  big.length = 2 << 20;  // 17 sources of 2 MiB exceed 32 MiB
  big.sources.assign(17, m.sources[0]);
  big.copies.clear();
  b.clear();
  EncodeGatherCell(big, &b);
  EXPECT_EQ(DecodeGatherCell(b).error().code(), StatusCode::kInvalidArgument);
  // A copy count the body cannot hold is refused before anything is allocated.
  b.clear();
  EncodeGatherCell(m, &b);
  const uint32_t lie = 0xfffffff0;
  std::memcpy(&b[28], &lie, 4);
  EXPECT_EQ(DecodeGatherCell(b).error().code(), StatusCode::kProtocolError);
}

}  // namespace
}  // namespace farmem::wire

namespace farmem::wire {
namespace {

TEST(WireHello, IdentityTrailerRoundTripsAndIsOptional) {
  HelloRequest m;
  m.client_name = "n";
  m.identity = "alice";
  std::vector<uint8_t> b;
  EncodeHello(m, &b);
  auto d = DecodeHello(b);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->identity, "alice");
  EXPECT_EQ(d->client_name, "n");
  m.identity.clear();
  std::vector<uint8_t> plain;
  EncodeHello(m, &plain);
  EXPECT_EQ(plain.size() + 6, b.size());
  auto p = DecodeHello(plain);
  ASSERT_TRUE(p.has_value());
  EXPECT_TRUE(p->identity.empty());
  // A trailer of length 0, or one whose length disagrees with what follows, is malformed.
  std::vector<uint8_t> zero = plain;
  zero.push_back(0);
  EXPECT_FALSE(DecodeHello(zero).has_value());
  std::vector<uint8_t> cut(b.begin(), b.end() - 1);
  EXPECT_FALSE(DecodeHello(cut).has_value());
  std::vector<uint8_t> longer = b;
  longer.push_back('x');
  EXPECT_FALSE(DecodeHello(longer).has_value());
}

}  // namespace
}  // namespace farmem::wire
