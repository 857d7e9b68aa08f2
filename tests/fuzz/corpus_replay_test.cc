// Runs the fuzz target in every build, with the ordinary compiler (and under ASan/UBSan in the
// sanitizer build): the committed corpus must match what the encoders produce today, every corpus
// and regression file must pass, and so must a fixed set of deterministic mutations of them.
// Real coverage-guided fuzzing is run_fuzz.sh's job; this keeps the target and corpus honest.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

#include "seed_frames.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace farmem::fuzz {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::vector<uint8_t>> FilesIn(const fs::path& dir) {
  std::vector<std::vector<uint8_t>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file()) out.push_back(ReadFile(e.path()));
  }
  return out;
}

void Feed(const std::vector<uint8_t>& input) { LLVMFuzzerTestOneInput(input.data(), input.size()); }

TEST(FuzzCorpus, CommittedSeedsMatchTheEncoders) {
  const fs::path dir = fs::path(FARMEM_FUZZ_DIR) / "corpus";
  const SeedFrames seeds = MakeSeedFrames();
  EXPECT_LT(seeds.size(), 50u);
  for (const auto& [name, bytes] : seeds) {
    ASSERT_TRUE(fs::exists(dir / name))
        << (dir / name) << " is missing: run make_seed_corpus " << dir.string();
    EXPECT_EQ(ReadFile(dir / name), bytes)
        << name << " no longer matches the wire format: regenerate with make_seed_corpus";
  }
}

TEST(FuzzCorpus, EveryCorpusAndRegressionFilePasses) {
  size_t n = 0;
  for (const char* sub : {"corpus", "regressions"}) {
    for (const auto& input : FilesIn(fs::path(FARMEM_FUZZ_DIR) / sub)) {
      Feed(input);
      ++n;
    }
  }
  EXPECT_GE(n, MakeSeedFrames().size());
}

// Mutations in the spirit of libFuzzer's: bit flips, interesting values over length fields,
// truncation, insertion, splicing.
std::vector<uint8_t> Mutate(std::mt19937_64& rng, std::vector<uint8_t> in,
                            const std::vector<std::vector<uint8_t>>& pool) {
  static constexpr uint32_t kInteresting[] = {0,
                                              1,
                                              7,
                                              8,
                                              24,
                                              1023,
                                              1024,
                                              1025,
                                              0x7fffffff,
                                              0x80000000,
                                              0xffffffff,
                                              wire::kMaxDataLen,
                                              wire::kMaxDataLen + 1,
                                              wire::kMaxBodyLen,
                                              wire::kMaxBodyLen + 1,
                                              wire::kMaxControlBodyLen + 1};
  const int steps = 1 + static_cast<int>(rng() % 4);
  for (int s = 0; s < steps; ++s) {
    const size_t pos = in.empty() ? 0 : rng() % in.size();
    switch (rng() % 7) {
      case 0:
        if (!in.empty()) in[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        if (!in.empty()) in[pos] = static_cast<uint8_t>(rng());
        break;
      case 2:
        if (in.size() >= 4) {
          const uint32_t v = kInteresting[rng() % std::size(kInteresting)];
          std::memcpy(&in[rng() % (in.size() - 3)], &v, 4);
        }
        break;
      case 3:
        in.resize(in.empty() ? 0 : rng() % in.size());
        break;
      case 4:
        in.insert(in.begin() + static_cast<ptrdiff_t>(pos), 1 + rng() % 32,
                  static_cast<uint8_t>(rng()));
        break;
      case 5: {
        const auto& other = pool[rng() % pool.size()];
        in.insert(in.end(), other.begin(), other.end());
        break;
      }
      default:
        if (in.size() >= 8) {
          const uint64_t v = rng() % 2 ? ~uint64_t{0} - rng() % 64 : rng();
          std::memcpy(&in[rng() % (in.size() - 7)], &v, 8);
        }
        break;
    }
  }
  return in;
}

TEST(FuzzCorpus, DeterministicMutationsPass) {
  std::vector<std::vector<uint8_t>> pool;
  for (const auto& [name, bytes] : MakeSeedFrames()) pool.push_back(bytes);
  std::mt19937_64 rng(20240601);
  constexpr int kPerSeed = 4000;
  for (const auto& seed : pool) {
    for (int i = 0; i < kPerSeed; ++i) Feed(Mutate(rng, seed, pool));
  }
}

}  // namespace
}  // namespace farmem::fuzz
