// Server admission (see server.h): the admission thread's epoll loop, accepting, each pending
// connection's non-blocking HELLO/AUTH exchange, handing an authenticated connection to a thread
// of its own (or refusing it), and dropping pending connections that fail or time out. Starting,
// stopping, housekeeping, notices and the auth policy are server.cc.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "connection.h"
#include "server.h"

namespace farmem::daemon {

namespace {
// A handshake reply is small and goes out on a fresh socket: if the kernel does not take all of
// it at once, the peer is not reading, and it is not waited for.
bool SendWithoutBlocking(int fd, std::span<const uint8_t> bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n =
        ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

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

void Server::AdmissionLoop() {
  std::array<epoll_event, 64> events;
  while (!stopping_.load()) {
    const auto now = Clock::now();
    ExpirePending();
    Clock::time_point next = refusals_.Flush(now);
    if (!pending_.empty()) next = std::min(next, pending_.front().deadline);
    if (accept_paused_until_ != Clock::time_point{}) {
      if (now >= accept_paused_until_) {
        accept_paused_until_ = {};
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = kListenerKey;
        ::epoll_ctl(epoll_.fd(), EPOLL_CTL_MOD, listener_.fd(), &ev);
      } else {
        next = std::min(next, accept_paused_until_);
      }
    }
    int timeout_ms = -1;
    if (next != Clock::time_point::max()) {
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now());
      timeout_ms = static_cast<int>(std::clamp<int64_t>(wait.count(), 0, 60'000));
    }
    const int n =
        ::epoll_wait(epoll_.fd(), events.data(), static_cast<int>(events.size()), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::critical("epoll_wait failed: {}; no new connections are admitted", strerror(errno));
      break;
    }
    for (int i = 0; i < n && !stopping_.load(); ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kListenerKey) {
        AcceptAll();
      } else if (key != kWakeKey) {
        OnReadable(key);
      }
    }
  }
  pending_by_serial_.clear();
  pending_.clear();
  pending_count_.store(0);
}

void Server::AcceptAll() {
  // Bounded per wake-up, so connections already being admitted are served during a flood.
  for (int accepted = 0; accepted < 256; ++accepted) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd = ::accept4(listener_.fd(), reinterpret_cast<sockaddr*>(&ss), &len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && !pending_.empty()) {
        // The oldest handshake gives its descriptor to the newest connection.
        DropPending(pending_.begin(), RefusalLog::kPendingLimit,
                    fmt::format("handshake dropped: out of file descriptors ({}); raise the "
                                "open-file limit (LimitNOFILE) or lower --max-pending-handshakes",
                                strerror(errno)));
        continue;
      }
      counters_.refused[RefusalLog::kAcceptFailed].fetch_add(1, std::memory_order_relaxed);
      refusals_.Note(RefusalLog::kAcceptFailed, "listener",
                     fmt::format("accept failed: {}; raise the open-file limit (LimitNOFILE)",
                                 strerror(errno)));
      // Level-triggered: stop watching the listener for a moment instead of spinning on it.
      epoll_event ev{};
      ev.data.u64 = kListenerKey;
      ::epoll_ctl(epoll_.fd(), EPOLL_CTL_MOD, listener_.fd(), &ev);
      accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
      return;
    }
    Socket sock(fd);
    const std::string peer = PeerName(ss);
    if (pending_.size() >= options_.max_pending_handshakes) {
      DropPending(pending_.begin(), RefusalLog::kPendingLimit,
                  fmt::format("handshake dropped for a newer connection: {} connections are in "
                              "HELLO/AUTH (--max-pending-handshakes)",
                              pending_.size()));
    }
    Pending& p =
        pending_.emplace_back(Pending{.serial = kFirstConnectionKey + next_serial_++,
                                      .socket = std::move(sock),
                                      .peer = peer,
                                      .deadline = Clock::now() + options_.handshake_timeout,
                                      .handshake = Handshake(&handshake_config_),
                                      .len = 0,
                                      .buf = {}});
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = p.serial;
    if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, p.socket.fd(), &ev) != 0) {
      spdlog::error("epoll_ctl(ADD) for {}: {}", peer, strerror(errno));
      pending_.pop_back();
      continue;
    }
    pending_by_serial_.emplace(p.serial, std::prev(pending_.end()));
    pending_count_.store(pending_.size(), std::memory_order_relaxed);
    if (pending_.size() > peak_pending_.load(std::memory_order_relaxed)) {
      peak_pending_.store(pending_.size(), std::memory_order_relaxed);
    }
    spdlog::debug("connection from {}", peer);
  }
}

