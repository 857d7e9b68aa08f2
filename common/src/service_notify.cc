#include "farmem/common/service_notify.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>

#include <cstdlib>
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

void Send(const std::string& state) {
  // unset_environment = 0: the threads that notify later (ServiceMonitor) still need the socket.
  const int rc = sd_notify(0, state.c_str());
  if (rc < 0) spdlog::warn("sd_notify({}) failed: {}", state.substr(0, state.find('\n')), rc);
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
  uint64_t usec = 0;
  // > 0 only when WATCHDOG_USEC is set and WATCHDOG_PID (if set) is this process.
  if (sd_watchdog_enabled(0, &usec) <= 0) return std::chrono::microseconds(0);
  return std::chrono::microseconds(usec);
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
