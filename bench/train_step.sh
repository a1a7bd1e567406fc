#!/bin/sh
# Config S training step, kiln eager vs PyTorch eager, side by side in one run, each at
# 1 and 2 threads, interleaved over ROUNDS rounds; prints every figure and the ratio of
# the best kiln tokens/s to the best PyTorch tokens/s, and of their peak RSS.
#   sh bench/train_step.sh [BUILD_DIR] [ROUNDS] [STEPS]
# Needs PyTorch for the Python in TORCH2_PY (default python3): Debian's python3-torch, or
# PyTorch 2.x from PyPI in a virtual environment (see bench/train_step_compile.sh):
#   TORCH2_PY=~/torch2/bin/python sh bench/train_step.sh
# OMP_NUM_THREADS is left unset: setting it to 1 made PyTorch 1.13 slower here (2,070 ->
# 1,650 tokens/s).
set -eu
build=${1:-build}
rounds=${2:-3}
steps=${3:-10}
py=${TORCH2_PY:-python3}
if ! "$py" -c "import torch" 2>/dev/null; then
    echo "train_step.sh: $py has no PyTorch; set TORCH2_PY (see the comment at the top)" >&2
    exit 1
fi
out=$(mktemp)
for r in $(seq "$rounds"); do
    for t in 1 2; do
        "$build/bench_train_step" --threads "$t" --steps "$steps" --warmup 2 | tee -a "$out"
        "$py" tests/reference/train_step_torch.py --threads "$t" --steps "$steps" --warmup 2 | tee -a "$out"
    done
done
"$py" - "$out" <<'PY'
import sys
sys.path.insert(0, "bench")
from medians import rows_of, best
rows = rows_of(sys.argv[1])
kt, kv, kall = best(rows, lambda r: r.get("engine") == "kiln")
pt, pv, pall = best(rows, lambda r: r.get("impl") == "torch-eager")
krss = max(r["peak_rss_mb"] for r in rows if r.get("engine") == "kiln")
prss = max(r["peak_rss_mib"] for r in rows if r.get("impl") == "torch-eager")
print(f"kiln median tokens/s by threads: {kall}; best {kv:.0f} at {kt} thread(s), peak RSS {krss:.0f} MiB")
print(f"torch median tokens/s by threads: {pall}; best {pv:.0f} at {pt} thread(s), peak RSS {prss:.0f} MiB")
print(f"ratio kiln/torch tokens/s = {kv / pv:.2f}   peak RSS kiln/torch = {krss / prss:.2f}")
PY
rm -f "$out"
