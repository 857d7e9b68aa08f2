// Authenticated encryption of the data farmem puts on lenders (pages of farmem-nbd, spans of the
// far_ptr runtime): AES-256-GCM from OpenSSL's libcrypto (AES-NI and carry-less multiply where
// the CPU has them). The data key is the client's own: it is generated per export or runtime
// (GenerateKey) or kept in a data key file for re-attach (WriteDataKeyFile/LoadDataKeyFile), and
// never leaves the client process. Daemons only ever hold ciphertext; the tag that authenticates
// it stays with the caller (or travels next to the ciphertext, as the caller decides).
//
// Two implementations of the same standard AES-256-GCM (12-byte nonce, 16-byte tag): Intel's
// intel-ipsec-mb (libIPSec_MB, its direct GCM API; VAES + VPCLMULQDQ on AVX-512 CPUs, ~4x
// OpenSSL 3.0 per 4 KiB page) where its CPU detection finds AES-NI, else OpenSSL's libcrypto
// (EVP). Either opens what the other sealed: the bytes on lenders do not depend on it.
// FARMEM_AEAD_IMPL=auto|openssl|ipsec-mb chooses (ChosenImpl); tests pass the Impl directly.
//
// Nonces must never repeat under one key: callers derive them from where and when the data was
// written (MakeNonce(domain, x) with x packing e.g. the page number and its write version) and keep
// the versions, so no nonce is random and none is reused across overwrites, rebuilds or moves (a
// rebuild or move copies ciphertext, it never re-encrypts). See docs/security.md.
//
// A Cipher is not thread-safe (OpenSSL: one context per direction, keyed once, so a call only
// sets the nonce; ipsec-mb: its expanded key is only read, but keep one rule): give each thread
// its own (Clone).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "farmem/common/status.h"

// OpenSSL's context type and intel-ipsec-mb's expanded key, declared here so users need not
// include either library's header.
struct evp_cipher_ctx_st;
struct gcm_key_data;

namespace farmem::aead {

inline constexpr size_t kKeyBytes = 32;
inline constexpr size_t kNonceBytes = 12;
inline constexpr size_t kTagBytes = 16;
using Key = std::array<uint8_t, kKeyBytes>;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Tag = std::array<uint8_t, kTagBytes>;

// The nonce domain (4 bytes, big-endian) || x (8 bytes, big-endian). `domain` separates the
// users of one key (e.g. pages from the backup file's copies); `x` packs what the data is and
// its write version, as the caller documents (e.g. page number << 24 | version).
Nonce MakeNonce(uint32_t domain, uint64_t x);

// A fresh random key.
Result<Key> GenerateKey();

// A data key file: "# ..." comments and one "data-key HEX" line, mode 600 (the checks of
// auth::LoadSecretFile). Load refuses anything else with the command that fixes it.
Result<Key> LoadDataKeyFile(const std::string& path);
// Creates `path` (it must not exist: a data key is never overwritten, that would make the data
// encrypted under it unreadable) with mode 600.
Status WriteDataKeyFile(const std::string& path, const Key& key);
// The key in `path` if it exists, else a new key written there. `created` says which.
Result<Key> LoadOrCreateDataKeyFile(const std::string& path, bool* created = nullptr);

// Which library does the AES-256-GCM of a Cipher.
enum class Impl { kOpenSsl, kIpsecMb };
// "openssl" or "ipsec-mb": the values FARMEM_AEAD_IMPL accepts, in logs and metric labels.
std::string_view ImplName(Impl impl);
// What intel-ipsec-mb's CPU detection chose on this machine, e.g. "avx512", "sse", "no-aesni"
// (no AES-NI: its software AES), "none" (the library cannot run here).
std::string_view IpsecMbArch();
// Whether intel-ipsec-mb runs on AES-NI here (what `auto` picks it for).
bool IpsecMbHasAesNi();
// The implementation Cipher::Create(key) uses: FARMEM_AEAD_IMPL=openssl or ipsec-mb if set,
// else (unset, empty or `auto`) ipsec-mb where IpsecMbHasAesNi(), OpenSSL otherwise.
// InvalidArgument for another value; FailedPrecondition for ipsec-mb where it cannot run.
Result<Impl> ChosenImpl();
// One line for a program's start-up log: the implementation and why.
std::string DescribeChosenImpl();

class Cipher {
 public:
  // With ChosenImpl() (its error if FARMEM_AEAD_IMPL is wrong).
  static Result<Cipher> Create(const Key& key);
  // With `impl` (FailedPrecondition for ipsec-mb where it cannot run).
  static Result<Cipher> Create(const Key& key, Impl impl);
  Cipher(Cipher&& other) noexcept;
  Cipher& operator=(Cipher&& other) noexcept;
  Cipher(const Cipher&) = delete;
  Cipher& operator=(const Cipher&) = delete;
  ~Cipher();

  // Another Cipher with the same key and implementation, for another thread.
  Result<Cipher> Clone() const;
  Impl impl() const { return impl_; }

  // Encrypts `plain` into `out` (same size; out may be plain itself) and writes the tag. `aad`
  // is authenticated, not encrypted (may be empty).
  Status Seal(const Nonce& nonce, std::span<const uint8_t> aad, std::span<const uint8_t> plain,
              std::span<uint8_t> out, Tag* tag);
  // Decrypts `cipher` into `out` (same size; may be in place) if `tag` authenticates it with
  // `nonce` and `aad`; DataLoss ("failed authentication") otherwise, and then `out` holds no
  // plaintext (it is zeroed).
  Status Open(const Nonce& nonce, std::span<const uint8_t> aad, std::span<const uint8_t> cipher,
              std::span<uint8_t> out, const Tag& tag);

 private:
  Cipher() = default;
  void Reset();
  Status SealIpsecMb(const Nonce& nonce, std::span<const uint8_t> aad,
                     std::span<const uint8_t> plain, std::span<uint8_t> out, Tag* tag);
  Status OpenIpsecMb(const Nonce& nonce, std::span<const uint8_t> aad,
                     std::span<const uint8_t> cipher, std::span<uint8_t> out, const Tag& tag);
  Impl impl_ = Impl::kOpenSsl;
  Key key_{};
  evp_cipher_ctx_st* enc_ = nullptr;  // kOpenSsl
  evp_cipher_ctx_st* dec_ = nullptr;
  gcm_key_data* gcm_key_ = nullptr;  // kIpsecMb: round keys and GHASH key powers, cleansed on free
};

}  // namespace farmem::aead
