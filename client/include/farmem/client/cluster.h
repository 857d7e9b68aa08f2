// Cluster: the farmem cluster as one client sees it. There is no coordinator: the client talks to
// every daemon itself, places slabs by power-of-two-choices on free slabs, keeps its leases alive
// with heartbeats and finds failed daemons on its own.
//
// What it solves for a borrower (blockdev, farptr, kmod's control tool):
//   - which daemons exist (an explicit peer list and/or a DNS name whose every A/AAAA record is a
//     daemon, e.g. a Kubernetes headless service; re-resolved now and then);
//   - where a new slab goes (Allocate), and how a group of slabs lands on distinct nodes for
//   erasure
//     coding or replication (AllocateGroup);
//   - keeping leases alive: one background thread heartbeats every live daemon, since a daemon
//     reclaims (and zeroes) every lease of a client whose heartbeats stop;
//   - knowing when leases are gone: a daemon that stops answering or whose connection breaks and
//     cannot be reopened is declared down (kNodeDown, listing the leases unreachable there); a
//     daemon that restarted (new node id in HELLO) lost this client's leases (kLeasesLost); a
//     daemon under memory pressure announces evictions (kEvictNotice). The owner of the data
//     reacts: moves it, rebuilds it from parity, or gives up.
//   - a false down is not a loss: the leases of a daemon declared down are retained (not freed)
//     until the daemon answers again or its lease TTL has passed since its last answer. If the
//     same daemon process answers (same HELLO node id), each retained lease is checked there and
//     handed back (kLeasesReturned) or reported gone (kLeasesLost); if a new process answers, or
//     the TTL passed, they are all reported gone (kLeasesLost). See LeaseState.
//   - not blaming a daemon for our own stalls: a process-wide stall meter measures how late this
//     process's own timers ran; the time the client itself did not run extends a heartbeat's
//     failure deadline, and a heartbeat that timed out leaves the node suspect and re-probes it
//     (a fresh connection and HELLO) before it is declared down.
//   - data channels to a node, with the same identity (OpenChannel).
//
// Ownership: a Cluster owns one control connection per daemon, the bookkeeping of every lease it
// granted, and its background thread. Leases belong to the Cluster's client id (random per
// Cluster): two Clusters in one process are two clients. Close() (or the destructor) frees every
// lease still held.
//
// Threads: every public method may be called from any thread, concurrently, except that Close()
// and the destructor must not be called from an event callback. Control calls to one daemon are
// serialized on that daemon's connection; calls to different daemons run in parallel.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "farmem/client/placement.h"
#include "farmem/common/config.h"
#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"
#include "farmem/common/wire.h"
#include "farmem/transport/fault_injection.h"
#include "farmem/transport/tcp_connection.h"
#include "farmem/transport/transport.h"

