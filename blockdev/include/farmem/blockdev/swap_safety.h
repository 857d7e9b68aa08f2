// Process settings that let farmem-nbd serve a swap device without deadlocking the machine.
//
// What it solves: when the kernel swaps to farmem-nbd it is short of memory. If the server then
// needs memory itself (a page fault on its own code, stack or buffers, or a reclaim that waits for
// writeback to the very device it serves) the machine can deadlock, and the OOM killer might pick
// the server, which loses every swapped-out page. So, as far as the process is permitted:
//  - mlockall(MCL_CURRENT | MCL_FUTURE): every page, including buffers allocated later, stays in
//    RAM (needs CAP_IPC_LOCK or a large RLIMIT_MEMLOCK);
//  - prctl(PR_SET_IO_FLUSHER): allocations of this process do not recurse into filesystem/block
//    I/O during reclaim (Linux >= 5.6, needs CAP_SYS_RESOURCE);
//  - /proc/self/oom_score_adj = -1000: the OOM killer never picks it (needs CAP_SYS_RESOURCE);
//  - threads created from then on (std::thread included) get a kThreadStackSize stack, not
//    glibc's default of RLIMIT_STACK (8 MiB): under MCL_FUTURE a thread's whole stack is locked
//    when it starts, and ten threads took 80 MiB of locked memory for a few KiB of stack each.
// Each step is tried independently; a failure is reported, not fatal (the caller warns).
// Call once at startup, from the main thread, before serving.
#pragma once

#include <cstddef>

#include "farmem/common/status.h"

namespace farmem::blockdev {

// The stack of every thread of a swap-safe process. The deepest measured was 28 KiB (a connection
// thread running the page store, 4 KiB random I/O at depth 16): this leaves 9x headroom.
inline constexpr size_t kThreadStackSize = 256u << 10;

struct SwapSafetyReport {
  Status memory_locked;
  Status io_flusher;
  Status oom_protected;
  Status small_stacks;
  bool all_ok() const {
    return memory_locked.ok() && io_flusher.ok() && oom_protected.ok() && small_stacks.ok();
  }
};

SwapSafetyReport EnterSwapSafeMode();

}  // namespace farmem::blockdev
