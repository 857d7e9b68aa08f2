// farmemctl kmod attach / detach: the control plane of farmem.ko (kmod/, docs/kmod.md).
//
// attach authenticates to the daemons (client::Cluster), leases the slabs by
// power-of-two-choices, asks each daemon that holds one for a one-time RDMA admission token on a
// control connection authenticated as the lease owner, and hands the module, through
// /sys/kernel/farmem/control, each daemon's rdma_cm address + token and each slab's lease id,
// remote address and rkey. Then it stays running as the lease keeper: the Cluster's heartbeats
// keep the leases alive (a daemon ends the leases, and the rkeys, of a client whose heartbeats
// stop). It returns when the device is removed (farmemctl kmod detach, or rmmod) or on
// SIGINT/SIGTERM (then it removes the device itself), and frees the leases.
//
// Re-adoption: the module keeps the client id and identity the leases belong to, each daemon's
// control endpoint, and every slab's lease (read back from /sys/kernel/farmem/slabs). attach run
// while /dev/farmem0 is running (its keeper was killed: systemd restarts it) connects with that
// client id, so its heartbeats renew the same leases (a daemon binds leases to identity + client
// id, auth::LeaseOwner), and becomes the keeper; the device never stopped serving, as long as
// the restart came within the daemons' lease TTL. The re-adopted leases become the Cluster's
// (Cluster::AdoptLeases): eviction notices and a daemon's restart or death reach this keeper
// as they reached the first one.
//
// Rebuilding (replicate:N): the keeper watches the module's status (POLLPRI) and its Cluster's
// events. A copy whose daemon disconnected, whose work requests failed (stale), or whose lease
// its daemon reported lost or is about to evict, gets a new lease by the Cluster's placement on a
// daemon the slab does not use; the module is handed it with the `rebuild` command, copies the
// slab there from a live copy while serving (kmod/farmem_rebuild.c), and the old lease is freed.
// A copy whose lease is noticed (EVICT_NOTICE: the daemon wants the memory back at a deadline)
// while its daemon is still connected and the copy not stale is moved instead: the `move`
// command copies it from that very lease, which serves until the deadline, so nothing is lost
// even with resilience none, and a replicated slab never runs degraded; then the noticed lease
// is freed (the lender's acknowledgement). "rebuild done" is printed once every slab has all
// its copies again.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "farmem/common/auth.h"
#include "farmem/common/config.h"
#include "farmem/common/mutex.h"
#include "farmem/common/wire.h"
#include "farmemctl.h"

namespace farmem::ctl {
namespace {

constexpr int kIfaceVersion = 4;  // kmod/farmem.h FARMEM_IFACE_VERSION
constexpr std::chrono::milliseconds kTokenTimeout{5000};
constexpr size_t kMaxCopies = 3;  // kmod/farmem.h FARMEM_MAX_REPLICAS
constexpr size_t kMaxName = 80;   // kmod/farmem.h FARMEM_NAME_BYTES, with its NUL
constexpr int kMaxPeers = 64;     // kmod/farmem.h FARMEM_MAX_PEERS

Status WriteControl(const std::string& dir, const std::string& line) {
  const std::string path = dir + "/control";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoStatus(StatusCode::kUnavailable,
                       fmt::format("opening {} (is farmem.ko loaded? insmod farmem.ko)", path),
                       errno);
  }
  const ssize_t n = ::write(fd, line.data(), line.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(line.size())) {
    // The token is a secret for 10 s: keep it out of the message.
    std::string shown = line;
    if (line.find(" peer ") != std::string::npos) {  // "... PORT TOKEN ENDPOINT": hide TOKEN
      const size_t end = line.rfind(' ');
      const size_t begin = line.rfind(' ', end - 1);
      shown = line.substr(0, begin) + " <token>" + line.substr(end);
    }
    return ErrnoStatus(StatusCode::kInternal,
                       fmt::format("farmem.ko refused '{}' (its reason is in dmesg)", shown), err);
  }
  return Status::Ok();
}

Result<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Err(ErrnoStatus(StatusCode::kUnavailable, "opening " + path, errno));
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Err(ErrnoStatus(StatusCode::kInternal, "reading " + path, err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

Status CheckVersion(const std::string& dir) {
  auto read = ReadFile(dir + "/version");
  if (!read) return read.error().WithContext("is farmem.ko loaded? (insmod farmem.ko)");
  const std::string& v = *read;
  if (std::atoi(v.c_str()) != kIfaceVersion) {
    return ProtocolError(fmt::format(
        "farmem.ko speaks control interface version {}, this farmemctl speaks {}: use the "
        "farmemctl built with that module",
        v.substr(0, v.find('\n')), kIfaceVersion));
  }
  return Status::Ok();
}

Result<std::string> ResolveIpv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res); rc != 0) {
    return Err(Unavailable(fmt::format("{}: no IPv4 address ({}); farmem.ko connects over IPv4",
                                       host, gai_strerror(rc))));
  }
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, text, sizeof(text));
  ::freeaddrinfo(res);
  return std::string(text);
}

