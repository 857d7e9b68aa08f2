// What the benchmarks' main functions share. Their command lines are CLI11's, with farmem's
// --version (common/command_line.h), like every farmem program's:
//   CLI::App app{"what it measures"};
//   farmem::cli::AddVersionOption(app, "nbd_move_bench");
//   app.add_option("--seconds", a.seconds, "...")->capture_default_str();
//   app.add_option("--resilience", a.modes, "...")->delimiter(',');   // a comma-separated list
//   CLI11_PARSE(app, argc, argv);
//   farmem::bench::UseBinariesBeside(argv[0]);
// so that a typo fails with a message naming it and --help lists every option with its default.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace farmem::bench {

// The daemons a benchmark starts through the tests' fixture (tests/support/daemon_fixture.h) are
// the ones built beside it, unless $FARMEM_BIN_DIR says otherwise.
inline void UseBinariesBeside(const char* argv0) {
  if (std::getenv("FARMEM_BIN_DIR") != nullptr) return;
  const std::string dir = std::filesystem::absolute(argv0).parent_path().string();
  ::setenv("FARMEM_BIN_DIR", dir.c_str(), 1);
}

// The options of the benchmarks where a lender asks its memory back while a workload reads
// (nbd_move_bench, farptr_move_bench): the resilience modes to run one after the other, the
// notice's grace, and how long the steady windows before and after last.
inline void AddMoveOptions(CLI::App& app, std::vector<std::string>& modes, uint32_t& grace_ms,
                           int& seconds) {
  app.add_option("--resilience", modes, "resilience modes, comma-separated")
      ->capture_default_str()
      ->delimiter(',');
  app.add_option("--grace-ms", grace_ms, "eviction notice grace")->capture_default_str();
  app.add_option("--seconds", seconds, "steady seconds before and after")->capture_default_str();
}

}  // namespace farmem::bench
