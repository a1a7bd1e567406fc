#!/bin/sh
# kiln's own GEMM against OpenBLAS and BLIS (bench/gemm_own.c), then the compute ceilings
# of this machine (bench/fma_peak.c), at each thread count given.
#   sh bench/gemm.sh [BUILD_DIR] [THREADS...]        (default: build 1 2)
# Debian's OpenBLAS picks its SSE3 kernels on some virtual machines (docs/perf-log.md):
# on a processor with AVX-512 it is told to use its SkylakeX kernels, its best here,
# unless OPENBLAS_CORETYPE is already set. BLIS's OpenMP threads are told to sleep when
# idle, so that they do not spin against the other libraries' runs in the same process.
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
threads=${*:-1 2}
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=SkylakeX
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
for t in $threads; do
    echo "## $t thread(s)"
    "$build/bench_gemm_own" --threads "$t"
done
"$build/bench_fma_peak" --threads "$(echo "$threads" | tr ' ' '\n' | sort -n | tail -1)" --rounds 5
