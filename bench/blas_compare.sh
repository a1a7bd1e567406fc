#!/bin/sh
# bench/blas_compare.sh: runs bench_gemm from several builds (one per BLAS) in turn,
# round-robin, and prints the median over rounds of each BLAS's GFLOP/s per GEMM,
# with the ratio of each variant to the first. One process cannot hold two BLAS
# libraries (both define cblas_sgemm), so rounds alternate whole processes instead;
# within each process bench_gemm interleaves kiln and the BLAS.
#
#   bench/blas_compare.sh [-r ROUNDS] [-t THREADS] [-n REPS] [-a "BENCH_GEMM ARGS"] LABEL:BENCH_GEMM[:VAR=VALUE,...] ...
#
# e.g. bench/blas_compare.sh -t 2 openblas:build-bench-openblas/bench_gemm \
#        blis-omp:build-bench-blis/bench_gemm blis-omp-passive:build-bench-blis/bench_gemm:OMP_WAIT_POLICY=passive
set -eu
rounds=3 threads=0 reps=11 args=
while getopts r:t:n:a: o; do
    case $o in
    r) rounds=$OPTARG ;;
    t) threads=$OPTARG ;;
    n) reps=$OPTARG ;;
    a) args=$OPTARG ;;
    *) sed -n 's/^#   //p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n 's/^#   //p' "$0" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

# Reduces one bench_gemm output to "label|key|kiln|blas" lines (mix rows: "label|key|ms|").
extract() {
    awk -v L="$1" '
        /^## mix/ { mix = 1; next }
        /^## / { mix = 0; next }
        mix && NF >= 2 && $NF ~ /^[0-9.]+$/ { k = $1; for (i = 2; i < NF; i++) k = k " " $i; print L "|" k "|" $NF "|"; next }
        $1 == "step" && $2 == "total" { print L "|step total|" $(NF-2) "|" $(NF-1); next }
        {   # a GEMM row: a name of one or more words, then M N K
            for (i = 2; i + 2 < NF; i++) if ($i ~ /^[0-9]+$/ && $(i+1) ~ /^[0-9]+$/ && $(i+2) ~ /^[0-9]+$/) break
            if (i + 2 >= NF) next
            k = $1; for (j = 2; j < i; j++) k = k " " $j
            if ($NF ~ /e/) print L "|" k "|" $(NF-3) "|" $(NF-2)
            else print L "|" k "|" $(NF-2) "|" $(NF-1)
        }'
}

r=1
while [ "$r" -le "$rounds" ]; do
    for spec in "$@"; do
        label=${spec%%:*}
        rest=${spec#*:}
        bin=${rest%%:*}
        envs=
        [ "$rest" != "$bin" ] && envs=$(echo "${rest#*:}" | tr , ' ')
        # shellcheck disable=SC2086
        env $envs "$bin" --threads "$threads" --reps "$reps" $args >"$tmp/out" 2>&1 || { cat "$tmp/out" >&2; exit 1; }
        [ "$r" = 1 ] && sed -n 's/^# /  /p' "$tmp/out" | sed "s|^|$label: |" >&2
        extract "$label" <"$tmp/out" >>"$tmp/all"
    done
    r=$((r + 1))
done

labels=
for spec in "$@"; do labels="$labels ${spec%%:*}"; done
# Median per (label, key) of the BLAS column (the kiln column for the "kiln" rows of mix).
awk -F'|' -v labels="$labels" -v rounds="$rounds" '
    function med(s,    a, n, i, j, t) {
        n = split(s, a, " ")
        for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    {
        if (!($2 in seen)) { seen[$2] = 1; order[++nk] = $2 }
        v = ($4 == "") ? $3 : $4
        vals[$1 "|" $2] = vals[$1 "|" $2] " " v
        kv[$1 "|" $2] = kv[$1 "|" $2] " " $3
    }
    END {
        nl = split(labels, L, " ")
        printf "# median of %d rounds; GEMM rows: BLAS GFLOP/s (higher is better); mix rows: ms (lower is better)\n", rounds
        printf "%-24s", "gemm / mix"
        for (i = 1; i <= nl; i++) printf " %14s", L[i]
        for (i = 2; i <= nl; i++) printf " %9s", "/" L[1]
        printf "\n"
        for (k = 1; k <= nk; k++) {
            key = order[k]
            printf "%-24s", key
            for (i = 1; i <= nl; i++) { m[i] = med(vals[L[i] "|" key]); printf " %14.2f", m[i] }
            for (i = 2; i <= nl; i++) printf " %9.2f", (m[1] > 0 ? m[i] / m[1] : 0)
            printf "\n"
        }
        if (!(("step total") in seen)) exit
        printf "%-24s", "kiln step total GF/s"
        for (i = 1; i <= nl; i++) printf " %14.2f", med(kv[L[i] "|step total"])
        printf "\n"
    }' "$tmp/all"
