#!/usr/bin/env bash
# Installs what building and testing moelora needs on Debian 12 (apt; npm packages for the
# tokenizer and client tests). Safe to run again: it only installs what is missing. Runs as root
# without sudo (containers), or as a user with sudo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "moelora: install-deps.sh needs root or sudo to install packages" >&2
    exit 1
  fi
  SUDO="sudo"
fi

# libboost1.81-dev: Boost.Beast/Asio for the HTTP server (header-only). curl: the examples in
# docs/serving.md and the printed hints.
packages=(build-essential cmake ninja-build pkg-config git curl ca-certificates
          nlohmann-json3-dev libcli11-dev libboost1.81-dev libpcre2-dev libspdlog-dev libfmt-dev
          libgtest-dev libgmock-dev libbenchmark-dev clang libclang-rt-14-dev python3 python3-jinja2)
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "moelora: installing ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ "${1:-}" = "--with-test-packages" ]; then
  # Node projects of the tests (the real tokenizers and the official openai client).
  for d in tests/js tests/e2e; do
    if [ -f "$root/$d/package.json" ]; then
      (cd "$root/$d" && if [ -f package-lock.json ]; then npm ci --no-audit --no-fund --loglevel=error; \
                         else npm install --no-audit --no-fund --loglevel=error; fi)
    fi
  done
fi
