// Server (see server.h): starting and stopping the listener and threads, RDMA, housekeeping
// (reaping finished connections, trimming after a burst), client bookkeeping, drain and eviction
// notices, and the authentication policy. The admission thread (accept, handshakes, Admit) is
// server_admission.cc.
#include "server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>

#include "connection.h"

namespace farmem::daemon {

namespace {
// Room for a burst of connects while the admission loop is busy (the kernel caps it at somaxconn).
constexpr int kListenBacklog = 4096;
// malloc_trim once this many connections (pending or served) have mostly gone away.
constexpr size_t kTrimAfter = 64;

bool SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

// Every pending handshake and served connection holds a descriptor: ask for as many as the hard
// limit allows, and say so when even that is short of what the options admit.
void RaiseOpenFileLimit(const ServerOptions& o) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }
  const uint64_t wanted = uint64_t{o.max_pending_handshakes} + 2 * uint64_t{o.max_connections} + 64;
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < wanted) {
    spdlog::warn(
        "open-file limit {} is below the {} that --max-pending-handshakes {} and "
        "--max-connections {} may use: a flood then costs handshakes of real clients; raise "
        "LimitNOFILE",
        rl.rlim_cur, wanted, o.max_pending_handshakes, o.max_connections);
  }
}

}  // namespace

Server::Server(ServerOptions options, SlabPool* pool) : options_(std::move(options)), pool_(pool) {
  std::random_device rd;
  node_id_ = (uint64_t{rd()} << 32) | rd();
}

Server::~Server() { Stop(); }

Status Server::Start() {
  RaiseOpenFileLimit(options_);
  FARMEM_ASSIGN_OR_RETURN(listener_, ListenTcp(options_.listen, kListenBacklog));
  FARMEM_ASSIGN_OR_RETURN(port_, LocalPort(listener_));
  FARMEM_RETURN_IF_ERROR(StartRdma());
  if (options_.secret.empty()) {
    spdlog::warn(
        "NO AUTHENTICATION: any client that reaches {}:{} can lease and read this "
        "daemon's memory. Give --secret-file to require a shared secret.",
        options_.listen.host, port_);
  }
  handshake_config_.secret = options_.secret;
  handshake_config_.old_secrets = options_.old_secrets;
  handshake_config_.revoked = options_.revoked;
  {
    MutexLock lock(&auth_mu_);
    auth_ = {options_.secret, options_.old_secrets, options_.revoked};
  }
  handshake_config_.node_id = node_id_;
  // Access reports are accepted whatever the transport (a client counts only what the daemon
  // cannot see: its one-sided RDMA operations).
  handshake_config_.features = (rdma_ != nullptr ? uint32_t{wire::kFeatureVerbs} : 0u) |
                               uint32_t{wire::kFeatureAccessReports};
  if (!SetNonBlocking(listener_.fd())) {
    return ErrnoStatus(StatusCode::kInternal, "O_NONBLOCK on the listening socket", errno);
  }
  epoll_ = Socket(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) return ErrnoStatus(StatusCode::kResourceExhausted, "epoll_create1", errno);
  wake_ = Socket(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_.valid()) return ErrnoStatus(StatusCode::kResourceExhausted, "eventfd", errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenerKey;
  if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, listener_.fd(), &ev) != 0) {
    return ErrnoStatus(StatusCode::kInternal, "epoll_ctl(listener)", errno);
  }
  ev.data.u64 = kWakeKey;
  if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, wake_.fd(), &ev) != 0) {
    return ErrnoStatus(StatusCode::kInternal, "epoll_ctl(eventfd)", errno);
  }
  admission_thread_ = std::thread([this] { AdmissionLoop(); });
  housekeeping_thread_ = std::thread([this] { HousekeepingLoop(); });
  reclaimer_ = std::make_unique<Reclaimer>(options_.reclaim, pool_, this);
  reclaimer_->Start();
  spdlog::info("listening on {}:{} (node id {:#018x})", options_.listen.host, port_, node_id_);
  return Status::Ok();
}

