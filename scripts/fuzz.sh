#!/bin/sh
# A bounded libFuzzer run over the server's request parser, chat templates and text
# stream (tests/fuzz/fuzz_openai.c): FUZZ_SECONDS (default 120) of fuzzing from a small
# seed corpus. Exits non-zero on a crash, a sanitizer report or a broken invariant.
#   sh scripts/fuzz.sh [BUILD_DIR]
set -eu
build=${1:-build-fuzz}
seconds=${FUZZ_SECONDS:-120}
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
cmake --build "$build" --target fuzz_openai -j "$(nproc)" >/dev/null
corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
# Seeds: the first byte picks the mode (0 completions, 1 chat, 2 template, 3 stream).
printf '\000{"prompt":"hi","max_tokens":5,"stop":["a"],"n":2,"seed":1,"logprobs":2}' >"$corpus/c1"
printf '\000{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}' >"$corpus/c2"
printf '\001{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"top_logprobs":1,"logprobs":true}' >"$corpus/c3"
printf '\002{"message":"{role}: {content}\\n","generation":"assistant:","stop":["\\nuser:"]}' >"$corpus/c4"
printf '\003|caf\303|\251 \342\202|\254 \nus|er: x' >"$corpus/c5"
echo "fuzz: $seconds s over the request parser, chat templates and text stream"
"$build/fuzz_openai" -max_total_time="$seconds" -max_len=4096 -timeout=10 -print_final_stats=1 "$corpus" 2>&1 | tail -15