std::string Hex(std::span<const uint8_t> bytes) {
  std::string out;
  for (uint8_t b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

// What the module holds: /sys/kernel/farmem/slabs (kmod/farmem_ctl.c).
struct Held {
  uint64_t size = 0, slab_size = 0;
  size_t copies = 0;
  std::string owner_id, identity;  // empty: not given (a module set up by hand)
  struct Peer {
    int index = 0;
    std::string endpoint;
    bool connected = false;
  };
  struct Slab {
    uint32_t index = 0;
    int peer = 0;
    uint64_t lease_id = 0;
    uint64_t remote_addr = 0;
    uint32_t rkey = 0;
    uint32_t replica = 0;
    bool stale = false;
  };
  std::vector<Peer> peers;
  std::vector<Slab> slabs;
};

Result<Held> ReadHeld(const std::string& dir) {
  FARMEM_ASSIGN_OR_RETURN(std::string text, ReadFile(dir + "/slabs"));
  Held h;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream w(line);
    std::string kind, flag;
    w >> kind;
    if (kind == "size") {
      w >> h.size >> h.slab_size >> h.copies;
    } else if (kind == "owner") {
      w >> h.owner_id >> h.identity;
    } else if (kind == "peer") {
      Held::Peer p;
      std::string ip, port;
      w >> p.index >> ip >> port >> p.endpoint >> flag;
      p.connected = flag == "connected=1";
      h.peers.push_back(std::move(p));
    } else if (kind == "slab") {
      Held::Slab sl;
      w >> sl.index >> sl.peer >> sl.lease_id >> sl.remote_addr >> sl.rkey >> sl.replica >> flag;
      sl.stale = flag == "stale=1";
      h.slabs.push_back(sl);
    } else {
      continue;
    }
    if (w.fail()) return Err(ProtocolError(fmt::format("{}/slabs: bad line '{}'", dir, line)));
  }
  return h;
}

// The status file's state word: none, created or running.
std::string State(const std::string& dir) {
  auto st = ReadFile(dir + "/status");
  if (!st || !st->starts_with("state=")) return "none";
  const std::string rest = st->substr(6);
  return rest.substr(0, rest.find_first_of(" \n"));
}

// Which module peer (kmod/farmem.h: one rdma_cm connection) reaches which daemon.
struct Peers {
  std::map<int, client::NodeId> node_of;  // every module peer index given
  std::map<client::NodeId, int> live;     // the index to use for a node (connected when given)
  int next = 0;                           // the next unused index
};

// Connects the module to the daemon `node` as peer `peers->next`: an RDMA admission token asked
// on a control connection of this client id, then the `peer` command. Running or not.
Result<int> ConnectPeer(client::Cluster& cl, const std::string& dir, client::NodeId node,
                        Peers* peers) {
  if (peers->next >= kMaxPeers) {
    return Err(ResourceExhausted(
        fmt::format("farmem.ko holds at most {} daemon connections and all are used", kMaxPeers)));
  }
  const int index = peers->next;
  const client::NodeInfo info = cl.node(node);
  const std::string endpoint = info.endpoint.ToString();
  if (endpoint.size() >= kMaxName || endpoint.find(' ') != std::string::npos) {
    return Err(InvalidArgument(fmt::format(
        "daemon '{}': farmem.ko keeps a daemon's address in {} characters without spaces: "
        "name it by a shorter address in --peers",
        endpoint, kMaxName - 1)));
  }
  FARMEM_ASSIGN_OR_RETURN(std::string ip, ResolveIpv4(info.endpoint.host));
  FARMEM_ASSIGN_OR_RETURN(transport::TcpConnection conn, cl.ControlConnection(node));
  auto reply = conn.Call(wire::Opcode::kRdmaToken, {}, kTokenTimeout);
  if (!reply) return Err(reply.error().WithContext(endpoint + ": RDMA_TOKEN"));
  FARMEM_ASSIGN_OR_RETURN(wire::RdmaTokenReply token, wire::DecodeRdmaTokenReply(*reply));
  FARMEM_RETURN_IF_ERROR(
      WriteControl(dir, fmt::format("{} peer {} {} {} {} {}", kIfaceVersion, index, ip,
                                    token.rdma_port, Hex(token.token), endpoint))
          .WithContext(fmt::format("connecting farmem.ko to {} (rdma_cm port {})", endpoint,
                                   token.rdma_port)));
  peers->node_of[index] = node;
  peers->live[node] = index;
  peers->next = index + 1;
  return index;
}

// Every daemon must lend slabs of one size and serve RDMA: farmem.ko reads and writes slabs of
// the device's slab size with RDMA only.
Status CheckLease(client::Cluster& cl, const client::Lease& l, uint64_t slab_size) {
  if (l.grant.length != slab_size) {
    return InvalidArgument(fmt::format(
        "daemon {} lends slabs of {}, others {}: farmem.ko needs one slab size",
        cl.node(l.node).endpoint.ToString(), FormatSize(l.grant.length), FormatSize(slab_size)));
  }
  if (l.grant.rkey == 0 && l.grant.remote_addr == 0) {
    return InvalidArgument(
        fmt::format("daemon {} serves no RDMA (run it with --rdma on on an RDMA device's "
                    "address): farmem.ko reads and writes slabs with RDMA only",
                    cl.node(l.node).endpoint.ToString()));
  }
  return Status::Ok();
}

// Leases the slabs and configures the module; on failure the caller removes the device.
// copies: 1 (resilience none) or N (replicate:N: every slab's N copies on N distinct daemons).
// *leases holds slab s's copy r at s * copies + r.
Status Configure(client::Cluster& cl, const std::string& dir, uint64_t size, size_t copies,
                 std::vector<client::Lease>* leases, Peers* peers) {
  uint64_t slab_size = 0;
  for (client::NodeId id = 0; id < cl.node_count() && slab_size == 0; ++id) {
    if (auto st = cl.Stat(id)) slab_size = st->slab_size;
  }
  if (slab_size == 0) return Unavailable("no daemon answered STAT");
  const size_t nslabs = static_cast<size_t>((size + slab_size - 1) / slab_size);
  if (copies == 1) {
    FARMEM_ASSIGN_OR_RETURN(*leases, cl.Allocate(nslabs));
  } else {
    for (size_t i = 0; i < nslabs; ++i) {
      auto group = cl.AllocateGroup(copies);
      if (!group) return group.error().WithContext(fmt::format("slab {}'s {} copies", i, copies));
      leases->insert(leases->end(), group->begin(), group->end());
    }
  }
  for (const client::Lease& l : *leases) FARMEM_RETURN_IF_ERROR(CheckLease(cl, l, slab_size));
  FARMEM_RETURN_IF_ERROR(WriteControl(dir, fmt::format("{} create {} {} {}", kIfaceVersion,
                                                       nslabs * slab_size, slab_size, copies)));
  // Who holds the leases, for a restarted attach to renew them (see the top of this file).
  FARMEM_RETURN_IF_ERROR(WriteControl(
      dir, fmt::format("{} owner {} {}", kIfaceVersion, auth::EncodeHex(cl.client_id()),
                       auth::CanonicalIdentity(cl.options().identity))));
  for (const client::Lease& l : *leases) {
    if (peers->live.contains(l.node)) continue;
    if (auto index = ConnectPeer(cl, dir, l.node, peers); !index) return index.error();
  }
  for (size_t i = 0; i < leases->size(); ++i) {
    const client::Lease& l = (*leases)[i];
    FARMEM_RETURN_IF_ERROR(WriteControl(
        dir,
        fmt::format("{} slab {} {} {} {} {} {}", kIfaceVersion, i / copies, peers->live[l.node],
                    l.id(), l.grant.remote_addr, l.grant.rkey, i % copies)));
  }
  return WriteControl(dir, fmt::format("{} start", kIfaceVersion));
}

// Whether this attach may take over the running device `held`: same size and copies as asked
// (systemd restarts it with the same command line; anything else is a mistake to report).
Status CheckAdoptable(const Held& held, const std::string& dir, uint64_t size, size_t copies) {
  if (held.owner_id.empty()) {
    return InvalidArgument(fmt::format(
        "/dev/farmem0 is running but {}/slabs names no lease owner (it was not set up by "
        "farmemctl kmod attach): remove it first (farmemctl kmod detach)",
        dir));
  }
  const uint64_t want =
      held.slab_size == 0 ? 0 : (size + held.slab_size - 1) / held.slab_size * held.slab_size;
  if (want != held.size || copies != held.copies) {
    return InvalidArgument(fmt::format(
        "/dev/farmem0 is running with {} in {} cop{}; this attach asks for {} in {}: run it "
        "with the device's --size and --resilience to re-adopt it, or detach it first",
        FormatSize(held.size), held.copies, held.copies == 1 ? "y" : "ies", FormatSize(size),
        copies));
  }
  return Status::Ok();
}

// Takes over the device's leases (Cluster::AdoptLeases: checked on each daemon, renewed by this
// Cluster's heartbeats from now on, and covered by its events, Free and Close) and learns which
// module peer reaches which daemon. Leases that lapsed before this restart are reported, not
// recovered here: their bytes are gone (with replicate:N the keeper rebuilds those copies).
// Returns how many leases were adopted.
Result<size_t> Adopt(client::Cluster& cl, const Held& held, Peers* peers) {
  for (const Held::Peer& p : held.peers) {
    bool found = false;
    for (const client::NodeInfo& n : cl.nodes()) {
      if (n.endpoint.ToString() == p.endpoint) {
        peers->node_of[p.index] = n.id;
        if (p.connected) peers->live[n.id] = p.index;
        found = true;
        break;
      }
    }
    if (!found) {
      return Err(InvalidArgument(
          fmt::format("/dev/farmem0 has leases on daemon {}, which --peers does not name: give the "
                      "daemons it was attached with",
                      p.endpoint)));
    }
    peers->next = std::max(peers->next, p.index + 1);
  }
  std::map<client::NodeId, std::vector<uint64_t>> by_node;
  for (const Held::Slab& sl : held.slabs)
    by_node[peers->node_of.at(sl.peer)].push_back(sl.lease_id);
  size_t adopted = 0;
  for (const auto& [node, ids] : by_node) {
    const std::string name = cl.node(node).endpoint.ToString();
    auto gone = cl.AdoptLeases(node, ids);
    if (!gone) {
      spdlog::warn("re-adopting: {} is down ({}): its {} lease(s) cannot be renewed", name,
                   gone.error().ToString(), ids.size());
      continue;
    }
    adopted += ids.size() - gone->size();
    if (!gone->empty()) {
      spdlog::error(
          "re-adopting: {} holds {} of the device's {} lease(s) there: the others lapsed before "
          "this restart (lease TTL {} ms) and their bytes are gone",
          name, ids.size() - gone->size(), ids.size(), cl.node(node).lease_ttl_ms);
    } else {
      spdlog::info("re-adopted {} lease(s) on {} (lease TTL {} ms)", ids.size(), name,
                   cl.node(node).lease_ttl_ms);
    }
  }
  return adopted;
}

// The lease keeper's reaction to lost copies (see the top of this file). Repair() runs on the
// attach command's thread; the Cluster's event callback only records lease ids and wakes it.
class Rebuilder {
 public:
  Rebuilder(client::Cluster& cl, std::string dir, size_t copies)
      : cl_(cl), dir_(std::move(dir)), copies_(copies) {
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  }
  ~Rebuilder() {
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }
  Rebuilder(const Rebuilder&) = delete;
  Rebuilder& operator=(const Rebuilder&) = delete;

  int wake_fd() const { return wake_fd_; }
  // Which module peer reaches which daemon: filled by Configure or Adopt before Repair runs.
  Peers* peers() { return &peers_; }

  // Called on the Cluster's thread: the leases named are gone or going (a daemon down or
  // restarted, an eviction notice), or back (kLeasesReturned).
  void OnEvent(const client::Event& e) {
    spdlog::warn("{} {}: {} lease(s) {}", client::EventTypeName(e.type), e.endpoint.ToString(),
                 e.lease_ids.size(), e.reason.ok() ? "" : e.reason.ToString());
    {
      MutexLock lock(&mu_);
      for (uint64_t id : e.lease_ids) {
        if (e.type == client::EventType::kLeasesReturned) {
          doomed_.erase(id);
        } else if (e.type != client::EventType::kNodeUp) {
          doomed_.insert(id);
        }
      }
    }
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }

  // Gives every lost copy a new lease and has the module rebuild it there; prints "rebuild
  // done" once every slab has all its copies again. Failures are logged (once while they stay
  // the same) and retried at the next call.
  void Repair() {
    uint64_t drained;
    (void)!::read(wake_fd_, &drained, sizeof(drained));
    auto held = ReadHeld(dir_);
    if (!held) return Note("reading " + dir_ + "/slabs: " + held.error().ToString());
    std::map<int, bool> connected;
    for (const Held::Peer& p : held->peers) connected[p.index] = p.connected;
    std::set<uint64_t> doomed;
    {
      MutexLock lock(&mu_);
      doomed = doomed_;
    }
    // Per slab: its copies, and which are lost.
    std::map<uint32_t, std::vector<const Held::Slab*>> slabs;
    for (const Held::Slab& sl : held->slabs) slabs[sl.index].push_back(&sl);
    auto lost = [&](const Held::Slab& sl) {
      return sl.stale || !connected[sl.peer] || doomed.contains(sl.lease_id);
    };
    // A copy that still holds every byte and can be read: a noticed one serves until its
    // deadline, so it is moved from itself rather than rebuilt from another (or lost).
    auto readable = [&](const Held::Slab& sl) { return !sl.stale && connected[sl.peer]; };
    size_t bad = 0;
    std::vector<uint32_t> dead;  // slabs with no live copy left
    bool failed = false;         // a rebuild failed: the others wait for the next round
    bool again = false;          // this slab has another lost copy: it waits for a new round
    bool rerun = false;          // some slab's did: a new round at once
    for (auto& [index, reps] : slabs) {
      const bool any_readable =
          std::ranges::any_of(reps, [&](const auto* r) { return readable(*r); });
      // Noticed copies first: a rebuild of another copy of the slab then reads from a copy
      // that stays.
      std::ranges::stable_partition(reps, [&](const auto* r) { return readable(*r); });
      for (const Held::Slab* sl : reps) {
        if (!lost(*sl)) continue;
        ++bad;
        if (!any_readable) {
          dead.push_back(index);
          break;
        }
        if (failed || again) continue;
        const bool move = readable(*sl);
        const std::string_view why = sl->stale              ? "stale"
                                     : !connected[sl->peer] ? "daemon disconnected"
                                                            : "lease noticed";
        if (Status s = RebuildOne(*sl, reps, held->slab_size, why, move); !s.ok()) {
          Note(fmt::format("{} slab {} copy {}: {} (retried every second)",
                           move ? "moving" : "rebuilding", index, sl->replica, s.ToString()));
          failed = true;
          continue;
        }
        --bad;
        // The slab's copies changed: another lost copy of it is handled on fresh `slabs`.
        again = std::ranges::count_if(reps, [&](const auto* r) { return lost(*r); }) > 1;
      }
      rerun = rerun || again;
      again = false;
    }
    if (rerun) {
      const uint64_t one = 1;
      (void)!::write(wake_fd_, &one, sizeof(one));
    }
    if (!dead.empty()) {
      Note(fmt::format("{} slab(s) have no live copy left{}: their bytes are lost (first: slab {})",
                       dead.size(), copies_ == 1 ? " (resilience none)" : "", dead.front()));
    }
    FreeOrphans(*held);
    if (bad == 0 && degraded_) {
      fmt::print("rebuild done: every slab has its {} cop{} ({} rebuilt, {} moved so far)\n",
                 copies_, copies_ == 1 ? "y" : "ies", rebuilt_, moved_);
      std::fflush(stdout);
      last_note_.clear();
    }
    degraded_ = bad > 0;
  }

 private:
  // A failure worth one log line while it stays the same (Repair retries every second).
  void Note(const std::string& what) {
    if (what != last_note_) spdlog::error("{}", what);
    last_note_ = what;
  }

  // Gives copy sl of a slab a new lease and has the module fill it: from another live copy
  // (`rebuild`), or, move, from sl's own lease, still readable (`move`). Then frees sl's lease.
  Status RebuildOne(const Held::Slab& sl, const std::vector<const Held::Slab*>& reps,
                    uint64_t slab_size, std::string_view why, bool move) {
    std::vector<client::NodeId> exclude;
    for (const Held::Slab* r : reps) exclude.push_back(peers_.node_of.at(r->peer));
    if (!degraded_) {
      spdlog::warn("slab {} copy {} (lease {:#x}) is {} ({}): {} it", sl.index, sl.replica,
                   sl.lease_id, move ? "going" : "lost", why, move ? "moving" : "rebuilding");
    }
    degraded_ = true;
    FARMEM_ASSIGN_OR_RETURN(client::Lease lease, cl_.AllocateExcluding(exclude));
    auto fail = [&](Status s) {
      (void)cl_.Free(std::span<const client::Lease>(&lease, 1));
      return s;
    };
    if (Status s = CheckLease(cl_, lease, slab_size); !s.ok()) return fail(s);
    int index;
    if (auto it = peers_.live.find(lease.node);
        it != peers_.live.end() && PeerConnected(it->second)) {
      index = it->second;
    } else {
      auto connected = ConnectPeer(cl_, dir_, lease.node, &peers_);
      if (!connected) return fail(connected.error());
      index = *connected;
    }
    const auto started = Clock::now();
    if (Status s =
            WriteControl(dir_, fmt::format("{} {} {} {} {} {} {} {}", kIfaceVersion,
                                           move ? "move" : "rebuild", sl.index, sl.replica, index,
                                           lease.id(), lease.grant.remote_addr, lease.grant.rkey));
        !s.ok()) {
      return fail(s);
    }
    ++(move ? moved_ : rebuilt_);
    spdlog::info(
        "slab {} copy {}: {} {} (lease {:#x}) in {} ms", sl.index, sl.replica,
        move ? "moved off " + cl_.node(peers_.node_of.at(sl.peer)).endpoint.ToString() + " to"
             : std::string("rebuilt on"),
        cl_.node(lease.node).endpoint.ToString(), lease.id(),
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started).count());
    // The old lease: gone with its daemon (Free accepts that), or noticed (freeing it is the
    // acknowledgement the lender waits for).
    client::Lease old{peers_.node_of.at(sl.peer), wire::LeaseGrant{.lease_id = sl.lease_id}};
    if (Status s = cl_.Free(std::span<const client::Lease>(&old, 1)); !s.ok()) {
      // (A noticed lease not freed holds up its lender until the deadline: worth a warning.)
      if (move) {
        spdlog::warn("freeing the moved copy's old lease {:#x}: {}", sl.lease_id, s.ToString());
      } else {
        spdlog::debug("freeing the lost copy's lease {:#x}: {}", sl.lease_id, s.ToString());
      }
    }
    MutexLock lock(&mu_);
    doomed_.erase(sl.lease_id);
    return Status::Ok();
  }

  // Leases of this device's owner that a daemon has under notice but the slab table does not
  // name: the old lease of a move that a keeper killed meanwhile had finished (the module
  // switched the slab to the new lease; the old one was never freed). This Cluster's heartbeats
  // renew them and nothing else frees them, so the lender would wait for its deadline: adopt
  // them (checked there) and free them. Only leases outside `held` (read this round; every lease
  // the module serves from is in it, and a lease this keeper leased since is the Cluster's, never
  // listed here), so a lease in use is never freed.
  void FreeOrphans(const Held& held) {
    std::set<uint64_t> in_use;
    for (const Held::Slab& sl : held.slabs) in_use.insert(sl.lease_id);
    std::set<client::NodeId> nodes;
    for (const auto& [peer, node] : peers_.node_of) nodes.insert(node);
    for (client::NodeId node : nodes) {
      std::vector<uint64_t> orphans = cl_.node(node).noticed_not_held;
      std::erase_if(orphans, [&](uint64_t id) { return in_use.contains(id); });
      if (orphans.empty()) continue;
      const std::string name = cl_.node(node).endpoint.ToString();
      auto gone = cl_.AdoptLeases(node, orphans);
      if (!gone) {
        Note(fmt::format("adopting {} orphan lease(s) on {}: {}", orphans.size(), name,
                         gone.error().ToString()));
        continue;
      }
      std::vector<client::Lease> free;
      for (uint64_t id : orphans) {
        if (std::ranges::find(*gone, id) == gone->end()) {
          free.push_back({node, wire::LeaseGrant{.lease_id = id}});
        }
      }
      if (free.empty()) continue;
      const Status s = cl_.Free(free);
      spdlog::warn(
          "freed {} orphan lease(s) on {} (under notice there, in no slab of /dev/farmem0: left "
          "by a move an earlier keeper finished){}",
          free.size(), name, s.ok() ? "" : ": " + s.ToString());
    }
  }

  bool PeerConnected(int index) {
    auto held = ReadHeld(dir_);
    if (!held) return false;
    for (const Held::Peer& p : held->peers) {
      if (p.index == index) return p.connected;
    }
    return false;
  }

  client::Cluster& cl_;
  const std::string dir_;
  const size_t copies_;
  Peers peers_;
  int wake_fd_ = -1;
  Mutex mu_;
  std::set<uint64_t> doomed_ GUARDED_BY(mu_);  // leases the Cluster reported gone or going
  bool degraded_ = false;                      // some copy was lost and is not rebuilt yet
  size_t rebuilt_ = 0;
  size_t moved_ = 0;
  std::string last_note_;
};

}  // namespace

