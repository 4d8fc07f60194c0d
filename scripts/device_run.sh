#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, with .device-pack/ carried (made here by
# scripts/device_prepare.sh). Runs the stages named as arguments (default: all), logging to $OUT
# (QUICK=1: the bench stage skips its rank-64 and Mixtral points):
#   ops      the op suite (every CUDA kernel vs the CPU reference)
#   shapes   verify on the fixtures at other model shapes (tests/fixtures-shapes.tar.xz), CPU and
#            CUDA (three modes, MLA both forms); REGEN=1 makes them again first (needs
#            .devpack/make_fixtures.py, the team's generator) and sends the archive back
#   verify   moelora verify on every public fixture: graphs + overlap, eager, overlap off
#   bench    moelora bench (decode steps with sampling, prefill) with JSON records
#   serve    moelora serve --backend cuda on the bundled model, driven over HTTP
#   sanitize compute-sanitizer memcheck over the sampling op tests and one verify
#   moe      the MoE workbench (checks, FP8 regime x tile sweep, prefill) and an ncu profile of
#            the grouped GEMMs at 256 tokens in both regimes
#   wgmma    the Hopper grouped GEMM (TMA + wgmma) against the CPU and mma.sync, both timed per
#            tile and batch, prefill; an ncu profile of it at 256 tokens
#   split    the wgmma MoE op-suite cases and `dev_moe_bench split` (e4m3 x e4m3 wgmmas: W8A16 with
#            split-form activations, W8A8) against the CPU and the other kernels, timed
#   moeops   the MoE op-suite cases only (every kernel of the MoE layer vs the CPU reference)
#   attnblock the attention block (issue 11): the dense LoRA epilogue, attention and head-pass op
#            cases (the small-M GEMM beside its LoRA shrink), sanitizers on the beside cases,
#            `dev_attention_block` (Qwen3 with --ab; JSON records), verify (graphs)
#            (its 2026-12-07 run also timed a split merge inside the decode kernel, `dev_attention
#            merged`, since removed: slower everywhere, bench/RESULTS.md)
#   attnquick the decode step at 1 and 8 tokens with and without --no-dense-lora-beside-gemm, and
#            ncu of the Qwen3 block (1 token, 8 adapters) and the DeepSeek MLA block (1 token)
#   attnstep the decode step on the defaults, and with 8 adapters --no-dense-lora-beside-gemm
#   attnprof every kernel of the attention block, base and 8 adapters, 1 and 64 tokens (ncu);
#            DeepSeek-V3's MLA block at one token
#   loraprof every kernel of one MoE layer with and without 8 LoRA adapters at 1 and 64 tokens (ncu
#            durations, kernels alone): where issue 10's LoRA tax goes
#   unrun, unrunstep, unrunmoe (one call each: together they overrun one call's 10 minutes; unrun
#            = op cases, sanitizers, dev_attention prefill; unrunstep = verify and the decode step
#            with the new flags; unrunmoe = the dense LoRA and MoE workbenches)
#            first run of what the 2026-12-05 tenth session wrote without a GPU: the op cases of the
#            down LoRA expand in moe_reduce, NVFP4 on the wgmma GEMM, the penalty slots and the dense
#            LoRA epilogue, then `dev_lora_dense ingemm`, verify and the decode step with
#            `--dense-lora-in-gemm`, `dev_moe_bench lora` and `nvfp4` (checked bit for bit / vs the
#            CPU, timed); from the eleventh session the wgmma prefill attention (op cases, memcheck,
#            racecheck, dev_attention's prefill rows), the decode split combine (every attention
#            op case: it is on the default path) and the KV write in the rotation pass (op
#            cases, the decode step with --kv-write-in-head-pass)
#   direct   per-pair MoE LoRA items vs moe_align's groups: the MoE LoRA op cases, sanitizers on the
#            per-pair cases, `dev_moe_bench direct`
#   loradefault the MoE LoRA op cases, `dev_moe_bench direct`, the decode step (0 and 8 adapters)
#            and verify on choose_moe_tuning's LoRA defaults of 2026-12-06
#   firstrun the decode step on the LoRA defaults (and with 8 adapters --no-moe-lora-beside-gemm),
#            moeblock's workbench, verify (graphs; and with --no-moe-lora-beside-gemm), in one call
#            (its run of 2026-12-07 forced the shrinks beside the GEMMs at every batch instead, with the
#            flag --moe-lora-beside-gemm of that day: bench/logs/2026-12-07-h100-firstrun-*)
#   beside   the MoE LoRA shrinks beside the expert GEMMs (one stream, the GEMMs waiting for them only
#            before their epilogues): MoE LoRA op cases, sanitizers, `dev_moe_bench beside`, verify
#            eager with it; the DeepSeek fixtures with --shared-experts-concurrent
#   beside2  the decode step and verify on the beside default, the placement op cases, dev_moe_block
#            DeepSeek-V3 with and without the routed LoRA's side stream (the concurrent rows' bits)
#   moeblock the whole MoE block (router, top-k, routed and shared experts, LoRA) as the forward pass
#            runs it, `dev_moe_block` at Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 shapes, 0 and 8
#            adapters (JSON records to $out/moe_block_records.jsonl), DeepSeek's shared experts after
#            and beside the routed ones; verify on the DeepSeek fixtures with them beside
#   lora     `dev_moe_bench lora`: the LoRA expands inside the base kernels (gate_up in the GEMM's
#            epilogue, down in moe_reduce) vs their own kernels, bit for bit, then timed with 1 and 8
#            adapters (run `moeops lora` for the op cases too)
#   nvfp4    NVFP4 experts on the 4-bit GEMMs (mma.sync and wgmma): their op-suite cases,
#            `dev_moe_bench nvfp4` (CPU checks, per-tile times of both kernels vs the 4-bit floor and
#            the FP8 layer) and `bench` of the
#            NVFP4 Qwen3-30B-A3B config against the FP8 one (decode step, 1 and 64 tokens)
#   moefull  the whole MoE workbench (every table of bench/RESULTS.md's MoE section)
#   sampler  the sampling op tests and the sampler workbench (cluster size x rows x logits)
#   samplerprof ncu's source-level profile of the sampling kernel (PROF_ROWS x PROF_CLUSTER, default
#            256 x 2): the hottest source lines by stall samples and instructions
#   attn     the attention op tests, memcheck and racecheck on their sanitize cases, the attention
#            workbench (decode kernels x batch x context, prefill)
#   nvfp4refs the float64 Hugging Face references of the NVFP4 fixtures (python3 with torch,
#            transformers 5.17, peft 0.21: the H200 machine has them), archived to
#            $OUT/nvfp4_fixtures.tar to be committed; run it before verify so that verify covers
#            the NVFP4 checkpoints
# SERVE_CONC (default "1 16 64 256") lists the concurrencies of the random-weight serving runs.
set -uo pipefail
# The binaries travel packed (scripts/device_prepare.sh); unpack them where the stages look.
if [ -f .device-pack/device.tar.xz ]; then mkdir -p .device && tar -xJf .device-pack/device.tar.xz -C .device; fi
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp}
bin=./.device/moelora
stages=${*:-ops verify bench serve}
# The op suite (or the cases FILTER selects) as three gtest shards side by side, each logging in
# full to $out/PREFIX_shard<i>.log: the CPU references dominate its time.
run_sharded() {
  local filter=$1 prefix=$2 limit=$3 pids="" i p
  for i in 0 1 2; do
    GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$i timeout $limit ./.device/moelora_op_suite --gtest_filter="$filter" \
      > $out/${prefix}_shard$i.log 2>&1 &
    pids="$pids $!"
  done
  for p in $pids; do wait $p; echo "shard exit $?"; done
  grep -hE "^\[==========\] .* ran|^\[  PASSED|^\[  FAILED" $out/${prefix}_shard*.log | head -40
}
# memcheck, then racecheck, over the op-suite cases FILTER selects, each logging to
# $out/<tool>_NAME.log (exit 3 on a finding), each under LIMIT seconds.
run_sanitizers() {
  local filter=$1 name=$2 limit=$3 tool
  for tool in memcheck racecheck; do
    timeout $limit compute-sanitizer --tool $tool --error-exitcode 3 ./.device/moelora_op_suite --gtest_filter="$filter" \
      > $out/${tool}_$name.log 2>&1; echo "$tool $name exit $?"; tail -2 $out/${tool}_$name.log
  done
}
# moelora bench at Qwen3-30B-A3B shapes on CUDA (r 16, 10 iterations): LIMIT LOG BATCHES ADAPTERS
# [flags...]; output in $out/LOG.log, records in $out/LOG.jsonl, the table printed.
step_bench() {
  local limit=$1 log=$2 batches=$3 adapters=$4
  shift 4
  timeout $limit $bin bench --config bench/configs/qwen3-30b-a3b-fp8.json --backend cuda --batch $batches \
    --adapters $adapters --rank 16 --iters 10 --json $out/$log.jsonl "$@" > $out/$log.log 2>&1; echo "exit $?"
  grep -v "^\[" $out/$log.log | tail -12
}
# ncu durations of every kernel of one replayed dev_attention_block step: MODEL TOKENS ADAPTERS,
# per block (the step's layers), from $out/ncu_attention_block_MODEL_T<T>_a<N>.csv.
ncu_attention_block() {
  local log=$out/ncu_attention_block_$1_T$2_a$3.csv L
  timeout 150 ncu --profile-from-start off --print-units base \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --csv ./.device/dev_attention_block $1 --profile $2 $3 > $log 2>&1; echo "ncu $1 T=$2 adapters=$3 exit $?"
  grep "^profiled" $log
  L=$(grep -o "([0-9]* layers)" $log | grep -o "[0-9]*")
  python3 scripts/ncu_durations.py "$log" --by-name ${L:-1}
}
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
for stage in $stages; do
  case $stage in
  nvfp4refs)
    echo "== NVFP4 fixture references"
    timeout 240 python3 scripts/make_nvfp4_fixtures.py references tests/fixtures > $out/nvfp4_refs.log 2>&1
    echo "exit $?"; tail -4 $out/nvfp4_refs.log
    # One archive (the device tool brings back a limited number of files per call).
    tar -cf $out/nvfp4_fixtures.tar tests/fixtures/*/cases.json tests/fixtures/*/expected-nvfp4.safetensors
    tar -tf $out/nvfp4_fixtures.tar ;;
  shapes)
    # Fixtures at shapes the public ones lack, then verify on them: CPU (the spec) and CUDA in its
    # three modes, MLA in both forms. They are committed as tests/fixtures-shapes.tar.xz; REGEN=1
    # makes them again (scripts/make_shape_fixtures.py: the team's generator, carried as
    # .devpack/make_fixtures.py, with other model shapes; NVFP4 from them) and sends the archive
    # back in 15 MB parts ($OUT/fixtures_shapes.tar.xz.part*: the device tool's file limit).
    rm -rf tests/fixtures-shapes
    if [ "${REGEN:-0}" = 1 ] || [ ! -f tests/fixtures-shapes.tar.xz ]; then
      echo "== shape fixtures"
      timeout 300 python3 scripts/make_shape_fixtures.py .devpack/make_fixtures.py tests/fixtures-shapes \
        > $out/shape_fixtures.log 2>&1; echo "exit $?"; tail -3 $out/shape_fixtures.log
      python3 scripts/make_nvfp4_fixtures.py quantize tests/fixtures-shapes >> $out/shape_fixtures.log 2>&1
      timeout 200 python3 scripts/make_nvfp4_fixtures.py references tests/fixtures-shapes >> $out/shape_fixtures.log 2>&1
      echo "nvfp4 exit $?"; tail -3 $out/shape_fixtures.log
      tar -cf - tests/fixtures-shapes | xz -6 -T0 | split -b 15M - $out/fixtures_shapes.tar.xz.part
    else
      tar -xJf tests/fixtures-shapes.tar.xz
    fi
    timeout 200 $bin verify --fixtures tests/fixtures-shapes --backend cpu > $out/verify_shapes_cpu.log 2>&1
    echo "cpu exit $?"; grep "all cases" $out/verify_shapes_cpu.log; tail -1 $out/verify_shapes_cpu.log
    for mode in "" "--no-graphs" "--no-overlap" "--mla decompressed"; do
      log=$out/verify_shapes_cuda${mode//[- ]/_}.log
      echo "== verify shapes cuda $mode"
      timeout 150 $bin verify --fixtures tests/fixtures-shapes --backend cuda $mode > $log 2>&1; echo "exit $?"
      grep "all cases" $log; tail -1 $log
    done ;;
  ops)
    # 576 cases in 205 s this way on 2026-12-05 (one process overran 300 s).
    echo "== op suite (3 shards)"
    run_sharded '*' op_suite 450 ;;
  verify)
    for mode in "" "--no-graphs" "--no-overlap"; do
      log=$out/verify_cuda${mode//-/_}.log
      echo "== verify cuda $mode"
      timeout 150 $bin verify --fixtures tests/fixtures --backend cuda $mode > $log 2>&1; echo "exit $?"
      grep "all cases" $log; tail -1 $log
    done ;;
  bench)
    echo "== bench"
    rec=$out/bench_records.jsonl
    cfg=bench/configs/qwen3-30b-a3b-fp8.json
    (
      timeout 240 $bin bench --config $cfg --backend cuda --batch 1,8,64,128,256 --adapters 0,8 --rank 16 --iters 10 --json $rec
      [ "${QUICK:-0}" = 1 ] || timeout 90 $bin bench --config $cfg --backend cuda --batch 1,64 --adapters 0,8 --rank 64 --iters 8 --json $rec
      timeout 90 $bin bench --config $cfg --backend cuda --batch 64 --adapters 0,8 --iters 3 --prefill 512 --json $rec
      [ "${QUICK:-0}" = 1 ] || timeout 90 $bin bench --config bench/configs/mixtral-8x7b-fp8.json --backend cuda --batch 1,64 --adapters 0,8 --iters 6 --json $rec
    ) > $out/bench.log 2>&1
    grep -v "^\[" $out/bench.log ;;
  serve)
    echo "== serve --backend cuda (bundled model)"
    m=models/tiny-qwen3moe
    $bin serve --backend cuda --port 8123 --model $m --lora attn-r8=$m/adapters/attn-r8 --lora full-r16=$m/adapters/full-r16 \
      > $out/serve.log 2>&1 &
    pid=$!
    for i in $(seq 1 120); do curl -sf localhost:8123/health >/dev/null && break; sleep 0.5; done
    curl -s localhost:8123/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "full-r16", "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 1, "logprobs": 2}'; echo
    timeout 120 $bin bench-serving --port 8123 -n 256 --max-concurrency 64 --input-len 32 --output-len 32 --include-base 2>&1 | tail -12
    kill -TERM $pid; wait $pid; echo "serve exit $?"
    grep -E "memory:|engine:" $out/serve.log | head -5
    echo "== serve --random-weights (Qwen3-30B-A3B shapes, 8 random adapters r16) + bench-serving"
    $bin serve --backend cuda --port 8124 --random-weights --config bench/configs/qwen3-30b-a3b-fp8.json \
      --random-adapters 8 --random-adapter-rank 16 --max-lora-rank 16 --max-num-seqs 256 --max-model-len 2048 \
      > $out/serve_random.log 2>&1 &
    pid=$!
    for i in $(seq 1 240); do curl -sf localhost:8124/health >/dev/null && break; sleep 0.5; done
    for c in ${SERVE_CONC:-1 16 64 256}; do
      for ad in 0 8; do
        if [ $ad = 0 ]; then sel="--include-base --adapters 0"; else sel="--adapters 8"; fi
        echo "-- concurrency $c adapters $ad"
        timeout 90 $bin bench-serving --port 8124 -n $((c * 4 > 32 ? c * 4 : 32)) --max-concurrency $c --input-len 128 \
          --output-len 64 $sel --json $out/serving_c${c}_a${ad}.json 2>&1 | grep -E "throughput|TTFT|ITL|failed" | head -6
      done
    done
    kill -TERM $pid; wait $pid; echo "serve exit $?"
    grep -E "memory:|engine:|random" $out/serve_random.log | head -5 ;;
  moe)
    echo "== MoE workbench (regimes)"
    timeout 300 ./.device/dev_moe_bench regimes > $out/moe_bench_regimes.log 2>&1; echo "exit $?"
    grep -v "^T=" $out/moe_bench_regimes.log
    if command -v ncu >/dev/null; then
      for a8 in 0 1; do
        timeout 120 ncu -k regex:moe_gemm_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section Occupancy --section LaunchStats ./.device/dev_moe_bench profile 256 1 $a8 \
          > $out/ncu_moe_T256_tile16_act8_$a8.log 2>&1; echo "ncu act8=$a8 exit $?"
        grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Executed Ipc A|Issue Slots Busy|Achieved Occupancy|Registers Per|No Eligible" \
          $out/ncu_moe_T256_tile16_act8_$a8.log | head -24
      done
    fi ;;
  sampler)
    echo "== sampling op tests"
    timeout 200 ./.device/moelora_op_suite --gtest_brief=1 --gtest_filter='*Sample*' > $out/op_suite_sampling.log 2>&1; echo "exit $?"
    grep -E "FAILED|PASSED|Failure" $out/op_suite_sampling.log | head -20; tail -3 $out/op_suite_sampling.log
    echo "== sampler workbench"
    timeout 240 ./.device/dev_sampling > $out/sampling_bench.log 2>&1; echo "exit $?"
    cat $out/sampling_bench.log ;;
  samplerprof)
    # Where the sampler's time goes, per source line: ncu's full set on one launch (256 rows on
    # clusters of 2, the engine's 256-token pick), its source page as CSV, the hottest lines by warp
    # stall samples and by instructions executed (scripts/ncu_source_top.py).
    echo "== sampler source profile"
    timeout 200 ncu -k regex:sample_kernel --launch-skip 2 --launch-count 1 --set full --import-source yes \
      -f -o /tmp/sampler_prof ./.device/dev_sampling profile ${PROF_ROWS:-256} ${PROF_CLUSTER:-2} > $out/ncu_sampler_full.log 2>&1
    echo "exit $?"; tail -2 $out/ncu_sampler_full.log
    ncu -i /tmp/sampler_prof.ncu-rep --page source --csv --print-source cuda > /tmp/sampler_src_cuda.csv 2>&1
    echo "source page exit $?"
    ncu -i /tmp/sampler_prof.ncu-rep --page details > $out/ncu_sampler_details.txt 2>&1
    python3 scripts/ncu_source_top.py /tmp/sampler_src_cuda.csv > $out/ncu_sampler_source_top.txt 2>&1
    echo "top lines exit $?"; head -60 $out/ncu_sampler_source_top.txt ;;
  attn)
    echo "== attention op tests"
    timeout 200 ./.device/moelora_op_suite --gtest_brief=1 --gtest_filter='*Attn*:*Attention*' > $out/op_suite_attn.log 2>&1
    echo "exit $?"; grep -E "FAILED|PASSED|Failure" $out/op_suite_attn.log | head -20; tail -3 $out/op_suite_attn.log
    run_sanitizers 'SanitizeAttn*' attn 200
    echo "== attention workbench"
    timeout 300 ./.device/dev_attention > $out/attention_bench.log 2>&1; echo "exit $?"
    cat $out/attention_bench.log ;;
  wgmma)
    echo "== MoE workbench (wgmma)"
    timeout 300 ./.device/dev_moe_bench wgmma > $out/moe_bench_wgmma.log 2>&1; echo "exit $?"
    grep -v "^T=" $out/moe_bench_wgmma.log
    if command -v ncu >/dev/null; then
      for tl in ${NCU_TILES:-2}; do
        timeout 120 ncu -k regex:moe_gemm_wgmma_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
          ./.device/dev_moe_bench profile 256 $tl 0 1 > $out/ncu_wgmma_T256_tile$tl.log 2>&1; echo "ncu tile=$tl exit $?"
        grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Stall|Shared Memory Configuration Size" \
          $out/ncu_wgmma_T256_tile$tl.log | head -24
      done
    fi ;;
  loraprof)
    # Where the MoE LoRA tax goes (issue 10: +112 % at 1 token, +56 % at 64 with 8 adapters): every
    # kernel of the layer's third launch, base and 8 adapters, at the heuristic's choices; ncu
    # serialises them, so each duration is the kernel alone (no side-stream overlap).
    for T in 1 64; do
      for ad in 0 8; do
        log=$out/ncu_moe_lora_T${T}_a${ad}.csv
        timeout 150 ncu --profile-from-start off --print-units base --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
          --csv ./.device/dev_moe_bench profile $T -1 -1 -1 $ad > $log 2>&1; echo "ncu T=$T adapters=$ad exit $?"
        python3 scripts/ncu_durations.py "$log" --last-part 3
      done
    done ;;
  attnblock)
    echo "== op suite: the dense LoRA epilogue (the GEMM beside its shrink), attention, head pass"
    run_sharded 'DenseLoraEpilogue*:Attn/*:HeadPass*:*ROPE_KV*' op_suite_attnblock 200
    run_sanitizers 'DenseLoraEpilogue*beside*' attnblock 120
    echo "== attention block workbench (Qwen3 also with the GEMMs waiting for their LoRA shrinks: same bits)"
    timeout 200 ./.device/dev_attention_block qwen3 --ab --json $out/attention_block_records.jsonl > $out/attention_block_qwen3.log 2>&1
    echo "exit $?"; cat $out/attention_block_qwen3.log
    timeout 150 ./.device/dev_attention_block mixtral deepseek --iters 10 --json $out/attention_block_records.jsonl > $out/attention_block_others.log 2>&1
    echo "exit $?"; grep -v "^#" $out/attention_block_others.log
    echo "== verify cuda (graphs)"
    timeout 120 $bin verify --fixtures tests/fixtures --backend cuda > $out/verify_cuda.log 2>&1
    echo "exit $?"; grep "all cases" $out/verify_cuda.log; tail -1 $out/verify_cuda.log ;;
  attnquick)
    # The short form of attnstep + attnprof for a call with little device time left.
    step_bench 90 bench_quick 1,8 0,8
    step_bench 90 bench_quick_not_beside 1,8 0,8 --no-dense-lora-beside-gemm
    ncu_attention_block qwen3 1 8
    ncu_attention_block deepseek 1 0 ;;
  mla)
    # The tensor-core absorbed MLA (issue 11, 2026-12-07 sixteenth session): its op cases (each
    # prints its worst row error), the RoPE and attention cases (shared helpers moved), sanitizers,
    # verify on the DeepSeek fixture in all three modes, then the block and its kernels (ncu).
    echo "== op suite: MLA, elementwise (RoPE), head pass, attention"
    run_sharded 'Mla/*:SanitizeMla/*:Elt/*ROPE*:HeadPass/*:Attn/*decode*' mla_ops 200
    grep -h "FAILED\|Failure" $out/mla_ops_shard*.log | head -20
    grep -h "^\[ MLA " $out/mla_ops_shard*.log | sort -k10 -g | tail -3
    run_sanitizers 'SanitizeMla/*' mla 90
    for mode in "" "--no-graphs" "--no-overlap"; do
      timeout 60 $bin verify --fixtures tests/fixtures/deepseekv3 --backend cuda $mode > $out/verify_deepseek${mode//-/_}.log 2>&1
      echo "verify deepseek $mode exit $?"; grep "all cases" $out/verify_deepseek${mode//-/_}.log; tail -1 $out/verify_deepseek${mode//-/_}.log
    done
    for model in deepseek mixtral; do
      timeout 120 ./.device/dev_attention_block $model --iters 20 --json $out/attention_block.jsonl > $out/attention_block_$model.log 2>&1
      echo "exit $?"; grep -v "^#" $out/attention_block_$model.log | tail -13
    done
    # A/B without a product flag: dev_attention_block_a, when packed, is another build of the tree
    # (what it is: the log of the call that packed it).
    if [ -x ./.device/dev_attention_block_a ]; then
      timeout 120 ./.device/dev_attention_block_a deepseek --iters 20 > $out/attention_block_deepseek_a.log 2>&1
      echo "A exit $?"; grep -v "^#" $out/attention_block_deepseek_a.log | tail -13
    fi
    for Ta in "1 0" "1 8" "64 0"; do ncu_attention_block deepseek $Ta; done ;;
  mlaprof)
    # DeepSeek-V3's absorbed MLA block per kernel (issue 11): 1, 64 and 256 tokens, and 8 adapters
    # at 1 token; the block's own timing first.
    timeout 120 ./.device/dev_attention_block deepseek --iters 20 > $out/attention_block_deepseek.log 2>&1
    echo "exit $?"; cat $out/attention_block_deepseek.log | tail -30
    for Ta in "1 0" "1 8" "64 0" "256 0"; do ncu_attention_block deepseek $Ta; done ;;
  attnstep)
    echo "== decode step (default, then 8 adapters with --no-dense-lora-beside-gemm)"
    step_bench 150 bench 1,8,64,256 0,8
    step_bench 100 bench_not_beside 1,8 8 --no-dense-lora-beside-gemm ;;
  attnprof)
    # Where the attention block's time goes (issue 11): every kernel of one replayed step of
    # dev_attention_block (L blocks), per block: Qwen3-30B-A3B base and 8 adapters at 1 and 64
    # tokens, DeepSeek-V3's MLA (absorbed) at one token.
    for T in 1 64; do
      for ad in 0 8; do ncu_attention_block qwen3 $T $ad; done
    done
    ncu_attention_block deepseek 1 0 ;;
  split)
    echo "== op suite, wgmma MoE cases (dequantising, split form, W8A8)"
    timeout 300 ./.device/moelora_op_suite --gtest_brief=1 --gtest_filter='Moe*wgmma*:MoeSanitize*' > $out/op_suite_split.log 2>&1
    echo "exit $?"; grep -E "FAILED|PASSED|Failure" $out/op_suite_split.log | head -30; tail -3 $out/op_suite_split.log
    echo "== MoE workbench (split)"
    timeout 300 ./.device/dev_moe_bench split > $out/moe_bench_split.log 2>&1; echo "exit $?"
    grep -v "^T=" $out/moe_bench_split.log ;;
  nvfp4)
    echo "== NVFP4 MoE: op suite, workbench, decode step"
    timeout 200 ./.device/moelora_op_suite --gtest_brief=1 --gtest_filter='Moe*nvfp4*:*Dense*nvfp4*:DenseNvfp4Decode.*' > $out/nvfp4_ops.log 2>&1
    echo "ops exit $?"; grep -E "FAILED|PASSED|Failure" $out/nvfp4_ops.log | head -30; tail -3 $out/nvfp4_ops.log
    timeout 300 ./.device/dev_moe_bench nvfp4 > $out/nvfp4_moe_bench.log 2>&1
    echo "moe_bench exit $?"; grep -v "^check.* ok$" $out/nvfp4_moe_bench.log
    rec=$out/bench_records.jsonl
    for cfg in bench/configs/qwen3-30b-a3b-nvfp4.json bench/configs/qwen3-30b-a3b-fp8.json; do
      timeout 150 $bin bench --config $cfg --backend cuda --batch 1,64 --adapters 0,8 --rank 16 --iters 8 --json $rec
    done > $out/nvfp4_bench.log 2>&1
    grep -v "^\[" $out/nvfp4_bench.log ;;
  direct)
    # Per-pair MoE LoRA items (MoeTuning::lora_direct) against moe_align's groups: the MoE LoRA op
    # cases (each eager one compares both forms bit for bit), memcheck and racecheck on the per-pair
    # sanitize cases, then `dev_moe_bench direct` (bit for bit, CPU, timed with 1 and 8 adapters).
    echo "== op suite, MoE LoRA cases"
    run_sharded 'Moe*LORA*' op_suite_moe_lora 200
    run_sanitizers 'MoeSanitize*lora_per_pair*' moe_lora_per_pair 100
    echo "== MoE workbench (LoRA per pair)"
    timeout 200 ./.device/dev_moe_bench direct > $out/moe_bench_direct.log 2>&1; echo "exit $?"
    grep -v "ok$" $out/moe_bench_direct.log ;;
  loradefault)
    # choose_moe_tuning's LoRA choices of 2026-12-06 (per-pair items up to 2 pairs per expert, the
    # down expand in moe_reduce from 1): the MoE LoRA op cases on the new defaults, `dev_moe_bench
    # direct` (its default columns), the decode step with 0 and 8 adapters, verify (graphs).
    echo "== op suite, MoE LoRA cases"
    run_sharded 'Moe*LORA*' op_suite_moe_lora 200
    echo "== MoE workbench (LoRA items)"
    timeout 200 ./.device/dev_moe_bench direct > $out/moe_bench_direct.log 2>&1; echo "exit $?"
    grep -v "ok$" $out/moe_bench_direct.log
    echo "== bench"
    timeout 200 $bin bench --config bench/configs/qwen3-30b-a3b-fp8.json --backend cuda --batch 1,8,64,256 \
      --adapters 0,8 --rank 16 --iters 10 --json $out/bench_records.jsonl > $out/bench.log 2>&1; echo "exit $?"
    tail -30 $out/bench.log
    echo "== verify cuda"
    timeout 150 $bin verify --fixtures tests/fixtures --backend cuda > $out/verify_cuda.log 2>&1; echo "exit $?"
    grep "all cases" $out/verify_cuda.log; tail -1 $out/verify_cuda.log ;;
  firstrun)
    # One call (under 10 minutes) for what the 2026-12-07 sessions wrote and what aa14457's defaults
    # still lacked, most needed first: the decode step on choose_moe_tuning's LoRA defaults (0 and 8
    # adapters; also issue 9's step / logits ratios), the MoE block workbench, verify (graphs), then
    # the decode step with 8 adapters and verify with the LoRA shrinks beside the expert GEMMs.
    echo "== bench"
    step_bench 170 bench 1,8,64,256 0,8
    echo "== MoE block workbench"
    timeout 200 ./.device/dev_moe_block --iters 10 --json $out/moe_block_records.jsonl > $out/moe_block.log 2>&1
    echo "exit $?"; cat $out/moe_block.log
    echo "== verify cuda (graphs)"
    timeout 90 $bin verify --fixtures tests/fixtures --backend cuda > $out/verify_cuda.log 2>&1; echo "exit $?"
    tail -1 $out/verify_cuda.log
    echo "== bench, 8 adapters, never the LoRA shrinks beside the expert GEMMs (--no-moe-lora-beside-gemm)"
    step_bench 100 bench_not_beside 1,8,64,256 8 --no-moe-lora-beside-gemm
    echo "== verify cuda --no-moe-lora-beside-gemm"
    timeout 90 $bin verify --fixtures tests/fixtures --backend cuda --no-moe-lora-beside-gemm > $out/verify_cuda_not_beside.log 2>&1
    echo "exit $?"; tail -1 $out/verify_cuda_not_beside.log ;;
  beside)
    # The MoE LoRA shrinks beside the grouped GEMMs (MoeTuning::lora_shrink_beside_gemm, 2026-12-07):
    # the MoE LoRA op cases (each eager one compares it bit for bit with the default placement),
    # memcheck and racecheck on its sanitize cases, `dev_moe_bench beside` (checks, timed), then
    # verify eager (the default takes it up to half a pair per expert) and the DeepSeek fixtures with
    # the shared experts beside the routed ones, and dev_moe_block's DeepSeek-V3 rows.
    echo "== op suite, MoE LoRA cases"
    run_sharded 'Moe*LORA*:CudaConcurrently*' op_suite_moe_lora_beside 200
    run_sanitizers 'MoeSanitize*lora_beside*' moe_lora_beside 70
    echo "== MoE workbench (LoRA beside the GEMMs)"
    timeout 150 ./.device/dev_moe_bench beside > $out/moe_bench_beside.log 2>&1; echo "exit $?"
    grep -v "ok$" $out/moe_bench_beside.log
    timeout 60 $bin verify --fixtures tests/fixtures --backend cuda --no-graphs \
      > $out/verify_cuda_beside_eager.log 2>&1; echo "exit $?"; tail -1 $out/verify_cuda_beside_eager.log
    timeout 45 $bin verify --fixtures tests/fixtures/deepseekv3 --backend cuda --shared-experts-concurrent \
      > $out/verify_shared_concurrent.log 2>&1; echo "exit $?"; tail -1 $out/verify_shared_concurrent.log
    echo "== MoE block workbench, DeepSeek-V3 (shared experts after and beside the routed ones)"
    timeout 120 ./.device/dev_moe_block --iters 10 --json $out/moe_block_records_deepseek.jsonl deepseek \
      > $out/moe_block_deepseek.log 2>&1; echo "exit $?"; cat $out/moe_block_deepseek.log ;;
  beside2)
    # After `beside` (2026-12-07): the decode step and verify on the new default (the LoRA shrinks
    # beside the expert GEMMs up to half a pair per expert), the MoE LoRA op cases that name a
    # placement, then dev_moe_block's DeepSeek-V3 rows with the routed LoRA on its side stream and
    # without it (whose shared-experts-concurrent rows differ from the serial ones, and where).
    echo "== bench"
    step_bench 170 bench 1,8,64,256 0,8
    echo "== verify cuda (graphs)"
    timeout 90 $bin verify --fixtures tests/fixtures --backend cuda > $out/verify_cuda.log 2>&1; echo "exit $?"
    tail -1 $out/verify_cuda.log
    echo "== op suite, MoE LoRA cases naming a placement"
    run_sharded 'Moe*LORA*lora_be*' op_suite_moe_lora_placement 100
    for flag in "" --no-overlap; do
      echo "== MoE block workbench, DeepSeek-V3 $flag"
      timeout 110 ./.device/dev_moe_block --iters 5 deepseek $flag > $out/moe_block_deepseek$flag.log 2>&1
      echo "exit $?"; grep -v "^#" $out/moe_block_deepseek$flag.log
    done ;;
  moeblock)
    echo "== MoE block workbench"
    timeout 400 ./.device/dev_moe_block --json $out/moe_block_records.jsonl > $out/moe_block.log 2>&1; echo "exit $?"
    cat $out/moe_block.log
    echo "== verify cuda, DeepSeek-V3 fixtures, shared experts concurrent (graphs, then eager)"
    for g in "" --no-graphs; do
      timeout 60 $bin verify --fixtures tests/fixtures/deepseekv3 --backend cuda --shared-experts-concurrent $g \
        > $out/verify_shared_concurrent$g.log 2>&1; echo "exit $?"; tail -1 $out/verify_shared_concurrent$g.log
    done ;;
  lora)
    echo "== MoE workbench (LoRA)"
    timeout 200 ./.device/dev_moe_bench lora > $out/moe_bench_lora.log 2>&1; echo "exit $?"
    grep -v "ok$" $out/moe_bench_lora.log ;;
  unrun)
    echo "== op suite: the code written without a GPU (down LoRA in moe_reduce, NVFP4 wgmma, penalty slots, wgmma prefill attention)"
    run_sharded 'Moe*LORA*:Moe*nvfp4*:MoeSanitize*:SamplePenaltySlots*:Sample/*edits*:DenseLoraEpilogue*:*Attn*:HeadPass*:*ROPE_KV*' op_suite_unrun 240
    echo "== wgmma prefill attention: memcheck and racecheck on its sanitize case, then the workbench's prefill rows"
    run_sanitizers 'SanitizeAttn*wgmma*' attn_wgmma 120
    timeout 200 ./.device/dev_attention prefill > $out/attention_prefill_wgmma.log 2>&1; echo "exit $?"
    sed -n '/# prefill/,$p' $out/attention_prefill_wgmma.log
    ;;
  unrunstep)
    for mode in "" "--no-graphs"; do  # the engine's step with it, end to end on the fixtures
      log=$out/verify_cuda_no_dense_lora_in_gemm${mode//-/_}.log
      echo "== verify cuda --no-dense-lora-in-gemm $mode"
      timeout 150 $bin verify --fixtures tests/fixtures --backend cuda --no-dense-lora-in-gemm $mode > $log 2>&1
      echo "exit $?"; grep "all cases" $log; tail -1 $log
    done
    echo "== verify cuda --no-kv-write-in-head-pass (the separate cache write)"
    timeout 150 $bin verify --fixtures tests/fixtures --backend cuda --no-kv-write-in-head-pass > $out/verify_cuda_kv_write.log 2>&1
    echo "exit $?"; grep "all cases" $out/verify_cuda_kv_write.log; tail -1 $out/verify_cuda_kv_write.log
    echo "== decode step with the defaults and without the dense LoRA in the GEMM / the KV write in the rotation launch"
    for flag in "" "--no-dense-lora-in-gemm" "--no-kv-write-in-head-pass"; do
      timeout 120 $bin bench --config bench/configs/qwen3-30b-a3b-fp8.json --backend cuda --batch 1,8 --adapters 0,8 \
        --rank 16 --iters 10 --json $out/bench_records_unrun.jsonl $flag 2>&1 | grep -v "^\["
    done ;;
  unrunmoe)
    echo "== dense LoRA inside the small-M GEMM vs GEMM + segmented kernel"
    timeout 120 ./.device/dev_lora_dense ingemm > $out/lora_dense_ingemm.log 2>&1; echo "exit $?"
    grep -v "^#" $out/lora_dense_ingemm.log
    echo "== MoE workbench (LoRA)"
    timeout 200 ./.device/dev_moe_bench lora > $out/moe_bench_lora.log 2>&1; echo "exit $?"
    grep -v "ok$" $out/moe_bench_lora.log
    echo "== MoE workbench (NVFP4)"
    timeout 300 ./.device/dev_moe_bench nvfp4 > $out/nvfp4_moe_bench.log 2>&1; echo "exit $?"
    grep -v "^check.* ok$" $out/nvfp4_moe_bench.log ;;
  moeops)
    echo "== op suite, MoE cases (3 shards: 200 cases in 128 s on 2026-12-05)"
    run_sharded 'Moe*' op_suite_moe 240 ;;
  moefull)
    echo "== MoE workbench (full)"
    timeout 500 ./.device/dev_moe_bench > $out/moe_bench.log 2>&1; echo "exit $?"
    grep -v "^T=" $out/moe_bench.log ;;
  sanitize)
    echo "== compute-sanitizer"
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 ./.device/moelora_op_suite --gtest_filter='*Sample*' \
      > $out/sanitizer_sampling.log 2>&1; echo "memcheck sampling exit $?"; tail -2 $out/sanitizer_sampling.log
    timeout 240 compute-sanitizer --tool racecheck --error-exitcode 3 ./.device/moelora_op_suite --gtest_filter='SanitizeSample*' \
      > $out/racecheck_sampling.log 2>&1; echo "racecheck sampling exit $?"; tail -2 $out/racecheck_sampling.log
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 $bin verify --fixtures tests/fixtures/qwen3moe --backend cuda \
      > $out/sanitizer_verify.log 2>&1; echo "memcheck verify exit $?"; tail -2 $out/sanitizer_verify.log ;;
  esac
done
