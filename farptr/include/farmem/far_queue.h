// far_queue<T>: a FIFO queue whose elements live in far memory, with std::queue's interface.
//
// A container adaptor over far_list<T> (as std::queue is over std::deque): elements are pushed
// at the high end of the last chunk and popped from the low end of the first, so only the two
// end chunks need to be local; the chunks in between may be evicted while they wait, and are
// swapped back in when the front reaches them (when the front empties a chunk, the next two are
// prefetched, so a steady consumer finds them local).
//
//   farmem::far_queue<Job> q(*rt);
//   q.push(job);  q.emplace(id, cost);
//   while (!q.empty()) { Job j = q.front(); q.pop(); run(j); }
//
// front()/back() return far_list's proxy `reference` (assignable; converts to T), or T on a
// const queue. Threads: like std::queue: one writer, or any number of readers.
#pragma once

#include <cstddef>
#include <utility>

#include "farmem/far_list.h"

namespace farmem {

template <typename T, typename Container = far_list<T>>
class far_queue {
 public:
  using container_type = Container;
  using value_type = typename Container::value_type;
  using size_type = typename Container::size_type;
  using reference = typename Container::reference;
  using const_reference = typename Container::const_reference;

  explicit far_queue(Runtime& rt) : c_(rt) {}
  explicit far_queue(Container&& c) : c_(std::move(c)) {}
  far_queue(const far_queue&) = delete;
  far_queue& operator=(const far_queue&) = delete;
  far_queue(far_queue&&) noexcept = default;
  far_queue& operator=(far_queue&&) noexcept = default;

  reference front() { return c_.front(); }
  const_reference front() const { return c_.front(); }
  reference back() { return c_.back(); }
  const_reference back() const { return c_.back(); }
  bool empty() const { return c_.empty(); }
  size_type size() const { return c_.size(); }

  void push(const value_type& v) { c_.push_back(v); }
  template <typename... Args>
  reference emplace(Args&&... args) {
    return c_.emplace_back(std::forward<Args>(args)...);
  }
  void pop() { c_.pop_front(); }
  void swap(far_queue& o) noexcept { c_.swap(o.c_); }
  friend void swap(far_queue& a, far_queue& b) noexcept { a.swap(b); }

  // The underlying list (std::queue keeps it as the protected member `c`).
  const Container& container() const { return c_; }

 private:
  Container c_;
};

}  // namespace farmem
