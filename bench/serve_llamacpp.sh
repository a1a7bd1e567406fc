#!/bin/sh
# kiln serve against llama.cpp's llama-server on the same weights, side by side in one
# run: a GPT-2 style model (a byte tokenizer, context 256; LAYERS x WIDTH, trained for
# one step: speed does not depend on the weights) served by kiln from its run folder and
# by llama-server from its `kiln export gguf` file, the same prompts (64 tokens), the
# same number of new tokens, greedy decoding with end-of-text ignored, the same threads.
# Each server at 1, 4 and 16 concurrent streaming clients (kiln's continuous batching
# against llama-server's parallel slots, -np 16), alternating over ROUNDS rounds:
# time to first token, per-stream decode tokens/s and total tokens/s, the medians,
# and kiln / llama.cpp for each.
#   LLAMA_SERVER=path/to/llama-server sh bench/serve_llamacpp.sh [BUILD_DIR] [ROUNDS] [TOKENS] [LAYERS] [WIDTH] [HEADS] [GGUF_TYPE]
# The defaults: 3 rounds, 64 tokens, 6 layers of width 384 (the demo's); KILN_WEIGHTS=bf16
# serves kiln's linear layers in bf16 (against GGUF_TYPE q8_0, say). llama-server is
# llama.cpp's own server (its source ships in llama-cpp-python's sdist on PyPI:
# `pip download --no-binary :all: --no-deps llama-cpp-python`, then in vendor/llama.cpp
# `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server`).
set -eu
build=${1:-build}
rounds=${2:-3}
tokens=${3:-64}
layers=${4:-6}
width=${5:-384}
heads=${6:-6}
gtype=${7:-f32}
threads=${THREADS:-2}
server=${LLAMA_SERVER:-llama-server}
command -v "$server" >/dev/null 2>&1 || [ -x "$server" ] || {
    echo "serve_llamacpp.sh: no llama-server ($server); set LLAMA_SERVER (see the comment at the top)" >&2
    exit 2
}
work=$(mktemp -d)
srv_kiln=
srv_lcpp=
trap 'kill $srv_kiln $srv_lcpp 2>/dev/null || true; rm -rf "$work"' EXIT
sh bench/serve_model.sh "$build" "$work/run" "$layers" "$width" "$heads" 1 1
"$build/kiln" export gguf "$work/run" "$work/model.gguf" --dtype "$gtype" >/dev/null
"$build/kiln" serve "$work/run" --port 0 --threads "$threads" --kv-memory 256 --weights "${KILN_WEIGHTS:-f32}" \
    2>"$work/kiln.log" &
srv_kiln=$!
lport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$server" -m "$work/model.gguf" --host 127.0.0.1 --port "$lport" -t "$threads" -tb "$threads" -np 16 \
    -c $((16 * 256)) -ngl 0 >"$work/lcpp.log" 2>&1 &
srv_lcpp=$!
for _ in $(seq 600); do grep -q ready "$work/kiln.log" && break; sleep 0.1; done
kport=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$work/kiln.log")
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$lport/health" >/dev/null 2>&1 && break; sleep 0.1; done
extra='{"temperature": 0, "ignore_eos": true}'
for r in $(seq "$rounds"); do
    for c in 1 4 16; do
        python3 bench/serve_client.py --port "$kport" --clients "$c" --tokens "$tokens" --peer kiln \
            --extra "$extra" | sed "s/^{/{\"round\": $r, /" | tee -a "$work/out.jsonl"
        python3 bench/serve_client.py --port "$lport" --clients "$c" --tokens "$tokens" --peer llama.cpp \
            --extra "$extra" | sed "s/^{/{\"round\": $r, /" | tee -a "$work/out.jsonl"
    done
done
python3 - "$work/out.jsonl" "$layers" "$width" "$gtype" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
import os
print(f"model: {sys.argv[2]} layers, width {sys.argv[3]}; kiln's weights {os.environ.get('KILN_WEIGHTS', 'f32')}, "
      f"llama.cpp's {sys.argv[4]}")
for c in (1, 4, 16):
    med = {}
    for peer in ("kiln", "llama.cpp"):
        rs = [r for r in rows if r["peer"] == peer and r["clients"] == c]
        med[peer] = {k: statistics.median(r[k] for r in rs) for k in ("ttft_ms", "decode_tok_s", "total_tok_s")}
        m = med[peer]
        print(f"{c:2d} clients {peer:9s}: ttft {m['ttft_ms']:7.1f} ms, decode {m['decode_tok_s']:7.1f} tok/s a stream, "
              f"total {m['total_tok_s']:7.1f} tok/s")
    k, l = med["kiln"], med["llama.cpp"]
    print(f"{c:2d} clients kiln / llama.cpp: decode {k['decode_tok_s'] / l['decode_tok_s']:.2f}, "
          f"total {k['total_tok_s'] / l['total_tok_s']:.2f}, time to first token {l['ttft_ms'] / k['ttft_ms']:.2f}")
PY
