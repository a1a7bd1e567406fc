#!/bin/sh
# Flex attention's forward on the cpu, kiln against PyTorch 2.x's compiled flex_attention
# (issue 27's peer), side by side in one run: for each T, causal and a sliding window of
# T/8 (B 1, 8 heads of 64, f32), each engine at 1 and 2 threads, the best of each taken.
# ROUNDS rounds, each running both engines at both thread counts in turn (each figure a
# median of 3 calls), so that the machine's drift moves both sides of a round alike.
# Prints every JSON line and, per T and mask, torch's best ms / kiln's best ms (> 1:
# kiln faster): over all rounds, and round by round with the rounds' median.
#   TORCH2_PY=~/torch2/bin/python sh bench/flex.sh [BUILD_DIR] [T_LIST] [ROUNDS]
# PyTorch 2.x comes from PyPI: python3 -m venv ~/torch2 && ~/torch2/bin/pip install torch
set -eu
build=${1:-build}
Ts=${2:-512,1024,2048,4096}
rounds=${3:-5}
py=${TORCH2_PY:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; then
    echo "flex.sh: $py has no PyTorch 2.x; set TORCH2_PY (see the comment at the top)" >&2
    exit 2
fi
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}
out=$(mktemp)
for r in $(seq "$rounds"); do
    for th in 1 2; do
        KILN_NUM_THREADS=$th "$build/bench_flex" --T "$Ts" --rounds 3 | sed "s/^{/{\"round\":$r,/" | tee -a "$out"
        "$py" "$(dirname "$0")/flex_torch.py" --T "$Ts" --threads "$th" --rounds 3 2>/dev/null |
            sed "s/^{/{\"round\": $r, /" | tee -a "$out"
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for T in sorted({r["T"] for r in rows}):
    k = [r for r in rows if r["T"] == T and r["bench"] == "flex"]
    t = [r for r in rows if r["T"] == T and r["bench"] == "flex_torch"]
    if not k or not t:
        continue
    for kname, tname in (("flex_causal_ms", "causal_ms"), ("flex_window_T8_ms", "window_T8_ms")):
        kb, tb = min(r[kname] for r in k), min(r[tname] for r in t)
        rounds = sorted({r["round"] for r in k} & {r["round"] for r in t})
        paired = sorted(min(r[tname] for r in t if r["round"] == n) / min(r[kname] for r in k if r["round"] == n)
                        for n in rounds)
        print(f"T {T} {tname[:-3]}: kiln {kb:.2f} ms, torch.compile {tb:.2f} ms, torch / kiln {tb / kb:.2f}; "
              f"round by round {' '.join(f'{x:.2f}' for x in paired)}, median {statistics.median(paired):.2f}")
PY
rm -f "$out"
