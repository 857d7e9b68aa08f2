#include "server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>
#include <random>

#include "connection.h"

namespace farmem::daemon {

namespace {
std::string PeerName(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    return fmt::format("{}:{}", buf, ntohs(a->sin_port));
  }
  auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
  return fmt::format("[{}]:{}", buf, ntohs(a->sin6_port));
}
// SCHED_BATCH for the calling thread (see ServerOptions::batch_scheduling). Needs no privilege;
// a failure only costs the optimization.
void SetBatchScheduling() {
  sched_param param{};
  if (::sched_setscheduler(0, SCHED_BATCH, &param) != 0) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      spdlog::info("connection threads keep the default scheduling policy: SCHED_BATCH: {}",
                   strerror(errno));
    }
  }
}
}  // namespace

Server::Server(ServerOptions options, SlabPool* pool) : options_(std::move(options)), pool_(pool) {
  std::random_device rd;
  node_id_ = (uint64_t{rd()} << 32) | rd();
}

Server::~Server() { Stop(); }

Status Server::Start() {
  FARMEM_ASSIGN_OR_RETURN(listener_, ListenTcp(options_.listen));
  FARMEM_ASSIGN_OR_RETURN(port_, LocalPort(listener_));
  FARMEM_RETURN_IF_ERROR(StartRdma());
  if (options_.secret.empty()) {
    spdlog::warn(
        "NO AUTHENTICATION: any client that reaches {}:{} can lease and read this "
        "daemon's memory. Give --secret-file to require a shared secret.",
        options_.listen.host, port_);
  }
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  housekeeping_thread_ = std::thread([this] { HousekeepingLoop(); });
  spdlog::info("listening on {}:{} (node id {:#018x})", options_.listen.host, port_, node_id_);
  return Status::Ok();
}

void Server::Stop() {
  if (stopping_.exchange(true)) return;
  listener_.Shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    std::lock_guard lock(stop_mu_);
    stop_cv_.notify_all();
  }
  if (housekeeping_thread_.joinable()) housekeeping_thread_.join();
  std::vector<Live> conns;
  {
    std::lock_guard lock(conns_mu_);
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

void Server::AcceptLoop() {
  while (!stopping_.load()) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd = ::accept4(listener_.fd(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (stopping_.load()) return;
      if (errno == EMFILE || errno == ENFILE) {
        spdlog::error("accept: {}; raise the open-file limit", strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      spdlog::error("accept failed: {}", strerror(errno));
      return;
    }
    Socket sock(fd);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    const std::string peer = PeerName(ss);
    ReapFinished();
    std::lock_guard lock(conns_mu_);
    if (conns_.size() >= options_.max_connections) {
      spdlog::warn("refusing {}: already serving {} connections (--max-connections)", peer,
                   conns_.size());
      continue;
    }
    spdlog::debug("connection from {}", peer);
    auto conn = std::make_unique<Connection>(this, std::move(sock), peer);
    auto finished = std::make_shared<std::atomic<bool>>(false);
    Connection* raw = conn.get();
    std::thread t([raw, finished, batch = options_.batch_scheduling] {
      if (batch) SetBatchScheduling();
      raw->Serve();
      finished->store(true);
    });
    conns_.push_back({std::move(conn), std::move(t), finished});
  }
}

void Server::ReapFinished() {
  std::vector<Live> done;
  {
    std::lock_guard lock(conns_mu_);
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
  std::unique_lock lock(stop_mu_);
  while (!stopping_.load()) {
    stop_cv_.wait_for(lock, period);
    if (stopping_.load()) break;
    lock.unlock();
    pool_->ReclaimExpired();
    ReapFinished();
    lock.lock();
  }
}

void Server::ClientConnected(const wire::ClientId& id) {
  std::lock_guard lock(conns_mu_);
  ++clients_[id];
}

void Server::ClientDisconnected(const wire::ClientId& id) {
  std::lock_guard lock(conns_mu_);
  auto it = clients_.find(id);
  if (it != clients_.end() && --it->second == 0) clients_.erase(it);
}

uint32_t Server::client_count() {
  std::lock_guard lock(conns_mu_);
  return static_cast<uint32_t>(clients_.size());
}

}  // namespace farmem::daemon
