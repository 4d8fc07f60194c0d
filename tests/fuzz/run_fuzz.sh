#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a bounded time.
# Usage: tests/fuzz/run_fuzz.sh SOURCE_DIR WORK_DIR SECONDS_PER_TARGET
set -euo pipefail
src=$1 work=$2 secs=${3:-30}
mkdir -p "$work"
CXX=${FUZZ_CXX:-clang++}
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I"$src/src")
common=("$src/src/core/status.cpp" "$src/src/core/dtype.cpp" "$src/src/core/tensor.cpp" "$src/src/io/mapped_file.cpp"
        "$src/src/io/json_util.cpp" "$src/src/ops/weight_format.cpp")
"$CXX" "${flags[@]}" "$src/tests/fuzz/fuzz_safetensors.cpp" "${common[@]}" "$src/src/io/safetensors.cpp" \
  -lfmt -o "$work/fuzz_safetensors"
"$CXX" "${flags[@]}" "$src/tests/fuzz/fuzz_json_configs.cpp" "${common[@]}" "$src/src/model/model_config.cpp" \
  "$src/src/lora/peft_config.cpp" -lfmt -lpcre2-8 -o "$work/fuzz_json_configs"
# Seed corpora: real files from the fixtures (small ones) plus a few hand-made edge cases.
mkdir -p "$work/corpus_st" "$work/corpus_json"
find "$src/tests/fixtures" -name 'adapter_model.safetensors' -size -200k -exec cp {} "$work/corpus_st/" \; 2>/dev/null || true
i=0; for f in $(find "$src/tests/fixtures" -name '*.json' | head -40); do cp "$f" "$work/corpus_json/seed$i.json"; i=$((i+1)); done
printf '\x02\x00\x00\x00\x00\x00\x00\x00{}' > "$work/corpus_st/empty_header"
"$work/fuzz_safetensors" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 "$work/corpus_st"
"$work/fuzz_json_configs" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 "$work/corpus_json"
echo "fuzzing finished without findings"
