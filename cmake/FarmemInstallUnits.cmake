# Installs deploy/systemd/*.in as systemd units whose ExecStart= names the installed binaries.
# Run by `cmake --install` / cpack (install(CODE) in cmake/FarmemInstall.cmake), so the paths are
# those of the prefix actually installed to (`cmake --install build --prefix /opt/farmem`, or /usr
# in the .deb), not the one configured. DESTDIR is honoured (file(INSTALL)).
# In: FARMEM_UNIT_SOURCE_DIR, FARMEM_UNIT_WORK_DIR, FARMEM_INSTALL_SBINDIR, FARMEM_INSTALL_BINDIR,
# FARMEM_INSTALL_UNITDIR
# (relative to the prefix, or absolute) and CMAKE_INSTALL_PREFIX (set by cmake --install).
foreach(var FARMEM_UNIT_SOURCE_DIR FARMEM_UNIT_WORK_DIR FARMEM_INSTALL_SBINDIR FARMEM_INSTALL_BINDIR
            FARMEM_INSTALL_UNITDIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "FarmemInstallUnits.cmake: ${var} is not set")
  endif()
endforeach()

if(IS_ABSOLUTE "${FARMEM_INSTALL_SBINDIR}")
  set(FARMEM_SBINDIR "${FARMEM_INSTALL_SBINDIR}")
else()
  set(FARMEM_SBINDIR "${CMAKE_INSTALL_PREFIX}/${FARMEM_INSTALL_SBINDIR}")
endif()
if(IS_ABSOLUTE "${FARMEM_INSTALL_BINDIR}")
  set(FARMEM_BINDIR "${FARMEM_INSTALL_BINDIR}")
else()
  set(FARMEM_BINDIR "${CMAKE_INSTALL_PREFIX}/${FARMEM_INSTALL_BINDIR}")
endif()
if(IS_ABSOLUTE "${FARMEM_INSTALL_UNITDIR}")
  set(unit_dir "${FARMEM_INSTALL_UNITDIR}")
else()
  set(unit_dir "${CMAKE_INSTALL_PREFIX}/${FARMEM_INSTALL_UNITDIR}")
endif()

file(GLOB templates "${FARMEM_UNIT_SOURCE_DIR}/*.in")
set(units "")
foreach(template ${templates})
  get_filename_component(name "${template}" NAME)
  string(REGEX REPLACE "\\.in$" "" name "${name}")
  configure_file("${template}" "${FARMEM_UNIT_WORK_DIR}/${name}" @ONLY)
  list(APPEND units "${FARMEM_UNIT_WORK_DIR}/${name}")
endforeach()
file(INSTALL DESTINATION "${unit_dir}" TYPE FILE PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
     FILES ${units})
