// Linked into every test binary (farmem_add_test, cmake/FarmemTesting.cmake): when the binary is
// still running at 85% of its ctest TIMEOUT (FARMEM_TEST_TIMEOUT_S, which farmem_add_test and
// farmem_test_timeout set), it prints the stack of every thread of itself and of its child
// processes (the daemons its fixture started) to stderr, once, with gdb. ctest ends a binary at its
// timeout with SIGKILL and the log says only "Timeout": a hang seen once in CI (far_list_queue_test
// under ASan, docs/testing.md) left nothing to find its cause by. This is diagnosis, not a timed
// assertion: nothing fails because of it, and without the variable (a binary run by hand) or
// without gdb it does nothing but say so.
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

void DumpStacks() {
  // Yama (ptrace_scope 1) lets only an ancestor, or root, attach: gdb is this process's child.
  (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  const std::string pid = std::to_string(getpid());
  const std::string cmd =
      "command -v gdb >/dev/null || { echo 'hang_dump: gdb is not installed: no stacks'; exit; }; "
      "for p in " +
      pid + " $(pgrep -P " + pid +
      "); do "
      "[ $p = $$ ] && continue; "  // this shell, also a child
      "echo \"== hang_dump: the stacks of process $p: $(tr '\\0' ' ' </proc/$p/cmdline)\"; "
      "gdb -p $p -batch -nx -ex 'thread apply all bt' 2>&1 | grep -v '^\\[New LWP'; "
      "done >&2";
  std::fprintf(stderr,
               "hang_dump: still running at 85%% of the ctest timeout: every thread's stack "
               "follows\n");
  std::fflush(stderr);
  (void)std::system(cmd.c_str());
}

[[maybe_unused]] const bool kArmed = [] {
  const char* s = std::getenv("FARMEM_TEST_TIMEOUT_S");
  const long timeout_s = s != nullptr ? std::strtol(s, nullptr, 10) : 0;
  if (timeout_s <= 0) return false;
  std::thread([timeout_s] {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_s * 850));
    DumpStacks();
  }).detach();
  return true;
}();

}  // namespace
