#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs `moelora` with the given arguments
# (default: serve the tiny model that ships in the repository, with its two adapters).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
if [ $# -eq 0 ]; then set -- serve; fi
exec "${MOELORA_BUILD_DIR:-$root/build}/tools/moelora" "$@"
