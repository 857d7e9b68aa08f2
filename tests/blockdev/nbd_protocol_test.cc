// Unit tests of the pure NBD protocol layer: option negotiation and request validation, driven
// byte by byte exactly as a socket would drive them.
#include "farmem/blockdev/nbd_protocol.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "nbd_test_client.h"

namespace farmem::blockdev::nbd {
namespace {

using testing::GoData;
using testing::OptionBytes;

ExportInfo TestExport() {
  ExportInfo info;
  info.name = "disk";
  info.description = "a test disk";
  info.size = 1u << 20;
  info.can_flush = info.can_fua = info.can_trim = info.can_write_zeroes = true;
  info.can_multi_conn = true;
  return info;
}

std::vector<uint8_t> Be32(uint32_t v) {
  std::vector<uint8_t> b(4);
  StoreBe32(b.data(), v);
  return b;
}

struct ParsedReply {
  uint32_t option;
  uint32_t type;
  std::vector<uint8_t> data;
};

// Splits option-reply bytes into replies; fails the test on malformed output.
std::vector<ParsedReply> ParseReplies(const std::vector<uint8_t>& out) {
  std::vector<ParsedReply> replies;
  size_t pos = 0;
  while (pos < out.size()) {
    EXPECT_GE(out.size() - pos, kOptionReplyHeaderSize);
    if (out.size() - pos < kOptionReplyHeaderSize) break;
    EXPECT_EQ(LoadBe64(&out[pos]), kOptionReplyMagic);
    ParsedReply r;
    r.option = LoadBe32(&out[pos + 8]);
    r.type = LoadBe32(&out[pos + 12]);
    const uint32_t len = LoadBe32(&out[pos + 16]);
    pos += kOptionReplyHeaderSize;
    EXPECT_LE(len, out.size() - pos);
    if (len > out.size() - pos) break;
    r.data.assign(out.begin() + pos, out.begin() + pos + len);
    pos += len;
    replies.push_back(std::move(r));
  }
  return replies;
}

// Feeds `bytes` the way NbdConnection does (exactly bytes_wanted() at a time) and collects output.
class Negotiation {
 public:
  explicit Negotiation(uint32_t client_flags = kClientFlagFixedNewstyle | kClientFlagNoZeroes)
      : info_(TestExport()), neg_(&info_) {
    Feed(Be32(client_flags));
  }
  std::vector<uint8_t> Feed(const std::vector<uint8_t>& bytes) {
    std::vector<uint8_t> out;
    size_t pos = 0;
    while (pos < bytes.size() && neg_.bytes_wanted() > 0) {
      const size_t n = neg_.bytes_wanted();
      if (bytes.size() - pos < n) {
        ADD_FAILURE() << "negotiator wants " << n << " bytes, only " << bytes.size() - pos;
        break;
      }
      neg_.Feed(std::span<const uint8_t>(bytes.data() + pos, n), &out);
      pos += n;
    }
    return out;
  }
  std::vector<ParsedReply> Option(uint32_t option, const std::vector<uint8_t>& data = {}) {
    return ParseReplies(Feed(OptionBytes(option, data)));
  }
  OptionNegotiator& neg() { return neg_; }
  ExportInfo& info() { return info_; }

