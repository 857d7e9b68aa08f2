// Authentication for farmem connections (challenge-response, HMAC-SHA256 from OpenSSL's
// libcrypto). A client authenticates as an identity (a name) with that name's key: the key of a
// name is HKDF-SHA256 of the cluster secret and the name (ClientKey), so a daemon, which holds
// the cluster secret, can check any name without a key list, and a client holding one name's key
// learns nothing of the cluster secret or of other names' keys. The built-in name "cluster"
// (kClusterIdentity) is the cluster secret itself: the administrator's and the daemons' own name.
// Keys never cross the wire: each side proves it holds the key by MACing both sides' fresh
// nonces, the client id and the name. See docs/wire-protocol.md, "Authentication" and
// "Identities". All functions are pure or use OpenSSL's thread-safe RNG; any thread may call
// them.
#pragma once

#include <span>
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

// Lower-case hexadecimal of `bytes`, and back (InvalidArgument for odd length or a non-hex
// character). The one hex codec of the key files.
std::string EncodeHex(std::span<const uint8_t> bytes);
Result<std::string> DecodeHex(std::string_view hex);

// ---- identities ----

// The built-in identity of whoever holds the cluster secret itself (administrators, daemons
// acting for a client, clients configured with --secret-file). A HELLO without an identity
// means this name.
inline constexpr std::string_view kClusterIdentity = "cluster";
// Bytes of a derived client key.
inline constexpr size_t kClientKeyBytes = 32;

// A name is 1..64 characters of [A-Za-z0-9._@-] (they end up in logs and in --revoked-file).
Status ValidateIdentity(std::string_view name);
// "" and kClusterIdentity are the same identity; every other name is itself.
std::string_view CanonicalIdentity(std::string_view name);

// The key `name` authenticates with: for kClusterIdentity the cluster secret itself, otherwise
// HKDF-SHA256(ikm = cluster secret, salt = none, info = "farmem client key v1" || name), 32 bytes.
// `name` must be valid (ValidateIdentity).
std::string ClientKey(std::string_view cluster_secret, std::string_view name);

// Whose leases a connection may touch: the daemon binds every lease to this value, computed from
// the authenticated identity and the client id the client chose (a label under its name: two
// processes of one name keep separate leases and heartbeats, and no name can reach another
// name's leases whatever id it sends). SHA-256("farmem lease owner v1" || len || name || id),
// first 16 bytes.
wire::ClientId LeaseOwner(std::string_view identity, const wire::ClientId& client_id);

// What a client holds to authenticate as one name (farmemctl key issue writes it).
struct ClientKeyFile {
  std::string identity;
  std::string key;  // raw bytes
};
// The file's text: "name NAME" and "key HEX" lines (and a comment).
std::string FormatClientKeyFile(const ClientKeyFile& k);
// Reads a key file with the checks of LoadSecretFile (mode 600, size); refuses a file without a
// valid name or with a key shorter than kMinSecretBytes.
Result<ClientKeyFile> LoadClientKeyFile(const std::string& path);

// What a client program authenticates with, from its --secret-file (the cluster secret: identity
// "cluster") or its --key-file (one name's key). Neither: {} (no authentication). Both: an error.
Result<ClientKeyFile> LoadClientCredentials(const std::string& secret_file,
                                            const std::string& key_file);

// What the client sends in AUTH, and what the daemon answers to prove itself. `key` is
// ClientKey(secret, identity). For the cluster identity ("" or "cluster") the proof is the one of
// protocol v1 (no name in it), so clients that only know the cluster secret keep working.
wire::Mac ClientProof(std::string_view key, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id,
                      std::string_view identity = {});
wire::Mac ServerProof(std::string_view key, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id,
                      std::string_view identity = {});

// Constant-time comparison (of MACs, and of RDMA tokens, which have the same type).
bool MacEqual(const wire::Mac& a, const wire::Mac& b);

}  // namespace farmem::auth
