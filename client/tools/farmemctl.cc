// farmemctl: look at a farmem cluster and exercise it from the command line.
//
//   farmemctl stat --peers h:p,h:p [--secret-file F]     per-daemon capacity and usage
//   farmemctl demo --peers h:p,h:p [--secret-file F] [--size 384M]
//       borrows slabs by power-of-two-choices, writes patterned data across the daemons,
//       reads it all back verified, shows per-daemon usage, frees everything.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <map>

#include "farmem/client/cluster.h"
#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"

using namespace farmem;
using Sec = std::chrono::duration<double>;

namespace {

struct Common {
  std::string peers, peers_dns, secret_file, transport = "auto";
};

Result<std::unique_ptr<client::Cluster>> ConnectCluster(const Common& c, const char* name) {
  client::ClusterOptions o;
  FARMEM_ASSIGN_OR_RETURN(o.peers, ParseEndpointList(c.peers, kDefaultPort));
  o.peers_dns = c.peers_dns;
  o.transport = c.transport;
  o.client_name = name;
  if (!c.secret_file.empty()) {
    FARMEM_ASSIGN_OR_RETURN(o.secret, auth::LoadSecretFile(c.secret_file));
  }
  if (o.peers.empty() && o.peers_dns.empty()) {
    return Err(InvalidArgument("give the daemons with --peers host:port,... or --peers-dns"));
  }
  return client::Cluster::Connect(std::move(o));
}

void PrintNodes(client::Cluster& cluster, const std::map<client::NodeId, uint64_t>& written) {
  fmt::print("  {:<22} {:>6} {:>10} {:>10} {:>8} {:>12} {:>12}\n", "daemon", "state", "capacity",
             "lent", "slabs", "written", "this client");
  for (client::NodeId id = 0; id < cluster.node_count(); ++id) {
    client::NodeInfo info = cluster.node(id);
    auto st = info.alive ? cluster.Stat(id) : Result<wire::StatReply>(Err(info.last_error));
    if (!st) {
      fmt::print("  {:<22} {:>6}   {}\n", info.endpoint.ToString(), "DOWN", st.error().ToString());
      continue;
    }
    const uint64_t lent = uint64_t{st->total_slabs - st->free_slabs} * st->slab_size;
    auto it = written.find(id);
    fmt::print("  {:<22} {:>6} {:>10} {:>10} {:>8} {:>12} {:>12}\n", info.endpoint.ToString(), "up",
               FormatSize(st->capacity), FormatSize(lent),
               fmt::format("{}/{}", st->total_slabs - st->free_slabs, st->total_slabs),
               FormatSize(st->bytes_written), it == written.end() ? "-" : FormatSize(it->second));
  }
}

// The byte at `offset` of slab number `slab`: distinct per slab and position, cheap to check.
inline uint64_t Pattern(uint64_t slab, uint64_t offset) {
  uint64_t x = (slab << 40) ^ offset ^ 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

void Fill(std::span<uint8_t> buf, uint64_t slab, uint64_t offset) {
  for (size_t i = 0; i < buf.size(); i += 8) {
    const uint64_t v = Pattern(slab, offset + i);
    std::memcpy(buf.data() + i, &v, 8);
  }
}

int Demo(const Common& c, const std::string& size_text) {
  auto size = ParseSize(size_text);
  if (!size) {
    fmt::print(stderr, "--size: {}\n", size.error().ToString());
    return 2;
  }
  auto cluster = ConnectCluster(c, "farmemctl-demo");
  if (!cluster) {
    fmt::print(stderr, "farmemctl: {}\n", cluster.error().ToString());
    return 1;
  }
  client::Cluster& cl = **cluster;
  fmt::print("connected to {} of {} daemons\n", cl.alive_count(), cl.node_count());
  uint64_t slab_size = 0;
  for (client::NodeId id = 0; id < cl.node_count() && slab_size == 0; ++id) {
    if (auto st = cl.Stat(id)) slab_size = st->slab_size;
  }
  if (slab_size == 0) {
    fmt::print(stderr, "farmemctl: no daemon answered STAT\n");
    return 1;
  }
  const size_t nslabs = static_cast<size_t>((*size + slab_size - 1) / slab_size);
  fmt::print("borrowing {} as {} slabs of {} (power-of-two-choices placement)\n", FormatSize(*size),
             nslabs, FormatSize(slab_size));
  auto leases = cl.Allocate(nslabs);
  if (!leases) {
    fmt::print(stderr, "farmemctl: {}\n", leases.error().ToString());
    return 1;
  }
  std::map<client::NodeId, std::unique_ptr<transport::Channel>> channels;
  std::map<client::NodeId, uint64_t> per_node;
  for (const client::Lease& l : *leases) {
    per_node[l.node] += l.grant.length;
    if (!channels.count(l.node)) {
      auto ch = cl.OpenChannel(l.node);
      if (!ch) {
        fmt::print(stderr, "farmemctl: {}\n", ch.error().ToString());
        return 1;
      }
      channels[l.node] = std::move(*ch);
    }
  }
  // Move data in batches of 16 operations of 256 KiB per daemon round.
  constexpr uint32_t kOp = 256 << 10;
  constexpr size_t kDepth = 16;
  std::vector<uint8_t> buf(kOp * kDepth), check(kOp * kDepth);
  auto pass = [&](bool write, uint64_t* bad) -> Status {
    for (size_t li = 0; li < leases->size(); ++li) {
      const client::Lease& l = (*leases)[li];
      const uint64_t len = std::min<uint64_t>(l.grant.length, *size - li * slab_size);
      for (uint64_t off = 0; off < len; off += uint64_t{kOp} * kDepth) {
        std::vector<transport::Op> ops;
        for (size_t k = 0; k < kDepth && off + k * kOp < len; ++k) {
          const uint64_t o = off + k * kOp;
          const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(kOp, len - o));
          std::span<uint8_t> b(buf.data() + k * kOp, n);
          if (write) Fill(b, li, o);
          ops.push_back({write ? transport::OpType::kWrite : transport::OpType::kRead, l.slab(), o,
                         b.data(), n});
        }
        FARMEM_RETURN_IF_ERROR(channels[l.node]->Execute(ops));
        if (!write) {
          for (size_t k = 0; k < ops.size(); ++k) {
            std::span<uint8_t> want(check.data(), ops[k].length);
            Fill(want, li, ops[k].offset);
            if (std::memcmp(want.data(), ops[k].local, ops[k].length) != 0) ++*bad;
          }
        }
      }
    }
    return Status::Ok();
  };
  uint64_t bad = 0;
  auto t0 = Clock::now();
  if (Status s = pass(true, &bad); !s.ok()) {
    fmt::print(stderr, "farmemctl: write failed: {}\n", s.ToString());
    return 1;
  }
  const double wsec = Sec(Clock::now() - t0).count();
  t0 = Clock::now();
  if (Status s = pass(false, &bad); !s.ok()) {
    fmt::print(stderr, "farmemctl: read failed: {}\n", s.ToString());
    return 1;
  }
  const double rsec = Sec(Clock::now() - t0).count();
  const double mib = static_cast<double>(*size) / (1 << 20);
  fmt::print("wrote {} in {:.2f} s ({:.0f} MiB/s), read back in {:.2f} s ({:.0f} MiB/s) over {}\n",
             FormatSize(*size), wsec, mib / wsec, rsec, mib / rsec,
             channels.begin()->second->kind());
  if (bad != 0) {
    fmt::print("VERIFY FAILED: {} chunks differ\n", bad);
    return 1;
  }
  fmt::print("verified: every byte read back is the byte written\n");
  fmt::print("per-daemon usage while borrowed:\n");
  PrintNodes(cl, per_node);
  channels.clear();
  if (Status s = cl.Free(*leases); !s.ok()) {
    fmt::print(stderr, "farmemctl: free: {}\n", s.ToString());
    return 1;
  }
  fmt::print("freed {} slabs; per-daemon usage now:\n", leases->size());
  PrintNodes(cl, {});
  (void)cl.Close();
  return 0;
}

int StatCmd(const Common& c) {
  auto cluster = ConnectCluster(c, "farmemctl-stat");
  if (!cluster) {
    fmt::print(stderr, "farmemctl: {}\n", cluster.error().ToString());
    return 1;
  }
  PrintNodes(**cluster, {});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"farmemctl - inspect and exercise a farmem cluster"};
  app.require_subcommand(1);
  Common c;
  std::string size = "384M", log_level = "warn";
  auto add_common = [&](CLI::App* sub) {
    sub->add_option("--peers", c.peers, "Daemons: host:port,host:port (port defaults to 7411)");
    sub->add_option("--peers-dns", c.peers_dns, "A name:port whose every address is a daemon");
    sub->add_option("--secret-file", c.secret_file, "Shared secret the daemons require");
    sub->add_option("--transport", c.transport, "tcp, verbs or auto")
        ->capture_default_str()
        ->check(cli::OneOf(kTransports));
  };
  cli::AddLogLevelOption(app, log_level);
  cli::AddVersionOption(app, "farmemctl");
  CLI::App* stat = app.add_subcommand("stat", "Show every daemon's capacity and usage");
  add_common(stat);
  CLI::App* demo = app.add_subcommand(
      "demo", "Borrow slabs, write patterned data, read it back verified, free it");
  add_common(demo);
  demo->add_option("--size", size, "How much memory to borrow and fill")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  cli::SetUpLogging("farmemctl", log_level);
  if (*stat) return StatCmd(c);
  return Demo(c, size);
}
