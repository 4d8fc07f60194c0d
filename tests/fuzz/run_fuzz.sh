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
# The targets build side by side (one clang process each); a failed build fails the run.
build() { "$CXX" "${flags[@]}" "$@"; }
pids=()
build "$src/tests/fuzz/fuzz_safetensors.cpp" "${common[@]}" "$src/src/io/safetensors.cpp" \
  -lfmt -o "$work/fuzz_safetensors" & pids+=($!)
build "$src/tests/fuzz/fuzz_json_configs.cpp" "${common[@]}" "$src/src/model/model_config.cpp" \
  "$src/src/lora/peft_config.cpp" -lfmt -lpcre2-8 -o "$work/fuzz_json_configs" & pids+=($!)
# Client input and model output: request bodies, the tokenizers and chat templates, the tool-call
# parsers.
core=("$src/src/core/status.cpp" "$src/src/core/dtype.cpp" "$src/src/core/tensor.cpp" "$src/src/core/log.cpp")
build "$src/tests/fuzz/fuzz_tokenizer.cpp" "${core[@]}" "$src/src/io/mapped_file.cpp" \
  "$src/src/io/json_util.cpp" "$src"/src/tokenizer/*.cpp -DSPDLOG_FMT_EXTERNAL -DSPDLOG_SHARED_LIB -DSPDLOG_COMPILED_LIB \
  -lspdlog -lfmt -lpcre2-8 -o "$work/fuzz_tokenizer" & pids+=($!)
build "$src/tests/fuzz/fuzz_tool_calls.cpp" "${common[@]}" "$src/src/server/api_error.cpp" \
  "$src/src/server/tool_calls.cpp" -lfmt -o "$work/fuzz_tool_calls" & pids+=($!)
build "$src/tests/fuzz/fuzz_openai_requests.cpp" "${common[@]}" "$src/src/server/api_error.cpp" \
  "$src/src/server/openai_protocol.cpp" -lfmt -o "$work/fuzz_openai_requests" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
# Seed corpora: real files from the fixtures (small ones) plus a few hand-made edge cases.
mkdir -p "$work/corpus_st" "$work/corpus_json"
find "$src/tests/fixtures" -name 'adapter_model.safetensors' -size -200k -exec cp {} "$work/corpus_st/" \; 2>/dev/null || true
i=0; for f in $(find "$src/tests/fixtures" -name '*.json' | head -40); do cp "$f" "$work/corpus_json/seed$i.json"; i=$((i+1)); done
printf '\x02\x00\x00\x00\x00\x00\x00\x00{}' > "$work/corpus_st/empty_header"
mkdir -p "$work/corpus_text" "$work/corpus_tools" "$work/corpus_api"
printf '{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"1"}],"max_tokens":5,"n":2,"stop":["a"],"logprobs":true,"top_logprobs":3,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"temperature":0.5,"logit_bias":{"5":-100},"stream":true,"stream_options":{"include_usage":true}}' > "$work/corpus_api/chat"
printf '{"model":"m","prompt":["a",[1,2,3]],"max_tokens":3,"n":1,"echo":true,"bad_words":["x"],"seed":1,"top_p":0.9,"min_tokens":1,"repetition_penalty":1.1}' > "$work/corpus_api/completion"
printf '\x00\x00Hello, world! héllo 中文 😀\nsecond line <|im_start|>' > "$work/corpus_text/seed0"
printf '\x00\x07Ok <tool_call>\n{"name": "f", "arguments": {"a": [1, "x"]}}\n</tool_call> tail' > "$work/corpus_tools/hermes"
printf '\x01\x05hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' > "$work/corpus_tools/deepseek"
printf '\x02\x03[TOOL_CALLS] [{"name": "g", "arguments": {}}, {"name": "h", "arguments": {"q": "v"}}]' > "$work/corpus_tools/mistral"
# The tokenizers: the bundled Qwen3 one, and the test packages' Llama-2 (SentencePiece) and
# DeepSeek-V3 ones where scripts/install-deps.sh --with-test-packages put them.
tok_dirs="$src/models/tiny-qwen3moe"
for pkg in llama2 deepseek_v3; do
  d="$src/tests/js/node_modules/@lenml/tokenizer-$pkg/models"
  [ -f "$d/tokenizer.json" ] && tok_dirs="$tok_dirs:$d"
done
# The real chat templates as seeds of the template mode (first byte 0xff).
for d in ${tok_dirs//:/ }; do
  python3 - "$d/tokenizer_config.json" "$work/corpus_text/tpl_$(basename "$(dirname "$d")")_$(basename "$d")" <<'PY' || true
import json, sys
t = json.load(open(sys.argv[1])).get("chat_template")
if isinstance(t, str):
    open(sys.argv[2], "wb").write(b"\xff\x01" + t.encode())
PY
done
"$work/fuzz_safetensors" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 "$work/corpus_st"
"$work/fuzz_json_configs" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 "$work/corpus_json"
FUZZ_TOKENIZER_DIRS="$tok_dirs" "$work/fuzz_tokenizer" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=4096 \
  -print_final_stats=1 "$work/corpus_text"
"$work/fuzz_openai_requests" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=8192 -print_final_stats=1 "$work/corpus_api"
"$work/fuzz_tool_calls" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 "$work/corpus_tools"
echo "fuzzing finished without findings"
