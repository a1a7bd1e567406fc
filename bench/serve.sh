#!/bin/sh
# kiln serve against a PyTorch eager generate loop with a KV cache, side by side in one
# run on the same weights: a width-384, 6-layer GPT-2-style model (byte tokenizer,
# context 256; trained for a few steps only, since speed does not depend on the weights),
# 64-token prompts, 128 new tokens. ROUNDS rounds, interleaved: PyTorch single stream,
# then kiln at 1, 4 and 16 concurrent streaming clients. Prints every figure and the
# ratios of the medians: kiln / PyTorch single-stream decode, and kiln 16-client total
# tokens/s / kiln 1-client total tokens/s.
#   sh bench/serve.sh [BUILD_DIR] [ROUNDS]      (MODEL=path/to/run to bring a model)
# Needs PyTorch for /usr/bin/python3 (apt-get install python3-torch).
set -eu
build=${1:-build}
rounds=${2:-3}
py=/usr/bin/python3
work=$(mktemp -d)
trap 'kill "$srv" 2>/dev/null || true; rm -rf "$work"' EXIT
model=${MODEL:-}
if [ -z "$model" ]; then
  model="$work/run"
  sh bench/serve_model.sh "$build" "$model" 6 384 6 5 4
fi
"$build/kiln" serve "$model" --port 0 2>"$work/serve.log" &
srv=$!
for _ in $(seq 200); do grep -q ready "$work/serve.log" && break; sleep 0.1; done
port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$work/serve.log")
out="$work/out.jsonl"
for r in $(seq "$rounds"); do
  "$py" bench/serve_torch.py "$model/model.safetensors" --reps 1 | tee -a "$out"
  for c in 1 4 16; do "$py" bench/serve_client.py --port "$port" --clients "$c" | tee -a "$out"; done
done
"$py" - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda xs: statistics.median(xs)
torch = [r for r in rows if r["peer"] == "pytorch"]
kiln = {c: [r for r in rows if r["peer"] == "kiln" and r["clients"] == c] for c in (1, 4, 16)}
td, tt = med(r["decode_tok_s"] for r in torch), med(r["ttft_ms"] for r in torch)
print(f"pytorch {torch[0]['torch']} single stream: decode {td:.1f} tok/s, ttft {tt:.1f} ms")
for c, rs in kiln.items():
    print(f"kiln {c:2d} client(s): total {med(r['total_tok_s'] for r in rs):7.1f} tok/s, per-stream decode "
          f"{med(r['decode_tok_s'] for r in rs):6.1f} tok/s, ttft {med(r['ttft_ms'] for r in rs):7.1f} ms")
kd = med(r["decode_tok_s"] for r in kiln[1])
print(f"ratio kiln/pytorch single-stream decode: {kd / td:.2f} (target >= 2)")
k1, k16 = med(r["total_tok_s"] for r in kiln[1]), med(r["total_tok_s"] for r in kiln[16])
print(f"ratio kiln 16 clients / 1 client total tokens/s: {k16 / k1:.2f} (target >= 4)")
print(f"ttft kiln 1 client / pytorch: {med(r['ttft_ms'] for r in kiln[1]) / tt:.2f}")
PY
