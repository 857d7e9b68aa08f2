#include "farmem/common/aead.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <sstream>

#include "farmem/common/auth.h"

// The header aligns its key structure (gcm_key_data, 64 bytes) only #ifdef LINUX, the macro the
// library itself is built with (undefined again after: a unity build goes on to other files).
#ifndef LINUX
#define LINUX
#define FARMEM_AEAD_DEFINED_LINUX
#endif
#include <intel-ipsec-mb.h>
#ifdef FARMEM_AEAD_DEFINED_LINUX
#undef LINUX
#undef FARMEM_AEAD_DEFINED_LINUX
#endif
static_assert(alignof(gcm_key_data) == 64);

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

// ---- the implementations ----

namespace {

// intel-ipsec-mb for this CPU: init_mb_mgr_auto fills a manager with the functions for the CPU
// it finds, and the direct GCM API used here (IMB_AES256_GCM_PRE, _ENC, _DEC) takes from it just
// three function pointers; all state of a call is the caller's (gcm_context_data, on the stack)
// and the expanded key (gcm_key_data, per Cipher, only read). So the pointers are copied out and
// the manager (~200 KiB, mostly its job queues, locked in swap-safe mode) is freed at once:
// what stays for the process is these few words, only read, shared by all threads.
struct IpsecMb {
  IMB_ARCH arch = IMB_ARCH_NONE;
  aes_gcm_pre_t gcm256_pre = nullptr;
  aes_gcm_enc_dec_t gcm256_enc = nullptr;
  aes_gcm_enc_dec_t gcm256_dec = nullptr;
};

const IpsecMb& Ipsec() {
  static const IpsecMb m = [] {
    IpsecMb r;
    IMB_MGR* mgr = alloc_mb_mgr(0);
    if (mgr == nullptr) return r;
    init_mb_mgr_auto(mgr, &r.arch);
    // No architecture it can run on (e.g. a CPU without SSE4.2): ENODEV and IMB_ARCH_NONE.
    if (imb_get_errno(mgr) != 0 || mgr->gcm256_pre == nullptr || mgr->gcm256_enc == nullptr ||
        mgr->gcm256_dec == nullptr) {
      r.arch = IMB_ARCH_NONE;
    } else {
      r.gcm256_pre = mgr->gcm256_pre;
      r.gcm256_enc = mgr->gcm256_enc;
      r.gcm256_dec = mgr->gcm256_dec;
    }
    free_mb_mgr(mgr);
    return r;
  }();
  return m;
}

constexpr std::string_view kImplVar = "FARMEM_AEAD_IMPL";

Status AuthenticationFailed() {
  return DataLoss(
      "the data failed authentication (AES-GCM tag mismatch): it was changed on the "
      "lender or in transit, or read with the wrong key");
}

Status IpsecMbUnusable() {
  return InvalidArgument(fmt::format(
      "{}=ipsec-mb: intel-ipsec-mb finds no CPU architecture it can run on here (arch {}); "
      "unset {} (or set it to auto or openssl) to use OpenSSL",
      kImplVar, IpsecMbArch(), kImplVar));
}

}  // namespace

std::string_view ImplName(Impl impl) { return impl == Impl::kIpsecMb ? "ipsec-mb" : "openssl"; }

std::string_view IpsecMbArch() {
  switch (Ipsec().arch) {
    case IMB_ARCH_NOAESNI:
      return "no-aesni";
    case IMB_ARCH_SSE:
      return "sse";
    case IMB_ARCH_AVX:
      return "avx";
    case IMB_ARCH_AVX2:
      return "avx2";
    case IMB_ARCH_AVX512:
      return "avx512";
    default:
      return "none";
  }
}

bool IpsecMbHasAesNi() {
  const IMB_ARCH a = Ipsec().arch;
  return a == IMB_ARCH_SSE || a == IMB_ARCH_AVX || a == IMB_ARCH_AVX2 || a == IMB_ARCH_AVX512;
}

Result<Impl> ChosenImpl() {
  const char* env = std::getenv(std::string(kImplVar).c_str());
  const std::string_view v = env == nullptr ? "" : env;
  if (v.empty() || v == "auto") return IpsecMbHasAesNi() ? Impl::kIpsecMb : Impl::kOpenSsl;
  if (v == "openssl") return Impl::kOpenSsl;
  if (v == "ipsec-mb") {
    if (Ipsec().arch == IMB_ARCH_NONE) return Err(IpsecMbUnusable());
    return Impl::kIpsecMb;
  }
  return Err(InvalidArgument(fmt::format(
      "{}={}: not an AES-GCM implementation; the accepted values are auto (the default: "
      "ipsec-mb where the CPU has AES-NI, else openssl), openssl and ipsec-mb",
      kImplVar, v)));
}

