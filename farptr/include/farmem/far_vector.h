// far_vector<T>: an array whose elements live in far memory, usable with a local budget far below
// its size, shaped like std::vector so that range-for and the standard algorithms work on it.
//
// Elements are packed into chunks of kChunkBytes (default 4 KiB); each chunk is one far object,
// so a chunk is fetched, kept hot and evicted as a unit, and consecutive chunks were allocated
// (and tend to be evicted) into the same spans. Only the chunk pointers (8 bytes per chunk) are
// local: 2 bytes of local metadata per KiB of data.
//
// Sequential prefetch: when accesses walk chunks in order, the vector asks the runtime to bring
// the chunks `prefetch_distance` ahead in the background, so a scan finds them local (the swap-in
// of one span brings several chunks at once).
//
//   farmem::far_vector<uint64_t> v(*rt, 10'000'000);
//   v[5] = 42;                                                 // a proxy: writes under its own
//   scope uint64_t sum = std::accumulate(v.begin(), v.end(), 0ull);  // reads element by element
//   std::sort(v.begin(), v.end());
//   { farmem::DerefScope s; v.at_mut(5, s) = 42; }             // a real T&, valid in `s`
//
// Element access comes in two shapes (docs/farptr.md, "far_vector and std::vector"):
//   - The std shape: operator[], front/back and the iterators hand out `reference`, a proxy (an
//     index into the vector, like std::vector<bool>::reference) that reads or writes the element
//     by copy, each access under a DerefScope of its own; on a const vector they hand out T by
//     value. No reference into far memory ever outlives a scope.
//   - The scoped shape: at(i, scope) / at_mut(i, scope) return a real `const T&` / `T&` that stays
//     valid until `scope` ends, and for_each_span(f) hands f a std::span of one chunk at a time:
//     the fast ways through a block of elements.
//
// Threads: like std::vector. Concurrent reads and writes of different elements from many threads
// are safe; push_back/resize/reserve/clear/erase/insert need exclusive access.
#pragma once

#include <algorithm>
#include <atomic>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "farmem/far_ptr.h"
#include "farmem/internal/element_ref.h"

namespace farmem {

template <typename T, size_t kChunkBytes = 4096>
class far_vector {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "far_vector<T> needs a trivially copyable, trivially destructible T");
  static_assert(sizeof(T) <= kChunkBytes, "an element must fit in a chunk");

  template <bool kConst>
  class basic_iterator;

 public:
  static constexpr size_t kPerChunk = kChunkBytes / sizeof(T);
  struct Chunk {
    T items[kPerChunk];
  };

 private:
  struct Slot {  // element i of *v, for `reference`
    far_vector* v;
    size_t i;
    const T& read(const DerefScope& s) const { return v->at(i, s); }
    T& write(const DerefScope& s) const { return v->at_mut(i, s); }
  };

 public:
  // What `v[i]`, `*it`, front() and back() of a non-const vector return: stands for element i of
  // the vector (farmem/internal/element_ref.h). Reading converts to T, assigning writes;
  // assigning one proxy to another copies the value, it does not rebind. Valid while the vector
  // lives and has more than i elements (growth does not invalidate it: chunks never move).
  using reference = farptr_internal::element_ref<T, Slot>;
  using value_type = T;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using const_reference = T;  // a copy: nothing points into far memory outside a scope
  using iterator = basic_iterator<false>;
  using const_iterator = basic_iterator<true>;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  explicit far_vector(Runtime& rt, size_t n = 0, const T& value = T()) : rt_(&rt) {
    // Eight spans' worth of chunks ahead of the scan: the prefetcher reads up to eight spans at
    // once, so their round trips overlap.
    prefetch_distance_ =
        std::max<size_t>(2, 8 * static_cast<size_t>(rt.options().span_size) / kChunkBytes);
    resize(n, value);
  }
  far_vector(Runtime& rt, std::initializer_list<T> init) : far_vector(rt) {
    assign(init.begin(), init.end());
  }
  template <std::input_iterator It, std::sentinel_for<It> S>
  far_vector(Runtime& rt, It first, S last) : far_vector(rt) {
    assign(std::move(first), last);
  }

