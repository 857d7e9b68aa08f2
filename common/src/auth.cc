#include "farmem/common/auth.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

namespace farmem::auth {

Result<std::string> LoadSecretFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Err(ErrnoStatus(StatusCode::kNotFound, fmt::format("secret file {}", path), errno));
  }
  const std::string fix_length = fmt::format(
      "make a new one with `head -c 32 /dev/urandom | base64 > {0} && chmod 600 {0}` and give "
      "the same file to every daemon and client",
      path);
  if (st.st_mode & (S_IRWXG | S_IRWXO)) {
    return Err(InvalidArgument(fmt::format(
        "secret file {0} may be accessed by group or others (mode {1:03o}): anyone on this "
        "machine could read the secret; run `chmod 600 {0}`",
        path, st.st_mode & 0777)));
  }
  if (st.st_size > 4096) {
    return Err(InvalidArgument(fmt::format(
        "secret file {} is {} bytes: it may hold at most 4096; {}", path, st.st_size, fix_length)));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Err(ErrnoStatus(StatusCode::kIoError, fmt::format("open {}", path), errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string secret = ss.str();
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  if (secret.size() < kMinSecretBytes) {
    return Err(InvalidArgument(fmt::format(
        "secret file {} holds {} bytes{}: a secret needs at least {} (it could be guessed from "
        "one recorded handshake); {}",
        path, secret.size(), secret.empty() ? " (it is blank)" : "", kMinSecretBytes, fix_length)));
  }
  return secret;
}

Status RandomBytes(std::span<uint8_t> out) {
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return Internal("OpenSSL RAND_bytes failed: no entropy source");
  }
  return Status::Ok();
}

namespace {
wire::Mac Proof(std::string_view label, std::string_view secret, const wire::Nonce& server_nonce,
                const wire::Nonce& client_nonce, const wire::ClientId& client_id) {
  std::vector<uint8_t> msg;
  msg.insert(msg.end(), label.begin(), label.end());
  msg.insert(msg.end(), server_nonce.begin(), server_nonce.end());
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  msg.insert(msg.end(), client_id.begin(), client_id.end());
  wire::Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(),
       mac.data(), &len);
  return mac;
}
}  // namespace

wire::Mac ClientProof(std::string_view secret, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id) {
  return Proof("farmem-auth-v1 client", secret, server_nonce, client_nonce, client_id);
}

wire::Mac ServerProof(std::string_view secret, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id) {
  return Proof("farmem-auth-v1 server", secret, server_nonce, client_nonce, client_id);
}

bool MacEqual(const wire::Mac& a, const wire::Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace farmem::auth
