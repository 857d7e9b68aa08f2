// Runs the fuzz targets' checks (fuzz/*.cc) in the ordinary GCC and ASan/UBSan builds: every seed
// of fuzz_corpus/, plus a fixed-seed batch of mutations of each. The real fuzzing needs clang
// (run_fuzz.sh); this keeps the corpus and the invariants exercised on every test run.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace farmem::blockdev::nbd {
int FuzzNbdRequests(const uint8_t* data, size_t size);
int FuzzNbdHandshake(const uint8_t* data, size_t size);
}  // namespace farmem::blockdev::nbd

namespace {

using Target = int (*)(const uint8_t*, size_t);

std::vector<std::vector<uint8_t>> Seeds(const std::string& sub) {
  const char* src = std::getenv("FARMEM_SOURCE_DIR");
  const std::filesystem::path dir =
      std::filesystem::path(src != nullptr ? src : ".") / "tests/blockdev/fuzz_corpus" / sub;
  std::vector<std::vector<uint8_t>> seeds;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream f(entry.path(), std::ios::binary);
    seeds.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  return seeds;
}

void RunWithMutations(Target target, const std::vector<std::vector<uint8_t>>& seeds) {
  std::mt19937 rng(20261130);
  for (const auto& seed : seeds) {
    target(seed.data(), seed.size());
    for (int i = 0; i < 3000; ++i) {
      std::vector<uint8_t> m = seed;
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits && !m.empty(); ++e) {
        const size_t at = rng() % m.size();
        switch (rng() % 5) {
          case 0:
            m[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
            break;
          case 1:
            m[at] = static_cast<uint8_t>(rng());
            break;
          case 2:
            m[at] = (rng() % 2) ? 0xff : 0x00;
            break;
          case 3:
            m.resize(at);
            break;
          case 4: {
            const auto& other = seeds[rng() % seeds.size()];
            m.insert(m.begin() + static_cast<long>(at), other.begin(), other.end());
            break;
          }
        }
      }
      target(m.data(), m.size());
    }
  }
}

TEST(NbdFuzzReplay, RequestCorpusAndMutations) {
  const auto seeds = Seeds("request");
  ASSERT_GE(seeds.size(), 5u);
  RunWithMutations(farmem::blockdev::nbd::FuzzNbdRequests, seeds);
}

TEST(NbdFuzzReplay, HandshakeCorpusAndMutations) {
  const auto seeds = Seeds("handshake");
  ASSERT_GE(seeds.size(), 5u);
  RunWithMutations(farmem::blockdev::nbd::FuzzNbdHandshake, seeds);
}

}  // namespace
