#!/bin/sh
# kiln serve with its linear weights in f32, bf16 and f16 (--weights), side by side in
# one run on the same model: three servers, each measured at 1 and at 16 concurrent
# streaming clients (64-token prompts, TOKENS new tokens), the two alternating over
# ROUNDS rounds. Prints every figure, the medians, the ratios bf16 / f32 and f16 / f32 of total and
# per-stream decode tokens/s, and each server's resident memory once loaded (VmRSS; a
# 192 MiB KV cache each, enough for 16 streams of this model without queueing). The default model is 12 layers of width 768 (85M
# parameters, 340 MB in f32; trained for one step, since speed does not depend on the
# weights): large enough that decoding streams its weights from memory.
#   sh bench/serve_weights.sh [BUILD_DIR] [ROUNDS] [TOKENS]   (MODEL=path/to/run to bring a model)
# Needs python3 (the client is standard library only).
set -eu
build=${1:-build}
rounds=${2:-3}
tokens=${3:-64}
py=python3
work=$(mktemp -d)
srv_f32=
srv_bf16=
srv_f16=
trap 'kill $srv_f32 $srv_bf16 $srv_f16 2>/dev/null || true; rm -rf "$work"' EXIT
model=${MODEL:-}
if [ -z "$model" ]; then
    model="$work/run"
    sh bench/serve_model.sh "$build" "$model" 12 768 12 1 1
fi
# start NAME WEIGHTS: a server in the background; sets port_NAME and srv_NAME
start() {
    "$build/kiln" serve "$model" --port 0 --weights "$2" --kv-memory 192 2>"$work/$1.log" &
    eval "srv_$1=$!"
    for _ in $(seq 600); do grep -q ready "$work/$1.log" && break; sleep 0.1; done
    eval "port_$1=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$work/$1.log")"
}
start f32 f32
start bf16 bf16
start f16 f16
for w in f32 bf16 f16; do
    eval "pid=\$srv_$w"
    echo "{\"server\": \"$w\", \"rss_mb\": $(awk '/VmRSS/ {print $2 / 1024}' /proc/$pid/status)}" | tee -a "$work/out.jsonl"
done
for r in $(seq "$rounds"); do
    for c in 1 16; do
        for w in f32 bf16 f16; do
            eval "port=\$port_$w"
            "$py" bench/serve_client.py --port "$port" --clients "$c" --tokens "$tokens" |
                sed "s/^{/{\"server\": \"$w\", /" | tee -a "$work/out.jsonl"
        done
    done
done
"$py" - "$work/out.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
rss = {r["server"]: r["rss_mb"] for r in rows if "rss_mb" in r}
med = lambda xs: statistics.median(list(xs))
for c in (1, 16):
    got = {}
    for w in ("f32", "bf16", "f16"):
        rs = [r for r in rows if r.get("server") == w and r.get("clients") == c]
        got[w] = (med(r["total_tok_s"] for r in rs), med(r["decode_tok_s"] for r in rs))
        print(f"{w:4s} {c:2d} client(s): total {got[w][0]:7.1f} tok/s, per-stream decode {got[w][1]:6.1f} tok/s")
    for w in ("bf16", "f16"):
        print(f"ratio {w} / f32 at {c:2d} client(s): total {got[w][0] / got['f32'][0]:.2f}, "
              f"per-stream decode {got[w][1] / got['f32'][1]:.2f}")
for w in ("f32", "bf16", "f16"):
    print(f"{w:4s} server resident once loaded: {rss[w]:.0f} MB")
print(f"resident bf16 / f32: {rss['bf16'] / rss['f32']:.2f}, f16 / f32: {rss['f16'] / rss['f32']:.2f}")
PY
