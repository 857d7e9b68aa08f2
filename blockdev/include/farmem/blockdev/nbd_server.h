// NbdServer: serves one BlockBackend as an NBD export (fixed newstyle, structured replies) on Unix
// sockets, TCP and systemd-activated sockets.
//
// What it solves: it is the whole protocol side of farmem-nbd, usable in-process (tests hand it a
// socketpair with Serve()) and by the program (main.cc adds listeners and signal handling).
//
// Threading and ownership:
//  - One accept thread waits on all listeners. Each accepted connection gets its own thread,
//    which runs the handshake and then every request to completion: it reads all requests the
//    socket has ready, runs them against the backend as one batch on that same thread, and sends
//    all their replies with one sendmsg. No request is handed from thread to thread (a cross-core
//    wake-up costs tens of microseconds on these machines, see docs/nbd.md). A client that does
//    not read its replies only stalls its own connection, which stops reading requests and is
//    dropped after reply_timeout; the backend never waits on a client's socket.
//  - A connection allocates its buffers (one receive buffer, one 32 MiB data buffer) when it enters
//    transmission; the request path itself does not allocate.
//  - The server borrows the backend, which must outlive it and be safe to call from all
//    connection threads at once (see block_backend.h).
//  - Start(), Serve() and Stop() may be called from any thread; Stop() is idempotent and also run
//    by the destructor.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/nbd_metrics.h"
#include "farmem/blockdev/nbd_protocol.h"
#include "farmem/blockdev/swap_safety.h"
#include "farmem/common/config.h"
#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"

namespace farmem::blockdev {

struct NbdServerOptions {
  std::string export_name;              // "" = only the default export
  std::string description;              // optional, shown by nbdinfo
  std::vector<std::string> unix_paths;  // a stale socket file at the path is replaced
  std::vector<Endpoint> tcp;            // port 0 picks a free port (see listening_on())
  std::vector<int> inherited_fds;       // listening sockets, e.g. from TakeSocketActivationFds()
  // Connections beyond this are closed right after accept: each one in transmission holds ~34 MiB
  // of buffers (locked, in swap-safe mode). Swap clients use 1-4 connections.
  size_t max_connections = 16;
  // A client must send each handshake message within this time.
  std::chrono::milliseconds handshake_timeout{30000};
  // A connection whose client leaves its replies unread this long (counted from when the socket
  // first refuses them) is dropped. Meanwhile that connection reads no new requests; the backend
  // and every other connection carry on (see nbd_connection.h).
  std::chrono::milliseconds reply_timeout{30000};
  // On Stop(), how long connections get to finish the requests they already received.
  std::chrono::milliseconds drain_timeout{5000};
  // Borrowed; must outlive the server. Null: requests are not counted (--metrics-listen off).
  NbdMetrics* metrics = nullptr;
  // After a connection's thread has answered a batch, it spins up to this long for the client's
  // next request before it sleeps on the socket (AdaptiveSpin's policy: yields, backs off where
  // requests come further apart or the CPUs are busy). 0: it sleeps at once. At most
  // AdaptiveSpin::kMaxBudget. 10 µs measured best on the 2-vCPU machines (docs/benchmarks-nbd.md
  // "Spinning for the next request"): fio's depth-16 writes +16%, depth 1 +26%, reads level.
  std::chrono::microseconds request_busy_poll{10};
};

// Takes the sockets passed by systemd socket activation (LISTEN_PID / LISTEN_FDS, fds from 3)
// and clears those variables. Empty if the variables are absent or meant for another process.
Result<std::vector<int>> TakeSocketActivationFds();

class NbdServer {
 public:
  // `backend` is borrowed. Fails if the export would be unusable (size not a multiple of 512,
  // export name or description longer than the protocol allows).
  static Result<std::unique_ptr<NbdServer>> Create(BlockBackend* backend, NbdServerOptions options);
  ~NbdServer();
  NbdServer(const NbdServer&) = delete;
  NbdServer& operator=(const NbdServer&) = delete;

  // Binds every listener in the options, adopts the inherited ones, starts accepting.
  [[nodiscard]] Status Start() EXCLUDES(mu_);
  // Serves an already-connected stream socket (takes ownership of fd), e.g. one end of a
  // socketpair. Works with or without Start().
  [[nodiscard]] Status Serve(int fd) EXCLUDES(mu_);
  // Stops accepting; lets connections finish the requests they already received (up to
  // drain_timeout), then cuts them off; joins every thread; removes Unix socket files.
  void Stop() EXCLUDES(mu_);

  // Where the server listens: "unix:/run/x.sock", "tcp:127.0.0.1:10809", "fd:3".
  std::vector<std::string> listening_on() const;
  // TCP port actually bound for options.tcp[i] (useful with port 0).
  uint16_t tcp_port(size_t i) const;
  size_t active_connections() const EXCLUDES(mu_);
  uint64_t connections_served() const { return connections_served_.load(); }
  const nbd::ExportInfo& export_info() const { return info_; }

 private:
  struct Listener {
    Socket socket;
    std::string description;
    std::string unix_path;  // removed on Stop()
    uint16_t tcp_port = 0;
  };
  struct ConnectionSlot {
    int fd = -1;  // owned; closed after the thread is joined (never reused while it runs)
    std::function<void()> body;  // what the thread runs
    // A pthread, for its small stack: under mlockall(MCL_FUTURE) a thread's whole stack is
    // locked when it starts, so the server's threads do not get glibc's default 8 MiB; they need
    // a few tens of KiB (kThreadStackSize, swap_safety.h, in either mode).
    pthread_t thread{};
    std::atomic<bool> done{false};
  };

  NbdServer(BlockBackend* backend, NbdServerOptions options, nbd::ExportInfo info);
  Status AddListenerUnix(const std::string& path);
  Status AddListenerTcp(const Endpoint& ep);
  Status AdoptListener(int fd);
  void AcceptLoop();
  Status AddConnection(int fd, std::string peer) EXCLUDES(mu_);
  void ReapFinished() EXCLUDES(mu_);  // joins and closes finished connections
  void Wake();

  BlockBackend* const backend_;
  const NbdServerOptions options_;
  const nbd::ExportInfo info_;
  std::vector<Listener> listeners_;  // set up by Start() before the accept thread runs
  int wake_fd_ = -1;                 // eventfd: connection finished, or Stop()
  std::function<void()> accept_body_;
  pthread_t accept_thread_{};
  bool accept_started_ = false;
  std::atomic<uint64_t> connections_served_{0};

  mutable Mutex mu_;
  std::vector<std::unique_ptr<ConnectionSlot>> slots_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool stopped_ GUARDED_BY(mu_) = false;
};

}  // namespace farmem::blockdev
