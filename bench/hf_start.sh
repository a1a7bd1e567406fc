#!/bin/sh
# kiln serve's start on a ~500M-parameter Hugging Face checkpoint (issue 26): the
# safetensors files mapped and the f32 weights taken from the mapping (KILN_OPT_MMAP=1,
# the default) against read into memory and copied (KILN_OPT_MMAP=0), for the folder in
# f32 and in bf16, side by side in one run, alternating over ROUNDS rounds. For each:
# seconds from the start of `kiln serve` to ready, seconds for the first completion (8
# new tokens), and the server's memory after it (VmRSS, of it file-backed RssFile:
# mapped pages the kernel may drop and read again, and anonymous RssAnon) and its peak
# (VmHWM). The files are in the page cache (a warm start; each configuration reads the
# same files). The model: LLaMA-style, 29 layers of width 1280, 20 heads (4 for keys
# and values), MLP 3456, a byte vocabulary: 499M parameters, 2.0 GB in f32, made by one
# training step (speed does not depend on the weights) and `kiln export hf`.
#   sh bench/hf_start.sh [BUILD_DIR] [ROUNDS]      (HF=an existing folder to use instead)
# Needs python3 (standard library) and 8 GB of disk in $TMPDIR.
set -eu
build=${1:-build}
rounds=${2:-2}
work=$(mktemp -d)
srv=
trap 'kill $srv 2>/dev/null || true; rm -rf "$work"' EXIT
if [ -n "${HF:-}" ]; then
    folders="given:$HF"
else
    printf 'in the beginning god created the heaven and the earth\n%.0s' $(seq 400) >"$work/corpus.txt"
    echo "making the model (one training step of 499M parameters)..." >&2
    "$build/kiln" train --data "$work/corpus.txt" --out "$work/run" --arch llama --layers 29 --width 1280 \
        --heads 20 --kv-heads 4 --ffn 3456 --context 32 --batch 1 --steps 1 --eval-every 1000 --eval-batches 1 \
        --quiet >/dev/null
    "$build/kiln" export hf "$work/run" "$work/f32" >/dev/null
    "$build/kiln" export hf "$work/run" "$work/bf16" --dtype bf16 >/dev/null
    rm -rf "$work/run"
    folders="f32:$work/f32 bf16:$work/bf16"
fi
# kB of a field of /proc/PID/status
field() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }
now() { date +%s.%N; }
for r in $(seq "$rounds"); do
    for f in $folders; do
        name=${f%%:*}
        dir=${f#*:}
        for mm in 1 0; do
            log="$work/serve.log"
            t0=$(now)
            KILN_OPT_MMAP=$mm "$build/kiln" serve "$dir" --port 0 --kv-memory 64 --threads 2 2>"$log" &
            srv=$!
            while ! grep -q ready "$log"; do
                kill -0 $srv 2>/dev/null || { cat "$log" >&2; exit 1; }
                sleep 0.02
            done
            t1=$(now)
            port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$log")
            python3 - "$port" <<'PY'
import json, sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions",
                             data=json.dumps({"prompt": "in the beginning", "max_tokens": 8,
                                              "temperature": 0}).encode(),
                             headers={"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=600).read()
PY
            t2=$(now)
            echo "{\"round\": $r, \"weights\": \"$name\", \"mmap\": $mm, \"ready_s\": $(awk "BEGIN {print $t1 - $t0}")," \
                "\"first_completion_s\": $(awk "BEGIN {print $t2 - $t1}"), \"rss_mb\": $(($(field $srv VmRSS) / 1024))," \
                "\"rss_file_mb\": $(($(field $srv RssFile) / 1024)), \"rss_anon_mb\": $(($(field $srv RssAnon) / 1024))," \
                "\"peak_mb\": $(($(field $srv VmHWM) / 1024))}" | tee -a "$work/out.jsonl"
            kill $srv
            wait $srv 2>/dev/null || true
            srv=
        done
    done
done
python3 - "$work/out.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\nmedians over the rounds:")
for w in dict.fromkeys(r["weights"] for r in rows):
    for mm in (1, 0):
        rs = [r for r in rows if r["weights"] == w and r["mmap"] == mm]
        med = {k: statistics.median(r[k] for r in rs) for k in ("ready_s", "first_completion_s", "rss_mb",
                                                                 "rss_file_mb", "rss_anon_mb", "peak_mb")}
        print(f"  {w:5s} mmap={mm}: ready {med['ready_s']:.2f} s, first completion {med['first_completion_s']:.2f} s, "
              f"RSS {med['rss_mb']:.0f} MB (file {med['rss_file_mb']:.0f}, anon {med['rss_anon_mb']:.0f}), "
              f"peak {med['peak_mb']:.0f} MB")
    on = [r for r in rows if r["weights"] == w and r["mmap"] == 1]
    off = [r for r in rows if r["weights"] == w and r["mmap"] == 0]
    print(f"  {w:5s} ready time mapped / read: "
          f"{statistics.median(r['ready_s'] for r in on) / statistics.median(r['ready_s'] for r in off):.2f}, "
          f"peak memory mapped / read: "
          f"{statistics.median(r['peak_mb'] for r in on) / statistics.median(r['peak_mb'] for r in off):.2f}")
PY
