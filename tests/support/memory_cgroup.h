// MemoryCgroup and MemoryHog: a real memory cgroup for farmemd and a process that takes memory in
// it (issue 12: the lender's own programs push it over --reserve). Used by
// daemon_cgroup_pressure_test, lender_pressure_test and nbd_pressure_bench.
//
// MemoryCgroup makes a child memory cgroup of this process's own — cgroup v1
// (/sys/fs/cgroup/memory/..., these hosts) or v2 (the test guest) — with a limit, and removes it
// at the end (every process must have left it by then). Where none can be made (not root, no
// memory controller, no delegation) ok() is false and why() says why: tests skip with it.
// MemoryHog forks a child that joins the cgroup, faults in and writes `bytes` of anonymous memory
// and holds them until it is killed (by Stop() or the destructor). Used by one thread.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace farmem::testing {

class MemoryCgroup {
 public:
  MemoryCgroup(const std::string& name, uint64_t limit) {
    namespace fs = std::filesystem;
    std::ifstream in("/proc/self/cgroup");
    std::string line, v1, v2;
    while (std::getline(in, line)) {
      const size_t a = line.find(':'), b = line.find(':', a + 1);
      if (a == std::string::npos || b == std::string::npos) continue;
      const std::string ctl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
      if (line.rfind("0::", 0) == 0) v2 = path;
      if (ctl == "memory") v1 = path;
    }
    const std::string leaf = name + "-" + std::to_string(::getpid());
    if (!v1.empty() && fs::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes")) {
      dir_ = fs::path("/sys/fs/cgroup/memory") / fs::path(v1).relative_path() / leaf;
      limit_file_ = "memory.limit_in_bytes";
      usage_file_ = "memory.usage_in_bytes";
    } else if (fs::exists("/sys/fs/cgroup/cgroup.controllers")) {
      dir_ = fs::path("/sys/fs/cgroup") / fs::path(v2).relative_path() / leaf;
      limit_file_ = "memory.max";
      usage_file_ = "memory.current";
    } else {
      why_ = "no memory cgroup controller";
      return;
    }
    std::error_code ec;
    if (!fs::create_directory(dir_, ec) && ec) {
      why_ = "cannot create " + dir_.string() + ": " + ec.message();
      dir_.clear();
      return;
    }
    if (!Write(limit_file_, std::to_string(limit))) {
      why_ = "cannot set " + (dir_ / limit_file_).string();
    }
  }
  ~MemoryCgroup() {
    if (dir_.empty()) return;
    std::error_code ec;
    std::filesystem::remove(dir_, ec);  // rmdir: every process has left it by now
  }
  MemoryCgroup(const MemoryCgroup&) = delete;
  MemoryCgroup& operator=(const MemoryCgroup&) = delete;

  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  const std::filesystem::path& dir() const { return dir_; }
  bool Join(pid_t pid) const { return Write("cgroup.procs", std::to_string(pid)); }
  // What the cgroup is charged now (v1 usage_in_bytes, v2 memory.current); 0 if unreadable.
  uint64_t Usage() const {
    std::ifstream in(dir_ / usage_file_);
    uint64_t v = 0;
    in >> v;
    return v;
  }

 private:
  bool Write(const std::string& file, const std::string& value) const {
    std::ofstream out(dir_ / file);
    out << value << "\n";
    out.flush();
    return out.good();
  }
  std::filesystem::path dir_;
  std::string limit_file_, usage_file_;
  std::string why_;
};

class MemoryHog {
 public:
  MemoryHog() = default;
  ~MemoryHog() { Stop(); }
  MemoryHog(const MemoryHog&) = delete;
  MemoryHog& operator=(const MemoryHog&) = delete;

  // Forks the hog into `cg` and returns once it holds `bytes` (false: it could not).
  bool Start(const MemoryCgroup& cg, uint64_t bytes) {
    int fds[2];
    if (::pipe(fds) != 0) return false;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(fds[0]);
      if (!cg.Join(::getpid())) _exit(2);
      // MAP_POPULATE faults the memory in from the kernel in one go: touching it page by page
      // took 7 s for 700 MiB on a busy 2-vCPU host, which would blur the onset of the pressure.
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      if (p == MAP_FAILED) _exit(3);
      std::memset(p, 1, bytes);  // private anonymous memory: written, it is the hog's for good
      const char ok = 1;
      (void)!::write(fds[1], &ok, 1);
      for (;;) ::pause();
    }
    ::close(fds[1]);
    if (pid_ < 0) {
      ::close(fds[0]);
      return false;
    }
    char byte = 0;
    const bool ok = ::read(fds[0], &byte, 1) == 1;
    ::close(fds[0]);
    return ok;
  }
  // Kills the hog (its memory leaves the cgroup) and reaps it.
  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

}  // namespace farmem::testing
