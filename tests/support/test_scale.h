// FARMEM_LONG_TESTS=1: the long host workloads run at their by-hand size. CI runs a short form of
// them (docs/testing.md, "Short and long forms").
#pragma once

#include <cstdlib>
#include <string_view>

namespace farmem::testing {

inline bool LongTests() {
  const char* v = std::getenv("FARMEM_LONG_TESTS");
  return v != nullptr && std::string_view(v) != "" && std::string_view(v) != "0";
}

}  // namespace farmem::testing
