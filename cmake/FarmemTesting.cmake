# farmem_add_test(NAME <name> SOURCES <files...> LIBS <targets...> LABELS <unit|integration|vm...>
#                 [TIMEOUT <seconds>])
# Builds one GoogleTest executable and registers it with ctest under the given labels.
# Test binaries find farmemd and friends through the FARMEM_BIN_DIR environment variable.

# ctest -j starts tests in descending COST. Without timings of its own (a fresh clone has no
# Testing/Temporary/CTestCostData.txt) it would start the longest ones last, in declaration order,
# and the stage would end with one of them running alone on two cores (far_stress_test started
# 52nd of 59 in a fresh CI run). These are the longest, with their seconds in a release build
# (docs/testing.md); once ctest has timed a test, its own figures take over.
set(kFarmemLongTestCost
  far_stress_test 160 far_containers_test 90 page_store_test 40 daemon_admission_test 22
  far_ptr_test 15 client_cluster_test 15 far_parity_offload_test 15 far_list_queue_test 15
  nbd_stalled_client_test 12 daemon_regression_test 10)
# Not built or run under ASan+UBSan (FARMEM_SANITIZE; -DFARMEM_ASAN_ALL_TESTS=ON builds them all;
# ctest lists them as "Not Run (Disabled)", their targets are left out of `all`):
# tests whose subject is timing (failure detection, SIGSTOP, lease expiry, DNS re-resolve, drain
# deadlines), start-up refusals, or the long far_ptr workloads. Every one of them runs in the
# release build; the code they reach with bytes from the network or the disk (frame and NBD
# parsers, the page store's data path, the object heap, the codec, the handshake) runs under ASan
# in the tests that are kept (page_store_test, page_store_eviction_test, nbd_*, daemon_*,
# client_cluster_test, far_ptr_test, the fuzz replays...). docs/testing.md has the list and why.
set(kFarmemNotUnderAsan
  far_stress_test far_containers_test startup_options_test nbd_export_capacity_test
  nbd_descheduled_client_test page_store_false_down_test far_false_down_test
  far_peers_dns_join_test lease_expired_while_up_test far_gray_failure_test far_evict_notice_test
  drain_two_clients_test)
option(FARMEM_ASAN_ALL_TESTS "Under FARMEM_SANITIZE, also build the tests kFarmemNotUnderAsan leaves out" OFF)
# The test files themselves at -O1 in an optimized tree: what they test (the libraries and
# programs) stays at the build type's -O2, but GoogleTest's assertion macros make -O2 code
# generation of a test file expensive (tests/common/wire_test.cc: 10.1 CPU s at -O2, 6.9 at -O1;
# the default tree's ~90 test files took ~500 of its ~930 CPU s: docs/testing.md). Debug trees
# (ASan) keep their -O0. The shared precompiled header gets the same flag (GCC rejects a PCH
# built with other optimization options).
function(farmem_test_optimization target)
  target_compile_options(${target} PRIVATE $<$<CONFIG:RelWithDebInfo,Release,MinSizeRel>:-O1>)
endfunction()

# farmem_test_timeout(<name> <seconds>): a farmem_add_test test's TIMEOUT changed after it was
# added; the binary learns it too (tests/support/hang_dump.cc prints its stacks at 85% of it).
function(farmem_test_timeout name seconds)
  set_tests_properties(${name} PROPERTIES TIMEOUT ${seconds})
  set_property(TEST ${name} APPEND PROPERTY ENVIRONMENT "FARMEM_TEST_TIMEOUT_S=${seconds}")
endfunction()

function(farmem_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock
    farmem_every_test)
  farmem_test_optimization(${T_NAME})
  if(TARGET farmem_test_pch)  # FARMEM_PCH (tests/CMakeLists.txt)
    target_precompile_headers(${T_NAME} REUSE_FROM farmem_test_pch)
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "FARMEM_BIN_DIR=${CMAKE_BINARY_DIR}/bin;FARMEM_SOURCE_DIR=${CMAKE_SOURCE_DIR};FARMEM_TEST_TIMEOUT_S=${T_TIMEOUT}")
  if(FARMEM_SANITIZE AND NOT FARMEM_ASAN_ALL_TESTS AND T_NAME IN_LIST kFarmemNotUnderAsan)
    set_target_properties(${T_NAME} PROPERTIES EXCLUDE_FROM_ALL TRUE)
    set_tests_properties(${T_NAME} PROPERTIES DISABLED TRUE)
  endif()
  list(FIND kFarmemLongTestCost ${T_NAME} i)
  if(i GREATER_EQUAL 0)
    math(EXPR i "${i} + 1")
    list(GET kFarmemLongTestCost ${i} cost)
    set_tests_properties(${T_NAME} PROPERTIES COST ${cost})
  endif()
endfunction()
