// far_list<T>: a sequence whose elements live in far memory, usable with a local budget far below
// its size, shaped like std::list so that range-for and the standard algorithms work on it.
//
// Layout: an unrolled list. Elements are packed into chunks of kChunkBytes (default 4 KiB); each
// chunk is one far object holding a run items[lo, hi) of consecutive elements, so a chunk is
// fetched, kept hot and evicted as a unit. Locally there is only a std::list of chunk
// descriptors (the far pointer and lo/hi: one list node, ~40 bytes, per chunk), so a list of
// millions of elements needs only a few bytes of local memory per KiB of data, and walking it
// touches one chunk at a time. A forward scan prefetches: reading the first element of a chunk
// through an iterator hints the next two chunks to the runtime's prefetcher.
//
//   farmem::far_list<uint64_t> l(*rt);
//   l.push_back(1);  l.push_front(0);                      // never moves other elements
//   auto it = std::find_if(l.begin(), l.end(), pred);      // bidirectional iterators
//   l.insert(it, 7);  l.erase(it2);
//   uint64_t sum = std::accumulate(l.begin(), l.end(), 0ull);
//   for (auto&& x : l) x = x * 2;                          // `x` is a proxy: writes the list
//
// push_front/pop_front/push_back/pop_back are O(1) and move no element (a chunk grows at its low
// end towards the front, at its high end towards the back). insert/erase in the middle shift the
// elements of one chunk (at most kChunkBytes of memmove, towards the end that is closer or has
// room) and split a full chunk in two: unlike std::list, they invalidate iterators into that
// chunk (docs/farptr.md, "far_list and std::list").
//
// Element access: as far_vector's. front/back and the iterators of a non-const list hand out
// `reference`, a proxy that reads or writes the element by copy under a DerefScope of its own;
// on a const list, T by value. No reference into far memory ever outlives a scope.
//
// Threads: like std::list: one writer, or any number of readers.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <list>
#include <type_traits>
#include <utility>

#include "farmem/far_ptr.h"
#include "farmem/internal/element_ref.h"

namespace farmem {

template <typename T, size_t kChunkBytes = 4096>
class far_list {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "far_list<T> needs a trivially copyable, trivially destructible T");
  static_assert(sizeof(T) <= kChunkBytes / 2, "at least two elements must fit in a chunk");

  template <bool kConst>
  class basic_iterator;

 public:
  static constexpr size_t kPerChunk = kChunkBytes / sizeof(T);
  struct Chunk {
    T items[kPerChunk];
  };

 private:
  // One chunk: its elements are items[lo, hi), never empty while in the list.
  struct Seg {
    far_ptr<Chunk> chunk;
    uint32_t lo = 0;
    uint32_t hi = 0;
  };
  using Segs = std::list<Seg>;
  using SegIt = typename Segs::iterator;
  using SegCIt = typename Segs::const_iterator;
  struct Slot {  // element items[off] of one chunk, for `reference`
    SegIt seg;
    uint32_t off;
    const T& read(const DerefScope& s) const { return seg->chunk.deref(s).items[off]; }
    T& write(const DerefScope& s) const { return seg->chunk.deref_mut(s).items[off]; }
  };

 public:
  // What `*it`, front() and back() of a non-const list return: stands for one element
  // (farmem/internal/element_ref.h). Reading converts to T (one deref), assigning writes;
  // assigning one proxy to another copies the value. Valid as long as an iterator to the element
  // would be.
  using reference = farptr_internal::element_ref<T, Slot>;
  using value_type = T;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using const_reference = T;  // a copy: nothing points into far memory outside a scope
  using iterator = basic_iterator<false>;
  using const_iterator = basic_iterator<true>;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  explicit far_list(Runtime& rt) : rt_(&rt) {}
  far_list(Runtime& rt, size_t n, const T& value = T()) : far_list(rt) {
    for (size_t i = 0; i < n; ++i) push_back(value);
  }
  far_list(Runtime& rt, std::initializer_list<T> init) : far_list(rt, init.begin(), init.end()) {}
  template <std::input_iterator It, std::sentinel_for<It> S>
  far_list(Runtime& rt, It first, S last) : far_list(rt) {
    for (; first != last; ++first) push_back(static_cast<T>(*first));
  }

