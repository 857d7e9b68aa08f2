// Metrics over HTTP: MetricsServer, the minimal GET /metrics responder the programs run on
// --metrics-listen, the matching client HttpGet, and WritePortFile (the bound port for tests and
// scripts). The registry, exposition and parser are metrics.cc.
#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "farmem/common/metrics.h"

namespace farmem::metrics {

MetricsServer::MetricsServer(const Registry* registry, Socket listener, Socket wake, uint16_t port)
    : registry_(registry), listener_(std::move(listener)), wake_(std::move(wake)), port_(port) {}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const Endpoint& listen,
                                                            const Registry* registry) {
  auto l = ListenTcp(listen, 16);
  if (!l) return Err(l.error().WithContext("metrics listener " + listen.ToString()));
  FARMEM_ASSIGN_OR_RETURN(uint16_t port, LocalPort(*l));
  Socket wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return Err(Internal(fmt::format("eventfd: {}", strerror(errno))));
  std::unique_ptr<MetricsServer> s(
      new MetricsServer(registry, std::move(*l), std::move(wake), port));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsServer::~MetricsServer() {
  stopping_.store(true);
  const uint64_t one = 1;
  (void)!::write(wake_.fd(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

void MetricsServer::Loop() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{listener_.fd(), POLLIN, 0}, {wake_.fd(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics: poll failed: {}; metrics are no longer served", strerror(errno));
      return;
    }
    if (fds[1].revents != 0 || stopping_.load()) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    Socket conn(::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!conn.valid()) {
      // Out of descriptors or a connection reset before accept: try again on the next poll, but
      // not in a busy loop when descriptors stay short.
      if (errno == EMFILE || errno == ENFILE) ::poll(nullptr, 0, 100);
      continue;
    }
    ServeOne(std::move(conn));
  }
}

namespace {

// Sends all of `data` on a non-blocking socket by the deadline; false if the peer went away.
bool SendBy(int fd, std::string_view data, Deadline deadline) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

std::string Reply(int code, std::string_view reason, std::string_view content_type,
                  std::string_view body, bool head_only, std::string_view extra = {}) {
  std::string r = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
      code, reason, content_type, body.size(), extra);
  if (!head_only) r += body;
  return r;
}

}  // namespace

void MetricsServer::ServeOne(Socket conn) {
  const Deadline deadline = DeadlineIn(kRequestTimeout);
  std::string head;
  head.reserve(1024);
  char buf[2048];
  std::string answer;
  for (;;) {
    const size_t end = head.find("\r\n\r\n");
    const size_t lf_end = head.find("\n\n");
    const size_t head_end = std::min(end, lf_end);
    if (head.size() > kMaxRequestHead &&
        (head_end == std::string::npos || head_end > kMaxRequestHead)) {
      answer = Reply(431, "Request Header Fields Too Large", "text/plain",
                     "request head over 8 KiB\n", false);
      break;
    }
    if (head_end != std::string::npos) break;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      answer =
          Reply(408, "Request Timeout", "text/plain", "request not complete within 2 s\n", false);
      break;
    }
    pollfd p{conn.fd(), POLLIN, 0};
    const int pr = ::poll(&p, 1, static_cast<int>(left));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) continue;  // the deadline check above answers
    const ssize_t n = ::recv(conn.fd(), buf, sizeof buf, 0);
    if (n == 0) return;  // closed before a whole request: nothing to answer
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return;
    }
    head.append(buf, static_cast<size_t>(n));
  }
  if (answer.empty()) {
    requests_.fetch_add(1, std::memory_order_relaxed);
    // Request line: METHOD SP TARGET SP HTTP/1.x
    const size_t eol = head.find('\n');
    std::string_view line(head.data(), eol);
    if (line.ends_with('\r')) line.remove_suffix(1);
    const size_t a = line.find(' ');
    const size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
    const bool well_formed = a != std::string_view::npos && b != std::string_view::npos &&
                             line.find(' ', b + 1) == std::string_view::npos && a > 0 &&
                             b > a + 1 && line.substr(b + 1).starts_with("HTTP/1.");
    if (!well_formed) {
      answer = Reply(400, "Bad Request", "text/plain",
                     "expected a request line: GET /metrics HTTP/1.1\n", false);
    } else {
      const std::string_view method = line.substr(0, a);
      std::string_view target = line.substr(a + 1, b - a - 1);
      target = target.substr(0, target.find('?'));
      const bool head_only = method == "HEAD";
      if (method != "GET" && !head_only) {
        answer = Reply(405, "Method Not Allowed", "text/plain", "only GET and HEAD\n", false,
                       "Allow: GET, HEAD\r\n");
      } else if (target == "/metrics") {
        answer = Reply(200, "OK", "text/plain; version=0.0.4; charset=utf-8", registry_->Render(),
                       head_only);
      } else if (target == "/healthz") {
        answer = Reply(200, "OK", "text/plain", "ok\n", head_only);
      } else {
        answer = Reply(404, "Not Found", "text/plain", "not found: try /metrics\n", head_only);
      }
    }
  }
  if (!SendBy(conn.fd(), answer, DeadlineIn(kRequestTimeout))) return;
  // Half-close, then take (and drop) what the client still sends for a moment: closing with
  // unread bytes would make the kernel send a reset, which can destroy the answer before the
  // client has read it (a 431 to an oversized head, say).
  ::shutdown(conn.fd(), SHUT_WR);
  const Deadline drain_until = DeadlineIn(std::chrono::milliseconds(200));
  size_t drained = 0;
  while (drained < (1u << 20)) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(drain_until - Clock::now()).count();
    pollfd p{conn.fd(), POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
    const ssize_t n = ::recv(conn.fd(), buf, sizeof buf, 0);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

Result<HttpResponse> HttpGet(const Endpoint& ep, std::string_view path, Deadline deadline) {
  FARMEM_ASSIGN_OR_RETURN(Socket s, ConnectTcp(ep, deadline));
  const std::string req =
      fmt::format("GET {} HTTP/1.1\r\nHost: {}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n",
                  path, ep.ToString());
  FARMEM_RETURN_IF_ERROR(
      SendAll(s.fd(), {reinterpret_cast<const uint8_t*>(req.data()), req.size()}, deadline));
  std::string all;
  uint8_t buf[16384];
  for (;;) {
    iovec iov{buf, sizeof buf};
    auto n = RecvSome(s.fd(), &iov, 1, deadline);
    if (!n) {
      if (n.error().code() == StatusCode::kUnavailable) break;  // closed: the answer is complete
      return Err(n.error().WithContext("GET http://" + ep.ToString() + std::string(path)));
    }
    all.append(reinterpret_cast<const char*>(buf), *n);
    if (all.size() > (64u << 20)) return Err(ResourceExhausted("HTTP answer over 64 MiB"));
  }
  const size_t end = all.find("\r\n\r\n");
  if (!all.starts_with("HTTP/1.") || end == std::string::npos || all.size() < 12) {
    return Err(ProtocolError(fmt::format("http://{}{} did not answer HTTP", ep.ToString(), path)));
  }
  HttpResponse r;
  r.status = std::atoi(all.substr(9, 3).c_str());
  const std::string head = all.substr(0, end);
  const size_t ct = head.find("\r\nContent-Type: ");
  if (ct != std::string::npos) {
    const size_t e = head.find("\r\n", ct + 2);
    r.content_type = head.substr(ct + 16, e == std::string::npos ? e : e - ct - 16);
  }
  r.body = all.substr(end + 4);
  return r;
}

Status WritePortFile(const std::string& path, uint16_t port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << port << "\n";
    if (!f) return IoError(fmt::format("cannot write {}", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return IoError(fmt::format("cannot rename {} to {}: {}", tmp, path, strerror(errno)));
  }
  return Status::Ok();
}

}  // namespace farmem::metrics