namespace farmem::client {

namespace internal {
class StallMeter;  // client/src/stall_meter.h
}

// How often a borrower waiting for data ops checks whether their daemon was declared down
// meanwhile. A daemon that stops answering but keeps its sockets open (SIGSTOP, a partition: a
// gray failure) breaks nothing, so without this check its ops wait out op_timeout; with it they
// end within this interval of the cluster declaring the daemon down (failure_timeout), and the
// borrower reads degraded from the other members. Borrowers slice their waits by it and never
// pass it to Channel::Poll (a TCP channel whose receive times out is broken): they wait on
// Channel::wait_fd() with poll(2), and call Poll only once a reply is there.
inline constexpr std::chrono::milliseconds kDownCheckInterval{50};

struct ClusterOptions {
  // Daemons named one by one. A peer that cannot be reached at Connect is still a node: it starts
  // down and is retried.
  std::vector<Endpoint> peers;
  // "name:port" (port defaults to kDefaultPort): every address the name resolves to is a daemon.
  // Addresses that answer become nodes; the name is re-resolved every dns_refresh_interval and
  // new daemons join the table. Two addresses that reach the same daemon (same HELLO node id,
  // e.g. "localhost" giving both 127.0.0.1 and ::1) are one node. May be combined with `peers`.
  std::string peers_dns;
  // The key this client authenticates with: the cluster secret (identity empty: the built-in
  // administrator identity "cluster"), or the key of `identity` (farmemctl key issue;
  // auth::LoadClientCredentials reads either). Empty: daemons run without authentication.
  std::string secret;
  std::string identity;     // the name leases are bound to; empty: "cluster"
  std::string client_name;  // shown in daemon logs; default "farmem-client-<pid>"
  // The client id every connection presents; unset: a random one. Leases belong to (identity,
  // client id): a process given the id of one that died renews that one's leases with its
  // heartbeats (farmemctl kmod attach re-adopting a device, docs/kmod.md). It does not know them
  // (Free, Close and the events cover only leases this Cluster granted).
  std::optional<wire::ClientId> client_id;
  std::chrono::milliseconds heartbeat_interval{500};
  // A daemon that has not answered for this long, or whose connection broke and cannot be
  // reopened, is down. Must exceed heartbeat_interval.
  std::chrono::milliseconds failure_timeout{2000};
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds op_timeout{5000};  // control calls (STAT, ALLOC, FREE) and data ops
  // How often a down daemon is retried. Zero: 2 * heartbeat_interval.
  std::chrono::milliseconds reconnect_interval{0};
  std::chrono::milliseconds dns_refresh_interval{10000};
  std::string transport = "auto";  // tcp | verbs | auto (verbs where both ends have a device)
  uint32_t channel_depth = 64;     // max outstanding ops per data channel
  // Seeds placement's RNG; unset = std::random_device. For reproducible tests.
  std::optional<uint64_t> rng_seed;
  // Tests: count and report (HEARTBEAT access reports) data operations on tcp channels too. By
  // default only verbs operations are reported, which the daemon cannot see; it counts the tcp
  // ones it serves itself, unless it runs with --access-counts reported.
  bool report_tcp_accesses = false;
  // Tests: every data channel is wrapped with these deterministic faults
  // (transport/fault_injection.h). Unset in production.
  std::shared_ptr<transport::FaultInjector> fault_injector;
  // Tests: data channels are opened through this transport (never verbs) instead of tcp: an
  // in-process fake that serves the slabs from memory with scripted faults
  // (tests/support/fake_fabric.h). Unset in production.
  std::shared_ptr<transport::Transport> data_transport;
};

// One slab lent to this client.
struct Lease {
  NodeId node = 0;
  wire::LeaseGrant grant;

