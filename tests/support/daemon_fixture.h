// Real farmemd processes for integration tests: start N daemons on 127.0.0.1, kill one (SIGKILL,
// or SIGSTOP to make it hang), restart it on the same port, stop them all at teardown.
//
// Any test folder can use it: link farmem::test_support (tests/support/) and
//   #include "support/daemon_fixture.h"
// Processes and the work dir are support/process.h's ChildProcess and TempDir.
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

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/status.h"
#include "support/process.h"
#include "support/wait.h"

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
  // Port of the first Start (later starts reuse the port). 0: the daemon picks a free one.
  // Daemons behind one DNS name share a port on different loopback addresses.
  uint16_t port = 0;
  std::vector<std::string> extra_args{};
  std::chrono::milliseconds start_timeout{10000};
  // farmemd --max-client-share. Tests often fill a daemon with one client on purpose, so the
  // fixture lets one client take everything; empty: farmemd's default.
  std::string max_client_share = "1";
};

// One farmemd on 127.0.0.1. The first Start() lets the daemon pick a free port (--listen :0,
// --port-file); later starts reuse that port, so clients that knew it find the restarted daemon.
class DaemonProcess {
 public:
  DaemonProcess(DaemonConfig config, std::string work_dir, std::string name)
      : config_(std::move(config)),
        work_dir_(std::move(work_dir)),
        name_(std::move(name)),
        port_(config_.port) {}
  ~DaemonProcess() { (void)Stop(); }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Starts the daemon and waits until it listens. Fails (with the daemon's log) if it exits or
  // does not come up within config.start_timeout.
  Status Start() {
    if (process_) return Status(StatusCode::kInvalidArgument, name_ + " is already running");
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
    FARMEM_ASSIGN_OR_RETURN(ChildProcess p, ChildProcess::Spawn(args, {.stdout_path = log_path(),
                                                                       .stderr_path = log_path(),
                                                                       .append_output = true,
                                                                       .kill_with_parent = true}));
    process_.emplace(std::move(p));

    std::optional<int> exit_status;
    const bool listening = WaitUntil(
        [&] {
          if ((exit_status = process_->TryWait())) return true;
          std::ifstream in(port_file);
          unsigned port = 0;
          if (in >> port && port > 0 && port <= 65535) {
            port_ = static_cast<uint16_t>(port);
            return true;
          }
          return false;
        },
        config_.start_timeout);
    if (exit_status) {
      process_.reset();
      return Status(StatusCode::kUnavailable, name_ + " (farmemd) exited at start (" +
                                                  DescribeExit(*exit_status) +
                                                  "); its log ends:\n" + LogTail());
    }
    if (listening) return Status::Ok();
    Kill();
    return Status(StatusCode::kDeadlineExceeded, name_ + " (farmemd) did not listen within " +
                                                     std::to_string(config_.start_timeout.count()) +
                                                     " ms; its log ends:\n" + LogTail());
  }

  // SIGKILL (no goodbye to anyone) and reap.
  void Kill() { process_.reset(); }

  // SIGSTOP / SIGCONT: the daemon keeps its sockets but answers nothing (a hung node). Pause
  // returns once the daemon is stopped ('T' in /proc/PID/stat), so it is hung from then on.
  void Pause() {
    if (!process_) return;
    process_->Signal(SIGSTOP);
    (void)WaitForProcessState(process_->pid(), 'T', std::chrono::seconds(10));
  }
  void Resume() {
    if (process_) process_->Signal(SIGCONT);
  }

  // SIGTERM, then SIGKILL if it has not exited within `grace`. Ok if it exited cleanly.
  Status Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(5000)) {
    if (!process_) return Status::Ok();
    process_->Signal(SIGTERM);
    process_->Signal(SIGCONT);  // a paused daemon must run to handle SIGTERM
    const std::optional<int> status = process_->WaitExit(grace);
    process_.reset();  // kills it if it is still running
    if (!status) {
      return Status(StatusCode::kDeadlineExceeded,
                    name_ + " ignored SIGTERM for " + std::to_string(grace.count()) + " ms");
    }
    if (WIFEXITED(*status) && WEXITSTATUS(*status) == 0) return Status::Ok();
    return Status(StatusCode::kInternal,
                  name_ + " exited badly on SIGTERM (" + DescribeExit(*status) + ")");
  }

  // Kill, then start again on the same port: a new daemon incarnation (new node id, no leases).
  Status Restart() {
    Kill();
    return Start();
  }

  bool running() const { return process_.has_value() && process_->running(); }
  pid_t pid() const { return process_ ? process_->pid() : -1; }
  uint16_t port() const { return port_; }
  // Where clients reach it (127.0.0.1 when it listens on a wildcard).
  Endpoint endpoint() const {
    const bool wildcard = config_.listen_host == "::" || config_.listen_host == "0.0.0.0";
    return Endpoint{wildcard ? "127.0.0.1" : config_.listen_host, port_};
  }
  const std::string& name() const { return name_; }
  std::string log_path() const { return work_dir_ + "/" + name_ + ".log"; }

  std::string LogTail(size_t max_bytes = 4000) const {
    const std::string s = ReadFile(log_path());
    return s.size() > max_bytes ? s.substr(s.size() - max_bytes) : s;
  }

 private:
  DaemonConfig config_;
  std::string work_dir_;
  std::string name_;
  std::optional<ChildProcess> process_;  // set while the daemon runs
  uint16_t port_ = 0;
};

// N daemons sharing one config, secret and work dir.
class DaemonSet {
 public:
  explicit DaemonSet(DaemonConfig config = {}) : config_(std::move(config)) {}
  ~DaemonSet() {
    StopAll();
    daemons_.clear();  // before work_dir_ (declared first) removes their logs
  }
  DaemonSet(const DaemonSet&) = delete;
  DaemonSet& operator=(const DaemonSet&) = delete;

  // Starts n more daemons, one after the other (each waits until it listens).
  Status Start(size_t n) {
    if (!work_dir_) {
      work_dir_ = std::make_unique<TempDir>();
      if (!work_dir_->ok()) return work_dir_->status();
    }
    for (size_t i = 0; i < n; ++i) {
      const size_t index = daemons_.size();
      daemons_.push_back(
          std::make_unique<DaemonProcess>(config_, work_dir(), "farmemd-" + std::to_string(index)));
      FARMEM_RETURN_IF_ERROR(daemons_.back()->Start());
    }
    return Status::Ok();
  }

  DaemonProcess& operator[](size_t i) { return *daemons_.at(i); }
  size_t size() const { return daemons_.size(); }
  const std::string& secret() const { return config_.secret; }
  // Empty until the first Start().
  const std::string& work_dir() const {
    static const std::string kNone;
    return work_dir_ ? work_dir_->path() : kNone;
  }

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
  std::unique_ptr<TempDir> work_dir_;  // secret, port files, logs; removed at teardown
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
};

}  // namespace farmem::testing
