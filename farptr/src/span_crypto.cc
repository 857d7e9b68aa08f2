// Per-object AES-256-GCM sealing of spans (see span_crypto.h for the scheme).
#include "span_crypto.h"

#include <openssl/evp.h>
#include <openssl/kdf.h>

#include <cstring>
#include <string_view>

#include "farmem/common/auth.h"
#include "farmem/internal/seal_observer.h"

namespace farmem::farptr_internal {

namespace {

Mutex g_observer_mu;
SealObserver g_observer GUARDED_BY(g_observer_mu);
std::atomic<bool> g_observing{false};

void Observe(uint64_t key_id, uint64_t first, uint64_t count) {
  if (!g_observing.load(std::memory_order_acquire)) return;
  MutexLock lock(&g_observer_mu);
  if (!g_observer) return;
  for (uint64_t i = 0; i < count; ++i) g_observer(key_id, aead::MakeNonce(kSealDomain, first + i));
}

// HKDF-SHA256(ikm = data key, salt, info = "farmem farptr runtime key v1").
Result<aead::Key> DeriveRuntimeKey(const aead::Key& data_key, std::span<const uint8_t> salt) {
  static constexpr std::string_view kInfo = "farmem farptr runtime key v1";
  aead::Key out{};
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
  bool ok =
      ctx != nullptr && EVP_PKEY_derive_init(ctx) > 0 &&
      EVP_PKEY_CTX_set_hkdf_md(ctx, EVP_sha256()) > 0 &&
      EVP_PKEY_CTX_set1_hkdf_salt(ctx, salt.data(), static_cast<int>(salt.size())) > 0 &&
      EVP_PKEY_CTX_set1_hkdf_key(ctx, data_key.data(), static_cast<int>(data_key.size())) > 0 &&
      EVP_PKEY_CTX_add1_hkdf_info(ctx, reinterpret_cast<const unsigned char*>(kInfo.data()),
                                  static_cast<int>(kInfo.size())) > 0;
  size_t len = out.size();
  ok = ok && EVP_PKEY_derive(ctx, out.data(), &len) > 0 && len == out.size();
  EVP_PKEY_CTX_free(ctx);
  if (!ok) return Err(Internal("HKDF-SHA256 (OpenSSL) failed deriving the far_ptr runtime key"));
  return out;
}

}  // namespace

void SetSealObserverForTest(SealObserver observer) {
  MutexLock lock(&g_observer_mu);
  g_observing.store(static_cast<bool>(observer), std::memory_order_release);
  g_observer = std::move(observer);
}

Result<std::unique_ptr<SpanCrypto>> SpanCrypto::Create(const aead::Key& data_key) {
  uint8_t salt[16];
  FARMEM_RETURN_IF_ERROR(auth::RandomBytes(salt));
  FARMEM_ASSIGN_OR_RETURN(aead::Key key, DeriveRuntimeKey(data_key, salt));
  // The key's id (for tests and messages): 8 bytes of SHA-256("farptr key id" || key), which
  // says nothing about the key.
  uint8_t digest[EVP_MAX_MD_SIZE];
  unsigned digest_len = 0;
  std::vector<uint8_t> id_input(13 + key.size());
  std::memcpy(id_input.data(), "farptr key id", 13);
  std::memcpy(id_input.data() + 13, key.data(), key.size());
  const bool hashed =
      EVP_Digest(id_input.data(), id_input.size(), digest, &digest_len, EVP_sha256(), nullptr) > 0;
  std::memset(id_input.data(), 0, id_input.size());
  Result<aead::Cipher> c = aead::Cipher::Create(key);
  std::memset(key.data(), 0, key.size());
  if (!c) return Err(c.error());
  if (!hashed) return Err(Internal("SHA-256 (OpenSSL) failed"));
  std::unique_ptr<SpanCrypto> sc(new SpanCrypto(std::move(*c)));
  std::memcpy(&sc->key_id_, digest, sizeof(sc->key_id_));
  return sc;
}

std::unique_ptr<aead::Cipher> SpanCrypto::Checkout() {
  {
    MutexLock lock(&pool_mu_);
    if (!pool_.empty()) {
      auto c = std::move(pool_.back());
      pool_.pop_back();
      return c;
    }
  }
  Result<aead::Cipher> c = proto_.Clone();
  if (!c) return nullptr;
  return std::make_unique<aead::Cipher>(std::move(*c));
}

void SpanCrypto::Return(std::unique_ptr<aead::Cipher> c) {
  if (!c) return;
  MutexLock lock(&pool_mu_);
  pool_.push_back(std::move(c));
}

Status SpanCrypto::SealSpan(const uint8_t* frame, uint32_t slot_size, uint32_t span_bytes,
                            std::span<ObjectEntry* const> owners, uint8_t* image) {
  std::memset(image, 0, span_bytes);
  uint64_t live = 0;
  for (ObjectEntry* e : owners) live += e != nullptr ? 1 : 0;
  if (live == 0) return Status::Ok();
  auto cipher = Checkout();
  if (!cipher) return Internal("cannot clone the far_ptr cipher (OpenSSL out of memory?)");
  // One fresh seal number per object, taken together: never reused under this key.
  const uint64_t first = next_seal_.fetch_add(live, std::memory_order_relaxed);
  uint64_t seal = first;
  Status st;
  aead::Tag tag;
  for (size_t i = 0; i < owners.size() && st.ok(); ++i) {
    ObjectEntry* e = owners[i];
    if (e == nullptr) continue;
    const size_t off = i * static_cast<size_t>(slot_size);
    st = cipher->Seal(aead::MakeNonce(kSealDomain, seal), {}, {frame + off, e->size},
                      {image + off, e->size}, &tag);
    e->seal = seal++;
    if (TagInSlot(e->size, slot_size)) {
      std::memcpy(image + off + e->size, tag.data(), tag.size());
    } else {
      MutexLock lock(&side_mu_);
      side_tags_[e] = tag;
    }
  }
  Return(std::move(cipher));
  Observe(key_id_, first, live);
  return st;
}

void SpanCrypto::OpenSlots(const uint8_t* cells, uint8_t* out, uint32_t slot_size,
                           std::span<ObjectEntry* const> owners, std::span<const uint32_t> slots,
                           std::vector<uint32_t>* failed) {
  auto cipher = Checkout();
  for (const uint32_t i : slots) {
    const size_t off = i * static_cast<size_t>(slot_size);
    if (!OpenWith(cipher.get(), cells + off, out + off, slot_size, owners[i])) failed->push_back(i);
  }
  Return(std::move(cipher));
}

bool SpanCrypto::OpenObject(const uint8_t* sealed, uint8_t* out, uint32_t slot_size,
                            const ObjectEntry* e) {
  auto cipher = Checkout();
  const bool ok = OpenWith(cipher.get(), sealed, out, slot_size, e);
  Return(std::move(cipher));
  return ok;
}

bool SpanCrypto::OpenWith(aead::Cipher* cipher, const uint8_t* sealed, uint8_t* out,
                          uint32_t slot_size, const ObjectEntry* e) {
  aead::Tag tag;
  if (TagInSlot(e->size, slot_size)) {
    std::memcpy(tag.data(), sealed + e->size, tag.size());
  } else {
    MutexLock lock(&side_mu_);
    auto it = side_tags_.find(e);
    if (it != side_tags_.end()) {
      tag = it->second;
    } else {
      tag.fill(0);  // never sealed: fails below
    }
  }
  if (cipher == nullptr) {
    std::memset(out, 0, e->size);
    return false;
  }
  return cipher
      ->Open(aead::MakeNonce(kSealDomain, e->seal), {}, {sealed, e->size}, {out, e->size}, tag)
      .ok();
}

void SpanCrypto::Forget(const ObjectEntry* e) {
  MutexLock lock(&side_mu_);
  side_tags_.erase(e);
}

uint64_t SpanCrypto::SideTagBytes() const {
  MutexLock lock(&side_mu_);
  // A node (next pointer, key, tag, cached hash) and its malloc header, plus a bucket pointer.
  return side_tags_.size() * 56 + side_tags_.bucket_count() * 8;
}

}  // namespace farmem::farptr_internal
