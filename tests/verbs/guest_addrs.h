// The guest's addresses for the verbs tests: deploy/vm/run --addrs N puts them, space-separated,
// in FARMEM_VM_ADDRS (each on an rxe-backed interface).
#pragma once

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace farmem::testing {

inline std::vector<std::string> GuestAddrs() {
  const char* env = std::getenv("FARMEM_VM_ADDRS");
  std::vector<std::string> out;
  std::istringstream in(env != nullptr ? env : "");
  for (std::string a; in >> a;) out.push_back(a);
  return out;
}

}  // namespace farmem::testing