  // Copying would duplicate far data behind the caller's back: copy explicitly with
  // far_list(rt, l.begin(), l.end()).
  far_list(const far_list&) = delete;
  far_list& operator=(const far_list&) = delete;
  // Moves take the chunks; the moved-from list is empty and stays usable (same runtime). Unlike
  // std::list's, iterators do not survive a move or swap (they hold their list's end); proxies
  // do.
  far_list(far_list&& o) noexcept
      : rt_(o.rt_), segs_(std::move(o.segs_)), size_(std::exchange(o.size_, 0)) {
    o.segs_.clear();
  }
  far_list& operator=(far_list&& o) noexcept {
    if (this != &o) {
      rt_ = o.rt_;
      segs_ = std::move(o.segs_);  // frees ours
      o.segs_.clear();
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  void swap(far_list& o) noexcept {
    std::swap(rt_, o.rt_);
    segs_.swap(o.segs_);
    std::swap(size_, o.size_);
  }
  friend void swap(far_list& a, far_list& b) noexcept { a.swap(b); }

  Runtime& runtime() const { return *rt_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t max_size() const { return Segs().max_size() * kPerChunk; }
  // Far objects (chunks) the list holds; each holds 1..kPerChunk elements.
  size_t chunk_count() const { return segs_.size(); }

  // --- Element access (no check for an empty list, as std::list). ---
  reference front() { return reference(Slot{segs_.begin(), segs_.front().lo}); }
  T front() const { return Get(segs_.begin(), segs_.front().lo); }
  reference back() { return reference(Slot{std::prev(segs_.end()), segs_.back().hi - 1}); }
  T back() const { return Get(std::prev(segs_.end()), segs_.back().hi - 1); }

  // --- Iterators: bidirectional; see `reference`. ---
  iterator begin() { return iterator(&segs_, segs_.begin(), segs_.empty() ? 0 : segs_.front().lo); }
  iterator end() { return iterator(&segs_, segs_.end(), 0); }
  const_iterator begin() const {
    return const_iterator(&segs_, segs_.begin(), segs_.empty() ? 0 : segs_.front().lo);
  }
  const_iterator end() const { return const_iterator(&segs_, segs_.end(), 0); }
  const_iterator cbegin() const { return begin(); }
  const_iterator cend() const { return end(); }
  reverse_iterator rbegin() { return reverse_iterator(end()); }
  reverse_iterator rend() { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const { return const_reverse_iterator(begin()); }
  const_reverse_iterator crbegin() const { return rbegin(); }
  const_reverse_iterator crend() const { return rend(); }

  // --- Modifiers at the ends: O(1), no other element moves, no iterator is invalidated. ---
  void push_back(const T& v) {
    if (segs_.empty() || segs_.back().hi == kPerChunk) NewSeg(segs_.end(), 0);
    Seg& s = segs_.back();
    Set(std::prev(segs_.end()), s.hi, v);
    ++s.hi;
    ++size_;
  }
  void push_front(const T& v) {
    if (segs_.empty() || segs_.front().lo == 0) NewSeg(segs_.begin(), kPerChunk);
    Seg& s = segs_.front();
    Set(segs_.begin(), s.lo - 1, v);
    --s.lo;
    ++size_;
  }
  template <typename... Args>
  reference emplace_back(Args&&... args) {
    push_back(T(std::forward<Args>(args)...));
    return back();
  }
  template <typename... Args>
  reference emplace_front(Args&&... args) {
    push_front(T(std::forward<Args>(args)...));
    return front();
  }
  // A chunk that empties is freed; the two after the new front (what a FIFO reads next) are
  // prefetched.
  void pop_front() {
    --size_;
    if (++segs_.front().lo == segs_.front().hi) {
      segs_.pop_front();
      if (!segs_.empty()) PrefetchFrom(std::next(segs_.begin()));
    }
  }
  void pop_back() {
    --size_;
    if (segs_.back().lo == --segs_.back().hi) segs_.pop_back();
  }
  void clear() {
    segs_.clear();
    size_ = 0;
  }

  // --- Modifiers in the middle: shift the elements of one chunk; invalidate iterators into
  // that chunk (and into the new one when it splits), no others. ---
  // Inserts before `pos`; returns an iterator to the new element.
  iterator insert(const_iterator pos, const T& value) {
    if (pos.seg_ == segs_.end()) {
      push_back(value);
      return iterator(&segs_, std::prev(segs_.end()), segs_.back().hi - 1);
    }
    SegIt seg = segs_.erase(pos.seg_, pos.seg_);  // const -> mutable
    uint32_t off = pos.off_;
    if (off == seg->lo) {
      // Before the first element of a chunk: into free room at its low end, or at the high end
      // of the chunk before; no element moves.
      if (seg->lo > 0) {
        Set(seg, --seg->lo, value);
        ++size_;
        return iterator(&segs_, seg, seg->lo);
      }
      if (seg != segs_.begin() && std::prev(seg)->hi < kPerChunk) {
        SegIt p = std::prev(seg);
        Set(p, p->hi++, value);
        ++size_;
        return iterator(&segs_, p, p->hi - 1);
      }
    }
    if (seg->lo == 0 && seg->hi == kPerChunk) {
      // Full: move the upper half to a new chunk after this one.
      const uint32_t mid = kPerChunk / 2;
      SegIt next = NewSeg(std::next(seg), 0);
      {
        DerefScope s;
        const Chunk& from = seg->chunk.deref(s);
        Chunk& to = next->chunk.deref_mut(s);
        std::copy(from.items + mid, from.items + kPerChunk, to.items);
      }
      next->hi = kPerChunk - mid;
      seg->hi = mid;
      if (off > mid) {
        seg = next;
        off -= mid;
      }
    }
    // Now the chunk has room at one end: shift towards it.
    DerefScope s;
    Chunk& c = seg->chunk.deref_mut(s);
    ++size_;
    if (seg->hi < kPerChunk && (seg->lo == 0 || seg->hi - off <= off - seg->lo)) {
      std::copy_backward(c.items + off, c.items + seg->hi, c.items + seg->hi + 1);
      ++seg->hi;
      c.items[off] = value;
      return iterator(&segs_, seg, off);
    }
    std::copy(c.items + seg->lo, c.items + off, c.items + seg->lo - 1);
    --seg->lo;
    c.items[off - 1] = value;
    return iterator(&segs_, seg, off - 1);
  }
  template <typename... Args>
  iterator emplace(const_iterator pos, Args&&... args) {
    return insert(pos, T(std::forward<Args>(args)...));
  }
  iterator insert(const_iterator pos, size_t n, const T& value) {
    iterator it = MakeMutable(pos);
    for (size_t i = 0; i < n; ++i) it = insert(it, value);
    return it;
  }
  template <std::input_iterator It, std::sentinel_for<It> S>
  iterator insert(const_iterator pos, It first, S last) {
    // Each element goes before the element that followed the previous one (the one at `pos`).
    // A later insert may shift the chunk of an earlier one: the first is found again by
    // stepping back from the last.
    iterator after = MakeMutable(pos);
    size_t n = 0;
    for (; first != last; ++first, ++n) after = std::next(insert(after, static_cast<T>(*first)));
    return std::prev(after, static_cast<difference_type>(n));
  }

  // Erases the element at `pos`; returns an iterator to the one after it.
  iterator erase(const_iterator pos) {
    SegIt seg = segs_.erase(pos.seg_, pos.seg_);
    const uint32_t off = pos.off_;
    --size_;
    if (seg->hi - seg->lo == 1) {
      SegIt next = segs_.erase(seg);
      return iterator(&segs_, next, next == segs_.end() ? 0 : next->lo);
    }
    if (off + 1 == seg->hi) {  // the last of its chunk
      --seg->hi;
      SegIt next = std::next(seg);
      return iterator(&segs_, next, next == segs_.end() ? 0 : next->lo);
    }
    if (off == seg->lo) {
      ++seg->lo;
      return iterator(&segs_, seg, seg->lo);
    }
    // Shift the shorter side over the hole.
    DerefScope s;
    Chunk& c = seg->chunk.deref_mut(s);
    if (off - seg->lo < seg->hi - off - 1) {
      std::copy_backward(c.items + seg->lo, c.items + off, c.items + off + 1);
      ++seg->lo;
      return iterator(&segs_, seg, off + 1);
    }
    std::copy(c.items + off + 1, c.items + seg->hi, c.items + off);
    --seg->hi;
    return iterator(&segs_, seg, off);
  }
  iterator erase(const_iterator first, const_iterator last) {
    // Erasing shifts elements within a chunk, which moves `last` when it is in the same chunk:
    // count first, then erase one at a time.
    size_t n = static_cast<size_t>(std::distance(first, last));
    iterator it = MakeMutable(first);
    while (n-- > 0) it = erase(it);
    return it;
  }
  void resize(size_t n, const T& value = T()) {
    while (size_ > n) pop_back();
    while (size_ < n) push_back(value);
  }

  // Erases every element for which pred(T) holds; returns how many (std::list::remove_if).
  template <typename Pred>
  size_t remove_if(Pred pred) {
    size_t removed = 0;
    for (iterator it = begin(); it != end();) {
      if (pred(static_cast<T>(*it))) {
        it = erase(it);
        ++removed;
      } else {
        ++it;
      }
    }
    return removed;
  }
  size_t remove(const T& value) requires std::equality_comparable<T> {
    return remove_if([&](const T& x) { return x == value; });
  }
  friend size_t erase_if(far_list& l, auto pred) { return l.remove_if(pred); }

 private:
  using arrow_proxy = farptr_internal::arrow_proxy<T>;

  template <bool kConst>
  class basic_iterator {
    using It = std::conditional_t<kConst, SegCIt, SegIt>;
    using List = std::conditional_t<kConst, const Segs, Segs>;

   public:
    using iterator_concept = std::bidirectional_iterator_tag;
    // As far_vector's: the legacy category says bidirectional although `reference` is a proxy.
    using iterator_category = std::bidirectional_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using reference = std::conditional_t<kConst, T, typename far_list::reference>;
    using pointer = void;

    basic_iterator() = default;
    template <bool kOther>
    requires(kConst && !kOther)
        basic_iterator(const basic_iterator<kOther>& o)  // NOLINT(google-explicit-constructor)
        : segs_(o.segs_), seg_(o.seg_), off_(o.off_) {}

    reference operator*() const {
      PrefetchAhead();
      if constexpr (kConst) {
        return Get(seg_, off_);
      } else {
        return reference(Slot{seg_, off_});
      }
    }
    arrow_proxy operator->() const {
      PrefetchAhead();
      return arrow_proxy{Get(seg_, off_)};
    }

    basic_iterator& operator++() {
      if (++off_ == seg_->hi) {
        ++seg_;
        if (seg_ == segs_->end()) {
          off_ = 0;
        } else {
          off_ = seg_->lo;
        }
      }
      return *this;
    }
    basic_iterator operator++(int) {
      basic_iterator t = *this;
      ++*this;
      return t;
    }
    basic_iterator& operator--() {
      if (seg_ == segs_->end() || off_ == seg_->lo) {
        --seg_;
        off_ = seg_->hi - 1;
      } else {
        --off_;
      }
      return *this;
    }
    basic_iterator operator--(int) {
      basic_iterator t = *this;
      --*this;
      return t;
    }
    friend bool operator==(const basic_iterator& a, const basic_iterator& b) {
      return a.seg_ == b.seg_ && a.off_ == b.off_;
    }

    friend T iter_move(const basic_iterator& it) {
      it.PrefetchAhead();
      return Get(it.seg_, it.off_);
    }
    friend void iter_swap(const basic_iterator& a, const basic_iterator& b) requires(!kConst) {
      farptr_internal::swap_elements(a, b);
    }

   private:
    friend class far_list;
    friend class basic_iterator<!kConst>;
    // A forward scan reading the first element of a chunk: bring the next two in the background
    // (hints for local chunks cost a load). Only reads prefetch: std::next/std::distance do not.
    void PrefetchAhead() const {
      if (off_ != seg_->lo) return;
      auto n = std::next(seg_);
      for (int i = 0; i < 2 && n != segs_->end(); ++i, ++n) n->chunk.prefetch();
    }
    basic_iterator(List* segs, It seg, uint32_t off) : segs_(segs), seg_(seg), off_(off) {}
    List* segs_ = nullptr;
    It seg_{};
    uint32_t off_ = 0;
  };

  static T Get(SegCIt seg, uint32_t off) {
    DerefScope s;
    return seg->chunk.deref(s).items[off];
  }
  static void Set(SegIt seg, uint32_t off, const T& v) {
    DerefScope s;
    seg->chunk.deref_mut(s).items[off] = v;
  }
  // A new empty chunk before `pos`, with its run starting (empty) at `at`.
  SegIt NewSeg(SegIt pos, uint32_t at) {
    return segs_.insert(pos, Seg{make_far_in<Chunk>(*rt_), at, at});
  }
  SegIt NewSeg(SegCIt pos, uint32_t at) { return NewSeg(segs_.erase(pos, pos), at); }
  iterator MakeMutable(const_iterator it) {
    return iterator(&segs_, segs_.erase(it.seg_, it.seg_), it.off_);
  }
  void PrefetchFrom(SegCIt seg) const {
    for (int i = 0; i < 2 && seg != segs_.end(); ++i, ++seg) seg->chunk.prefetch();
  }

  Runtime* rt_;
  Segs segs_;
  size_t size_ = 0;
};

}  // namespace farmem