void Server::OnReadable(uint64_t serial) {
  auto found = pending_by_serial_.find(serial);
  if (found == pending_by_serial_.end()) return;  // dropped earlier in this batch of events
  const PendingList::iterator it = found->second;
  Pending& p = *it;
  const ssize_t n = ::recv(p.socket.fd(), p.buf.data() + p.len, p.buf.size() - p.len, 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {
    spdlog::debug("{} left during the handshake", p.peer);
    DropPending(it, RefusalLog::kKinds, {});
    return;
  }
  p.len += static_cast<size_t>(n);
  RefreshHandshakeConfig();
  size_t consumed = 0;
  switch (p.handshake.Feed({p.buf.data(), p.len}, &consumed)) {
    case Handshake::Outcome::kNeedMore:
      // The frame in progress fits: Feed refuses a header announcing more than kMaxHandshakeBody.
      std::memmove(p.buf.data(), p.buf.data() + consumed, p.len - consumed);
      p.len -= consumed;
      if (!p.handshake.output().empty()) {  // the HELLO reply, while AUTH is awaited
        if (!SendWithoutBlocking(p.socket.fd(), p.handshake.output())) {
          DropPending(it, RefusalLog::kBadHandshake, "does not take the HELLO reply; closed");
          return;
        }
        p.handshake.output().clear();
      }
      return;
    case Handshake::Outcome::kRefused: {
      const Status& why = p.handshake.failure();
      DropPending(
          it,
          why.code() == StatusCode::kPermissionDenied ? RefusalLog::kWrongSecret
                                                      : RefusalLog::kBadHandshake,
          fmt::format("{}{}: {}; closed", p.handshake.client_name().empty() ? "" : "client ",
                      p.handshake.client_name(), why.ToString()));
      return;
    }
    case Handshake::Outcome::kAuthenticated:
      Admit(it, consumed);
      return;
  }
}

void Server::Admit(PendingList::iterator it, size_t consumed) {
  Pending& p = *it;
  ::epoll_ctl(epoll_.fd(), EPOLL_CTL_DEL, p.socket.fd(), nullptr);
  ReapFinished();
  size_t served;
  {
    MutexLock lock(&conns_mu_);
    served = conns_.size();  // only this thread adds connections: the count cannot grow
  }
  if (served >= options_.max_connections) {
    p.handshake.Refuse(ResourceExhausted(fmt::format(
        "this daemon already serves {} connections (--max-connections {}): close some or raise "
        "the limit",
        served, options_.max_connections)));
    DropPending(it, RefusalLog::kConnectionLimit,
                fmt::format("authenticated client {} refused: --max-connections {} reached",
                            p.handshake.client_name(), options_.max_connections));
    return;
  }
  const int fd = p.socket.fd();
  // The client counts as connected (STAT) before it sees the handshake's last reply.
  auto conn = std::make_unique<Connection>(
      this, std::move(p.socket), p.peer, p.handshake,
      std::span<const uint8_t>(p.buf).subspan(consumed, p.len - consumed));
  if (!SendWithoutBlocking(fd, p.handshake.output())) {
    conn.reset();
    p.handshake.output().clear();
    DropPending(it, RefusalLog::kBadHandshake, "does not take the handshake reply; closed");
    return;
  }
  // The connection's thread blocks (with deadlines) on its socket.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto finished = std::make_shared<std::atomic<bool>>(false);
  Connection* raw = conn.get();
  std::thread t([raw, finished, batch = options_.batch_scheduling] {
    if (batch) SetBatchScheduling();
    raw->Serve();
    finished->store(true);
  });
  {
    MutexLock lock(&conns_mu_);
    conns_.push_back({std::move(conn), std::move(t), finished});
  }
  spdlog::debug(
      "admitted {} ({}, identity '{}', farmem {})", p.peer, p.handshake.client_name(),
      p.handshake.identity(),
      p.handshake.client_version().empty() ? "version not sent" : p.handshake.client_version());
  pending_by_serial_.erase(p.serial);
  pending_.erase(it);
  pending_count_.store(pending_.size(), std::memory_order_relaxed);
}

void Server::DropPending(PendingList::iterator it, RefusalLog::Kind kind, const std::string& why) {
  Pending& p = *it;
  const int fd = p.socket.fd();
  ::epoll_ctl(epoll_.fd(), EPOLL_CTL_DEL, fd, nullptr);
  if (!p.handshake.output().empty()) {
    // One error reply, then close. What the peer sent that we will never read is drained first,
    // so the close is a FIN after the reply and not a reset that could overtake it.
    (void)SendWithoutBlocking(fd, p.handshake.output());
    ::shutdown(fd, SHUT_WR);
    uint8_t sink[4096];
    for (int i = 0; i < 16 && ::recv(fd, sink, sizeof(sink), 0) > 0; ++i) {
    }
  }
  if (kind != RefusalLog::kKinds) {
    counters_.refused[kind].fetch_add(1, std::memory_order_relaxed);
    refusals_.Note(kind, p.peer, why);
  }
  pending_by_serial_.erase(p.serial);
  pending_.erase(it);
  pending_count_.store(pending_.size(), std::memory_order_relaxed);
}

void Server::ExpirePending() {
  const auto now = Clock::now();
  while (!pending_.empty() && pending_.front().deadline <= now) {
    const Pending& p = pending_.front();
    DropPending(pending_.begin(), RefusalLog::kHandshakeTimeout,
                fmt::format("no {} within {} ms of connecting (--handshake-timeout-ms); closed",
                            p.handshake.hello_done() ? "AUTH" : "HELLO",
                            options_.handshake_timeout.count()));
  }
}

}  // namespace farmem::daemon
