#include "farmem/common/socket.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace farmem {

void Socket::Close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::Shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

namespace {

int RemainingMs(Deadline deadline) {
  if (deadline == kNoDeadline) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count(), INT_MAX));
}

// Waits for `events`; returns OK when ready.
Status WaitFd(int fd, short events, Deadline deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int ms = RemainingMs(deadline);
    const int n = ::poll(&p, 1, ms);
    if (n > 0) return Status::Ok();
    if (n == 0) return DeadlineExceeded(fmt::format("{}: timed out", what));
    if (errno != EINTR) return ErrnoStatus(StatusCode::kUnavailable, what, errno);
  }
}

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};

Result<std::unique_ptr<addrinfo, AddrInfoDeleter>> Resolve(const std::string& host, uint16_t port,
                                                           bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) {
    return Err(Unavailable(fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc))));
  }
  return std::unique_ptr<addrinfo, AddrInfoDeleter>(res);
}

}  // namespace

Result<Socket> ConnectTcp(const Endpoint& ep, Deadline deadline) {
  FARMEM_ASSIGN_OR_RETURN(auto res, Resolve(ep.host, ep.port, false));
  Status last = Unavailable(fmt::format("connect {}: no addresses", ep.ToString()));
  for (addrinfo* ai = res.get(); ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s.valid()) {
      last = ErrnoStatus(StatusCode::kUnavailable, "socket", errno);
      continue;
    }
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      Status w = WaitFd(s.fd(), POLLOUT, deadline, "connect");
      if (!w.ok()) {
        last = w.WithContext(fmt::format("connect {}", ep.ToString()));
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      last = ErrnoStatus(StatusCode::kUnavailable, fmt::format("connect {}", ep.ToString()), errno);
      continue;
    }
    // Back to blocking: the data path uses blocking calls bounded by poll() deadlines.
    ::fcntl(s.fd(), F_SETFL, ::fcntl(s.fd(), F_GETFL) & ~O_NONBLOCK);
    int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return s;
  }
  return Err(last);
}

Result<Socket> ListenTcp(const Endpoint& ep, int backlog) {
  FARMEM_ASSIGN_OR_RETURN(auto res, Resolve(ep.host, ep.port, true));
  Status last = Unavailable(fmt::format("listen {}: no addresses", ep.ToString()));
  for (addrinfo* ai = res.get(); ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0));
    if (!s.valid()) continue;
    int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last = ErrnoStatus(StatusCode::kUnavailable, fmt::format("bind {}", ep.ToString()), errno);
      continue;
    }
    if (::listen(s.fd(), backlog) != 0) {
      last = ErrnoStatus(StatusCode::kUnavailable, fmt::format("listen {}", ep.ToString()), errno);
      continue;
    }
    return s;
  }
  return Err(last);
}

Result<uint16_t> LocalPort(const Socket& s) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    return Err(ErrnoStatus(StatusCode::kInternal, "getsockname", errno));
  }
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

Result<std::vector<std::string>> ResolveAll(const std::string& host) {
  FARMEM_ASSIGN_OR_RETURN(auto res, Resolve(host, 1, false));
  std::vector<std::string> out;
  for (addrinfo* ai = res.get(); ai != nullptr; ai = ai->ai_next) {
    char buf[NI_MAXHOST];
    if (::getnameinfo(ai->ai_addr, ai->ai_addrlen, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) ==
        0) {
      if (std::find(out.begin(), out.end(), buf) == out.end()) out.emplace_back(buf);
    }
  }
  return out;
}

void AdvanceIov(iovec*& iov, int& iovcnt, size_t bytes) {
  while (iovcnt > 0 && bytes >= iov->iov_len) {
    bytes -= iov->iov_len;
    ++iov;
    --iovcnt;
  }
  if (iovcnt > 0) {
    iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + bytes;
    iov->iov_len -= bytes;
  }
}

Status SendAll(int fd, iovec* iov, int iovcnt, Deadline deadline) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(iovcnt, IOV_MAX));
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        FARMEM_RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline, "send"));
        continue;
      }
      return ErrnoStatus(StatusCode::kUnavailable, "send", errno);
    }
    AdvanceIov(iov, iovcnt, static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status SendAll(int fd, std::span<const uint8_t> bytes, Deadline deadline) {
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  return SendAll(fd, &iov, 1, deadline);
}

Status RecvExactV(int fd, iovec* iov, int iovcnt, Deadline deadline) {
  while (iovcnt > 0 && iov->iov_len == 0) {
    ++iov;
    --iovcnt;
  }
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(iovcnt, IOV_MAX));
    // Blocking receive first (the common case: data is on its way); poll only when a deadline
    // must be enforced and nothing has arrived.
    const ssize_t n = ::recvmsg(fd, &msg, deadline == kNoDeadline ? MSG_WAITALL : MSG_DONTWAIT);
    if (n == 0) return Unavailable("connection closed by peer");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // With no deadline the socket's SO_RCVTIMEO (if set) is what expired.
        if (deadline == kNoDeadline) return DeadlineExceeded("receive timed out");
        FARMEM_RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline, "receive"));
        continue;
      }
      return ErrnoStatus(StatusCode::kUnavailable, "receive", errno);
    }
    AdvanceIov(iov, iovcnt, static_cast<size_t>(n));
  }
  return Status::Ok();
}

Result<size_t> RecvSome(int fd, const iovec* iov, int iovcnt, Deadline deadline) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(std::min(iovcnt, IOV_MAX));
  for (;;) {
    const ssize_t n = ::recvmsg(fd, &msg, deadline == kNoDeadline ? 0 : MSG_DONTWAIT);
    if (n > 0) return static_cast<size_t>(n);
    if (n == 0) return Err(Unavailable("connection closed by peer"));
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return Err(ErrnoStatus(StatusCode::kUnavailable, "receive", errno));
    }
    if (deadline == kNoDeadline) return Err(DeadlineExceeded("receive timed out"));
    FARMEM_RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline, "receive"));
  }
}

Status SetReceiveTimeout(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0) {
    return ErrnoStatus(StatusCode::kInternal, "setsockopt SO_RCVTIMEO", errno);
  }
  return Status::Ok();
}

Status RecvExact(int fd, std::span<uint8_t> out, Deadline deadline) {
  iovec iov{out.data(), out.size()};
  return RecvExactV(fd, &iov, 1, deadline);
}

bool IsConnectionRefused(const Status& s) {
  // ConnectTcp words it with ErrnoStatus: "connect HOST:PORT: " + strerror(ECONNREFUSED).
  return s.code() == StatusCode::kUnavailable &&
         s.message().find(std::strerror(ECONNREFUSED)) != std::string::npos;
}

}  // namespace farmem
