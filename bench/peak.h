/* The compute ceilings of this machine's cores, the numbers GEMM and model-FLOP
 * figures are read against: each thread runs 12 independent chains of one multiply-add
 * instruction (enough chains to cover its latency on both pipes of current x86 cores).
 *   avx2         256-bit vfmadd: 8 f32 multiply-adds, 16 flops
 *   avx512       512-bit vfmadd: 16 f32 multiply-adds, 32 flops
 *   avx512-bf16  vdpbf16ps: 16 lanes each adding two bf16 products, 64 flops
 * Used by bench/fma_peak.c and bench/gemm_own.c. */
#ifndef KILN_BENCH_PEAK_H
#define KILN_BENCH_PEAK_H
#include <pthread.h>
#include <stdio.h>
#include "bench.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef enum { PEAK_AVX2, PEAK_AVX512, PEAK_AVX512_BF16, PEAK_COUNT } peak_isa;
static const char *const peak_names[PEAK_COUNT] = {"avx2", "avx512", "avx512-bf16"};
static const int peak_flops_per_op[PEAK_COUNT] = {16, 32, 64};

#define PEAK_CHAINS 12
/* acc = acc * m + c (or acc += a.b with tiny a) keeps every chain bounded, so no
 * overflow or denormals slow it down. Each returns a sum so the work is not dead. */
#if defined(__x86_64__)
/* One loop per instruction: PEAK_CHAINS chains of `step` (one instruction each), then
 * their sum. */
#define PEAK_LOOP(name, isa, vec, set1, add, step, sum)                                       \
    __attribute__((target(isa))) static float name(long iters)                               \
    {                                                                                        \
        vec acc[PEAK_CHAINS];                                                                \
        for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = set1((float)i);                       \
        for (long n = 0; n < iters; n++)                                                     \
            _Pragma("GCC unroll 12") for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = step(acc[i]); \
        vec s = acc[0];                                                                      \
        for (int i = 1; i < PEAK_CHAINS; i++) s = add(s, acc[i]);                            \
        return sum(s);                                                                       \
    }
#define AVX2_STEP(x) _mm256_fmadd_ps(x, _mm256_set1_ps(0.999999f), _mm256_set1_ps(1e-6f))
#define AVX2_SUM(s) _mm256_cvtss_f32(s)
#define AVX512_STEP(x) _mm512_fmadd_ps(x, _mm512_set1_ps(0.999999f), _mm512_set1_ps(1e-6f))
/* 0x3380 is bf16 6e-8: the chains grow by 2 * 36e-16 a step, far from overflow. */
#define BF16_STEP(x) _mm512_dpbf16_ps(x, (__m512bh)_mm512_set1_epi16(0x3380), (__m512bh)_mm512_set1_epi16(0x3380))
PEAK_LOOP(peak_loop_avx2, "avx2,fma", __m256, _mm256_set1_ps, _mm256_add_ps, AVX2_STEP, AVX2_SUM)
PEAK_LOOP(peak_loop_avx512, "avx512f", __m512, _mm512_set1_ps, _mm512_add_ps, AVX512_STEP, _mm512_reduce_add_ps)
PEAK_LOOP(peak_loop_avx512_bf16, "avx512f,avx512bf16", __m512, _mm512_set1_ps, _mm512_add_ps, BF16_STEP,
          _mm512_reduce_add_ps)
#endif

/* Whether this processor runs the instruction of `isa`. */
static inline int peak_supported(peak_isa isa)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    switch (isa) {
    case PEAK_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case PEAK_AVX512: return __builtin_cpu_supports("avx512f");
    case PEAK_AVX512_BF16: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    default: return 0;
    }
#else
    (void)isa;
    return 0;
#endif
}

typedef struct {
    peak_isa isa;
    long iters;
    pthread_barrier_t *start;
    float sink;
} peak_worker_arg;

static void *peak_worker(void *p)
{
    peak_worker_arg *a = p;
    pthread_barrier_wait(a->start);
#if defined(__x86_64__)
    a->sink = a->isa == PEAK_AVX2     ? peak_loop_avx2(a->iters)
              : a->isa == PEAK_AVX512 ? peak_loop_avx512(a->iters)
                                      : peak_loop_avx512_bf16(a->iters);
#endif
    return NULL;
}

/* GFLOP/s of nthreads threads (at most 64) each running iters iterations of isa's
 * chains, timed from a common start; 0 where the processor lacks the instruction. */
static inline double peak_run(peak_isa isa, int nthreads, long iters)
{
    if (!peak_supported(isa)) return 0.0;
    pthread_t th[64];
    peak_worker_arg args[64];
    pthread_barrier_t start;
    if (nthreads > 64) nthreads = 64;
    pthread_barrier_init(&start, NULL, (unsigned)nthreads + 1);
    for (int i = 0; i < nthreads; i++) {
        args[i] = (peak_worker_arg){isa, iters, &start, 0};
        pthread_create(&th[i], NULL, peak_worker, &args[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = bench_now_s();
    for (int i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
    double t = bench_now_s() - t0;
    pthread_barrier_destroy(&start);
    float sink = 0;
    for (int i = 0; i < nthreads; i++) sink += args[i].sink;
    if (sink == -1.0f) printf("(unreachable)\n");
    return (double)nthreads * (double)iters * PEAK_CHAINS * peak_flops_per_op[isa] / t * 1e-9;
}
#endif
