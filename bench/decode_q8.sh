#!/bin/sh
# Decoding with q8_0 weights (issue 47 item 3): kiln's paged forward with its linear
# weights packed as f32, bf16 and q8_0 (bench_decode_q8), and llama.cpp
# (llama-cpp-python, bench/decode_q8_llamacpp.py) on the same model as kiln's Q8_0 GGUF
# file (kiln quantize --type q8_0), one stream and 16, ROUNDS rounds alternating kiln and
# llama.cpp, at THREADS threads; and the machine's read bandwidth (bench_stream_read)
# before and after. The default model: LLaMA-style, 20 layers of 1024, 16 heads (4
# key/value), byte vocabulary, context 64, trained one step (speed does not depend on
# the weights): 222M parameters, 888 MB in f32.
#   sh bench/decode_q8.sh [BUILD_DIR] [ROUNDS] [STEPS] [THREADS]   (MODEL=run folder to bring one)
# Needs build/venv with llama-cpp-python.
set -eu
build=${1:-build}
rounds=${2:-3}
steps=${3:-8}
threads=${4:-2}
py=$build/venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=${MODEL:-}
if [ -z "$model" ]; then
    model="$work/run"
    python3 -c "
import random
r = random.Random(3)
w = 'in the beginning god created heaven and earth was without form void darkness upon face of deep'.split()
print('\n'.join(' '.join(r.choice(w) for _ in range(12)) for _ in range(4000)))" >"$work/corpus.txt"
    "$build/kiln" train --data "$work/corpus.txt" --out "$model" --arch llama --layers 20 --width 1024 --heads 16 \
        --kv-heads 4 --context 64 --batch 1 --steps 1 --log-every 1 --eval-every 1000 >/dev/null
    rm -f "$model/train_state.safetensors"
fi
"$build/kiln" quantize "$model" "$work/m-q8_0.gguf" --type q8_0 --threads "$threads" >/dev/null
"$build/bench_stream_read" --threads "$threads" | tee -a "$work/out.jsonl"
for r in $(seq "$rounds"); do
    "$build/bench_decode_q8" "$model" --threads "$threads" --steps "$steps" --rounds 1 | tee -a "$work/out.jsonl"
    "$py" bench/decode_q8_llamacpp.py "$work/m-q8_0.gguf" "$threads" "$steps" 1 16 2>/dev/null | tee -a "$work/out.jsonl"
done
"$build/bench_stream_read" --threads "$threads" | tee -a "$work/out.jsonl"
"$py" - "$work/out.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
med = lambda xs: statistics.median(list(xs))
bw = max(r["GBps"] for r in rows if r.get("bench") == "stream_read")
k = [r for r in rows if r.get("summary")]
l = [r for r in rows if r.get("bench") == "decode_q8_llamacpp"]
params = k[0]["linear_params"]
bpw = {"f32": 4, "bf16": 2, "q8_0": 34 / 32}
print(f"read bandwidth (best stream_read): {bw:.2f} GB/s; linear weights {params / 1e6:.1f}M")
for s in (1, 16):
    lc = med(r[f"s{s}_tok_s"] for r in l)
    for w in ("f32", "bf16", "q8_0"):
        t = med(r[f"{w}_s{s}_tok_s"] for r in k)
        gbs = params * bpw[w] * t / s / 1e9
        print(f"{s:2d} stream(s) kiln {w:5s} {t:7.1f} tok/s  weights read {gbs:5.1f} GB/s = {gbs / bw:.2f} of the machine's"
              f"  / llama.cpp Q8_0 {t / lc:.2f}")
    gbs = params * bpw["q8_0"] * lc / s / 1e9
    print(f"{s:2d} stream(s) llama.cpp Q8_0 {lc:7.1f} tok/s  weights read {gbs:5.1f} GB/s = {gbs / bw:.2f} of the machine's")
PY
