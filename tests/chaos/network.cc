#include "network.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "support/process.h"

namespace farmem::chaos {

namespace {

// The veth partitioned packets are redirected to; it stays down, so the kernel drops them.
constexpr const char* kBlackhole = "fmchaos-bh0";
constexpr int kMaxDaemons = 14;  // prio has 16 bands: band 1 for everything else, one per daemon

// ip and tc live in /usr/sbin, which a test's PATH may lack.
std::string Tool(const std::string& name) {
  for (const char* dir : {"/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"}) {
    if (::access((dir + name).c_str(), X_OK) == 0) return dir + name;
  }
  return name;
}

std::string Join(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

Status Run(const std::vector<std::string>& argv) {
  const testing::CommandResult r = testing::RunCommand(argv, std::chrono::seconds(20));
  if (r.exit_code == 0) return Status::Ok();
  return Status(StatusCode::kUnavailable, fmt::format("'{}' failed (exit {}): {}", Join(argv),
                                                      r.exit_code, r.err.empty() ? r.out : r.err));
}

Status Tc(std::vector<std::string> args) {
  args.insert(args.begin(), Tool("tc"));
  return Run(args);
}

// Several tc commands in one process (tc -batch): both directions of a path change together, and
// under emulation (the qemu guest) each tc process costs most of a second.
Status TcBatch(const std::vector<std::vector<std::string>>& commands) {
  const char* tmp = std::getenv("TMPDIR");
  std::string path =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/farmem-chaos-tc.XXXXXX";
  const int fd = ::mkstemp(path.data());
  if (fd < 0) return ErrnoStatus(StatusCode::kIoError, "mkstemp " + path, errno);
  std::string text;
  for (const auto& c : commands) text += Join(c) + "\n";
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  Status s = written ? Run({Tool("tc"), "-batch", path})
                     : ErrnoStatus(StatusCode::kIoError, "write " + path, errno);
  ::unlink(path.c_str());
  if (!s.ok()) return Status(s.code(), s.message() + " (commands: " + text + ")");
  return s;
}

Status WriteProcFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(StatusCode::kUnavailable, "open " + path, errno);
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus(StatusCode::kUnavailable, "write " + path, err);
  }
  return Status::Ok();
}

// u32 matches for "to or from `port`" (TCP/UDP ports sit at offset 20: lo carries no IP options).
std::vector<std::vector<std::string>> PortMatches(uint16_t port) {
  const std::string p = std::to_string(port);
  return {{"match", "ip", "dport", p, "0xffff"}, {"match", "ip", "sport", p, "0xffff"}};
}

}  // namespace

Status EnterPrivateNetwork() {
  if (::unshare(CLONE_NEWNET) != 0) {
    const int first = errno;
    // Without CAP_SYS_ADMIN: a user namespace of our own gives it (uid 0 there = us here).
    const uid_t uid = ::getuid();
    const gid_t gid = ::getgid();
    if (::unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0) {
      return ErrnoStatus(StatusCode::kUnavailable,
                         fmt::format("unshare(CLONE_NEWNET) failed ({}), and so did a user "
                                     "namespace with it",
                                     std::strerror(first)),
                         errno);
    }
    (void)WriteProcFile("/proc/self/setgroups", "deny");
    FARMEM_RETURN_IF_ERROR(WriteProcFile("/proc/self/uid_map", fmt::format("0 {} 1", uid)));
    FARMEM_RETURN_IF_ERROR(WriteProcFile("/proc/self/gid_map", fmt::format("0 {} 1", gid)));
  }
  const std::string ip = Tool("ip");
  FARMEM_RETURN_IF_ERROR(Run({ip, "link", "set", "lo", "up"}));
  FARMEM_RETURN_IF_ERROR(
      Run({ip, "link", "add", kBlackhole, "type", "veth", "peer", "name", "fmchaos-bh1"}));
  return Tc({"qdisc", "add", "dev", "lo", "handle", "ffff:", "ingress"});
}

