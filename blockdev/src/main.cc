// farmem-nbd: serves a block device over NBD. With --backend memory the device lives in this
// process's RAM (tests, benchmarks); the farmem backend (remote page store) and the flags of both
// are in backend_setup.h. The protocol itself is in the farmem_blockdev library (nbd_server.h).
#include <fmt/format.h>
#include <malloc.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend_setup.h"
#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/nbd_server.h"
#include "farmem/blockdev/swap_safety.h"
#include "farmem/common/adaptive_spin.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"
#include "farmem/common/metrics.h"
#include "farmem/common/service_notify.h"
#include "farmem/common/status.h"
#include "farmem/common/version.h"

namespace {

using farmem::Result;
using farmem::Status;
using farmem::blockdev::AddBackendFlags;
using farmem::blockdev::BackendConfig;
using farmem::blockdev::BlockBackend;
using farmem::blockdev::CheckEncryptionFlags;
using farmem::blockdev::CheckFlagsApply;
using farmem::blockdev::OpenBackend;
using farmem::blockdev::RegisterExportMetrics;
using farmem::blockdev::ResolveLayout;

int Fail(const Status& s) {
  spdlog::error("farmem-nbd: {}", s.ToString());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "farmem-nbd: serves a block device over the NBD protocol (fixed newstyle, structured "
      "replies).\nConnect with e.g. nbd-client, qemu, nbdinfo, or fio's nbd engine. Listens on "
      "--unix, --listen and on sockets passed by systemd socket activation (LISTEN_FDS)."};
  app.get_formatter()->column_width(34);

  BackendConfig backend_cfg;
  AddBackendFlags(app, &backend_cfg);

