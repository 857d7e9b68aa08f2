// The NBD wire protocol as farmem-nbd speaks it: constants, and pure parsers/encoders over bytes.
//
// What it solves: every byte a client sends is untrusted. All decisions about those bytes (is this
// option well-formed, may this request run, which error does the spec name for it) are made here,
// in functions with no I/O and no shared state, so that libFuzzer can drive them directly and the
// socket code in nbd_connection.cc / nbd_transmission.cc only moves bytes. docs/nbd.md says which
// parts of the protocol (github.com/NetworkBlockDevice/nbd doc/proto.md) are implemented.
//
// This header deliberately does not include farmem/common/status.h: the fuzz targets are built
// with clang-14, whose pairing with libstdc++ 12 has no std::expected. Results here are NBD error
// numbers (they go on the wire as they are) or small plain structs.
//
// Threading: everything here is pure; an OptionNegotiator is owned by one connection thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace farmem::blockdev::nbd {

// ---- magics ----
inline constexpr uint64_t kNbdMagic = 0x4e42444d41474943ull;          // "NBDMAGIC"
inline constexpr uint64_t kOptionMagic = 0x49484156454f5054ull;       // "IHAVEOPT"
inline constexpr uint64_t kOptionReplyMagic = 0x0003e889045565a9ull;  // option replies
inline constexpr uint32_t kRequestMagic = 0x25609513u;
inline constexpr uint32_t kSimpleReplyMagic = 0x67446698u;
inline constexpr uint32_t kStructuredReplyMagic = 0x668e33efu;

// ---- handshake flags (server, 16 bits) and client flags (32 bits) ----
inline constexpr uint16_t kFlagFixedNewstyle = 1u << 0;
inline constexpr uint16_t kFlagNoZeroes = 1u << 1;
inline constexpr uint32_t kClientFlagFixedNewstyle = 1u << 0;
inline constexpr uint32_t kClientFlagNoZeroes = 1u << 1;

// ---- options ----
inline constexpr uint32_t kOptExportName = 1;
inline constexpr uint32_t kOptAbort = 2;
inline constexpr uint32_t kOptList = 3;
inline constexpr uint32_t kOptStartTls = 5;
inline constexpr uint32_t kOptInfo = 6;
inline constexpr uint32_t kOptGo = 7;
inline constexpr uint32_t kOptStructuredReply = 8;
inline constexpr uint32_t kOptListMetaContext = 9;
inline constexpr uint32_t kOptSetMetaContext = 10;
inline constexpr uint32_t kOptExtendedHeaders = 11;

// ---- option reply types ----
inline constexpr uint32_t kRepAck = 1;
inline constexpr uint32_t kRepServer = 2;
inline constexpr uint32_t kRepInfo = 3;
inline constexpr uint32_t kRepErrUnsup = 0x80000001u;
inline constexpr uint32_t kRepErrPolicy = 0x80000002u;
inline constexpr uint32_t kRepErrInvalid = 0x80000003u;
inline constexpr uint32_t kRepErrUnknown = 0x80000006u;
inline constexpr uint32_t kRepErrShutdown = 0x80000007u;
inline constexpr uint32_t kRepErrTooBig = 0x80000009u;

// ---- NBD_INFO_* ----
inline constexpr uint16_t kInfoExport = 0;
inline constexpr uint16_t kInfoName = 1;
inline constexpr uint16_t kInfoDescription = 2;
inline constexpr uint16_t kInfoBlockSize = 3;

// ---- transmission flags ----
inline constexpr uint16_t kTxHasFlags = 1u << 0;
inline constexpr uint16_t kTxReadOnly = 1u << 1;
inline constexpr uint16_t kTxSendFlush = 1u << 2;
inline constexpr uint16_t kTxSendFua = 1u << 3;
inline constexpr uint16_t kTxRotational = 1u << 4;
inline constexpr uint16_t kTxSendTrim = 1u << 5;
inline constexpr uint16_t kTxSendWriteZeroes = 1u << 6;
inline constexpr uint16_t kTxSendDf = 1u << 7;
inline constexpr uint16_t kTxCanMultiConn = 1u << 8;

