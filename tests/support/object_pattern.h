// Deterministic object contents for far_ptr tests and the chaos suite's far_ptr workload: the bytes
// of object `id` at `version`, so that any byte that comes back wrong shows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace farmem::testing {

inline void FillObject(std::span<std::byte> out, uint64_t id, uint64_t version) {
  uint64_t x = id * 0x9E3779B97F4A7C15ull + version * 0xBF58476D1CE4E5B9ull + 1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (i % 8 == 0) {
      x ^= x >> 31;
      x *= 0x94D049BB133111EBull;
      x ^= x >> 29;
    }
    out[i] = static_cast<std::byte>(x >> ((i % 8) * 8));
  }
}

}  // namespace farmem::testing
