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
// the restart came within the daemons' lease TTL.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "farmem/common/auth.h"
#include "farmem/common/config.h"
#include "farmem/common/wire.h"
#include "farmemctl.h"

namespace farmem::ctl {
namespace {

constexpr int kIfaceVersion = 2;  // kmod/farmem.h FARMEM_IFACE_VERSION
constexpr std::chrono::milliseconds kTokenTimeout{5000};
constexpr size_t kMaxCopies = 3;  // kmod/farmem.h FARMEM_MAX_REPLICAS
constexpr size_t kMaxName = 80;   // kmod/farmem.h FARMEM_NAME_BYTES, with its NUL

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
      uint64_t raddr = 0, rkey = 0;
      w >> sl.index >> sl.peer >> sl.lease_id >> raddr >> rkey >> sl.replica >> flag;
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

// Leases the slabs and configures the module; on failure the caller removes the device.
// copies: 1 (resilience none) or N (replicate:N: every slab's N copies on N distinct daemons).
// *leases holds slab s's copy r at s * copies + r.
Status Configure(client::Cluster& cl, const std::string& dir, uint64_t size, size_t copies,
                 std::vector<client::Lease>* leases) {
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
  for (const client::Lease& l : *leases) {
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
  }
  FARMEM_RETURN_IF_ERROR(WriteControl(dir, fmt::format("{} create {} {} {}", kIfaceVersion,
                                                       nslabs * slab_size, slab_size, copies)));
  // Who holds the leases, for a restarted attach to renew them (see the top of this file).
  FARMEM_RETURN_IF_ERROR(WriteControl(
      dir, fmt::format("{} owner {} {}", kIfaceVersion, auth::EncodeHex(cl.client_id()),
                       auth::CanonicalIdentity(cl.options().identity))));
  std::map<client::NodeId, int> peer_index;
  for (const client::Lease& l : *leases) {
    if (peer_index.contains(l.node)) continue;
    const int index = static_cast<int>(peer_index.size());
    const client::NodeInfo node = cl.node(l.node);
    const std::string endpoint = node.endpoint.ToString();
    if (endpoint.size() >= kMaxName || endpoint.find(' ') != std::string::npos) {
      return InvalidArgument(fmt::format(
          "daemon '{}': farmem.ko keeps a daemon's address in {} characters without spaces: "
          "name it by a shorter address in --peers",
          endpoint, kMaxName - 1));
    }
    FARMEM_ASSIGN_OR_RETURN(std::string ip, ResolveIpv4(node.endpoint.host));
    FARMEM_ASSIGN_OR_RETURN(transport::TcpConnection conn, cl.ControlConnection(l.node));
    auto reply = conn.Call(wire::Opcode::kRdmaToken, {}, kTokenTimeout);
    if (!reply) return reply.error().WithContext(node.endpoint.ToString() + ": RDMA_TOKEN");
    FARMEM_ASSIGN_OR_RETURN(wire::RdmaTokenReply token, wire::DecodeRdmaTokenReply(*reply));
    FARMEM_RETURN_IF_ERROR(
        WriteControl(dir, fmt::format("{} peer {} {} {} {} {}", kIfaceVersion, index, ip,
                                      token.rdma_port, Hex(token.token), endpoint))
            .WithContext(fmt::format("connecting farmem.ko to {} (rdma_cm port {})",
                                     node.endpoint.ToString(), token.rdma_port)));
    peer_index[l.node] = index;
  }
  for (size_t i = 0; i < leases->size(); ++i) {
    const client::Lease& l = (*leases)[i];
    FARMEM_RETURN_IF_ERROR(WriteControl(
        dir, fmt::format("{} slab {} {} {} {} {} {}", kIfaceVersion, i / copies, peer_index[l.node],
                         l.id(), l.grant.remote_addr, l.grant.rkey, i % copies)));
  }
  return WriteControl(dir, fmt::format("{} start", kIfaceVersion));
}

// The leases of a re-adopted device, per node. The Cluster did not grant them, so its Close
// does not free them: the keeper does, at the end (FreeAdopted).
using Adopted = std::map<client::NodeId, std::vector<uint64_t>>;

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

// Renews the device's leases now (a HEARTBEAT as their owner on each daemon) and says which
// node holds which. Leases that lapsed before this restart are reported, not recovered: their
// bytes are gone (the module's reads there fail with remote access errors).
Result<Adopted> Adopt(client::Cluster& cl, const Held& held) {
  std::map<int, client::NodeId> node_of;  // module peer index -> node
  for (const Held::Peer& p : held.peers) {
    bool found = false;
    for (const client::NodeInfo& n : cl.nodes()) {
      if (n.endpoint.ToString() == p.endpoint) {
        node_of[p.index] = n.id;
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
  }
  Adopted adopted;
  for (const Held::Slab& sl : held.slabs) adopted[node_of.at(sl.peer)].push_back(sl.lease_id);
  for (const auto& [node, ids] : adopted) {
    const std::string name = cl.node(node).endpoint.ToString();
    auto conn = cl.ControlConnection(node);
    if (!conn) {
      spdlog::warn("re-adopting: {} is down ({}): its {} lease(s) cannot be renewed", name,
                   conn.error().ToString(), ids.size());
      continue;
    }
    auto reply = conn->Call(wire::Opcode::kHeartbeat, {}, kTokenTimeout);
    if (!reply) return Err(reply.error().WithContext(name + ": HEARTBEAT"));
    FARMEM_ASSIGN_OR_RETURN(wire::HeartbeatReply hb, wire::DecodeHeartbeatReply(*reply));
    if (hb.leases_held < ids.size()) {
      spdlog::error(
          "re-adopting: {} holds {} of the device's {} lease(s) there: the others lapsed before "
          "this restart (lease TTL {} ms) and their bytes are gone",
          name, hb.leases_held, ids.size(), hb.lease_ttl_ms);
    } else {
      spdlog::info("re-adopted {} lease(s) on {} (lease TTL {} ms)", ids.size(), name,
                   hb.lease_ttl_ms);
    }
  }
  return adopted;
}

// Frees a re-adopted device's leases (FREE as their owner). A lease that lapsed meanwhile makes
// a daemon refuse the whole call, so then they go one by one and lapsed ones are skipped.
Status FreeAdopted(client::Cluster& cl, const Adopted& adopted) {
  Status result = Status::Ok();
  auto free = [](transport::TcpConnection& conn, std::span<const uint64_t> ids) {
    wire::FreeRequest req;
    req.lease_ids.assign(ids.begin(), ids.end());
    std::vector<uint8_t> body;
    wire::EncodeFree(req, &body);
    return conn.Call(wire::Opcode::kFree, body, kTokenTimeout);
  };
  for (const auto& [node, ids] : adopted) {
    const std::string name = cl.node(node).endpoint.ToString();
    auto conn = cl.ControlConnection(node);
    if (!conn) {
      result = conn.error().WithContext(fmt::format(
          "freeing {} lease(s) on {} (they lapse with the lease TTL)", ids.size(), name));
      continue;
    }
    for (size_t i = 0; i < ids.size(); i += wire::kMaxLeasesPerCall) {
      const std::span<const uint64_t> batch(
          ids.data() + i, std::min<size_t>(wire::kMaxLeasesPerCall, ids.size() - i));
      if (free(*conn, batch)) continue;
      for (uint64_t id : batch) {
        if (auto r = free(*conn, std::span<const uint64_t>(&id, 1)); !r) {
          spdlog::warn("freeing lease {:#x} on {}: {}", id, name, r.error().ToString());
        }
      }
    }
  }
  return result;
}

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
  Adopted adopted;
  if (held) {
    const std::string_view me = auth::CanonicalIdentity(cl.options().identity);
    Result<Adopted> a = me == held->identity
                            ? Adopt(cl, *held)
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
    adopted = std::move(*a);
    size_t n = 0;
    for (const auto& [node, ids] : adopted) n += ids.size();
    fmt::print(
        "re-adopted /dev/farmem0: {} in {} slabs ({}) on {} daemons, {} lease(s); keeping the "
        "leases alive (farmemctl kmod detach, or SIGTERM, ends it)\n",
        FormatSize(held->size), held->size / held->slab_size, resilience, adopted.size(), n);
  } else {
    std::vector<client::Lease> leases;
    if (Status s = Configure(cl, dir, *size, copies, &leases); !s.ok()) {
      fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
      (void)WriteControl(dir, fmt::format("{} remove", kIfaceVersion));
      (void)cl.Close();
      return 1;
    }
    std::map<client::NodeId, int> per_node;
    for (const auto& l : leases) per_node[l.node]++;
    fmt::print(
        "attached /dev/farmem0: {} in {} slabs ({}) on {} daemons; keeping the leases alive "
        "(farmemctl kmod detach, or SIGTERM, ends it)\n",
        FormatSize(leases.size() / copies * leases[0].grant.length), leases.size() / copies,
        resilience, per_node.size());
  }
  std::fflush(stdout);
  cl.Subscribe([](const client::Event& e) {
    spdlog::warn("{} {}: {} lease(s) {}", client::EventTypeName(e.type), e.endpoint.ToString(),
                 e.lease_ids.size(), e.reason.ok() ? "" : e.reason.ToString());
  });

  // Wait for the device to go away (status changes wake poll with POLLPRI) or a signal.
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
    pollfd p[2] = {{sfd, POLLIN, 0}, {stfd, POLLPRI, 0}};
    // The timeout only re-reads the status in case a notification was missed.
    ::poll(p, stfd >= 0 ? 2 : 1, 1000);
    if (p[0].revents & POLLIN) {
      fmt::print("signal: removing /dev/farmem0 and freeing the leases\n");
      if (Status s = WriteControl(dir, fmt::format("{} remove", kIfaceVersion)); !s.ok()) {
        fmt::print(stderr, "farmemctl kmod attach: {}\n", s.ToString());
      }
      break;
    }
  }
  if (stfd >= 0) ::close(stfd);
  int rc = 0;
  if (Status s = FreeAdopted(cl, adopted); !s.ok()) {
    fmt::print(stderr, "farmemctl kmod attach: freeing the leases: {}\n", s.ToString());
    rc = 1;
  }
  if (Status s = cl.Close(); !s.ok()) {
    fmt::print(stderr, "farmemctl kmod attach: freeing the leases: {}\n", s.ToString());
    return 1;
  }
  return rc;
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
