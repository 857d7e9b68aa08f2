#include "farmem/common/metrics.h"

#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

namespace farmem::metrics {

namespace {

bool ValidName(std::string_view n, bool label) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!label && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

void CheckNames(std::string_view name, const Labels& labels) {
  bool ok = ValidName(name, false);
  for (const auto& [k, v] : labels) ok = ok && ValidName(k, true) && k != "le";
  if (!ok) {
    spdlog::critical("metrics: invalid metric or label name in '{}' (a bug)", name);
    std::abort();
  }
}

const char* TypeName(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AppendEscaped(std::string* out, std::string_view v, bool quote) {
  for (char c : v) {
    if (c == '\\') {
      *out += "\\\\";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '"' && quote) {
      *out += "\\\"";
    } else {
      *out += c;
    }
  }
}

void AppendValue(std::string* out, double v) {
  if (std::isnan(v)) {
    *out += "NaN";
  } else if (std::isinf(v)) {
    *out += v > 0 ? "+Inf" : "-Inf";
  } else if (v == std::floor(v) && std::fabs(v) < 1e15) {
    *out += fmt::format("{}", static_cast<int64_t>(v));
  } else {
    *out += fmt::format("{}", v);
  }
}

void AppendSample(std::string* out, std::string_view name, const Labels& labels,
                  const std::pair<std::string, std::string>* extra, double v) {
  *out += name;
  if (!labels.empty() || extra != nullptr) {
    *out += '{';
    bool first = true;
    auto one = [&](const std::string& k, const std::string& val) {
      if (!first) *out += ',';
      first = false;
      *out += k;
      *out += "=\"";
      AppendEscaped(out, val, true);
      *out += '"';
    };
    for (const auto& [k, val] : labels) one(k, val);
    if (extra != nullptr) one(extra->first, extra->second);
    *out += '}';
  }
  *out += ' ';
  AppendValue(out, v);
  *out += '\n';
}

std::string FormatBound(double b) {
  std::string s;
  AppendValue(&s, b);
  return s;
}

}  // namespace

// ---- Histogram ----

Histogram::Histogram(std::vector<uint64_t> upper_bounds, double scale)
    : bounds_(std::move(upper_bounds)),
      scale_(scale),
      buckets_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {}

std::vector<uint64_t> Histogram::Buckets() const {
  std::vector<uint64_t> b(bounds_.size() + 1);
  for (size_t i = 0; i < b.size(); ++i) b[i] = buckets_[i].load(std::memory_order_relaxed);
  return b;
}

std::vector<uint64_t> LatencyBoundsNs() {
  std::vector<uint64_t> b;
  for (uint64_t us : {10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000,
                      250000, 500000, 1000000, 5000000}) {
    b.push_back(us * 1000);
  }
  return b;
}

// ---- Registry ----

struct Registry::Family {
  std::string name, help;
  Type type;
  std::vector<std::pair<Labels, std::unique_ptr<Counter>>> counters;
  std::vector<std::pair<Labels, std::unique_ptr<Histogram>>> histograms;
  std::vector<std::function<void(const Emit&)>> callbacks;
};

Registry::Registry() = default;
Registry::~Registry() = default;

Registry::Family& Registry::FamilyFor(std::string_view name, std::string_view help, Type type) {
  for (auto& f : families_) {
    if (f->name == name) {
      if (f->type != type) {
        spdlog::critical("metrics: '{}' registered with two types (a bug)", name);
        std::abort();
      }
      return *f;
    }
  }
  auto f = std::make_unique<Family>();
  f->name = std::string(name);
  f->help = std::string(help);
  f->type = type;
  families_.push_back(std::move(f));
  return *families_.back();
}

Counter& Registry::AddCounter(std::string_view name, std::string_view help, Labels labels) {
  CheckNames(name, labels);
  MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, Type::kCounter);
  f.counters.emplace_back(std::move(labels), std::make_unique<Counter>());
  return *f.counters.back().second;
}

Histogram& Registry::AddHistogram(std::string_view name, std::string_view help, Labels labels,
                                  std::vector<uint64_t> upper_bounds, double scale) {
  CheckNames(name, labels);
  MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, Type::kHistogram);
  f.histograms.emplace_back(std::move(labels),
                            std::make_unique<Histogram>(std::move(upper_bounds), scale));
  return *f.histograms.back().second;
}

void Registry::AddCallback(std::string_view name, std::string_view help, Type type,
                           std::function<void(const Emit&)> collect) {
  CheckNames(name, {});
  MutexLock lock(&mu_);
  FamilyFor(name, help, type).callbacks.push_back(std::move(collect));
}

