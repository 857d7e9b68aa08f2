// libFuzzer target over the daemon's handshake parser (daemon/src/handshake.{h,cc}): the first
// bytes any client — authenticated or not — sends to farmemd go through Handshake::Feed.
//
// Input: byte 0 picks the daemon's configuration (bit 0: a secret, so AUTH is required; bit 1:
// the daemon refuses the connection once the handshake is half fed, as when --max-connections
// are served; bit 2: a secret with an old one of a rotation window and the identity "mallory"
// revoked), byte 1 how the rest arrives (0: all at once, else in reads of that many bytes).
// The rest is fed the way the admission loop (daemon/src/server.cc, Server::OnReadable) does:
// into a buffer of kHandshakeBuffer bytes, Feed, drop what was consumed, send and clear output().
//
// Besides crashes and undefined behaviour (ASan + UBSan) it traps when:
//   - Feed consumes more than it was given, or asks for more bytes while the buffer is full (the
//     connection would stall until the handshake timeout);
//   - what the daemon would send is not a sequence of well-formed reply frames (valid header,
//     REPLY flag, a decodable HELLO/AUTH reply or error message);
//   - a refused handshake has no failure, or its last frame is not an error reply carrying it;
//   - a connection is admitted without HELLO, or with a secret configured (no input can know
//     the MAC of a random server nonce), or as a revoked identity, or as a name that is not valid;
//   - the lease owner of an admitted connection is not the one its identity and client id make.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "farmem/common/auth.h"
#include "farmem/common/status.h"
#include "farmem/common/wire.h"
#include "fuzz_check.h"
#include "handshake.h"

namespace farmem::daemon {
namespace {

// Every frame in `out` is a well-formed reply; returns the last one's header.
wire::FrameHeader CheckReplies(std::span<const uint8_t> out) {
  wire::FrameHeader last{};
  size_t at = 0;
  while (at < out.size()) {
    FUZZ_CHECK(out.size() - at >= wire::kHeaderSize);
    auto h = wire::DecodeHeader(out.subspan(at, wire::kHeaderSize));
    FUZZ_CHECK(h.has_value());
    FUZZ_CHECK(h->flags == wire::kFlagReply);
    FUZZ_CHECK(out.size() - at - wire::kHeaderSize >= h->body_len);
    const auto body = out.subspan(at + wire::kHeaderSize, h->body_len);
    if (h->status != 0) {
      FUZZ_CHECK(body.size() <= wire::kMaxErrorMessage);
    } else if (h->opcode == static_cast<uint8_t>(wire::Opcode::kHello)) {
      FUZZ_CHECK(wire::DecodeHelloReply(body).has_value());
    } else {
      FUZZ_CHECK(h->opcode == static_cast<uint8_t>(wire::Opcode::kAuth));
      FUZZ_CHECK(wire::DecodeAuthReply(body).has_value());
    }
    last = *h;
    at += wire::kHeaderSize + h->body_len;
  }
  return last;
}

}  // namespace
}  // namespace farmem::daemon

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using farmem::daemon::Handshake;
  using farmem::daemon::HandshakeConfig;
  using farmem::daemon::kHandshakeBuffer;
  if (size < 2) return 0;
  static const HandshakeConfig kOpen{"", 0x1234, 0, {}, {}};
  static const HandshakeConfig kSecret{
      "0123456789abcdef0123456789abcdef", 0x5678, farmem::wire::kFeatureVerbs, {}, {}};
  const uint8_t mode = data[0];
  const size_t read_size = data[1] == 0 ? kHandshakeBuffer : data[1];
  const std::span<const uint8_t> in(data + 2, size - 2);
  static const HandshakeConfig kRotating{"0123456789abcdef0123456789abcdef",
                                         0x9abc,
                                         0,
                                         {"fedcba9876543210fedcba9876543210"},
                                         {"mallory"}};
  const HandshakeConfig* config = (mode & 4) != 0   ? &kRotating
                                  : (mode & 1) != 0 ? &kSecret
                                                    : &kOpen;
  const bool refuse_midway = (mode & 2) != 0;

  Handshake hs(config);
  std::vector<uint8_t> buf;
  size_t pos = 0;
  Handshake::Outcome outcome = Handshake::Outcome::kNeedMore;
  while (outcome == Handshake::Outcome::kNeedMore && pos < in.size()) {
    const size_t room = kHandshakeBuffer - buf.size();
    FUZZ_CHECK(room > 0);  // a full buffer that still needs more would never progress
    const size_t n = std::min({read_size, in.size() - pos, room});
    buf.insert(buf.end(), in.begin() + static_cast<ptrdiff_t>(pos),
               in.begin() + static_cast<ptrdiff_t>(pos + n));
    pos += n;
    size_t consumed = ~size_t{0};
    outcome = hs.Feed(buf, &consumed);
    FUZZ_CHECK(consumed <= buf.size());
    buf.erase(buf.begin(), buf.begin() + static_cast<ptrdiff_t>(consumed));
    if (outcome == Handshake::Outcome::kNeedMore) {
      FUZZ_CHECK(buf.size() < kHandshakeBuffer);
      farmem::daemon::CheckReplies(hs.output());
      hs.output().clear();  // sent
      if (refuse_midway && pos * 2 >= in.size()) {
        hs.Refuse(farmem::ResourceExhausted("the daemon serves --max-connections connections"));
        outcome = Handshake::Outcome::kRefused;
      }
    }
  }
  switch (outcome) {
    case Handshake::Outcome::kNeedMore:
      break;
    case Handshake::Outcome::kRefused: {
      FUZZ_CHECK(!hs.failure().ok());
      FUZZ_CHECK(!hs.output().empty());
      const farmem::wire::FrameHeader last = farmem::daemon::CheckReplies(hs.output());
      FUZZ_CHECK(last.status == static_cast<uint16_t>(hs.failure().code()));
      break;
    }
    case Handshake::Outcome::kAuthenticated:
      FUZZ_CHECK(hs.hello_done());
      FUZZ_CHECK(config->secret.empty());
      FUZZ_CHECK(!config->revoked.contains(hs.identity()));
      FUZZ_CHECK(farmem::auth::ValidateIdentity(hs.identity()).ok());
      FUZZ_CHECK(hs.owner() == farmem::auth::LeaseOwner(hs.identity(), hs.client_id()));
      farmem::daemon::CheckReplies(hs.output());
      break;
  }
  return 0;
}
