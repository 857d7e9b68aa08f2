// NbdServer: listeners, the accept thread and connection lifetimes. See nbd_server.h.
#include "farmem/blockdev/nbd_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "farmem/common/adaptive_spin.h"
#include "nbd_connection.h"

namespace farmem::blockdev {

namespace {

std::string PeerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "unknown peer";
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return fmt::format("tcp:{}:{}", host, ntohs(in->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return fmt::format("tcp:[{}]:{}", host, ntohs(in6->sin6_port));
  }
  if (ss.ss_family == AF_UNIX) return "unix client";
  return "peer";
}

bool IsTcp(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
  return ss.ss_family == AF_INET || ss.ss_family == AF_INET6;
}

// Runs (*body)() on a new thread named `name` (top -H, /proc/PID/task/*/comm) with a stack of
// `stack_size` bytes. Returns 0 or an errno value.
int StartThread(pthread_t* thread, const char* name, size_t stack_size,
                std::function<void()>* body) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, stack_size);
  const int rc = pthread_create(
      thread, &attr,
      [](void* arg) -> void* {
        (*static_cast<std::function<void()>*>(arg))();
        return nullptr;
      },
      body);
  pthread_attr_destroy(&attr);
  if (rc == 0) pthread_setname_np(*thread, name);  // cosmetic: a failure changes nothing
  return rc;
}

}  // namespace

Result<std::vector<int>> TakeSocketActivationFds() {
  const char* pid_text = std::getenv("LISTEN_PID");
  const char* fds_text = std::getenv("LISTEN_FDS");
  std::vector<int> fds;
  if (pid_text == nullptr || fds_text == nullptr) return fds;
  char* end = nullptr;
  const long pid = std::strtol(pid_text, &end, 10);
  if (*end != '\0' || pid != static_cast<long>(::getpid())) return fds;  // meant for another
  const long n = std::strtol(fds_text, &end, 10);
  if (*end != '\0' || n < 0 || n > 64) {
    return Err(InvalidArgument(fmt::format("LISTEN_FDS='{}' is not a small number", fds_text)));
  }
  ::unsetenv("LISTEN_PID");
  ::unsetenv("LISTEN_FDS");
  ::unsetenv("LISTEN_FDNAMES");
  constexpr int kFirst = 3;  // SD_LISTEN_FDS_START
  for (int fd = kFirst; fd < kFirst + n; ++fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
      return Err(InvalidArgument(fmt::format("socket activation: fd {} is not a socket", fd)));
    }
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    fds.push_back(fd);
  }
  return fds;
}

Result<std::unique_ptr<NbdServer>> NbdServer::Create(BlockBackend* backend,
                                                     NbdServerOptions options) {
  if (backend == nullptr) return Err(InvalidArgument("no backend"));
  nbd::ExportInfo info;
  info.name = options.export_name;
  info.description = options.description;
  info.size = backend->size();
  info.can_flush = backend->can_flush();
  info.can_fua = backend->can_fua();
  info.can_trim = backend->can_trim();
  info.can_write_zeroes = backend->can_write_zeroes();
  info.can_multi_conn = backend->can_multi_conn();
  if (info.size == 0 || info.size % nbd::kMinBlockSize != 0) {
    return Err(InvalidArgument(fmt::format("export size {} is not a non-zero multiple of {} bytes",
                                           info.size, nbd::kMinBlockSize)));
  }
  if (info.name.size() > nbd::kMaxStringLen || info.description.size() > nbd::kMaxStringLen) {
    return Err(InvalidArgument("export name and description must be at most 4096 bytes"));
  }
  if (options.max_connections == 0) return Err(InvalidArgument("max_connections must be >= 1"));
  if (options.reply_timeout.count() <= 0) return Err(InvalidArgument("reply_timeout must be > 0"));
  if (options.request_busy_poll.count() < 0 ||
      options.request_busy_poll > AdaptiveSpin::kMaxBudget) {
    return Err(InvalidArgument(
        fmt::format("request_busy_poll must be 0 to {} us", AdaptiveSpin::kMaxBudget.count())));
  }
  return std::unique_ptr<NbdServer>(new NbdServer(backend, std::move(options), std::move(info)));
}