  // Copying would duplicate far data behind the caller's back: copy explicitly with
  // far_vector(rt, v.begin(), v.end()).
  far_vector(const far_vector&) = delete;
  far_vector& operator=(const far_vector&) = delete;
  // Moves take the chunks; the moved-from vector is empty and stays usable (same runtime).
  far_vector(far_vector&& o) noexcept
      : rt_(o.rt_),
        chunks_(std::move(o.chunks_)),
        size_(std::exchange(o.size_, 0)),
        prefetch_distance_(o.prefetch_distance_) {
    o.chunks_.clear();
    o.ResetPrefetch();
  }
  far_vector& operator=(far_vector&& o) noexcept {
    if (this != &o) {
      rt_ = o.rt_;
      chunks_ = std::move(o.chunks_);  // frees ours
      o.chunks_.clear();
      size_ = std::exchange(o.size_, 0);
      prefetch_distance_ = o.prefetch_distance_;
      ResetPrefetch();
      o.ResetPrefetch();
    }
    return *this;
  }
  void swap(far_vector& o) noexcept {
    std::swap(rt_, o.rt_);
    chunks_.swap(o.chunks_);
    std::swap(size_, o.size_);
    std::swap(prefetch_distance_, o.prefetch_distance_);
    ResetPrefetch();
    o.ResetPrefetch();
  }
  friend void swap(far_vector& a, far_vector& b) noexcept { a.swap(b); }

  Runtime& runtime() const { return *rt_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return chunks_.size() * kPerChunk; }
  size_t max_size() const { return std::vector<far_ptr<Chunk>>().max_size() / kPerChunk; }

  // --- Scoped access: real references, valid until the scope ends. No bounds check. ---
  const T& at(size_t i, const DerefScope& s) const {
    Touch(i / kPerChunk);
    return chunks_[i / kPerChunk].deref(s).items[i % kPerChunk];
  }
  T& at_mut(size_t i, const DerefScope& s) {
    Touch(i / kPerChunk);
    return chunks_[i / kPerChunk].deref_mut(s).items[i % kPerChunk];
  }

  // --- By copy, each under a scope of its own. No bounds check (as std::vector::operator[]). ---
  T get(size_t i) const {
    DerefScope s;
    return at(i, s);
  }
  void set(size_t i, const T& v) {
    DerefScope s;
    at_mut(i, s) = v;
  }
  reference operator[](size_t i) { return reference(Slot{this, i}); }
  T operator[](size_t i) const { return get(i); }
  reference front() { return reference(Slot{this, 0}); }
  T front() const { return get(0); }
  reference back() { return reference(Slot{this, size_ - 1}); }
  T back() const { return get(size_ - 1); }