 private:
  ExportInfo info_;
  OptionNegotiator neg_;
};

TEST(NbdGreeting, IsFixedNewstyleWithNoZeroes) {
  std::vector<uint8_t> out;
  OptionNegotiator::Greeting(&out);
  ASSERT_EQ(out.size(), 18u);
  EXPECT_EQ(LoadBe64(out.data()), kNbdMagic);
  EXPECT_EQ(LoadBe64(out.data() + 8), kOptionMagic);
  EXPECT_EQ(LoadBe16(out.data() + 16), kFlagFixedNewstyle | kFlagNoZeroes);
}

TEST(NbdNegotiation, UnknownClientFlagsCloseTheConnection) {
  Negotiation n(kClientFlagFixedNewstyle | 0x4);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kClosed);
}

TEST(NbdNegotiation, GoSendsExportBlockSizeNameDescriptionThenAck) {
  Negotiation n;
  const uint16_t infos[] = {kInfoName, kInfoDescription, kInfoBlockSize, 0x7777 /* unknown */};
  auto replies = n.Option(kOptGo, GoData("disk", infos));
  ASSERT_EQ(replies.size(), 5u);
  bool saw_export = false, saw_block = false, saw_name = false, saw_desc = false;
  for (size_t i = 0; i + 1 < replies.size(); ++i) {
    const auto& r = replies[i];
    EXPECT_EQ(r.option, kOptGo);
    ASSERT_EQ(r.type, kRepInfo);
    ASSERT_GE(r.data.size(), 2u);
    switch (LoadBe16(r.data.data())) {
      case kInfoExport:
        ASSERT_EQ(r.data.size(), 12u);
        EXPECT_EQ(LoadBe64(r.data.data() + 2), 1u << 20);
        EXPECT_EQ(LoadBe16(r.data.data() + 10), kTxHasFlags | kTxSendFlush | kTxSendFua |
                                                    kTxSendTrim | kTxSendWriteZeroes |
                                                    kTxCanMultiConn);
        saw_export = true;
        break;
      case kInfoBlockSize:
        ASSERT_EQ(r.data.size(), 14u);
        EXPECT_EQ(LoadBe32(r.data.data() + 2), 512u);
        EXPECT_EQ(LoadBe32(r.data.data() + 6), 4096u);
        EXPECT_EQ(LoadBe32(r.data.data() + 10), 32u << 20);
        saw_block = true;
        break;
      case kInfoName:
        EXPECT_EQ(std::string(r.data.begin() + 2, r.data.end()), "disk");
        saw_name = true;
        break;
      case kInfoDescription:
        EXPECT_EQ(std::string(r.data.begin() + 2, r.data.end()), "a test disk");
        saw_desc = true;
        break;
      default:
        ADD_FAILURE() << "unexpected info type";
    }
  }
  EXPECT_TRUE(saw_export && saw_block && saw_name && saw_desc);
  EXPECT_EQ(replies.back().type, kRepAck);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kTransmission);
  EXPECT_FALSE(n.neg().structured_replies());
}

TEST(NbdNegotiation, InfoDoesNotEnterTransmissionAndGoWithDefaultNameDoes) {
  Negotiation n;
  auto replies = n.Option(kOptInfo, GoData("", {}));
  ASSERT_FALSE(replies.empty());
  EXPECT_EQ(replies.back().type, kRepAck);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kOptionHeader);
  replies = n.Option(kOptGo, GoData("", {}));
  EXPECT_EQ(replies.back().type, kRepAck);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kTransmission);
}

TEST(NbdNegotiation, StructuredReplyAddsDfFlag) {
  Negotiation n;
  auto replies = n.Option(kOptStructuredReply);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].type, kRepAck);
  n.Option(kOptGo, GoData("", {}));
  ASSERT_EQ(n.neg().state(), OptionNegotiator::State::kTransmission);
  EXPECT_TRUE(n.neg().structured_replies());
  EXPECT_TRUE(n.neg().transmission_flags() & kTxSendDf);
}

TEST(NbdNegotiation, StructuredReplyWithDataIsInvalid) {
  Negotiation n;
  auto replies = n.Option(kOptStructuredReply, {1, 2, 3});
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].type, kRepErrInvalid);
  EXPECT_FALSE(n.neg().structured_replies());
}

TEST(NbdNegotiation, UnknownExportIsErrUnknownAndNegotiationGoesOn) {
  Negotiation n;
  auto replies = n.Option(kOptGo, GoData("nope", {}));
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].type, kRepErrUnknown);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kOptionHeader);
}

