// farmemctl: look at a farmem cluster and exercise it from the command line.
//
//   farmemctl stat --peers h:p,h:p [--secret-file F] [--json]
//       per-daemon state, version, capacity and usage; exit 3 when a daemon is down
//   farmemctl export stat HOST:PORT [--json]
//       an export's health from farmem-nbd --metrics-listen HOST:PORT
//   farmemctl drain HOST:PORT [--secret-file F] [--grace-ms 30000] [--wait]
//       the daemon grants nothing more and gives every client notice to move its data
//       (docs/operations.md "Drain"); --wait returns once it holds no lease
//   farmemctl undrain HOST:PORT [--secret-file F]     grant again, lift pending notices
//   farmemctl demo --peers h:p,h:p [--secret-file F | --key-file K] [--size 384M]
//       borrows slabs by power-of-two-choices, writes patterned data across the daemons,
//       reads it all back verified, shows per-daemon usage, frees everything.
//   farmemctl key issue NAME --secret-file F --out K
//       writes the key of identity NAME (derived from the cluster secret, docs/operations.md
//       "Security") to K, mode 0600; a client given --key-file K authenticates as NAME.
//   farmemctl kmod attach --peers h:p,h:p [--secret-file F | --key-file K] --size 1G
//       [--resilience none|replicate:N]
//       leases slabs for farmem.ko and hands them over as /dev/farmem0; stays running as the lease
//       keeper until `farmemctl kmod detach` (or SIGTERM) removes the device (docs/kmod.md);
//       run again while /dev/farmem0 runs (the keeper was killed), it re-adopts the device
// stat, demo and kmod attach take --key-file K instead of --secret-file to act as one identity.
//
// This file: main (option parsing), demo, drain, key issue; stat and export stat are
// farmemctl_stat.cc, kmod attach/detach farmemctl_kmod.cc, what they share is farmemctl.h.
#include "farmemctl.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "farmem/client/cluster.h"
#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"

using namespace farmem;
using Sec = std::chrono::duration<double>;

namespace farmem::ctl {

Result<std::unique_ptr<client::Cluster>> ConnectCluster(
    const Common& c, const char* name, const std::optional<wire::ClientId>& client_id) {
  client::ClusterOptions o;
  o.client_id = client_id;
  FARMEM_ASSIGN_OR_RETURN(o.peers, ParseEndpointList(c.peers, kDefaultPort));
  o.peers_dns = c.peers_dns;
  o.transport = c.transport;
  o.client_name = name;
  FARMEM_ASSIGN_OR_RETURN(auth::ClientKeyFile cred,
                          auth::LoadClientCredentials(c.secret_file, c.key_file));
  o.secret = std::move(cred.key);
  o.identity = std::move(cred.identity);
  if (o.peers.empty() && o.peers_dns.empty()) {
    return Err(InvalidArgument("give the daemons with --peers host:port,... or --peers-dns"));
  }
  return client::Cluster::Connect(std::move(o));
}

}  // namespace farmem::ctl

using namespace farmem::ctl;

