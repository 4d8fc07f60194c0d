# Registered in place of the e2e suites when CMake found no node/npm: a missing runtime fails
# loudly instead of the suites silently not existing.
message(FATAL_ERROR "tests/e2e needs node and npm (Debian 12: apt-get install nodejs npm, or ./scripts/install-deps.sh), "
                    "then re-run cmake")
