// The outside project of tests/package: far_ptr<T> and a far_vector on the farmemd daemon given by
// --peers, through the installed headers and libraries only. Prints "consumer ok <sum>".
#include <cstdio>
#include <cstdlib>
#include <string>

#include "farmem/common/config.h"
#include "farmem/common/version.h"
#include "farmem/far_ptr.h"
#include "farmem/far_vector.h"
#include "farmem/runtime.h"

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "--peers") {
    std::fprintf(stderr, "usage: consumer --peers host:port\n");
    return 2;
  }
  farmem::RuntimeOptions opts;
  auto peers = farmem::ParseEndpointList(argv[2], farmem::kDefaultPort);
  if (!peers) {
    std::fprintf(stderr, "--peers: %s\n", peers.error().ToString().c_str());
    return 2;
  }
  opts.peers = *peers;
  opts.resilience = "none";
  opts.local_budget = 1u << 20;
  opts.span_size = 64u << 10;
  auto rt = farmem::Runtime::Create(opts);
  if (!rt) {
    std::fprintf(stderr, "farmem: %s\n", rt.error().ToString().c_str());
    return 1;
  }
  uint64_t sum = 0;
  {
    farmem::far_vector<uint64_t> v(**rt);
    for (uint64_t i = 1; i <= 100000; ++i) v.push_back(i);  // 800 KB: past half the budget
    for (size_t i = 0; i < v.size(); ++i) sum += v.get(i);
    farmem::far_ptr<uint64_t> p = farmem::make_far_in<uint64_t>(**rt, sum);
    farmem::DerefScope scope;
    if (p.deref(scope) != sum) return 1;
  }
  std::printf("consumer ok %lu (farmem %s)\n", static_cast<unsigned long>(sum),
              std::string(farmem::kVersionString).c_str());
  return sum == 100000ull * 100001 / 2 ? 0 : 1;
}
