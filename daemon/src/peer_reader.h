// PeerReader: farmemd reading cells of other daemons on behalf of one of its clients, for parity
// offload (PARITY_ENCODE, docs/wire-protocol.md).
//
// The problem: to compute a parity cell next to where it is stored, a daemon needs the k data
// cells of its span set, which live on k other daemons and belong to the same client. The daemon
// connects to those daemons as that client (same identity and client id, authenticated with the
// identity's key, which it derives from the cluster secret: a daemon that knows the secret may act
// for any client, as any holder of the secret can) and reads the cells with ordinary READ frames.
// During a key rotation the peer may know only the old or only the new secret: each is tried.
// Connections are kept per peer address and reused by later requests of the same client connection.
//
// Reads are pipelined: Start() sends one READ to every source, then Finish() receives each reply
// straight into the caller's buffer, so the k daemons work at the same time.
//
// Threading: owned by one Connection and used only by its thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "farmem/common/socket.h"
#include "farmem/common/wire.h"
#include "farmem/transport/tcp_connection.h"

namespace farmem::daemon {

class PeerReader {
 public:
  // `secrets`: the cluster secrets to try, current first (Server::Secrets()).
  PeerReader(std::vector<std::string> secrets, std::string identity, wire::ClientId client_id,
             std::string client_name)
      : secrets_(std::move(secrets)),
        identity_(std::move(identity)),
        client_id_(client_id),
        client_name_(std::move(client_name)) {}

  // Sends a READ of cells[i] (length bytes each) to its daemon. Fails without sending anything
  // more on the first source that cannot be reached; every connection that has a request in
  // flight is then dropped (a late reply must not be taken for the answer to a later request).
  Status Start(std::span<const wire::PeerCell> cells, uint32_t length, Deadline deadline);
  // Receives the reply for cells[i] into dst (length bytes). Call for i = 0, 1, ... in order.
  Status Finish(size_t i, uint8_t* dst, Deadline deadline);
  // Drops connections with requests still in flight (after an error).
  void Abandon();

 private:
  struct Link {
    std::unique_ptr<transport::TcpConnection> conn;
  };
  Result<Link*> LinkFor(const wire::PeerCell& cell, Deadline deadline);
  static constexpr size_t kMaxLinks = 64;

  std::vector<std::string> secrets_;
  std::string identity_;
  wire::ClientId client_id_;
  std::string client_name_;
  std::map<std::string, Link> links_;  // by "host:port"
  // During one Start/Finish round, for cells[i]: its link, request id and "host:port". Replies
  // are matched by request id, so a peer named twice is still read right.
  std::vector<Link*> inflight_;
  std::vector<uint64_t> ids_;
  std::vector<std::string> names_;
  uint32_t length_ = 0;
};

}  // namespace farmem::daemon
