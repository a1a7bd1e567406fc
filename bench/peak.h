/* The compute ceilings of this machine's cores, the numbers GEMM and model-FLOP
 * figures are read against: each thread runs 12 independent chains of one multiply-add
 * instruction (enough chains to cover its latency on both pipes of current x86 cores).
 *   avx2         256-bit vfmadd: 8 f32 multiply-adds, 16 flops
 *   avx512       512-bit vfmadd: 16 f32 multiply-adds, 32 flops
 *   avx512-bf16  vdpbf16ps: 16 lanes each adding two bf16 products, 64 flops
 *   amx-bf16     tdpbf16ps: a 16 x 32 by 32 x 16 bf16 product into a 16 x 16 f32 tile,
 *                16,384 flops; four independent C tiles from two A and two B tiles, as
 *                kiln's AMX micro-kernel runs them (the unit takes one at a time)
 *   amx-loads    the same with the two A and two B tiles loaded from L1 before each
 *                four, as a 2 x 2 AMX GEMM kernel must (eight tiles hold four C tiles
 *                and four operands, so one load a tdpbf16ps is the fewest): the ceiling
 *                of any GEMM built on it
 * Used by bench/fma_peak.c and bench/gemm_own.c. */
#ifndef KILN_BENCH_PEAK_H
#define KILN_BENCH_PEAK_H
#include <pthread.h>
#include <stdio.h>
#include "bench.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef enum { PEAK_AVX2, PEAK_AVX512, PEAK_AVX512_BF16, PEAK_AMX_BF16, PEAK_AMX_LOADS, PEAK_COUNT } peak_isa;
static const char *const peak_names[PEAK_COUNT] = {"avx2", "avx512", "avx512-bf16", "amx-bf16", "amx-loads"};
/* flops per instruction; the AMX loops count PEAK_CHAINS instructions an iteration too */
static const int peak_flops_per_op[PEAK_COUNT] = {16, 32, 64, 16384, 16384};

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

/* AMX: Linux grants the tile state to a process that asks (arch_prctl), and each thread
 * loads a tile configuration: here eight 16 x 64-byte tiles. The tiles hold zeros, so
 * the sums stay zero; the unit's speed does not depend on the values. */
#include <sys/syscall.h>
#include <unistd.h>
__attribute__((target("amx-tile,amx-bf16"))) static float peak_loop_amx(long iters, int loads)
{
    static _Alignas(64) unsigned char ab[4][1024]; /* zeros: two A and two B tiles, in L1 */
    struct {
        unsigned char palette, start_row, reserved[14];
        unsigned short colsb[16];
        unsigned char rows[16];
    } cfg = {.palette = 1};
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    _tile_zero(0); /* the tile numbers are immediates */
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (long n = 0; n < iters; n++) /* PEAK_CHAINS = 12 instructions an iteration */
        for (int r = 0; r < 3; r++) {
            if (loads) {
                _tile_loadd(4, ab[0], 64);
                _tile_loadd(5, ab[1], 64);
                _tile_loadd(6, ab[2], 64);
                _tile_loadd(7, ab[3], 64);
            }
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    float out[256];
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
static int peak_amx_permitted(void)
{
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}
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
    case PEAK_AMX_BF16:
    case PEAK_AMX_LOADS: return peak_amx_permitted();
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
    a->sink = a->isa == PEAK_AVX2          ? peak_loop_avx2(a->iters)
              : a->isa == PEAK_AVX512      ? peak_loop_avx512(a->iters)
              : a->isa == PEAK_AVX512_BF16 ? peak_loop_avx512_bf16(a->iters)
                                           : peak_loop_amx(a->iters / 64, a->isa == PEAK_AMX_LOADS); /* 256x a vdpbf16ps */
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
    long ran = isa == PEAK_AMX_BF16 || isa == PEAK_AMX_LOADS ? iters / 64 : iters;
    return (double)nthreads * (double)ran * PEAK_CHAINS * peak_flops_per_op[isa] / t * 1e-9;
}
#endif
