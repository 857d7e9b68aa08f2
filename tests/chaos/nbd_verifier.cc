#include "nbd_verifier.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <unordered_map>

#include "nbd_test_client.h"

namespace farmem::chaos {

namespace {

using blockdev::testing::NbdReply;
using blockdev::testing::NbdTestClient;
using SteadyClock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x4B4C42534F414843ull;  // "CHAOSBLK"
constexpr uint16_t kCmdRead = 0;
constexpr uint16_t kCmdWrite = 1;
constexpr size_t kMaxProblems = 8;

uint64_t Mix(uint64_t x) {
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 32);
}

// Generation 0 is a block never written: zeros.
void FillBlock(uint8_t* out, uint32_t unit, uint64_t block, uint32_t gen) {
  if (gen == 0) {
    std::memset(out, 0, unit);
    return;
  }
  const uint64_t head[4] = {kMagic, block, gen, Mix(block ^ (uint64_t{gen} << 40))};
  std::memcpy(out, head, sizeof(head));
  uint64_t x = head[3];
  for (size_t i = sizeof(head); i < unit; i += 8) {
    x = Mix(x + 0x9E3779B97F4A7C15ull);
    std::memcpy(out + i, &x, 8);
  }
}

std::string Describe(const uint8_t* p, uint32_t unit) {
  uint64_t head[3];
  std::memcpy(head, p, sizeof(head));
  if (head[0] == kMagic) return fmt::format("block {} generation {}", head[1], head[2]);
  if (std::all_of(p, p + unit, [](uint8_t b) { return b == 0; })) return "zeros";
  return "bytes that are no block of this test";
}

}  // namespace

struct NbdVerifier::Conn {
  struct Pending {
    uint16_t type = 0;
    uint64_t block = 0;  // region-relative
    uint32_t n = 0;
    std::vector<uint32_t> gens;  // writes
    SteadyClock::time_point sent;
  };

  std::optional<NbdTestClient> client;
  std::chrono::milliseconds request_timeout{120000};  // NbdWorkloadOptions::request_timeout
  uint32_t unit = 4096;                               // bytes per block
  uint64_t first = 0;                                 // first block of the region
  uint64_t blocks = 0;
  std::vector<uint32_t> gen;  // last acknowledged generation per block
  std::vector<uint8_t> busy;  // a request on the block is in flight
  std::unordered_map<uint64_t, std::vector<uint32_t>> maybe;  // after failed writes
  uint32_t next_gen = 1;
  uint64_t next_handle = 1;
  std::unordered_map<uint64_t, Pending> pending;
  std::mt19937_64 rng;
  std::vector<uint8_t> buf;
  NbdWorkloadReport r;
  // Final verification: a failed read is counted in final_read_errors (the caller turns it into
  // lost bytes), not as a failed request of the run.
  bool final_pass = false;
  uint64_t final_read_errors = 0;

  void Problem(std::string what) {
    if (r.problems.size() < kMaxProblems) r.problems.push_back(std::move(what));
  }

  bool Expected(uint64_t b, const uint8_t* got, std::vector<uint8_t>& scratch) {
    scratch.resize(unit);
    FillBlock(scratch.data(), unit, first + b, gen[b]);
    if (std::memcmp(scratch.data(), got, unit) == 0) return true;
    auto it = maybe.find(b);
    if (it == maybe.end()) return false;
    for (uint32_t g : it->second) {
      FillBlock(scratch.data(), unit, first + b, g);
      if (std::memcmp(scratch.data(), got, unit) == 0) return true;
    }
    return false;
  }

  void CheckRead(uint64_t b, uint32_t n, const std::vector<uint8_t>& data) {
    std::vector<uint8_t> scratch;
    for (uint32_t i = 0; i < n; ++i) {
      const uint8_t* p = data.data() + static_cast<size_t>(i) * unit;
      if (Expected(b + i, p, scratch)) {
        r.bytes_verified += unit;
      } else {
        r.bytes_corrupt += unit;
        Problem(fmt::format("CORRUPT: block {} ({} bytes) should hold generation {} but holds {}",
                            first + b + i, unit, gen[b + i], Describe(p, unit)));
      }
    }
  }

