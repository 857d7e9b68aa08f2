// Runs the handshake fuzz target (fuzz_handshake.cc) in every build, with the ordinary compiler
// (and under ASan/UBSan in the sanitizer build): every seed in handshake_corpus/ and every file in
// handshake_regressions/ must pass, and so must deterministic mutations of the seeds. Real
// coverage-guided fuzzing is run_fuzz.sh's job.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace farmem::fuzz {
namespace {

namespace fs = std::filesystem;

std::vector<std::vector<uint8_t>> FilesIn(const fs::path& dir) {
  std::vector<std::vector<uint8_t>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

void Feed(const std::vector<uint8_t>& input) { LLVMFuzzerTestOneInput(input.data(), input.size()); }

TEST(HandshakeFuzzCorpus, SeedsAndRegressionsPass) {
  const auto seeds = FilesIn(fs::path(FARMEM_FUZZ_DIR) / "handshake_corpus");
  EXPECT_GE(seeds.size(), 10u);
  for (const auto& s : seeds) Feed(s);
  for (const auto& r : FilesIn(fs::path(FARMEM_FUZZ_DIR) / "handshake_regressions")) Feed(r);
}

TEST(HandshakeFuzzCorpus, MutationsOfTheSeedsPass) {
  const auto seeds = FilesIn(fs::path(FARMEM_FUZZ_DIR) / "handshake_corpus");
  ASSERT_FALSE(seeds.empty());
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> in = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !in.empty(); ++e) {
      const size_t at = rng() % in.size();
      switch (rng() % 4) {
        case 0:
          in[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:
          in[at] = static_cast<uint8_t>(rng());
          break;
        case 2:
          in.resize(at);
          break;
        default:
          in.insert(in.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng()));
      }
    }
    Feed(in);
  }
}

}  // namespace
}  // namespace farmem::fuzz
