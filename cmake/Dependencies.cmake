# Every dependency comes from Debian 12 packages (scripts/install-deps.sh installs them).
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.11 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
# Boost.Beast/Asio for the HTTP server (header-only): Debian 12's libboost1.81-dev.
find_package(Boost 1.81 REQUIRED)
if(MOELORA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
find_package(benchmark QUIET)