// ---- commands and command flags ----
inline constexpr uint16_t kCmdRead = 0;
inline constexpr uint16_t kCmdWrite = 1;
inline constexpr uint16_t kCmdDisc = 2;
inline constexpr uint16_t kCmdFlush = 3;
inline constexpr uint16_t kCmdTrim = 4;
inline constexpr uint16_t kCmdCache = 5;
inline constexpr uint16_t kCmdWriteZeroes = 6;
inline constexpr uint16_t kCmdBlockStatus = 7;

inline constexpr uint16_t kCmdFlagFua = 1u << 0;
inline constexpr uint16_t kCmdFlagNoHole = 1u << 1;
inline constexpr uint16_t kCmdFlagDf = 1u << 2;
inline constexpr uint16_t kCmdFlagReqOne = 1u << 3;
inline constexpr uint16_t kCmdFlagFastZero = 1u << 4;

// ---- structured replies ----
inline constexpr uint16_t kReplyFlagDone = 1u << 0;
inline constexpr uint16_t kReplyTypeNone = 0;
inline constexpr uint16_t kReplyTypeOffsetData = 1;
inline constexpr uint16_t kReplyTypeOffsetHole = 2;
inline constexpr uint16_t kReplyTypeError = 0x8001;
inline constexpr uint16_t kReplyTypeErrorOffset = 0x8002;

// ---- error numbers (proto.md "Error values"; fixed, independent of the host's errno) ----
inline constexpr uint32_t kEperm = 1;
inline constexpr uint32_t kEio = 5;
inline constexpr uint32_t kEnomem = 12;
inline constexpr uint32_t kEinval = 22;
inline constexpr uint32_t kEnospc = 28;
inline constexpr uint32_t kEoverflow = 75;
inline constexpr uint32_t kEnotsup = 95;
inline constexpr uint32_t kEshutdown = 108;

// ---- sizes and limits ----
inline constexpr size_t kRequestHeaderSize = 28;
inline constexpr size_t kSimpleReplySize = 16;
inline constexpr size_t kStructuredHeaderSize = 20;
inline constexpr size_t kOptionHeaderSize = 16;  // magic, option, length
inline constexpr size_t kOptionReplyHeaderSize = 20;
inline constexpr size_t kExportNameReplyZeroes = 124;
// Size constraints advertised with NBD_INFO_BLOCK_SIZE and enforced on every request.
inline constexpr uint32_t kMinBlockSize = 512;
inline constexpr uint32_t kPreferredBlockSize = 4096;
inline constexpr uint32_t kMaxPayload = 32u << 20;
// proto.md: strings MUST be no longer than 4096 bytes.
inline constexpr size_t kMaxStringLen = 4096;
// Largest option body read into memory: a 4096-byte name plus GO's fixed fields and a generous
// list of info requests. Longer options are skipped and refused with NBD_REP_ERR_TOO_BIG.
inline constexpr uint32_t kMaxOptionLen = 8192;
// Options longer than this are a denial of service: the connection is closed without reading them.
inline constexpr uint32_t kMaxSkippedOptionLen = 1u << 20;
// After this many options without reaching transmission the client is cut off.
inline constexpr uint32_t kMaxOptionsPerConnection = 1024;

// ---- big-endian access (NBD is network byte order throughout) ----
inline uint16_t LoadBe16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
inline uint32_t LoadBe32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | uint32_t{p[3]};
}
inline uint64_t LoadBe64(const uint8_t* p) { return uint64_t{LoadBe32(p)} << 32 | LoadBe32(p + 4); }
inline void StoreBe16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
inline void StoreBe32(uint8_t* p, uint32_t v) {
  StoreBe16(p, static_cast<uint16_t>(v >> 16));
  StoreBe16(p + 2, static_cast<uint16_t>(v));
}
inline void StoreBe64(uint8_t* p, uint64_t v) {
  StoreBe32(p, static_cast<uint32_t>(v >> 32));
  StoreBe32(p + 4, static_cast<uint32_t>(v));
}

const char* OptionName(uint32_t option);
const char* CommandName(uint16_t type);

