#!/bin/sh
# Config S-MoE against dense config S (LLaMA style: RMSNorm, RoPE, SwiGLU; T 128, C 256,
# 4 layers, B 16; forward, backward, clipping, AdamW) and against PyTorch's eager MoE
# that loops over its experts (tests/reference/moe_ref.py, the common implementation),
# side by side in one run, each at 1 and 2 threads, interleaved over ROUNDS rounds; kiln's
# S-MoE eager and compiled (--compile: the step one graph), its best of the two counted.
# S-MoE: every block 8 routed experts, top-2, plus 1 shared, each of width 232, so that
# the 3 experts a token uses hold about the parameters of the dense SwiGLU (3 x 232 =
# 696 against F = 704). Prints every figure and the ratios of the best medians.
#   sh bench/train_step_moe.sh [BUILD_DIR] [ROUNDS] [STEPS]
# TORCH2_PY: a python with PyTorch 2.x (default ~/torch2/bin/python); set
# OPENBLAS_CORETYPE=SkylakeX where OpenBLAS does not know the processor (kiln doctor).
set -eu
build=${1:-build}
rounds=${2:-3}
steps=${3:-10}
py=${TORCH2_PY:-$HOME/torch2/bin/python}
moe="--experts 8 --top-k 2 --shared 1 --expert-ffn 232"
out=$(mktemp)
for r in $(seq "$rounds"); do
    for t in 1 2; do
        "$build/bench_train_step" --model llama --threads "$t" --steps "$steps" --warmup 2 | tee -a "$out"
        # shellcheck disable=SC2086
        "$build/bench_train_step" --model llama $moe --threads "$t" --steps "$steps" --warmup 2 | tee -a "$out"
        # shellcheck disable=SC2086
        "$build/bench_train_step" --model llama $moe --threads "$t" --steps "$steps" --warmup 2 --compile | tee -a "$out"
        # shellcheck disable=SC2086
        "$py" tests/reference/train_step_torch.py --model llama $moe --threads "$t" --steps "$steps" --warmup 2 | tee -a "$out"
    done
done
"$py" - "$out" <<'PY'
import statistics
import sys
sys.path.insert(0, "bench")
from medians import rows_of, best
rows = rows_of(sys.argv[1])
dt, dv, dall = best(rows, lambda r: r.get("engine") == "kiln" and r.get("experts") == 0)
mt, mv, mall = best(rows, lambda r: r.get("engine") == "kiln" and r.get("experts", 0) > 0)
ct, cv, call = best(rows, lambda r: r.get("engine") == "kiln-compile" and r.get("experts", 0) > 0)
pt, pv, pall = best(rows, lambda r: r.get("impl") == "torch-eager")
print(f"kiln dense config S: median tokens/s by threads {dall}; best {dv:.0f} at {dt}")
print(f"kiln S-MoE:          median tokens/s by threads {mall}; best {mv:.0f} at {mt}")
print(f"kiln S-MoE compiled: median tokens/s by threads {call}; best {cv:.0f} at {ct}")
print(f"torch eager S-MoE (a loop over experts): {pall}; best {pv:.0f} at {pt}")
print(f"kiln S-MoE / kiln dense = {mv / dv:.2f}   kiln S-MoE / torch eager S-MoE = {mv / pv:.2f}   "
      f"kiln S-MoE at its best (eager or compiled) / torch eager S-MoE = {max(mv, cv) / pv:.2f}")
# Each round's S-MoE run against the dense run just before it, at the best thread count:
# the machine's drift moves both, so the paired ratios scatter less than the medians'.
dense = [r["tokens_per_s"] for r in rows if r.get("engine") == "kiln" and r.get("experts") == 0 and r["threads"] == mt]
moe = [r["tokens_per_s"] for r in rows if r.get("engine") == "kiln" and r.get("experts", 0) > 0 and r["threads"] == mt]
pairs = sorted(m / d for d, m in zip(dense, moe))
print(f"kiln S-MoE / kiln dense, round by round at {mt} threads: {' '.join(f'{x:.2f}' for x in pairs)}; "
      f"median {statistics.median(pairs):.2f}")
PY
rm -f "$out"
