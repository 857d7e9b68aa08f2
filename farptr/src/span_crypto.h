// SpanCrypto: confidentiality and integrity of far objects on the lenders (docs/farptr.md,
// "Encryption"; docs/security.md).
//
// Each object is sealed on its own (AES-256-GCM, farmem/common/aead.h) when its span is written
// out: the sealed image of a span holds, at each live slot, the ciphertext of that object's
// bytes, and zeros everywhere else (free slots, slot padding). The tag and the seal number stay
// in the object's local entry (ObjectEntry::seal, ::tag); nothing about the encryption travels
// to the daemons. The nonce is (kSealDomain, seal number), and the seal number comes from one
// counter per runtime key, taken anew for every seal: no two seals under one key share a nonce,
// whatever happened to the object in between. The nonce is bound to the object's write, not to
// where its bytes lie, so everything that moves ciphertext — GATHER_CELL and client-side
// compaction, moves on eviction notices, re-protection, degraded reads — moves it unchanged and
// never needs the key. Parity is computed over the sealed images.
//
// Keys: the data key (RuntimeOptions::data_key / data_key_file, or a fresh random one) never
// leaves the process; each runtime derives its own key from it (HKDF-SHA256 with a random salt),
// so two runtimes given the same data key file never seal under the same key and their seal
// counters may both start at 1.
//
// Threads: every method from any thread (a pool of aead::Cipher, one per concurrent caller).
// Entries are read and written under the lock of their span (the caller's).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "farmem/common/aead.h"
#include "farmem/common/mutex.h"
#include "farmem/common/status.h"
#include "farmem/internal/object.h"

namespace farmem::farptr_internal {

// "FPOB": far_ptr object. The nonce's high 4 bytes; the low 8 are the seal number.
inline constexpr uint32_t kSealDomain = 0x46504f42;

class SpanCrypto {
 public:
  // `data_key`: the runtime's data key; the key actually used is derived from it (see above).
  static Result<std::unique_ptr<SpanCrypto>> Create(const aead::Key& data_key);

  // Seals the objects of one span: for each slot i with owners[i] != null, the first
  // owners[i]->size bytes at frame + i * slot_size are sealed into image at the same offset, and
  // owners[i]->seal / ->tag updated. Every other byte of image (span_bytes long) is zero.
  Status SealSpan(const uint8_t* frame, uint32_t slot_size, uint32_t span_bytes,
                  std::span<ObjectEntry* const> owners, uint8_t* image);
  // Opens the objects in `slots` of a sealed image: slot i's ciphertext at cells + i * slot_size
  // (left unchanged, so a failed open can be retried from the same bytes) is authenticated and
  // decrypted to the same offset of `out`. Slots whose tag fails (their bytes in `out` are
  // zeroed, no plaintext is written) are appended to *failed. The runtime opens lazily: a
  // swap-in opens only the object dereferenced, the others on their first deref (heap.h).
  void OpenSlots(const uint8_t* cells, uint8_t* out, uint32_t slot_size,
                 std::span<ObjectEntry* const> owners, std::span<const uint32_t> slots,
                 std::vector<uint32_t>* failed);

  uint64_t key_id() const { return key_id_; }

 private:
  explicit SpanCrypto(aead::Cipher proto) : proto_(std::move(proto)) {}
  std::unique_ptr<aead::Cipher> Checkout();
  void Return(std::unique_ptr<aead::Cipher> c);

  aead::Cipher proto_;  // never used directly: Clone()d for each caller
  uint64_t key_id_ = 0;
  std::atomic<uint64_t> next_seal_{1};
  Mutex pool_mu_;
  std::vector<std::unique_ptr<aead::Cipher>> pool_ GUARDED_BY(pool_mu_);
};

}  // namespace farmem::farptr_internal
