// Handshake: the HELLO / AUTH exchange that admits one connection to farmemd
// (docs/wire-protocol.md, "HELLO" and "AUTH"), as a state machine that does no I/O.
//
// The admission loop (server_admission.cc) owns one Handshake per connection that has not
// authenticated yet, feeds it whatever bytes arrived and sends what it produced; no thread waits on
// such a connection. Only once the client has proved it holds the key of the identity it names in
// HELLO (auth.h; the cluster secret, or a key derived from it for one name) — or said HELLO to a
// daemon without a secret — does the connection get a thread of its own (Connection). A handshake
// frame is small: a body over kMaxHandshakeBody is refused from its header, so a connection being
// admitted never buffers more than kHandshakeBuffer bytes.
//
// Threading: a Handshake belongs to the thread that feeds it. The reply helpers at the end are
// pure and shared with Connection, so every reply of the daemon is framed in one place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "farmem/common/status.h"
#include "farmem/common/wire.h"

namespace farmem::daemon {

// Largest HELLO or AUTH body accepted (a HELLO is at most 181 bytes today, an AUTH 162).
inline constexpr uint32_t kMaxHandshakeBody = 1024;
inline constexpr size_t kHandshakeBuffer = wire::kHeaderSize + kMaxHandshakeBody;

// Appends a reply to `req` carrying `body` (status OK), or an error reply carrying `status`'s
// message, to `out`.
void AppendReply(const wire::FrameHeader& req, std::span<const uint8_t> body,
                 std::vector<uint8_t>* out);
void AppendErrorReply(const wire::FrameHeader& req, const Status& status,
                      std::vector<uint8_t>* out);

struct HandshakeConfig {
  std::string secret;  // the cluster secret; empty: HELLO alone admits
  uint64_t node_id = 0;
  uint32_t features = 0;  // HELLO reply features besides AUTH_REQUIRED
  // Key rotation (--old-secret-file): proofs made from these are accepted too.
  std::vector<std::string> old_secrets;
  // Identities refused at HELLO (--revoked-file).
  std::set<std::string, std::less<>> revoked;
};

class Handshake {
 public:
  enum class Outcome {
    kNeedMore,       // waiting for the rest of a frame or for the next one
    kAuthenticated,  // admitted: send output(), then serve the connection
    kRefused,        // send output() (one error reply), then close; failure() says why
  };

  explicit Handshake(const HandshakeConfig* config) : config_(config) {}

  // Processes the complete frames at the front of `in` until the handshake ends or needs more
  // bytes; sets *consumed to the bytes used. Bytes after the frame that authenticated the
  // connection are not consumed: they are the client's first requests.
  Outcome Feed(std::span<const uint8_t> in, size_t* consumed);

  // Replaces the output with an error reply to the last request and ends the handshake refused
  // (e.g. the daemon already serves --max-connections connections).
  void Refuse(const Status& status);

  std::vector<uint8_t>& output() { return out_; }
  const Status& failure() const { return failure_; }
  bool hello_done() const { return hello_done_; }
  const wire::ClientId& client_id() const { return client_id_; }
  const std::string& client_name() const { return client_name_; }
  // The identity the client proved (auth::kClusterIdentity when it sent none), and the lease
  // owner it acts as (auth::LeaseOwner of that identity and its client id). Without a secret the
  // identity is whatever the client declared: nothing is authenticated then.
  const std::string& identity() const { return identity_; }
  wire::ClientId owner() const;
  // The client's farmem version from AUTH's trailer; empty when it did not say (a client that
  // predates it, or a daemon without a secret: no AUTH).
  const std::string& client_version() const { return client_version_; }

 private:
  Outcome Fail(const wire::FrameHeader& h, Status status);
  Outcome OnHello(const wire::FrameHeader& h, std::span<const uint8_t> body);
  Outcome OnAuth(const wire::FrameHeader& h, std::span<const uint8_t> body);

  const HandshakeConfig* config_;
  bool hello_done_ = false;
  wire::FrameHeader last_{};
  wire::ClientId client_id_{};
  wire::Nonce client_nonce_{};
  wire::Nonce server_nonce_{};
  std::string client_name_;
  std::string identity_;
  std::string client_version_;
  std::vector<uint8_t> out_;
  Status failure_;
};

}  // namespace farmem::daemon
