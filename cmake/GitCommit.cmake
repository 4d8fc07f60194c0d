# Run as a script at every build (tools/CMakeLists.txt): writes OUT, a header defining
# MOELORA_GIT_COMMIT (the short commit, "-dirty" when tracked files differ from it), and rewrites it
# only when that changed, so a build after a commit stamps the new commit and recompiles one file.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  set(commit "unknown")
elseif(dirty)
  string(APPEND commit "-dirty")
endif()
set(text "#pragma once\n#define MOELORA_GIT_COMMIT \"${commit}\"\n")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT old STREQUAL text)
  file(WRITE ${OUT} "${text}")
endif()
