#include "memory_source.h"

#include <fmt/format.h>

#include <charconv>
#include <fstream>
#include <sstream>
#include <string_view>

namespace farmem::daemon {

namespace fs = std::filesystem;

namespace {

Result<std::string> ReadText(const fs::path& path) {
  std::ifstream f(path);
  if (!f) return Err(IoError(fmt::format("cannot read {}", path.string())));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::optional<uint64_t> ParseU64(std::string_view s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.remove_suffix(1);
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

Result<uint64_t> ReadU64(const fs::path& path) {
  FARMEM_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  std::optional<uint64_t> v = ParseU64(text);
  if (!v) return Err(IoError(fmt::format("{}: not a number: '{}'", path.string(), text)));
  return *v;
}

// The value of `key` in a "key value" per line file (memory.stat, memory.events); 0 if absent.
uint64_t KeyValue(const std::string& text, std::string_view key) {
  std::istringstream in(text);
  std::string k;
  uint64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

// v1's "no limit" is PAGE_COUNTER_MAX rounded to pages (about 2^63); anything at or above the
// host's RAM is no limit for our purpose either.
bool Unlimited(uint64_t limit, const fs::path& proc) {
  if (limit >= (uint64_t{1} << 62)) return true;
  Result<std::string> meminfo = ReadText(proc / "meminfo");
  if (!meminfo) return false;
  std::istringstream in(*meminfo);
  std::string k;
  uint64_t kib = 0;
  std::string unit;
  while (in >> k >> kib) {
    std::getline(in, unit);
    if (k == "MemTotal:") return limit >= kib * 1024;
  }
  return false;
}

class Host final : public MemorySource {
 public:
  explicit Host(fs::path proc) : proc_(std::move(proc)) {}
  Result<MemorySnapshot> Read() override {
    FARMEM_ASSIGN_OR_RETURN(std::string meminfo, ReadText(proc_ / "meminfo"));
    MemorySnapshot s;
    std::istringstream in(meminfo);
    std::string k, rest;
    uint64_t kib = 0;
    bool total = false, avail = false;
    while (in >> k >> kib) {
      std::getline(in, rest);
      if (k == "MemTotal:") s.limit = kib * 1024, total = true;
      if (k == "MemAvailable:") s.available = kib * 1024, avail = true;
    }
    if (!total || !avail) {
      return Err(IoError(fmt::format("{} has no MemTotal/MemAvailable (kernel older than 3.14?)",
                                     (proc_ / "meminfo").string())));
    }
    if (Result<std::string> psi = ReadText(proc_ / "pressure" / "memory"); psi) {
      s.psi_full_avg10 = ParsePsiFullAvg10(*psi);
      s.psi_full_total_us = ParsePsiFullTotal(*psi);
    }
    s.taken = std::chrono::steady_clock::now();
    return s;
  }
  std::string name() const override { return "host (" + (proc_ / "meminfo").string() + ")"; }

 private:
  fs::path proc_;
};

class CgroupV2 final : public MemorySource {
 public:
  explicit CgroupV2(fs::path dir) : dir_(std::move(dir)) {}
  Result<MemorySnapshot> Read() override {
    FARMEM_ASSIGN_OR_RETURN(std::string max, ReadText(dir_ / "memory.max"));
    std::optional<uint64_t> limit = ParseU64(max);
    if (!limit) return Err(IoError(fmt::format("{}: no limit ('{}')", dir_.string(), max)));
    FARMEM_ASSIGN_OR_RETURN(uint64_t current, ReadU64(dir_ / "memory.current"));
    MemorySnapshot s;
    s.limit = *limit;
    uint64_t reclaimable = 0;
    if (Result<std::string> stat = ReadText(dir_ / "memory.stat"); stat) {
      reclaimable = KeyValue(*stat, "inactive_file");
    }
    const uint64_t used = current > reclaimable ? current - reclaimable : 0;
    s.available = s.limit > used ? s.limit - used : 0;
    if (Result<std::string> ev = ReadText(dir_ / "memory.events"); ev) {
      s.limit_hits = KeyValue(*ev, "max") + KeyValue(*ev, "oom");
    }
    if (Result<std::string> psi = ReadText(dir_ / "memory.pressure"); psi) {
      s.psi_full_avg10 = ParsePsiFullAvg10(*psi);
      s.psi_full_total_us = ParsePsiFullTotal(*psi);
    }
    s.taken = std::chrono::steady_clock::now();
    return s;
  }
  std::string name() const override { return "cgroup v2 " + dir_.string(); }

 private:
  fs::path dir_;
};

class CgroupV1 final : public MemorySource {
 public:
  CgroupV1(fs::path dir, fs::path proc) : dir_(std::move(dir)), proc_(std::move(proc)) {}
  Result<MemorySnapshot> Read() override {
    FARMEM_ASSIGN_OR_RETURN(uint64_t limit, ReadU64(dir_ / "memory.limit_in_bytes"));
    FARMEM_ASSIGN_OR_RETURN(uint64_t usage, ReadU64(dir_ / "memory.usage_in_bytes"));
    MemorySnapshot s;
    s.limit = limit;
    uint64_t reclaimable = 0;
    if (Result<std::string> stat = ReadText(dir_ / "memory.stat"); stat) {
      reclaimable = KeyValue(*stat, "total_inactive_file");
    }
    const uint64_t used = usage > reclaimable ? usage - reclaimable : 0;
    s.available = limit > used ? limit - used : 0;
    if (Result<uint64_t> f = ReadU64(dir_ / "memory.failcnt"); f) s.limit_hits = *f;
    if (Result<std::string> psi = ReadText(proc_ / "pressure" / "memory"); psi) {
      s.psi_full_avg10 = ParsePsiFullAvg10(*psi);
      s.psi_full_total_us = ParsePsiFullTotal(*psi);
    }
    s.taken = std::chrono::steady_clock::now();
    return s;
  }
  std::string name() const override { return "cgroup v1 " + dir_.string(); }

 private:
  fs::path dir_, proc_;
};

// The daemon's own memory cgroup directory from /proc/self/cgroup, v2 first ("0::/path"), then
// v1 ("N:...memory...:/path"). nullopt when it has none.
std::optional<fs::path> OwnCgroup(const fs::path& proc, const fs::path& root) {
  Result<std::string> text = ReadText(proc / "self" / "cgroup");
  if (!text) return std::nullopt;
  std::istringstream in(*text);
  std::string line;
  std::optional<fs::path> v1, v2;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    const fs::path rel = fs::path(path).relative_path();
    if (controllers.empty() && line.starts_with("0::")) {
      const fs::path dir = root / rel;
      if (fs::exists(dir / "memory.max")) v2 = dir;
    } else {
      std::istringstream cs(controllers);
      std::string c;
      while (std::getline(cs, c, ',')) {
        if (c == "memory") {
          fs::path dir = root / "memory" / rel;
          if (fs::exists(dir / "memory.limit_in_bytes")) v1 = dir;
        }
      }
    }
  }
  return v2 ? v2 : v1;
}

bool HasLimit(const fs::path& dir, const fs::path& proc) {
  if (fs::exists(dir / "memory.max")) {
    Result<std::string> max = ReadText(dir / "memory.max");
    return max && ParseU64(*max).has_value();
  }
  Result<uint64_t> limit = ReadU64(dir / "memory.limit_in_bytes");
  return limit && !Unlimited(*limit, proc);
}

}  // namespace

std::optional<uint64_t> ParsePsiFullTotal(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("full ")) continue;
    const size_t at = line.find("total=");
    if (at == std::string::npos) return std::nullopt;
    return ParseU64(std::string_view(line).substr(at + 6));
  }
  return std::nullopt;
}

std::optional<double> ParsePsiFullAvg10(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("full ")) continue;
    const size_t at = line.find("avg10=");
    if (at == std::string::npos) return std::nullopt;
    try {
      return std::stod(line.substr(at + 6));
    } catch (...) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

std::unique_ptr<MemorySource> HostMemorySource(const fs::path& proc) {
  return std::make_unique<Host>(proc);
}

std::unique_ptr<MemorySource> CgroupMemorySource(const fs::path& dir, const fs::path& proc) {
  if (fs::exists(dir / "memory.max")) return std::make_unique<CgroupV2>(dir);
  return std::make_unique<CgroupV1>(dir, proc);
}

Result<std::unique_ptr<MemorySource>> OpenMemorySource(const std::string& spec,
                                                       const fs::path& proc,
                                                       const fs::path& cgroup_root) {
  std::unique_ptr<MemorySource> src;
  if (spec == "host") {
    src = HostMemorySource(proc);
  } else if (spec == "auto" || spec == "cgroup") {
    std::optional<fs::path> dir = OwnCgroup(proc, cgroup_root);
    if (dir && HasLimit(*dir, proc)) {
      src = CgroupMemorySource(*dir, proc);
    } else if (spec == "cgroup") {
      return Err(InvalidArgument(fmt::format(
          "--memory-source cgroup: this process's memory cgroup ({}) has no memory limit; set "
          "one (memory.max, or memory.limit_in_bytes on cgroup v1), or use --memory-source host",
          dir ? dir->string() : "none found in /proc/self/cgroup")));
    } else {
      src = HostMemorySource(proc);
    }
  } else if (spec.starts_with("cgroup:")) {
    const fs::path dir = spec.substr(7);
    if (!fs::exists(dir / "memory.max") && !fs::exists(dir / "memory.limit_in_bytes")) {
      return Err(InvalidArgument(fmt::format(
          "--memory-source {}: {} has neither memory.max (cgroup v2) nor memory.limit_in_bytes "
          "(cgroup v1)",
          spec, dir.string())));
    }
    src = CgroupMemorySource(dir, proc);
  } else {
    return Err(InvalidArgument(
        fmt::format("--memory-source '{}': use auto, host, cgroup or cgroup:DIR", spec)));
  }
  Result<MemorySnapshot> first = src->Read();
  if (!first) return Err(first.error().WithContext("--memory-source " + spec));
  return src;
}

}  // namespace farmem::daemon
