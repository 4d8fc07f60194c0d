#!/usr/bin/env bash
# Everything the GPU machine runs in one call (device tool; see docs/gpu.md), from the repo root,
# with .device/ carrying the CUDA build and the Debian shared libraries it links:
#   1. the op suite (every CUDA kernel vs the CPU reference), 2. verify on every public fixture in
#   three modes, 3. moelora bench on full-size shapes. Logs go to $OUT.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp}
bin=./.device/moelora
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
if [ "${SKIP_OPS:-0}" != 1 ]; then
  echo "== op suite"; timeout 240 ./.device/moelora_op_suite --gtest_brief=1 > $out/op_suite.log 2>&1; tail -4 $out/op_suite.log
fi
for mode in "" "--no-graphs" "--no-overlap"; do
  echo "== verify cuda $mode"; timeout 120 $bin verify --fixtures tests/fixtures --backend cuda $mode > $out/verify_cuda${mode//-/_}.log 2>&1
  grep "all cases" $out/verify_cuda${mode//-/_}.log; tail -1 $out/verify_cuda${mode//-/_}.log
done
echo "== bench"
(
timeout 150 $bin bench --config bench/configs/qwen3-30b-a3b-fp8.json --backend cuda --batch 1,8,64,128,256 --adapters 0,1,8,32 --rank 16 --iters 8 --prefill 0
timeout 60 $bin bench --config bench/configs/qwen3-30b-a3b-fp8.json --backend cuda --batch 1,64 --adapters 0,8 --rank 64 --iters 8
timeout 60 $bin bench --config bench/configs/qwen3-30b-a3b-fp8.json --backend cuda --no-graphs --batch 1,64 --adapters 0,8 --iters 5 --prefill 512
timeout 60 $bin bench --config bench/configs/mixtral-8x7b-fp8.json --backend cuda --batch 1,64 --adapters 0,8 --iters 5
timeout 60 $bin bench --config bench/configs/qwen3-235b-a22b-fp8.json --layers 8 --backend cuda --batch 1,64 --adapters 0,8 --iters 5
) > $out/bench.log 2>&1
cat $out/bench.log | grep -v "^\[" 
