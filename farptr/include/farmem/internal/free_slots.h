// FreeSlots: which slots of one far_ptr span are free, a bit each (Span::free_slots in
// farptr/src/heap.h). Not a public API: here so that a unit test reaches it.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

namespace farmem::farptr_internal {

// The free slots of one span, a bit each (1 = free): 1/32 of what a list of slot numbers took,
// which the frames get back when the budget includes metadata. Take() hands out the lowest free
// slot.
class FreeSlots {
 public:
  // n slots, all free (a fresh span) or none (a span made to hold lost objects, the compactor's
  // rebuild, which Puts the free ones after).
  void Reset(uint32_t n, bool all_free) {
    words_.assign((n + 63) / 64, all_free ? ~0ull : 0ull);
    if (all_free && n % 64 != 0) words_.back() = (1ull << (n % 64)) - 1;
    free_ = all_free ? n : 0;
    first_word_ = 0;
  }
  void Release() {  // the span retires: give the memory back
    words_.clear();
    words_.shrink_to_fit();
    free_ = 0;
    first_word_ = 0;
  }
  bool empty() const { return free_ == 0; }
  uint32_t size() const { return free_; }
  // The lowest free slot, now taken. Not empty().
  uint32_t Take() {
    while (words_[first_word_] == 0) ++first_word_;
    uint64_t& w = words_[first_word_];
    const uint32_t slot = first_word_ * 64 + static_cast<uint32_t>(std::countr_zero(w));
    w &= w - 1;
    --free_;
    return slot;
  }
  void Put(uint32_t slot) {  // slot < n, and taken
    words_[slot / 64] |= 1ull << (slot % 64);
    ++free_;
    first_word_ = std::min(first_word_, slot / 64);
  }
  static uint64_t BytesFor(uint32_t n) { return (n + 63) / 64 * 8ull; }

 private:
  std::vector<uint64_t> words_;
  uint32_t free_ = 0;
  uint32_t first_word_ = 0;  // no free slot in the words before it
};

}  // namespace farmem::farptr_internal
