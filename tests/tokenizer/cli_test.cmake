# `moelora tokenize` on the bundled demo tokenizer (models/tiny-qwen3moe: one id per byte, in
# GPT-2's symbol order, so "h" = 0x68 - 0x21 = 71). Run by CTest:
#   cmake -DMOELORA=<moelora binary> -DSOURCE_DIR=<source tree> -P cli_test.cmake
set(dir "${SOURCE_DIR}/models/tiny-qwen3moe")
set(scratch "${CMAKE_CURRENT_BINARY_DIR}/tokenizer_cli")
file(MAKE_DIRECTORY "${scratch}")

# expected_output is the exact stdout, or with a trailing REGEX argument a regular expression.
function(run_case name args input expected_output expected_code)
  file(WRITE "${scratch}/${name}.in" "${input}")
  execute_process(COMMAND ${MOELORA} --log-level error tokenize --tokenizer "${dir}" ${args}
                  INPUT_FILE "${scratch}/${name}.in" OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE code)
  if(NOT code EQUAL expected_code)
    message(FATAL_ERROR "${name}: exit code ${code}, expected ${expected_code}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
  if(ARGN STREQUAL "REGEX")
    set(matched FALSE)
    if(out MATCHES "${expected_output}")
      set(matched TRUE)
    endif()
  elseif(out STREQUAL expected_output)
    set(matched TRUE)
  else()
    set(matched FALSE)
  endif()
  if(NOT matched)
    message(FATAL_ERROR "${name}: unexpected output\n--- got:\n${out}\n--- expected:\n${expected_output}")
  endif()
  message(STATUS "${name}: ok")
endfunction()

run_case(strings "" "\"hi\"\n\"\"\n\"é\"\n" "{\"ids\":[71,72]}\n{\"ids\":[]}\n{\"ids\":[127,102]}\n" 0)
run_case(chat "--chat"
  "[{\"role\": \"user\", \"content\": \"Hi\"}]\n"
  "{\"text\":\"<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n\",\"ids\":[27,91,72,76,62,82,83,64,81,83,91,29,84,82,68,81,198,39,72,27,91,72,76,62,68,77,67,91,29,198,27,91,72,76,62,82,83,64,81,83,91,29,64,82,82,72,82,83,64,77,83,198]}\n"
  0)
run_case(chat_object "--chat"
  "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"U\"}], \"add_generation_prompt\": false}\n"
  "{\"text\":\"<|im_start|>system\\nS<|im_end|>\\n<|im_start|>user\\nU<|im_end|>\\n\",\"ids\":[27,91,72,76,62,82,83,64,81,83,91,29,82,88,82,83,68,76,198,50,27,91,72,76,62,68,77,67,91,29,198,27,91,72,76,62,82,83,64,81,83,91,29,84,82,68,81,198,52,27,91,72,76,62,68,77,67,91,29,198]}\n"
  0)
run_case(decode "--decode" "[71, 72]\n[127, 102]\n[127]\n" "{\"text\":\"hi\"}\n{\"text\":\"é\"}\n{\"text\":\"�\"}\n" 0)
# Not JSON, not a string, a lone surrogate (which JSON cannot carry as UTF-8): an error line each,
# the next line still served, exit code 1.
run_case(bad_lines ""
  "not json\n{\"text\": 1}\n\"\\ud800\"\n\"ok\"\n"
  "^{\"error\":\"the line is not valid JSON: [^\n]*\"}\n{\"error\":\"expected a JSON string \\(use --chat for message lists\\)\"}\n{\"error\":\"the line is not valid JSON: [^\n]*surrogate[^\n]*\"}\n{\"ids\":\\[78,74\\]}\n$"
  1 REGEX)
run_case(bad_ids "--decode" "[1, 999]\n[\"x\"]\n" "{\"error\":\"token id 999 (at position 1) is not in the vocabulary of 256 ids\"}\n{\"error\":\"token ids must be integers, got \\\"x\\\"\"}\n" 1)
