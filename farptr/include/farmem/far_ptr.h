// far_ptr<T>: an owning pointer (move-only, 8 bytes) to an object that lives in local memory when
// it is used and in a farmem daemon's memory when it is cold; DerefScope: the region of code in
// which dereferenced objects stay put (AIFM's contract).
//
//   farmem::far_ptr<Order> o = farmem::make_far<Order>(42, 9.5);
//   {
//     farmem::DerefScope scope;
//     const Order& a = o.deref(scope);      // local: a few instructions; remote: fetched
//     o.deref_mut(scope).price = 10.0;      // marks the object dirty
//     // `a` stays valid and local until `scope` ends, even while the evictor runs.
//   }
//
// Rules (docs/farptr.md has the full list):
//   - A reference from deref/deref_mut is valid only until the scope passed to it ends.
//   - T must be trivially copyable and trivially destructible: objects move between machines as
//     bytes, and a remote object cannot run a destructor. sizeof(T) <= the runtime's span size.
//   - Scopes nest; a thread should not keep one open for long (the evictor waits for scopes that
//     were open when it picked its victims) and everything dereferenced in one scope must fit in
//     the local budget.
//   - deref of an object whose data is lost (daemon gone, no redundancy) aborts the program with
//     a message naming what was lost; try_deref returns that as a Status instead.
//
// Threads: a far_ptr is like a unique_ptr: one owner; several threads may deref the same object
// concurrently for reading; writers need the caller's own synchronization, as with plain memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

#include "farmem/internal/object.h"
#include "farmem/runtime.h"

namespace farmem {

class DerefScope {
 public:
  DerefScope() {
    if (farptr_internal::tls_scope_depth++ == 0) farptr_internal::EnterScopeOutermost();
  }
  ~DerefScope() {
    if (--farptr_internal::tls_scope_depth == 0) farptr_internal::ExitScopeOutermost();
  }
  DerefScope(const DerefScope&) = delete;
  DerefScope& operator=(const DerefScope&) = delete;
};

namespace farptr_internal {

// The fast paths, shared by far_ptr and far_bytes. A hit is one load, one and, one compare.
inline void* DerefConst(ObjectEntry* e) {
  const uint64_t w = LoadWord(e);
  if ((w & (kPresent | kEvacuating | kHot)) == (kPresent | kHot)) [[likely]] {
    return reinterpret_cast<void*>(w & kAddrMask);
  }
  return DerefOrDie(e, false);
}
inline void* DerefMut(ObjectEntry* e) {
  const uint64_t w = LoadWord(e);
  if ((w & (kPresent | kEvacuating | kHot | kDirty)) == (kPresent | kHot | kDirty)) [[likely]] {
    return reinterpret_cast<void*>(w & kAddrMask);
  }
  return DerefOrDie(e, true);
}
inline Result<void*> TryDeref(ObjectEntry* e, bool mut) {
  const uint64_t want = mut ? (kPresent | kHot | kDirty) : (kPresent | kHot);
  const uint64_t w = LoadWord(e);
  if ((w & (want | kEvacuating)) == want) return reinterpret_cast<void*>(w & kAddrMask);
  return DerefSlow(e, mut);
}

// What far_ptr and far_bytes share: ownership of one entry.
class FarHandle {
 public:
  FarHandle() = default;
  explicit FarHandle(ObjectEntry* e) : e_(e) {}
  FarHandle(FarHandle&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  FarHandle& operator=(FarHandle&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  ~FarHandle() { reset(); }

  void reset() {
    if (e_ != nullptr) FreeObject(std::exchange(e_, nullptr));
  }
  explicit operator bool() const { return e_ != nullptr; }
  // A snapshot: whether the object was local at the moment of the call.
  bool is_local() const { return e_ != nullptr && (LoadWord(e_) & kPresent) != 0; }
  // Starts bringing the object in without waiting for it.
  void prefetch() const {
    if (e_ != nullptr && (LoadWord(e_) & kPresent) == 0) PrefetchObject(e_);
  }
  ObjectEntry* entry() const { return e_; }

 protected:
  ObjectEntry* e_ = nullptr;
};

}  // namespace farptr_internal

template <typename T>
class far_ptr : public farptr_internal::FarHandle {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "far_ptr<T> needs a trivially copyable, trivially destructible T: objects move "
                "between machines as bytes");