NbdServer::NbdServer(BlockBackend* backend, NbdServerOptions options, nbd::ExportInfo info)
    : backend_(backend), options_(std::move(options)), info_(std::move(info)) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

NbdServer::~NbdServer() {
  Stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

Status NbdServer::AddListenerUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument(fmt::format("unix socket path '{}' is empty or too long", path));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return InvalidArgument(fmt::format("'{}' exists and is not a socket", path));
    }
    ::unlink(path.c_str());  // a stale socket from an earlier run
  }
  Socket s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s.valid()) return ErrnoStatus(StatusCode::kIoError, "socket(AF_UNIX)", errno);
  if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(StatusCode::kIoError, fmt::format("bind {}", path), errno);
  }
  if (::listen(s.fd(), 128) != 0) {
    ::unlink(path.c_str());
    return ErrnoStatus(StatusCode::kIoError, fmt::format("listen {}", path), errno);
  }
  listeners_.push_back({std::move(s), "unix:" + path, path, 0});
  return Status::Ok();
}

Status NbdServer::AddListenerTcp(const Endpoint& ep) {
  FARMEM_ASSIGN_OR_RETURN(Socket s, ListenTcp(ep));
  FARMEM_ASSIGN_OR_RETURN(uint16_t port, LocalPort(s));
  ::fcntl(s.fd(), F_SETFL, ::fcntl(s.fd(), F_GETFL) | O_NONBLOCK);
  listeners_.push_back(
      {std::move(s), fmt::format("tcp:{}", Endpoint{ep.host, port}.ToString()), "", port});
  return Status::Ok();
}

Status NbdServer::AdoptListener(int fd) {
  int accepting = 0;
  socklen_t len = sizeof(accepting);
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || !accepting) {
    return InvalidArgument(fmt::format("inherited fd {} is not a listening socket", fd));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  listeners_.push_back({Socket(fd), fmt::format("fd:{}", fd), "", 0});
  return Status::Ok();
}

Status NbdServer::Start() {
  if (wake_fd_ < 0) return ErrnoStatus(StatusCode::kIoError, "eventfd", errno);
  {
    MutexLock lock(&mu_);
    if (stopping_) return Aborted("server is stopping");
  }
  if (accept_started_) return InvalidArgument("server already started");
  for (const std::string& path : options_.unix_paths) FARMEM_RETURN_IF_ERROR(AddListenerUnix(path));
  for (const Endpoint& ep : options_.tcp) FARMEM_RETURN_IF_ERROR(AddListenerTcp(ep));
  for (int fd : options_.inherited_fds) FARMEM_RETURN_IF_ERROR(AdoptListener(fd));
  if (listeners_.empty()) {
    return InvalidArgument("nothing to listen on: give --unix, --listen or socket activation");
  }
  for (const Listener& l : listeners_) spdlog::info("nbd: listening on {}", l.description);
  accept_body_ = [this] { AcceptLoop(); };
  if (const int rc = StartThread(&accept_thread_, "nbd-accept", kThreadStackSize, &accept_body_);
      rc != 0) {
    return ErrnoStatus(StatusCode::kResourceExhausted, "starting the accept thread", rc);
  }
  accept_started_ = true;
  return Status::Ok();
}

std::vector<std::string> NbdServer::listening_on() const {
  std::vector<std::string> out;
  for (const Listener& l : listeners_) out.push_back(l.description);
  return out;
}

uint16_t NbdServer::tcp_port(size_t i) const {
  size_t seen = 0;
  for (const Listener& l : listeners_) {
    if (l.description.starts_with("tcp:") && seen++ == i) return l.tcp_port;
  }
  return 0;
}

size_t NbdServer::active_connections() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& slot : slots_) n += slot->done.load() ? 0 : 1;
  return n;
}

void NbdServer::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(wake_fd_, &one, sizeof(one));
}

