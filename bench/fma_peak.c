/* bench/fma_peak: the f32 FMA ceiling of this machine's cores, the number GEMM and
 * model-FLOP-utilisation figures are read against. Each thread runs 12 independent
 * chains of 256-bit vfmadd (8 floats, 2 flops each): enough chains to cover the FMA
 * latency (4-5 cycles) on both FMA pipes of current x86 cores. Prints the median
 * GFLOP/s over several rounds at 1 thread and at each count up to --threads.
 *
 *   bench_fma_peak [--threads N] [--iters N] [--rounds N]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include "bench.h"
#define HAVE_X86 1
#endif

#define CHAINS 12



#ifdef HAVE_X86
/* acc = acc * m + c keeps every chain bounded (it tends to c / (1 - m)), so no
 * overflow or denormals slow it down. Returns a sum so the work is not dead. */
__attribute__((target("avx2,fma"))) static float fma_loop(long iters)
{
    __m256 acc[CHAINS];
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long n = 0; n < iters; n++) {
        acc[0] = _mm256_fmadd_ps(acc[0], m, c);
        acc[1] = _mm256_fmadd_ps(acc[1], m, c);
        acc[2] = _mm256_fmadd_ps(acc[2], m, c);
        acc[3] = _mm256_fmadd_ps(acc[3], m, c);
        acc[4] = _mm256_fmadd_ps(acc[4], m, c);
        acc[5] = _mm256_fmadd_ps(acc[5], m, c);
        acc[6] = _mm256_fmadd_ps(acc[6], m, c);
        acc[7] = _mm256_fmadd_ps(acc[7], m, c);
        acc[8] = _mm256_fmadd_ps(acc[8], m, c);
        acc[9] = _mm256_fmadd_ps(acc[9], m, c);
        acc[10] = _mm256_fmadd_ps(acc[10], m, c);
        acc[11] = _mm256_fmadd_ps(acc[11], m, c);
    }
    __m256 s = acc[0];
    for (int i = 1; i < CHAINS; i++) s = _mm256_add_ps(s, acc[i]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif

typedef struct {
    long iters;
    pthread_barrier_t *start;
    float sink;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *a = p;
    pthread_barrier_wait(a->start);
#ifdef HAVE_X86
    a->sink = fma_loop(a->iters);
#endif
    return NULL;
}

/* GFLOP/s of nthreads threads each running iters iterations, timed from a common start. */
static double run(int nthreads, long iters)
{
    pthread_t th[64];
    worker_arg args[64];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)nthreads + 1);
    for (int i = 0; i < nthreads; i++) {
        args[i] = (worker_arg){iters, &start, 0};
        pthread_create(&th[i], NULL, worker, &args[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = bench_now_s();
    for (int i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
    double t = bench_now_s() - t0;
    pthread_barrier_destroy(&start);
    float sink = 0;
    for (int i = 0; i < nthreads; i++) sink += args[i].sink;
    if (sink == -1.0f) printf("(unreachable)\n");
    return (double)nthreads * (double)iters * CHAINS * 8 * 2 / t * 1e-9;
}

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
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        printf("bench_fma_peak: this CPU has no AVX2/FMA; nothing to measure\n");
        return 0;
    }
#else
    printf("bench_fma_peak: not an x86 CPU; nothing to measure\n");
    return 0;
#endif
    printf("# bench_fma_peak: %d chains of 256-bit f32 FMA per thread, %ld iterations, median of %d rounds\n",
           CHAINS, iters, rounds);
    printf("%8s %12s %12s %12s\n", "threads", "GFLOP/s", "per thread", "best");
    for (int n = 1; n <= threads; n++) {
        double g[64];
        run(n, iters / 10); /* warm up: clocks and page mappings */
        for (int r = 0; r < rounds; r++) g[r] = run(n, iters);
        qsort(g, (size_t)rounds, sizeof g[0], bench_cmp_double);
        double med = g[rounds / 2];
        printf("%8d %12.1f %12.1f %12.1f\n", n, med, med / n, g[rounds - 1]);
    }
    return 0;
}
