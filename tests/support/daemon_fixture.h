// Real farmemd processes for integration tests: start N daemons on 127.0.0.1, kill one (SIGKILL,
// or SIGSTOP to make it hang), restart it on the same port, stop them all at teardown.
//
// Header-only so any test folder can use it: link farmem::test_support (tests/support/) and
//   #include "support/daemon_fixture.h"
//
//   farmem::testing::DaemonSet daemons({.capacity = "8M", .slab_size = "1M"});
//   ASSERT_TRUE(daemons.Start(3).ok());
//   options.peers = daemons.endpoints(); options.secret = daemons.secret();
//   daemons[1].Kill();  ...  ASSERT_TRUE(daemons[1].Restart().ok());
//
// farmemd is found through $FARMEM_BIN_DIR (set by farmem_add_test). Each daemon logs to
// <work dir>/farmemd-<i>.log; a failure to start quotes the end of that log. The work dir (secret
// file, port files, logs) is removed at teardown unless FARMEM_KEEP_TEST_DIRS is set.
// Daemons get PR_SET_PDEATHSIG, so a crashed test does not leave them running.
//
// Threads: a DaemonProcess/DaemonSet belongs to the test's main thread (PR_SET_PDEATHSIG fires when
// the thread that started the daemon exits).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/status.h"

namespace farmem::testing {

// How to run each farmemd. Small defaults keep tests light: 16 slabs of 1 MiB.
struct DaemonConfig {
  std::string capacity = "16M";
  std::string slab_size = "1M";
  std::string secret = "farmem-test-secret";  // empty: no --secret-file (an open daemon)
  std::optional<uint32_t> lease_ttl_ms{};     // unset: farmemd's default
  std::string log_level = "info";
  // Where to listen. "::" (dual-stack wildcard) makes one daemon reachable as 127.0.0.1 and ::1.
  std::string listen_host = "127.0.0.1";
  std::vector<std::string> extra_args{};
  std::chrono::milliseconds start_timeout{10000};
  // farmemd --max-client-share. Tests often fill a daemon with one client on purpose, so the
  // fixture lets one client take everything; empty: farmemd's default.
  std::string max_client_share = "1";
};

// $FARMEM_BIN_DIR/<name>, or ./<name> when the variable is unset.
inline std::string BinPath(const std::string& name) {
  const char* dir = std::getenv("FARMEM_BIN_DIR");
  return (dir != nullptr && *dir != '\0') ? std::string(dir) + "/" + name : "./" + name;
}

// A fresh private directory under $TMPDIR (or /tmp).
inline Result<std::string> MakeTempDir(const std::string& prefix = "farmem-test") {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + "-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return Err(ErrnoStatus(StatusCode::kIoError, "mkdtemp " + tmpl, errno));
  }
  return tmpl;
}

