// far_vector<T>: an array whose elements live in far memory, usable with a local budget far below
// its size.
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
//   { farmem::DerefScope s; v.at_mut(5, s) = 42; }
//   uint64_t x = v.get(5);
//
// Threads: like std::vector. Concurrent at()/at_mut()/get()/set() from many threads are safe
// when no two threads write the same element; push_back/resize need exclusive access.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "farmem/far_ptr.h"

namespace farmem {

template <typename T, size_t kChunkBytes = 4096>
class far_vector {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "far_vector<T> needs a trivially copyable, trivially destructible T");
  static_assert(sizeof(T) <= kChunkBytes, "an element must fit in a chunk");

 public:
  static constexpr size_t kPerChunk = kChunkBytes / sizeof(T);
  struct Chunk {
    T items[kPerChunk];
  };

  explicit far_vector(Runtime& rt, size_t n = 0, const T& value = T()) : rt_(&rt) {
    resize(n, value);
    // Eight spans' worth of chunks ahead of the scan: the prefetcher reads up to eight spans at
    // once, so their round trips overlap.
    prefetch_distance_ =
        std::max<size_t>(2, 8 * static_cast<size_t>(rt.options().span_size) / kChunkBytes);
  }
  far_vector(const far_vector&) = delete;
  far_vector& operator=(const far_vector&) = delete;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  const T& at(size_t i, const DerefScope& s) const {
    Touch(i / kPerChunk);
    return chunks_[i / kPerChunk].deref(s).items[i % kPerChunk];
  }
  T& at_mut(size_t i, const DerefScope& s) {
    Touch(i / kPerChunk);
    return chunks_[i / kPerChunk].deref_mut(s).items[i % kPerChunk];
  }
  T get(size_t i) const {
    DerefScope s;
    return at(i, s);
  }
  void set(size_t i, const T& v) {
    DerefScope s;
    at_mut(i, s) = v;
  }

  void push_back(const T& v) {
    if (size_ == chunks_.size() * kPerChunk) chunks_.push_back(make_far_in<Chunk>(*rt_));
    set(size_++, v);
  }

  void resize(size_t n, const T& value = T()) {
    const size_t need = (n + kPerChunk - 1) / kPerChunk;
    while (chunks_.size() < need) chunks_.push_back(make_far_in<Chunk>(*rt_));
    for (size_t i = size_; i < n; ++i) {
      DerefScope s;
      // Fill a chunk at a time.
      Chunk& c = chunks_[i / kPerChunk].deref_mut(s);
      const size_t end = std::min(n, (i / kPerChunk + 1) * kPerChunk);
      for (; i < end; ++i) c.items[i % kPerChunk] = value;
      --i;
    }
    size_ = n;
    if (chunks_.size() > need) chunks_.resize(need);
  }

  // Tuning: how many chunks ahead a sequential scan is prefetched (0: never).
  void set_prefetch_distance(size_t chunks) { prefetch_distance_ = chunks; }

 private:
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
