// verbs_bench: farmem's one-sided reads and writes against a running farmemd, through the verbs
// transport (RDMA READ/WRITE on an RC queue pair) or the TCP transport, at queue depth 1
// (latency) and at queue depth N (throughput), from registered buffers.
//
// bench/verbs_bench.sh runs it inside the qemu guest next to perftest's ib_read_lat, ib_write_lat
// and ib_read_bw on the same soft-RoCE device, which are the baseline (docs/benchmarks-rdma.md).
//
//   verbs_bench --daemon HOST:PORT [--secret-file F] [--transport verbs|tcp] [--size 4096]
//               [--iters 2000] [--depth 16] [--seconds 3] [--ops read,write] [--modes lat,bw]
//
// Prints a human line and a `RESULT key=value ...` line per measurement.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>
#include <vector>

#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/transport/tcp_connection.h"
#include "farmem/transport/transport.h"
#include "farmem/transport/verbs.h"

using namespace farmem;
using namespace farmem::transport;
using Clock = std::chrono::steady_clock;

namespace {

[[noreturn]] void Die(const std::string& what) {
  fmt::print(stderr, "verbs_bench: {}\n", what);
  std::exit(1);
}

template <typename T>
T Check(Result<T> r, const char* what) {
  if (!r.has_value()) Die(fmt::format("{}: {}", what, r.error().ToString()));
  return std::move(*r);
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) Die(fmt::format("{}: {}", what, s.ToString()));
}

struct Bench {
  Channel* ch;
  std::function<void()> keep_alive;  // heartbeats the lease now and then
  RemoteSlab slab;
  uint8_t* buf;
  const LocalRegion* region;
  uint32_t size;
  uint64_t span;  // bytes of the lease the ops range over
};

Op MakeOp(const Bench& b, OpType type, uint64_t i, size_t slot) {
  Op op;
  op.type = type;
  op.slab = b.slab;
  op.offset = (i * b.size) % b.span;
  op.local = b.buf + slot * b.size;
  op.length = b.size;
  op.region = b.region;
  op.user_data = slot;
  return op;
}

