// Server: farmemd's listener and its connections.
//
// One thread admits connections: an epoll loop that accepts, runs each new connection's HELLO/AUTH
// exchange without blocking (handshake.h), and closes those that do not finish it within one
// deadline (--handshake-timeout-ms) or that exceed --max-pending-handshakes (the oldest goes).
// Only an authenticated connection gets a thread (up to --max-connections): someone without the
// secret can hold neither threads nor connection slots, and an idle or slow socket costs a
// kernel socket and about 1.5 KiB. Refusals are logged at a bounded rate (refusal_log.h).
// Each authenticated connection is served by a thread of its own that runs every request
// to completion (read the frame, touch slab memory, answer) and batches the replies of all frames
// that arrived together into one sendmsg. There is no hand-off between threads on the data path:
// on these machines a cross-core wake-up costs more than the operation (docs/architecture.md).
// A housekeeping thread reclaims leases whose clients stopped heartbeating. A Reclaimer
// (reclaimer.h) takes memory back under host memory pressure and on drain: it sends EVICT_NOTICE
// through DeliverNotice, which queues the frame on the owner's connections; each connection's
// thread sends it ahead of its next replies (a client's heartbeat brings one at least every
// heartbeat interval), so no two threads ever write one socket. With RDMA, an
// RdmaListener (rdma_listener.h) admits queue pairs and registers leases; it has no data path.
//
// Threading: Start/Stop from the main thread; everything else is internal.
#pragma once

#include <array>
#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "auth_policy.h"
#include "farmem/common/config.h"
#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"
#include "handshake.h"
#include "rdma_listener.h"
#include "reclaimer.h"
#include "refusal_log.h"
#include "slab_pool.h"

namespace farmem::daemon {

struct ServerOptions {
  Endpoint listen{"127.0.0.1", kDefaultPort};
  std::string secret;  // empty: no authentication (the daemon says so loudly)
  // Identities and rotation (auth_policy.h): accepted old secrets, refused identities.
  std::vector<std::string> old_secrets;
  std::set<std::string, std::less<>> revoked;
  uint32_t max_connections = 256;  // authenticated connections served at once (one thread each)
  // Connections still in HELLO/AUTH; when full, the oldest is dropped for the newest, so a flood
  // of sockets without the secret cannot keep a client with it out.
  uint32_t max_pending_handshakes = 1024;
  // From accept to authenticated, whatever arrives meanwhile (not per byte).
  std::chrono::milliseconds handshake_timeout{5000};
  // Once a frame has started to arrive, all of it is due within this (not per byte); the same
  // bound applies to the peer taking a batch of replies. Between frames a connection may idle.
  std::chrono::milliseconds frame_timeout{10000};
  std::chrono::milliseconds idle_timeout{0};  // 0: connections may stay idle forever
  RdmaMode rdma = RdmaMode::kAuto;
  // Unset: the TCP host, port = TCP port + 1 (any free port when the TCP port is 0).
  std::optional<Endpoint> rdma_listen;
  // Connection threads run under SCHED_BATCH: a request arriving does not preempt whatever runs on
  // the lending machine (its own programs, or the client that just sent the request and has more
  // to send); the thread runs at the next scheduling point instead. Same CPU share as before.
  bool batch_scheduling = true;
  // Memory pressure and drain (reclaimer.h). Without a memory source only drains take memory back.
  ReclaimOptions reclaim;
};

// What the daemon counts for STAT and --metrics-listen (daemon_metrics.cc). Bumped by connection
// threads with relaxed adds (no ordering between counters is promised); read at any time.
struct ServerCounters {
  // Opcodes 1..14 by their number; slot 0 collects unknown opcodes.
  static constexpr size_t kOpcodeSlots = 16;
  static size_t Slot(uint8_t opcode) { return opcode < kOpcodeSlots - 1 ? opcode : 0; }

  std::atomic<uint64_t> ops{0};  // data operations (a BATCH counts each of its reads and writes)
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> protocol_errors{0};
  std::array<std::atomic<uint64_t>, kOpcodeSlots> requests{};       // frames received
  std::array<std::atomic<uint64_t>, kOpcodeSlots> request_bytes{};  // data moved by them
  std::array<std::atomic<uint64_t>, RefusalLog::kKinds> refused{};  // by RefusalLog::Kind
  std::atomic<uint64_t> connections_admitted{0};                    // authenticated
  std::atomic<uint64_t> evict_notices{0};   // EVICT_NOTICE frames queued to clients
  std::atomic<uint64_t> leases_noticed{0};  // leases named in them
};

class Connection;

class Server final : public NoticeSink {
 public:
  Server(ServerOptions options, SlabPool* pool);
  ~Server() override;

  Status Start();  // binds and starts the threads
  void Stop()
      EXCLUDES(conns_mu_, stop_mu_);  // closes everything; returns when all threads are done
  uint16_t port() const { return port_; }
  uint64_t node_id() const { return node_id_; }