  // `completed`: replies may be read while the request is sent (see SendReading); a WRITE of the
  // workload's (Fill, the run) is sent that way.
  Status Send(uint16_t type, uint64_t b, uint32_t n, std::atomic<uint64_t>* completed = nullptr) {
    Pending p{type, b, n, {}, SteadyClock::now()};
    std::span<const uint8_t> payload;
    if (type == kCmdWrite) {
      buf.resize(static_cast<size_t>(n) * unit);
      for (uint32_t i = 0; i < n; ++i) {
        p.gens.push_back(next_gen++);
        FillBlock(buf.data() + static_cast<size_t>(i) * unit, unit, first + b + i, p.gens.back());
      }
      payload = buf;
    }
    for (uint32_t i = 0; i < n; ++i) busy[b + i] = 1;
    const uint64_t handle = next_handle++;
    p.sent = SteadyClock::now();
    pending.emplace(handle, std::move(p));
    if (completed != nullptr && type == kCmdWrite) {
      return SendReading(type, handle, (first + b) * unit, n * unit, payload, *completed);
    }
    return client->Send(type, 0, handle, (first + b) * unit, n * unit, payload);
  }

  // Sends a request, reading replies whenever the socket takes no more of it. farmem-nbd reads no
  // new request while replies it owes are refused by the socket (they would have nowhere to go):
  // a client that blocks in a send while it owes reads of earlier replies (a WRITE of up to 64 KiB
  // after READs whose replies fill the socket) deadlocks with it, until farmem-nbd drops the
  // connection after --reply-timeout (30 s). A real NBD client reads replies on their own thread.
  Status SendReading(uint16_t type, uint64_t handle, uint64_t offset, uint32_t length,
                     std::span<const uint8_t> payload, std::atomic<uint64_t>& completed) {
    std::vector<uint8_t> msg = blockdev::testing::RequestBytes(type, 0, handle, offset, length);
    msg.insert(msg.end(), payload.begin(), payload.end());
    client->Expect(type, handle, offset, length);
    const int fd = client->fd();
    const auto deadline = SteadyClock::now() + request_timeout;
    size_t sent = 0;
    while (sent < msg.size()) {
      const ssize_t w =
          ::send(fd, msg.data() + sent, msg.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w > 0) {
        sent += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        return IoError(fmt::format("send: {}", std::strerror(errno)));
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
      if (left.count() <= 0) return DeadlineExceeded("send: the server took no more bytes");
      pollfd pfd{fd, POLLIN | POLLOUT, 0};
      const int rc = ::poll(&pfd, 1, static_cast<int>(left.count()));
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) return IoError(fmt::format("poll: {}", std::strerror(errno)));
      if ((pfd.revents & POLLIN) != 0) FARMEM_RETURN_IF_ERROR(ReceiveOne(completed));
    }
    return Status::Ok();
  }

  // Receives one reply and accounts for it.
  Status ReceiveOne(std::atomic<uint64_t>& completed) {
    Result<NbdReply> reply = client->Receive();
    if (!reply) return reply.error();
    auto it = pending.find(reply->handle);
    if (it == pending.end()) return Status(StatusCode::kProtocolError, "reply to no request");
    Pending p = std::move(it->second);
    pending.erase(it);
    const double ms =
        std::chrono::duration<double, std::milli>(SteadyClock::now() - p.sent).count();
    r.longest_stall_ms = std::max(r.longest_stall_ms, ms);
    ++r.requests;
    completed.fetch_add(1, std::memory_order_relaxed);
    for (uint32_t i = 0; i < p.n; ++i) busy[p.block + i] = 0;
    if (p.type == kCmdWrite) {
      for (uint32_t i = 0; i < p.n; ++i) {
        if (reply->error == 0) {
          gen[p.block + i] = p.gens[i];
          maybe.erase(p.block + i);
        } else {
          maybe[p.block + i].push_back(p.gens[i]);
        }
      }
      if (reply->error == 0) {
        r.bytes_written += static_cast<uint64_t>(p.n) * unit;
      } else {
        ++r.failed_requests;
        Problem(fmt::format("WRITE of blocks {}..{} failed: error {} {}", first + p.block,
                            first + p.block + p.n, reply->error, reply->message));
      }
    } else if (reply->error == 0) {
      CheckRead(p.block, p.n, reply->data);
    } else if (final_pass) {
      ++final_read_errors;
    } else {
      ++r.failed_requests;
      Problem(fmt::format("READ of blocks {}..{} failed: error {} {}", first + p.block,
                          first + p.block + p.n, reply->error, reply->message));
    }
    return Status::Ok();
  }
};

