// Pure NBD parsing, validation and encoding. See nbd_protocol.h and docs/nbd.md.
#include "farmem/blockdev/nbd_protocol.h"

#include <algorithm>
#include <array>

namespace farmem::blockdev::nbd {

const char* OptionName(uint32_t option) {
  switch (option) {
    case kOptExportName:
      return "NBD_OPT_EXPORT_NAME";
    case kOptAbort:
      return "NBD_OPT_ABORT";
    case kOptList:
      return "NBD_OPT_LIST";
    case kOptStartTls:
      return "NBD_OPT_STARTTLS";
    case kOptInfo:
      return "NBD_OPT_INFO";
    case kOptGo:
      return "NBD_OPT_GO";
    case kOptStructuredReply:
      return "NBD_OPT_STRUCTURED_REPLY";
    case kOptListMetaContext:
      return "NBD_OPT_LIST_META_CONTEXT";
    case kOptSetMetaContext:
      return "NBD_OPT_SET_META_CONTEXT";
    case kOptExtendedHeaders:
      return "NBD_OPT_EXTENDED_HEADERS";
  }
  return "unknown option";
}

const char* CommandName(uint16_t type) {
  switch (type) {
    case kCmdRead:
      return "NBD_CMD_READ";
    case kCmdWrite:
      return "NBD_CMD_WRITE";
    case kCmdDisc:
      return "NBD_CMD_DISC";
    case kCmdFlush:
      return "NBD_CMD_FLUSH";
    case kCmdTrim:
      return "NBD_CMD_TRIM";
    case kCmdCache:
      return "NBD_CMD_CACHE";
    case kCmdWriteZeroes:
      return "NBD_CMD_WRITE_ZEROES";
    case kCmdBlockStatus:
      return "NBD_CMD_BLOCK_STATUS";
  }
  return "unknown command";
}

uint16_t TransmissionFlags(const ExportInfo& info, bool structured_replies) {
  uint16_t f = kTxHasFlags;
  if (info.can_flush) f |= kTxSendFlush;
  if (info.can_fua) f |= kTxSendFua;
  if (info.can_trim) f |= kTxSendTrim;
  if (info.can_write_zeroes) f |= kTxSendWriteZeroes;
  if (info.can_multi_conn) f |= kTxCanMultiConn;
  // Every READ is answered with a single content chunk, so DF is always honoured.
  if (structured_replies) f |= kTxSendDf;
  return f;
}

// ============================== handshake ==============================

namespace {

void Append(std::vector<uint8_t>* out, std::span<const uint8_t> bytes) {
  out->insert(out->end(), bytes.begin(), bytes.end());
}
void AppendBe16(std::vector<uint8_t>* out, uint16_t v) {
  uint8_t b[2];
  StoreBe16(b, v);
  Append(out, b);
}
void AppendBe32(std::vector<uint8_t>* out, uint32_t v) {
  uint8_t b[4];
  StoreBe32(b, v);
  Append(out, b);
}
void AppendBe64(std::vector<uint8_t>* out, uint64_t v) {
  uint8_t b[8];
  StoreBe64(b, v);
  Append(out, b);
}
std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

void AppendOptionReply(std::vector<uint8_t>* out, uint32_t option, uint32_t type,
                       std::span<const uint8_t> data) {
  AppendBe64(out, kOptionReplyMagic);
  AppendBe32(out, option);
  AppendBe32(out, type);
  AppendBe32(out, static_cast<uint32_t>(data.size()));
  Append(out, data);
}

void OptionNegotiator::Greeting(std::vector<uint8_t>* out) {
  AppendBe64(out, kNbdMagic);
  AppendBe64(out, kOptionMagic);
  AppendBe16(out, kFlagFixedNewstyle | kFlagNoZeroes);
}

size_t OptionNegotiator::bytes_wanted() const {
  switch (state_) {
    case State::kClientFlags:
      return 4;
    case State::kOptionHeader:
      return kOptionHeaderSize;
    case State::kOptionData:
      return option_len_;
    case State::kSkipOptionData:
      return std::min<uint32_t>(skip_left_, 64u << 10);
    case State::kTransmission:
    case State::kClosed:
      return 0;
  }
  return 0;
}

void OptionNegotiator::Feed(std::span<const uint8_t> bytes, std::vector<uint8_t>* out) {
  if (bytes.size() != bytes_wanted() || bytes.empty()) {
    Close("internal: fed the wrong number of bytes");
    return;
  }
  switch (state_) {
    case State::kClientFlags:
      OnClientFlags(bytes);
      return;
    case State::kOptionHeader:
      OnOptionHeader(bytes, out);
      return;
    case State::kOptionData:
      state_ = State::kOptionHeader;
      OnOption(bytes, out);
      return;
    case State::kSkipOptionData:
      skip_left_ -= static_cast<uint32_t>(bytes.size());
      if (skip_left_ == 0) {
        state_ = State::kOptionHeader;
        ReplyError(out, kRepErrTooBig, "option data too long");
      }
      return;
    case State::kTransmission:
    case State::kClosed:
      return;
  }
}

void OptionNegotiator::Close(const char* reason) {
  state_ = State::kClosed;
  close_reason_ = reason;
}

void OptionNegotiator::OnClientFlags(std::span<const uint8_t> bytes) {
  client_flags_ = LoadBe32(bytes.data());
  // proto.md: the server MUST drop the connection on unknown client flags.
  if ((client_flags_ & ~(kClientFlagFixedNewstyle | kClientFlagNoZeroes)) != 0) {
    Close("client sent unknown handshake flags");
    return;
  }
  state_ = State::kOptionHeader;
}

void OptionNegotiator::OnOptionHeader(std::span<const uint8_t> bytes, std::vector<uint8_t>* out) {
  if (LoadBe64(bytes.data()) != kOptionMagic) {
    Close("bad option magic");
    return;
  }
  option_ = LoadBe32(bytes.data() + 8);
  option_len_ = LoadBe32(bytes.data() + 12);
  if (++options_seen_ > kMaxOptionsPerConnection) {
    Close("too many options");
    return;
  }
  const bool fixed = (client_flags_ & kClientFlagFixedNewstyle) != 0;
  if (!fixed && option_ != kOptExportName) {
    // A plain-newstyle client cannot parse option replies; nothing but EXPORT_NAME is valid.
    Close("option other than NBD_OPT_EXPORT_NAME from a non-fixed-newstyle client");
    return;
  }
  if (option_len_ > kMaxOptionLen) {
    if (option_ == kOptExportName) {
      Close("NBD_OPT_EXPORT_NAME too long");  // EXPORT_NAME cannot be answered with an error
    } else if (option_len_ > kMaxSkippedOptionLen) {
      Close("option data absurdly long");
    } else {
      skip_left_ = option_len_;
      state_ = State::kSkipOptionData;
    }
    return;
  }
  if (option_len_ == 0) {
    OnOption({}, out);
    return;
  }
  state_ = State::kOptionData;
}

void OptionNegotiator::Reply(std::vector<uint8_t>* out, uint32_t type,
                             std::span<const uint8_t> data) {
  AppendOptionReply(out, option_, type, data);
}

void OptionNegotiator::ReplyError(std::vector<uint8_t>* out, uint32_t type,
                                  std::string_view message) {
  Reply(out, type, AsBytes(message));
}

bool OptionNegotiator::NameSelectsExport(std::string_view name) const {
  return name.empty() || name == info_->name;
}

void OptionNegotiator::OnOption(std::span<const uint8_t> data, std::vector<uint8_t>* out) {
  switch (option_) {
    case kOptExportName:
      OnExportName(data, out);
      return;
    case kOptAbort:
      // The spec says to ignore any data sent with ABORT.
      Reply(out, kRepAck);
      Close("client sent NBD_OPT_ABORT");
      return;
    case kOptList:
      OnList(data, out);
      return;
    case kOptInfo:
    case kOptGo:
      OnInfoOrGo(data, out);
      return;
    case kOptStructuredReply:
      if (!data.empty()) {
        ReplyError(out, kRepErrInvalid, "NBD_OPT_STRUCTURED_REPLY takes no data");
        return;
      }
      structured_replies_ = true;
      Reply(out, kRepAck);
      return;
    case kOptStartTls:
      ReplyError(out, kRepErrUnsup, "farmem-nbd does not support TLS");
      return;
    default:
      ReplyError(out, kRepErrUnsup, "option not supported by farmem-nbd");
      return;
  }
}

void OptionNegotiator::OnExportName(std::span<const uint8_t> data, std::vector<uint8_t>* out) {
  const std::string_view name(reinterpret_cast<const char*>(data.data()), data.size());
  if (name.size() > kMaxStringLen || !NameSelectsExport(name)) {
    // No way to answer EXPORT_NAME with an error: the spec says to terminate the session.
    Close("NBD_OPT_EXPORT_NAME asked for an unknown export");
    return;
  }
  transmission_flags_ = TransmissionFlags(*info_, structured_replies_);
  AppendBe64(out, info_->size);
  AppendBe16(out, transmission_flags_);
  if (!no_zeroes()) out->insert(out->end(), kExportNameReplyZeroes, 0);
  state_ = State::kTransmission;
}

void OptionNegotiator::OnList(std::span<const uint8_t> data, std::vector<uint8_t>* out) {
  if (!data.empty()) {
    ReplyError(out, kRepErrInvalid, "NBD_OPT_LIST takes no data");
    return;
  }
  std::vector<uint8_t> server;
  AppendBe32(&server, static_cast<uint32_t>(info_->name.size()));
  Append(&server, AsBytes(info_->name));
  Append(&server, AsBytes(info_->description));
  Reply(out, kRepServer, server);
  Reply(out, kRepAck);
}

void OptionNegotiator::OnInfoOrGo(std::span<const uint8_t> data, std::vector<uint8_t>* out) {
  // Data: 32-bit name length, name, 16-bit count, count x 16-bit info requests. Every length is
  // checked against what is actually present, in 64-bit arithmetic so nothing wraps.
  if (data.size() < 6) {
    ReplyError(out, kRepErrInvalid, "option data too short");
    return;
  }
  const uint64_t name_len = LoadBe32(data.data());
  if (name_len > data.size() - 6) {
    ReplyError(out, kRepErrInvalid, "export name length exceeds option length");
    return;
  }
  if (name_len > kMaxStringLen) {
    ReplyError(out, kRepErrTooBig, "export name longer than 4096 bytes");
    return;
  }
  const std::string_view name(reinterpret_cast<const char*>(data.data() + 4), name_len);
  const uint8_t* p = data.data() + 4 + name_len;
  const uint64_t count = LoadBe16(p);
  p += 2;
  if (data.size() != 4 + name_len + 2 + 2 * count) {
    ReplyError(out, kRepErrInvalid, "information request count does not match option length");
    return;
  }
  if (!NameSelectsExport(name)) {
    ReplyError(out, kRepErrUnknown, "no such export");
    return;
  }
  bool want_name = false;
  bool want_description = false;
  for (uint64_t i = 0; i < count; ++i) {
    const uint16_t req = LoadBe16(p + 2 * i);
    if (req == kInfoName) want_name = true;
    if (req == kInfoDescription) want_description = true;
    // Unknown requests are ignored (MUST); BLOCK_SIZE and EXPORT are sent regardless.
  }

  const uint16_t tflags = TransmissionFlags(*info_, structured_replies_);
  std::vector<uint8_t> item;
  AppendBe16(&item, kInfoExport);
  AppendBe64(&item, info_->size);
  AppendBe16(&item, tflags);
  Reply(out, kRepInfo, item);

  // Sent even when not asked for: our minimum block size (512) is not the protocol default (1),
  // and the spec asks servers with non-default constraints to advertise them.
  item.clear();
  AppendBe16(&item, kInfoBlockSize);
  AppendBe32(&item, kMinBlockSize);
  AppendBe32(&item, kPreferredBlockSize);
  AppendBe32(&item, kMaxPayload);
  Reply(out, kRepInfo, item);

  if (want_name) {
    item.clear();
    AppendBe16(&item, kInfoName);
    Append(&item, AsBytes(info_->name));
    Reply(out, kRepInfo, item);
  }
  if (want_description && !info_->description.empty()) {
    item.clear();
    AppendBe16(&item, kInfoDescription);
    Append(&item, AsBytes(info_->description));
    Reply(out, kRepInfo, item);
  }
  Reply(out, kRepAck);
  if (option_ == kOptGo) {
    transmission_flags_ = tflags;
    state_ = State::kTransmission;
  }
}

// ============================== transmission ==============================

bool DecodeRequestHeader(std::span<const uint8_t> bytes, Request* out) {
  if (bytes.size() < kRequestHeaderSize) return false;
  const uint8_t* p = bytes.data();
  if (LoadBe32(p) != kRequestMagic) return false;
  out->flags = LoadBe16(p + 4);
  out->type = LoadBe16(p + 6);
  out->handle = LoadBe64(p + 8);
  out->offset = LoadBe64(p + 16);
  out->length = LoadBe32(p + 24);
  return true;
}

Framing NextFrame(std::span<const uint8_t> buffered) {
  Framing f;
  if (buffered.size() < kRequestHeaderSize) return f;
  if (!DecodeRequestHeader(buffered, &f.request)) {
    f.kind = Framing::kBadMagic;
    return f;
  }
  f.kind = Framing::kRequest;
  f.payload = PayloadLength(f.request);
  return f;
}

namespace {

RequestCheck Fail(uint32_t error, const char* message) { return RequestCheck{error, message}; }

}  // namespace

RequestCheck CheckRequest(const Request& r, const Session& s) {
  const uint16_t tf = s.transmission_flags;
  uint16_t allowed = 0;
  if (tf & kTxSendFua) allowed |= kCmdFlagFua;  // valid on every command once advertised
  bool has_range = true;
  switch (r.type) {
    case kCmdRead:
      if (tf & kTxSendDf) allowed |= kCmdFlagDf;
      break;
    case kCmdWrite:
      break;
    case kCmdDisc: {
      RequestCheck c;
      c.disconnect = true;
      return c;
    }
    case kCmdFlush:
      if (!(tf & kTxSendFlush)) return Fail(kEinval, "NBD_CMD_FLUSH was not advertised");
      has_range = false;
      break;
    case kCmdTrim:
      if (!(tf & kTxSendTrim)) return Fail(kEinval, "NBD_CMD_TRIM was not advertised");
      break;
    case kCmdWriteZeroes:
      if (!(tf & kTxSendWriteZeroes)) {
        return Fail(kEinval, "NBD_CMD_WRITE_ZEROES was not advertised");
      }
      allowed |= kCmdFlagNoHole;
      break;
    default:
      return Fail(kEinval, "unknown or unsupported command");
  }
  if ((r.flags & ~allowed) != 0) return Fail(kEinval, "command flag not valid for this command");

  if (!has_range) {
    if (r.offset != 0 || r.length != 0) {
      return Fail(kEinval, "NBD_CMD_FLUSH offset and length must be zero");
    }
    return {};
  }
  if (r.length == 0) return Fail(kEinval, "length is zero");
  if (r.type == kCmdWrite && r.length > kMaxPayload) {
    return Fail(kEinval, "write longer than the maximum payload (32 MiB)");
  }
  if (r.type == kCmdRead && r.length > kMaxPayload) {
    return s.structured_replies ? Fail(kEoverflow, "read longer than the maximum payload (32 MiB)")
                                : Fail(kEinval, "read longer than the maximum payload (32 MiB)");
  }
  if (r.offset % kMinBlockSize != 0 || r.length % kMinBlockSize != 0) {
    return Fail(kEinval, "offset or length not a multiple of the 512-byte minimum block size");
  }
  // No overflow: compare against what is left after offset instead of adding.
  if (r.length > s.export_size || r.offset > s.export_size - r.length) {
    return r.type == kCmdRead ? Fail(kEinval, "read beyond the end of the export")
                              : Fail(kEnospc, "write beyond the end of the export");
  }
  return {};
}

void EncodeSimpleReply(uint8_t out[kSimpleReplySize], uint32_t error, uint64_t handle) {
  StoreBe32(out, kSimpleReplyMagic);
  StoreBe32(out + 4, error);
  StoreBe64(out + 8, handle);
}

void EncodeStructuredHeader(uint8_t out[kStructuredHeaderSize], uint16_t flags, uint16_t type,
                            uint64_t handle, uint32_t payload_length) {
  StoreBe32(out, kStructuredReplyMagic);
  StoreBe16(out + 4, flags);
  StoreBe16(out + 6, type);
  StoreBe64(out + 8, handle);
  StoreBe32(out + 16, payload_length);
}

void EncodeOffsetDataHeader(uint8_t out[kOffsetDataHeaderSize], uint64_t handle, uint64_t offset,
                            uint32_t data_length, bool done) {
  EncodeStructuredHeader(out, done ? kReplyFlagDone : 0, kReplyTypeOffsetData, handle,
                         8 + data_length);
  StoreBe64(out + kStructuredHeaderSize, offset);
}

void EncodeErrorChunkHeader(uint8_t out[kErrorChunkFixedSize], uint64_t handle, uint32_t error,
                            uint16_t message_length) {
  EncodeStructuredHeader(out, kReplyFlagDone, kReplyTypeError, handle, 6u + message_length);
  StoreBe32(out + kStructuredHeaderSize, error);
  StoreBe16(out + kStructuredHeaderSize + 4, message_length);
}

}  // namespace farmem::blockdev::nbd
