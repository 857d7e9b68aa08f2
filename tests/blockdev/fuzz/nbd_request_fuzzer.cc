// libFuzzer target: the transmission-phase request parser and validator (NextFrame,
// CheckRequest) and the reply encoders, over an arbitrary byte stream.
//
// Input layout: byte 0 selects what was negotiated (bit 0 structured replies, bits 1-5 which
// optional commands the export offers), bytes 1-8 the export size (big-endian, rounded down to
// 512), the rest is the byte stream a client sent after the handshake.
//
// Besides memory errors (ASan/UBSan) it checks the validator's promises: anything it accepts is
// a known command with advertised flags, inside the export, aligned, and at most 32 MiB of payload.
#include <cstdio>
#include <cstdlib>

#include "farmem/blockdev/nbd_protocol.h"

namespace farmem::blockdev::nbd {

namespace {

[[noreturn]] void Violation(const char* what, const Request& r) {
  std::fprintf(stderr, "invariant violated: %s (type %u flags 0x%x offset %llu length %u)\n", what,
               r.type, r.flags, static_cast<unsigned long long>(r.offset), r.length);
  std::abort();
}

}  // namespace

int FuzzNbdRequests(const uint8_t* data, size_t size) {
  if (size < 9) return 0;
  ExportInfo info;
  info.size = LoadBe64(data + 1) & ~uint64_t{kMinBlockSize - 1};
  info.can_flush = data[0] & 2;
  info.can_fua = data[0] & 4;
  info.can_trim = data[0] & 8;
  info.can_write_zeroes = data[0] & 16;
  info.can_multi_conn = data[0] & 32;
  const bool structured = data[0] & 1;
  const Session s{info.size, TransmissionFlags(info, structured), structured};

  std::span<const uint8_t> stream(data + 9, size - 9);
  uint8_t reply[64];
  while (true) {
    const Framing f = NextFrame(stream);
    if (f.kind != Framing::kRequest) break;
    const Request& r = f.request;
    if (f.payload != (r.type == kCmdWrite ? r.length : 0)) Violation("payload length", r);
    const RequestCheck c = CheckRequest(r, s);
    if (c.message == nullptr) Violation("null message", r);
    if (c.disconnect) {
      if (r.type != kCmdDisc) Violation("disconnect for a non-DISC request", r);
      break;
    }
    if (c.error == 0) {
      uint16_t allowed = (s.transmission_flags & kTxSendFua) ? kCmdFlagFua : 0;
      switch (r.type) {
        case kCmdRead:
          if (s.transmission_flags & kTxSendDf) allowed |= kCmdFlagDf;
          [[fallthrough]];
        case kCmdWrite:
          if (r.length > kMaxPayload) Violation("payload over 32 MiB accepted", r);
          break;
        case kCmdFlush:
          if (!info.can_flush) Violation("flush not advertised", r);
          if (r.offset != 0 || r.length != 0) Violation("flush with a range", r);
          break;
        case kCmdTrim:
          if (!info.can_trim) Violation("trim not advertised", r);
          break;
        case kCmdWriteZeroes:
          if (!info.can_write_zeroes) Violation("write zeroes not advertised", r);
          allowed |= kCmdFlagNoHole;
          break;
        default:
          Violation("unknown command accepted", r);
      }
      if ((r.flags & ~allowed) != 0) Violation("flag accepted that was not advertised", r);
      if (r.type != kCmdFlush) {
        if (r.length == 0) Violation("zero length accepted", r);
        if (r.offset % kMinBlockSize || r.length % kMinBlockSize) Violation("misaligned", r);
        if (r.offset > info.size || r.length > info.size - r.offset) Violation("out of range", r);
      }
    } else if (c.error != kEinval && c.error != kEnospc && c.error != kEoverflow) {
      Violation("error outside EINVAL/ENOSPC/EOVERFLOW", r);
    }
    // Exercise every encoder the server would use for this request.
    EncodeSimpleReply(reply, c.error, r.handle);
    const uint16_t mlen = ErrorMessageLength(c.message);
    EncodeErrorChunkHeader(reply, r.handle, c.error == 0 ? kEio : c.error, mlen);
    if (LoadBe32(reply + 16) != 6u + mlen) Violation("error chunk length", r);
    if (r.type == kCmdRead && c.error == 0) {
      EncodeOffsetDataHeader(reply, r.handle, r.offset, r.length);
      if (LoadBe32(reply + 16) != 8u + r.length) Violation("data chunk length", r);
    }
    const uint64_t consumed = kRequestHeaderSize + uint64_t{f.payload};
    if (consumed >= stream.size()) break;
    stream = stream.subspan(static_cast<size_t>(consumed));
  }
  return 0;
}

}  // namespace farmem::blockdev::nbd

#ifndef FARMEM_FUZZ_NO_MAIN
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return farmem::blockdev::nbd::FuzzNbdRequests(data, size);
}
#endif
