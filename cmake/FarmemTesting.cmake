# farmem_add_test(NAME <name> SOURCES <files...> LIBS <targets...> LABELS <unit|integration|vm...>
#                 [TIMEOUT <seconds>])
# Builds one GoogleTest executable and registers it with ctest under the given labels.
# Test binaries find farmemd and friends through the FARMEM_BIN_DIR environment variable.
function(farmem_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "FARMEM_BIN_DIR=${CMAKE_BINARY_DIR}/bin;FARMEM_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
endfunction()