 public:
  far_ptr() = default;
  far_ptr(std::nullptr_t) {}  // NOLINT(google-explicit-constructor)
  far_ptr(far_ptr&&) noexcept = default;
  far_ptr& operator=(far_ptr&&) noexcept = default;

  const T& deref(const DerefScope&) const {
    return *static_cast<const T*>(farptr_internal::DerefConst(e_));
  }
  T& deref_mut(const DerefScope&) { return *static_cast<T*>(farptr_internal::DerefMut(e_)); }
  Result<const T*> try_deref(const DerefScope&) const {
    FARMEM_ASSIGN_OR_RETURN(void* p, farptr_internal::TryDeref(e_, false));
    return static_cast<const T*>(p);
  }
  Result<T*> try_deref_mut(const DerefScope&) {
    FARMEM_ASSIGN_OR_RETURN(void* p, farptr_internal::TryDeref(e_, true));
    return static_cast<T*>(p);
  }

  // Copies in / out under a scope of their own.
  T read() const {
    DerefScope s;
    return deref(s);
  }
  void write(const T& v) {
    DerefScope s;
    deref_mut(s) = v;
  }

  // Takes over an entry made by AllocateObject (for containers).
  static far_ptr adopt(farptr_internal::ObjectEntry* e) {
    far_ptr p;
    p.e_ = e;
    return p;
  }
};

// A far object whose size is chosen at run time (up to one span): a byte array.
class far_bytes : public farptr_internal::FarHandle {
 public:
  far_bytes() = default;
  far_bytes(far_bytes&&) noexcept = default;
  far_bytes& operator=(far_bytes&&) noexcept = default;

  size_t size() const { return e_ == nullptr ? 0 : e_->size; }
  std::span<const std::byte> deref(const DerefScope&) const {
    return {static_cast<const std::byte*>(farptr_internal::DerefConst(e_)), size()};
  }
  std::span<std::byte> deref_mut(const DerefScope&) {
    return {static_cast<std::byte*>(farptr_internal::DerefMut(e_)), size()};
  }
  Result<std::span<const std::byte>> try_deref(const DerefScope&) const {
    FARMEM_ASSIGN_OR_RETURN(void* p, farptr_internal::TryDeref(e_, false));
    return std::span<const std::byte>(static_cast<const std::byte*>(p), size());
  }
  Result<std::span<std::byte>> try_deref_mut(const DerefScope&) {
    FARMEM_ASSIGN_OR_RETURN(void* p, farptr_internal::TryDeref(e_, true));
    return std::span<std::byte>(static_cast<std::byte*>(p), size());
  }

  friend far_bytes make_far_bytes_in(Runtime& rt, size_t size);
};

// Allocates `size` zeroed bytes in `rt`.
inline far_bytes make_far_bytes_in(Runtime& rt, size_t size) {
  DerefScope s;
  void* addr = nullptr;
  far_bytes b;
  b.e_ = farptr_internal::AllocateObject(&rt, size, &addr);
  std::memset(addr, 0, size);
  return b;
}
inline far_bytes make_far_bytes(size_t size) {
  return make_far_bytes_in(*Runtime::Default(), size);
}

// Constructs a T in `rt`. The new object starts local and hot.
template <typename T, typename... Args>
far_ptr<T> make_far_in(Runtime& rt, Args&&... args) {
  DerefScope s;
  void* addr = nullptr;
  farptr_internal::ObjectEntry* e = farptr_internal::AllocateObject(&rt, sizeof(T), &addr);
  ::new (addr) T(std::forward<Args>(args)...);
  return far_ptr<T>::adopt(e);
}

// Constructs a T in the default runtime (Runtime::Default()).
template <typename T, typename... Args>
far_ptr<T> make_far(Args&&... args) {
  return make_far_in<T>(*Runtime::Default(), std::forward<Args>(args)...);
}

}  // namespace farmem