void Server::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_.valid()) {
    const uint64_t one = 1;
    (void)!::write(wake_.fd(), &one, sizeof(one));
  }
  if (admission_thread_.joinable()) admission_thread_.join();
  if (reclaimer_ != nullptr) reclaimer_->Stop();
  {
    MutexLock lock(&stop_mu_);
    stop_cv_.SignalAll();
  }
  if (housekeeping_thread_.joinable()) housekeeping_thread_.join();
  std::vector<Live> conns;
  {
    MutexLock lock(&conns_mu_);
    conns.swap(conns_);
  }
  for (Live& l : conns) l.conn->Shutdown();
  for (Live& l : conns) l.thread.join();
  listener_.Close();
  if (rdma_ != nullptr) {
    pool_->SetRegistrar(nullptr);
    rdma_->Stop();
  }
}

Status Server::StartRdma() {
  if (options_.rdma == RdmaMode::kOff) return Status::Ok();
  Endpoint ep = options_.rdma_listen.value_or(
      Endpoint{options_.listen.host,
               static_cast<uint16_t>(options_.listen.port == 0 || options_.listen.port == 65535
                                         ? 0
                                         : options_.listen.port + 1)});
  const bool loopback = ep.host == "localhost" || ep.host == "::1" || ep.host.starts_with("127.");
  if (loopback && options_.rdma == RdmaMode::kAuto) {
    spdlog::info(
        "RDMA not served on the loopback address {} (soft-RoCE cannot use lo); serving TCP only: "
        "listen on an interface's address, or give --rdma-listen",
        ep.host);
    return Status::Ok();
  }
  Result<std::unique_ptr<RdmaListener>> r = RdmaListener::Start(ep);
  if (!r.has_value()) {
    if (options_.rdma == RdmaMode::kOn) return r.error().WithContext("--rdma on");
    spdlog::info("no RDMA device; serving TCP only ({})", r.error().message());
    return Status::Ok();
  }
  rdma_ = std::move(*r);
  pool_->SetRegistrar(rdma_.get());
  return Status::Ok();
}

void Server::ReapFinished() {
  std::vector<Live> done;
  {
    MutexLock lock(&conns_mu_);
    for (size_t i = 0; i < conns_.size();) {
      if (conns_[i].finished->load()) {
        done.push_back(std::move(conns_[i]));
        conns_[i] = std::move(conns_.back());
        conns_.pop_back();
      } else {
        ++i;
      }
    }
  }
  for (Live& l : done) l.thread.join();
}

void Server::HousekeepingLoop() {
  const auto period = std::max(std::chrono::milliseconds(50), pool_->lease_ttl() / 4);
  MutexLock lock(&stop_mu_);
  while (!stopping_.load()) {
    stop_cv_.WaitFor(&stop_mu_, period);
    if (stopping_.load()) break;
    lock.Unlock();
    pool_->ReclaimExpired();
    ReapFinished();
    TrimAfterBurst();
    lock.Lock();
  }
}

void Server::TrimAfterBurst() {
  size_t served;
  {
    MutexLock lock(&conns_mu_);
    served = conns_.size();
  }
  const size_t pending = pending_count_.load(std::memory_order_relaxed);
  const size_t now = served + pending;
  // Pending connections may come and go between two looks: the admission thread keeps their peak.
  peak_connections_ = std::max(peak_connections_, served + peak_pending_.exchange(pending));
  // After a burst of connections (a flood, or many clients leaving), the heap keeps what their
  // buffers used in per-thread arenas: give it back to the OS once most of them are gone.
  if (peak_connections_ >= kTrimAfter && now <= peak_connections_ / 4) {
    ::malloc_trim(0);
    spdlog::debug("returned free heap memory to the OS after {} connections dropped to {}",
                  peak_connections_, now);
    peak_connections_ = now;
  }
}

void Server::ClientConnected(const wire::ClientId& id, const std::string& name) {
  MutexLock lock(&conns_mu_);
  ClientEntry& e = clients_[id];
  ++e.connections;
  e.name = name;
}

void Server::ClientDisconnected(const wire::ClientId& id) {
  MutexLock lock(&conns_mu_);
  auto it = clients_.find(id);
  if (it != clients_.end() && --it->second.connections == 0) clients_.erase(it);
}

uint32_t Server::Drain(std::chrono::milliseconds grace) {
  return reclaimer_ != nullptr ? reclaimer_->Drain(grace) : 0;
}

void Server::Undrain() {
  if (reclaimer_ != nullptr) reclaimer_->Undrain();
}

