// Global operator new/delete that count allocations (counting_new.h). Kept in its own
// translation unit so the compiler cannot inline them into the test body (GCC 12 then reports
// -Wmismatched-new-delete false positives).
#include "support/counting_new.h"

#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

namespace farmem::testing {
namespace {
std::atomic<long> g_allocations{0};
// Trivially initialized thread_locals: reading them in operator new needs no TLS init call.
thread_local bool t_counting = false;
thread_local uint64_t t_allocations = 0;
const bool g_trace = std::getenv("FARMEM_ALLOC_TRACE") != nullptr;
const bool g_abort = std::getenv("FARMEM_ALLOC_ABORT") != nullptr;

// Where this thread's allocation came from: backtrace_symbols_fd does not allocate; the first
// backtrace() call does (it loads libgcc_s), made by SetThreadCounting before counting starts.
void Trace(std::size_t size) {
  t_counting = false;
  void* frames[24];
  const int n = backtrace(frames, 24);
  char line[64] = "---- allocation on the data path: ";
  std::size_t at = std::strlen(line);
  char digits[24];
  std::size_t nd = 0;
  do {
    digits[nd++] = static_cast<char>('0' + size % 10);
    size /= 10;
  } while (size != 0);
  while (nd > 0) line[at++] = digits[--nd];
  std::memcpy(line + at, " bytes\n", 7);
  (void)!::write(2, line, at + 7);
  backtrace_symbols_fd(frames, n, 2);
  t_counting = true;
}
}  // namespace

long AllocationCount() { return g_allocations.load(std::memory_order_relaxed); }

uint64_t ThreadAllocationCount() { return t_allocations; }

bool SetThreadCounting(bool on) {
  if (on && g_trace) {
    void* frames[4];
    (void)backtrace(frames, 4);  // loads libgcc_s now, not while counting
  }
  const bool was = t_counting;
  t_counting = on;
  return was;
}

void CountAllocation(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (!t_counting) return;
  ++t_allocations;
  if (g_abort) std::abort();
  if (g_trace) Trace(size);
}

}  // namespace farmem::testing

void* operator new(std::size_t size) {
  farmem::testing::CountAllocation(size);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t align) {
  farmem::testing::CountAllocation(size);
  const std::size_t a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (size + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
// Every other replaceable form too: one left out would come from the library (or from ASan's
// allocator, in the ASan tree) while its memory is freed here (ASan: alloc-dealloc mismatch).
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  farmem::testing::CountAllocation(size);
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new(std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  farmem::testing::CountAllocation(size);
  const std::size_t a = static_cast<std::size_t>(align);
  return std::aligned_alloc(a, (size + a - 1) / a * a);
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void* operator new[](std::size_t size, std::align_val_t align) {
  return ::operator new(size, align);
}
void* operator new[](std::size_t size, const std::nothrow_t& t) noexcept {
  return ::operator new(size, t);
}
void* operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t& t) noexcept {
  return ::operator new(size, align, t);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