  // --- Iterators: random access; see `reference`. Not invalidated by growth. ---
  iterator begin() { return iterator(this, 0); }
  iterator end() { return iterator(this, size_); }
  const_iterator begin() const { return const_iterator(this, 0); }
  const_iterator end() const { return const_iterator(this, size_); }
  const_iterator cbegin() const { return begin(); }
  const_iterator cend() const { return end(); }
  reverse_iterator rbegin() { return reverse_iterator(end()); }
  reverse_iterator rend() { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const { return const_reverse_iterator(begin()); }
  const_reverse_iterator crbegin() const { return rbegin(); }
  const_reverse_iterator crend() const { return rend(); }

  // --- Size and capacity. ---
  void push_back(const T& v) {
    if (size_ == capacity()) chunks_.push_back(make_far_in<Chunk>(*rt_));
    set(size_++, v);
  }
  template <typename... Args>
  reference emplace_back(Args&&... args) {
    push_back(T(std::forward<Args>(args)...));
    return back();
  }
  void pop_back() { --size_; }

  // Allocates the chunks for `n` elements now (one far object per chunk).
  void reserve(size_t n) {
    const size_t need = (n + kPerChunk - 1) / kPerChunk;
    chunks_.reserve(need);
    while (chunks_.size() < need) chunks_.push_back(make_far_in<Chunk>(*rt_));
  }

  // Shrinking keeps the chunks (the capacity), as std::vector does; shrink_to_fit frees them.
  void resize(size_t n, const T& value = T()) {
    reserve(n);
    for (size_t i = size_; i < n;) {
      DerefScope s;
      // Fill a chunk at a time.
      Chunk& c = chunks_[i / kPerChunk].deref_mut(s);
      const size_t end = std::min(n, (i / kPerChunk + 1) * kPerChunk);
      for (; i < end; ++i) c.items[i % kPerChunk] = value;
    }
    size_ = n;
  }
  void clear() { size_ = 0; }
  // Gives back the chunks past size() (their far objects are freed).
  void shrink_to_fit() {
    chunks_.resize((size_ + kPerChunk - 1) / kPerChunk);
    chunks_.shrink_to_fit();
    ResetPrefetch();
  }

  void assign(size_t n, const T& value) {
    clear();
    resize(n, value);
  }
  template <std::input_iterator It, std::sentinel_for<It> S>
  void assign(It first, S last) {
    clear();
    if constexpr (std::sized_sentinel_for<S, It>) reserve(static_cast<size_t>(last - first));
    for (; first != last; ++first) push_back(static_cast<T>(*first));
  }

  // Inserts before `pos` and shifts the rest up by one (linear, like std::vector).
  iterator insert(const_iterator pos, const T& value) {
    const size_t at = pos.index();
    push_back(value);
    std::rotate(begin() + at, end() - 1, end());
    return begin() + at;
  }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    const size_t from = first.index(), to = last.index();
    std::move(begin() + to, end(), begin() + from);
    size_ -= to - from;
    return begin() + from;
  }

  // --- Block access: the fast way to run an algorithm over many elements. ---
  // Calls f(std::span<const T>) (or f(std::span<T>), which marks the chunks written) on
  // consecutive pieces of elements [first, last), one chunk per piece, each under a scope of its
  // own; `f` must not keep the span past its call. Prefetches like a sequential scan.
  //   v.for_each_span([&](std::span<const uint64_t> s) {
  //     sum = std::accumulate(s.begin(), s.end(), sum);
  //   });
  template <typename F>
  void for_each_span(size_t first, size_t last, F&& f) const {
    while (first < last) {
      const size_t c = first / kPerChunk;
      const size_t end = std::min(last, (c + 1) * kPerChunk);
      DerefScope s;
      Touch(c);
      const Chunk& chunk = chunks_[c].deref(s);
      f(std::span<const T>(chunk.items + first % kPerChunk, end - first));
      first = end;
    }
  }
  template <typename F>
  void for_each_span(F&& f) const {
    for_each_span(0, size_, std::forward<F>(f));
  }
  template <typename F>
  void for_each_span_mut(size_t first, size_t last, F&& f) {
    while (first < last) {
      const size_t c = first / kPerChunk;
      const size_t end = std::min(last, (c + 1) * kPerChunk);
      DerefScope s;
      Touch(c);
      Chunk& chunk = chunks_[c].deref_mut(s);
      f(std::span<T>(chunk.items + first % kPerChunk, end - first));
      first = end;
    }
  }
  template <typename F>
  void for_each_span_mut(F&& f) {
    for_each_span_mut(0, size_, std::forward<F>(f));
  }

  // Tuning: how many chunks ahead a sequential scan is prefetched (0: never).
  void set_prefetch_distance(size_t chunks) { prefetch_distance_ = chunks; }

 private:
  using arrow_proxy = farptr_internal::arrow_proxy<T>;

  // iterator (kConst false) and const_iterator. A position: the vector and an index.
  template <bool kConst>
  class basic_iterator {
    using Vec = std::conditional_t<kConst, const far_vector, far_vector>;

   public:
    using iterator_concept = std::random_access_iterator_tag;
    // As std::vector<bool>'s: the legacy category says random access although `reference` is a
    // proxy, so that the classic algorithms take their random-access paths.
    using iterator_category = std::random_access_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using reference = std::conditional_t<kConst, T, typename far_vector::reference>;
    using pointer = void;

