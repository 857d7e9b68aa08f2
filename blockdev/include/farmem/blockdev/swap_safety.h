// Process settings that let farmem-nbd serve a swap device without deadlocking the machine.
//
// What it solves: when the kernel swaps to farmem-nbd it is short of memory. If the server then
// needs memory itself (a page fault on its own code, stack or buffers, or a reclaim that waits for
// writeback to the very device it serves) the machine can deadlock, and the OOM killer might pick
// the server, which loses every swapped-out page. So, as far as the process is permitted:
//  - prctl(PR_SET_IO_FLUSHER): allocations of this process do not recurse into filesystem/block
//    I/O during reclaim (Linux >= 5.6, needs CAP_SYS_RESOURCE);
//  - memory locked (needs CAP_IPC_LOCK or a large RLIMIT_MEMLOCK): everything mapped from then on
//    (heap, thread stacks, every buffer) is populated and locked whole as it is mapped
//    (MCL_FUTURE), and so is the program's own file; the shared libraries mapped at start are
//    locked page by page as they are used (MCL_CURRENT | MCL_ONFAULT), so their pages farmem-nbd
//    never runs (most of libcrypto and libstdc++) take nothing from the
//    host. A library page used for the first time later may be read from its file: that is safe
//    only under PR_SET_IO_FLUSHER, so when that step failed everything is locked whole instead
//    (mlockall(MCL_CURRENT | MCL_FUTURE));
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

// The stack of every thread of a swap-safe process (locked whole, ~11 threads at idle + one per
// connection). The deepest measured was 28 KiB (a connection thread running the page store, 4 KiB
// random I/O at depth 16; 24 KiB for ec:4+2 reads degraded by a killed daemon): 128 KiB leaves
// 4.5x headroom, and a stack that overflowed would hit glibc's guard page (a crash, not a silent
// corruption).
inline constexpr size_t kThreadStackSize = 128u << 10;

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