  uint64_t id() const { return grant.lease_id; }
  transport::RemoteSlab slab() const { return transport::RemoteSlab::From(grant); }
};

// A snapshot of what the client knows about one daemon.
struct NodeInfo {
  NodeId id = 0;
  Endpoint endpoint;
  bool alive = false;
  // Up, but a data-path error was reported within its suspect window (docs/operations.md).
  bool suspect = false;
  uint64_t daemon_id = 0;               // HELLO node id; 0 until first contact; new after restart
  std::optional<wire::StatReply> stat;  // the last STAT answer, if any
  size_t leases_held = 0;               // leases this client holds there
  uint64_t lease_ttl_ms = 0;            // from the last HEARTBEAT reply; 0 = unknown
  // Data operations on its leases this client reported to it on HEARTBEAT (the daemon does not
  // see one-sided RDMA operations; ClusterOptions::report_tcp_accesses), since the client started.
  uint64_t accesses_reported = 0;
  // Leases of this client id that the daemon said (last HEARTBEAT) are under an eviction notice
  // but that this Cluster does not hold: granted to an earlier process with the same client id
  // (a restarted keeper, docs/kmod.md) and not adopted. Nobody renews them but this Cluster's
  // heartbeats; the process that knows they are unused may AdoptLeases and Free them.
  std::vector<uint64_t> noticed_not_held;
  Status last_error;                 // why it is down (or the last failure seen)
  Clock::time_point last_contact{};  // last successful exchange
};

// What a client can wait for a node to be (Cluster::WaitForNode): answering, or declared down.
enum class NodeState { kUp, kDown };

// What the client knows of one of its leases (Cluster::LeaseState).
enum class LeaseState {
  kHeld,      // its daemon is up and the lease was not reported lost
  kRetained,  // its daemon is down, but the same process may answer again with it (kNodeDown)
  kGone,      // reported lost for good (restart, expiry, eviction), freed, or never granted
};

enum class EventType {
  kNodeDown,    // the node is unreachable; lease_ids (held there) are gone for this client
  kNodeUp,      // a node answered again, or a new one joined (DNS refresh)
  kLeasesLost,  // the node is up but lost lease_ids (it restarted)
  // The node needs its memory back (host memory pressure, or a drain) and will end lease_ids at
  // `deadline` (grace_ms after the notice arrived). Move the data elsewhere, then Free() the
  // leases: freeing is the acknowledgement, and a lease freed in time costs nothing. A lease still
  // held at the deadline is ended by the daemon (reads and writes on it fail with Expired, never
  // other data) and reported here once more as kLeasesLost, within a heartbeat interval.
  kEvictNotice,
  // The node was declared down (kNodeDown listed lease_ids) but the same daemon process (same
  // HELLO node id) answered again and still holds lease_ids, contents intact: they are this
  // client's again. A borrower that has not replaced those members yet may use them again, but
  // only if no write went past them while they were down (else resync or rebuild them first);
  // one that replaced them frees them (Free) as usual.
  kLeasesReturned,
};
const char* EventTypeName(EventType type);

struct Event {
  EventType type = EventType::kNodeDown;
  NodeId node = 0;
  Endpoint endpoint;
  std::vector<uint64_t> lease_ids;
  uint32_t grace_ms = 0;         // kEvictNotice only
  Status reason;                 // why (kNodeDown, kLeasesLost); OK otherwise
  Clock::time_point deadline{};  // kEvictNotice: when the daemon ends the leases
};

using SubscriptionId = uint64_t;
// Called on the Cluster's background thread, one event at a time, in the order they happened.
// While a callback runs no heartbeat is sent: it must not block long (hand the work to another
// thread). It may call any Cluster method except Close().
using EventCallback = std::function<void(const Event&)>;

class Cluster {
 public:
  // Resolves peers, connects and authenticates to each in parallel, starts the heartbeat thread.
  // Fails only when no daemon is reachable (the message lists each peer's error; the code is the
  // peers' common code, e.g. PermissionDenied for a wrong secret, else Unavailable), or when the
  // options are invalid (InvalidArgument).
  static Result<std::unique_ptr<Cluster>> Connect(ClusterOptions options);

  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  const wire::ClientId& client_id() const { return client_id_; }
  const ClusterOptions& options() const { return options_; }

  // Nodes are never removed from the table (a dead one stays, down), so ids stay valid.
  size_t node_count() const;
  size_t alive_count() const;
  // Snapshot; an id >= node_count() gives a default NodeInfo with a NotFound last_error.
  NodeInfo node(NodeId id) const;
  // node(id).alive without the snapshot's copies (its STAT reply's strings): for the request path,
  // which must not allocate (farmem-nbd's swap safety). False for an id >= node_count().
  bool alive(NodeId id) const;
  std::vector<NodeInfo> nodes() const;

  // Waits until node(id) is in `state` (kUp: alive; kDown: declared down) and every subscriber
  // has been handed the events emitted up to then, so a borrower reacting to kNodeDown has seen
  // it. For tests and tools that must wait for the client to notice a failure or a return.
  // DeadlineExceeded after `timeout` (saying what the node is), NotFound for an unknown id.
  Status WaitForNode(NodeId id, NodeState state, std::chrono::milliseconds timeout) const;

