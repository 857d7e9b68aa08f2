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
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/wire.h"
#include "farmemctl.h"

namespace farmem::ctl {
namespace {

constexpr int kIfaceVersion = 1;  // kmod/farmem.h FARMEM_IFACE_VERSION
constexpr std::chrono::milliseconds kTokenTimeout{5000};
constexpr size_t kMaxCopies = 3;  // kmod/farmem.h FARMEM_MAX_REPLICAS

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
    const std::string shown =
        line.substr(0, line.find(" peer ") == std::string::npos ? line.size() : line.rfind(' '));
    return ErrnoStatus(StatusCode::kInternal,
                       fmt::format("farmem.ko refused '{}' (its reason is in dmesg)", shown), err);
  }
  return Status::Ok();
}

Result<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Err(ErrnoStatus(StatusCode::kUnavailable, "opening " + path, errno));
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  const int err = errno;
  ::close(fd);
  if (n < 0) return Err(ErrnoStatus(StatusCode::kInternal, "reading " + path, err));
  return std::string(buf, static_cast<size_t>(n));
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
  std::map<client::NodeId, int> peer_index;
  for (const client::Lease& l : *leases) {
    if (peer_index.contains(l.node)) continue;
    const int index = static_cast<int>(peer_index.size());
    const client::NodeInfo node = cl.node(l.node);
    FARMEM_ASSIGN_OR_RETURN(std::string ip, ResolveIpv4(node.endpoint.host));
    FARMEM_ASSIGN_OR_RETURN(transport::TcpConnection conn, cl.ControlConnection(l.node));
    auto reply = conn.Call(wire::Opcode::kRdmaToken, {}, kTokenTimeout);
    if (!reply) return reply.error().WithContext(node.endpoint.ToString() + ": RDMA_TOKEN");
    FARMEM_ASSIGN_OR_RETURN(wire::RdmaTokenReply token, wire::DecodeRdmaTokenReply(*reply));
    FARMEM_RETURN_IF_ERROR(
        WriteControl(dir, fmt::format("{} peer {} {} {} {}", kIfaceVersion, index, ip,
                                      token.rdma_port, Hex(token.token)))
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
  auto cluster = ConnectCluster(c, "farmemctl-kmod");
  if (!cluster) {
    fmt::print(stderr, "farmemctl kmod attach: {}\n", cluster.error().ToString());
    return 1;
  }
  client::Cluster& cl = **cluster;
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
