#include "test_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "nbd_test_client.h"

namespace farmem::blockdev::testing {

TempDir::TempDir() {
  char tmpl[] = "/tmp/farmem-nbd-test.XXXXXX";
  const char* p = ::mkdtemp(tmpl);
  path_ = p != nullptr ? p : "/tmp";
}

TempDir::~TempDir() {
  std::error_code ec;
  if (path_ != "/tmp") std::filesystem::remove_all(path_, ec);
}

Result<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                         const SpawnOptions& options) {
  // Everything the child needs is prepared before fork(): the test process has other threads,
  // so the child may only make async-signal-safe calls (no malloc, no setenv).
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view kv(*e);
    if (kv.starts_with("LISTEN_PID=") || kv.starts_with("LISTEN_FDS=")) continue;
    env_storage.emplace_back(kv);
  }
  char listen_pid[32] = "LISTEN_PID=";
  static char listen_fds[] = "LISTEN_FDS=1";
  std::vector<char*> env;
  for (std::string& kv : env_storage) env.push_back(kv.data());
  if (options.activation_fd >= 0) {
    env.push_back(listen_fds);
    env.push_back(listen_pid);
  }
  env.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Err(ErrnoStatus(StatusCode::kIoError, "fork", errno));
  if (pid == 0) {
    const int out = ::open(options.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(options.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out >= 0) ::dup2(out, 1);
    if (err >= 0) ::dup2(err, 2);
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    if (options.activation_fd >= 0) {
      if (options.activation_fd != 3) {
        ::dup2(options.activation_fd, 3);
      } else {
        ::fcntl(3, F_SETFD, 0);
      }
      // Append the pid's digits by hand (async-signal-safe).
      char digits[16];
      int n = 0;
      for (pid_t v = ::getpid(); v > 0 && n < 15; v /= 10)
        digits[n++] = static_cast<char>('0' + v % 10);
      char* p = listen_pid + 11;
      while (n > 0) *p++ = digits[--n];
      *p = '\0';
    }
    ::execvpe(args[0], args.data(), env.data());
    ::_exit(127);
  }
  return ChildProcess(pid);
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

bool ChildProcess::Alive() {
  if (pid_ <= 0) return false;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    pid_ = -1;
    return false;
  }
  return r == 0;
}

int ChildProcess::Stop(int sig, std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, sig);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
  return -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  TempDir dir;
  SpawnOptions opts;
  opts.stdout_path = dir.File("out");
  opts.stderr_path = dir.File("err");
  CommandResult result;
  auto child = ChildProcess::Spawn(argv, opts);
  if (!child) {
    result.err = child.error().ToString();
    return result;
  }
  const pid_t pid = child->pid();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  bool exited = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (exited) {
    // Reaped here; keep the destructor from signalling a recycled pid.
    ChildProcess moved(std::move(*child));
    (void)moved.Alive();
  } else {
    child->Stop(SIGKILL, std::chrono::seconds(5));
  }
  result.out = ReadFile(dir.File("out"));
  result.err = ReadFile(dir.File("err"));
  if (!exited) {
    result.err += "\n[timed out]";
  } else if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  }
  return result;
}

bool WaitForUnixSocket(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ConnectUnix(path).has_value()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

std::string BinDir() {
  const char* d = std::getenv("FARMEM_BIN_DIR");
  return d != nullptr ? d : ".";
}

std::string FarmemNbdPath() { return BinDir() + "/farmem-nbd"; }

bool HaveProgram(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (::access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

Result<std::unique_ptr<FarmemNbd>> FarmemNbd::Start(const std::string& size,
                                                    std::vector<std::string> extra_args) {
  std::vector<std::string> args = {"--backend", "memory", "--size", size};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  return Launch(std::move(args));
}

Result<std::unique_ptr<FarmemNbd>> FarmemNbd::Launch(std::vector<std::string> args) {
  auto dir = std::make_unique<TempDir>();
  const std::string sock = dir->File("nbd.sock");
  std::vector<std::string> argv = {FarmemNbdPath(), "--unix", sock, "--no-swap-safe"};
  argv.insert(argv.end(), args.begin(), args.end());
  SpawnOptions opts;
  opts.stderr_path = dir->File("stderr.log");
  FARMEM_ASSIGN_OR_RETURN(ChildProcess p, ChildProcess::Spawn(argv, opts));
  if (!WaitForUnixSocket(sock, std::chrono::seconds(20))) {
    return Err(Unavailable("farmem-nbd did not start: " + ReadFile(dir->File("stderr.log"))));
  }
  return std::unique_ptr<FarmemNbd>(new FarmemNbd(std::move(dir), sock, std::move(p)));
}

}  // namespace farmem::blockdev::testing