  // Whether the lease can still come back (see LeaseState): a borrower that cannot rebuild a
  // member elsewhere (resilience none, too many members down) waits while it is kRetained rather
  // than declaring its data lost.
  LeaseState GetLeaseState(const Lease& lease) const;

  // Asks the daemon now (also refreshes node(id).stat).
  Result<wire::StatReply> Stat(NodeId id);

  // n slabs, each placed by power-of-two-choices: STAT two distinct random live nodes, ALLOC on
  // the one with more free slabs; if it is exhausted try the other, then every node with free
  // slabs, most free first. All or nothing: on failure, slabs already taken are freed.
  // ResourceExhausted ("no daemon has a free slab: <node free counts>") when every live daemon is
  // full; Unavailable when none is up or one failed to answer (a retry may succeed).
  Result<std::vector<Lease>> Allocate(size_t n);

  // n slabs on n distinct nodes (one erasure-coding or replica group), each picked by two-choices
  // among the nodes not yet used. InvalidArgument if the cluster has fewer than n nodes,
  // ResourceExhausted if fewer than n live nodes have a free slab. All or nothing.
  Result<std::vector<Lease>> AllocateGroup(size_t n);

  // One slab by two-choices among live nodes not in `exclude`: a replacement member for a group
  // that lost one (the rebuilt copy must not share a node with the survivors).
  Result<Lease> AllocateExcluding(std::span<const NodeId> exclude);

  // Takes over leases that this client id holds on the node but this Cluster did not grant: a
  // process given the client id of one that died (ClusterOptions::client_id; farmemctl kmod
  // attach re-adopting a device, docs/kmod.md). Each is checked there (a one-byte READ, which a
  // daemon serves only for a lease its client still holds); the held ones are this Cluster's from
  // then on, as if granted here: the events (kNodeDown, kLeasesLost, kEvictNotice), Free and
  // Close cover them. Returns the ids the daemon no longer holds (they lapsed, or were never this
  // client's). Unavailable when the node is down or the connection fails meanwhile.
  Result<std::vector<uint64_t>> AdoptLeases(NodeId id, std::span<const uint64_t> lease_ids);

  // Returns leases to their daemons. Leases already lost (their node went down or restarted) are
  // accepted and ignored. If a daemon cannot be reached, the leases are forgotten by this call
  // and freed in the background once it answers; the returned error says so. NotFound for a lease
  // this Cluster never granted or already freed.
  Status Free(std::span<const Lease> leases);

  // A data channel to the node for the calling thread (a Channel is single-threaded), through the
  // configured transport, with this client's identity.
  Result<std::unique_ptr<transport::Channel>> OpenChannel(NodeId id);
  // For a borrower's per-thread table of channels: the channel in `slot`, reopened when it is
  // missing or broken (a broken one is dropped with whatever it still had outstanding). Null with
  // *error set when the node is down or the open fails (the failure is reported as by
  // ReportFailure). With `opened_to` (kept by the caller beside `slot`), a channel opened to an
  // earlier incarnation of the daemon (it restarted on the same address: new HELLO node id) is
  // replaced too, before an op fails on it and a healthy member is blamed.
  transport::Channel* EnsureChannel(std::unique_ptr<transport::Channel>& slot, NodeId id,
                                    Status* error, uint64_t* opened_to = nullptr);

  // A new control connection to the node, authenticated as this client, for a borrower's own
  // requests (farptr's offload); the caller owns it. Unavailable when the node is down.
  Result<transport::TcpConnection> ControlConnection(NodeId id);

  // A borrower saw a data-path error on this node: probe it now rather than at the next heartbeat.
  void ReportFailure(NodeId id, const Status& error);

  SubscriptionId Subscribe(EventCallback callback);
  // After it returns, the callback is not running and will not be called again (unless called
  // from within a callback, which unsubscribes from the next event on).
  void Unsubscribe(SubscriptionId id);

