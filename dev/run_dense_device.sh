#!/bin/bash
# One device call for the dense / LoRA / attention / sampling kernels: op suite, compute-sanitizer
# (memcheck + racecheck on the reduced "Sanitize*" list) and the three workbenches.
# Usage (on the GPU machine, repo root): bash dev/run_dense_device.sh <bin dir> <out dir>
# The binaries are built on the dev machine and carried: <bin dir>/op_suite_c1 (or set SUITE, e.g.
# SUITE=build-c1/tests/ops/moelora_op_suite; the filters below select the dense families only),
# <bin dir>/dev_{dense_gemm,lora_dense,attention}, and <bin dir>/lib/libfmt.so.9 (the machine has
# none of our Debian packages).
B=${1:-build-c1/run}
O=${2:-$OUT}
export LD_LIBRARY_PATH=$PWD/$B/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
SUITE=${SUITE:-$B/op_suite_c1}
T=/tmp/c1logs
mkdir -p $T
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; } > $O/gpu.txt 2>&1
# Families in separate processes: a sticky CUDA error in one cannot hide the others' results.
FAMS="Device*:DenseFp8Decode* Elt/* Dense/* Lora/* Attn/* Sample*:SampleDistribution*"
SAN="SanitizeElt/*:DenseFp8Decode* SanitizeDense/* SanitizeLora/* SanitizeAttn/* SanitizeSample/*"
i=0
for f in $FAMS; do
  (timeout 150 $SUITE --gtest_filter="$f" > $T/ops_$i.log 2>&1; echo "[rc=$? filter=$f]" >> $T/ops_$i.log) &
  i=$((i + 1))
done
i=0
for f in $SAN; do
  (timeout 150 $CS --tool memcheck --error-exitcode 7 $SUITE --gtest_filter="$f" > $T/mem_$i.log 2>&1
   echo "[rc=$? filter=$f]" >> $T/mem_$i.log) &
  i=$((i + 1))
done
wait
i=0
for f in $SAN; do
  (timeout 120 $CS --tool racecheck --error-exitcode 7 $SUITE --gtest_filter="$f" > $T/race_$i.log 2>&1
   echo "[rc=$? filter=$f]" >> $T/race_$i.log) &
  i=$((i + 1))
done
wait
cat $T/ops_*.log > $O/ops.log
cat $T/mem_*.log > $O/memcheck.log
cat $T/race_*.log > $O/racecheck.log
for d in dense_gemm:90 lora_dense:120 attention:90; do
  timeout ${d#*:} $B/dev_${d%:*} > $O/${d%:*}.log 2>&1
  echo "[rc=$?]" >> $O/${d%:*}.log
done
echo "== summary"
grep -hE "^\[  (PASSED|FAILED) |\[rc=|tests ran" $O/ops.log
grep -hE "FAILED  \]" $O/ops.log | head -40
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|\[rc=" $O/memcheck.log $O/racecheck.log
grep -hE "^# check|MISSED|\[rc=" $O/dense_gemm.log $O/lora_dense.log $O/attention.log | head -60
