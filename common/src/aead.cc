#include "farmem/common/aead.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <sstream>

#include "farmem/common/auth.h"

namespace farmem::aead {

Nonce MakeNonce(uint32_t domain, uint64_t x) {
  Nonce n{};
  for (int i = 0; i < 4; ++i) n[i] = static_cast<uint8_t>(domain >> (24 - 8 * i));
  for (int i = 0; i < 8; ++i) n[4 + i] = static_cast<uint8_t>(x >> (56 - 8 * i));
  return n;
}

Result<Key> GenerateKey() {
  Key k{};
  FARMEM_RETURN_IF_ERROR(auth::RandomBytes(k));
  return k;
}

namespace {
constexpr std::string_view kKeyLine = "data-key ";
}  // namespace

Result<Key> LoadDataKeyFile(const std::string& path) {
  auto text = auth::LoadSecretFile(path);
  if (!text) return Err(text.error().WithContext("data key file"));
  const std::string fix = fmt::format(
      "a data key file holds one line 'data-key HEX' of {} bytes; if this file was not written by "
      "farmem, move it away (data encrypted under another key cannot be read) and let farmem "
      "create {}",
      kKeyBytes, path);
  std::istringstream in(*text);
  std::string line;
  std::optional<Key> key;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    if (!line.starts_with(kKeyLine) || key.has_value()) {
      return Err(InvalidArgument(fmt::format("data key file {}: unexpected line; {}", path, fix)));
    }
    auto raw = auth::DecodeHex(std::string_view(line).substr(kKeyLine.size()));
    if (!raw || raw->size() != kKeyBytes) {
      return Err(InvalidArgument(fmt::format(
          "data key file {}: the key is not {} hexadecimal bytes; {}", path, kKeyBytes, fix)));
    }
    Key k{};
    std::memcpy(k.data(), raw->data(), k.size());
    key = k;
  }
  if (!key)
    return Err(InvalidArgument(fmt::format("data key file {} holds no key; {}", path, fix)));
  return *key;
}

Status WriteDataKeyFile(const std::string& path, const Key& key) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return ErrnoStatus(StatusCode::kIoError, fmt::format("create data key file {}", path), errno);
  }
  const std::string text = fmt::format(
      "# farmem data key (AES-256-GCM): whoever holds it can read the data written with it.\n"
      "# Keep it private (chmod 600); without it that data cannot be read.\ndata-key {}\n",
      auth::EncodeHex({key.data(), key.size()}));
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = errno;
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size()) || !synced) {
    ::unlink(path.c_str());
    return ErrnoStatus(StatusCode::kIoError, fmt::format("write data key file {}", path),
                       n < 0 ? err : EIO);
  }
  return Status::Ok();
}

Result<Key> LoadOrCreateDataKeyFile(const std::string& path, bool* created) {
  if (created != nullptr) *created = false;
  if (::access(path.c_str(), F_OK) == 0) return LoadDataKeyFile(path);
  FARMEM_ASSIGN_OR_RETURN(Key k, GenerateKey());
  FARMEM_RETURN_IF_ERROR(WriteDataKeyFile(path, k));
  if (created != nullptr) *created = true;
  return k;
}

// ---- Cipher ----

