#!/bin/sh
# kiln compile on 2 ranks x 1 thread, config S shape: the in-graph allreduces
# overlapped with the rest of backward against KILN_COMPILE_DISABLE=overlap,
# interleaved; prints the median ms_per_step of steps 6-30 of each run.
#   sh bench/overlap_ab.sh [BATCH=8] [PAIRS=2] [BUILD=build]
# Needs mpirun (openmpi-bin) and a corpus: $KILN_DATA, else data/kjv.txt.
set -e
cd "$(dirname "$0")/.."
B=${1:-8}; R=${2:-2}; BUILD=${3:-build}
DATA=${KILN_DATA:-data/kjv.txt}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
med() {
    python3 -c "
import json, statistics, sys
v = [json.loads(l)['ms_per_step'] for l in open(sys.argv[1]) if json.loads(l)['step'] >= 6]
print('%.1f' % statistics.median(v))" "$1"
}
for r in $(seq "$R"); do
    for mode in on off; do
        off=""; [ "$mode" = off ] && off=overlap
        rm -rf "$OUT/run"
        KILN_COMPILE_DISABLE=$off mpirun --allow-run-as-root --oversubscribe -np 2 "$BUILD/kiln" train \
            --data "$DATA" --out "$OUT/run" --quiet --compile --arch gpt2 --layers 4 --width 256 --heads 4 \
            --context 128 --batch "$B" --steps 30 --log-every 1 --eval-every 1000 --save-every 1000 \
            --threads 1 >/dev/null 2>&1
        echo "batch $B, overlap $mode: $(med "$OUT/run/metrics.jsonl") ms a step"
    done
done
