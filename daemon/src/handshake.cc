#include "handshake.h"

#include <fmt/format.h>

#include <cstring>
#include <optional>

#include "farmem/common/auth.h"
#include "farmem/common/version.h"

namespace farmem::daemon {

void AppendReply(const wire::FrameHeader& req, std::span<const uint8_t> body,
                 std::vector<uint8_t>* out) {
  wire::FrameHeader r = req;
  r.flags = wire::kFlagReply;
  r.status = 0;
  r.body_len = static_cast<uint32_t>(body.size());
  const size_t at = out->size();
  out->resize(at + wire::kHeaderSize + body.size());
  wire::EncodeHeader(r, out->data() + at);
  if (!body.empty()) std::memcpy(out->data() + at + wire::kHeaderSize, body.data(), body.size());
}

void AppendErrorReply(const wire::FrameHeader& req, const Status& status,
                      std::vector<uint8_t>* out) {
  std::vector<uint8_t> msg;
  wire::EncodeError(status, &msg);
  wire::FrameHeader r = req;
  r.version = wire::kVersion;
  r.flags = wire::kFlagReply;
  r.status = static_cast<uint16_t>(status.code());
  r.body_len = static_cast<uint32_t>(msg.size());
  const size_t at = out->size();
  out->resize(at + wire::kHeaderSize + msg.size());
  wire::EncodeHeader(r, out->data() + at);
  std::memcpy(out->data() + at + wire::kHeaderSize, msg.data(), msg.size());
}

Handshake::Outcome Handshake::Feed(std::span<const uint8_t> in, size_t* consumed) {
  *consumed = 0;
  while (in.size() - *consumed >= wire::kHeaderSize) {
    const std::span<const uint8_t> rest = in.subspan(*consumed);
    Result<wire::FrameHeader> hr = wire::DecodeHeader(rest.first(wire::kHeaderSize));
    if (!hr.has_value()) return Fail(wire::FrameHeader{}, hr.error());
    const wire::FrameHeader h = *hr;
    last_ = h;
    if (h.flags != 0) {
      return Fail(h, ProtocolError("clients send requests: reply/push flags are not allowed"));
    }
    const auto op = static_cast<wire::Opcode>(h.opcode);
    if (op != wire::Opcode::kHello && op != wire::Opcode::kAuth) {
      return Fail(h, Unauthenticated(fmt::format("{} before authentication: send HELLO{} first",
                                                 wire::OpcodeName(h.opcode),
                                                 config_->secret.empty() ? "" : " and AUTH")));
    }
    if (h.body_len > kMaxHandshakeBody) {
      return Fail(
          h, ProtocolError(fmt::format("{} body of {} bytes exceeds {}", wire::OpcodeName(h.opcode),
                                       h.body_len, kMaxHandshakeBody)));
    }
    if (rest.size() < wire::kHeaderSize + h.body_len) return Outcome::kNeedMore;
    const std::span<const uint8_t> body = rest.subspan(wire::kHeaderSize, h.body_len);
    *consumed += wire::kHeaderSize + h.body_len;
    const Outcome o = op == wire::Opcode::kHello ? OnHello(h, body) : OnAuth(h, body);
    if (o != Outcome::kNeedMore) return o;
  }
  return Outcome::kNeedMore;
}

Handshake::Outcome Handshake::OnHello(const wire::FrameHeader& h, std::span<const uint8_t> body) {
  if (hello_done_) return Fail(h, ProtocolError("HELLO sent twice on one connection"));
  Result<wire::HelloRequest> req = wire::DecodeHello(body);
  if (!req.has_value()) return Fail(h, req.error());
  if (req->min_version > wire::kVersion || req->max_version < wire::kVersion) {
    return Fail(h, ProtocolError(fmt::format("client speaks versions {}..{}, this daemon {}",
                                             req->min_version, req->max_version, wire::kVersion)));
  }
  if (Status s = auth::RandomBytes(server_nonce_); !s.ok()) return Fail(h, s);
  hello_done_ = true;
  client_id_ = req->client_id;
  client_nonce_ = req->client_nonce;
  client_name_ = req->client_name;
  if (!req->identity.empty()) {
    if (Status s = auth::ValidateIdentity(req->identity); !s.ok()) {
      return Fail(h, s.WithContext("HELLO"));
    }
  }
  identity_ = std::string(auth::CanonicalIdentity(req->identity));
  if (config_->revoked.contains(identity_)) {
    return Fail(h, PermissionDenied(fmt::format(
                       "identity '{}' is revoked on this daemon (--revoked-file)", identity_)));
  }
  wire::HelloReply reply;
  reply.node_id = config_->node_id;
  reply.server_nonce = server_nonce_;
  reply.features = config_->features | wire::kFeatureVersion;
  reply.daemon_version = std::string(kVersionString);
  if (!config_->secret.empty()) reply.features |= wire::kFeatureAuthRequired;
  std::vector<uint8_t> body_out;
  wire::EncodeHelloReply(reply, &body_out);
  AppendReply(h, body_out, &out_);
  return config_->secret.empty() ? Outcome::kAuthenticated : Outcome::kNeedMore;
}

Handshake::Outcome Handshake::OnAuth(const wire::FrameHeader& h, std::span<const uint8_t> body) {
  if (!hello_done_) return Fail(h, ProtocolError("AUTH before HELLO"));
  Result<wire::AuthRequest> req = wire::DecodeAuth(body);
  if (!req.has_value()) return Fail(h, req.error());
  if (config_->revoked.contains(identity_)) {  // revoked between HELLO and AUTH (SIGHUP)
    return Fail(h, PermissionDenied(fmt::format(
                       "identity '{}' is revoked on this daemon (--revoked-file)", identity_)));
  }
  // The current secret, then those of a rotation window. The key of a name is derived from each.
  std::optional<std::string> key;
  for (size_t i = 0; i <= config_->old_secrets.size() && !key; ++i) {
    std::string k =
        auth::ClientKey(i == 0 ? config_->secret : config_->old_secrets[i - 1], identity_);
    const wire::Mac expected =
        auth::ClientProof(k, server_nonce_, client_nonce_, client_id_, identity_);
    if (auth::MacEqual(expected, req->client_mac)) key = std::move(k);
  }
  if (!key) {
    return Fail(h, PermissionDenied(
                       identity_ == auth::kClusterIdentity
                           ? std::string("authentication failed: wrong secret")
                           : fmt::format("authentication failed: wrong secret or key for identity "
                                         "'{}' (issue it with `farmemctl key issue {}`)",
                                         identity_, identity_)));
  }
  client_version_ = std::move(req->client_version);
  wire::AuthReply reply;
  reply.server_mac = auth::ServerProof(*key, server_nonce_, client_nonce_, client_id_, identity_);
  std::vector<uint8_t> body_out;
  wire::EncodeAuthReply(reply, &body_out);
  AppendReply(h, body_out, &out_);
  return Outcome::kAuthenticated;
}

wire::ClientId Handshake::owner() const { return auth::LeaseOwner(identity_, client_id_); }

Handshake::Outcome Handshake::Fail(const wire::FrameHeader& h, Status status) {
  AppendErrorReply(h, status, &out_);
  failure_ = std::move(status);
  return Outcome::kRefused;
}

void Handshake::Refuse(const Status& status) {
  out_.clear();
  (void)Fail(last_, status);
}

}  // namespace farmem::daemon