NbdVerifier::NbdVerifier(NbdWorkloadOptions options) : options_(std::move(options)) {}

NbdVerifier::~NbdVerifier() { Stop(); }

Status NbdVerifier::Connect() {
  if (options_.unit != 4096 && options_.unit != 512) {
    return InvalidArgument(
        fmt::format("NbdWorkloadOptions::unit is 4096 or 512, not {}", options_.unit));
  }
  blockdev::testing::ClientOptions co;
  co.timeout = options_.request_timeout;
  for (int c = 0; c < options_.connections; ++c) {
    auto client = NbdTestClient::Connect(options_.socket_path, co);
    if (!client) return client.error();
    auto conn = std::make_unique<Conn>();
    size_ = client->size();
    conn->client.emplace(std::move(*client));
    conn->unit = options_.unit;
    conn->request_timeout = options_.request_timeout;
    conn->r.unit = options_.unit;
    conn->rng.seed(0xC4A05 + options_.seed * 1000 + static_cast<uint64_t>(c));
    conns_.push_back(std::move(conn));
  }
  const uint64_t total = size_ / options_.unit;
  const uint64_t per = total / conns_.size();
  for (size_t c = 0; c < conns_.size(); ++c) {
    Conn& k = *conns_[c];
    k.first = c * per;
    k.blocks = c + 1 == conns_.size() ? total - k.first : per;
    k.gen.assign(k.blocks, 0);
    k.busy.assign(k.blocks, 0);
  }
  return Status::Ok();
}