std::string Registry::Render() const {
  MutexLock lock(&mu_);
  std::string out;
  out.reserve(16384);
  for (const auto& f : families_) {
    out += "# HELP ";
    out += f->name;
    out += ' ';
    AppendEscaped(&out, f->help, false);
    out += "\n# TYPE ";
    out += f->name;
    out += ' ';
    out += TypeName(f->type);
    out += '\n';
    for (const auto& [labels, c] : f->counters) {
      AppendSample(&out, f->name, labels, nullptr, static_cast<double>(c->value()));
    }
    for (const auto& [labels, h] : f->histograms) {
      const std::vector<uint64_t> b = h->Buckets();
      uint64_t cum = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        cum += b[i];
        const std::pair<std::string, std::string> le{
            "le", i < h->bounds().size()
                      ? FormatBound(static_cast<double>(h->bounds()[i]) * h->scale())
                      : "+Inf"};
        AppendSample(&out, f->name + "_bucket", labels, &le, static_cast<double>(cum));
      }
      AppendSample(&out, f->name + "_sum", labels, nullptr,
                   static_cast<double>(h->sum()) * h->scale());
      AppendSample(&out, f->name + "_count", labels, nullptr, static_cast<double>(cum));
    }
    for (const auto& collect : f->callbacks) {
      collect([&](const Labels& labels, double v) {
        CheckNames(f->name, labels);
        AppendSample(&out, f->name, labels, nullptr, v);
      });
    }
  }
  return out;
}

// ---- parsing ----

std::string Sample::Label(std::string_view key) const {
  for (const auto& [k, v] : labels) {
    if (k == key) return v;
  }
  return "";
}

namespace {

Status LineError(size_t line, std::string_view text, std::string_view why) {
  return InvalidArgument(fmt::format("metrics exposition line {}: {}: '{}'", line, why,
                                     text.substr(0, std::min<size_t>(text.size(), 120))));
}

bool ParseDouble(std::string_view s, double* v) {
  if (s == "NaN") {
    *v = std::nan("");
    return true;
  }
  if (s == "+Inf" || s == "Inf") {
    *v = HUGE_VAL;
    return true;
  }
  if (s == "-Inf") {
    *v = -HUGE_VAL;
    return true;
  }
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (*b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, *v);
  return ec == std::errc() && p == e;
}

// The family a sample name belongs to, given the declared types.
std::string FamilyOf(const std::string& name, const std::map<std::string, std::string>& types) {
  if (types.count(name)) return name;
  for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      std::string base = name.substr(0, name.size() - suffix.size());
      auto it = types.find(base);
      if (it != types.end() && it->second == "histogram") return base;
    }
  }
  return "";
}

}  // namespace