  // Frees every lease still held, stops the background thread, closes connections. Idempotent;
  // afterwards every call fails with Aborted. Not from an event callback.
  Status Close();

 private:
  struct Node;  // client/src/node.h

  explicit Cluster(ClusterOptions options);

  // ---- setup (cluster_setup.cc; FindNode in cluster.cc) ----
  // A daemon to dial at start: named in peers (a node even while down), or found in peers_dns
  // (a node only once it answers).
  struct DialTarget {
    Endpoint endpoint;
    bool from_dns = false;
  };
  Status Start();
  Status InitCredentials();   // client id, secret and name every connection presents
  Status ChooseTransports();  // tcp always; verbs unless transport=tcp (an error if =verbs)
  // The peers, then peers_dns resolved (a resolution failure goes to *dns_error, not an error).
  Result<std::vector<DialTarget>> PeersToDial(std::string* dns_error);
  // Connects to every target at once, one thread each; results in target order.
  std::vector<Result<transport::TcpConnection>> DialAll(
      const std::vector<DialTarget>& targets) const;
  // Makes nodes of what was dialed (aliases of one daemon once); fails when no daemon answered.
  Status AdoptDialed(const std::vector<DialTarget>& targets,
                     std::vector<Result<transport::TcpConnection>>& dialed,
                     const std::string& dns_error) EXCLUDES(mu_);
  Result<transport::TcpConnection> ConnectTo(const Endpoint& ep,
                                             std::chrono::milliseconds timeout) const;
  Node* AddNode(const Endpoint& ep) REQUIRES(mu_);
  Node* FindNode(NodeId id) const EXCLUDES(mu_);