std::string DescribeChosenImpl() {
  auto impl = ChosenImpl();
  if (!impl) return impl.error().message();
  const char* env = std::getenv(std::string(kImplVar).c_str());
  const bool forced = env != nullptr && *env != '\0' && std::string_view(env) != "auto";
  return fmt::format("AES-256-GCM by {} ({}; intel-ipsec-mb {} arch {})", ImplName(*impl),
                     forced ? fmt::format("{}={}", kImplVar, env)
                            : std::string("auto: ipsec-mb where the CPU has AES-NI"),
                     imb_get_version_str(), IpsecMbArch());
}

// ---- Cipher ----

Result<Cipher> Cipher::Create(const Key& key) {
  FARMEM_ASSIGN_OR_RETURN(Impl impl, ChosenImpl());
  return Create(key, impl);
}

Result<Cipher> Cipher::Create(const Key& key, Impl impl) {
  Cipher c;
  c.impl_ = impl;
  c.key_ = key;
  if (impl == Impl::kIpsecMb) {
    const IpsecMb& m = Ipsec();
    if (m.arch == IMB_ARCH_NONE) return Err(IpsecMbUnusable());
    c.gcm_key_ = new (std::nothrow) gcm_key_data;
    if (c.gcm_key_ == nullptr) return Err(ResourceExhausted("no memory for an AES-GCM key"));
    m.gcm256_pre(key.data(), c.gcm_key_);
    return c;
  }
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

Cipher::Cipher(Cipher&& other) noexcept
    : impl_(other.impl_),
      key_(other.key_),
      enc_(other.enc_),
      dec_(other.dec_),
      gcm_key_(other.gcm_key_) {
  other.enc_ = nullptr;
  other.dec_ = nullptr;
  other.gcm_key_ = nullptr;
  OPENSSL_cleanse(other.key_.data(), other.key_.size());
}

Cipher& Cipher::operator=(Cipher&& other) noexcept {
  if (this != &other) {
    Reset();
    impl_ = other.impl_;
    key_ = other.key_;
    enc_ = other.enc_;
    dec_ = other.dec_;
    gcm_key_ = other.gcm_key_;
    other.enc_ = nullptr;
    other.dec_ = nullptr;
    other.gcm_key_ = nullptr;
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
  if (gcm_key_ != nullptr) {
    OPENSSL_cleanse(gcm_key_, sizeof(gcm_key_data));
    delete gcm_key_;
    gcm_key_ = nullptr;
  }
  OPENSSL_cleanse(key_.data(), key_.size());
}

Result<Cipher> Cipher::Clone() const { return Create(key_, impl_); }

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

// intel-ipsec-mb checks its pointers even for zero lengths: empty spans get these.
const uint8_t kNoInput[1] = {0};
}  // namespace

Status Cipher::Seal(const Nonce& nonce, std::span<const uint8_t> aad,
                    std::span<const uint8_t> plain, std::span<uint8_t> out, Tag* tag) {
  if (out.size() != plain.size()) return InvalidArgument("Seal: output and input sizes differ");
  if (impl_ == Impl::kIpsecMb) return SealIpsecMb(nonce, aad, plain, out, tag);
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
  if (impl_ == Impl::kIpsecMb) return OpenIpsecMb(nonce, aad, cipher, out, tag);
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
    return AuthenticationFailed();
  }
  return Status::Ok();
}

Status Cipher::SealIpsecMb(const Nonce& nonce, std::span<const uint8_t> aad,
                           std::span<const uint8_t> plain, std::span<uint8_t> out, Tag* tag) {
  gcm_context_data ctx;
  uint8_t no_output = 0;
  Ipsec().gcm256_enc(gcm_key_, &ctx, out.empty() ? &no_output : out.data(),
                     plain.empty() ? kNoInput : plain.data(), plain.size(), nonce.data(),
                     aad.empty() ? kNoInput : aad.data(), aad.size(), tag->data(), kTagBytes);
  OPENSSL_cleanse(&ctx, sizeof(ctx));  // holds a block of key stream
  return Status::Ok();
}

Status Cipher::OpenIpsecMb(const Nonce& nonce, std::span<const uint8_t> aad,
                           std::span<const uint8_t> cipher, std::span<uint8_t> out,
                           const Tag& tag) {
  gcm_context_data ctx;
  uint8_t no_output = 0;
  // Starts as the complement of `tag`: should the library refuse the call and write nothing,
  // the comparison fails.
  Tag computed;
  for (size_t i = 0; i < kTagBytes; ++i) computed[i] = static_cast<uint8_t>(~tag[i]);
  Ipsec().gcm256_dec(gcm_key_, &ctx, out.empty() ? &no_output : out.data(),
                     cipher.empty() ? kNoInput : cipher.data(), cipher.size(), nonce.data(),
                     aad.empty() ? kNoInput : aad.data(), aad.size(), computed.data(), kTagBytes);
  OPENSSL_cleanse(&ctx, sizeof(ctx));
  if (CRYPTO_memcmp(computed.data(), tag.data(), kTagBytes) != 0) {
    if (!out.empty()) std::memset(out.data(), 0, out.size());
    return AuthenticationFailed();
  }
  return Status::Ok();
}

}  // namespace farmem::aead