Result<std::vector<Sample>> ParseExposition(std::string_view text) {
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;
  std::set<std::string> finished;  // families whose lines are over
  std::set<std::string> series;
  std::string current;
  size_t line_no = 0;
  if (!text.empty() && !text.ends_with('\n')) {
    return Err(InvalidArgument("metrics exposition does not end with a newline"));
  }
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (line.empty()) continue;
    if (line[0] == '#') {
      // "# HELP name text" / "# TYPE name type"; other comments are allowed.
      if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
        const bool type = line.starts_with("# TYPE ");
        std::string_view rest = line.substr(7);
        const size_t sp = rest.find(' ');
        const std::string name(rest.substr(0, sp));
        if (!ValidName(name, false)) return Err(LineError(line_no, line, "invalid metric name"));
        if (type) {
          const std::string_view t = sp == std::string_view::npos ? "" : rest.substr(sp + 1);
          if (t != "counter" && t != "gauge" && t != "histogram" && t != "summary" &&
              t != "untyped") {
            return Err(LineError(line_no, line, "unknown metric type"));
          }
          if (types.count(name)) return Err(LineError(line_no, line, "second TYPE line"));
          types[name] = std::string(t);
        }
        if (name != current) {
          if (!current.empty()) finished.insert(current);
          if (finished.count(name)) {
            return Err(LineError(line_no, line, "family continues after other families"));
          }
          current = name;
        }
      }
      continue;
    }
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (!ValidName(s.name, false)) return Err(LineError(line_no, line, "invalid metric name"));
    if (i < line.size() && line[i] == '{') {
      ++i;
      for (;;) {
        if (i < line.size() && line[i] == '}') {
          ++i;
          break;
        }
        size_t k = i;
        while (k < line.size() && line[k] != '=') ++k;
        std::string key(line.substr(i, k - i));
        if (!ValidName(key, true)) return Err(LineError(line_no, line, "invalid label name"));
        if (k + 1 >= line.size() || line[k + 1] != '"') {
          return Err(LineError(line_no, line, "label value not quoted"));
        }
        i = k + 2;
        std::string value;
        bool closed = false;
        while (i < line.size()) {
          const char c = line[i++];
          if (c == '"') {
            closed = true;
            break;
          }
          if (c == '\\') {
            if (i >= line.size()) break;
            const char e = line[i++];
            if (e == 'n') {
              value += '\n';
            } else if (e == '\\' || e == '"') {
              value += e;
            } else {
              return Err(LineError(line_no, line, "invalid escape in label value"));
            }
          } else {
            value += c;
          }
        }
        if (!closed) return Err(LineError(line_no, line, "unterminated label value"));
        for (const auto& [ek, ev] : s.labels) {
          if (ek == key) return Err(LineError(line_no, line, "label given twice"));
        }
        s.labels.emplace_back(std::move(key), std::move(value));
        if (i < line.size() && line[i] == ',') ++i;
      }
    }
    if (i >= line.size() || line[i] != ' ') return Err(LineError(line_no, line, "no value"));
    std::string_view value = line.substr(i + 1);
    const size_t sp = value.find(' ');  // an optional timestamp follows
    if (sp != std::string_view::npos) {
      int64_t ts = 0;
      std::string_view t = value.substr(sp + 1);
      auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), ts);
      if (ec != std::errc() || p != t.data() + t.size()) {
        return Err(LineError(line_no, line, "invalid timestamp"));
      }
      value = value.substr(0, sp);
    }
    if (!ParseDouble(value, &s.value)) return Err(LineError(line_no, line, "invalid value"));
    const std::string family = FamilyOf(s.name, types);
    if (family.empty()) return Err(LineError(line_no, line, "sample without a TYPE line"));
    if (family != current) {
      if (!current.empty()) finished.insert(current);
      if (finished.count(family)) {
        return Err(LineError(line_no, line, "family continues after other families"));
      }
      current = family;
    }
    std::string key = s.name;
    for (const auto& [k, v] : s.labels) key += "\x1f" + k + "\x1e" + v;
    if (!series.insert(key).second) return Err(LineError(line_no, line, "series repeated"));
    samples.push_back(std::move(s));
  }
  // Histograms: per series (labels without le), buckets cumulative, +Inf present and == _count.
  std::map<std::string, std::pair<double, bool>> last_bucket;  // series -> (value, saw +Inf)
  for (const Sample& s : samples) {
    if (!s.name.ends_with("_bucket")) continue;
    const std::string family = s.name.substr(0, s.name.size() - 7);
    auto t = types.find(family);
    if (t == types.end() || t->second != "histogram") continue;
    std::string key = family;
    std::string le;
    for (const auto& [k, v] : s.labels) {
      if (k == "le") {
        le = v;
      } else {
        key += "\x1f" + k + "\x1e" + v;
      }
    }
    double bound = 0;
    if (!ParseDouble(le, &bound)) {
      return Err(InvalidArgument(fmt::format("histogram {}: bucket without a valid le", family)));
    }
    auto [it, inserted] = last_bucket.try_emplace(key, s.value, false);
    if (!inserted && s.value < it->second.first) {
      return Err(InvalidArgument(fmt::format("histogram {}: buckets are not cumulative", family)));
    }
    it->second.first = s.value;
    if (std::isinf(bound)) it->second.second = true;
  }
  for (const auto& [key, v] : last_bucket) {
    if (!v.second) {
      return Err(InvalidArgument(fmt::format("histogram series {} has no le=\"+Inf\" bucket",
                                             key.substr(0, key.find('\x1f')))));
    }
  }
  for (const Sample& s : samples) {
    if (!s.name.ends_with("_count")) continue;
    const std::string family = s.name.substr(0, s.name.size() - 6);
    auto t = types.find(family);
    if (t == types.end() || t->second != "histogram") continue;
    std::string key = family;
    for (const auto& [k, v] : s.labels) key += "\x1f" + k + "\x1e" + v;
    auto it = last_bucket.find(key);
    if (it == last_bucket.end() || it->second.first != s.value) {
      return Err(InvalidArgument(
          fmt::format("histogram {}: _count differs from the +Inf bucket", family)));
    }
  }
  return samples;
}

std::optional<double> Find(const std::vector<Sample>& samples, std::string_view name,
                           const Labels& match) {
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool all = true;
    for (const auto& [k, v] : match) all = all && s.Label(k) == v;
    if (all) return s.value;
  }
  return std::nullopt;
}

// ---- HTTP ----

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
