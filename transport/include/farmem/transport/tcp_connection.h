// A blocking, authenticated, framed request/response connection to a farmemd over TCP.
//
// Used for the control plane (STAT, ALLOC, FREE, HEARTBEAT) by client/, and underneath the TCP
// data channel. Connect() performs HELLO and, when a secret is configured, the mutual
// challenge-response AUTH (docs/wire-protocol.md). Not thread-safe: the owner serializes calls
// (client/ wraps it in a mutex).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "farmem/common/socket.h"
#include "farmem/common/wire.h"
#include "farmem/transport/transport.h"

namespace farmem::transport {

class TcpConnection {
 public:
  static Result<TcpConnection> Connect(const ChannelOptions& options);

  TcpConnection(TcpConnection&&) = default;
  TcpConnection& operator=(TcpConnection&&) = default;

  // One request, one reply (the reply's error status becomes the returned Status).
  // Push frames (EVICT_NOTICE) arriving meanwhile are stored for TakePushes().
  Result<std::vector<uint8_t>> Call(wire::Opcode op, std::span<const uint8_t> body,
                                    std::chrono::milliseconds timeout);

  std::vector<std::vector<uint8_t>> TakePushes();  // bodies of EVICT_NOTICE pushes received

  const wire::HelloReply& hello() const { return hello_; }
  const Endpoint& endpoint() const { return endpoint_; }
  Socket& socket() { return socket_; }
  const Socket& socket() const { return socket_; }
  uint64_t NextRequestId() { return ++next_request_id_; }
  bool broken() const { return broken_; }
  void MarkBroken() { broken_ = true; }
  // Unblocks a thread stuck in Call (used on shutdown).
  void Shutdown() { socket_.Shutdown(); }

 private:
  TcpConnection() = default;
  Status Handshake(const ChannelOptions& options);

  Socket socket_;
  Endpoint endpoint_;
  wire::HelloReply hello_;
  uint64_t next_request_id_ = 0;
  bool broken_ = false;
  std::vector<std::vector<uint8_t>> pushes_;
};

}  // namespace farmem::transport