void NbdServer::AcceptLoop() {
  std::vector<pollfd> pfds;
  pfds.push_back({wake_fd_, POLLIN, 0});
  for (const Listener& l : listeners_) pfds.push_back({l.socket.fd(), POLLIN, 0});
  for (;;) {
    const int n = ::poll(pfds.data(), pfds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("nbd: poll failed: {}", std::strerror(errno));
      return;
    }
    if (pfds[0].revents) {
      uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof(v));
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
      }
      ReapFinished();
    }
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (!(pfds[i].revents & POLLIN)) continue;
      const int fd = ::accept4(pfds[i].fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          spdlog::warn("nbd: accept: {}; pausing", std::strerror(errno));
          ReapFinished();
          ::usleep(100 * 1000);
        }
        continue;  // EAGAIN, ECONNABORTED, EINTR: nothing to do
      }
      if (IsTcp(fd)) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      }
      Status s = AddConnection(fd, PeerName(fd));
      if (!s.ok()) spdlog::warn("nbd: refused a connection: {}", s.ToString());
    }
  }
}

Status NbdServer::Serve(int fd) { return AddConnection(fd, PeerName(fd)); }

Status NbdServer::AddConnection(int fd, std::string peer) {
  ReapFinished();
  MutexLock lock(&mu_);
  if (stopping_) {
    ::close(fd);
    return Aborted("server is stopping");
  }
  size_t active = 0;
  for (const auto& slot : slots_) active += slot->done.load() ? 0 : 1;
  if (active >= options_.max_connections) {
    ::close(fd);
    return ResourceExhausted(
        fmt::format("{}: already serving {} connections (--max-connections)", peer, active));
  }
  auto slot = std::make_unique<ConnectionSlot>();
  ConnectionSlot* raw = slot.get();
  raw->fd = fd;
  raw->body = [this, raw, fd, peer = std::move(peer)]() mutable {
    {
      NbdConnection conn(fd, std::move(peer), backend_, &info_, options_.metrics,
                         options_.handshake_timeout, options_.reply_timeout,
                         options_.request_busy_poll);
      conn.Run();
    }
    // Tell the client we are done now; the fd itself is closed by whoever joins this thread,
    // so its number cannot be reused while someone might still call shutdown() on it.
    ::shutdown(fd, SHUT_RDWR);
    raw->done.store(true);
    Wake();
  };
  const int rc = StartThread(&raw->thread, "nbd-conn", kThreadStackSize, &raw->body);
  if (rc != 0) {
    ::close(fd);
    return ErrnoStatus(StatusCode::kResourceExhausted, "starting a connection thread", rc);
  }
  slots_.push_back(std::move(slot));
  connections_served_.fetch_add(1);
  return Status::Ok();
}

void NbdServer::ReapFinished() {
  std::vector<std::unique_ptr<ConnectionSlot>> finished;
  {
    MutexLock lock(&mu_);
    for (auto it = slots_.begin(); it != slots_.end();) {
      if ((*it)->done.load()) {
        finished.push_back(std::move(*it));
        it = slots_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& slot : finished) {
    pthread_join(slot->thread, nullptr);
    ::close(slot->fd);
  }
}

void NbdServer::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopping_ = true;
    stopped_ = true;
    // No new requests: each connection finishes the batch it has, sends the replies, and sees
    // end-of-file on its next receive.
    for (const auto& slot : slots_) ::shutdown(slot->fd, SHUT_RD);
  }
  Wake();
  if (accept_started_) {
    pthread_join(accept_thread_, nullptr);
    accept_started_ = false;
  }
  for (Listener& l : listeners_) {
    l.socket.Close();
    if (!l.unix_path.empty()) ::unlink(l.unix_path.c_str());
  }

  const auto deadline = std::chrono::steady_clock::now() + options_.drain_timeout;
  for (;;) {
    bool all_done = true;
    {
      MutexLock lock(&mu_);
      for (const auto& slot : slots_) all_done = all_done && slot->done.load();
      if (!all_done && std::chrono::steady_clock::now() >= deadline) {
        // A client that does not read its replies keeps its thread waiting to send (up to
        // reply_timeout): cut it off.
        for (const auto& slot : slots_) ::shutdown(slot->fd, SHUT_RDWR);
        break;
      }
    }
    if (all_done) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<std::unique_ptr<ConnectionSlot>> all;
  {
    MutexLock lock(&mu_);
    all.swap(slots_);
  }
  for (auto& slot : all) {
    pthread_join(slot->thread, nullptr);
    ::close(slot->fd);
  }
  spdlog::info("nbd: server stopped after {} connections", connections_served_.load());
}

}  // namespace farmem::blockdev
