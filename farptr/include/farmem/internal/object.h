// The per-object word that far_ptr<T> points to, and the entry points the inline fast paths of
// far_ptr.h call when they miss. Not a public API: only far_ptr.h, the containers and farptr/src
// include this header.
//
// Every live object has one ObjectEntry, allocated by the runtime and never moved, so a far_ptr is
// one pointer (8 bytes) whatever happens to the object. The entry's `word` says where the object
// is right now:
//
//   bit 63 kPresent     the object's bytes are in local memory at (word & kAddrMask)
//   bit 62 kEvacuating  the evictor wants to move it: a deref must take the slow path
//   bit 61 kHot         dereferenced since the last CLOCK sweep (Carbink's hotness bit)
//   bit 60 kDirty       written through deref_mut since it was last made local
//   bits 0..47          local address (valid only with kPresent)
//
// A remote object's word has no kPresent bit; where it lives remotely is in the span it belongs
// to (`span`, `slot`). Those two fields change only while the runtime holds the lock of the span
// the entry currently points to (see farptr/src/object_heap.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

#include "farmem/common/status.h"

namespace farmem {
class Runtime;
}

namespace farmem::farptr_internal {

inline constexpr uint64_t kPresent = uint64_t{1} << 63;
inline constexpr uint64_t kEvacuating = uint64_t{1} << 62;
inline constexpr uint64_t kHot = uint64_t{1} << 61;
inline constexpr uint64_t kDirty = uint64_t{1} << 60;
inline constexpr uint64_t kAddrMask = (uint64_t{1} << 48) - 1;

struct Span;

struct ObjectEntry {
  std::atomic<uint64_t> word{0};
  std::atomic<Span*> span{nullptr};
  std::atomic<uint32_t> slot{0};
  uint32_t size = 0;  // bytes the program asked for; set once at allocation
  // Encryption (farptr/src/span_crypto.h): the seal number of the object's bytes in its remote
  // cell (the nonce of their AES-GCM seal), written when its span is sealed for swap-out and read
  // when that cell is opened, only under the lock of the span the entry points to. The GCM tag
  // lies in the slot, after the ciphertext. Unused without encryption.
  uint64_t seal = 0;
};
// 32 bytes of local memory per object, whatever its size (docs/farptr.md, "Sizing the local
// budget"): keep it so.
static_assert(sizeof(ObjectEntry) == 32);

// Memory order of `word`: loads on the deref fast path are seq_cst (a plain load on x86) and pair
// with the seq_cst store of DerefScope entry and the evictor's seq_cst marking (see scope.cc).
inline uint64_t LoadWord(const ObjectEntry* e) { return e->word.load(std::memory_order_seq_cst); }

// Slow paths. Precondition: the calling thread is inside a DerefScope.
// Makes the object local (swapping its span in, or cancelling an eviction in progress), sets
// kHot (and kDirty when `mut`) and returns its address, valid until the scope ends.
Result<void*> DerefSlow(ObjectEntry* e, bool mut);
// The same, but an object that cannot be produced (its data is lost) is fatal: logs the Status
// and aborts. Used by deref()/deref_mut(), which return references.
void* DerefOrDie(ObjectEntry* e, bool mut);

// Allocates an object of `size` bytes in `rt`, local and hot; *addr receives its address (valid
// until the caller's scope ends). Aborts when `size` exceeds the runtime's span size (a
// programming error; make_far checks sizeof(T) where it can).
ObjectEntry* AllocateObject(Runtime* rt, size_t size, void** addr);
// Frees the object (local or remote). Any thread, any time the object is not being dereferenced.
void FreeObject(ObjectEntry* e);
// Asks the runtime to make the object local in the background (far_vector's prefetcher).
void PrefetchObject(ObjectEntry* e);
// Makes the objects of `rt` that `entries` name local now, their misses overlapped (the reads
// posted together): what a batch of derefs would do one miss at a time. Null, present or stale
// entries (freed or reused since the caller read them) are skipped, so the caller need hold no
// lock across the reads. Nothing stays pinned: deref them in the same scope, or check that they
// are still local (the objects fetched are left hot, so they outlive one evictor sweep).
void FetchObjects(Runtime* rt, std::span<ObjectEntry* const> entries);
// The runtime an entry belongs to.
Runtime* RuntimeOf(const ObjectEntry* e);

// Scopes (scope.cc). Nesting is allowed; only the outermost scope is visible to the evictor.
void EnterScopeOutermost();
void ExitScopeOutermost();
bool InScope();
extern thread_local int tls_scope_depth;

}  // namespace farmem::farptr_internal
