# farmem_clang_expected_flags(<out-var>)
# Sets <out-var> to the compile flags this clang needs to use std::expected from libstdc++, or to
# "NOTFOUND" when it cannot. common/ uses std::expected. libstdc++ 12 enables <expected> only when
# __cpp_concepts >= 202002L (P0848R3, conditionally trivial special members). clang 16-18
# implement P0848R3 but still report 201907L; clang 14/15 lack it. Probe: first as is, then with
# the macro raised; the static_asserts check that the triviality rules P0848R3 brings really hold.
# Used by the fuzz targets (tests/fuzz) and the thread-safety build (FARMEM_THREAD_SAFETY).
include_guard(GLOBAL)
include(CheckCXXSourceCompiles)

function(farmem_clang_expected_flags out)
  set(probe [=[
#include <expected>
#include <string>
#include <type_traits>
static_assert(std::is_trivially_destructible_v<std::expected<int, int>>);
static_assert(std::is_trivially_copy_constructible_v<std::expected<int, int>>);
static_assert(!std::is_trivially_destructible_v<std::expected<int, std::string>>);
static_assert(!std::is_trivially_copy_constructible_v<std::expected<int, std::string>>);
int main() {
  std::expected<int, std::string> e = std::unexpected<std::string>(std::string(64, 'x'));
  auto c = e;
  c = 1;
  return *c - 1;
}
]=])
  set(override -Wno-builtin-macro-redefined -U__cpp_concepts -D__cpp_concepts=202002L)
  check_cxx_source_compiles("${probe}" FARMEM_CLANG_HAS_EXPECTED)
  if(FARMEM_CLANG_HAS_EXPECTED)
    set(${out} "" PARENT_SCOPE)
    return()
  endif()
  list(JOIN override " " CMAKE_REQUIRED_FLAGS)
  check_cxx_source_compiles("${probe}" FARMEM_CLANG_HAS_EXPECTED_WITH_OVERRIDE)
  if(FARMEM_CLANG_HAS_EXPECTED_WITH_OVERRIDE)
    set(${out} ${override} PARENT_SCOPE)
  else()
    set(${out} NOTFOUND PARENT_SCOPE)
  endif()
endfunction()
