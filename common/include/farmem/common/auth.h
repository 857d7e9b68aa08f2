// Shared-secret authentication for farmem connections (challenge-response, HMAC-SHA256 from
// OpenSSL's libcrypto). The secret never crosses the wire: each side proves it knows the secret
// by MACing both sides' fresh nonces and the client id. See docs/wire-protocol.md,
// "Authentication". All functions are pure or use OpenSSL's thread-safe RNG; any thread may call
// them.
#pragma once

#include <string>
#include <string_view>

#include "farmem/common/status.h"
#include "farmem/common/wire.h"

namespace farmem::auth {

// A secret shorter than this is refused: it could be guessed offline from one recorded
// handshake. `head -c 32 /dev/urandom | base64` gives 44 bytes.
inline constexpr size_t kMinSecretBytes = 16;

// Reads a secret file: its content with one trailing newline removed. The one loader of secret
// files for every farmem program. Refuses (InvalidArgument, with the command that fixes it) a file
// that group or others may access in any way (chmod 600), and a secret shorter than
// kMinSecretBytes or longer than 4 KiB; NotFound/IoError if it cannot be read.
Result<std::string> LoadSecretFile(const std::string& path);

// Fills `out` with cryptographically strong random bytes.
Status RandomBytes(std::span<uint8_t> out);

// What the client sends in AUTH, and what the daemon answers to prove itself.
wire::Mac ClientProof(std::string_view secret, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id);
wire::Mac ServerProof(std::string_view secret, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id);

// Constant-time comparison (of MACs, and of RDMA tokens, which have the same type).
bool MacEqual(const wire::Mac& a, const wire::Mac& b);

}  // namespace farmem::auth
