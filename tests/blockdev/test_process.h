// farmem-nbd for the blockdev integration tests, on a Unix socket in its own temp dir. Child
// processes, temp dirs and RunCommand are tests/support/process.h's, named here too so blockdev
// tests can say testing::ChildProcess.
// Each object is used by one thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "farmem/common/status.h"
#include "support/process.h"

namespace farmem::blockdev::testing {

using farmem::testing::BinDir;
using farmem::testing::ChildProcess;
using farmem::testing::CommandResult;
using farmem::testing::HaveProgram;
using farmem::testing::ReadFile;
using farmem::testing::RunCommand;
using farmem::testing::SpawnOptions;
using farmem::testing::TempDir;

// How many times `needle` occurs in `text`, not overlapping (log lines counted in a process's log).
inline size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos;
       pos = text.find(needle, pos + needle.size())) {
    ++n;
  }
  return n;
}

// Waits until something accepts connections on the Unix socket at `path`.
bool WaitForUnixSocket(const std::string& path, std::chrono::milliseconds timeout);

std::string FarmemNbdPath();

// farmem-nbd on a Unix socket in its own TempDir, swap-safe mode off: Start() with --backend
// memory, Launch() with whatever backend the arguments choose.
class FarmemNbd {
 public:
  static Result<std::unique_ptr<FarmemNbd>> Start(const std::string& size,
                                                  std::vector<std::string> extra_args = {});
  // farmem-nbd --unix <socket> --no-swap-safe <args> (any backend).
  static Result<std::unique_ptr<FarmemNbd>> Launch(std::vector<std::string> args);
  const std::string& socket_path() const { return socket_; }
  std::string uri() const { return "nbd+unix:///?socket=" + socket_; }
  ChildProcess& process() { return process_; }
  std::string log() const { return ReadFile(dir_->File("stderr.log")); }

 private:
  FarmemNbd(std::unique_ptr<TempDir> dir, std::string socket, ChildProcess p)
      : dir_(std::move(dir)), socket_(std::move(socket)), process_(std::move(p)) {}
  std::unique_ptr<TempDir> dir_;
  std::string socket_;
  ChildProcess process_;  // declared after dir_: killed before its directory is removed
};

}  // namespace farmem::blockdev::testing
