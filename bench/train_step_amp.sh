#!/bin/sh
# Config S training step in mixed precision: kiln and PyTorch 2.x, each in f32 and with
# bf16 autocast (kiln --precision bf16; torch.autocast("cpu", torch.bfloat16)), eager,
# at THREADS threads, interleaved over ROUNDS rounds in one run. Prints every figure,
# each median tokens/s, and the ratios kiln bf16 / torch bf16 (the issue's target) and
# bf16 / f32 for each engine. OPENBLAS_CORETYPE=SkylakeX as in bench/gemm.sh (this
# VM's processor is otherwise given a generic OpenBLAS core; kiln's f32 uses OpenBLAS).
#   TORCH2_PY=~/torch2/bin/python sh bench/train_step_amp.sh [BUILD_DIR] [ROUNDS] [STEPS] [THREADS]
# PyTorch 2.x comes from PyPI: python3 -m venv ~/torch2 && ~/torch2/bin/pip install torch numpy
set -eu
build=${1:-build}
rounds=${2:-3}
steps=${3:-10}
threads=${4:-2}
py=${TORCH2_PY:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; then
    echo "train_step_amp.sh: $py has no PyTorch 2.x; set TORCH2_PY (see the comment at the top)" >&2
    exit 2
fi
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}
out=$(mktemp)
for r in $(seq "$rounds"); do
    for p in f32 bf16; do
        "$build/bench_train_step" --threads "$threads" --steps "$steps" --warmup 2 --precision "$p" | tee -a "$out"
        "$py" -W ignore tests/reference/train_step_torch.py --threads "$threads" --steps "$steps" --warmup 2 \
            --precision "$p" 2>/dev/null | tee -a "$out"
    done
done
"$py" - "$out" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
med = {}
for r in rows:
    who = "kiln" if r.get("engine") == "kiln" else "torch"
    med.setdefault((who, r["precision"]), []).append(r["tokens_per_s"])
med = {k: statistics.median(v) for k, v in med.items()}
for k in sorted(med):
    print(f"{k[0]:5s} {k[1]:4s} median tokens/s {med[k]:8.0f}")
print(f"ratio kiln bf16 / torch bf16 = {med[('kiln', 'bf16')] / med[('torch', 'bf16')]:.2f}")
print(f"ratio kiln bf16 / kiln f32   = {med[('kiln', 'bf16')] / med[('kiln', 'f32')]:.2f}")
print(f"ratio torch bf16 / torch f32 = {med[('torch', 'bf16')] / med[('torch', 'f32')]:.2f}")
print(f"ratio kiln f32 / torch f32   = {med[('kiln', 'f32')] / med[('torch', 'f32')]:.2f}")
PY
rm -f "$out"
