# What `cmake --install` puts where, and the Debian package (cpack -G DEB) made of it:
#   sbin/farmemd, sbin/farmem-nbd, bin/farmemctl           (install() next to each program)
#   lib/systemd/system/farmemd{,@}.service, farmem-nbd.{service,socket}   (ExecStart= = this prefix)
#   share/man/man8/farmemd.8, farmem-nbd.8, man1/farmemctl.1   (help2man, cmake/FarmemManPages.cmake)
#   include/farmem/...  lib/libfarmem_{farptr,spanstore,client,transport,ec,common}.a
#   lib/cmake/farmem/   find_package(farmem) -> farmem::farptr, farmem::client, ...
#   lib/pkgconfig/farmem.pc
# Included at the end of the top-level CMakeLists.txt, after every target exists.
# docs/operations.md ("Install") says how to use it; tests/package checks all of it.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

# Relative to the install prefix (systemd reads both /usr/lib/systemd/system and
# /usr/local/lib/systemd/system), or absolute.
set(FARMEM_INSTALL_UNITDIR "lib/systemd/system" CACHE STRING "Where systemd units are installed")
set(FARMEM_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/farmem")

# ---- libraries, headers, the CMake package and farmem.pc ----
set(farmem_installed_libs farmem_common farmem_ec farmem_transport farmem_client farmem_spanstore
    farmem_farptr)
foreach(lib ${farmem_installed_libs})
  string(REGEX REPLACE "^farmem_" "" short "${lib}")
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${short})
endforeach()
set_target_properties(farmem_version PROPERTIES EXPORT_NAME version)
install(TARGETS ${farmem_installed_libs} farmem_version EXPORT farmemTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(dir common ec transport client spanstore farptr)
  # command_line.h (CLI11) and service_notify.h (sd_notify) serve the programs, not library users.
  install(DIRECTORY ${CMAKE_SOURCE_DIR}/${dir}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
    PATTERN command_line.h EXCLUDE PATTERN service_notify.h EXCLUDE)
endforeach()
install(FILES ${FARMEM_GENERATED_INCLUDE_DIR}/farmem/common/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/farmem/common)
install(EXPORT farmemTargets NAMESPACE farmem:: DESTINATION ${FARMEM_INSTALL_CMAKEDIR})

# Private dependencies of the static libraries, which a program linking them needs too:
# <prefix of the PkgConfig:: target>=<pkg-config module>.
set(FARMEM_PC_IMPORTS CRYPTO=libcrypto ISAL=libisal)
set(FARMEM_PC_REQUIRES "fmt spdlog libcrypto libisal")
if(FARMEM_WITH_VERBS)
  list(APPEND FARMEM_PC_IMPORTS IBVERBS=libibverbs RDMACM=librdmacm)
  string(APPEND FARMEM_PC_REQUIRES " libibverbs librdmacm")
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/farmemConfig.cmake.in
  ${CMAKE_BINARY_DIR}/package/farmemConfig.cmake INSTALL_DESTINATION ${FARMEM_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/package/farmemConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/package/farmemConfig.cmake
  ${CMAKE_BINARY_DIR}/package/farmemConfigVersion.cmake DESTINATION ${FARMEM_INSTALL_CMAKEDIR})

# farmem.pc finds its prefix from where it lies (${pcfiledir}), so it is right for any
# `cmake --install --prefix` and for the .deb alike.
file(RELATIVE_PATH pc_to_prefix /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
string(REGEX REPLACE "/$" "" pc_to_prefix "${pc_to_prefix}")
set(PC_PREFIX "\${pcfiledir}/${pc_to_prefix}")
set(PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
set(PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/farmem.pc.in ${CMAKE_BINARY_DIR}/package/farmem.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/package/farmem.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# ---- systemd units: ExecStart= is filled in at install time, for the prefix installed to ----
install(CODE "
  set(FARMEM_UNIT_SOURCE_DIR \"${CMAKE_SOURCE_DIR}/deploy/systemd\")
  set(FARMEM_UNIT_WORK_DIR \"${CMAKE_BINARY_DIR}/package/systemd\")
  set(FARMEM_INSTALL_SBINDIR \"${CMAKE_INSTALL_SBINDIR}\")
  set(FARMEM_INSTALL_BINDIR \"${CMAKE_INSTALL_BINDIR}\")
  set(FARMEM_INSTALL_UNITDIR \"${FARMEM_INSTALL_UNITDIR}\")
  include(\"${CMAKE_CURRENT_LIST_DIR}/FarmemInstallUnits.cmake\")
")

# ---- man pages ----
include(${CMAKE_CURRENT_LIST_DIR}/FarmemManPages.cmake)

# ---- the Debian package: cpack -G DEB in the build directory -> farmem_<version>_<arch>.deb ----
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME farmem)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "farmem")
set(CPACK_PACKAGE_CONTACT "farmem developers <dev@farmem>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "far memory: lend idle DRAM (farmemd), swap to it (farmem-nbd), far_ptr<T> for C++")
string(CONCAT CPACK_PACKAGE_DESCRIPTION
    "farmemd lends slabs of a machine's idle memory over TCP and RDMA; farmem-nbd serves a block "
    "device (swap) kept on farmemd daemons with replication or erasure coding; farmemctl inspects "
    "a cluster. Also the C++23 libraries (far_ptr<T>, the cluster client) with their CMake package "
    "and farmem.pc.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # farmem_0.1.0_amd64.deb
set(CPACK_DEBIAN_PACKAGE_SECTION admin)
set(CPACK_STRIP_FILES ON)  # debug info stays in the build tree
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)  # Depends: from the programs' shared libraries
# Building against the static libraries needs their dependencies' headers and .pc files.
set(CPACK_DEBIAN_PACKAGE_SUGGESTS
    "libfmt-dev, libspdlog-dev, libssl-dev, libisal-dev, libipsec-mb-dev, libibverbs-dev, librdmacm-dev, nbd-client")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA ${CMAKE_SOURCE_DIR}/deploy/debian/postinst
    ${CMAKE_SOURCE_DIR}/deploy/debian/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
