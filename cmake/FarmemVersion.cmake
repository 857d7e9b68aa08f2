# farmem::version — the generated header farmem/common/version.h (kVersion, kVersionString), kept
# up to date with `git describe` at every build (cmake/FarmemVersionHeader.cmake). Programs use it
# for --version through cli::AddVersionFlag (command_line.h); it is installed with the headers.
include_guard(GLOBAL)

set(FARMEM_GENERATED_INCLUDE_DIR ${CMAKE_BINARY_DIR}/generated/include)
set(farmem_version_header ${FARMEM_GENERATED_INCLUDE_DIR}/farmem/common/version.h)
file(MAKE_DIRECTORY ${FARMEM_GENERATED_INCLUDE_DIR}/farmem/common)
set(farmem_version_cmd ${CMAKE_COMMAND} -DSOURCE_DIR=${CMAKE_SOURCE_DIR}
    -DOUTPUT=${farmem_version_header} -DPROJECT_VERSION=${PROJECT_VERSION}
    -P ${CMAKE_CURRENT_LIST_DIR}/FarmemVersionHeader.cmake)
# Once at configure time too, so that the header exists for tools reading compile_commands.json.
execute_process(COMMAND ${farmem_version_cmd})
add_custom_target(farmem_version_header
  COMMAND ${farmem_version_cmd}
  BYPRODUCTS ${farmem_version_header}
  COMMENT "farmem version: git describe"
  VERBATIM)
add_library(farmem_version INTERFACE)
add_library(farmem::version ALIAS farmem_version)
target_include_directories(farmem_version INTERFACE
  $<BUILD_INTERFACE:${FARMEM_GENERATED_INCLUDE_DIR}> $<INSTALL_INTERFACE:include>)
add_dependencies(farmem_version farmem_version_header)
