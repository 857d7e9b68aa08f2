// Allocation counting for tests that guard a data path against heap allocation: a test binary
// that links farmem::counting_new (tests/support/counting_new.cc) has every global operator new
// counted — every replaceable form (plain, array, nothrow, aligned), so that the sanitizers'
// allocators see one consistent pair of new and delete. Link it only into binaries that want it:
// it replaces the allocator for the whole program.
//
// Two counts: one for the whole process (every thread's allocations, always), and one per thread
// that counts only while that thread switched it on (SetThreadCounting): a test of one thread's
// request path over real daemons, whose other threads (heartbeats, recovery) allocate as they
// please. While a thread counts, FARMEM_ALLOC_TRACE=1 in the environment prints each of its
// allocations' size and stack to stderr, and FARMEM_ALLOC_ABORT=1 aborts at the first (for gdb).
#pragma once

#include <cstdint>

namespace farmem::testing {

// Global operator new calls (all forms, every thread) since the program started; a test takes
// the difference around the code it checks.
long AllocationCount();

// This thread's operator new calls made while its counting was on, since the thread started.
uint64_t ThreadAllocationCount();
// Switches the counting of this thread's allocations on or off; returns whether it was on.
// Switching it on the first time with FARMEM_ALLOC_TRACE set loads what the stack trace needs
// first (that allocates), so the trace itself is not counted.
bool SetThreadCounting(bool on);

// Counts this thread's allocations from its construction (counting on) to its destruction.
class ThreadAllocationScope {
 public:
  ThreadAllocationScope() : before_(ThreadAllocationCount()), was_(SetThreadCounting(true)) {}
  ~ThreadAllocationScope() { SetThreadCounting(was_); }
  ThreadAllocationScope(const ThreadAllocationScope&) = delete;
  ThreadAllocationScope& operator=(const ThreadAllocationScope&) = delete;
  uint64_t count() const { return ThreadAllocationCount() - before_; }

 private:
  uint64_t before_;
  bool was_;
};

}  // namespace farmem::testing
