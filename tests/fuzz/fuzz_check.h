// FUZZ_CHECK(cond): an invariant of a fuzz target. When it does not hold, the file, line and
// condition go to stderr and the process traps, which libFuzzer (and the replay tests) report as a
// crash with the input that caused it.
#pragma once

#include <cstdio>

#define FUZZ_CHECK(cond)                                                                \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      __builtin_trap();                                                                 \
    }                                                                                   \
  } while (0)
