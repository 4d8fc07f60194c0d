#!/usr/bin/env bash
# The main job: installs what is missing, builds what serving needs (the `moelora` executable
# only: no test, no CUDA op suite), and runs it with the given arguments (default: serve the tiny
# model that ships in the repository, with its two adapters).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MOELORA_BUILD_DIR:-$root/build}
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOELORA_CUDA="${MOELORA_CUDA:-AUTO}" >/dev/null
cmake --build "$build" --target moelora -j "$(nproc)"
# Without arguments: serve the bundled model; HTTP adapter loading is confined to the repository's
# test fixtures (the README's example loads one of them).
if [ $# -eq 0 ]; then set -- serve --lora-root "$root/tests/fixtures"; fi
exec "$build/tools/moelora" "$@"
