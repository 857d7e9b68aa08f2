# farmem_add_vm_test(NAME <name> COMMAND <command> [args...]
#                    [TIMEOUT <s>] [MEM <MiB>] [SMP <n>] [ADDRS <n>] [CPU <qemu -cpu>] [SHARES <dirs...>]
#                    [MODULES <kernel modules...>] [ENV <K=V...>] [LABELS <more labels...>]
#                    [DEPENDS_ON <tests...>])
# Registers a ctest test that runs COMMAND inside the qemu guest (deploy/vm/run): real soft-RoCE
# (rxe0 on 10.0.2.15 [+ ADDRS more]), the kernel NBD client, swap, cgroup v2, kernel modules.
# COMMAND runs with the same paths as on the host (its / is the host's, read-only), so pass
# $<TARGET_FILE:tgt> and source paths as they are. SHARES are host directories the guest may write
# (created at configure time). CPU is the emulated CPU model (FARMEM_VM_CPU; the harness's default
# is qemu64, which has no SSSE3: ISA-L then falls back to its byte-at-a-time C code, ~10x slower
# than its SSE path under emulation — ec tests want kFarmemVmCpuV2). Labelled "vm"; skipped (exit 77) when qemu or Debian's kernel
# package cannot be had, unless FARMEM_VM_REQUIRED=1. See docs/vm-harness.md.
#
# Use from another tests/<dir>/CMakeLists.txt:
#   include(${CMAKE_SOURCE_DIR}/tests/vm/FarmemVmTest.cmake)
#   farmem_add_vm_test(NAME blockdev_vm_swap TIMEOUT 300 COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/x.sh)
include_guard(GLOBAL)

# x86-64-v2 (what any server farmem runs on has): qemu 7.2 has no model of that name. A cache
# variable: include_guard(GLOBAL) skips this file in every directory but the first to include it.
set(kFarmemVmCpuV2 "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt" CACHE INTERNAL "qemu -cpu: x86-64-v2")

function(farmem_add_vm_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT;MEM;SMP;ADDRS;CPU" "COMMAND;SHARES;MODULES;ENV;LABELS;DEPENDS_ON" ${ARGN})
  if(NOT T_NAME OR NOT T_COMMAND)
    message(FATAL_ERROR "farmem_add_vm_test: NAME and COMMAND are required")
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  # The harness kills the guest itself a little before ctest would kill the harness. A guest stuck
  # in its own set-up (before the command starts) is booted once more after 90 s: ctest allows it.
  math(EXPR guest_timeout "${T_TIMEOUT} - 15")
  math(EXPR T_TIMEOUT "${T_TIMEOUT} + 90")
  set(args --skip-unavailable --timeout ${guest_timeout} --boot-timeout 90)
  if(T_MEM)
    list(APPEND args --mem ${T_MEM})
  endif()
  if(T_SMP)
    list(APPEND args --smp ${T_SMP})
  endif()
  if(T_ADDRS)
    list(APPEND args --addrs ${T_ADDRS})
  endif()
  foreach(d IN LISTS T_SHARES)
    file(MAKE_DIRECTORY ${d})
    list(APPEND args --share ${d})
  endforeach()
  if(T_MODULES)
    list(JOIN T_MODULES " " mods)
    list(APPEND args --modules "${mods}")
  endif()
  foreach(kv IN LISTS T_ENV)
    list(APPEND args --env ${kv})
  endforeach()
  add_test(NAME ${T_NAME}
    COMMAND bash ${CMAKE_SOURCE_DIR}/deploy/vm/run ${args} -- ${T_COMMAND}
    WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  # A guest keeps one host core busy per vCPU (TCG runs each vCPU on a host thread): it counts as
  # that many ctest jobs. Under `ctest -j2` a two-vCPU guest runs alone and two one-vCPU guests
  # (the swap and kmod tests) run side by side, each on a core of its own. The one-vCPU guests
  # carry the label vm-smp1: tests/run's stage vm1 runs them (two at a time in .ci/run, once the
  # sanitizer trees are built), stage vm2 the others, one at a time.
  if(NOT T_SMP)
    set(T_SMP 2)
  endif()
  set(labels vm)
  if(T_SMP EQUAL 1)
    list(APPEND labels vm-smp1)
  endif()
  list(APPEND labels ${T_LABELS})
  set_tests_properties(${T_NAME} PROPERTIES
    LABELS "${labels}"
    TIMEOUT ${T_TIMEOUT}
    SKIP_RETURN_CODE 77
    PROCESSORS ${T_SMP}
    ENVIRONMENT "FARMEM_BIN_DIR=${CMAKE_BINARY_DIR}/bin;FARMEM_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  if(T_CPU)
    set_property(TEST ${T_NAME} APPEND PROPERTY ENVIRONMENT "FARMEM_VM_CPU=${T_CPU}")
  endif()
  if(T_DEPENDS_ON)
    set_tests_properties(${T_NAME} PROPERTIES DEPENDS "${T_DEPENDS_ON}")
  endif()
endfunction()