    basic_iterator() = default;
    // iterator -> const_iterator.
    template <bool kOther>
    requires(kConst && !kOther)
        basic_iterator(const basic_iterator<kOther>& o)  // NOLINT(google-explicit-constructor)
        : v_(o.v_), i_(o.i_) {}

    reference operator*() const {
      if constexpr (kConst) {
        return v_->get(i_);
      } else {
        return reference(Slot{v_, i_});
      }
    }
    reference operator[](difference_type n) const { return *(*this + n); }
    arrow_proxy operator->() const { return arrow_proxy{v_->get(i_)}; }

    basic_iterator& operator++() {
      ++i_;
      return *this;
    }
    basic_iterator operator++(int) {
      basic_iterator t = *this;
      ++i_;
      return t;
    }
    basic_iterator& operator--() {
      --i_;
      return *this;
    }
    basic_iterator operator--(int) {
      basic_iterator t = *this;
      --i_;
      return t;
    }
    basic_iterator& operator+=(difference_type n) {
      i_ = static_cast<size_t>(static_cast<difference_type>(i_) + n);
      return *this;
    }
    basic_iterator& operator-=(difference_type n) { return *this += -n; }
    friend basic_iterator operator+(basic_iterator it, difference_type n) { return it += n; }
    friend basic_iterator operator+(difference_type n, basic_iterator it) { return it += n; }
    friend basic_iterator operator-(basic_iterator it, difference_type n) { return it -= n; }
    friend difference_type operator-(const basic_iterator& a, const basic_iterator& b) {
      return static_cast<difference_type>(a.i_) - static_cast<difference_type>(b.i_);
    }
    friend bool operator==(const basic_iterator& a, const basic_iterator& b) {
      return a.i_ == b.i_;
    }
    friend std::strong_ordering operator<=>(const basic_iterator& a, const basic_iterator& b) {
      return a.i_ <=> b.i_;
    }

    // What std::ranges algorithms use to move and swap elements: by value.
    friend T iter_move(const basic_iterator& it) { return it.v_->get(it.i_); }
    friend void iter_swap(const basic_iterator& a, const basic_iterator& b) requires(!kConst) {
      farptr_internal::swap_elements(a, b);
    }

    size_t index() const { return i_; }

   private:
    friend class far_vector;
    friend class basic_iterator<!kConst>;
    basic_iterator(Vec* v, size_t i) : v_(v), i_(i) {}
    Vec* v_ = nullptr;
    size_t i_ = 0;
  };

  void ResetPrefetch() {
    last_chunk_.store(~size_t{0} - 1, std::memory_order_relaxed);
    streak_.store(0, std::memory_order_relaxed);
    prefetched_.store(0, std::memory_order_relaxed);
  }

  // Sequential-access detector: two steps of +1 chunk in a row start prefetching.
  void Touch(size_t c) const {
    const size_t last = last_chunk_.load(std::memory_order_relaxed);
    if (c == last) return;
    last_chunk_.store(c, std::memory_order_relaxed);
    if (c != last + 1) {
      streak_.store(0, std::memory_order_relaxed);
      return;
    }
    if (streak_.fetch_add(1, std::memory_order_relaxed) < 1 || prefetch_distance_ == 0) return;
    // Hint every chunk in (prefetched_, c + distance]; the runtime drops hints for spans that are
    // already local or on their way.
    const size_t until = std::min(chunks_.size(), c + 1 + prefetch_distance_);
    size_t from = std::max(prefetched_.load(std::memory_order_relaxed), c + 1);
    if (from > until) from = c + 1;  // the scan restarted further back
    for (size_t p = from; p < until; ++p) {
      if (!chunks_[p].is_local()) chunks_[p].prefetch();
    }
    prefetched_.store(std::max(from, until), std::memory_order_relaxed);
  }

  Runtime* rt_;
  std::vector<far_ptr<Chunk>> chunks_;
  size_t size_ = 0;
  size_t prefetch_distance_ = 0;
  mutable std::atomic<size_t> last_chunk_{~size_t{0} - 1};
  mutable std::atomic<size_t> streak_{0};
  mutable std::atomic<size_t> prefetched_{0};
};

}  // namespace farmem
