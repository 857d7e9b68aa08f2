// Allocation counting for tests that guard a data path against heap allocation: a test binary
// that compiles tests/support/counting_new.cc into itself (farmem_add_test SOURCES) has every
// global operator new counted. Link it only into binaries that want it: it replaces the
// allocator for the whole program, and every thread's allocations count.
#pragma once

namespace farmem::testing {

// Global operator new calls (all forms) since the program started; a test takes the difference
// around the code it checks.
long AllocationCount();

}  // namespace farmem::testing
