# Writes one man page from a program's --help and --version (help2man), at build time, so that
# the page always matches the options the program has. A program with subcommands (farmemctl)
# gets a SUBCOMMANDS section holding each subcommand's --help, found by walking the "Subcommands:"
# lists of the help texts (so a new subcommand needs no change here).
#   cmake -DHELP2MAN=<path> -DPROGRAM=<binary> -DNAME=<program name> -DSECTION=<1|8>
#         -DDESCRIPTION=<one line> -DOUTPUT=<page> -P FarmemManPage.cmake
foreach(var HELP2MAN PROGRAM NAME SECTION DESCRIPTION OUTPUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "FarmemManPage.cmake: -D${var}=... missing")
  endif()
endforeach()

# The subcommand names listed under "Subcommands:" in a CLI11 help text.
function(farmem_subcommands help out)
  set(names "")
  set(in_list FALSE)
  string(REPLACE "\n" ";" lines "${help}")
  foreach(line IN LISTS lines)
    if(line MATCHES "^Subcommands:")
      set(in_list TRUE)
    elseif(in_list AND line MATCHES "^  ([a-z][a-z0-9-]*)( |$)")
      list(APPEND names "${CMAKE_MATCH_1}")
    elseif(in_list AND NOT line MATCHES "^ ")
      set(in_list FALSE)
    endif()
  endforeach()
  set(${out} "${names}" PARENT_SCOPE)
endfunction()

function(farmem_roff_literal text out)
  string(REPLACE "\\" "\\e" text "${text}")
  string(REGEX REPLACE "(^|\n)([.'])" "\\1\\\\&\\2" text "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

execute_process(COMMAND ${PROGRAM} --help OUTPUT_VARIABLE help RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} --help failed (${rc})")
endif()
farmem_subcommands("${help}" queue)
set(include_text "")
while(queue)
  list(POP_FRONT queue path)  # "stat", or "export;stat" spelled "export stat"
  string(REPLACE " " ";" args "${path}")
  execute_process(COMMAND ${PROGRAM} ${args} --help OUTPUT_VARIABLE sub_help RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${PROGRAM} ${path} --help failed (${rc})")
  endif()
  string(REPLACE "${PROGRAM}" "${NAME}" sub_help "${sub_help}")  # CLI11 prints argv[0]
  farmem_roff_literal("${sub_help}" literal)
  string(APPEND include_text ".SS \"${NAME} ${path}\"\n.nf\n${literal}\n.fi\n")
  farmem_subcommands("${sub_help}" nested)
  foreach(n IN LISTS nested)
    list(APPEND queue "${path} ${n}")
  endforeach()
endwhile()

set(extra "")
if(NOT include_text STREQUAL "")
  get_filename_component(dir "${OUTPUT}" DIRECTORY)
  set(include_file "${dir}/${NAME}.h2m")
  file(WRITE "${include_file}" "[SUBCOMMANDS]\n${include_text}")
  set(extra --include "${include_file}")
endif()
execute_process(
  COMMAND ${HELP2MAN} --no-info --no-discard-stderr --section ${SECTION} --name "${DESCRIPTION}"
          ${extra} --output "${OUTPUT}" ${PROGRAM}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "help2man failed for ${PROGRAM} (${rc})")
endif()
