// Process helpers for the blockdev integration tests: start farmem-nbd and third-party NBD
// clients (nbdinfo, nbdcopy, qemu-io, fio), capture their output, stop them.
// Each object is used by one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::blockdev::testing {

// A private directory under /tmp (short enough for Unix socket paths), removed with its contents.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct SpawnOptions {
  std::string stdout_path = "/dev/null";
  std::string stderr_path = "/dev/null";
  // If >= 0: installed as fd 3 with LISTEN_FDS=1 and LISTEN_PID=<child> (socket activation).
  int activation_fd = -1;
};

class ChildProcess {
 public:
  static Result<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                    const SpawnOptions& options = {});
  ChildProcess(ChildProcess&& o) noexcept : pid_(o.pid_) { o.pid_ = -1; }
  ChildProcess& operator=(ChildProcess&&) = delete;
  ~ChildProcess();  // SIGKILL + reap if still running

  pid_t pid() const { return pid_; }
  bool Alive();
  // Sends `sig` and waits up to `timeout` for exit. Returns the wait status, or -1 on timeout
  // (the process is then killed).
  int Stop(int sig, std::chrono::milliseconds timeout);

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

struct CommandResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out;
  std::string err;
};
// Runs a program to completion (killed after `timeout`), capturing stdout and stderr.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Waits until something accepts connections on the Unix socket at `path`.
bool WaitForUnixSocket(const std::string& path, std::chrono::milliseconds timeout);

// Where farmem-nbd and the other programs were built (FARMEM_BIN_DIR).
std::string BinDir();
std::string FarmemNbdPath();
bool HaveProgram(const std::string& name);  // on PATH
std::string ReadFile(const std::string& path);

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
  ChildProcess process_;
};

}  // namespace farmem::blockdev::testing