  // ---- control calls (cluster.cc) ----
  Status CheckOpen() const EXCLUDES(mu_);
  // One exchange on the node's connection (node.call_mu held), waiting at most `timeout` for
  // the answer (op_timeout unless given). On a transport failure it drops the connection and
  // asks the background thread to probe the node.
  Result<std::vector<uint8_t>> CallLocked(
      Node& node, wire::Opcode op, std::span<const uint8_t> body,
      std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  Result<wire::StatReply> StatNode(Node& node);
  Result<Lease> AllocOn(Node& node);

  // ---- data channels and access reports (cluster_channels.cc) ----
  // `channel`, wrapped so that its operations are counted in node.accesses for the HEARTBEAT
  // access report when the daemon takes reports (`features`) and does not see them itself
  // (`one_sided`: verbs; tcp too with options_.report_tcp_accesses).
  std::unique_ptr<transport::Channel> CountedIfReported(Node& node, uint32_t features,
                                                        std::unique_ptr<transport::Channel> channel,
                                                        bool one_sided) const;
  // The access report for the next HEARTBEAT to `node` (empty: none is due, or the daemon does
  // not take reports); after the daemon answered, node.accesses->Commit(report).
  wire::HeartbeatRequest PendingAccessReport(Node& node) EXCLUDES(mu_);
  Status SendFreeLocked(Node& node, std::span<const uint64_t> ids);  // node.call_mu held

  // ---- placement and freeing (cluster_leases.cc) ----
  // One slab by two-choices among live nodes not in `exclude` (indexed by NodeId).
  Result<Lease> PlaceOne(const std::vector<bool>& exclude);
  // What one PlaceOne learned: per node what STAT / ALLOC said (for the error), the nodes asked,
  // and whether a daemon failed otherwise than by being full.
  struct PlacementLog {
    std::map<NodeId, std::string> seen;
    std::vector<bool> tried;
    bool alloc_failed = false;
  };
  static bool Excluded(const std::vector<bool>& exclude, NodeId id);
  // STATs the sampled nodes, then ALLOCs on them most free first; nullopt if none granted one.
  std::optional<Lease> TryPlaceOn(std::span<const NodeId> sampled, PlacementLog* log);
  // Why nothing was placed: Unavailable (none up, or one failed) or ResourceExhausted (all full).
  Status PlacementFailure(const std::vector<bool>& exclude, const PlacementLog& log) const
      EXCLUDES(mu_);

  std::vector<NodeId> AliveNodes() const EXCLUDES(mu_);
  Status FreeAll();

  // ---- background thread (cluster_monitor.cc) ----
  void MonitorLoop();
  // A node's own thread: runs the heartbeats and reconnects the monitor queues for it (Node::work)
  // until the Cluster stops.
  void NodeWorkerLoop(Node& node);
  void Heartbeat(Node& node);
  // Heartbeat's turn for a node whose connection a call holds (call_mu) past the failure window:
  // a call stuck on a daemon that answers nothing (paused, hung) must not hold off its detection
  // until op_timeout. Asks on a connection of its own (a HELLO) and declares the node down if
  // that goes unanswered too, and then ends the stuck call (AbortCallInFlight).
  void ProbeBusyNode(Node& node);
  // Shuts down the socket a call waits on (Node::call_fd), if one does: the call then fails
  // at once, names the down (CallLocked) and drops the connection. Without call_mu.
  static void AbortCallInFlight(Node& node);
  // The node answered (at `at`): the start of its next failure window.
  void NoteContactLocked(Node& node, Clock::time_point at) REQUIRES(mu_);
  // What this process lost to its own stalls since the node's last answer, at most one more
  // failure_timeout: a deadline that passed while we were descheduled is no evidence against the
  // daemon, and a client that keeps stalling still detects a hung daemon within twice the
  // failure timeout.
  std::chrono::nanoseconds StalledSinceContactLocked(const Node& node) const REQUIRES(mu_);
  // When the node's failure window ends: failure_timeout after its last answer, plus `stalled`
  // (StalledSinceContactLocked, which the heartbeat keeps to extend its deadline by later
  // stalls). Past it without an answer, the node is overdue (Heartbeat, ProbeBusyNode).
  Clock::time_point FailureWindowEndLocked(const Node& node, std::chrono::nanoseconds stalled) const
      REQUIRES(mu_);
  // The timeout of calls a live daemon answers at once — HEARTBEAT, STAT, the one-byte READ that
  // checks a retained lease: failure_timeout, not op_timeout. Whoever makes one holds the node's
  // connection meanwhile (call_mu), and with it often more: the node's worker, which also runs
  // its heartbeats (a daemon that stops again right after it came back must be detected within
  // the failure window), or placement inside the span-set store's allocation (a far_ptr deref
  // waited out a STAT to a stopped daemon). ALLOC (it populates and locks a slab) and FREE keep
  // op_timeout.
  std::chrono::milliseconds QuickCallTimeout() const { return options_.failure_timeout; }
  void Reconnect(Node& node);
  void RefreshDns();
  // The rest run with node.call_mu held.
  // Drops the connection, marks the node down, moves its leases to `lost`, emits kNodeDown.
  void MarkDown(Node& node, Status reason);
  // MarkDown without the connection (for ProbeBusyNode, which cannot take call_mu: the caller
  // holding it drops the connection when its call fails, which AbortCallInFlight makes now).
  void DeclareDown(Node& node, Status reason) EXCLUDES(mu_);
  // Adopts a fresh connection: notices a daemon restart (kLeasesLost) or a return (kNodeUp).
  // False if the daemon turned out to be another node's (an alias); the connection is dropped.
  bool Adopt(Node& node, transport::TcpConnection conn);
  // ---- lease checks, called from the rounds (cluster_lease_checks.cc) ----
  void RetryPendingFreesLocked(Node& node);
  // After a reconnect to the same daemon process: checks each retained lease there (a one-byte
  // READ) and hands it back (kLeasesReturned) or reports it gone (kLeasesLost).
  void ReclaimRetainedLocked(Node& node);
  // Asks the daemon about each lease with a one-byte READ, which it serves only for a lease this
  // client still holds: held or gone (with the first refusal in *why). False if the connection
  // failed meanwhile (then nothing is known of the rest).
  bool ProbeLeasesLocked(Node& node, std::span<const uint64_t> ids, std::vector<uint64_t>* held,
                         std::vector<uint64_t>* gone, Status* why);
  // The daemon answers a HEARTBEAT but holds fewer of this client's leases than the client thinks
  // (it reclaimed them: heartbeats did not reach it within its lease TTL, e.g. this process was
  // stopped): checks each lease there (a one-byte READ) and reports those it refuses (kLeasesLost).
  void CheckLeasesHeldLocked(Node& node, uint32_t daemon_count);
  // A down node's retained leases whose TTL passed since its last answer: the daemon has ended
  // them (or will as soon as it runs): kLeasesLost.
  // `why`: what ended the wait (empty: its lease TTL passed since its last answer).
  void ExpireRetained(Node& node, std::string_view why = {}) REQUIRES(mu_);
  void CollectPushes(Node& node);  // EVICT_NOTICE pushes read during a call become events
  // Leases the daemon says are under notice (EVICT_NOTICE pushes, with `all`; HEARTBEAT's list):
  // those held and not yet known to be noticed become a kEvictNotice event (with `all`, every
  // held one does); the rest are kept as noticed_not_held (HEARTBEAT's list only).
  void NoteNoticed(Node& node, std::span<const wire::NoticedLease> noticed, bool all) REQUIRES(mu_);
  // Noticed leases still held after their deadline: the daemon ended them (kLeasesLost).
  void ExpireNoticed(Node& node);
  void Emit(Event event) REQUIRES(mu_);
  void DispatchEvents() EXCLUDES(mu_);

  // Set before the background thread starts, read-only afterwards.
  const ClusterOptions options_;
  wire::ClientId client_id_{};
  transport::Credentials credentials_;
  std::optional<Endpoint> dns_endpoint_;             // parsed peers_dns
  std::shared_ptr<transport::Transport> transport_;  // tcp, or options_.data_transport
  std::unique_ptr<transport::Transport> verbs_;      // null: transport=tcp, or no RDMA device here
  std::chrono::milliseconds reconnect_interval_;
  // How long this process did not run (failure detection does not count it against daemons).
  std::unique_ptr<internal::StallMeter> stall_meter_;

  // Lock order: Node::call_mu, then mu_. dispatch_mu_, then subs_mu_ (never with the others).
  mutable Mutex mu_;
  CondVar wake_;  // on mu_: events, probes, stop
  std::vector<std::unique_ptr<Node>> nodes_ GUARDED_BY(mu_);
  // Addresses from DNS that turned out to be another node's daemon (don't dial them again).
  std::vector<Endpoint> aliases_ GUARDED_BY(mu_);
  std::vector<Event> pending_events_ GUARDED_BY(mu_);
  // Events emitted, and events whose callbacks have all returned (for WaitForNode).
  uint64_t events_emitted_ GUARDED_BY(mu_) = 0;
  uint64_t events_dispatched_ GUARDED_BY(mu_) = 0;
  bool probe_requested_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  bool closed_ GUARDED_BY(mu_) = false;
  std::mt19937_64 rng_ GUARDED_BY(mu_);

  Mutex subs_mu_;
  std::map<SubscriptionId, std::shared_ptr<EventCallback>> subscribers_ GUARDED_BY(subs_mu_);
  SubscriptionId next_subscription_ GUARDED_BY(subs_mu_) = 1;
  Mutex dispatch_mu_
      ACQUIRED_BEFORE(subs_mu_);  // held while callbacks run, so Unsubscribe can wait them out

  std::thread monitor_;
  Mutex close_mu_ ACQUIRED_BEFORE(mu_);  // serializes Close()
};

}  // namespace farmem::client
