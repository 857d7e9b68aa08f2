// The element proxy of the far containers (far_vector, far_list): what `v[i]`, `*it`, front()
// and back() of a non-const container return, so that range-for and the standard algorithms
// (std::sort, std::accumulate, std::find_if...) work although no reference into far memory may
// outlive a DerefScope. Not a public API: use the containers' `reference`.
//
// element_ref<T, Slot> stands for one element. Reading converts to T (one deref under a scope of
// its own), assigning writes (one deref_mut); assigning one proxy to another copies the value, it
// does not rebind (like std::vector<bool>::reference). Comparisons compare the values.
//
// `Slot` is the container's small copyable locator of one element, with
//   const T& read(const DerefScope& s) const;   // the element, valid in `s`
//   T& write(const DerefScope& s) const;        // the same, marked written
// A proxy is valid as long as its slot is (each container says when that is).
//
// Threads: a proxy is a value; the container's rules decide who may read or write the element.
#pragma once

#include <compare>
#include <concepts>

#include "farmem/far_ptr.h"

namespace farmem::farptr_internal {

template <typename T, typename Slot>
class element_ref {
 public:
  explicit element_ref(Slot slot) : slot_(slot) {}
  element_ref(const element_ref&) = default;

  operator T() const { return get(); }  // NOLINT(google-explicit-constructor)
  T get() const {
    DerefScope s;
    return slot_.read(s);
  }
  const element_ref& operator=(const T& x) const {
    DerefScope s;
    slot_.write(s) = x;
    return *this;
  }
  const element_ref& operator=(const element_ref& o) const { return *this = o.get(); }

  // Read-modify-write under one scope.
  template <typename U>
  const element_ref& operator+=(const U& x) const requires requires(T& t) {
    t += x;
  }
  {
    DerefScope s;
    slot_.write(s) += x;
    return *this;
  }
  template <typename U>
  const element_ref& operator-=(const U& x) const requires requires(T& t) {
    t -= x;
  }
  {
    DerefScope s;
    slot_.write(s) -= x;
    return *this;
  }

  friend void swap(element_ref a, element_ref b) {
    const T t = a.get();
    a = b.get();
    b = t;
  }

  friend bool operator==(const element_ref& a,
                         const element_ref& b) requires std::equality_comparable<T> {
    return a.get() == b.get();
  }
  friend bool operator==(const element_ref& a, const T& b) requires std::equality_comparable<T> {
    return a.get() == b;
  }
  friend auto operator<=>(const element_ref& a,
                          const element_ref& b) requires std::three_way_comparable<T> {
    return a.get() <=> b.get();
  }
  friend auto operator<=>(const element_ref& a, const T& b) requires std::three_way_comparable<T> {
    return a.get() <=> b;
  }
  // For a T that only has operator< (what std::sort needs).
  friend bool operator<(const element_ref& a,
                        const element_ref& b) requires(!std::three_way_comparable<T>) &&
      requires(const T& x) {
    x < x;
  }
  { return a.get() < b.get(); }
  friend bool operator<(const element_ref& a, const T& b) requires(!std::three_way_comparable<T>) &&
      requires(const T& x) {
    x < x;
  }
  { return a.get() < b; }
  friend bool operator<(const T& a, const element_ref& b) requires(!std::three_way_comparable<T>) &&
      requires(const T& x) {
    x < x;
  }
  { return a < b.get(); }

 private:
  Slot slot_;
};

// What `operator->` of a far container's iterator returns: a copy of the element, read-only
// (writing a field through it would write the copy: assign the whole element through `*it`).
template <typename T>
struct arrow_proxy {
  T value;
  const T* operator->() const { return &value; }
};

// The iter_swap of a far container's mutable iterator: by value through the proxies. (Not
// `swap(*a, *b)`: inside a container that name is the member swap.)
template <typename It>
void swap_elements(const It& a, const It& b) {
  const auto ra = *a, rb = *b;
  const typename It::value_type t = ra;
  ra = rb;
  rb = t;
}

}  // namespace farmem::farptr_internal