// Writes a file readable by its owner only (farmemd warns about looser secret files).
inline Status WritePrivateFile(const std::string& path, const std::string& content) {
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

// One farmemd on 127.0.0.1. The first Start() lets the daemon pick a free port (--listen :0,
// --port-file); later starts reuse that port, so clients that knew it find the restarted daemon.
class DaemonProcess {
 public:
  DaemonProcess(DaemonConfig config, std::string work_dir, std::string name)
      : config_(std::move(config)), work_dir_(std::move(work_dir)), name_(std::move(name)) {}
  ~DaemonProcess() { (void)Stop(); }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Starts the daemon and waits until it listens. Fails (with the daemon's log) if it exits or
  // does not come up within config.start_timeout.
  Status Start() {
    if (pid_ > 0) return Status(StatusCode::kInvalidArgument, name_ + " is already running");
    const std::string port_file = work_dir_ + "/" + name_ + ".port";
    std::filesystem::remove(port_file);
    std::vector<std::string> args = {
        BinPath("farmemd"),
        "--listen",
        Endpoint{config_.listen_host, port_}.ToString(),  // port 0 the first time: daemon picks
        "--capacity",
        config_.capacity,
        "--slab-size",
        config_.slab_size,
        "--port-file",
        port_file,
        "--log-level",
        config_.log_level,
    };
    if (!config_.secret.empty()) {
      const std::string secret_file = work_dir_ + "/secret";
      FARMEM_RETURN_IF_ERROR(WritePrivateFile(secret_file, config_.secret));
      args.insert(args.end(), {"--secret-file", secret_file});
    }
    if (!config_.max_client_share.empty()) {
      args.insert(args.end(), {"--max-client-share", config_.max_client_share});
    }
    if (config_.lease_ttl_ms) {
      args.insert(args.end(), {"--lease-ttl-ms", std::to_string(*config_.lease_ttl_ms)});
    }
    args.insert(args.end(), config_.extra_args.begin(), config_.extra_args.end());
    FARMEM_RETURN_IF_ERROR(Spawn(args));

    const auto deadline = std::chrono::steady_clock::now() + config_.start_timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return Status(StatusCode::kUnavailable, name_ + " (farmemd) exited at start (" +
                                                    DescribeExit(status) + "); its log ends:\n" +
                                                    LogTail());
      }
      std::ifstream in(port_file);
      unsigned port = 0;
      if (in >> port && port > 0 && port <= 65535) {
        port_ = static_cast<uint16_t>(port);
        return Status::Ok();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    Kill();
    return Status(StatusCode::kDeadlineExceeded, name_ + " (farmemd) did not listen within " +
                                                     std::to_string(config_.start_timeout.count()) +
                                                     " ms; its log ends:\n" + LogTail());
  }

  // SIGKILL (no goodbye to anyone) and reap.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // SIGSTOP / SIGCONT: the daemon keeps its sockets but answers nothing (a hung node).
  void Pause() {
    if (pid_ > 0) ::kill(pid_, SIGSTOP);
  }
  void Resume() {
    if (pid_ > 0) ::kill(pid_, SIGCONT);
  }

  // SIGTERM, then SIGKILL if it has not exited within `grace`. Ok if it exited cleanly.
  Status Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(5000)) {
    if (pid_ <= 0) return Status::Ok();
    ::kill(pid_, SIGTERM);
    ::kill(pid_, SIGCONT);  // a paused daemon must run to handle SIGTERM
    const auto deadline = std::chrono::steady_clock::now() + grace;
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::Ok();
        return Status(StatusCode::kInternal,
                      name_ + " exited badly on SIGTERM (" + DescribeExit(status) + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    Kill();
    return Status(StatusCode::kDeadlineExceeded,
                  name_ + " ignored SIGTERM for " + std::to_string(grace.count()) + " ms");
  }

  // Kill, then start again on the same port: a new daemon incarnation (new node id, no leases).
  Status Restart() {
    Kill();
    return Start();
  }

  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  uint16_t port() const { return port_; }
  // Where clients reach it (127.0.0.1 when it listens on a wildcard).
  Endpoint endpoint() const {
    const bool wildcard = config_.listen_host == "::" || config_.listen_host == "0.0.0.0";
    return Endpoint{wildcard ? "127.0.0.1" : config_.listen_host, port_};
  }
  const std::string& name() const { return name_; }
  std::string log_path() const { return work_dir_ + "/" + name_ + ".log"; }

  std::string LogTail(size_t max_bytes = 4000) const {
    std::ifstream in(log_path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    return s.size() > max_bytes ? s.substr(s.size() - max_bytes) : s;
  }

 private:
  Status Spawn(const std::vector<std::string>& args) {
    // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const std::string log = log_path();
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) return ErrnoStatus(StatusCode::kInternal, "fork", errno);
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        if (fd > STDERR_FILENO) ::close(fd);
      }
      ::execv(argv[0], argv.data());
      const char msg[] = "daemon_fixture: execv farmemd failed\n";
      (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    pid_ = pid;
    return Status::Ok();
  }

  static std::string DescribeExit(int status) {
    if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
    return "status " + std::to_string(status);
  }

  DaemonConfig config_;
  std::string work_dir_;
  std::string name_;
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

// N daemons sharing one config, secret and work dir.
class DaemonSet {
 public:
  explicit DaemonSet(DaemonConfig config = {}) : config_(std::move(config)) {}
  ~DaemonSet() {
    StopAll();
    if (!work_dir_.empty() && std::getenv("FARMEM_KEEP_TEST_DIRS") == nullptr) {
      std::error_code ec;
      std::filesystem::remove_all(work_dir_, ec);
    }
  }
  DaemonSet(const DaemonSet&) = delete;
  DaemonSet& operator=(const DaemonSet&) = delete;

  // Starts n more daemons, one after the other (each waits until it listens).
  Status Start(size_t n) {
    if (work_dir_.empty()) {
      FARMEM_ASSIGN_OR_RETURN(work_dir_, MakeTempDir());
    }
    for (size_t i = 0; i < n; ++i) {
      const size_t index = daemons_.size();
      daemons_.push_back(
          std::make_unique<DaemonProcess>(config_, work_dir_, "farmemd-" + std::to_string(index)));
      FARMEM_RETURN_IF_ERROR(daemons_.back()->Start());
    }
    return Status::Ok();
  }

  DaemonProcess& operator[](size_t i) { return *daemons_.at(i); }
  size_t size() const { return daemons_.size(); }
  const std::string& secret() const { return config_.secret; }
  const std::string& work_dir() const { return work_dir_; }

  std::vector<Endpoint> endpoints() const {
    std::vector<Endpoint> out;
    for (const auto& d : daemons_) out.push_back(d->endpoint());
    return out;
  }

  void StopAll() {
    for (auto& d : daemons_) (void)d->Stop();
  }

  // The logs of every daemon, for a failure message.
  std::string Logs(size_t max_bytes_each = 2000) const {
    std::string out;
    for (const auto& d : daemons_) {
      out += "---- " + d->name() + " (" + d->endpoint().ToString() + ") ----\n" +
             d->LogTail(max_bytes_each) + "\n";
    }
    return out;
  }

 private:
  DaemonConfig config_;
  std::string work_dir_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
};

}  // namespace farmem::testing
