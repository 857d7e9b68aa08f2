// libFuzzer target: fixed-newstyle option haggling (OptionNegotiator), fed exactly as the server
// feeds it from a socket.
//
// Input layout: byte 0 selects the export's capabilities, the rest is what the client sends
// after the server's greeting (client flags, then options).
//
// Besides memory errors it checks that everything the negotiator says back is well-formed: a
// sequence of option replies with correct magic and lengths (or, after NBD_OPT_EXPORT_NAME, the
// 10- or 134-byte export reply), and that transmission flags are truthful.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "farmem/blockdev/nbd_protocol.h"

namespace farmem::blockdev::nbd {

namespace {

[[noreturn]] void Violation(const char* what) {
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

void CheckReplies(const std::vector<uint8_t>& out) {
  size_t pos = 0;
  while (pos < out.size()) {
    if (out.size() - pos < kOptionReplyHeaderSize) Violation("truncated option reply header");
    if (LoadBe64(&out[pos]) != kOptionReplyMagic) Violation("bad option reply magic");
    const uint32_t type = LoadBe32(&out[pos + 12]);
    const uint32_t len = LoadBe32(&out[pos + 16]);
    pos += kOptionReplyHeaderSize;
    if (len > out.size() - pos) Violation("option reply longer than the output");
    if (type == kRepAck && len != 0) Violation("ACK with data");
    if (type == kRepInfo) {
      if (len < 2) Violation("INFO without a type");
      const uint16_t info = LoadBe16(&out[pos]);
      if (info == kInfoExport && len != 12) Violation("NBD_INFO_EXPORT length");
      if (info == kInfoBlockSize && len != 14) Violation("NBD_INFO_BLOCK_SIZE length");
    }
    if (type == kRepServer && (len < 4 || LoadBe32(&out[pos]) > len - 4)) {
      Violation("NBD_REP_SERVER name length");
    }
    if ((type & 0x80000000u) == 0 && type != kRepAck && type != kRepInfo && type != kRepServer) {
      Violation("unknown reply type");
    }
    pos += len;
  }
}

}  // namespace

int FuzzNbdHandshake(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  ExportInfo info;
  info.name = "disk";
  info.description = (data[0] & 64) ? "a described disk" : "";
  info.size = 1ull << 30;
  info.can_flush = data[0] & 2;
  info.can_fua = data[0] & 4;
  info.can_trim = data[0] & 8;
  info.can_write_zeroes = data[0] & 16;
  info.can_multi_conn = data[0] & 32;

  OptionNegotiator neg(&info);
  std::vector<uint8_t> out;
  size_t pos = 1;
  uint32_t last_option = 0;
  while (neg.bytes_wanted() > 0 && size - pos >= neg.bytes_wanted()) {
    const size_t want = neg.bytes_wanted();
    const auto before = neg.state();
    if (before == OptionNegotiator::State::kOptionHeader && want == kOptionHeaderSize) {
      last_option = LoadBe32(data + pos + 8);
    }
    out.clear();
    neg.Feed({data + pos, want}, &out);
    pos += want;
    if (neg.state() == OptionNegotiator::State::kTransmission && last_option == kOptExportName) {
      if (out.size() != 10 && out.size() != 10 + kExportNameReplyZeroes) {
        Violation("export name reply size");
      }
      if (out.size() != (neg.no_zeroes() ? 10u : 134u)) Violation("NO_ZEROES not honoured");
    } else {
      CheckReplies(out);
    }
    if (neg.state() == OptionNegotiator::State::kTransmission) {
      const uint16_t f = neg.transmission_flags();
      if (!(f & kTxHasFlags)) Violation("HAS_FLAGS missing");
      if (bool(f & kTxSendDf) != neg.structured_replies()) Violation("DF without structured");
      if (bool(f & kTxSendFlush) != info.can_flush) Violation("SEND_FLUSH untruthful");
      if (bool(f & kTxSendTrim) != info.can_trim) Violation("SEND_TRIM untruthful");
      if (bool(f & kTxCanMultiConn) != info.can_multi_conn) Violation("MULTI_CONN untruthful");
      break;
    }
  }
  return 0;
}

}  // namespace farmem::blockdev::nbd

#ifndef FARMEM_FUZZ_NO_MAIN
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return farmem::blockdev::nbd::FuzzNbdHandshake(data, size);
}
#endif