namespace {

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

// DRAIN (or undrain) one daemon over a control connection of its own; with `wait`, repeats the
// (idempotent) DRAIN until the daemon holds no lease or the grace period and 5 s more have passed.
int DrainCmd(const Common& c, const std::string& target, bool drain, uint32_t grace_ms, bool wait) {
  Common one = c;
  one.peers = target;
  one.peers_dns.clear();
  auto cluster = ConnectCluster(one, drain ? "farmemctl-drain" : "farmemctl-undrain");
  if (!cluster) {
    fmt::print(stderr, "farmemctl: {}\n", cluster.error().ToString());
    return 1;
  }
  auto conn = (*cluster)->ControlConnection(0);
  if (!conn) {
    fmt::print(stderr, "farmemctl: {}: {}\n", target, conn.error().ToString());
    return 1;
  }
  std::vector<uint8_t> req;
  wire::EncodeDrain({drain, grace_ms}, &req);
  auto call = [&]() -> Result<wire::DrainReply> {
    FARMEM_ASSIGN_OR_RETURN(auto body,
                            conn->Call(wire::Opcode::kDrain, req, std::chrono::seconds(10)));
    return wire::DecodeDrainReply(body);
  };
  auto r = call();
  if (!r) {
    fmt::print(stderr, "farmemctl: {} {}: {}\n", drain ? "drain" : "undrain", target,
               r.error().ToString());
    return 1;
  }
  if (!drain) {
    fmt::print("{}: undrained; granting again ({} lease(s) held)\n", target, r->leases_held);
    return 0;
  }
  fmt::print("{}: draining; {} lease(s) noticed to move within {} ms, {} held\n", target,
             r->leases_noticed, grace_ms, r->leases_held);
  if (!wait) return 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms) +
                        std::chrono::seconds(5);
  while (r->leases_held > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // polling the daemon's state
    r = call();
    if (!r) {
      fmt::print(stderr, "farmemctl: drain {}: {}\n", target, r.error().ToString());
      return 1;
    }
  }
  if (r->leases_held > 0) {
    fmt::print(stderr, "farmemctl: {} still holds {} lease(s)\n", target, r->leases_held);
    return 1;
  }
  fmt::print("{}: drained, no lease held\n", target);
  return 0;
}

