// Small RAII and blocking-I/O helpers over POSIX stream sockets, shared by the daemon and the TCP
// transport. Blocking calls take an absolute deadline so no peer can stall a caller forever.
// A Socket is owned by one thread at a time; the functions hold no shared state.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <span>
#include <string>

#include "farmem/common/config.h"
#include "farmem/common/status.h"

namespace farmem {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
inline Deadline DeadlineIn(std::chrono::milliseconds ms) { return Clock::now() + ms; }
inline constexpr Deadline kNoDeadline = Deadline::max();

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      Close();
      fd_ = o.release();
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Close();
  // Wakes any thread blocked on this socket (shutdown both directions); the fd stays open.
  void Shutdown();

 private:
  int fd_ = -1;
};

// Resolves and connects (IPv4/IPv6) with TCP_NODELAY, within the deadline.
Result<Socket> ConnectTcp(const Endpoint& ep, Deadline deadline);
// Whether a ConnectTcp failure was a refusal (ECONNREFUSED: nothing listens on the port, so no
// process that ever listened there is still running) rather than a timeout or an unreachable
// network (a paused, slow or cut-off process).
bool IsConnectionRefused(const Status& s);
// Binds and listens; port 0 picks a free port (see LocalPort).
Result<Socket> ListenTcp(const Endpoint& ep, int backlog = 128);
Result<uint16_t> LocalPort(const Socket& s);
// Every address `host` resolves to (a DNS name with many A/AAAA records gives many peers).
Result<std::vector<std::string>> ResolveAll(const std::string& host);

// Steps past `bytes` bytes of the iovec array (as after a short send or receive): drops the
// iovecs fully covered, shortens the next one. `bytes` must not exceed what the array holds.
void AdvanceIov(iovec*& iov, int& iovcnt, size_t bytes);

// Sends every byte of the iovecs (modifies the array as it goes). Unavailable on a broken peer.
Status SendAll(int fd, iovec* iov, int iovcnt, Deadline deadline);
Status SendAll(int fd, std::span<const uint8_t> bytes, Deadline deadline);
// Receives exactly out.size() bytes. Unavailable if the peer closes first; DeadlineExceeded.
Status RecvExact(int fd, std::span<uint8_t> out, Deadline deadline);
Status RecvExactV(int fd, iovec* iov, int iovcnt, Deadline deadline);
// Receives what has arrived, at least one byte, at most what the iovecs hold: the number of
// bytes. With kNoDeadline it blocks (bounded by SO_RCVTIMEO, if set); errors as RecvExact's.
Result<size_t> RecvSome(int fd, const iovec* iov, int iovcnt, Deadline deadline);
// Bounds blocking receives made with kNoDeadline (they then fail with DeadlineExceeded). The data
// path uses this instead of poll()+recv: one syscall per receive.
Status SetReceiveTimeout(int fd, std::chrono::milliseconds timeout);

}  // namespace farmem
