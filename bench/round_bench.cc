// round_bench: what one round to several daemons costs the client in system calls, as the TCP
// data path makes it today (one sendmsg per daemon, poll, one recv per reply: the pattern of
// client::ChannelSet over transport/tcp) against the same round posted through io_uring (every
// send and receive in one io_uring_enter, then the completions). The servers are threads of this
// process on loopback TCP that read a request of --bytes and answer --reply bytes, so the figure
// is the round's cost on this machine, not farmemd's; the baseline is the first pattern, from the
// same run, alternated with the second --alternations times (docs/benchmarks-nbd.md, "the `ec:4+2`
// mixed job, by CPU and system calls").
//
//   build/bin/round_bench [--servers 6] [--bytes 28672] [--reply 16] [--rounds 5000]
//                         [--alternations 3]
//
// Prints per round: wall time, the client thread's CPU, and the whole process's CPU (servers
// included, and io_uring's kernel workers if it used any).
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "bench_main.h"
#include "farmem/common/command_line.h"
#include "farmem/common/socket.h"

namespace {

double Now(clockid_t c) {
  timespec t{};
  clock_gettime(c, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

[[noreturn]] void Die(const char* what) {
  std::perror(what);
  std::exit(1);
}

struct Args {
  int servers = 6;
  int bytes = 28 * 1024;  // ~7 cells of 4 KiB: what an ec:4+2 write-back round sends a daemon
  int reply = 16;
  int rounds = 5000;
  int alternations = 3;
};

// A server: reads requests of `bytes`, answers each with `reply` bytes, until the peer closes.
void Serve(int fd, int bytes, int reply) {
  std::vector<uint8_t> in(static_cast<size_t>(bytes)), out(static_cast<size_t>(reply));
  for (;;) {
    if (!farmem::RecvExact(fd, in, farmem::kNoDeadline).ok()) break;
    if (!farmem::SendAll(fd, out, farmem::kNoDeadline).ok()) break;
  }
  ::close(fd);
}

// Today's pattern: a sendmsg per server, then poll and recv until every reply is in.
void RoundSyscalls(const std::vector<int>& fds, const std::vector<uint8_t>& req,
                   std::vector<std::vector<uint8_t>>& rep) {
  for (int fd : fds) {
    if (!farmem::SendAll(fd, req, farmem::kNoDeadline).ok()) Die("send");
  }
  std::vector<size_t> got(fds.size(), 0);
  size_t left = fds.size();
  std::vector<pollfd> p;
  std::vector<size_t> idx;
  while (left > 0) {
    p.clear();
    idx.clear();
    for (size_t i = 0; i < fds.size(); ++i) {
      if (got[i] < rep[i].size()) {
        p.push_back({fds[i], POLLIN, 0});
        idx.push_back(i);
      }
    }
    if (::poll(p.data(), p.size(), -1) < 0) Die("poll");
    for (size_t j = 0; j < p.size(); ++j) {
      if (p[j].revents == 0) continue;
      const size_t i = idx[j];
      const ssize_t n = ::recv(fds[i], rep[i].data() + got[i], rep[i].size() - got[i], 0);
      if (n <= 0) Die("recv");
      got[i] += static_cast<size_t>(n);
      if (got[i] == rep[i].size()) --left;
    }
  }
}

// The same round through io_uring: all sends and receives in one submission, then completions.
void RoundUring(io_uring& ring, const std::vector<int>& fds, const std::vector<uint8_t>& req,
                std::vector<std::vector<uint8_t>>& rep) {
  const size_t n = fds.size();
  for (size_t i = 0; i < n; ++i) {
    io_uring_sqe* e = io_uring_get_sqe(&ring);
    io_uring_prep_send(e, fds[i], req.data(), req.size(), MSG_WAITALL);
    e->user_data = i;
  }
  for (size_t i = 0; i < n; ++i) {
    io_uring_sqe* e = io_uring_get_sqe(&ring);
    io_uring_prep_recv(e, fds[i], rep[i].data(), rep[i].size(), MSG_WAITALL);
    e->user_data = n + i;
  }
  if (io_uring_submit_and_wait(&ring, static_cast<unsigned>(2 * n)) < 0) Die("io_uring_submit");
  for (size_t done = 0; done < 2 * n; ++done) {
    io_uring_cqe* q = nullptr;
    if (io_uring_wait_cqe(&ring, &q) != 0) Die("io_uring_wait_cqe");
    const size_t want = q->user_data < n ? req.size() : rep[q->user_data - n].size();
    if (q->res < 0 || static_cast<size_t>(q->res) != want) {
      std::fprintf(stderr, "io_uring op %llu: %d of %zu bytes\n",
                   static_cast<unsigned long long>(q->user_data), q->res, want);
      std::exit(1);
    }
    io_uring_cqe_seen(&ring, q);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"One round to several loopback TCP servers: sendmsg + poll + recv vs io_uring"};
  farmem::cli::AddVersionOption(app, "round_bench");
  app.add_option("--servers", a.servers, "servers (daemons) a round reaches")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--bytes", a.bytes, "request bytes per server per round")
      ->capture_default_str()
      ->check(CLI::Range(1, 16 << 20));
  app.add_option("--reply", a.reply, "reply bytes per server")
      ->capture_default_str()
      ->check(CLI::Range(1, 16 << 20));
  app.add_option("--rounds", a.rounds, "rounds per measurement")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000000));
  app.add_option("--alternations", a.alternations, "syscalls / io_uring measurements, alternated")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  auto listener = farmem::ListenTcp(farmem::Endpoint{"127.0.0.1", 0});
  if (!listener) {
    std::fprintf(stderr, "%s\n", listener.error().ToString().c_str());
    return 1;
  }
  auto port = farmem::LocalPort(*listener);
  std::vector<farmem::Socket> clients;
  std::vector<int> fds;
  std::vector<std::thread> servers;
  for (int i = 0; i < a.servers; ++i) {
    auto c = farmem::ConnectTcp(farmem::Endpoint{"127.0.0.1", *port}, farmem::kNoDeadline);
    if (!c) {
      std::fprintf(stderr, "%s\n", c.error().ToString().c_str());
      return 1;
    }
    const int s = ::accept(listener->fd(), nullptr, nullptr);
    if (s < 0) Die("accept");
    const int one = 1;
    ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(c->fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fds.push_back(c->fd());
    clients.push_back(std::move(*c));
    servers.emplace_back(Serve, s, a.bytes, a.reply);
  }
  const std::vector<uint8_t> req(static_cast<size_t>(a.bytes), 0x5a);
  std::vector<std::vector<uint8_t>> rep(fds.size(), std::vector<uint8_t>(a.reply));
  io_uring ring{};
  if (const int rc = io_uring_queue_init(static_cast<unsigned>(4 * a.servers), &ring, 0); rc < 0) {
    std::fprintf(stderr, "io_uring_queue_init: %s\n", std::strerror(-rc));
    return 1;
  }
  std::printf(
      "%d servers on loopback TCP, %d-byte requests, %d-byte replies, %d rounds a "
      "measurement, %u CPUs\n",
      a.servers, a.bytes, a.reply, a.rounds, std::thread::hardware_concurrency());
  std::printf("%-34s %14s %16s %16s\n", "per round", "wall us", "client CPU us", "all CPU us");
  std::vector<double> ratio_client, ratio_all;
  for (int alt = 0; alt < a.alternations; ++alt) {
    double client[2] = {}, all[2] = {};
    for (int mode = 0; mode < 2; ++mode) {
      const double w0 = Now(CLOCK_MONOTONIC), c0 = Now(CLOCK_THREAD_CPUTIME_ID),
                   p0 = Now(CLOCK_PROCESS_CPUTIME_ID);
      for (int r = 0; r < a.rounds; ++r) {
        if (mode == 0) {
          RoundSyscalls(fds, req, rep);
        } else {
          RoundUring(ring, fds, req, rep);
        }
      }
      const double w1 = Now(CLOCK_MONOTONIC), c1 = Now(CLOCK_THREAD_CPUTIME_ID),
                   p1 = Now(CLOCK_PROCESS_CPUTIME_ID);
      client[mode] = (c1 - c0) / a.rounds * 1e6;
      all[mode] = (p1 - p0) / a.rounds * 1e6;
      std::printf("%-34s %14.1f %16.1f %16.1f\n",
                  mode == 0 ? "sendmsg + poll + recv (baseline)" : "io_uring, one submission",
                  (w1 - w0) / a.rounds * 1e6, client[mode], all[mode]);
    }
    ratio_client.push_back(client[1] / client[0]);
    ratio_all.push_back(all[1] / all[0]);
  }
  std::sort(ratio_client.begin(), ratio_client.end());
  std::sort(ratio_all.begin(), ratio_all.end());
  std::printf("io_uring / baseline, median of %d alternations: client CPU %.2f, all CPU %.2f\n",
              a.alternations, ratio_client[ratio_client.size() / 2],
              ratio_all[ratio_all.size() / 2]);
  io_uring_queue_exit(&ring);
  for (farmem::Socket& c : clients) c.Close();
  for (std::thread& t : servers) t.join();
  return 0;
}
