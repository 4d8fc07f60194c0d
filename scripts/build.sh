#!/usr/bin/env bash
# Configures and builds moelora into build/ (CUDA backend too where nvcc exists: MOELORA_CUDA=AUTO).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MOELORA_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOELORA_CUDA="${MOELORA_CUDA:-AUTO}" >/dev/null
cmake --build "$build" -j "$(nproc)"
