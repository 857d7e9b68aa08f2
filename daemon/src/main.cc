// farmemd: the per-node daemon that lends slabs of this machine's idle DRAM.
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <fstream>

#include "daemon_metrics.h"
#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"
#include "farmem/common/metrics.h"
#include "farmem/common/service_notify.h"
#include "memory_source.h"
#include "pressure.h"
#include "server.h"
#include "slab_pool.h"

using namespace farmem;

int main(int argc, char** argv) {
  CLI::App app{
      "farmemd - lends slabs of this machine's memory to farmem clients over TCP and RDMA.\n"
      "Every option may also be set in a config file (--config), one `name = value` per line."};
  std::string listen = fmt::format("127.0.0.1:{}", kDefaultPort);
  std::string metrics_listen, metrics_port_file;
  std::string capacity = "1G", slab_size = "64M", secret_file, port_file, log_level = "info";
  uint32_t lease_ttl_ms = 10000, max_connections = 256;
  uint32_t max_pending_handshakes = 1024, handshake_timeout_ms = 5000, frame_timeout_ms = 10000;
  bool no_mlock = false, no_prefault = false, populate_at_start = false, no_huge_pages = false;
  std::string rdma = "auto", rdma_listen, sched = "batch", max_client_share = "0.75";
  std::string reserve = "10%", memory_source = "auto", access_counts = "all";
  uint32_t pressure_interval_ms = 250, evict_grace_ms = 5000, evict_sample_extra = 2;
  uint32_t drain_timeout_ms = 0;
  // PSI is opt-in: the host's `full` stall also counts a cgroup thrashing against its own
  // memory.max (a swap client on this host, say), which memory given back by farmemd does not
  // help; evicting for it took swapped pages from under that very client (nbd_farmem_swap_none).
  double psi_threshold = 0;
  cli::AddConfigFileOption(app,
                           "Read options from this file: `name = value` per line, names without "
                           "dashes; an unknown name or a [section] is an error");
  app.add_option("--listen", listen, "Address and port to serve on, host:port; port 0 picks one")
      ->capture_default_str();
  app.add_option("--capacity", capacity,
                 "Most memory to lend, e.g. 4G; rounded down to whole slabs. A ceiling: a slab's "
                 "memory is taken when it is leased and given back when the lease ends")
      ->capture_default_str();
  app.add_option("--slab-size", slab_size, "Unit of lending, a multiple of 4K (Infiniswap used 1G)")
      ->capture_default_str();
  app.add_option("--secret-file", secret_file,
                 "File with the shared secret clients must prove they know (chmod 600). "
                 "Without it the daemon is open to anyone who can reach it")
      ->check(CLI::ExistingFile);
  // Identities, rotation, revocation (docs/operations.md "Security"); re-read on SIGHUP.
  daemon::AuthFiles auth_files;
  app.add_option("--old-secret-file", auth_files.old_secret_file,
                 "Key rotation: a previous cluster secret (and the keys derived from it) still "
                 "accepted. Remove the file and send SIGHUP to stop accepting it")
      ->check(CLI::ExistingFile);
  app.add_option("--revoked-file", auth_files.revoked_file,
                 "Identities refused, one name per line (# comments). Re-read on SIGHUP: "
                 "connections of a newly revoked name are closed")
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
  app.add_option(
         "--reserve", reserve,
         "Memory this host (or the daemon's cgroup) keeps for its own programs: a size (2G) "
         "or a percentage of its memory (10%). Below it the daemon grants nothing and "
         "takes leases back with notice; 0 lends regardless")
      ->capture_default_str();
  app.add_option("--memory-source", memory_source,
                 "Where free memory is read: auto (the daemon's cgroup when it has a memory limit, "
                 "else the host), host (MemAvailable + PSI), cgroup, cgroup:DIR, or off")
      ->capture_default_str();
  app.add_option("--psi-threshold", psi_threshold,
                 "Share of time (percent) in which every task stalled on memory (PSI 'full', "
                 "measured between two readings) that counts as pressure even above --reserve "
                 "(0: ignore PSI)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--pressure-interval-ms", pressure_interval_ms,
                 "How often free memory is read and evictions that are due are carried out")
      ->capture_default_str()
      ->check(CLI::Range(10u, 60u * 1000u));
  app.add_option("--evict-grace-ms", evict_grace_ms,
                 "Under memory pressure: how long a client has after EVICT_NOTICE to move its data "
                 "and free the lease before it is ended")
      ->capture_default_str()
      ->check(CLI::Range(0u, 3600u * 1000u));
  app.add_option("--evict-sample-extra", evict_sample_extra,
                 "Victims are the E least active of E + this many randomly sampled leases")
      ->capture_default_str()
      ->check(CLI::Range(0u, 1024u));
  app.add_option("--access-counts", access_counts,
                 "What victim choice counts as a lease's activity: all (the TCP reads and writes "
                 "this daemon serves, plus what clients report of their RDMA ones on HEARTBEAT) or "
                 "reported (only clients' reports; for testing the reports over TCP)")
      ->capture_default_str()
      ->check(cli::OneOf({"all", "reported"}));
  app.add_option("--drain-timeout", drain_timeout_ms,
                 "On SIGTERM, drain first: notice every lease, grant nothing, and exit once all "
                 "are freed or after this many ms (0: exit at once). SIGINT always exits at once")
      ->capture_default_str()
      ->check(CLI::Range(0u, 3600u * 1000u));
  app.add_flag("--no-mlock", no_mlock, "Do not try to mlock leased slabs");
  app.add_flag("--no-prefault", no_prefault,
               "Do not populate a slab's pages when it is leased (unlocked slabs then fault on "
               "first access)");
  app.add_flag("--no-huge-pages", no_huge_pages,
               "Do not collapse leased slabs into transparent huge pages in the background "
               "(MADV_COLLAPSE): they keep 4 KiB pages, and the daemon spends no CPU on the copy");
  app.add_flag("--populate-at-start", populate_at_start,
               "Populate (and mlock) the whole --capacity before serving and keep it, as farmemd "
               "did before memory on demand; for comparisons (docs/benchmarks.md)");
  app.add_option("--port-file", port_file, "Write the port actually bound to this file");
  cli::AddMetricsOptions(app, metrics_listen, metrics_port_file);
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
  if (populate_at_start) {
    Status s = cli::RejectGiven(app, {"--no-huge-pages"},
                                "only for slabs populated when they are leased; the pool "
                                "--populate-at-start populates is given huge pages at start: "
                                "leave one of the two out");
    if (!s.ok()) return fail(s);
  }
  auto cap = ParseSize(capacity);
  if (!cap) return fail(cap.error().WithContext("--capacity"));
  auto slab = ParseSize(slab_size);
  if (!slab) return fail(slab.error().WithContext("--slab-size"));
  auto ep = ParseEndpoint(listen);
  if (!ep) return fail(ep.error().WithContext("--listen"));
  std::optional<Endpoint> metrics_ep;
  if (!metrics_listen.empty()) {
    auto m = ParseEndpoint(metrics_listen);
    if (!m) return fail(m.error().WithContext("--metrics-listen"));
    metrics_ep = *m;
  } else if (!metrics_port_file.empty()) {
    return fail(InvalidArgument("--metrics-port-file needs --metrics-listen"));
  }
  pool_opts.capacity = *cap;
  pool_opts.slab_size = *slab;
  pool_opts.lease_ttl = std::chrono::milliseconds(lease_ttl_ms);
  pool_opts.mlock = !no_mlock;
  pool_opts.prefault = !no_prefault;
  pool_opts.count_served_accesses = access_counts == "all";
  pool_opts.populate_at_start = populate_at_start;
  pool_opts.huge_pages = !no_huge_pages;
  auto share = daemon::ParseClientShare(max_client_share);
  if (!share) return fail(share.error());
  pool_opts.max_client_share = *share;
  server_opts.listen = *ep;
  server_opts.max_connections = max_connections;
  server_opts.max_pending_handshakes = max_pending_handshakes;
  server_opts.handshake_timeout = std::chrono::milliseconds(handshake_timeout_ms);
  server_opts.frame_timeout = std::chrono::milliseconds(frame_timeout_ms);
  server_opts.batch_scheduling = sched == "batch";
  auto reserve_parsed = daemon::ParseReserve(reserve);
  if (!reserve_parsed) return fail(reserve_parsed.error());
  server_opts.reclaim.pressure.reserve = *reserve_parsed;
  server_opts.reclaim.pressure.psi_full_threshold = psi_threshold;
  server_opts.reclaim.interval = std::chrono::milliseconds(pressure_interval_ms);
  server_opts.reclaim.evict_grace = std::chrono::milliseconds(evict_grace_ms);
  server_opts.reclaim.sample_extra = evict_sample_extra;
  if (memory_source != "off") {
    auto src = daemon::OpenMemorySource(memory_source);
    if (!src) return fail(src.error());
    // A reading that fails here is the reclaimer's to report (it retries); one that succeeds
    // must leave room to lend.
    if (auto m = (*src)->Read(); m.has_value()) {
      Status room =
          daemon::CheckReserveLeavesRoom(*reserve_parsed, m->limit, *slab, (*src)->name());
      if (!room.ok()) return fail(room);
    }
    server_opts.reclaim.source = std::move(*src);
  } else {
    Status s = cli::RejectGiven(
        app, {"--reserve", "--psi-threshold", "--evict-grace-ms", "--evict-sample-extra"},
        "only while free memory is watched, and --memory-source off lends regardless of it: "
        "give --memory-source auto, host or cgroup, or leave the option out");
    if (!s.ok()) return fail(s);
  }
  auto rdma_mode = daemon::ParseRdmaMode(rdma);
  if (!rdma_mode) return fail(rdma_mode.error());
  server_opts.rdma = *rdma_mode;
  if (!rdma_listen.empty()) {
    auto rep = ParseEndpoint(rdma_listen);
    if (!rep) return fail(rep.error().WithContext("--rdma-listen"));
    server_opts.rdma_listen = *rep;
  }
  auth_files.secret_file = secret_file;
  if (secret_file.empty() && !auth_files.old_secret_file.empty()) {
    return fail(InvalidArgument("--old-secret-file needs --secret-file (the current secret)"));
  }
  {
    auto policy = daemon::LoadAuthPolicy(auth_files, /*reload=*/false);
    if (!policy) return fail(policy.error());
    server_opts.secret = std::move(policy->secret);
    server_opts.old_secrets = std::move(policy->old_secrets);
    server_opts.revoked = std::move(policy->revoked);
  }

  // Signals are taken by sigwait below; every thread started from here on inherits the mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGHUP);  // reload the authentication files
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
  // Metrics last: a scrape then always finds a serving daemon.
  metrics::Registry registry;
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (metrics_ep) {
    daemon::RegisterDaemonMetrics(&registry, &server, pool->get());
    auto ms = metrics::MetricsServer::Start(*metrics_ep, &registry);
    if (!ms) return fail(ms.error().WithContext("--metrics-listen"));
    metrics_server = std::move(*ms);
    spdlog::info("metrics: http://{}/metrics",
                 Endpoint{metrics_ep->host, metrics_server->port()}.ToString());
    if (!metrics_port_file.empty()) {
      if (Status s = metrics::WritePortFile(metrics_port_file, metrics_server->port()); !s.ok()) {
        return fail(s.WithContext("--metrics-port-file"));
      }
    }
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
  while (sigwait(&sigs, &sig) == 0 && sig == SIGHUP) {
    auto policy = daemon::LoadAuthPolicy(auth_files, /*reload=*/true);
    Status s = policy ? server.ReloadAuth(std::move(*policy)) : policy.error();
    if (!s.ok()) spdlog::error("SIGHUP: {}; the previous policy stays in force", s.ToString());
  }
  systemd::NotifyStopping(fmt::format(
      "{}: {}", strsignal(sig),
      sig == SIGTERM && drain_timeout_ms > 0 ? "draining, then shutting down" : "shutting down"));
  if (sig == SIGTERM && drain_timeout_ms > 0) {
    // Drain: clients get notice and time to move their data; exit when they are done.
    const auto timeout = std::chrono::milliseconds(drain_timeout_ms);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const uint32_t noticed = server.Drain(timeout);
    spdlog::info("SIGTERM: draining {} lease(s) for up to {} ms before exiting (--drain-timeout)",
                 noticed, drain_timeout_ms);
    const timespec tick{0, 100'000'000};
    while ((*pool)->stats().leased_slabs > 0 && std::chrono::steady_clock::now() < deadline) {
      const int again = sigtimedwait(&sigs, nullptr, &tick);
      if (again > 0 && again != SIGHUP) break;  // a second SIGINT/SIGTERM: stop now
    }
    const uint32_t left = (*pool)->stats().leased_slabs;
    if (left > 0) {
      spdlog::warn("drain: {} lease(s) still held at exit", left);
    } else {
      spdlog::info("drain: every lease was freed");
    }
  }
  spdlog::info("{}: shutting down", strsignal(sig));
  monitor.reset();
  metrics_server.reset();  // its callbacks read the server
  server.Stop();
  spdlog::info("stopped");
  return 0;
}
