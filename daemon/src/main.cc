// farmemd: the per-node daemon that lends slabs of this machine's idle DRAM.
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <fstream>

#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"
#include "farmem/common/service_notify.h"
#include "server.h"
#include "slab_pool.h"

using namespace farmem;

int main(int argc, char** argv) {
  CLI::App app{
      "farmemd - lends slabs of this machine's memory to farmem clients over TCP and RDMA.\n"
      "Every option may also be set in a config file (--config), one `name = value` per line."};
  std::string listen = fmt::format("127.0.0.1:{}", kDefaultPort);
  std::string capacity = "1G", slab_size = "64M", secret_file, port_file, log_level = "info";
  uint32_t lease_ttl_ms = 10000, max_connections = 256;
  uint32_t max_pending_handshakes = 1024, handshake_timeout_ms = 5000, frame_timeout_ms = 10000;
  bool no_mlock = false, no_prefault = false;
  std::string rdma = "auto", rdma_listen, sched = "batch", max_client_share = "0.75";
  cli::AddConfigFileOption(app,
                           "Read options from this file: `name = value` per line, names without "
                           "dashes; an unknown name or a [section] is an error");
  app.add_option("--listen", listen, "Address and port to serve on, host:port; port 0 picks one")
      ->capture_default_str();
  app.add_option("--capacity", capacity, "Memory to lend, e.g. 4G; rounded down to whole slabs")
      ->capture_default_str();
  app.add_option("--slab-size", slab_size, "Unit of lending, a multiple of 4K (Infiniswap used 1G)")
      ->capture_default_str();
  app.add_option("--secret-file", secret_file,
                 "File with the shared secret clients must prove they know (chmod 600). "
                 "Without it the daemon is open to anyone who can reach it")
      ->check(CLI::ExistingFile);
  app.add_option("--lease-ttl-ms", lease_ttl_ms,
                 "A lease whose client sends no heartbeat for this long is reclaimed and zeroed")
      ->capture_default_str()
      ->check(CLI::Range(100u, 3600u * 1000u));
  app.add_option("--max-client-share", max_client_share,
                 "Most one client may lease from this daemon: a fraction of --capacity (0.5, 50%; "
                 "1 = no limit) or a size (512M). Beyond it ALLOC fails with ResourceExhausted "
                 "naming this limit; the default leaves a quarter for other clients")
      ->capture_default_str();
  app.add_option("--max-connections", max_connections,
                 "Authenticated connections served at once (one thread each); beyond it a client "
                 "is refused with ResourceExhausted")
      ->capture_default_str()
      ->check(CLI::Range(1u, 65536u));
  app.add_option("--max-pending-handshakes", max_pending_handshakes,
                 "Connections still in HELLO/AUTH, handled by one thread without blocking; when "
                 "full the oldest is dropped, so sockets without the secret cannot crowd out a "
                 "client with it. Each costs a file descriptor and about 1.5 KiB")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--handshake-timeout-ms", handshake_timeout_ms,
                 "A connection must complete HELLO (and AUTH) within this long of connecting, "
                 "however slowly its bytes trickle in, or it is closed")
      ->capture_default_str()
      ->check(CLI::Range(100u, 600u * 1000u));
  app.add_option("--frame-timeout-ms", frame_timeout_ms,
                 "Once a frame has started to arrive, all of it is due within this long (and a "
                 "client must take a batch of replies within it), or the connection is closed. "
                 "Idle time between frames is not limited")
      ->capture_default_str()
      ->check(CLI::Range(100u, 3600u * 1000u));
  app.add_option("--rdma", rdma,
                 "Serve one-sided RDMA (rdma_cm + verbs) next to TCP: auto (when a device serves "
                 "the address), on (or fail), off")
      ->capture_default_str()
      ->check(cli::OneOf({"auto", "on", "off"}));
  app.add_option("--rdma-listen", rdma_listen,
                 "rdma_cm address, host:port (default: the --listen host, its port + 1; "
                 "port 0 picks one)");
  app.add_option("--sched", sched,
                 "Scheduling policy of connection threads: batch (SCHED_BATCH: a request never "
                 "preempts the lending machine's own work or the client that sent it) or normal")
      ->capture_default_str()
      ->check(cli::OneOf({"batch", "normal"}));
  app.add_flag("--no-mlock", no_mlock, "Do not try to mlock the pool");
  app.add_flag("--no-prefault", no_prefault, "Do not touch the pool's pages at start");
  app.add_option("--port-file", port_file, "Write the port actually bound to this file");
  cli::AddLogLevelOption(app, log_level);
  cli::AddVersionOption(app, "farmemd");
  CLI11_PARSE(app, argc, argv);
  cli::SetUpLogging("farmemd", log_level);

  auto fail = [](const Status& s) {
    spdlog::critical("{}", s.ToString());
    return 1;
  };
  daemon::PoolOptions pool_opts;
  daemon::ServerOptions server_opts;
  if (rdma == "off") {
    Status s = cli::RejectGiven(app, {"--rdma-listen"},
                                "only when RDMA is served, and --rdma off serves TCP only: leave "
                                "it out, or use --rdma auto|on");
    if (!s.ok()) return fail(s);
  }
  auto cap = ParseSize(capacity);
  if (!cap) return fail(cap.error().WithContext("--capacity"));
  auto slab = ParseSize(slab_size);
  if (!slab) return fail(slab.error().WithContext("--slab-size"));
  auto ep = ParseEndpoint(listen);
  if (!ep) return fail(ep.error().WithContext("--listen"));
  pool_opts.capacity = *cap;
  pool_opts.slab_size = *slab;
  pool_opts.lease_ttl = std::chrono::milliseconds(lease_ttl_ms);
  pool_opts.mlock = !no_mlock;
  pool_opts.prefault = !no_prefault;
  auto share = daemon::ParseClientShare(max_client_share);
  if (!share) return fail(share.error());
  pool_opts.max_client_share = *share;
  server_opts.listen = *ep;
  server_opts.max_connections = max_connections;
  server_opts.max_pending_handshakes = max_pending_handshakes;
  server_opts.handshake_timeout = std::chrono::milliseconds(handshake_timeout_ms);
  server_opts.frame_timeout = std::chrono::milliseconds(frame_timeout_ms);
  server_opts.batch_scheduling = sched == "batch";
  auto rdma_mode = daemon::ParseRdmaMode(rdma);
  if (!rdma_mode) return fail(rdma_mode.error());
  server_opts.rdma = *rdma_mode;
  if (!rdma_listen.empty()) {
    auto rep = ParseEndpoint(rdma_listen);
    if (!rep) return fail(rep.error().WithContext("--rdma-listen"));
    server_opts.rdma_listen = *rep;
  }
  if (!secret_file.empty()) {
    auto secret = auth::LoadSecretFile(secret_file);
    if (!secret) return fail(secret.error().WithContext("--secret-file"));
    server_opts.secret = *secret;
  }

  // Signals are taken by sigwait below; every thread started from here on inherits the mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto pool = daemon::SlabPool::Create(pool_opts);
  if (!pool) return fail(pool.error());
  daemon::Server server(server_opts, pool->get());
  if (Status s = server.Start(); !s.ok()) return fail(s);
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << server.port() << "\n";
    std::rename(tmp.c_str(), port_file.c_str());
  }
  // systemd (Type=notify): serving now. The monitor's probe takes the server's and the pool's
  // locks, so a daemon stuck on them stops the watchdog pings (WatchdogSec=).
  systemd::NotifyReady(fmt::format("lending {} bytes on {}", pool_opts.capacity,
                                   Endpoint{ep->host, server.port()}.ToString()));
  auto monitor = systemd::ServiceMonitor::Start([&]() -> Result<std::string> {
    const daemon::PoolStats st = (*pool)->stats();
    return fmt::format("{} clients, {} of {} slabs free", server.client_count(), st.free_slabs,
                       st.total_slabs);
  });
  int sig = 0;
  sigwait(&sigs, &sig);
  spdlog::info("{}: shutting down", strsignal(sig));
  systemd::NotifyStopping(fmt::format("{}: shutting down", strsignal(sig)));
  monitor.reset();
  server.Stop();
  spdlog::info("stopped");
  return 0;
}
