#!/bin/sh
# Config S training step in mixed precision: kiln and PyTorch 2.x, each in f32 and with
# bf16 autocast (kiln --precision bf16; torch.autocast("cpu", torch.bfloat16)), eager and
# compiled (kiln --compile; torch.compile), at THREADS threads, interleaved over ROUNDS
# rounds in one run. Prints every figure, each median tokens/s, and for each mode the
# ratios kiln bf16 / torch bf16 (the issue's target) and bf16 / f32 for each engine: the
# ratio of the medians, and the median of the ratios of each round's adjacent runs
# (these machines drift by tens of percent over minutes; adjacent runs see the same
# machine). OPENBLAS_CORETYPE=SkylakeX as in bench/gemm.sh (this VM's processor is
# otherwise given a generic OpenBLAS core; kiln's f32 uses OpenBLAS).
#   TORCH2_PY=~/torch2/bin/python sh bench/train_step_amp.sh [BUILD_DIR] [ROUNDS] [STEPS] [THREADS] [MODES] [PRECISIONS]
# MODES: "eager", "compile" or "eager compile" (the default). PRECISIONS: "f32 bf16"
# (the default), or any of f32, bf16, f16 (f16: PyTorch with torch.amp.GradScaler).
# PyTorch 2.x comes from PyPI: python3 -m venv ~/torch2 && ~/torch2/bin/pip install torch numpy
set -eu
build=${1:-build}
rounds=${2:-3}
steps=${3:-10}
threads=${4:-2}
modes=${5:-eager compile}
precisions=${6:-f32 bf16}
py=${TORCH2_PY:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; then
    echo "train_step_amp.sh: $py has no PyTorch 2.x; set TORCH2_PY (see the comment at the top)" >&2
    exit 2
fi
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}
out=$(mktemp)
for r in $(seq "$rounds"); do
    for m in $modes; do
        flag=; [ "$m" = compile ] && flag=--compile
        for p in $precisions; do
            "$build/bench_train_step" --threads "$threads" --steps "$steps" --warmup 2 --precision "$p" $flag |
                sed "s/^{/{\"round\":$r,\"mode\":\"$m\",/" | tee -a "$out"
            "$py" -W ignore tests/reference/train_step_torch.py --threads "$threads" --steps "$steps" --warmup 2 \
                --precision "$p" $flag 2>/dev/null | sed "s/^{/{\"round\":$r,\"mode\":\"$m\",/" | tee -a "$out"
        done
    done
done
"$py" - "$out" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
runs = {}
for r in rows:
    who = "torch" if "impl" in r else "kiln"
    runs.setdefault((r["mode"], who, r["precision"]), {})[r["round"]] = r["tokens_per_s"]
def ratio(a, b):
    med = statistics.median(runs[a].values()) / statistics.median(runs[b].values())
    paired = [runs[a][k] / runs[b][k] for k in runs[a] if k in runs[b]]
    return f"{med:.2f} (median of the rounds' ratios {statistics.median(paired):.2f}, each {' '.join(f'{x:.2f}' for x in paired)})"
for k in sorted(runs):
    print(f"{k[0]:7s} {k[1]:5s} {k[2]:4s} median tokens/s {statistics.median(runs[k].values()):8.0f}")
precs = sorted({k[2] for k in runs})
for m in sorted({k[0] for k in runs}):
    for p in precs:
        print(f"{m}: kiln {p} / torch {p} = {ratio((m, 'kiln', p), (m, 'torch', p))}")
    for p in precs:
        if p != "f32" and "f32" in precs:
            print(f"{m}: kiln {p} / kiln f32   = {ratio((m, 'kiln', p), (m, 'kiln', 'f32'))}")
            print(f"{m}: torch {p} / torch f32 = {ratio((m, 'torch', p), (m, 'torch', 'f32'))}")
PY
rm -f "$out"