// What the server offers. One export per server (farmem-nbd serves one device).
struct ExportInfo {
  std::string name;         // "" is the default export; both "" and `name` select it
  std::string description;  // sent as NBD_INFO_DESCRIPTION / in NBD_REP_SERVER when not empty
  uint64_t size = 0;        // bytes; a multiple of kMinBlockSize
  // What the backend supports. NBD_FLAG_SEND_DF is added per connection (it depends on structured
  // replies being negotiated).
  bool can_flush = false;
  bool can_fua = false;
  bool can_trim = false;
  bool can_write_zeroes = false;
  bool can_multi_conn = false;
};

// Transmission flags advertised to a client, truthfully derived from `info`.
uint16_t TransmissionFlags(const ExportInfo& info, bool structured_replies);

// ============================== handshake ==============================

// Drives fixed-newstyle option haggling for one connection, from the client's flags to the end of
// NBD_OPT_GO / NBD_OPT_EXPORT_NAME, without doing any I/O itself. The caller sends Greeting(),
// then repeatedly reads exactly bytes_wanted() bytes from the client, passes them to Feed() and
// sends whatever Feed() appended to `out`, until state() is kTransmission or kClosed (send the
// output in both cases: an ABORT is acknowledged before closing).
//
// Handled: EXPORT_NAME (with or without NO_ZEROES), GO and INFO (NBD_INFO_EXPORT always;
// NAME, DESCRIPTION, BLOCK_SIZE when asked), LIST, ABORT, STRUCTURED_REPLY. Anything else gets
// NBD_REP_ERR_UNSUP and negotiation continues. Malformed options get NBD_REP_ERR_INVALID,
// oversized ones NBD_REP_ERR_TOO_BIG (their bytes are skipped), absurd ones close the connection.
class OptionNegotiator {
 public:
  enum class State {
    kClientFlags,     // waiting for the client's 32-bit flags
    kOptionHeader,    // waiting for IHAVEOPT, option, length
    kOptionData,      // waiting for the option's data
    kSkipOptionData,  // discarding an oversized option's data
    kTransmission,    // negotiation succeeded; transmission phase starts with the next byte
    kClosed,          // the connection must be closed (reason in close_reason())
  };

  // `info` is borrowed and must outlive the negotiator.
  explicit OptionNegotiator(const ExportInfo* info) : info_(info) {}

  // The server's opening bytes: NBDMAGIC, IHAVEOPT, handshake flags.
  static void Greeting(std::vector<uint8_t>* out);

  // Bytes Feed() needs next (never 0 unless state() is kTransmission or kClosed).
  size_t bytes_wanted() const;
  // `bytes.size()` must equal bytes_wanted(). Appends the reply bytes to `out`.
  void Feed(std::span<const uint8_t> bytes, std::vector<uint8_t>* out);

  State state() const { return state_; }
  bool structured_replies() const { return structured_replies_; }
  // The transmission flags sent to the client (valid once state() is kTransmission).
  uint16_t transmission_flags() const { return transmission_flags_; }
  bool no_zeroes() const { return (client_flags_ & kClientFlagNoZeroes) != 0; }
  // Why state() became kClosed; a static string.
  const char* close_reason() const { return close_reason_; }
  uint32_t options_seen() const { return options_seen_; }

 private:
  void OnClientFlags(std::span<const uint8_t> bytes);
  void OnOptionHeader(std::span<const uint8_t> bytes, std::vector<uint8_t>* out);
  void OnOption(std::span<const uint8_t> data, std::vector<uint8_t>* out);
  void OnExportName(std::span<const uint8_t> data, std::vector<uint8_t>* out);
  void OnInfoOrGo(std::span<const uint8_t> data, std::vector<uint8_t>* out);
  void OnList(std::span<const uint8_t> data, std::vector<uint8_t>* out);
  bool NameSelectsExport(std::string_view name) const;
  void Reply(std::vector<uint8_t>* out, uint32_t type, std::span<const uint8_t> data = {});
  void ReplyError(std::vector<uint8_t>* out, uint32_t type, std::string_view message);
  void Close(const char* reason);

