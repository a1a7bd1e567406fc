#!/bin/sh
# The config S training step's f32 GEMMs as the step runs them, on each engine: kiln's
# own GEMM (KILN_OPT_OWN_GEMM=1), OpenBLAS (the build in BUILD) and BLIS (a second build
# configured with -DKILN_BLAS=BLIS), each with the step's warm pool, shapes and layouts.
# The figure is the step's "op matmul" time from KILN_LOGS=profile (every matmul of the
# forward and backward: the 51 products of a config S step), so attention, the
# elementwise kernels and the optimizer are left out. The engines run in turn, their
# order rotated each round; the ratios are the median of each round's
# (other engine's time / kiln's), so >1 means kiln's GEMM is faster. The step is the
# compiled one (the profile is the compiled program's; eager runs the same products).
#   sh bench/step_gemms.sh [BUILD] [BLIS_BUILD] [ROUNDS] [THREADS]
#   (defaults: build build-blis 5 2)
# The BLIS build:  cmake -S . -B build-blis -DCMAKE_BUILD_TYPE=Release -DKILN_BLAS=BLIS
#                  cmake --build build-blis -j2 --target bench_train_step
# OpenBLAS is told to use its SkylakeX kernels on a processor with AVX-512 (Debian's
# picks generic ones on some virtual machines, docs/perf-log.md) unless
# OPENBLAS_CORETYPE is set; BLIS's OpenMP threads sleep when idle.
set -eu
build=${1:-build}
blis=${2:-build-blis}
rounds=${3:-5}
threads=${4:-2}
for b in "$build" "$blis"; do
    if [ ! -x "$b/bench_train_step" ]; then
        echo "step_gemms.sh: $b/bench_train_step not found (see the build commands at the top of this script)" >&2
        exit 2
    fi
done
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    export OPENBLAS_CORETYPE=SkylakeX
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# one step run of engine $1: prints "engine matmul_ms step_ms"
one() {
    case $1 in
    kiln) set -- kiln 1 "$build" ;;
    openblas) set -- openblas 0 "$build" ;;
    blis) set -- blis 0 "$blis" ;;
    esac
    KILN_OPT_OWN_GEMM=$2 KILN_LOGS=profile "$3/bench_train_step" --threads "$threads" --steps 8 --warmup 2 --compile 2>&1 |
        awk -v e="$1" '/ms a run/ { for (i = 1; i < NF; i++) if ($(i + 1) == "ms" && $(i + 2) == "a") step = $i }
                       / op matmul / { for (i = 1; i < NF; i++) if ($(i + 1) == "ms") mm = $i }
                       END { if (mm == "" || step == "") exit 1; print e, mm, step }'
}
engines="kiln openblas blis"
for r in $(seq "$rounds"); do
    order=$(echo "$engines" | tr ' ' '\n' | awk -v r="$r" '{ a[NR - 1] = $0 } END { for (i = 0; i < NR; i++) print a[(i + r) % NR] }')
    for e in $order; do
        line=$(one "$e") || {
            echo "step_gemms.sh: no profile from the $e run" >&2
            exit 1
        }
        echo "$r $line" | tee -a "$out"
    done
done
awk -v rounds="$rounds" -v threads="$threads" '
    { mm[$2, $1] = $3; st[$2, $1] = $4 }
    function median(v, n,    i, j, t) {
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
        return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
    }
    END {
        printf "# config S compiled step, %d threads, %d rounds: matmul ms (step ms), medians\n", threads, rounds
        split("kiln openblas blis", es, " ")
        for (k = 1; k <= 3; k++) {
            for (r = 1; r <= rounds; r++) { a[r] = mm[es[k], r]; b[r] = st[es[k], r] }
            printf "%-9s %8.2f (%.2f)\n", es[k], median(a, rounds), median(b, rounds)
        }
        for (k = 2; k <= 3; k++) {
            line = ""
            for (r = 1; r <= rounds; r++) { q[r] = mm[es[k], r] / mm["kiln", r]; line = line sprintf(" %.3f", q[r]) }
            printf "%s / kiln matmul time, per round:%s; median %.3f\n", es[k], line, median(q, rounds)
        }
    }' "$out"
