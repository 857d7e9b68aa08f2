// SpanCrypto: confidentiality and integrity of far objects on the lenders (docs/farptr.md,
// "Encryption"; docs/security.md).
//
// Each object is sealed on its own (AES-256-GCM, farmem/common/aead.h) when its span is written
// out: the sealed image of a span holds, at each live slot, the ciphertext of that object's
// bytes followed by its 16-byte GCM tag, and zeros everywhere else (free slots, slot padding).
// The seal number stays in the object's local entry (ObjectEntry::seal). The nonce is
// (kSealDomain, seal number), and the seal number comes from one counter per runtime key, taken
// anew for every seal: no two seals under one key share a nonce, whatever happened to the object
// in between. The nonce is bound to the object's write, not to where its bytes lie, so
// everything that moves ciphertext — GATHER_CELL and client-side compaction, moves on eviction
// notices, re-protection, degraded reads — moves it unchanged with its tag (both lie in the
// slot) and never needs the key. Parity is computed over the sealed images.
//
// The tag on the lender: forging one needs the key, and an older (ciphertext, tag) of the same
// object, or another object's, was sealed under another seal number than the one the entry
// holds, so it fails to open: the lender can neither forge nor replay. An object whose slot has
// no 16 bytes to spare after it (Heap::ClassForObject puts an object in a class with room for
// its tag unless that slot would be more than 25% larger: objects of nearly a span, power-of-two
// objects in small spans) keeps its tag here instead, in a side table (SideTagBytes).
//
// Keys: the data key (RuntimeOptions::data_key / data_key_file, or a fresh random one) never
// leaves the process; each runtime derives its own key from it (HKDF-SHA256 with a random salt),
// so two runtimes given the same data key file never seal under the same key and their seal
// counters may both start at 1.
//
// Threads: every method from any thread (a pool of aead::Cipher, one per concurrent caller).
// Entries are read and written under the lock of their span (the caller's); the side table has
// its own lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
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

  // Whether an object of `size` bytes in slots of `slot_size` has its tag in its slot (right
  // after its ciphertext) rather than in the side table.
  static bool TagInSlot(uint32_t size, uint32_t slot_size) {
    return size + aead::kTagBytes <= slot_size;
  }
  // The bytes at the start of its slot that hold an object's sealed form: what a read of that
  // object alone (a gathering miss) or a repair of its slot must cover.
  static uint32_t SealedBytes(uint32_t size, uint32_t slot_size) {
    return TagInSlot(size, slot_size) ? size + static_cast<uint32_t>(aead::kTagBytes) : size;
  }

  // Seals the objects of one span: for each slot i with owners[i] != null, the first
  // owners[i]->size bytes at frame + i * slot_size are sealed into image at the same offset,
  // their tag after them (or in the side table), and owners[i]->seal updated. Every other byte
  // of image (span_bytes long) is zero.
  Status SealSpan(const uint8_t* frame, uint32_t slot_size, uint32_t span_bytes,
                  std::span<ObjectEntry* const> owners, uint8_t* image);
  // Opens the objects in `slots` of a sealed image: slot i's ciphertext at cells + i * slot_size
  // and its tag after it (left unchanged, so a failed open can be retried from the same bytes;
  // or the side table's tag) is authenticated and
  // decrypted to the same offset of `out`. Slots whose tag fails (their bytes in `out` are
  // zeroed, no plaintext is written) are appended to *failed. The runtime opens lazily: a
  // swap-in opens only the object dereferenced, the others on their first deref (heap.h).
  void OpenSlots(const uint8_t* cells, uint8_t* out, uint32_t slot_size,
                 std::span<ObjectEntry* const> owners, std::span<const uint32_t> slots,
                 std::vector<uint32_t>* failed);
  // Opens one object read on its own (a gathering miss): `sealed` holds the first
  // SealedBytes(e->size, slot_size) bytes of its slot; the plaintext goes to out (e->size
  // bytes). False if its tag fails (out is then not plaintext).
  bool OpenObject(const uint8_t* sealed, uint8_t* out, uint32_t slot_size, const ObjectEntry* e);

  uint64_t key_id() const { return key_id_; }
  // The object's side-table tag goes (Heap::Free, for objects whose tag is not in their slot).
  void Forget(const ObjectEntry* e);
  // Local memory of the side table (counted with the entries).
  uint64_t SideTagBytes() const;

 private:
  explicit SpanCrypto(aead::Cipher proto) : proto_(std::move(proto)) {}
  std::unique_ptr<aead::Cipher> Checkout();
  // One object's open (OpenSlots, OpenObject): sealed is the start of its slot.
  bool OpenWith(aead::Cipher* cipher, const uint8_t* sealed, uint8_t* out, uint32_t slot_size,
                const ObjectEntry* e);
  void Return(std::unique_ptr<aead::Cipher> c);

  aead::Cipher proto_;  // never used directly: Clone()d for each caller
  uint64_t key_id_ = 0;
  std::atomic<uint64_t> next_seal_{1};
  Mutex pool_mu_;
  std::vector<std::unique_ptr<aead::Cipher>> pool_ GUARDED_BY(pool_mu_);
  mutable Mutex side_mu_;  // a leaf
  std::unordered_map<const ObjectEntry*, aead::Tag> side_tags_ GUARDED_BY(side_mu_);
};

}  // namespace farmem::farptr_internal
