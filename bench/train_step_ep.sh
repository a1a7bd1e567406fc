#!/bin/sh
# Expert-parallel training against data-parallel only, on config S-MoE (LLaMA style, T
# 128, C 256, 4 layers, a global batch of 16; every block 8 routed experts of width 232,
# top-2, plus 1 shared; forward, backward, clipping, AdamW), at 2 ranks under mpirun
# with 1 thread each, and one process at 2 threads beside them; interleaved over ROUNDS
# rounds. Data-parallel: every rank holds all experts and averages every gradient.
# Expert-parallel (--expert-parallel): rank r holds 4 of each block's experts, rows go
# to their expert's rank and back by all-to-all, the experts' gradients are not
# allreduced. Prints the median tokens/s of each, their ratio, and the share of rank 0's
# step spent inside the all-to-alls and the allreduces (waits for the other rank
# included).
#   sh bench/train_step_ep.sh [BUILD_DIR] [ROUNDS] [STEPS]
# Set OPENBLAS_CORETYPE=SkylakeX where OpenBLAS does not know the processor (kiln doctor).
set -eu
build=${1:-build}
rounds=${2:-3}
steps=${3:-10}
moe="--model llama --experts 8 --top-k 2 --shared 1 --expert-ffn 232 --steps $steps --warmup 2"
mpi="mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl_vader_single_copy_mechanism none"
out=$(mktemp)
for r in $(seq "$rounds"); do
    # shellcheck disable=SC2086
    "$build/bench_train_step" $moe --threads 2 | tee -a "$out"
    # shellcheck disable=SC2086
    $mpi "$build/bench_train_step" $moe --threads 1 --dist | tee -a "$out"
    # shellcheck disable=SC2086
    $mpi "$build/bench_train_step" $moe --threads 1 --expert-parallel | tee -a "$out"
done
python3 - "$out" <<'PY'
import statistics, sys
sys.path.insert(0, "bench")
from medians import rows_of
rows = rows_of(sys.argv[1])
def pick(world, ep):
    return [r for r in rows if r["world"] == world and r["expert_parallel"] == ep]
one, dp, ep = pick(1, False), pick(2, False), pick(2, True)
med = lambda rs, k: statistics.median(r[k] for r in rs)
print(f"one process, 2 threads:        median {med(one, 'tokens_per_s'):.0f} tokens/s")
print(f"2 ranks data-parallel:         median {med(dp, 'tokens_per_s'):.0f} tokens/s, "
      f"allreduce {100 * med(dp, 'allreduce_share'):.1f}% of the step")
print(f"2 ranks expert-parallel:       median {med(ep, 'tokens_per_s'):.0f} tokens/s, "
      f"all-to-all {100 * med(ep, 'a2a_share'):.1f}%, allreduce {100 * med(ep, 'allreduce_share'):.1f}% of the step")
print(f"expert-parallel / data-parallel = {med(ep, 'tokens_per_s') / med(dp, 'tokens_per_s'):.2f}")
PY
rm -f "$out"
