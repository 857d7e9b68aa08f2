// Telling systemd how a service is doing (sd_notify(3)): READY=1 once a program serves (its
// listeners are up), STATUS= lines for `systemctl status`, STOPPING=1 on the way out, and the
// watchdog keep-alive (WATCHDOG=1) for units with WatchdogSec=. Used by farmemd and farmem-nbd,
// whose units are Type=notify (deploy/systemd).
//
//   systemd::NotifyReady("lending 1 GiB on 0.0.0.0:7411");
//   auto monitor = systemd::ServiceMonitor::Start([&]() -> Result<std::string> {
//     return fmt::format("{} clients", server.client_count());  // takes the server's locks
//   });
//   ... sigwait ...
//   systemd::NotifyStopping("SIGTERM: shutting down");
//
// Outside systemd (no $NOTIFY_SOCKET) every call does nothing, at no cost. Any thread may call the
// Notify* functions.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::systemd {

// True when started by systemd with a notification socket (Type=notify and friends).
bool NotifyEnabled();
// READY=1 with a STATUS= line: the service now does what it is for.
void NotifyReady(std::string_view status);
// A STATUS= line alone.
void NotifyStatus(std::string_view status);
// STOPPING=1 with a STATUS= line: shutting down on purpose (not a failure).
void NotifyStopping(std::string_view status);

// The watchdog interval systemd asked for (WatchdogSec=), or zero when the unit sets none (or the
// variables are meant for another process).
std::chrono::microseconds WatchdogInterval();

// A thread that asks the program whether it is alive and tells systemd. Every period (half the
// watchdog interval when WatchdogSec= is set, else 10 s) it calls `probe`, which must exercise
// what a stuck program would not do (take the server's locks, read its counters):
//   - Ok(status): STATUS=<status> when it changed, and WATCHDOG=1 when the watchdog is on;
//   - an error: logged, STATUS=<the error>, and WATCHDOG=trigger, so systemd restarts the service
//     now (Restart=on-failure) instead of after the timeout;
//   - a probe that never returns sends nothing more, and systemd's watchdog fires.
// Not started (Start returns null) outside systemd: nothing would listen.
class ServiceMonitor {
 public:
  using Probe = std::function<Result<std::string>()>;

  // Null when $NOTIFY_SOCKET is not set. `period` overrides the interval (tests).
  static std::unique_ptr<ServiceMonitor> Start(
      Probe probe, std::chrono::milliseconds period = std::chrono::milliseconds(0));
  ~ServiceMonitor();  // stops the thread (waits for a probe in progress)
  ServiceMonitor(const ServiceMonitor&) = delete;
  ServiceMonitor& operator=(const ServiceMonitor&) = delete;

 private:
  ServiceMonitor(Probe probe, std::chrono::milliseconds period, bool watchdog);
  void Run() EXCLUDES(mu_);

  const Probe probe_;
  const std::chrono::milliseconds period_;
  const bool watchdog_;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace farmem::systemd
