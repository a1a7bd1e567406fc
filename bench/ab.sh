#!/bin/sh
# Paired timing of two bench commands that print a JSON line with "tokens_per_s"
# (bench_train_step, tests/reference/train_step_torch.py): A and B alternate N times and
# the median of the per-pair ratios A/B is printed with each pair's. On these noisy
# machines a pair's two runs see about the same machine; a median over separate runs
# does not.
#   sh bench/ab.sh N 'COMMAND A' 'COMMAND B'
# e.g. sh bench/ab.sh 6 'build/bench_train_step --precision bf16' \
#        'KILN_OPT_ATT_BF16=0 build/bench_train_step --precision bf16'
set -eu
if [ $# -ne 3 ]; then
    echo "usage: sh bench/ab.sh N 'COMMAND A' 'COMMAND B'" >&2
    exit 2
fi
n=$1
a=$(mktemp)
b=$(mktemp)
for i in $(seq "$n"); do
    sh -c "$2" | grep tokens_per_s >>"$a"
    sh -c "$3" | grep tokens_per_s >>"$b"
done
python3 - "$a" "$b" <<'PY'
import json, statistics, sys
a = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])]
b = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[2])]
r = [x / y for x, y in zip(a, b)]
print("A tokens/s", " ".join(f"{x:.0f}" for x in a), "median", f"{statistics.median(a):.0f}")
print("B tokens/s", " ".join(f"{x:.0f}" for x in b), "median", f"{statistics.median(b):.0f}")
print("A/B per pair", " ".join(f"{x:.3f}" for x in r), "median", f"{statistics.median(r):.3f}")
PY
rm -f "$a" "$b"
