// Child processes and temporary directories for tests: the one implementation every test folder
// uses (farmemd daemons in daemon_fixture.h, farmem-nbd and third-party NBD clients in
// tests/blockdev, the chaos suite's workloads).
//
//   farmem::testing::TempDir dir;                       // removed with its contents at scope end
//   auto p = farmem::testing::ChildProcess::Spawn({BinPath("farmem-nbd"), ...},
//                                                 {.stderr_path = dir.File("nbd.log")});
//   CommandResult r = RunCommand({"nbdinfo", uri});     // to completion, output captured
//
// Link farmem::test_support and #include "support/process.h".
// Threads: each object is used by one thread. Spawn may be called while other threads run (the
// child makes only async-signal-safe calls between fork and exec).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::testing {

// A fresh private directory under $TMPDIR (or /tmp), removed with its contents by the destructor
// unless FARMEM_KEEP_TEST_DIRS is set (then its path is printed, to look at after a failure).
// Keep `prefix` short: Unix socket paths inside it are limited to 107 bytes.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "farmem-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Empty if the directory could not be made (ok() false; status() says why).
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }
  const Status& status() const { return status_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  Status status_;
};

struct SpawnOptions {
  std::string stdout_path = "/dev/null";
  std::string stderr_path = "/dev/null";
  bool append_output = false;  // append to stdout_path/stderr_path instead of truncating them
  // SIGKILL the child when the thread that spawned it exits (PR_SET_PDEATHSIG), so a crashed test
  // leaves nothing running.
  bool kill_with_parent = false;
  // If >= 0: installed as fd 3 with LISTEN_FDS=1 and LISTEN_PID=<child> (socket activation).
  int activation_fd = -1;
};

// A running child (argv[0] is looked up on PATH unless it holds a '/'). The destructor SIGKILLs
// and reaps it if it is still running.
class ChildProcess {
 public:
  static Result<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                    const SpawnOptions& options = {});
  ChildProcess(ChildProcess&& o) noexcept : pid_(o.pid_) { o.pid_ = -1; }
  ChildProcess& operator=(ChildProcess&& o) noexcept;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  // Reaps the child if it has exited. False once it has exited.
  bool Alive();
  // The wait status if the child has exited (it is then reaped), nullopt if it still runs.
  std::optional<int> TryWait();
  // Waits up to `timeout` for the child to exit: its wait status, or nullopt (still running).
  std::optional<int> WaitExit(std::chrono::milliseconds timeout);
  void Signal(int sig);
  // Sends `sig` and waits up to `timeout` for exit. Returns the wait status, or -1 on timeout
  // (the process is then killed).
  int Stop(int sig, std::chrono::milliseconds timeout);
  // SIGKILL and reap (no-op if not running).
  void Kill();

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

// "exit code 3", "signal Killed", for messages.
std::string DescribeExit(int wait_status);

struct CommandResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out;
  std::string err;
};
// Runs a program to completion (killed after `timeout`), capturing stdout and stderr.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         std::chrono::milliseconds timeout = std::chrono::seconds(60));

// $FARMEM_BIN_DIR (set by farmem_add_test), or "." when it is unset.
std::string BinDir();
// BinDir()/<name>.
std::string BinPath(const std::string& name);
bool HaveProgram(const std::string& name);  // on PATH
// The whole file ("" if unreadable).
std::string ReadFile(const std::string& path);
// A number from /proc/PID/status: ProcStatus(pid, "VmRSS") in KiB, "Threads"; -1 if unreadable.
long ProcStatus(pid_t pid, const std::string& key);
// Writes a file readable by its owner only (farmemd warns about looser secret files).
Status WritePrivateFile(const std::string& path, const std::string& content);

}  // namespace farmem::testing