namespace {

// Runs fn(conn) on one thread per connection and returns the first error.
template <typename Fn>
Status OnEveryConnection(std::vector<std::unique_ptr<NbdVerifier::Conn>>& conns, Fn fn) {
  std::vector<Status> st(conns.size());
  std::vector<std::thread> threads;
  for (size_t c = 0; c < conns.size(); ++c) {
    threads.emplace_back([&, c] { st[c] = fn(*conns[c]); });
  }
  for (auto& t : threads) t.join();
  for (Status& s : st) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace

Status NbdVerifier::Fill() {
  return OnEveryConnection(conns_, [&](Conn& k) -> Status {
    uint64_t b = 0;
    while (b < k.blocks || !k.pending.empty()) {
      while (b < k.blocks && k.pending.size() < static_cast<size_t>(options_.depth)) {
        const uint32_t n =
            static_cast<uint32_t>(std::min<uint64_t>(options_.max_request_blocks, k.blocks - b));
        FARMEM_RETURN_IF_ERROR(k.Send(kCmdWrite, b, n, &completed_));
        b += n;
      }
      FARMEM_RETURN_IF_ERROR(k.ReceiveOne(completed_));
    }
    return Status::Ok();
  });
}

void NbdVerifier::Start() {
  stop_ = false;
  const double per_conn_rate =
      options_.ops_per_second > 0 ? options_.ops_per_second / conns_.size() : 0;
  for (auto& conn : conns_) {
    threads_.emplace_back([this, &k = *conn, per_conn_rate] {
      // Pacing a workload is about time itself: requests are spread evenly over each second.
      const auto interval = per_conn_rate > 0
                                ? std::chrono::duration_cast<SteadyClock::duration>(
                                      std::chrono::duration<double>(1.0 / per_conn_rate))
                                : SteadyClock::duration::zero();
      auto next = SteadyClock::now();
      auto fail = [&](const Status& s) {
        k.r.transport_failed = true;
        k.Problem("connection failed: " + s.ToString());
      };
      while (!stop_.load(std::memory_order_relaxed)) {
        while (k.pending.size() < static_cast<size_t>(options_.depth) &&
               !stop_.load(std::memory_order_relaxed)) {
          if (interval.count() > 0) {
            if (SteadyClock::now() < next && !k.pending.empty()) break;
            // Pacing to the configured request rate: time is the subject, not a wait on state.
            if (SteadyClock::now() < next) std::this_thread::sleep_until(next);
            next += interval;
          }
          // Mostly single blocks, some runs of up to max_request_blocks.
          const uint32_t want =
              k.rng() % 4 != 0 ? 1
                               : 1 + static_cast<uint32_t>(k.rng() % options_.max_request_blocks);
          const uint64_t b = k.rng() % k.blocks;
          const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(want, k.blocks - b));
          bool free = true;
          for (uint32_t i = 0; i < n && free; ++i) free = !k.busy[b + i];
          if (!free) continue;
          const uint16_t type =
              static_cast<int>(k.rng() % 100) < options_.read_percent ? kCmdRead : kCmdWrite;
          if (Status s = k.Send(type, b, n, &completed_); !s.ok()) {
            fail(s);
            return;
          }
        }
        if (k.pending.empty()) continue;
        if (Status s = k.ReceiveOne(completed_); !s.ok()) {
          fail(s);
          return;
        }
      }
      while (!k.pending.empty()) {
        if (Status s = k.ReceiveOne(completed_); !s.ok()) {
          fail(s);
          return;
        }
      }
    });
  }
}

void NbdVerifier::Stop() {
  stop_ = true;
  for (auto& t : threads_) t.join();
  threads_.clear();
}

Status NbdVerifier::VerifyAll() {
  return OnEveryConnection(conns_, [&](Conn& k) -> Status {
    // Reads of up to max_request_blocks, pipelined; a read that fails is retried block by block
    // so that exactly the lost blocks are counted.
    std::vector<std::pair<uint64_t, uint32_t>> failed;
    k.final_pass = true;
    uint64_t b = 0;
    while (b < k.blocks || !k.pending.empty()) {
      while (b < k.blocks && k.pending.size() < static_cast<size_t>(options_.depth)) {
        const uint32_t n =
            static_cast<uint32_t>(std::min<uint64_t>(options_.max_request_blocks, k.blocks - b));
        FARMEM_RETURN_IF_ERROR(k.Send(kCmdRead, b, n));
        b += n;
      }
      // Which request failed: the one no longer pending after a reply that raised the count.
      std::unordered_map<uint64_t, std::pair<uint64_t, uint32_t>> what;
      for (auto& [h, p] : k.pending) what[h] = {p.block, p.n};
      const uint64_t before = k.final_read_errors;
      FARMEM_RETURN_IF_ERROR(k.ReceiveOne(completed_));
      if (k.final_read_errors != before) {
        for (auto& [h, range] : what) {
          if (!k.pending.contains(h)) failed.push_back(range);
        }
      }
    }
    for (auto [fb, fn] : failed) {
      for (uint32_t i = 0; i < fn; ++i) {
        FARMEM_RETURN_IF_ERROR(k.Send(kCmdRead, fb + i, 1));
        const uint64_t before = k.final_read_errors;
        FARMEM_RETURN_IF_ERROR(k.ReceiveOne(completed_));
        if (k.final_read_errors != before) {
          k.r.bytes_lost += k.unit;
          k.r.lost_blocks.push_back(k.first + fb + i);
        }
      }
    }
    k.final_pass = false;
    return Status::Ok();
  });
}

NbdWorkloadReport NbdVerifier::Report() const {
  NbdWorkloadReport out;
  out.unit = options_.unit;
  for (const auto& c : conns_) {
    const NbdWorkloadReport& r = c->r;
    out.bytes_written += r.bytes_written;
    out.bytes_verified += r.bytes_verified;
    out.bytes_lost += r.bytes_lost;
    out.bytes_corrupt += r.bytes_corrupt;
    out.failed_requests += r.failed_requests;
    out.requests += r.requests;
    out.longest_stall_ms = std::max(out.longest_stall_ms, r.longest_stall_ms);
    out.lost_blocks.insert(out.lost_blocks.end(), r.lost_blocks.begin(), r.lost_blocks.end());
    for (const std::string& p : r.problems) {
      if (out.problems.size() < kMaxProblems) out.problems.push_back(p);
    }
    out.transport_failed = out.transport_failed || r.transport_failed;
  }
  std::sort(out.lost_blocks.begin(), out.lost_blocks.end());
  return out;
}

}  // namespace farmem::chaos
