#include "faults.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include "farmem/client/cluster.h"
#include "farmem/common/wire.h"
#include "nbd_test_client.h"
#include "test_process.h"

namespace farmem::chaos {

SlabFiller::SlabFiller() = default;
SlabFiller::~SlabFiller() { Release(); }

Status SlabFiller::Fill(const Endpoint& daemon, const std::string& secret) {
  // A fresh identity as long as the last one still got slabs: with a per-client share, each
  // client stops at its limit; without one, the first takes everything.
  for (int identity = 0; identity < 64; ++identity) {
    client::ClusterOptions o;
    o.peers = {daemon};
    o.secret = secret;
    o.client_name = "chaos-filler-" + std::to_string(identity);
    o.heartbeat_interval = std::chrono::milliseconds(200);
    o.failure_timeout = std::chrono::milliseconds(5000);
    auto c = client::Cluster::Connect(o);
    if (!c) return c.error();
    size_t got = 0;
    for (;;) {
      auto leases = (*c)->Allocate(1);
      if (!leases) break;
      ++got;
    }
    slabs_ += got;
    clients_.push_back(std::move(*c));
    if (got == 0) return Status::Ok();
  }
  return Status::Ok();
}

void SlabFiller::Release() {
  for (auto& c : clients_) (void)c->Close();
  clients_.clear();
}

namespace {

Result<Socket> ConnectNonBlocking(const Endpoint& ep) {
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s.valid()) return Err(ErrnoStatus(StatusCode::kIoError, "socket", errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(ep.port);
  if (::inet_pton(AF_INET, ep.host.c_str(), &a.sin_addr) != 1) {
    return Err(InvalidArgument("the flood needs an IPv4 address, not " + ep.host));
  }
  if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    return Err(ErrnoStatus(StatusCode::kUnavailable, "connect " + ep.ToString(), errno));
  }
  return s;
}

}  // namespace

SocketFlood::~SocketFlood() { Release(); }

Status SocketFlood::Start(const Endpoint& daemon, size_t idle, size_t slow) {
  for (size_t i = 0; i < idle; ++i) {
    auto s = ConnectNonBlocking(daemon);
    if (!s) return s.error();
    sockets_.push_back(std::move(*s));
  }
  for (size_t i = 0; i < slow; ++i) {
    auto s = ConnectNonBlocking(daemon);
    if (!s) return s.error();
    slow_.push_back(std::move(*s));
  }
  stop_ = false;
  slow_thread_ = std::thread([this] {
    wire::FrameHeader h;
    h.opcode = static_cast<uint8_t>(wire::Opcode::kHello);
    h.request_id = 1;
    h.body_len = 64;
    uint8_t frame[wire::kHeaderSize];
    wire::EncodeHeader(h, frame);
    // Slowloris is about time itself: one byte of a frame per connection per second.
    for (size_t i = 0; !stop_; i = (i + 1) % sizeof(frame)) {
      for (Socket& s : slow_) (void)::send(s.fd(), &frame[i], 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      for (int t = 0; t < 10 && !stop_; ++t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  });
  return Status::Ok();
}

void SocketFlood::Release() {
  stop_ = true;
  if (slow_thread_.joinable()) slow_thread_.join();
  sockets_.clear();
  slow_.clear();
}

Status StalledNbdClients::Start(const std::string& socket_path, size_t clients) {
  using blockdev::testing::NbdTestClient;
  for (size_t c = 0; c < clients; ++c) {
    auto client = NbdTestClient::Connect(socket_path);
    if (!client) return client.error();
    // 256 READs of 256 KiB: far more reply bytes than socket buffers hold.
    std::vector<uint8_t> bytes;
    const uint64_t span = std::max<uint64_t>(client->size() / (256u << 10), 1);
    for (uint64_t i = 0; i < 256; ++i) {
      const auto req = blockdev::testing::RequestBytes(0 /* READ */, 0, i + 1,
                                                       (i % span) * (256u << 10), 256u << 10);
      bytes.insert(bytes.end(), req.begin(), req.end());
    }
    FARMEM_RETURN_IF_ERROR(client->SendRaw(bytes));
    // Keep the socket, forget the client: nobody reads it until Release() closes it.
    Socket s(::dup(client->fd()));
    sockets_.push_back(std::move(s));
  }
  return Status::Ok();
}

void StalledNbdClients::Release() { sockets_.clear(); }

ProbeResult ProbeDaemon(const std::string& farmemctl, const Endpoint& daemon,
                        const std::string& secret_file, std::chrono::milliseconds timeout) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = blockdev::testing::RunCommand(
      {farmemctl, "stat", "--peers", daemon.ToString(), "--secret-file", secret_file}, timeout);
  ProbeResult out;
  out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  out.ok = r.exit_code == 0;
  if (!out.ok) {
    out.error = r.err.empty() ? r.out : r.err;
    if (out.error.size() > 300) out.error.resize(300);
  }
  return out;
}

}  // namespace farmem::chaos
