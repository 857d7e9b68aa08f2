#include "support/process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include "support/wait.h"

namespace farmem::testing {

TempDir::TempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + ".XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    status_ = ErrnoStatus(StatusCode::kIoError, "mkdtemp " + tmpl, errno);
    return;
  }
  path_ = tmpl;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  if (std::getenv("FARMEM_KEEP_TEST_DIRS") != nullptr) {
    std::fprintf(stderr, "[kept %s: FARMEM_KEEP_TEST_DIRS is set]\n", path_.c_str());
    return;
  }
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Result<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                         const SpawnOptions& options) {
  if (argv.empty()) return Err(Status(StatusCode::kInvalidArgument, "spawn: empty argv"));
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
  const int out_flags = O_WRONLY | O_CREAT | (options.append_output ? O_APPEND : O_TRUNC);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Err(ErrnoStatus(StatusCode::kIoError, "fork", errno));
  if (pid == 0) {
    if (options.kill_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    }
    const int out = ::open(options.stdout_path.c_str(), out_flags, 0644);
    const int err = options.stderr_path == options.stdout_path
                        ? out
                        : ::open(options.stderr_path.c_str(), out_flags, 0644);
    if (out >= 0) ::dup2(out, STDOUT_FILENO);
    if (err >= 0) ::dup2(err, STDERR_FILENO);
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
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
    const char msg[] = "test_support: exec failed\n";
    (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  return ChildProcess(pid);
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    Kill();
    pid_ = o.pid_;
    o.pid_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() { Kill(); }

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::optional<int> ChildProcess::TryWait() {
  if (pid_ <= 0) return std::nullopt;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
  pid_ = -1;
  return status;
}

bool ChildProcess::Alive() {
  if (pid_ <= 0) return false;
  return !TryWait().has_value();
}

std::optional<int> ChildProcess::WaitExit(std::chrono::milliseconds timeout) {
  std::optional<int> status;
  WaitUntil([&] { return (status = TryWait()).has_value(); }, timeout);
  return status;
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

int ChildProcess::Stop(int sig, std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, sig);
  if (auto status = WaitExit(timeout)) return *status;
  Kill();
  return -1;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

long ProcStatus(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with(key + ":")) return std::stol(line.substr(key.size() + 1));
  }
  return -1;
}

Status WritePrivateFile(const std::string& path, const std::string& content) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(StatusCode::kIoError, "open " + path, errno);
  const ssize_t n = ::write(fd, content.data(), content.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(content.size())) {
    return ErrnoStatus(StatusCode::kIoError, "write " + path, err);
  }
  return Status::Ok();
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  CommandResult result;
  TempDir dir("farmem-cmd");
  if (!dir.ok()) {
    result.err = dir.status().ToString();
    return result;
  }
  SpawnOptions opts;
  opts.stdout_path = dir.File("out");
  opts.stderr_path = dir.File("err");
  auto child = ChildProcess::Spawn(argv, opts);
  if (!child) {
    result.err = child.error().ToString();
    return result;
  }
  const std::optional<int> status = child->WaitExit(timeout);
  if (!status) child->Kill();
  result.out = ReadFile(dir.File("out"));
  result.err = ReadFile(dir.File("err"));
  if (!status) {
    result.err += "\n[timed out]";
  } else if (WIFEXITED(*status)) {
    result.exit_code = WEXITSTATUS(*status);
  }
  return result;
}

std::string BinDir() {
  const char* d = std::getenv("FARMEM_BIN_DIR");
  return d != nullptr && *d != '\0' ? d : ".";
}

std::string BinPath(const std::string& name) { return BinDir() + "/" + name; }

bool HaveProgram(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (::access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

}  // namespace farmem::testing
