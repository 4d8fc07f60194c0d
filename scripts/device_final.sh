#!/usr/bin/env bash
# The GPU engine end to end on the H200 (device tool; see docs/gpu.md): verify in three modes,
# compute-sanitizer over one verify, and `moelora serve --backend cuda` driven over HTTP.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp}
bin=./.device/moelora
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for mode in "" "--no-graphs" "--no-overlap"; do
  log=$out/verify_cuda${mode//-/_}.log
  echo "== moelora verify --fixtures tests/fixtures --backend cuda $mode"
  timeout 120 $bin verify --fixtures tests/fixtures --backend cuda $mode > $log 2>&1; echo "exit $?"
  grep "all cases" $log; tail -1 $log
done
echo "== compute-sanitizer memcheck: verify qwen3moe (graphs + overlap)"
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 $bin verify --fixtures tests/fixtures/qwen3moe --backend cuda \
  > $out/sanitizer_verify.log 2>&1; echo "exit $?"; tail -3 $out/sanitizer_verify.log
echo "== serve --backend cuda"
$bin serve --backend cuda --port 8123 > $out/serve.log 2>&1 &
pid=$!
for i in $(seq 1 60); do curl -s localhost:8123/health >/dev/null && break; sleep 0.5; done
curl -s localhost:8123/v1/completions -H 'Content-Type: application/json' \
  -d '{"model": "full-r16", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'; echo
curl -s localhost:8123/v1/load_lora_adapter -H 'Content-Type: application/json' \
  -d '{"lora_name": "legal", "lora_path": "'$PWD'/tests/fixtures/qwen3moe/adapters/pattern"}'; echo
curl -sN localhost:8123/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "legal", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": true}' | tail -3
timeout 120 $bin bench-serving --port 8123 -n 256 --max-concurrency 64 --input-len 32 --output-len 32 --include-base 2>&1 | tail -12
curl -s localhost:8123/metrics | grep -E "^vllm:(num_requests_running|generation_tokens_total|kv_cache_usage_perc)|^moelora_" | head
kill -TERM $pid; wait $pid; echo "serve exit $?"