  // Used by connections.
  SlabPool& pool() { return *pool_; }
  const ServerOptions& options() const { return options_; }
  ServerCounters& counters() { return counters_; }
  RdmaListener* rdma() { return rdma_.get(); }  // null: this daemon serves TCP only
  void ClientConnected(const wire::ClientId& id, const std::string& name) EXCLUDES(conns_mu_);
  void ClientDisconnected(const wire::ClientId& id) EXCLUDES(conns_mu_);
  uint32_t client_count() EXCLUDES(conns_mu_);
  // The names (HELLO) of the connected clients, for metrics labels.
  std::map<wire::ClientId, std::string> client_names() EXCLUDES(conns_mu_);
  size_t connection_count() EXCLUDES(conns_mu_);
  size_t pending_handshakes() const { return pending_count_.load(std::memory_order_relaxed); }

  // Drain (farmemctl drain, SIGTERM): grant nothing and notice every lease with `grace`; returns
  // how many. Undrain: grant again, lift pending notices.
  uint32_t Drain(std::chrono::milliseconds grace);
  void Undrain();
  // NoticeSink: queues one EVICT_NOTICE on the owner's control connections (those that sent
  // HEARTBEAT or ALLOC; all its connections if none did).
  void DeliverNotice(const EvictionNotice& notice) override EXCLUDES(conns_mu_);

  // Authentication policy (SIGHUP): new secrets and revocations apply to the next handshake step;
  // connections of a revoked identity are closed now. A daemon started without a secret cannot
  // get one this way (InvalidArgument: restart it with --secret-file).
  Status ReloadAuth(AuthPolicy policy) EXCLUDES(auth_mu_, conns_mu_);
  // The current secret, then the old ones: what the daemon proves itself with to its peers.
  std::vector<std::string> Secrets() EXCLUDES(auth_mu_);
  // Data operations and FREEs refused because the lease belongs to another owner.
  std::atomic<uint64_t>& foreign_lease_refusals() { return foreign_lease_refusals_; }

 private:
  // A connection in HELLO/AUTH, owned by the admission thread.
  struct Pending {
    uint64_t serial = 0;  // its epoll key
    Socket socket;
    std::string peer;
    std::chrono::steady_clock::time_point deadline;
    Handshake handshake;
    size_t len = 0;  // bytes in buf
    std::array<uint8_t, kHandshakeBuffer> buf;
  };
  using PendingList = std::list<Pending>;  // oldest (earliest deadline) first

  // epoll keys: the listener, the stop eventfd, then one serial per pending connection.
  static constexpr uint64_t kListenerKey = 0;
  static constexpr uint64_t kWakeKey = 1;
  static constexpr uint64_t kFirstConnectionKey = 2;

  Status StartRdma();
  // Admission (server_admission.cc).
  void AdmissionLoop();
  void AcceptAll();
  void OnReadable(uint64_t serial);
  // Hands an authenticated connection to a thread of its own, or refuses it at --max-connections.
  void Admit(PendingList::iterator it, size_t consumed) EXCLUDES(conns_mu_);
  // Closes a pending connection after sending it what its handshake produced (if anything).
  void DropPending(PendingList::iterator it, RefusalLog::Kind kind, const std::string& why);
  void ExpirePending();
  void HousekeepingLoop() EXCLUDES(stop_mu_);
  void ReapFinished() EXCLUDES(conns_mu_);
  void TrimAfterBurst() EXCLUDES(conns_mu_);
  // Admission thread: takes up a policy ReloadAuth stored.
  void RefreshHandshakeConfig() EXCLUDES(auth_mu_);

  ServerOptions options_;
  SlabPool* pool_;
  uint64_t node_id_ = 0;
  uint16_t port_ = 0;
  Socket listener_;
  std::unique_ptr<RdmaListener> rdma_;
  std::unique_ptr<Reclaimer> reclaimer_;
  std::atomic<bool> stopping_{false};
  std::thread admission_thread_;
  std::thread housekeeping_thread_;
  Mutex stop_mu_;  // only for stop_cv_'s waits: stopping_ is atomic
  CondVar stop_cv_;
  ServerCounters counters_;

  // Admission thread only.
  Socket epoll_;
  Socket wake_;  // eventfd: Stop() wakes the admission loop
  HandshakeConfig handshake_config_;
  PendingList pending_;
  std::unordered_map<uint64_t, PendingList::iterator> pending_by_serial_;
  uint64_t next_serial_ = 0;
  RefusalLog refusals_;
  std::chrono::steady_clock::time_point accept_paused_until_{};
  std::atomic<size_t> pending_count_{0};
  std::atomic<size_t> peak_pending_{0};  // since housekeeping last looked
  size_t peak_connections_ = 0;  // housekeeping thread: pending + served since the last trim

  struct Live {
    std::unique_ptr<Connection> conn;
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  Mutex conns_mu_;
  std::vector<Live> conns_ GUARDED_BY(conns_mu_);
  struct ClientEntry {
    uint32_t connections = 0;
    std::string name;
  };
  std::map<wire::ClientId, ClientEntry> clients_ GUARDED_BY(conns_mu_);

  Mutex auth_mu_;
  AuthPolicy auth_ GUARDED_BY(auth_mu_);
  std::atomic<uint64_t> auth_generation_{0};
  uint64_t applied_auth_generation_ = 0;  // admission thread
  std::atomic<uint64_t> foreign_lease_refusals_{0};
};

}  // namespace farmem::daemon