TEST(NbdNegotiation, MalformedGoIsInvalid) {
  Negotiation n;
  // Name length larger than the option.
  std::vector<uint8_t> d = GoData("disk", {});
  StoreBe32(d.data(), 1000);
  EXPECT_EQ(n.Option(kOptGo, d).at(0).type, kRepErrInvalid);
  // Name length 0xffffffff (would wrap 32-bit arithmetic).
  StoreBe32(d.data(), 0xffffffffu);
  EXPECT_EQ(n.Option(kOptGo, d).at(0).type, kRepErrInvalid);
  // Info count larger than the data.
  d = GoData("disk", {});
  StoreBe16(d.data() + 8, 3);
  EXPECT_EQ(n.Option(kOptGo, d).at(0).type, kRepErrInvalid);
  // Trailing garbage.
  d = GoData("disk", {});
  d.push_back(0);
  EXPECT_EQ(n.Option(kOptGo, d).at(0).type, kRepErrInvalid);
  // Too short to hold the fixed fields.
  EXPECT_EQ(n.Option(kOptGo, {0, 0, 0}).at(0).type, kRepErrInvalid);
  EXPECT_EQ(n.Option(kOptGo).at(0).type, kRepErrInvalid);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kOptionHeader);
}

TEST(NbdNegotiation, NameLongerThan4096IsTooBig) {
  Negotiation n;
  const std::string name(5000, 'x');
  EXPECT_EQ(n.Option(kOptGo, GoData(name, {})).at(0).type, kRepErrTooBig);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kOptionHeader);
}

TEST(NbdNegotiation, OversizedOptionIsSkippedAndAnsweredTooBig) {
  Negotiation n;
  const std::vector<uint8_t> big(kMaxOptionLen + 100, 0xab);
  auto replies = n.Option(kOptGo, big);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].type, kRepErrTooBig);
  EXPECT_EQ(replies[0].option, kOptGo);
  // The stream is still in sync: a good GO works.
  EXPECT_EQ(n.Option(kOptGo, GoData("", {})).back().type, kRepAck);
}

TEST(NbdNegotiation, AbsurdOptionLengthCloses) {
  Negotiation n;
  std::vector<uint8_t> header = OptionBytes(kOptGo, {});
  StoreBe32(header.data() + 12, 0xffffffffu);
  n.Feed(header);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kClosed);
}

TEST(NbdNegotiation, UnknownOptionsAreUnsupportedAndTheNextOptionIsRead) {
  Negotiation n;
  for (uint32_t opt : {kOptStartTls, kOptListMetaContext, kOptSetMetaContext, kOptExtendedHeaders,
                       uint32_t{4}, uint32_t{99}, uint32_t{0xdeadbeef}}) {
    auto replies = n.Option(opt, {1, 2, 3, 4});
    ASSERT_EQ(replies.size(), 1u) << opt;
    EXPECT_EQ(replies[0].type, kRepErrUnsup) << opt;
    EXPECT_EQ(replies[0].option, opt);
  }
  EXPECT_EQ(n.Option(kOptGo, GoData("", {})).back().type, kRepAck);
}

TEST(NbdNegotiation, ListNamesTheExport) {
  Negotiation n;
  auto replies = n.Option(kOptList);
  ASSERT_EQ(replies.size(), 2u);
  EXPECT_EQ(replies[0].type, kRepServer);
  ASSERT_GE(replies[0].data.size(), 4u);
  const uint32_t len = LoadBe32(replies[0].data.data());
  EXPECT_EQ(len, 4u);
  EXPECT_EQ(std::string(replies[0].data.begin() + 4, replies[0].data.begin() + 4 + len), "disk");
  EXPECT_EQ(replies[1].type, kRepAck);
  EXPECT_EQ(n.Option(kOptList, {0}).at(0).type, kRepErrInvalid);
}

TEST(NbdNegotiation, AbortIsAcknowledgedThenClosed) {
  Negotiation n;
  auto replies = n.Option(kOptAbort);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].type, kRepAck);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kClosed);
}

TEST(NbdNegotiation, BadOptionMagicCloses) {
  Negotiation n;
  std::vector<uint8_t> bytes = OptionBytes(kOptList, {});
  bytes[0] ^= 0xff;
  n.Feed(bytes);
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kClosed);
}