// Queue depth 1: post one, wait for it, repeat. Per-op times in microseconds.
std::vector<double> Latency(const Bench& b, OpType type, int iters) {
  std::vector<double> us;
  us.reserve(iters);
  Completion c[1];
  for (int i = -iters / 10; i < iters; ++i) {  // the first 10% warm up
    if (i % 256 == 0) b.keep_alive();
    const auto t0 = Clock::now();
    Check(b.ch->Post(MakeOp(b, type, static_cast<uint64_t>(i + iters), 0)), "post");
    Check(b.ch->Flush(), "flush");
    size_t got = 0;
    while (got == 0) got = Check(b.ch->Poll(c, std::chrono::milliseconds(5000)), "poll");
    Check(c[0].status, "operation");
    if (i >= 0) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// Queue depth `depth`: keep that many in flight for `seconds`. Returns ops per second.
double Throughput(const Bench& b, OpType type, uint32_t depth, double seconds) {
  std::vector<Completion> c(depth);
  uint64_t issued = 0, done = 0;
  std::vector<size_t> free_slots(depth);
  std::iota(free_slots.begin(), free_slots.end(), 0);
  const auto t0 = Clock::now();
  const auto end =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  for (;;) {
    if (issued % 256 < depth) b.keep_alive();
    const bool running = Clock::now() < end;
    if (running) {
      while (!free_slots.empty()) {
        Check(b.ch->Post(MakeOp(b, type, issued++, free_slots.back())), "post");
        free_slots.pop_back();
      }
      Check(b.ch->Flush(), "flush");
    }
    if (b.ch->outstanding() == 0) break;
    const size_t n = Check(b.ch->Poll(c, std::chrono::milliseconds(5000)), "poll");
    for (size_t i = 0; i < n; ++i) {
      Check(c[i].status, "operation");
      free_slots.push_back(c[i].user_data);
      ++done;
    }
  }
  return done / std::chrono::duration<double>(Clock::now() - t0).count();
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"farmem one-sided read/write latency and throughput against a farmemd"};
  std::string daemon, secret_file, kind = "verbs";
  uint32_t size = 4096, depth = 16;
  int iters = 2000;
  double seconds = 3;
  VerbsOptions vo;
  uint32_t spin_max_us = static_cast<uint32_t>(vo.spin_max.count());
  app.add_option("--daemon", daemon, "farmemd TCP address host:port")->required();
  app.add_option("--secret-file", secret_file, "Shared secret of the daemon");
  app.add_option("--transport", kind, "verbs or tcp")
      ->capture_default_str()
      ->check(CLI::IsMember({"verbs", "tcp"}));
  app.add_option("--size", size, "Bytes per operation")->capture_default_str();
  app.add_option("--iters", iters, "Operations per latency measurement")->capture_default_str();
  app.add_option("--depth", depth, "Operations in flight for throughput")->capture_default_str();
  app.add_option("--seconds", seconds, "Duration of each throughput measurement")
      ->capture_default_str();
  std::string ops = "read,write", modes = "lat,bw";
  app.add_option("--ops", ops, "Which operations: read, write or read,write")
      ->capture_default_str();
  app.add_option("--modes", modes, "lat (depth 1), bw (depth --depth) or lat,bw")
      ->capture_default_str();
  app.add_option("--spin-max-us", spin_max_us, "verbs: longest busy-poll before sleeping")
      ->capture_default_str();
  app.add_option("--signal-every", vo.signal_every, "verbs: signal every Nth request (0: last)")
      ->capture_default_str();
  farmem::cli::AddVersionOption(app, "verbs_bench");
  CLI11_PARSE(app, argc, argv);
  vo.spin_max = std::chrono::microseconds(spin_max_us);

  ChannelOptions o;
  o.endpoint = Check(ParseEndpoint(daemon), "--daemon");
  if (!secret_file.empty())
    o.credentials.secret = Check(auth::LoadSecretFile(secret_file), "secret");
  Check(auth::RandomBytes(o.credentials.client_id), "client id");
  o.credentials.client_name = "verbs_bench";
  o.max_outstanding = std::max<uint32_t>(depth, 1);
  o.connect_timeout = std::chrono::milliseconds(10000);

  std::unique_ptr<Transport> transport =
      kind == "verbs" ? Check(MakeVerbsTransport(vo), "verbs transport") : MakeTcpTransport();
  TcpConnection control = Check(TcpConnection::Connect(o), "control connection");
  std::vector<uint8_t> body;
  wire::EncodeAlloc({1}, &body);
  auto reply =
      Check(control.Call(wire::Opcode::kAlloc, body, std::chrono::milliseconds(5000)), "ALLOC");
  const wire::AllocReply grant = Check(wire::DecodeAllocReply(reply), "ALLOC reply");
  std::unique_ptr<Channel> ch = Check(transport->OpenChannel(o), "open channel");
  auto last_heartbeat = Clock::now();
  auto heartbeat = [&] {
    Check(control.Call(wire::Opcode::kHeartbeat, {}, std::chrono::milliseconds(5000)), "HEARTBEAT");
    last_heartbeat = Clock::now();
  };
  auto keep_alive = [&] {
    if (Clock::now() - last_heartbeat > std::chrono::seconds(1)) heartbeat();
  };

  std::vector<uint8_t> buf(size_t{size} * depth, 0x5a);
  std::unique_ptr<LocalRegion> region =
      Check(transport->RegisterMemory(buf.data(), buf.size()), "register");
  const RemoteSlab slab = RemoteSlab::From(grant.leases.at(0));
  Bench b{ch.get(),
          keep_alive,
          slab,
          buf.data(),
          region.get(),
          size,
          std::min<uint64_t>(slab.length, 64ull << 20) / size * size};
  fmt::print("verbs_bench: {} transport, channel kind {}, {} B ops on a {} MiB lease of {}\n", kind,
             ch->kind(), size, slab.length >> 20, daemon);

  auto wanted = [](const std::string& list, const char* what) {
    return ("," + list + ",").find(std::string(",") + what + ",") != std::string::npos;
  };
  for (OpType type : {OpType::kRead, OpType::kWrite}) {
    const char* name = type == OpType::kRead ? "read" : "write";
    if (!wanted(ops, name) || !wanted(modes, "lat")) continue;
    heartbeat();
    const std::vector<double> us = Latency(b, type, iters);
    const double avg = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
    fmt::print(
        "  {:5} depth 1:  typical {:8.1f} us  avg {:8.1f} us  p99 {:8.1f} us  min {:8.1f} us\n",
        name, Percentile(us, 0.5), avg, Percentile(us, 0.99), Percentile(us, 0));
    fmt::print(
        "RESULT transport={} op={} depth=1 size={} typical_us={:.2f} avg_us={:.2f} "
        "p99_us={:.2f}\n",
        kind, name, size, Percentile(us, 0.5), avg, Percentile(us, 0.99));
  }
  for (OpType type : {OpType::kRead, OpType::kWrite}) {
    const char* name = type == OpType::kRead ? "read" : "write";
    if (!wanted(ops, name) || !wanted(modes, "bw")) continue;
    heartbeat();
    const double rate = Throughput(b, type, depth, seconds);
    fmt::print("  {:5} depth {}: {:9.0f} ops/s  {:8.1f} MiB/s\n", name, depth, rate,
               rate * size / (1 << 20));
    fmt::print("RESULT transport={} op={} depth={} size={} ops_per_s={:.0f} mib_per_s={:.2f}\n",
               kind, name, depth, size, rate, rate * size / (1 << 20));
  }
  const ChannelStats st = ch->stats();
  fmt::print("  channel: {} ops, {} doorbells ({:.1f} ops per doorbell)\n", st.ops, st.doorbells,
             st.doorbells ? double(st.ops) / st.doorbells : 0.0);
  ch.reset();
  body.clear();
  wire::EncodeFree({{slab.lease_id}}, &body);
  Check(control.Call(wire::Opcode::kFree, body, std::chrono::milliseconds(5000)), "FREE");
  return 0;
}
