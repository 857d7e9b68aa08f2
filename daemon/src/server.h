// Server: farmemd's listener and its connections.
//
// One thread accepts; each connection is served by a thread of its own that runs every request
// to completion (read the frame, touch slab memory, answer) and batches the replies of all frames
// that arrived together into one sendmsg. There is no hand-off between threads on the data path:
// on these machines a cross-core wake-up costs more than the operation (docs/architecture.md).
// A housekeeping thread reclaims leases whose clients stopped heartbeating. With RDMA, an
// RdmaListener (rdma_listener.h) admits queue pairs and registers leases; it has no data path.
//
// Threading: Start/Stop from the main thread; everything else is internal.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/socket.h"
#include "rdma_listener.h"
#include "slab_pool.h"

namespace farmem::daemon {

struct ServerOptions {
  Endpoint listen{"127.0.0.1", kDefaultPort};
  std::string secret;  // empty: no authentication (the daemon says so loudly)
  uint32_t max_connections = 256;
  std::chrono::milliseconds idle_timeout{0};  // 0: connections may stay idle forever
  RdmaMode rdma = RdmaMode::kAuto;
  // Unset: the TCP host, port = TCP port + 1 (any free port when the TCP port is 0).
  std::optional<Endpoint> rdma_listen;
  // Connection threads run under SCHED_BATCH: a request arriving does not preempt whatever runs on
  // the lending machine (its own programs, or the client that just sent the request and has more
  // to send); the thread runs at the next scheduling point instead. Same CPU share as before.
  bool batch_scheduling = true;
};

struct ServerCounters {
  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> protocol_errors{0};
};

class Connection;

class Server {
 public:
  Server(ServerOptions options, SlabPool* pool);
  ~Server();

  Status Start();  // binds and starts the threads
  void Stop();     // closes everything; returns when all threads are done
  uint16_t port() const { return port_; }
  uint64_t node_id() const { return node_id_; }

  // Used by connections.
  SlabPool& pool() { return *pool_; }
  const ServerOptions& options() const { return options_; }
  ServerCounters& counters() { return counters_; }
  RdmaListener* rdma() { return rdma_.get(); }  // null: this daemon serves TCP only
  void ClientConnected(const wire::ClientId& id);
  void ClientDisconnected(const wire::ClientId& id);
  uint32_t client_count();

 private:
  Status StartRdma();
  void AcceptLoop();
  void HousekeepingLoop();
  void ReapFinished();

  ServerOptions options_;
  SlabPool* pool_;
  uint64_t node_id_ = 0;
  uint16_t port_ = 0;
  Socket listener_;
  std::unique_ptr<RdmaListener> rdma_;
  std::atomic<bool> stopping_{false};
  std::thread accept_thread_;
  std::thread housekeeping_thread_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  ServerCounters counters_;

  struct Live {
    std::unique_ptr<Connection> conn;
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  std::mutex conns_mu_;
  std::vector<Live> conns_;                     // GUARDED_BY(conns_mu_)
  std::map<wire::ClientId, uint32_t> clients_;  // GUARDED_BY(conns_mu_)
};

}  // namespace farmem::daemon