TEST(NbdNegotiation, ExportNameWithAndWithoutZeroes) {
  {
    Negotiation n;
    const std::vector<uint8_t> out = n.Feed(OptionBytes(kOptExportName, {}));
    ASSERT_EQ(out.size(), 10u);
    EXPECT_EQ(LoadBe64(out.data()), 1u << 20);
    EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kTransmission);
  }
  {
    Negotiation n(kClientFlagFixedNewstyle);
    const std::string name = "disk";
    const std::vector<uint8_t> out = n.Feed(
        OptionBytes(kOptExportName, {reinterpret_cast<const uint8_t*>(name.data()), name.size()}));
    ASSERT_EQ(out.size(), 10u + 124u);
    for (size_t i = 10; i < out.size(); ++i) EXPECT_EQ(out[i], 0);
  }
}

TEST(NbdNegotiation, ExportNameForUnknownExportCloses) {
  Negotiation n;
  const std::string name = "other";
  n.Feed(OptionBytes(kOptExportName, {reinterpret_cast<const uint8_t*>(name.data()), name.size()}));
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kClosed);
}

TEST(NbdNegotiation, NonFixedNewstyleClientMayOnlySendExportName) {
  Negotiation bad(0);
  bad.Feed(OptionBytes(kOptGo, GoData("", {})));
  EXPECT_EQ(bad.neg().state(), OptionNegotiator::State::kClosed);
  Negotiation good(0);
  EXPECT_EQ(good.Feed(OptionBytes(kOptExportName, {})).size(), 134u);
  EXPECT_EQ(good.neg().state(), OptionNegotiator::State::kTransmission);
}

TEST(NbdNegotiation, EndlessOptionsAreCutOff) {
  Negotiation n;
  for (uint32_t i = 0; i < kMaxOptionsPerConnection + 1; ++i) n.Feed(OptionBytes(kOptList, {}));
  EXPECT_EQ(n.neg().state(), OptionNegotiator::State::kClosed);
}

// ---- requests ----

Session TestSession(bool structured = true) {
  ExportInfo info = TestExport();
  return Session{info.size, TransmissionFlags(info, structured), structured};
}

Request Req(uint16_t type, uint64_t offset, uint32_t length, uint16_t flags = 0) {
  return Request{flags, type, 7, offset, length};
}

TEST(NbdRequestCheck, AcceptsWellFormedRequests) {
  const Session s = TestSession();
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, 4096), s).error, 0u);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, 4096, kCmdFlagDf), s).error, 0u);
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, (1u << 20) - 512, 512, kCmdFlagFua), s).error, 0u);
  EXPECT_EQ(CheckRequest(Req(kCmdFlush, 0, 0), s).error, 0u);
  EXPECT_EQ(CheckRequest(Req(kCmdTrim, 0, 1u << 20), s).error, 0u);
  EXPECT_EQ(CheckRequest(Req(kCmdWriteZeroes, 512, 512, kCmdFlagNoHole | kCmdFlagFua), s).error,
            0u);
  EXPECT_TRUE(CheckRequest(Req(kCmdDisc, 0, 0), s).disconnect);
}

TEST(NbdRequestCheck, OutOfRangeIsEinvalForReadsAndEnospcForWrites) {
  const Session s = TestSession();
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 1u << 20, 512), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, 1u << 20, 512), s).error, kEnospc);
  EXPECT_EQ(CheckRequest(Req(kCmdTrim, (1u << 20) - 512, 1024), s).error, kEnospc);
  EXPECT_EQ(CheckRequest(Req(kCmdWriteZeroes, 1u << 30, 512), s).error, kEnospc);
}

TEST(NbdRequestCheck, OffsetPlusLengthOverflowIsCaught) {
  const Session s = TestSession();
  const uint64_t huge = std::numeric_limits<uint64_t>::max() - 511;  // aligned, offset+len wraps
  EXPECT_EQ(CheckRequest(Req(kCmdRead, huge, 1024), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, huge, 1024), s).error, kEnospc);
  EXPECT_EQ(CheckRequest(Req(kCmdTrim, huge, 0xfffffe00u), s).error, kEnospc);
}

TEST(NbdRequestCheck, UnknownCommandsAndFlagsAreEinval) {
  const Session s = TestSession();
  for (uint16_t t : {kCmdCache, kCmdBlockStatus, uint16_t{8}, uint16_t{0xffff}}) {
    EXPECT_EQ(CheckRequest(Req(t, 0, 512), s).error, kEinval) << t;
  }
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, 512, kCmdFlagNoHole), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, 0, 512, kCmdFlagDf), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWriteZeroes, 0, 512, kCmdFlagFastZero), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, 512, 0x8000), s).error, kEinval);
}

