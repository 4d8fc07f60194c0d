#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repository root, with the CUDA build of moelora
# and the Debian shared libraries it needs carried in .device/ (see docs/gpu.md):
#   verify on every public fixture with the CUDA backend: graphs + overlap (default), eager,
#   and overlap off; then generate on the bundled model.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=${MOELORA_BIN:-./.device/moelora}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== verify cuda (graphs + overlap)"; $bin verify --fixtures tests/fixtures --backend cuda 2>&1 | tee $out/verify_cuda_graphs.log | tail -3
echo "== verify cuda (eager)"; $bin verify --fixtures tests/fixtures --backend cuda --no-graphs 2>&1 | tee $out/verify_cuda_eager.log | tail -3
echo "== verify cuda (no overlap)"; $bin verify --fixtures tests/fixtures --backend cuda --no-overlap 2>&1 | tee $out/verify_cuda_nooverlap.log | tail -3
echo "== generate cuda"; $bin generate --backend cuda --prompt-ids 1,2,3,4,5 --max-tokens 8 2>&1 | tee $out/generate_cuda.log | tail -4