int KmodAttachCmd(const Common& common, const std::string& size_text, const std::string& resilience,
                  const std::string& dir) {
  auto size = ParseSize(size_text);
  if (!size || *size == 0) {
    fmt::print(stderr, "--size: {}\n", size ? "must be > 0" : size.error().ToString());
    return 2;
  }
  size_t copies = 1;
  if (resilience.starts_with("replicate:")) {
    copies = std::strtoul(resilience.c_str() + 10, nullptr, 10);
  } else if (resilience != "none") {
    copies = 0;
  }
  if (copies < 1 || copies > kMaxCopies) {
    fmt::print(stderr, "--resilience: none or replicate:N (N = 2..{}) for farmem.ko, not '{}'\n",
               kMaxCopies, resilience);
    return 2;
  }
  if (Status s = CheckVersion(dir); !s.ok()) {
    fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
    return 1;
  }
  // SIGINT/SIGTERM end the wait below (signalfd), not the process.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);  // before the Cluster starts its threads
  const int sfd = signalfd(-1, &sigs, SFD_CLOEXEC);
  Common c = common;
  c.transport = "tcp";  // the tool only needs control connections; the module does the data

  // A device that is running lost its keeper (killed): re-adopt it. One left half set up by a
  // keeper that died during attach never served anything: remove it and start afresh.
  std::optional<Held> held;
  const std::string state = State(dir);
  if (state == "running") {
    auto h = ReadHeld(dir);
    Status s = h ? CheckAdoptable(*h, dir, *size, copies) : h.error();
    if (!s.ok()) {
      fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
      return 1;
    }
    held = std::move(*h);
  } else if (state == "created") {
    spdlog::warn("farmem.ko holds a device that was never started (its attach died): removing it");
    if (Status s = WriteControl(dir, fmt::format("{} remove", kIfaceVersion)); !s.ok()) {
      fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
      return 1;
    }
  }
  std::optional<wire::ClientId> client_id;
  if (held) {
    auto bytes = auth::DecodeHex(held->owner_id);
    if (!bytes || bytes->size() != client_id.emplace().size()) {
      fmt::print(stderr, "farmemctl kmod attach: {}/slabs: bad owner id '{}'\n", dir,
                 held->owner_id);
      return 1;
    }
    std::memcpy(client_id->data(), bytes->data(), client_id->size());
  }
  auto cluster = ConnectCluster(c, "farmemctl-kmod", client_id);
  if (!cluster) {
    fmt::print(stderr, "farmemctl kmod attach: {}\n", cluster.error().ToString());
    return 1;
  }
  client::Cluster& cl = **cluster;
  // Subscribed before any lease is this Cluster's, so no event about one is missed.
  Rebuilder rebuilder(cl, dir, copies);
  cl.Subscribe([&rebuilder](const client::Event& e) { rebuilder.OnEvent(e); });
  if (held) {
    const std::string_view me = auth::CanonicalIdentity(cl.options().identity);
    Result<size_t> a = me == held->identity
                           ? Adopt(cl, *held, rebuilder.peers())
                           : Err(PermissionDenied(fmt::format(
                                 "/dev/farmem0's leases belong to identity '{}', this attach "
                                 "authenticates as '{}': give that identity's key",
                                 held->identity, me)));
    if (!a) {
      fmt::print(stderr, "farmemctl kmod attach: re-adopting /dev/farmem0: {}\n",
                 a.error().ToString());
      (void)cl.Close();
      return 1;
    }
    std::set<client::NodeId> nodes;
    for (const auto& [index, node] : rebuilder.peers()->node_of) nodes.insert(node);
    fmt::print(
        "re-adopted /dev/farmem0: {} in {} slabs ({}) on {} daemons, {} lease(s); keeping the "
        "leases alive (farmemctl kmod detach, or SIGTERM, ends it)\n",
        FormatSize(held->size), held->size / held->slab_size, resilience, nodes.size(), *a);
  } else {
    std::vector<client::Lease> leases;
    if (Status s = Configure(cl, dir, *size, copies, &leases, rebuilder.peers()); !s.ok()) {
      fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
      (void)WriteControl(dir, fmt::format("{} remove", kIfaceVersion));
      (void)cl.Close();
      return 1;
    }
    fmt::print(
        "attached /dev/farmem0: {} in {} slabs ({}) on {} daemons; keeping the leases alive "
        "(farmemctl kmod detach, or SIGTERM, ends it)\n",
        FormatSize(leases.size() / copies * leases[0].grant.length), leases.size() / copies,
        resilience, rebuilder.peers()->live.size());
  }
  std::fflush(stdout);

  // Wait for the device to go away (status changes wake poll with POLLPRI) or a signal; on a
  // status change or a Cluster event, rebuild what was lost.
  const std::string status_path = dir + "/status";
  const int stfd = ::open(status_path.c_str(), O_RDONLY | O_CLOEXEC);
  std::string last;
  for (;;) {
    char buf[512];
    const ssize_t n = stfd >= 0 ? ::pread(stfd, buf, sizeof(buf) - 1, 0) : -1;
    const std::string st = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "state=none";
    if (st != last) spdlog::info("farmem.ko: {}", st.substr(0, st.find('\n')));
    last = st;
    if (st.starts_with("state=none")) {
      fmt::print("/dev/farmem0 was removed; freeing the leases\n");
      break;
    }
    rebuilder.Repair();
    pollfd p[3] = {{sfd, POLLIN, 0}, {rebuilder.wake_fd(), POLLIN, 0}, {stfd, POLLPRI, 0}};
    // The timeout re-reads the status in case a notification was missed, and retries a
    // rebuild that failed.
    ::poll(p, stfd >= 0 ? 3 : 2, 1000);
    if (p[0].revents & POLLIN) {
      fmt::print("signal: removing /dev/farmem0 and freeing the leases\n");
      if (Status s = WriteControl(dir, fmt::format("{} remove", kIfaceVersion)); !s.ok()) {
        fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
      }
      break;
    }
  }
  if (stfd >= 0) ::close(stfd);
  // Every lease, granted or adopted, is the Cluster's: Close frees them.
  if (Status s = cl.Close(); !s.ok()) {
    fmt::print(stderr, "farmemctl kmod attach: freeing the leases: {}\n", s.ToString());
    return 1;
  }
  return 0;
}

int KmodDetachCmd(const std::string& dir) {
  if (Status s = CheckVersion(dir); !s.ok()) {
    fmt::print(stderr, "farmemctl kmod detach: {}\n", s.ToString());
    return 1;
  }
  // Deleting the disk waits for its outstanding I/O; the attach process then frees the leases.
  if (Status s = WriteControl(dir, fmt::format("{} remove", kIfaceVersion)); !s.ok()) {
    fmt::print(stderr, "farmemctl kmod detach: {}\n", s.ToString());
    return 1;
  }
  return 0;
}

}  // namespace farmem::ctl
