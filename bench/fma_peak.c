/* bench/fma_peak: the compute ceilings of this machine's cores (bench/peak.h): f32
 * multiply-adds in 256-bit (AVX2) and 512-bit (AVX-512) registers, and bf16 dot products
 * (AVX512-BF16's vdpbf16ps), the numbers GEMM and model-FLOP-utilisation figures are
 * read against. Prints the median GFLOP/s over several rounds for each instruction the
 * processor has, at 1 thread and at each count up to --threads.
 *
 *   bench_fma_peak [--threads N] [--iters N] [--rounds N]
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "peak.h"

int main(int argc, char **argv)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cores > 0 ? (int)cores : 1, rounds = 7;
    long iters = 100000000L; /* ~0.4 s per round at 1 thread on a ~2.5 GHz core */
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_fma_peak [--threads N] [--iters N] [--rounds N]\n");
            return 2;
        }
    }
    if (argc % 2 == 0) {
        fprintf(stderr, "usage: bench_fma_peak [--threads N] [--iters N] [--rounds N]\n");
        return 2;
    }
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (rounds < 1) rounds = 1;
    if (rounds > 64) rounds = 64;
    printf("# bench_fma_peak: %d chains per thread, %ld iterations, median of %d rounds\n", PEAK_CHAINS, iters,
           rounds);
    printf("%-12s %8s %12s %12s %12s\n", "instruction", "threads", "GFLOP/s", "per thread", "best");
    for (int isa = 0; isa < PEAK_COUNT; isa++) {
        if (!peak_supported((peak_isa)isa)) {
            printf("%-12s (not on this processor)\n", peak_names[isa]);
            continue;
        }
        for (int n = 1; n <= threads; n++) {
            double g[64];
            peak_run((peak_isa)isa, n, iters / 10); /* warm up: clocks and page mappings */
            for (int r = 0; r < rounds; r++) g[r] = peak_run((peak_isa)isa, n, iters);
            qsort(g, (size_t)rounds, sizeof g[0], bench_cmp_double);
            double med = g[rounds / 2];
            printf("%-12s %8d %12.1f %12.1f %12.1f\n", peak_names[isa], n, med, med / n, g[rounds - 1]);
        }
    }
    return 0;
}