// farmemctl key issue: the key of one identity, derived from the cluster secret (auth.h).
int KeyIssueCmd(const std::string& secret_file, const std::string& name, const std::string& out) {
  if (Status s = auth::ValidateIdentity(name); !s.ok()) {
    fmt::print(stderr, "farmemctl key issue: {}\n", s.message());
    return 2;
  }
  if (name == auth::kClusterIdentity) {
    fmt::print(stderr,
               "farmemctl key issue: '{}' is the built-in identity of the cluster secret itself; "
               "give its holders --secret-file\n",
               name);
    return 2;
  }
  auto secret = auth::LoadSecretFile(secret_file);
  if (!secret) {
    fmt::print(stderr, "farmemctl key issue: --secret-file: {}\n", secret.error().ToString());
    return 1;
  }
  const std::string text = auth::FormatClientKeyFile({name, auth::ClientKey(*secret, name)});
  // Created 0600 and never widened: the key is as good as the name's password.
  const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    fmt::print(stderr, "farmemctl key issue: cannot create {}: {}{}\n", out, strerror(errno),
               errno == EEXIST ? " (remove it first: a key file is never overwritten)" : "");
    return 1;
  }
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok) {
    fmt::print(stderr, "farmemctl key issue: writing {} failed\n", out);
    ::unlink(out.c_str());
    return 1;
  }
  fmt::print(
      "wrote the key of identity '{}' to {} (mode 0600); give it to that client with "
      "--key-file {}\n",
      name, out, out);
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
    sub->add_option("--key-file", c.key_file,
                    "Authenticate as one identity: its key file (farmemctl key issue)");
    sub->add_option("--transport", c.transport, "tcp, verbs or auto")
        ->capture_default_str()
        ->check(cli::OneOf(kTransports));
  };
  cli::AddLogLevelOption(app, log_level);
  cli::AddVersionOption(app, "farmemctl");
  bool json = false;
  CLI::App* stat = app.add_subcommand(
      "stat",
      "Show every daemon's state, version, capacity and usage. Exit 0: every daemon answered; "
      "3: a daemon is down; 1: could not ask (docs/operations.md)");
  add_common(stat);
  stat->add_flag("--json", json, "Print JSON instead of a table");
  std::string export_target;
  CLI::App* exp = app.add_subcommand("export", "Look at a farmem-nbd export");
  exp->require_subcommand(1);
  CLI::App* export_stat = exp->add_subcommand(
      "stat",
      "An export's health from farmem-nbd --metrics-listen: degraded extents, rebuild progress "
      "and ETA, daemons and placement. Exit 0: whole; 3: degraded or a daemon not up; 4: data "
      "lost; 1: could not ask");
  export_stat->add_option("target", export_target, "farmem-nbd's --metrics-listen, host:port")
      ->required();
  export_stat->add_flag("--json", json, "Print JSON instead of text");
  std::string target;
  uint32_t grace_ms = 30000;
  bool wait = false;
  CLI::App* drain = app.add_subcommand(
      "drain", "Make one daemon grant nothing and give its clients notice to move their data");
  drain->add_option("target", target, "The daemon, host:port")->required();
  drain->add_option("--secret-file", c.secret_file, "Shared secret the daemon requires");
  drain->add_option("--key-file", c.key_file, "An identity's key file (DRAIN needs the secret)");
  drain->add_option("--grace-ms", grace_ms, "How long clients have to move their data")
      ->capture_default_str();
  drain->add_flag("--wait", wait,
                  "Return once the daemon holds no lease (exit 1 if it still does)");
  CLI::App* undrain =
      app.add_subcommand("undrain", "Let a drained daemon grant again and lift pending notices");
  undrain->add_option("target", target, "The daemon, host:port")->required();
  undrain->add_option("--secret-file", c.secret_file, "Shared secret the daemon requires");
  CLI::App* demo = app.add_subcommand(
      "demo", "Borrow slabs, write patterned data, read it back verified, free it");
  add_common(demo);
  demo->add_option("--size", size, "How much memory to borrow and fill")->capture_default_str();
  CLI::App* key = app.add_subcommand("key", "Client identities (docs/operations.md \"Security\")");
  key->require_subcommand(1);
  CLI::App* key_issue = key->add_subcommand(
      "issue", "Write the key of one identity, derived from the cluster secret, to a new file");
  std::string key_name, key_out;
  key_issue->add_option("name", key_name, "The identity: letters, digits and . _ @ -")->required();
  key_issue->add_option("--secret-file", c.secret_file, "The cluster secret")->required();
  key_issue->add_option("--out", key_out, "The key file to create (mode 0600)")->required();
  std::string kmod_size, kmod_resilience = "none", kmod_dir = "/sys/kernel/farmem";
  CLI::App* kmod = app.add_subcommand("kmod", "farmem.ko, the kernel paging client (docs/kmod.md)");
  kmod->require_subcommand(1);
  CLI::App* kmod_attach = kmod->add_subcommand(
      "attach",
      "Lease slabs, hand them to farmem.ko as /dev/farmem0, keep them alive until detach");
  add_common(kmod_attach);
  kmod_attach->add_option("--size", kmod_size, "Size of /dev/farmem0 (whole slabs)")->required();
  kmod_attach->add_option("--resilience", kmod_resilience, "none or replicate:N (N <= 3)")
      ->capture_default_str();
  CLI::App* kmod_detach = kmod->add_subcommand("detach", "Remove /dev/farmem0");
  for (CLI::App* sub : {kmod_attach, kmod_detach}) {
    sub->add_option("--sysfs", kmod_dir, "farmem.ko's control directory")->capture_default_str();
  }
  CLI11_PARSE(app, argc, argv);
  cli::SetUpLogging("farmemctl", log_level);
  if (*stat) return StatCmd(c, json);
  if (*exp) return ExportStatCmd(export_target, json);
  if (*drain) return DrainCmd(c, target, true, grace_ms, wait);
  if (*undrain) return DrainCmd(c, target, false, 0, false);
  if (*kmod_attach) return KmodAttachCmd(c, kmod_size, kmod_resilience, kmod_dir);
  if (*kmod_detach) return KmodDetachCmd(kmod_dir);
  if (*key) return KeyIssueCmd(c.secret_file, key_name, key_out);
  return Demo(c, size);
}