void Server::DeliverNotice(const EvictionNotice& notice) {
  std::vector<uint8_t> body;
  wire::EncodeEvictNotice({notice.lease_ids, notice.grace_ms}, &body);
  std::vector<uint8_t> frame(wire::kHeaderSize);
  wire::FrameHeader h;
  h.opcode = static_cast<uint8_t>(wire::Opcode::kEvictNotice);
  h.flags = wire::kFlagPush;
  h.request_id = 0;
  h.body_len = static_cast<uint32_t>(body.size());
  wire::EncodeHeader(h, frame.data());
  frame.insert(frame.end(), body.begin(), body.end());
  size_t queued = 0;
  {
    MutexLock lock(&conns_mu_);
    std::vector<Connection*> mine, control;
    for (const Live& l : conns_) {
      if (l.finished->load() || l.conn->owner() != notice.owner) continue;
      mine.push_back(l.conn.get());
      if (l.conn->is_control()) control.push_back(l.conn.get());
    }
    for (Connection* c : control.empty() ? mine : control) {
      c->QueuePush(frame);
      ++queued;
    }
  }
  counters_.evict_notices.fetch_add(queued, std::memory_order_relaxed);
  counters_.leases_noticed.fetch_add(notice.lease_ids.size(), std::memory_order_relaxed);
  if (queued == 0) {
    spdlog::warn(
        "EVICT_NOTICE for {} lease(s) not sent: their client is not connected; they end at the "
        "deadline ({} ms)",
        notice.lease_ids.size(), notice.grace_ms);
  } else {
    spdlog::info(
        "EVICT_NOTICE for {} lease(s) queued on {} connection(s) of their client; grace {} ms",
        notice.lease_ids.size(), queued, notice.grace_ms);
  }
}

// ---- authentication policy (SIGHUP) ----

Status Server::ReloadAuth(AuthPolicy policy) {
  if (options_.secret.empty() != policy.secret.empty()) {
    return InvalidArgument(
        "authentication cannot be switched on or off by a reload: restart farmemd with or "
        "without --secret-file");
  }
  std::set<std::string, std::less<>> revoked = policy.revoked;
  const size_t old_count = policy.old_secrets.size();
  {
    MutexLock lock(&auth_mu_);
    auth_ = std::move(policy);
  }
  auth_generation_.fetch_add(1, std::memory_order_release);
  // The admission thread takes it up before it feeds any handshake the next bytes.
  size_t closed = 0;
  {
    MutexLock lock(&conns_mu_);
    for (const Live& l : conns_) {
      if (l.finished->load() || !revoked.contains(l.conn->identity())) continue;
      l.conn->Shutdown();
      ++closed;
    }
  }
  spdlog::info(
      "authentication policy reloaded: {} old secret(s) accepted, {} identit{} revoked; closed {} "
      "connection(s) of revoked identities",
      old_count, revoked.size(), revoked.size() == 1 ? "y" : "ies", closed);
  return Status::Ok();
}

std::vector<std::string> Server::Secrets() {
  MutexLock lock(&auth_mu_);
  std::vector<std::string> out{auth_.secret};
  out.insert(out.end(), auth_.old_secrets.begin(), auth_.old_secrets.end());
  return out;
}

void Server::RefreshHandshakeConfig() {
  const uint64_t gen = auth_generation_.load(std::memory_order_acquire);
  if (gen == applied_auth_generation_) return;
  MutexLock lock(&auth_mu_);
  handshake_config_.secret = auth_.secret;
  handshake_config_.old_secrets = auth_.old_secrets;
  handshake_config_.revoked = auth_.revoked;
  applied_auth_generation_ = gen;
}

uint32_t Server::client_count() {
  MutexLock lock(&conns_mu_);
  return static_cast<uint32_t>(clients_.size());
}

std::map<wire::ClientId, std::string> Server::client_names() {
  MutexLock lock(&conns_mu_);
  std::map<wire::ClientId, std::string> names;
  for (const auto& [id, e] : clients_) names[id] = e.name;
  return names;
}

size_t Server::connection_count() {
  MutexLock lock(&conns_mu_);
  size_t n = 0;
  for (const Live& l : conns_) n += l.finished->load() ? 0 : 1;
  return n;
}

}  // namespace farmem::daemon
