#include "farmem/blockdev/swap_safety.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#endif

namespace farmem::blockdev {

namespace {

// The mappings of the program's own file (its code and read-only data), locked whole: every
// path of farmem-nbd, the rare ones (rebuild, error handling) included, stays in RAM.
Status LockOwnProgram() {
  std::error_code ec;
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) return Status(StatusCode::kIoError, "readlink /proc/self/exe: " + ec.message());
  std::ifstream maps("/proc/self/maps");
  if (!maps) return Status(StatusCode::kIoError, "cannot read /proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    // "start-end perms offset dev inode path"
    std::istringstream f(line);
    std::string range, perms, offset, dev, inode, path;
    f >> range >> perms >> offset >> dev >> inode;
    std::getline(f >> std::ws, path);
    if (path != exe) continue;
    const size_t dash = range.find('-');
    const uintptr_t start = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (::mlock(reinterpret_cast<const void*>(start), end - start) != 0) {
      return ErrnoStatus(StatusCode::kPermissionDenied, "mlock of " + exe + " " + range, errno);
    }
  }
  return Status::Ok();
}

// `on_fault`: what is mapped now (the program, its shared libraries, the main thread's stack) is
// locked page by page as it is used: a library's pages that farmem-nbd never touches (most of
// libcrypto and libstdc++) are not taken from the host. A library page
// used for the first time later is a page fault that may read the file: safe only if this
// process's allocations cannot recurse into I/O (PR_SET_IO_FLUSHER), so without that everything
// mapped now is locked whole, as before.
Status LockAllMemory(bool on_fault) {
  if (!on_fault) {
    if (::mlockall(MCL_CURRENT | MCL_FUTURE) != 0) {
      return ErrnoStatus(StatusCode::kPermissionDenied,
                         "mlockall(MCL_CURRENT|MCL_FUTURE) (needs CAP_IPC_LOCK or a larger "
                         "RLIMIT_MEMLOCK)",
                         errno);
    }
    return Status::Ok();
  }
  if (::mlockall(MCL_CURRENT | MCL_ONFAULT) != 0) {
    return ErrnoStatus(StatusCode::kPermissionDenied,
                       "mlockall(MCL_CURRENT|MCL_ONFAULT) (needs CAP_IPC_LOCK or a larger "
                       "RLIMIT_MEMLOCK)",
                       errno);
  }
  const Status own = LockOwnProgram();
  // Everything mapped from here on (the heap as it grows, thread stacks, the backend's buffers)
  // is populated and locked whole when it is mapped, so the request path never faults on it.
  // MCL_FUTURE alone leaves the current mappings as they are.
  if (::mlockall(MCL_FUTURE) != 0) {
    return ErrnoStatus(StatusCode::kPermissionDenied,
                       "mlockall(MCL_FUTURE) (needs CAP_IPC_LOCK or a larger RLIMIT_MEMLOCK)",
                       errno);
  }
  return own;
}

Status MarkIoFlusher() {
  if (::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) != 0) {
    return ErrnoStatus(StatusCode::kPermissionDenied,
                       "prctl(PR_SET_IO_FLUSHER) (needs CAP_SYS_RESOURCE and Linux >= 5.6)", errno);
  }
  return Status::Ok();
}

Status ProtectFromOomKiller() {
  const int fd = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(StatusCode::kIoError, "open /proc/self/oom_score_adj", errno);
  static constexpr char kValue[] = "-1000";
  const ssize_t n = ::write(fd, kValue, sizeof(kValue) - 1);
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(sizeof(kValue) - 1)) {
    return ErrnoStatus(StatusCode::kPermissionDenied,
                       "writing -1000 to /proc/self/oom_score_adj (needs CAP_SYS_RESOURCE)", err);
  }
  return Status::Ok();
}

Status UseSmallThreadStacks() {
  pthread_attr_t attr;
  if (const int rc = pthread_getattr_default_np(&attr); rc != 0) {
    return ErrnoStatus(StatusCode::kInternal, "pthread_getattr_default_np", rc);
  }
  int rc = pthread_attr_setstacksize(&attr, kThreadStackSize);
  if (rc == 0) rc = pthread_setattr_default_np(&attr);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    return ErrnoStatus(StatusCode::kInternal,
                       "pthread_setattr_default_np (threads keep the default stack size, locked "
                       "whole)",
                       rc);
  }
  return Status::Ok();
}

}  // namespace

SwapSafetyReport EnterSwapSafeMode() {
  SwapSafetyReport r;
  r.io_flusher = MarkIoFlusher();
  r.memory_locked = LockAllMemory(/*on_fault=*/r.io_flusher.ok());
  r.oom_protected = ProtectFromOomKiller();
  r.small_stacks = UseSmallThreadStacks();
  return r;
}

}  // namespace farmem::blockdev