  const ExportInfo* info_;
  State state_ = State::kClientFlags;
  uint32_t client_flags_ = 0;
  uint32_t option_ = 0;      // option being received
  uint32_t option_len_ = 0;  // its length
  uint32_t skip_left_ = 0;   // bytes of an oversized option still to discard
  uint32_t options_seen_ = 0;
  bool structured_replies_ = false;
  uint16_t transmission_flags_ = 0;
  const char* close_reason_ = "";
};

// Appends one option reply (header + data).
void AppendOptionReply(std::vector<uint8_t>* out, uint32_t option, uint32_t type,
                       std::span<const uint8_t> data);

// ============================== transmission ==============================

struct Request {
  uint16_t flags = 0;
  uint16_t type = 0;
  uint64_t handle = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
};

// What was negotiated for a connection; what every request is checked against.
struct Session {
  uint64_t export_size = 0;
  uint16_t transmission_flags = 0;
  bool structured_replies = false;
};

// Decodes the 28-byte request header at the front of `bytes`. False if fewer than 28 bytes or the
// magic is wrong (then the stream cannot be trusted any more: close the connection).
bool DecodeRequestHeader(std::span<const uint8_t> bytes, Request* out);

// Bytes of payload that follow this header on the wire (a WRITE's data; nothing else has any).
inline uint32_t PayloadLength(const Request& r) { return r.type == kCmdWrite ? r.length : 0; }

// The verdict on one request before anything runs.
struct RequestCheck {
  uint32_t error = 0;        // 0: execute; otherwise the NBD error to answer with
  const char* message = "";  // for a human, sent in structured error chunks; static storage
  bool disconnect = false;   // NBD_CMD_DISC: finish outstanding requests, then close
};
// Checks command, flags against what was negotiated, alignment to kMinBlockSize, lengths against
// kMaxPayload, and offset+length against the export size without overflowing. Errors follow the
// spec: EINVAL for unknown commands/flags, misalignment and reads out of range; ENOSPC for
// writes/trims/zeroes out of range; EINVAL for over-long WRITEs and simple-reply READs;
// EOVERFLOW for over-long READs with structured replies (the server never fragments).
RequestCheck CheckRequest(const Request& r, const Session& s);

// The next thing in a transmission-phase byte stream (the connection's receive buffer).
struct Framing {
  enum Kind {
    kNeedMore,  // not even a whole header yet
    kBadMagic,  // protocol violation: close
    kRequest,   // a header; `payload` more bytes belong to it (maybe not all buffered yet)
  };
  Kind kind = kNeedMore;
  Request request;
  uint32_t payload = 0;
};
Framing NextFrame(std::span<const uint8_t> buffered);

// ---- reply encoding ----
inline constexpr size_t kErrorChunkFixedSize = kStructuredHeaderSize + 6;  // + message
// Longest message put in an error chunk (longer ones are cut).
inline constexpr size_t kMaxErrorMessage = 256;

void EncodeSimpleReply(uint8_t out[kSimpleReplySize], uint32_t error, uint64_t handle);
void EncodeStructuredHeader(uint8_t out[kStructuredHeaderSize], uint16_t flags, uint16_t type,
                            uint64_t handle, uint32_t payload_length);
// Header of an NBD_REPLY_TYPE_OFFSET_DATA chunk (header + 8-byte offset), with DONE set if `done`
// (the last chunk of the reply); the `data_length` bytes of data follow.
inline constexpr size_t kOffsetDataHeaderSize = kStructuredHeaderSize + 8;
void EncodeOffsetDataHeader(uint8_t out[kOffsetDataHeaderSize], uint64_t handle, uint64_t offset,
                            uint32_t data_length, bool done = true);
// Header + fixed part of a final NBD_REPLY_TYPE_ERROR chunk; the message bytes (already cut to
// kMaxErrorMessage by the caller, see ErrorMessageLength) follow.
void EncodeErrorChunkHeader(uint8_t out[kErrorChunkFixedSize], uint64_t handle, uint32_t error,
                            uint16_t message_length);
inline uint16_t ErrorMessageLength(std::string_view message) {
  return static_cast<uint16_t>(message.size() < kMaxErrorMessage ? message.size()
                                                                 : kMaxErrorMessage);
}

}  // namespace farmem::blockdev::nbd