TEST(NbdRequestCheck, FlagsMustHaveBeenAdvertised) {
  Session s = TestSession(/*structured=*/false);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, 512, kCmdFlagDf), s).error, kEinval);
  s.transmission_flags = kTxHasFlags;  // nothing advertised
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, 0, 512, kCmdFlagFua), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdFlush, 0, 0), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdTrim, 0, 512), s).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWriteZeroes, 0, 512), s).error, kEinval);
}

TEST(NbdRequestCheck, LengthsAndAlignment) {
  const Session structured = TestSession(true);
  const Session simple = TestSession(false);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, 0), structured).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 1, 512), structured).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, 0, 100), structured).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdWrite, 0, kMaxPayload + 512), structured).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, kMaxPayload + 512), structured).error, kEoverflow);
  EXPECT_EQ(CheckRequest(Req(kCmdRead, 0, kMaxPayload + 512), simple).error, kEinval);
  EXPECT_EQ(CheckRequest(Req(kCmdFlush, 512, 0), structured).error, kEinval);
  // Trim and zero have no payload: any length up to the export is fine.
  Session big = structured;
  big.export_size = 1ull << 40;
  EXPECT_EQ(CheckRequest(Req(kCmdTrim, 0, 0xfffffe00u), big).error, 0u);
  EXPECT_EQ(CheckRequest(Req(kCmdWriteZeroes, 0, 0xfffffe00u), big).error, 0u);
}

TEST(NbdFraming, SplitsTheStream) {
  std::vector<uint8_t> bytes = testing::RequestBytes(kCmdWrite, 0, 1, 0, 512);
  EXPECT_EQ(NextFrame({bytes.data(), 27}).kind, Framing::kNeedMore);
  Framing f = NextFrame(bytes);
  ASSERT_EQ(f.kind, Framing::kRequest);
  EXPECT_EQ(f.payload, 512u);
  EXPECT_EQ(f.request.handle, 1u);
  bytes[3] ^= 1;
  EXPECT_EQ(NextFrame(bytes).kind, Framing::kBadMagic);
  EXPECT_EQ(NextFrame(testing::RequestBytes(kCmdRead, 0, 1, 0, 512)).payload, 0u);
}

TEST(NbdReplies, EncodingsMatchTheSpec) {
  uint8_t simple[kSimpleReplySize];
  EncodeSimpleReply(simple, kEnospc, 0x0102030405060708ull);
  EXPECT_EQ(LoadBe32(simple), kSimpleReplyMagic);
  EXPECT_EQ(LoadBe32(simple + 4), kEnospc);
  EXPECT_EQ(LoadBe64(simple + 8), 0x0102030405060708ull);

  uint8_t data[kOffsetDataHeaderSize];
  EncodeOffsetDataHeader(data, 9, 4096, 512);
  EXPECT_EQ(LoadBe32(data), kStructuredReplyMagic);
  EXPECT_EQ(LoadBe16(data + 4), kReplyFlagDone);
  EXPECT_EQ(LoadBe16(data + 6), kReplyTypeOffsetData);
  EXPECT_EQ(LoadBe64(data + 8), 9u);
  EXPECT_EQ(LoadBe32(data + 16), 8u + 512u);
  EXPECT_EQ(LoadBe64(data + 20), 4096u);

  uint8_t err[kErrorChunkFixedSize];
  EncodeErrorChunkHeader(err, 9, kEio, 5);
  EXPECT_EQ(LoadBe16(err + 6), kReplyTypeError);
  EXPECT_EQ(LoadBe32(err + 16), 6u + 5u);
  EXPECT_EQ(LoadBe32(err + 20), kEio);
  EXPECT_EQ(LoadBe16(err + 24), 5u);
  EXPECT_EQ(ErrorMessageLength(std::string(1000, 'x')), kMaxErrorMessage);
}

}  // namespace
}  // namespace farmem::blockdev::nbd
