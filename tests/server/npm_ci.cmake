# Installs the e2e tests' pinned client (tests/e2e/package-lock.json) unless it is already there.
if(EXISTS ${DIR}/node_modules/openai/package.json)
  message(STATUS "tests/e2e: node_modules present")
  return()
endif()
execute_process(COMMAND ${NPM} ci --no-audit --no-fund WORKING_DIRECTORY ${DIR} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "npm ci failed in ${DIR} (rc ${rc})")
endif()