Result<Cipher> Cipher::Create(const Key& key) {
  Cipher c;
  c.key_ = key;
  c.enc_ = EVP_CIPHER_CTX_new();
  c.dec_ = EVP_CIPHER_CTX_new();
  if (c.enc_ == nullptr || c.dec_ == nullptr ||
      EVP_EncryptInit_ex(c.enc_, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
      EVP_CIPHER_CTX_ctrl(c.enc_, EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr) != 1 ||
      EVP_EncryptInit_ex(c.enc_, nullptr, nullptr, key.data(), nullptr) != 1 ||
      EVP_DecryptInit_ex(c.dec_, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
      EVP_CIPHER_CTX_ctrl(c.dec_, EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr) != 1 ||
      EVP_DecryptInit_ex(c.dec_, nullptr, nullptr, key.data(), nullptr) != 1) {
    return Err(Internal("OpenSSL cannot set up AES-256-GCM (a broken libcrypto installation)"));
  }
  return c;
}

Cipher::Cipher(Cipher&& other) noexcept : key_(other.key_), enc_(other.enc_), dec_(other.dec_) {
  other.enc_ = nullptr;
  other.dec_ = nullptr;
  OPENSSL_cleanse(other.key_.data(), other.key_.size());
}

Cipher& Cipher::operator=(Cipher&& other) noexcept {
  if (this != &other) {
    Reset();
    key_ = other.key_;
    enc_ = other.enc_;
    dec_ = other.dec_;
    other.enc_ = nullptr;
    other.dec_ = nullptr;
    OPENSSL_cleanse(other.key_.data(), other.key_.size());
  }
  return *this;
}

Cipher::~Cipher() { Reset(); }

void Cipher::Reset() {
  EVP_CIPHER_CTX_free(enc_);
  EVP_CIPHER_CTX_free(dec_);
  enc_ = nullptr;
  dec_ = nullptr;
  OPENSSL_cleanse(key_.data(), key_.size());
}

Result<Cipher> Cipher::Clone() const { return Create(key_); }

namespace {
// The tag goes in and out as a parameter of the context: EVP_CIPHER_CTX_ctrl's GET_TAG/SET_TAG
// only translate to these calls in OpenSSL 3 (17 ns of the ~80 ns a tag call costs, per page).
OSSL_PARAM TagParam(uint8_t* tag) {
  return OSSL_PARAM_construct_octet_string(OSSL_CIPHER_PARAM_AEAD_TAG, tag, kTagBytes);
}

bool AddAad(evp_cipher_ctx_st* ctx, std::span<const uint8_t> aad, bool encrypt) {
  if (aad.empty()) return true;
  int len = 0;
  return encrypt
             ? EVP_EncryptUpdate(ctx, nullptr, &len, aad.data(), static_cast<int>(aad.size())) == 1
             : EVP_DecryptUpdate(ctx, nullptr, &len, aad.data(), static_cast<int>(aad.size())) == 1;
}
}  // namespace

Status Cipher::Seal(const Nonce& nonce, std::span<const uint8_t> aad,
                    std::span<const uint8_t> plain, std::span<uint8_t> out, Tag* tag) {
  if (out.size() != plain.size()) return InvalidArgument("Seal: output and input sizes differ");
  int len = 0;
  int fin = 0;
  OSSL_PARAM get_tag[] = {TagParam(tag->data()), OSSL_PARAM_construct_end()};
  if (EVP_EncryptInit_ex(enc_, nullptr, nullptr, nullptr, nonce.data()) != 1 ||
      !AddAad(enc_, aad, true) ||
      EVP_EncryptUpdate(enc_, out.data(), &len, plain.data(), static_cast<int>(plain.size())) !=
          1 ||
      EVP_EncryptFinal_ex(enc_, out.data() + len, &fin) != 1 ||
      EVP_CIPHER_CTX_get_params(enc_, get_tag) != 1) {
    return Internal("OpenSSL AES-256-GCM encryption failed");
  }
  return Status::Ok();
}

Status Cipher::Open(const Nonce& nonce, std::span<const uint8_t> aad,
                    std::span<const uint8_t> cipher, std::span<uint8_t> out, const Tag& tag) {
  if (out.size() != cipher.size()) return InvalidArgument("Open: output and input sizes differ");
  int len = 0;
  int fin = 0;
  Tag t = tag;  // OpenSSL's parameter takes a non-const pointer
  OSSL_PARAM set_tag[] = {TagParam(t.data()), OSSL_PARAM_construct_end()};
  if (EVP_DecryptInit_ex(dec_, nullptr, nullptr, nullptr, nonce.data()) != 1 ||
      !AddAad(dec_, aad, false) ||
      EVP_DecryptUpdate(dec_, out.data(), &len, cipher.data(), static_cast<int>(cipher.size())) !=
          1 ||
      EVP_CIPHER_CTX_set_params(dec_, set_tag) != 1) {
    std::memset(out.data(), 0, out.size());
    return Internal("OpenSSL AES-256-GCM decryption failed");
  }
  if (EVP_DecryptFinal_ex(dec_, out.data() + len, &fin) != 1) {
    std::memset(out.data(), 0, out.size());
    return DataLoss(
        "the data failed authentication (AES-GCM tag mismatch): it was changed on the "
        "lender or in transit, or read with the wrong key");
  }
  return Status::Ok();
}

}  // namespace farmem::aead
