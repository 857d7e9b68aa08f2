// tcp_bench: farmem's TCP transport against a raw loopback TCP baseline, in one run.
//
// Starts a real farmemd (child process) and, for the baseline, a plain blocking request/response
// server (another child) that answers exactly the bytes farmem's frames carry: a 48-byte request
// and a 24+4096-byte reply for a read; a 48+4096-byte request and a 24-byte reply for a write.
// Both servers and the client are placed on the same CPUs (--placement same|spread), so the
// comparison isolates what farmem adds: framing, validation, lease lookup, the slab copy.
//
//   tcp_bench [--seconds 1] [--rounds 3] [--size 4096] [--placement same|spread] [--farmemd PATH]
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/command_line.h"
#include "farmem/common/socket.h"
#include "farmem/transport/tcp_connection.h"
#include "farmem/transport/transport.h"

using namespace farmem;
using Sec = std::chrono::duration<double>;

namespace {

struct Args {
  double seconds = 1;
  int rounds = 3;
  uint32_t size = 4096;
  std::string placement = "same";
  std::string farmemd;
};

void Pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

void Die(const std::string& what) {
  fmt::print(stderr, "tcp_bench: {}\n", what);
  std::exit(1);
}

// The baseline server: blocking, one connection, run to completion, and as batched as farmemd:
// it answers every complete request one receive brought in with one sendmsg. Request: 48 bytes
// whose byte 5 says read (7) or write (8); a write carries `size` more bytes. Reply: 24 bytes,
// plus `size` bytes for a read. It copies to/from a buffer like farmemd copies to/from a slab.
[[noreturn]] void RawServer(int listen_fd, uint32_t size) {
  const int fd = ::accept(listen_fd, nullptr, nullptr);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<uint8_t> mem(size), rep(24, 0), buf(1 << 20);
  std::vector<iovec> iov;
  size_t have = 0;
  for (;;) {
    const ssize_t n = ::recv(fd, buf.data() + have, buf.size() - have, 0);
    if (n <= 0) _exit(0);
    have += static_cast<size_t>(n);
    size_t pos = 0;
    iov.clear();
    for (;;) {
      if (have - pos < 48) break;
      const bool write = buf[pos + 5] == 8;
      const size_t need = write ? 48 + size : 48;
      if (have - pos < need) break;
      if (write) std::memcpy(mem.data(), buf.data() + pos + 48, size);
      iov.push_back({rep.data(), 24});
      if (!write) iov.push_back({mem.data(), size});
      pos += need;
    }
    if (!iov.empty() && !SendAll(fd, iov.data(), static_cast<int>(iov.size()), kNoDeadline).ok()) {
      _exit(0);
    }
    std::memmove(buf.data(), buf.data() + pos, have - pos);
    have -= pos;
  }
}

struct Figures {
  double read_us = 0, write_us = 0;
  double read_ops_d16 = 0, write_ops_d16 = 0, read_ops_d64 = 0;
};

Figures Median(std::vector<Figures> v) {
  auto med = [&](double Figures::*f) {
    std::vector<double> x;
    for (const Figures& g : v) x.push_back(g.*f);
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  Figures m;
  m.read_us = med(&Figures::read_us);
  m.write_us = med(&Figures::write_us);
  m.read_ops_d16 = med(&Figures::read_ops_d16);
  m.write_ops_d16 = med(&Figures::write_ops_d16);
  m.read_ops_d64 = med(&Figures::read_ops_d64);
  return m;
}

// One side's figures, measured the same way for both sides: `one(write)` runs a single operation
// (latency: 1000 warm-up operations, then hundreds for a.seconds); `batch(write, depth)` returns a
// callable that runs `depth` operations at once (throughput: whole batches for a.seconds).
template <typename One, typename Batch>
Figures Measure(const Args& a, One one, Batch batch) {
  auto lat = [&](bool write) {
    for (int i = 0; i < 1000; ++i) one(write);
    uint64_t n = 0;
    const auto t0 = Clock::now();
    while (Sec(Clock::now() - t0).count() < a.seconds) {
      for (int i = 0; i < 100; ++i) one(write);
      n += 100;
    }
    return Sec(Clock::now() - t0).count() * 1e6 / static_cast<double>(n);
  };
  auto tput = [&](bool write, int depth) {
    auto run = batch(write, depth);
    uint64_t n = 0;
    const auto t0 = Clock::now();
    while (Sec(Clock::now() - t0).count() < a.seconds) {
      run();
      n += static_cast<uint64_t>(depth);
    }
    return static_cast<double>(n) / Sec(Clock::now() - t0).count();
  };
  Figures f;
  f.read_us = lat(false);
  f.write_us = lat(true);
  f.read_ops_d16 = tput(false, 16);
  f.write_ops_d16 = tput(true, 16);
  f.read_ops_d64 = tput(false, 64);
  return f;
}

// Baseline client: the same request/reply byte counts over a plain socket.
Figures RunRaw(uint16_t port, const Args& a) {
  auto sock = ConnectTcp({"127.0.0.1", port}, DeadlineIn(std::chrono::seconds(3)));
  if (!sock) Die(sock.error().ToString());
  const int fd = sock->fd();
  std::vector<uint8_t> req(48 + a.size, 0), rep(24 + a.size);
  auto one = [&](bool write) {
    req[5] = write ? 8 : 7;
    (void)SendAll(fd, {req.data(), write ? 48 + a.size : 48}, kNoDeadline);
    (void)RecvExact(fd, {rep.data(), write ? 24 : 24 + a.size}, kNoDeadline);
  };
  auto batch = [&](bool write, int depth) {
    std::vector<uint8_t> burst;
    for (int i = 0; i < depth; ++i) {
      req[5] = write ? 8 : 7;
      burst.insert(burst.end(), req.begin(), req.begin() + (write ? 48 + a.size : 48));
    }
    std::vector<uint8_t> replies(static_cast<size_t>(depth) * (write ? 24 : 24 + a.size));
    return [fd, burst = std::move(burst), replies = std::move(replies)]() mutable {
      (void)SendAll(fd, burst, kNoDeadline);
      (void)RecvExact(fd, replies, kNoDeadline);
    };
  };
  return Measure(a, one, batch);
}

Figures RunFarmem(uint16_t port, const Args& a) {
  transport::ChannelOptions o;
  o.endpoint = {"127.0.0.1", port};
  o.credentials.client_name = "tcp_bench";
  o.max_outstanding = 64;
  auto ctl = transport::TcpConnection::Connect(o);
  if (!ctl) Die(ctl.error().ToString());
  std::vector<uint8_t> body;
  wire::EncodeAlloc({1}, &body);
  auto r = ctl->Call(wire::Opcode::kAlloc, body, std::chrono::seconds(3));
  if (!r) Die(r.error().ToString());
  auto grant = wire::DecodeAllocReply(*r);
  if (!grant) Die(grant.error().ToString());
  const transport::RemoteSlab slab = transport::RemoteSlab::From(grant->leases[0]);
  auto tr = transport::MakeTcpTransport();
  auto ch = tr->OpenChannel(o);
  if (!ch) Die(ch.error().ToString());
  transport::Channel& c = **ch;
  std::vector<uint8_t> buf(static_cast<size_t>(a.size) * 64, 0x5a);
  auto one = [&](bool write) {
    Status s =
        write ? c.Write(slab, 0, {buf.data(), a.size}) : c.Read(slab, 0, {buf.data(), a.size});
    if (!s.ok()) Die(s.ToString());
  };
  auto batch = [&](bool write, int depth) {
    std::vector<transport::Op> ops;
    for (int i = 0; i < depth; ++i) {
      ops.push_back({write ? transport::OpType::kWrite : transport::OpType::kRead, slab,
                     static_cast<uint64_t>(i) * a.size,
                     buf.data() + static_cast<size_t>(i) * a.size, a.size});
    }
    return [&c, ops = std::move(ops)]() mutable {
      Status s = c.Execute(ops);
      if (!s.ok()) Die(s.ToString());
    };
  };
  const Figures f = Measure(a, one, batch);
  body.clear();
  wire::EncodeFree({{slab.lease_id}}, &body);
  if (auto fr = ctl->Call(wire::Opcode::kFree, body, std::chrono::seconds(3)); !fr) {
    Die(fr.error().ToString());
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"farmem's TCP transport vs a raw batched request/response server"};
  farmem::cli::AddVersionOption(app, "tcp_bench");
  app.add_option("--seconds", a.seconds, "timed seconds per round and side")->capture_default_str();
  app.add_option("--rounds", a.rounds, "alternating rounds")->capture_default_str();
  app.add_option("--size", a.size, "request size in bytes")->capture_default_str();
  app.add_option("--placement", a.placement, "same: both ends on CPU 0; spread: CPUs 0 and 1")
      ->capture_default_str()
      ->check(farmem::cli::OneOf({"same", "spread"}));
  app.add_option("--farmemd", a.farmemd, "farmemd binary (default: the one beside this program)");
  CLI11_PARSE(app, argc, argv);
  if (a.farmemd.empty()) {
    a.farmemd = (std::filesystem::path(argv[0]).parent_path() / "farmemd").string();
  }
  const bool same = a.placement == "same";
  const int server_cpu = 0, client_cpu = same ? 0 : 1;
  signal(SIGPIPE, SIG_IGN);

  // Baseline server (it serves one connection per round).
  auto listener = ListenTcp({"127.0.0.1", 0});
  if (!listener) Die(listener.error().ToString());
  const uint16_t raw_port = *LocalPort(*listener);
  const pid_t raw_pid = fork();
  if (raw_pid == 0) {
    Pin(server_cpu);
    for (int round = 0; round < a.rounds; ++round) {
      if (fork() == 0) RawServer(listener->fd(), a.size);
      wait(nullptr);
    }
    _exit(0);
  }
  listener->Close();

  // farmemd.
  const std::string port_file = fmt::format("/tmp/tcp_bench.{}.port", getpid());
  std::filesystem::remove(port_file);
  const pid_t d_pid = fork();
  if (d_pid == 0) {
    Pin(server_cpu);
    execl(a.farmemd.c_str(), "farmemd", "--listen", "127.0.0.1:0", "--port-file", port_file.c_str(),
          "--capacity", "64M", "--slab-size", "64M", "--log-level", "warn",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  for (int i = 0; i < 200 && !std::filesystem::exists(port_file); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  uint16_t d_port = 0;
  std::ifstream(port_file) >> d_port;
  if (d_port == 0) Die("farmemd did not start (" + a.farmemd + ")");

  Pin(client_cpu);
  fmt::print(
      "tcp_bench: {} B operations, {} s per figure, median of {} alternating rounds, placement "
      "'{}' (server cpu {}, client "
      "cpu {})\n",
      a.size, a.seconds, a.rounds, a.placement, server_cpu, client_cpu);
  // Alternate the two a few times and keep the median of each figure, so that a burst of noise
  // from elsewhere on the machine does not land on one side only.
  std::vector<Figures> raws, fms;
  for (int round = 0; round < a.rounds; ++round) {
    raws.push_back(RunRaw(raw_port, a));
    fms.push_back(RunFarmem(d_port, a));
  }
  const Figures raw = Median(raws);
  const Figures fm = Median(fms);
  kill(d_pid, SIGTERM);
  waitpid(raw_pid, nullptr, 0);
  waitpid(d_pid, nullptr, 0);
  std::filesystem::remove(port_file);

  fmt::print("{:<28} {:>14} {:>14} {:>8}\n", "", "raw baseline", "farmem tcp", "ratio");
  auto row_lat = [](const char* name, double base, double ours) {
    fmt::print("{:<28} {:>11.2f} us {:>11.2f} us {:>7.2f}x\n", name, base, ours, ours / base);
  };
  auto row_ops = [](const char* name, double base, double ours) {
    fmt::print("{:<28} {:>10.0f}/s {:>10.0f}/s {:>7.2f}x\n", name, base, ours, ours / base);
  };
  row_lat("read latency, depth 1", raw.read_us, fm.read_us);
  row_lat("write latency, depth 1", raw.write_us, fm.write_us);
  row_ops("read ops, depth 16", raw.read_ops_d16, fm.read_ops_d16);
  row_ops("write ops, depth 16", raw.write_ops_d16, fm.write_ops_d16);
  row_ops("read ops, depth 64", raw.read_ops_d64, fm.read_ops_d64);
  fmt::print(
      "(latency ratio: lower is better, target <= 1.3x; throughput ratio: higher is better, "
      "target >= 0.8x)\n");
  return 0;
}
