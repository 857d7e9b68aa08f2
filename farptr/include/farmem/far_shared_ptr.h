// far_shared_ptr<T>: shared ownership of one far object, shaped like std::shared_ptr: copies share
// the object, the last copy to go frees it. What far_ptr<T> is to std::unique_ptr.
//
//   farmem::far_shared_ptr<Order> a = farmem::make_far_shared<Order>(42, 9.5);
//   farmem::far_shared_ptr<Order> b = a;           // a.use_count() == 2, one object
//   b.write(Order{43, 1.0});                        // a sees it: the same object
//   { farmem::DerefScope s; double p = a.deref(s).price; }
//   a.reset();                                      // b still owns it; freed when b goes
//
// The object lives in far memory like any far_ptr's (local when used, remote when cold, evicted
// and fetched back by the runtime); the control block (the use count and the far_ptr) is a small
// local allocation, like std::shared_ptr's when it is not made by make_shared. Access is
// far_ptr's: deref/deref_mut under a DerefScope, read/write by copy. Deviations from
// std::shared_ptr, and why (docs/farptr.md, "far_shared_ptr and std::shared_ptr"):
//   - no operator*, operator-> or get(): a raw pointer or reference into far memory must not
//     outlive a scope, so access names the scope (deref) or copies (read/write);
//   - deref_mut is const, as std::shared_ptr's operator* is: constness of the pointer is not
//     constness of the object;
//   - T is trivially copyable and destructible (far_ptr's rule); no custom deleter or allocator,
//     no aliasing constructor, no weak pointer, no conversions between pointer types.
//
// Threads: as std::shared_ptr. Different far_shared_ptr objects may be copied, assigned and
// destroyed concurrently even when they share the object (the count is atomic; the thread whose
// release takes it to zero frees the object, after every other copy's accesses happened-before).
// One far_shared_ptr object is not to be modified from two threads at once. Concurrent reads of
// the object are safe; writers need the caller's own synchronization, as with far_ptr.
#pragma once

#include <atomic>
#include <compare>
#include <cstddef>
#include <functional>
#include <utility>

#include "farmem/far_ptr.h"

namespace farmem {

template <typename T>
class far_shared_ptr {
 public:
  using element_type = T;

  far_shared_ptr() noexcept = default;
  far_shared_ptr(std::nullptr_t) noexcept {}  // NOLINT(google-explicit-constructor)
  // Takes sole ownership of `p`'s object and shares it from now on (empty p: an empty pointer).
  explicit far_shared_ptr(far_ptr<T>&& p) : c_(p ? new Control{{1}, std::move(p)} : nullptr) {}

  far_shared_ptr(const far_shared_ptr& o) noexcept : c_(o.c_) {
    // Relaxed, as in every shared_ptr: a new reference is made from one that already exists.
    if (c_ != nullptr) c_->count.fetch_add(1, std::memory_order_relaxed);
  }
  far_shared_ptr(far_shared_ptr&& o) noexcept : c_(std::exchange(o.c_, nullptr)) {}
  far_shared_ptr& operator=(const far_shared_ptr& o) noexcept {
    far_shared_ptr(o).swap(*this);
    return *this;
  }
  far_shared_ptr& operator=(far_shared_ptr&& o) noexcept {
    far_shared_ptr(std::move(o)).swap(*this);
    return *this;
  }
  far_shared_ptr& operator=(std::nullptr_t) noexcept {
    reset();
    return *this;
  }
  ~far_shared_ptr() { Release(); }

  void reset() noexcept { far_shared_ptr().swap(*this); }
  void reset(far_ptr<T>&& p) { far_shared_ptr(std::move(p)).swap(*this); }
  void swap(far_shared_ptr& o) noexcept { std::swap(c_, o.c_); }
  friend void swap(far_shared_ptr& a, far_shared_ptr& b) noexcept { a.swap(b); }

  // How many far_shared_ptr share the object (0 when empty). Like std::shared_ptr::use_count,
  // a snapshot that other threads may change at once.
  long use_count() const noexcept {
    return c_ == nullptr ? 0 : c_->count.load(std::memory_order_relaxed);
  }
  explicit operator bool() const noexcept { return c_ != nullptr; }

  // --- Access: far_ptr's, on the shared object. The pointer must not be empty. ---
  const T& deref(const DerefScope& s) const { return c_->object.deref(s); }
  T& deref_mut(const DerefScope& s) const { return c_->object.deref_mut(s); }
  Result<const T*> try_deref(const DerefScope& s) const { return c_->object.try_deref(s); }
  Result<T*> try_deref_mut(const DerefScope& s) const { return c_->object.try_deref_mut(s); }
  T read() const { return c_->object.read(); }
  void write(const T& v) const { c_->object.write(v); }
  bool is_local() const { return c_ != nullptr && c_->object.is_local(); }
  void prefetch() const {
    if (c_ != nullptr) c_->object.prefetch();
  }

  // Two pointers are equal when they share one object (or are both empty); the order is that of
  // the objects' identities, stable while they live (for std::map / std::set keys).
  friend bool operator==(const far_shared_ptr& a, const far_shared_ptr& b) noexcept {
    return a.c_ == b.c_;
  }
  friend bool operator==(const far_shared_ptr& a, std::nullptr_t) noexcept {
    return a.c_ == nullptr;
  }
  friend std::strong_ordering operator<=>(const far_shared_ptr& a,
                                          const far_shared_ptr& b) noexcept {
    return std::compare_three_way()(a.c_, b.c_);
  }

 private:
  friend struct std::hash<far_shared_ptr>;
  struct Control {
    std::atomic<long> count;
    far_ptr<T> object;
  };

  void Release() noexcept {
    // acq_rel: every access through other copies happens-before the free by the last one.
    if (c_ != nullptr && c_->count.fetch_sub(1, std::memory_order_acq_rel) == 1) delete c_;
    c_ = nullptr;
  }

  Control* c_ = nullptr;
};

// Constructs a T in `rt` and shares it. The new object starts local and hot.
template <typename T, typename... Args>
far_shared_ptr<T> make_far_shared_in(Runtime& rt, Args&&... args) {
  return far_shared_ptr<T>(make_far_in<T>(rt, std::forward<Args>(args)...));
}

// Constructs a T in the default runtime (Runtime::Default()) and shares it.
template <typename T, typename... Args>
far_shared_ptr<T> make_far_shared(Args&&... args) {
  return make_far_shared_in<T>(*Runtime::Default(), std::forward<Args>(args)...);
}

}  // namespace farmem

// Hashes the object's identity, consistent with operator==.
template <typename T>
struct std::hash<farmem::far_shared_ptr<T>> {
  size_t operator()(const farmem::far_shared_ptr<T>& p) const noexcept {
    return std::hash<const void*>()(p.c_);
  }
};
