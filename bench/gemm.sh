#!/bin/sh
# kiln's own GEMM against OpenBLAS and BLIS (bench/gemm_own.c), then the compute ceilings
# of this machine (bench/fma_peak.c), at each thread count given.
#   sh bench/gemm.sh [BUILD_DIR] [THREADS...]        (default: build 1 2)
# Debian's OpenBLAS picks its SSE3 kernels on some virtual machines (docs/perf-log.md):
# on a processor with AVX-512 it is told to use its SkylakeX kernels, its best here,
# unless OPENBLAS_CORETYPE is already set. Idle threads are told not to spin (BLIS's
# OpenMP threads sleep, OpenBLAS's wait 2^4 cycles instead of its default, about 0.1 s),
# so that they do not run against the other libraries' runs in the same process: with
# them spinning, kiln's two-thread figures fell to 0.36-0.6 of its one-thread ones.
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
threads=${*:-1 2}
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=SkylakeX
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
export OPENBLAS_THREAD_TIMEOUT=${OPENBLAS_THREAD_TIMEOUT:-4}
for t in $threads; do
    echo "## $t thread(s)"
    "$build/bench_gemm_own" --threads "$t" --rest-ms 100 --max-square 4096
done
"$build/bench_fma_peak" --threads "$(echo "$threads" | tr ' ' '\n' | sort -n | tail -1)" --rounds 5
