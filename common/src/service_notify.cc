#include "farmem/common/service_notify.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

namespace farmem::systemd {
namespace {

// STATUS= is one line: a message with a newline would end the field early.
std::string OneLine(std::string_view text) {
  std::string line(text);
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return line;
}

// sd_notify(3)'s protocol, without libsystemd (which would map libgcrypt, libzstd, liblzma and
// liblz4 into farmem-nbd, locked in swap-safe mode, for this one datagram): the state as one
// datagram to the AF_UNIX socket named by $NOTIFY_SOCKET, a path or, with a leading '@', an
// abstract name. The environment is left set: the threads that notify later (ServiceMonitor)
// still need the socket. Returns an errno-style error, or 0.
int SendDatagram(const std::string& state) {
  const char* socket_name = std::getenv("NOTIFY_SOCKET");
  if (socket_name == nullptr || *socket_name == '\0') return 0;
  const size_t name_len = std::strlen(socket_name);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((socket_name[0] != '/' && socket_name[0] != '@') || name_len >= sizeof(addr.sun_path)) {
    return EAFNOSUPPORT;  // systemd ≥ 253 may also pass vsock:CID:PORT; not supported here
  }
  std::memcpy(addr.sun_path, socket_name, name_len);
  socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name_len);
  if (socket_name[0] == '@') {
    addr.sun_path[0] = '\0';  // abstract: the name is the bytes after the NUL, no terminator
  } else {
    addr_len += 1;  // the path's terminating NUL
  }
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  int rc = 0;
  if (::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr),
               addr_len) < 0) {
    rc = errno;
  }
  ::close(fd);
  return rc;
}

void Send(const std::string& state) {
  const int rc = SendDatagram(state);
  if (rc != 0) {
    spdlog::warn("telling systemd {} on NOTIFY_SOCKET={} failed: {}",
                 state.substr(0, state.find('\n')), std::getenv("NOTIFY_SOCKET"),
                 std::strerror(rc));
  }
}

// A decimal number of the environment, or nullopt when unset or not a number.
std::optional<uint64_t> EnvNumber(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  uint64_t value = 0;
  const char* end = text + std::strlen(text);
  const auto [ptr, ec] = std::from_chars(text, end, value);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

}  // namespace

bool NotifyEnabled() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  return socket != nullptr && *socket != '\0';
}

void NotifyReady(std::string_view status) {
  if (!NotifyEnabled()) return;
  Send(fmt::format("READY=1\nSTATUS={}", OneLine(status)));
}

void NotifyStatus(std::string_view status) {
  if (!NotifyEnabled()) return;
  Send(fmt::format("STATUS={}", OneLine(status)));
}

void NotifyStopping(std::string_view status) {
  if (!NotifyEnabled()) return;
  Send(fmt::format("STOPPING=1\nSTATUS={}", OneLine(status)));
}

std::chrono::microseconds WatchdogInterval() {
  // As sd_watchdog_enabled(3): only when WATCHDOG_USEC is a positive number and WATCHDOG_PID,
  // if set, is this process (a child started by the service does not ping for it).
  const auto usec = EnvNumber("WATCHDOG_USEC");
  if (!usec.has_value() || *usec == 0) return std::chrono::microseconds(0);
  if (std::getenv("WATCHDOG_PID") != nullptr) {
    const auto pid = EnvNumber("WATCHDOG_PID");
    if (!pid.has_value() || *pid != static_cast<uint64_t>(::getpid())) {
      return std::chrono::microseconds(0);
    }
  }
  return std::chrono::microseconds(*usec);
}

std::unique_ptr<ServiceMonitor> ServiceMonitor::Start(Probe probe,
                                                      std::chrono::milliseconds period) {
  if (!NotifyEnabled()) return nullptr;
  const auto watchdog = WatchdogInterval();
  if (period.count() <= 0) {
    // Half the watchdog interval, as sd_watchdog_enabled(3) recommends: one late ping is no kill.
    period = watchdog.count() > 0
                 ? std::max(std::chrono::milliseconds(1),
                            std::chrono::duration_cast<std::chrono::milliseconds>(watchdog / 2))
                 : std::chrono::milliseconds(10000);
  }
  if (watchdog.count() > 0) {
    spdlog::info("systemd watchdog: {} ms, checked every {} ms", watchdog.count() / 1000,
                 period.count());
  }
  return std::unique_ptr<ServiceMonitor>(
      new ServiceMonitor(std::move(probe), period, watchdog.count() > 0));
}

ServiceMonitor::ServiceMonitor(Probe probe, std::chrono::milliseconds period, bool watchdog)
    : probe_(std::move(probe)), period_(period), watchdog_(watchdog) {
  thread_ = std::thread([this] { Run(); });
}

ServiceMonitor::~ServiceMonitor() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void ServiceMonitor::Run() {
  std::string last_status;
  MutexLock lock(&mu_);
  while (!stopping_) {
    lock.Unlock();  // the probe may take the program's locks: never under ours
    Result<std::string> status = probe_();
    std::string state;
    if (status.has_value()) {
      if (*status != last_status) state = "STATUS=" + OneLine(*status);
      if (watchdog_) state += state.empty() ? "WATCHDOG=1" : "\nWATCHDOG=1";
      last_status = *status;
    } else {
      spdlog::error("health check failed: {}; asking systemd to restart this service",
                    status.error().ToString());
      last_status.clear();
      state = "STATUS=unhealthy: " + OneLine(status.error().ToString());
      if (watchdog_) state += "\nWATCHDOG=trigger";
    }
    if (!state.empty()) Send(state);
    lock.Lock();
    const auto next = std::chrono::steady_clock::now() + period_;
    cv_.WaitUntil(&mu_, next, [this]() {
      mu_.AssertHeld();
      return stopping_;
    });
  }
}

}  // namespace farmem::systemd
