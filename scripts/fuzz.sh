#!/bin/sh
# Bounded libFuzzer runs, one per target (tests/fuzz/fuzz.cmake), FUZZ_SECONDS each
# (default 120), from seed corpora: the server's request parser, chat templates and text
# stream (fuzz_openai, seeds below); flex attention's expressions and preset specs
# (fuzz_flex) and the model files: Hugging Face config.json, tokenizer.json and
# safetensors (fuzz_model_files); GGUF files (fuzz_gguf); seeds in tests/fuzz/corpus/, depth and size seeds
# among them (nesting 20,000 deep, 60,000 unary operators, 40 KB arrays). The whole
# library is built with clang, the fuzzer's coverage and ASan+UBSan. Exits non-zero on a
# crash, a sanitizer report, a stack overflow or a broken invariant; the input that did
# it is left as crash-* (or timeout-*, leak-*) in the current folder.
#   sh scripts/fuzz.sh [BUILD_DIR]
#   FUZZ_TARGETS="fuzz_flex" FUZZ_SECONDS=600 FUZZ_SEED=0 sh scripts/fuzz.sh    one target, longer, new mutations
set -eu
build=${1:-build-fuzz}
seconds=${FUZZ_SECONDS:-120}
# A fixed seed (FUZZ_SEED, default 1): the same mutations every run, so that CI's
# verdict on a tree is the one a developer gets from the same command; FUZZ_SEED=0
# lets libFuzzer pick one (for the long runs that look for new findings).
seed=${FUZZ_SEED:-1}
targets=${FUZZ_TARGETS:-fuzz_openai fuzz_flex fuzz_model_files fuzz_gguf}
src=$(pwd)
if ! command -v clang >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev >/dev/null
  else
    echo "fuzz: clang is missing (run: sudo apt-get install clang libclang-rt-14-dev)" >&2
    exit 1
  fi
fi
CC=clang cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DKILN_FUZZ=ON >/dev/null
# shellcheck disable=SC2086
cmake --build "$build" --target $targets -j "$(nproc)" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# fuzz_openai's seeds: the first byte picks the mode (0 completions, 1 chat, 2 template, 3 stream).
mkdir -p "$work/fuzz_openai"
c="$work/fuzz_openai"
printf '\000{"prompt":"hi","max_tokens":5,"stop":["a"],"n":2,"seed":1,"logprobs":2}' >"$c/c1"
printf '\000{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}' >"$c/c2"
printf '\001{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"top_logprobs":1,"logprobs":true}' >"$c/c3"
printf '\002{"message":"{role}: {content}\\n","generation":"assistant:","stop":["\\nuser:"]}' >"$c/c4"
printf '\003|caf\303|\251 \342\202|\254 \nus|er: x' >"$c/c5"
cp -r "$src/tests/fuzz/corpus/flex" "$work/fuzz_flex"
cp -r "$src/tests/fuzz/corpus/model_files" "$work/fuzz_model_files"
cp -r "$src/tests/fuzz/corpus/gguf" "$work/fuzz_gguf"
for t in $targets; do
  echo "fuzz: $t for $seconds s"
  # -rss_limit_mb: a parser that allocates without bound is a finding, not a slow run
  "$build/$t" -seed="$seed" -max_total_time="$seconds" -max_len=131072 -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
    "$work/$t" >"$work/$t.log" 2>&1 || {
    tail -40 "$work/$t.log"
    echo "fuzz: $t found a failure (its input is the crash-*, timeout-* or oom-* file here)" >&2
    exit 1
  }
  grep -E "^(Done|stat::number_of_executed_units)" "$work/$t.log" | head -2
done
