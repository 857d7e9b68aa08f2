# One man page per installed program, generated from its --help at build time by help2man
# (cmake/FarmemManPage.cmake) and installed to share/man. tests/package/man_pages_test.sh checks
# that each page lists every option --help shows.
include_guard(GLOBAL)
option(FARMEM_MAN_PAGES "Generate and install the man pages (needs help2man)" ON)
if(NOT FARMEM_MAN_PAGES)
  return()
endif()
find_program(FARMEM_HELP2MAN help2man)
if(NOT FARMEM_HELP2MAN)
  message(FATAL_ERROR "help2man not found: apt-get install help2man (or run deploy/install-deps.sh), "
                      "or configure with -DFARMEM_MAN_PAGES=OFF")
endif()

# <target> <section> <one-line description>
set(farmem_man_pages
  "farmemd|8|lend this machine's idle memory to farmem clients over TCP and RDMA"
  "farmem-nbd|8|serve far memory on farmemd daemons as a block device over NBD"
  "farmemctl|1|inspect and exercise a farmem cluster")
set(FARMEM_MAN_PAGE_FILES "")
foreach(entry ${farmem_man_pages})
  string(REPLACE "|" ";" entry "${entry}")
  list(GET entry 0 program)
  list(GET entry 1 section)
  list(GET entry 2 description)
  set(page ${CMAKE_BINARY_DIR}/man/${program}.${section})
  add_custom_command(OUTPUT ${page}
    COMMAND ${CMAKE_COMMAND} -DHELP2MAN=${FARMEM_HELP2MAN} -DPROGRAM=$<TARGET_FILE:${program}>
            -DNAME=${program} -DSECTION=${section} -DDESCRIPTION=${description} -DOUTPUT=${page}
            -P ${CMAKE_CURRENT_LIST_DIR}/FarmemManPage.cmake
    DEPENDS ${program} ${CMAKE_CURRENT_LIST_DIR}/FarmemManPage.cmake
    COMMENT "man page ${program}(${section}) from --help"
    VERBATIM)
  install(FILES ${page} DESTINATION ${CMAKE_INSTALL_MANDIR}/man${section})
  list(APPEND FARMEM_MAN_PAGE_FILES ${page})
endforeach()
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/man)
add_custom_target(farmem_man_pages ALL DEPENDS ${FARMEM_MAN_PAGE_FILES})
