// Writes the seed corpus of fuzz_frame_parser (seed_frames.h) into a directory, one file per
// frame: make_seed_corpus tests/fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "seed_frames.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  for (const auto& [name, bytes] : farmem::fuzz::MakeSeedFrames()) {
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
      return 1;
    }
  }
  return 0;
}
