#!/usr/bin/env bash
# Here (no GPU): puts the CUDA build and the Debian shared libraries it links into the git-ignored
# .device/, then packs them (xz) into the git-ignored .device-pack/device.tar.xz, which the device
# tool carries to the H200 (carry [".device-pack"]; device_run.sh unpacks it): the binaries alone
# are ~80 MB, over what one call may carry beside the ~44 MB checkout, packed ~9 MB. Arguments
# name the binaries to pack (default: all of .device/; the libraries always go). Build first with
# ./scripts/build.sh on a machine with nvcc (MOELORA_CUDA=AUTO builds the CUDA backend there).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MOELORA_BUILD_DIR:-$root/build}
mkdir -p "$root/.device/lib"
for lib in libfmt.so.9 libspdlog.so.1.10 libpcre2-8.so.0 libssl.so.3 libcrypto.so.3 libz.so.1; do
  [ -e "/lib/x86_64-linux-gnu/$lib" ] && cp -L "/lib/x86_64-linux-gnu/$lib" "$root/.device/lib/"
done
strip --strip-debug "$build/tools/moelora" -o "$root/.device/moelora"
strip --strip-debug "$build/tests/ops/moelora_op_suite" -o "$root/.device/moelora_op_suite"
# The workbenches that were built (dev/*.cu: dev_moe_bench, dev_moe_block, dev_attention_block, ...).
for w in "$build"/dev/dev_*; do
  [ -x "$w" ] && strip --strip-debug "$w" -o "$root/.device/$(basename "$w")"
done
mkdir -p "$root/.device-pack"
names=${*:-$(cd "$root/.device" && ls -p | grep -v /)}
# -9e: the 64 MiB dictionary spans binaries that share most of their kernels, so a second build of
# a workbench beside the first (an A/B) adds ~0.1 MB instead of ~8 (2026-12-07: 5 binaries 9.4 MB).
tar -C "$root/.device" -cf - lib $names | xz -T0 -9e > "$root/.device-pack/device.tar.xz"
ls -la "$root/.device-pack" | awk '{print $5, $9}'; echo "packed: lib $names"
