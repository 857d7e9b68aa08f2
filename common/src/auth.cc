#include "farmem/common/auth.h"

#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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

std::string EncodeHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    hex.push_back(kDigits[b >> 4]);
    hex.push_back(kDigits[b & 15]);
  }
  return hex;
}

Result<std::string> DecodeHex(std::string_view hex) {
  const auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0) return Err(InvalidArgument("odd number of hexadecimal digits"));
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]);
    const int lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return Err(InvalidArgument("not a hexadecimal digit"));
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

Status ValidateIdentity(std::string_view name) {
  if (name.empty() || name.size() > wire::kMaxIdentity) {
    return InvalidArgument(fmt::format("identity name of {} bytes: a name has 1 to {} characters",
                                       name.size(), wire::kMaxIdentity));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '@' || c == '-';
    if (!ok) {
      std::string shown;
      for (char d : name) shown += (d >= 0x20 && d <= 0x7e) ? d : '?';
      return InvalidArgument(fmt::format(
          "identity name '{}' has a character other than letters, digits and . _ @ -", shown));
    }
  }
  return Status::Ok();
}

std::string_view CanonicalIdentity(std::string_view name) {
  return name.empty() ? kClusterIdentity : name;
}

std::string ClientKey(std::string_view cluster_secret, std::string_view name) {
  name = CanonicalIdentity(name);
  if (name == kClusterIdentity) return std::string(cluster_secret);
  std::string info = "farmem client key v1";
  info.append(name);
  std::string key(kClientKeyBytes, '\0');
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "HKDF", nullptr);
  EVP_KDF_CTX* ctx = kdf != nullptr ? EVP_KDF_CTX_new(kdf) : nullptr;
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, const_cast<char*>("SHA256"), 0),
      OSSL_PARAM_construct_octet_string(
          OSSL_KDF_PARAM_KEY, const_cast<char*>(cluster_secret.data()), cluster_secret.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info.data(), info.size()),
      OSSL_PARAM_construct_end()};
  const bool ok =
      ctx != nullptr &&
      EVP_KDF_derive(ctx, reinterpret_cast<unsigned char*>(key.data()), key.size(), params) == 1;
  EVP_KDF_CTX_free(ctx);
  EVP_KDF_free(kdf);
  // libcrypto without HKDF is a broken installation, not an input error: fail loudly rather than
  // hand out a key everyone could compute.
  if (!ok) {
    std::fprintf(stderr, "farmem: OpenSSL HKDF-SHA256 is unavailable; cannot derive keys\n");
    std::abort();
  }
  return key;
}

wire::ClientId LeaseOwner(std::string_view identity, const wire::ClientId& client_id) {
  identity = CanonicalIdentity(identity);
  std::vector<uint8_t> msg;
  const std::string_view label = "farmem lease owner v1";
  msg.insert(msg.end(), label.begin(), label.end());
  msg.push_back(static_cast<uint8_t>(identity.size()));
  msg.insert(msg.end(), identity.begin(), identity.end());
  msg.insert(msg.end(), client_id.begin(), client_id.end());
  uint8_t digest[SHA256_DIGEST_LENGTH];
  SHA256(msg.data(), msg.size(), digest);
  wire::ClientId owner{};
  std::memcpy(owner.data(), digest, owner.size());
  return owner;
}

std::string FormatClientKeyFile(const ClientKeyFile& k) {
  const std::string hex = EncodeHex({reinterpret_cast<const uint8_t*>(k.key.data()), k.key.size()});
  return fmt::format(
      "# farmem client key (farmemctl key issue): authenticates as the name below. Keep it\n"
      "# private (chmod 600); give it with --key-file.\nname {}\nkey {}\n",
      k.identity, hex);
}

Result<ClientKeyFile> LoadClientKeyFile(const std::string& path) {
  FARMEM_ASSIGN_OR_RETURN(std::string text, LoadSecretFile(path));
  ClientKeyFile k;
  bool have_key = false;
  std::istringstream in(text);
  std::string line;
  const std::string fix = fmt::format(
      "issue it again with `farmemctl key issue NAME --secret-file CLUSTER_SECRET --out {}`", path);
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    if (line.starts_with("name ")) {
      k.identity = line.substr(5);
    } else if (line.starts_with("key ")) {
      auto raw = DecodeHex(std::string_view(line).substr(4));
      if (!raw) {
        return Err(
            InvalidArgument(fmt::format("key file {}: the key is not hexadecimal; {}", path, fix)));
      }
      k.key = std::move(*raw);
      have_key = true;
    } else {
      return Err(InvalidArgument(
          fmt::format("key file {}: unexpected line (a key file has 'name NAME' and 'key HEX'); {}",
                      path, fix)));
    }
  }
  if (Status s = ValidateIdentity(k.identity); !s.ok()) {
    return Err(InvalidArgument(fmt::format("key file {}: {}; {}", path, s.message(), fix)));
  }
  if (!have_key || k.key.size() < kMinSecretBytes) {
    return Err(InvalidArgument(
        fmt::format("key file {} holds a key of {} bytes: a key needs at least {}; {}", path,
                    k.key.size(), kMinSecretBytes, fix)));
  }
  return k;
}

Result<ClientKeyFile> LoadClientCredentials(const std::string& secret_file,
                                            const std::string& key_file) {
  if (!secret_file.empty() && !key_file.empty()) {
    return Err(InvalidArgument(
        "--secret-file and --key-file both given: a client authenticates either as the cluster "
        "administrator (--secret-file) or as one name (--key-file)"));
  }
  if (!key_file.empty()) {
    auto k = LoadClientKeyFile(key_file);
    if (!k) return Err(k.error().WithContext("--key-file"));
    return k;
  }
  ClientKeyFile k;
  if (!secret_file.empty()) {
    auto secret = LoadSecretFile(secret_file);
    if (!secret) return Err(secret.error().WithContext("--secret-file"));
    k.key = std::move(*secret);
  }
  return k;
}

namespace {
wire::Mac Proof(std::string_view label, std::string_view secret, const wire::Nonce& server_nonce,
                const wire::Nonce& client_nonce, const wire::ClientId& client_id,
                std::string_view identity) {
  std::vector<uint8_t> msg;
  msg.insert(msg.end(), label.begin(), label.end());
  msg.insert(msg.end(), server_nonce.begin(), server_nonce.end());
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  msg.insert(msg.end(), client_id.begin(), client_id.end());
  if (!identity.empty()) {  // v2: the name is part of what is proven
    msg.push_back(static_cast<uint8_t>(identity.size()));
    msg.insert(msg.end(), identity.begin(), identity.end());
  }
  wire::Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(),
       mac.data(), &len);
  return mac;
}
}  // namespace

wire::Mac ClientProof(std::string_view key, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id,
                      std::string_view identity) {
  if (CanonicalIdentity(identity) == kClusterIdentity) {
    return Proof("farmem-auth-v1 client", key, server_nonce, client_nonce, client_id, {});
  }
  return Proof("farmem-auth-v2 client", key, server_nonce, client_nonce, client_id, identity);
}

wire::Mac ServerProof(std::string_view key, const wire::Nonce& server_nonce,
                      const wire::Nonce& client_nonce, const wire::ClientId& client_id,
                      std::string_view identity) {
  if (CanonicalIdentity(identity) == kClusterIdentity) {
    return Proof("farmem-auth-v1 server", key, server_nonce, client_nonce, client_id, {});
  }
  return Proof("farmem-auth-v2 server", key, server_nonce, client_nonce, client_id, identity);
}

bool MacEqual(const wire::Mac& a, const wire::Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace farmem::auth
