#include "farmem/blockdev/swap_safety.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#endif

namespace farmem::blockdev {

namespace {

Status LockAllMemory() {
  if (::mlockall(MCL_CURRENT | MCL_FUTURE) != 0) {
    return ErrnoStatus(StatusCode::kPermissionDenied,
                       "mlockall(MCL_CURRENT|MCL_FUTURE) (needs CAP_IPC_LOCK or a larger "
                       "RLIMIT_MEMLOCK)",
                       errno);
  }
  return Status::Ok();
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
  r.memory_locked = LockAllMemory();
  r.io_flusher = MarkIoFlusher();
  r.oom_protected = ProtectFromOomKiller();
  r.small_stacks = UseSmallThreadStacks();
  return r;
}

}  // namespace farmem::blockdev
