// The control calls integration tests make on a farmemd (STAT, ALLOC, FREE, HEARTBEAT) over the
// real transport::TcpConnection, plus a TCP data channel opened as the same client, and a check
// that a daemon process is still alive. Header-only; used from the test's own thread.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "farmem/common/status.h"
#include "farmem/common/wire.h"
#include "farmem/transport/tcp_connection.h"
#include "farmem/transport/transport.h"
#include "support/raw_client.h"

namespace farmem::testing {

inline constexpr std::chrono::milliseconds kCallTimeout{5000};

// The code of a Result: kOk when it holds a value.
template <typename T>
StatusCode CodeOf(const Result<T>& r) {
  return r.has_value() ? StatusCode::kOk : r.error().code();
}

inline transport::ChannelOptions ClientOptions(const Endpoint& ep, const std::string& secret,
                                               const wire::ClientId& id,
                                               const std::string& name = "farmem-test") {
  transport::ChannelOptions o;
  o.endpoint = ep;
  o.credentials.secret = secret;
  o.credentials.client_id = id;
  o.credentials.client_name = name;
  o.connect_timeout = kCallTimeout;
  o.op_timeout = kCallTimeout;
  return o;
}

// One client of one daemon: a control connection and, on demand, data channels.
class DaemonClient {
 public:
  // `identity` empty: `secret` is the cluster secret; else `secret` is that identity's key.
  static Result<DaemonClient> Connect(const Endpoint& ep, const std::string& secret,
                                      const wire::ClientId& id = RandomClientId(),
                                      const std::string& identity = "") {
    DaemonClient c(ClientOptions(ep, secret, id));
    c.options_.credentials.identity = identity;
    FARMEM_ASSIGN_OR_RETURN(auto conn, transport::TcpConnection::Connect(c.options_));
    c.control_ = std::make_unique<transport::TcpConnection>(std::move(conn));
    return c;
  }

  const wire::ClientId& client_id() const { return options_.credentials.client_id; }
  transport::TcpConnection& control() { return *control_; }

  Result<std::unique_ptr<transport::Channel>> OpenChannel(uint32_t max_outstanding = 64) {
    transport::ChannelOptions o = options_;
    o.max_outstanding = max_outstanding;
    return transport_->OpenChannel(o);
  }

  Result<wire::StatReply> Stat() {
    FARMEM_ASSIGN_OR_RETURN(auto body, control_->Call(wire::Opcode::kStat, {}, kCallTimeout));
    return wire::DecodeStatReply(body);
  }

  Result<std::vector<wire::LeaseGrant>> Alloc(uint32_t count) {
    std::vector<uint8_t> req;
    wire::EncodeAlloc({count}, &req);
    FARMEM_ASSIGN_OR_RETURN(auto body, control_->Call(wire::Opcode::kAlloc, req, kCallTimeout));
    FARMEM_ASSIGN_OR_RETURN(wire::AllocReply reply, wire::DecodeAllocReply(body));
    if (reply.leases.size() != count) return Err(ProtocolError("ALLOC granted the wrong count"));
    return std::move(reply.leases);
  }

  Status Free(std::vector<uint64_t> lease_ids) {
    std::vector<uint8_t> req;
    wire::EncodeFree({std::move(lease_ids)}, &req);
    FARMEM_ASSIGN_OR_RETURN(auto body, control_->Call(wire::Opcode::kFree, req, kCallTimeout));
    if (!body.empty()) return ProtocolError("FREE reply has a body");
    return Status::Ok();
  }

  Result<wire::HeartbeatReply> Heartbeat() {
    FARMEM_ASSIGN_OR_RETURN(auto body, control_->Call(wire::Opcode::kHeartbeat, {}, kCallTimeout));
    return wire::DecodeHeartbeatReply(body);
  }

 private:
  explicit DaemonClient(transport::ChannelOptions options)
      : options_(std::move(options)), transport_(transport::MakeTcpTransport()) {}

  transport::ChannelOptions options_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::TcpConnection> control_;
};

// True if `pid` runs (not exited, not a zombie). The fixture only learns of a crash when it reaps.
inline bool ProcessAlive(pid_t pid) {
  if (pid <= 0 || ::kill(pid, 0) != 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

}  // namespace farmem::testing
