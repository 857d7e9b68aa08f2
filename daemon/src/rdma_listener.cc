#include "rdma_listener.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "farmem/common/auth.h"
#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"

#ifdef FARMEM_HAVE_VERBS
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#endif

namespace farmem::daemon {

Result<RdmaMode> ParseRdmaMode(std::string_view text) {
  if (text == "off") return RdmaMode::kOff;
  if (text == "auto") return RdmaMode::kAuto;
  if (text == "on") return RdmaMode::kOn;
  return Err(InvalidArgument(fmt::format("--rdma {}: expected auto, on or off", text)));
}

#ifdef FARMEM_HAVE_VERBS

namespace {

std::string AddrName(const sockaddr* sa) {
  if (sa == nullptr) return "?";
  char buf[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    return fmt::format("{}:{}", buf, ntohs(a->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    return fmt::format("[{}]:{}", buf, ntohs(a->sin6_port));
  }
  return "?";
}

std::string ClientName(const wire::ClientId& id) {
  return fmt::format("{:02x}{:02x}{:02x}{:02x}", id[0], id[1], id[2], id[3]);
}

uint64_t TokenKey(const wire::RdmaToken& t) {
  uint64_t k;
  std::memcpy(&k, t.data(), sizeof(k));
  return k;
}

constexpr size_t kMaxTokens = 4096;

}  // namespace

struct RdmaListener::Impl {
  rdma_event_channel* ec = nullptr;
  rdma_cm_id* listen_id = nullptr;
  ibv_context* ctx = nullptr;  // librdmacm's context for the device; not ours to close
  ibv_device_attr attr{};
  ibv_cq* cq = nullptr;  // shared by every queue pair: the daemon posts nothing, nothing completes
  int stop_fd = -1;
  std::thread thread;
  uint16_t port = 0;

  Mutex mu;
  bool stopped GUARDED_BY(mu) = false;
  struct Domain {
    ibv_pd* pd = nullptr;
    uint32_t refs = 0;  // regions + queue pairs
  };
  std::map<wire::ClientId, Domain> domains GUARDED_BY(mu);
  struct Region {
    ibv_mr* mr = nullptr;
    wire::ClientId owner{};
  };
  std::map<uint32_t, Region> regions GUARDED_BY(mu);  // by slab index
  struct Token {
    wire::RdmaToken token{};
    wire::ClientId client{};
    Clock::time_point expiry{};
  };
  std::multimap<uint64_t, Token> tokens GUARDED_BY(mu);  // by the token's first 8 bytes

  // Owned by the event thread (and by Stop once the thread is gone).
  struct Conn {
    wire::ClientId client{};
    std::string peer;
  };
  std::map<rdma_cm_id*, Conn> conns;

  ~Impl() {
    if (listen_id != nullptr) rdma_destroy_id(listen_id);
    if (cq != nullptr) ibv_destroy_cq(cq);
    if (ec != nullptr) rdma_destroy_event_channel(ec);
    if (stop_fd >= 0) ::close(stop_fd);
  }

  Result<ibv_pd*> AcquireDomain(const wire::ClientId& client) REQUIRES(mu) {
    Domain& d = domains[client];
    if (d.pd == nullptr) {
      d.pd = ibv_alloc_pd(ctx);
      if (d.pd == nullptr) {
        const int err = errno;
        domains.erase(client);
        return Err(ErrnoStatus(
            StatusCode::kResourceExhausted,
            fmt::format("allocating a protection domain for client {}", ClientName(client)), err));
      }
    }
    ++d.refs;
    return d.pd;
  }

  void ReleaseDomain(const wire::ClientId& client) REQUIRES(mu) {
    auto it = domains.find(client);
    if (it == domains.end()) return;
    if (--it->second.refs == 0) {
      if (int rc = ibv_dealloc_pd(it->second.pd); rc != 0) {
        spdlog::error("freeing the protection domain of client {}: {}", ClientName(client),
                      strerror(rc));
      }
      domains.erase(it);
    }
  }

  Result<wire::ClientId> ConsumeToken(std::span<const uint8_t> private_data) {
    FARMEM_ASSIGN_OR_RETURN(wire::RdmaToken token, wire::DecodeRdmaConnectData(private_data));
    MutexLock lock(&mu);
    PurgeExpiredTokens();
    auto [lo, hi] = tokens.equal_range(TokenKey(token));
    for (auto it = lo; it != hi; ++it) {
      if (auth::MacEqual(it->second.token, token)) {  // constant time: a guess learns nothing
        const wire::ClientId client = it->second.client;
        tokens.erase(it);
        return client;
      }
    }
    return Err(PermissionDenied(
        "RDMA connect request with an unknown, used or expired token: ask for a token on an "
        "authenticated TCP connection (RDMA_TOKEN) and connect within its lifetime"));
  }

  void PurgeExpiredTokens() REQUIRES(mu) {
    const auto now = Clock::now();
    for (auto it = tokens.begin(); it != tokens.end();) {
      it = it->second.expiry < now ? tokens.erase(it) : std::next(it);
    }
  }

  void EventLoop() {
    for (;;) {
      pollfd fds[2] = {{ec->fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        spdlog::error("rdma listener: poll: {}", strerror(errno));
        return;
      }
      if (fds[1].revents != 0) return;
      rdma_cm_event* ev = nullptr;
      while (rdma_get_cm_event(ec, &ev) == 0) HandleEvent(ev);
    }
  }

  void HandleEvent(rdma_cm_event* ev) {
    rdma_cm_id* id = ev->id;
    const rdma_cm_event_type type = ev->event;
    switch (type) {
      case RDMA_CM_EVENT_CONNECT_REQUEST: {
        const rdma_conn_param param = ev->param.conn;
        std::vector<uint8_t> pdata(
            static_cast<const uint8_t*>(param.private_data),
            static_cast<const uint8_t*>(param.private_data) + param.private_data_len);
        rdma_ack_cm_event(ev);
        OnConnectRequest(id, param, pdata);
        return;
      }
      case RDMA_CM_EVENT_ESTABLISHED: {
        rdma_ack_cm_event(ev);
        auto it = conns.find(id);
        if (it != conns.end()) {
          spdlog::info("RDMA connection from {} (client {}) established", it->second.peer,
                       ClientName(it->second.client));
        }
        return;
      }
      case RDMA_CM_EVENT_DISCONNECTED:
        rdma_ack_cm_event(ev);
        rdma_disconnect(id);  // completes the disconnect handshake; the QP goes to error
        DestroyConn(id, "disconnected");
        return;
      case RDMA_CM_EVENT_REJECTED:
      case RDMA_CM_EVENT_CONNECT_ERROR:
      case RDMA_CM_EVENT_UNREACHABLE: {
        const int status = ev->status;
        rdma_ack_cm_event(ev);
        if (id != listen_id) {
          DestroyConn(id, fmt::format("{} (status {})", rdma_event_str(type), status));
        }
        return;
      }
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        rdma_ack_cm_event(ev);
        spdlog::error("RDMA device removed: RDMA clients of this daemon lose their connections");
        return;
      default:
        rdma_ack_cm_event(ev);
        return;
    }
  }

  void Reject(rdma_cm_id* id, const std::string& peer, const Status& why) {
    spdlog::warn("rejected an RDMA connection from {}: {}", peer, why.ToString());
    uint8_t data[wire::kRdmaRejectDataSize];
    wire::EncodeRdmaRejectData(why.code(), data);
    rdma_reject(id, data, sizeof(data));
    rdma_destroy_id(id);
  }

  void OnConnectRequest(rdma_cm_id* id, const rdma_conn_param& param,
                        std::span<const uint8_t> pdata) {
    const std::string peer = AddrName(rdma_get_peer_addr(id));
    Result<wire::ClientId> client = ConsumeToken(pdata);
    if (!client.has_value()) return Reject(id, peer, client.error());
    if (id->verbs != ctx) {
      return Reject(id, peer,
                    Unavailable("the connection arrived on another RDMA device than the one this "
                                "daemon serves (--rdma-listen names the address to use)"));
    }
    ibv_pd* pd;
    {
      MutexLock lock(&mu);
      if (stopped) return Reject(id, peer, Unavailable("the daemon is shutting down"));
      Result<ibv_pd*> r = AcquireDomain(*client);
      if (!r.has_value()) return Reject(id, peer, r.error());
      pd = *r;
    }
    // The daemon posts no work requests: the queue pair only answers the client's READ/WRITE.
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 1;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    if (rdma_create_qp(id, pd, &init) != 0) {
      const Status s = ErrnoStatus(StatusCode::kResourceExhausted, "creating a queue pair", errno);
      {
        MutexLock lock(&mu);
        ReleaseDomain(*client);
      }
      return Reject(id, peer, s);
    }
    rdma_conn_param accept{};
    // READs the client may have in flight towards us: what it asked for (its initiator depth,
    // which the connect request reports to us as responder_resources), within the device's limit.
    accept.responder_resources = static_cast<uint8_t>(
        std::clamp<int>(param.responder_resources, 1, std::max(attr.max_qp_rd_atom, 1)));
    accept.initiator_depth = 0;  // the daemon never reads from clients
    accept.retry_count = 7;
    accept.rnr_retry_count = 7;
    conns[id] = {*client, peer};
    if (rdma_accept(id, &accept) != 0) {
      spdlog::warn("accepting the RDMA connection from {}: {}", peer, strerror(errno));
      DestroyConn(id, "accept failed");
      return;
    }
    spdlog::debug("RDMA connect request from {} (client {}): accepted, read depth {}", peer,
                  ClientName(*client), accept.responder_resources);
  }

  void DestroyConn(rdma_cm_id* id, std::string_view why) {
    auto it = conns.find(id);
    if (it == conns.end()) return;  // a rejected request, already destroyed
    spdlog::info("RDMA connection from {} (client {}) closed: {}", it->second.peer,
                 ClientName(it->second.client), why);
    rdma_destroy_qp(id);
    {
      MutexLock lock(&mu);
      ReleaseDomain(it->second.client);
    }
    conns.erase(it);
    rdma_destroy_id(id);
  }
};

Result<std::unique_ptr<RdmaListener>> RdmaListener::Start(const Endpoint& listen) {
  auto impl = std::make_unique<Impl>();
  impl->ec = rdma_create_event_channel();
  if (impl->ec == nullptr) {
    return Err(ErrnoStatus(StatusCode::kUnavailable,
                           "no RDMA device (opening the RDMA connection manager)", errno));
  }
  int ndev = 0;
  ibv_context** devs = rdma_get_devices(&ndev);
  if (devs == nullptr || ndev == 0) {
    if (devs != nullptr) rdma_free_devices(devs);
    return Err(Unavailable("no RDMA device"));
  }
  ibv_context* first = devs[0];
  rdma_free_devices(devs);

  if (rdma_create_id(impl->ec, &impl->listen_id, nullptr, RDMA_PS_TCP) != 0) {
    return Err(ErrnoStatus(StatusCode::kUnavailable, "rdma_create_id", errno));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(listen.port);
  if (int rc = ::getaddrinfo(listen.host.empty() ? nullptr : listen.host.c_str(), port.c_str(),
                             &hints, &res);
      rc != 0) {
    return Err(InvalidArgument(
        fmt::format("RDMA listen address {}: {}", listen.ToString(), gai_strerror(rc))));
  }
  const int brc = rdma_bind_addr(impl->listen_id, res->ai_addr);
  const int berr = errno;
  ::freeaddrinfo(res);
  if (brc != 0) {
    return Err(ErrnoStatus(
        StatusCode::kUnavailable,
        fmt::format("no RDMA device serves {} (rdma_bind_addr)", listen.ToString()), berr));
  }
  impl->ctx = impl->listen_id->verbs != nullptr ? impl->listen_id->verbs : first;
  if (rdma_listen(impl->listen_id, 64) != 0) {
    return Err(ErrnoStatus(StatusCode::kUnavailable,
                           fmt::format("rdma_listen on {}", listen.ToString()), errno));
  }
  impl->port = ntohs(rdma_get_src_port(impl->listen_id));
  if (ibv_query_device(impl->ctx, &impl->attr) != 0) {
    return Err(ErrnoStatus(StatusCode::kUnavailable, "ibv_query_device", errno));
  }
  impl->cq = ibv_create_cq(impl->ctx, 1, nullptr, nullptr, 0);
  if (impl->cq == nullptr) {
    return Err(ErrnoStatus(StatusCode::kResourceExhausted, "creating the listener's CQ", errno));
  }
  impl->stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl->stop_fd < 0) return Err(ErrnoStatus(StatusCode::kInternal, "eventfd", errno));
  const int flags = ::fcntl(impl->ec->fd, F_GETFL);
  if (flags < 0 || ::fcntl(impl->ec->fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return Err(
        ErrnoStatus(StatusCode::kInternal, "making the rdma_cm channel non-blocking", errno));
  }
  std::unique_ptr<RdmaListener> l(new RdmaListener(std::move(impl)));
  l->port_ = l->impl_->port;
  l->device_name_ = ibv_get_device_name(l->impl_->ctx->device);
  Impl* raw = l->impl_.get();
  raw->thread = std::thread([raw] { raw->EventLoop(); });
  spdlog::info("RDMA: listening with rdma_cm on {}:{} (device {}, read depth up to {})",
               listen.host, l->port_, l->device_name_, raw->attr.max_qp_rd_atom);
  return l;
}

RdmaListener::RdmaListener(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RdmaListener::~RdmaListener() { Stop(); }

void RdmaListener::Stop() {
  Impl& im = *impl_;
  {
    MutexLock lock(&im.mu);
    if (im.stopped) return;
    im.stopped = true;
  }
  if (im.thread.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(im.stop_fd, &one, sizeof(one));
    im.thread.join();
  }
  while (!im.conns.empty()) {
    rdma_cm_id* id = im.conns.begin()->first;
    rdma_disconnect(id);
    im.DestroyConn(id, "the daemon is shutting down");
  }
  MutexLock lock(&im.mu);
  for (auto& [slab, region] : im.regions) {
    ibv_dereg_mr(region.mr);
    im.ReleaseDomain(region.owner);
  }
  im.regions.clear();
  im.tokens.clear();
}

Result<wire::RdmaTokenReply> RdmaListener::IssueToken(const wire::ClientId& client) {
  wire::RdmaTokenReply reply;
  FARMEM_RETURN_IF_ERROR(auth::RandomBytes(reply.token));
  reply.rdma_port = port_;
  reply.valid_ms = static_cast<uint32_t>(kTokenLifetime.count());
  MutexLock lock(&impl_->mu);
  if (impl_->stopped) return Err(Unavailable("the daemon is shutting down"));
  impl_->PurgeExpiredTokens();
  if (impl_->tokens.size() >= kMaxTokens) {
    return Err(ResourceExhausted(fmt::format(
        "{} RDMA tokens are waiting to be used: connect with the ones you have", kMaxTokens)));
  }
  impl_->tokens.emplace(TokenKey(reply.token),
                        Impl::Token{reply.token, client, Clock::now() + kTokenLifetime});
  return reply;
}

Result<uint32_t> RdmaListener::RegisterLease(uint32_t slab, const wire::ClientId& owner, void* addr,
                                             uint64_t length) {
  MutexLock lock(&impl_->mu);
  if (impl_->stopped) return Err(Unavailable("the RDMA listener is stopped"));
  if (impl_->regions.contains(slab)) {
    return Err(Internal(fmt::format("slab {} is registered twice", slab)));
  }
  FARMEM_ASSIGN_OR_RETURN(ibv_pd * pd, impl_->AcquireDomain(owner));
  ibv_mr* mr = ibv_reg_mr(
      pd, addr, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
  if (mr == nullptr) {
    const int err = errno;
    impl_->ReleaseDomain(owner);
    return Err(ErrnoStatus(
        StatusCode::kResourceExhausted,
        fmt::format("registering slab {} ({}) with RDMA device {} (raise RLIMIT_MEMLOCK?)", slab,
                    FormatSize(length), device_name_),
        err));
  }
  impl_->regions[slab] = {mr, owner};
  return mr->rkey;
}

void RdmaListener::DeregisterLease(uint32_t slab) {
  MutexLock lock(&impl_->mu);
  auto it = impl_->regions.find(slab);
  if (it == impl_->regions.end()) return;
  if (int rc = ibv_dereg_mr(it->second.mr); rc != 0) {
    // Should not happen (no memory windows are ever bound). The region lives on in its owner's
    // protection domain, which is kept (leaked) with it: only that client could still reach it.
    spdlog::critical("deregistering slab {}: {}: its old owner may still reach it over RDMA", slab,
                     strerror(rc));
  } else {
    impl_->ReleaseDomain(it->second.owner);
  }
  impl_->regions.erase(it);
}

#else  // !FARMEM_HAVE_VERBS

struct RdmaListener::Impl {};

Result<std::unique_ptr<RdmaListener>> RdmaListener::Start(const Endpoint&) {
  return Err(Unimplemented("this farmemd was built without RDMA support (FARMEM_WITH_VERBS=OFF)"));
}
RdmaListener::RdmaListener(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RdmaListener::~RdmaListener() = default;
void RdmaListener::Stop() {}
Result<wire::RdmaTokenReply> RdmaListener::IssueToken(const wire::ClientId&) {
  return Err(Unimplemented("built without RDMA support"));
}
Result<uint32_t> RdmaListener::RegisterLease(uint32_t, const wire::ClientId&, void*, uint64_t) {
  return Err(Unimplemented("built without RDMA support"));
}
void RdmaListener::DeregisterLease(uint32_t) {}

#endif

}  // namespace farmem::daemon