  farmem::blockdev::NbdServerOptions opts;
  std::vector<std::string> tcp;
  bool swap_safe = true;
  std::string log_level = "info";
  double handshake_timeout_s = 30;
  double reply_timeout_s = 30;
  auto request_busy_poll_us = static_cast<uint32_t>(opts.request_busy_poll.count());
  std::string metrics_listen, metrics_port_file;
  app.add_option("--unix", opts.unix_paths,
                 "Listen on this Unix socket path (repeatable). A stale socket file is replaced; "
                 "the file is removed on exit.");
  app.add_option("--listen", tcp,
                 "Listen on TCP HOST:PORT (repeatable), e.g. 127.0.0.1:10809 or [::]:10809. "
                 "The protocol has no authentication or encryption: bind to trusted networks.");
  app.add_option("--export-name", opts.export_name,
                 "Name of the export. Clients may always ask for the default export ('').");
  app.add_option("--description", opts.description,
                 "Free text shown to clients (NBD_INFO_DESCRIPTION, NBD_OPT_LIST).");
  app.add_option("--max-connections", opts.max_connections,
                 "Refuse connections beyond this many; each one costs about 1.5 MiB of "
                 "buffers and stack (locked in swap-safe mode).")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--handshake-timeout", handshake_timeout_s,
                 "Seconds a client may take for each handshake message before it is dropped.")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--reply-timeout", reply_timeout_s,
                 "Seconds a client may leave its replies unread (its socket full) before it is "
                 "dropped. Meanwhile only that connection waits: it reads no new requests.")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--request-busy-poll-us", request_busy_poll_us,
                 "After answering a batch, a connection's thread spins up to this many µs "
                 "(polling its socket, yielding the CPU to anything runnable) for the client's "
                 "next request before it sleeps: the client's send then wakes no thread. Spins "
                 "that run out (sparse requests) or find the CPUs busy make the next 1, 2, 4 ... "
                 "64 waits sleep at once. 0: off.")
      ->check(CLI::Range(0u, static_cast<uint32_t>(farmem::AdaptiveSpin::kMaxBudget.count())))
      ->capture_default_str();
  app.add_flag("--swap-safe,!--no-swap-safe", swap_safe,
               "Make the process fit to serve swap: mlockall(MCL_CURRENT|MCL_FUTURE), "
               "PR_SET_IO_FLUSHER, oom_score_adj -1000; each failure is a warning. On by "
               "default; --no-swap-safe (or --swap-safe=false) turns it off.");
  farmem::cli::AddMetricsOptions(app, metrics_listen, metrics_port_file);
  farmem::cli::AddLogLevelOption(app, log_level);
  farmem::cli::AddVersionOption(app, "farmem-nbd");
  CLI11_PARSE(app, argc, argv);
  farmem::cli::SetUpLogging("farmem-nbd", log_level);
  if (Status s = CheckFlagsApply(app, backend_cfg); !s.ok()) return Fail(s);
  if (Status s = CheckEncryptionFlags(backend_cfg); !s.ok()) return Fail(s);
  if (Status s = ResolveLayout(&backend_cfg); !s.ok()) return Fail(s);

  // Signals: SIGINT/SIGTERM are taken synchronously by the main thread (blocked in every thread,
  // which inherit the mask); a vanished client must not kill the server through SIGPIPE.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  if (swap_safe) {
    // One malloc arena: under MCL_FUTURE every per-thread arena (64 MiB reserved each) would be
    // locked memory too, and the request path does not allocate, so there is nothing to gain.
    mallopt(M_ARENA_MAX, 1);
    // A fixed mmap threshold: glibc otherwise raises it to the size of each large block freed,
    // after which a connection's 1 MiB buffer comes from the heap, where it can stay (locked)
    // after the connection closed. Blocks above it are mapped, and unmapped when freed.
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    // Before anything is allocated, so that MCL_FUTURE also locks the backend and the buffers.
    const auto report = farmem::blockdev::EnterSwapSafeMode();
    if (!report.memory_locked.ok()) spdlog::warn("swap-safe: {}", report.memory_locked.ToString());
    if (!report.io_flusher.ok()) spdlog::warn("swap-safe: {}", report.io_flusher.ToString());
    if (!report.oom_protected.ok()) spdlog::warn("swap-safe: {}", report.oom_protected.ToString());
    if (!report.small_stacks.ok()) spdlog::warn("swap-safe: {}", report.small_stacks.ToString());
  }

  for (const std::string& t : tcp) {
    auto ep = farmem::ParseEndpoint(t);
    if (!ep) return Fail(ep.error().WithContext("--listen"));
    opts.tcp.push_back(*ep);
  }
  std::optional<farmem::Endpoint> metrics_ep;
  if (!metrics_listen.empty()) {
    auto m = farmem::ParseEndpoint(metrics_listen);
    if (!m) return Fail(m.error().WithContext("--metrics-listen"));
    metrics_ep = *m;
  } else if (!metrics_port_file.empty()) {
    return Fail(farmem::InvalidArgument("--metrics-port-file needs --metrics-listen"));
  }
  farmem::metrics::Registry registry;
  std::optional<farmem::blockdev::NbdMetrics> nbd_metrics;
  if (metrics_ep) {
    nbd_metrics.emplace(&registry);
    opts.metrics = &*nbd_metrics;
  }
  auto activated = farmem::blockdev::TakeSocketActivationFds();
  if (!activated) return Fail(activated.error());
  opts.inherited_fds = *activated;
  opts.handshake_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(handshake_timeout_s * 1000));
  opts.reply_timeout = std::chrono::milliseconds(static_cast<int64_t>(reply_timeout_s * 1000));
  opts.request_busy_poll = std::chrono::microseconds(request_busy_poll_us);

  auto backend = OpenBackend(backend_cfg);
  if (!backend) return Fail(backend.error().WithContext("opening the backend"));
  auto server = farmem::blockdev::NbdServer::Create(backend->get(), opts);
  if (!server) return Fail(server.error());
  if (Status s = (*server)->Start(); !s.ok()) return Fail(s);
  const std::string protection = farmem::blockdev::DescribeProtection(backend_cfg);
  spdlog::info("farmem-nbd: serving {} bytes from the {} backend{}", (*backend)->size(),
               backend_cfg.kind, protection.empty() ? "" : " (" + protection + ")");
  std::unique_ptr<farmem::metrics::MetricsServer> metrics_server;
  if (metrics_ep) {
    RegisterExportMetrics(&registry, &backend_cfg, backend->get(), opts.export_name);
    auto ms = farmem::metrics::MetricsServer::Start(*metrics_ep, &registry);
    if (!ms) return Fail(ms.error().WithContext("--metrics-listen"));
    metrics_server = std::move(*ms);
    spdlog::info("farmem-nbd: metrics on http://{}/metrics",
                 farmem::Endpoint{metrics_ep->host, metrics_server->port()}.ToString());
    if (!metrics_port_file.empty()) {
      if (Status s = farmem::metrics::WritePortFile(metrics_port_file, metrics_server->port());
          !s.ok()) {
        return Fail(s.WithContext("--metrics-port-file"));
      }
    }
  }
  // systemd (Type=notify): serving now. The monitor's probe takes the server's lock, so a server
  // stuck on it stops the watchdog pings (when the unit sets WatchdogSec=).
  farmem::systemd::NotifyReady(
      fmt::format("serving {} bytes from the {} backend", (*backend)->size(), backend_cfg.kind));
  auto monitor = farmem::systemd::ServiceMonitor::Start([&]() -> Result<std::string> {
    return fmt::format("{} NBD connections", (*server)->active_connections());
  });

  int sig = 0;
  sigwait(&stop_signals, &sig);
  spdlog::info("farmem-nbd: {} received, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
  farmem::systemd::NotifyStopping(sig == SIGINT ? "SIGINT: shutting down"
                                                : "SIGTERM: shutting down");
  monitor.reset();
  metrics_server.reset();  // its callbacks read the backend and the cluster
  (*server)->Stop();
  return 0;
}
