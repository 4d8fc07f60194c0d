#!/usr/bin/env bash
# Every test: installs what is missing (apt + the tests' npm packages), builds, runs CTest.
# GPU tests (label gpu) skip without a CUDA device; see tests/ops/records/ for the H200 runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh" --with-test-packages
"$root/scripts/build.sh"
cd "${MOELORA_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$(nproc)" --timeout 1800 "$@"