Status NetemAvailable() {
  FARMEM_RETURN_IF_ERROR(Tc({"qdisc", "add", "dev", kBlackhole, "root", "netem", "delay", "1ms"}));
  (void)Tc({"qdisc", "del", "dev", kBlackhole, "root"});
  // Band 1 (class 1:1) for all traffic; bands 2.. for impaired daemons.
  std::vector<std::string> args = {"qdisc", "add",  "dev",   "lo", "root",   "handle",
                                   "1:",    "prio", "bands", "16", "priomap"};
  for (int i = 0; i < 16; ++i) args.push_back("0");
  return Tc(args);
}

NetworkFaults::~NetworkFaults() { (void)HealAll(); }

Status NetworkFaults::Partition(int index, uint16_t port) {
  if (index < 0 || index >= kMaxDaemons) return InvalidArgument("network faults: daemon index");
  const std::string pref = std::to_string(index + 1);
  std::vector<std::vector<std::string>> batch;
  for (const auto& match : PortMatches(port)) {
    std::vector<std::string> args = {
        "filter", "add", "dev", "lo", "parent", "ffff:", "protocol", "ip", "prio", pref, "u32"};
    args.insert(args.end(), match.begin(), match.end());
    args.insert(args.end(), {"action", "mirred", "egress", "redirect", "dev", kBlackhole});
    batch.push_back(std::move(args));
  }
  partitioned_.insert(index);
  return TcBatch(batch);
}

Status NetworkFaults::Delay(int index, uint16_t port, int ms, int jitter_ms) {
  Impairment what = impaired_[index];
  what.delay_ms = ms;
  what.jitter_ms = jitter_ms;
  return Impair(index, port, what);
}

Status NetworkFaults::Loss(int index, uint16_t port, double percent) {
  Impairment what = impaired_[index];
  what.loss_percent = percent;
  return Impair(index, port, what);
}

Status NetworkFaults::Impair(int index, uint16_t port, const Impairment& what) {
  if (index < 0 || index >= kMaxDaemons) return InvalidArgument("network faults: daemon index");
  impaired_[index] = what;
  const std::string band = fmt::format("1:{:x}", index + 2);
  // A deep queue: at a few thousand requests/s, 50 ms of delay holds more than netem's default
  // 1000 packets, and overflowing it would add loss nobody asked for.
  std::vector<std::string> q = {"qdisc",  "replace", "dev",    "lo",
                                "parent", band,      "handle", fmt::format("{:x}:", index + 16),
                                "netem",  "limit",   "100000"};
  if (what.delay_ms > 0) {
    q.insert(q.end(), {"delay", fmt::format("{}ms", what.delay_ms)});
    if (what.jitter_ms > 0) q.push_back(fmt::format("{}ms", what.jitter_ms));
  }
  if (what.loss_percent > 0) q.insert(q.end(), {"loss", fmt::format("{}%", what.loss_percent)});
  std::vector<std::vector<std::string>> batch = {q};
  if (filtered_.insert(index).second) {
    for (const auto& match : PortMatches(port)) {
      std::vector<std::string> args = {
          "filter", "add",      "dev", "lo",   "parent",
          "1:",     "protocol", "ip",  "prio", std::to_string(index + 1),
          "u32"};
      args.insert(args.end(), match.begin(), match.end());
      args.insert(args.end(), {"flowid", band});
      batch.push_back(std::move(args));
    }
  }
  return TcBatch(batch);
}

Status NetworkFaults::HealAll() {
  std::vector<std::vector<std::string>> batch;
  for (int index : partitioned_) {
    batch.push_back(
        {"filter", "del", "dev", "lo", "parent", "ffff:", "prio", std::to_string(index + 1)});
  }
  for (int index : filtered_) {
    batch.push_back(
        {"filter", "del", "dev", "lo", "parent", "1:", "prio", std::to_string(index + 1)});
  }
  partitioned_.clear();
  impaired_.clear();
  filtered_.clear();
  return batch.empty() ? Status::Ok() : TcBatch(batch);
}

}  // namespace farmem::chaos
