/* kiln's own GEMM (gemm.h): the blocking, packing and threading, and the micro-kernels.
 *
 * Loops, outermost first: column chunks of B (rounds of at most NC columns, fewer with
 * ROUND_BYTES; each packed once over the pool), then work items of (MC rows) x (a
 * group of NR-column panels) over the pool; inside an item, K blocks of KC in order,
 * each packing its rows of A once and running the micro-kernel over every MR x NR tile
 * of the item. A tile at an edge of C runs the same micro-kernel on a full-size scratch
 * tile, so that every element gets the same arithmetic wherever it lies. */
#include "backends/cpu/gemm.h"
#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "core/opts.h"
#include "core/threadpool.h"
#include "core/util.h"
#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MR_MAX 32
#define NR_MAX 32
#define NC 4096 /* the most columns of B packed at once (a multiple of every NR) */
/* With KILN_OPT_GEMM_NARROW_ROUNDS, a round's K block of packed B is at most this many
 * bytes (1024 f32 columns), so that it stays in L2 while every row tile of C streams
 * past it (256 KiB to 1.5 MiB measured the same at one thread on a 2 MiB L2; the
 * largest keeps products of up to 1024 columns in one round, as before,
 * docs/perf-log.md). */
#define ROUND_BYTES ((int64_t)1 << 20)

/* Runs `steps` k-steps (a k-step is one k for f32, a pair of k for bf16, 32 k for AMX)
 * of the micro-panels a (MR rows) and b (NR columns, packed) into the MR x NR tile c
 * (row stride ldc): c = sum, or c += sum with `add` (the sum then starts from c). The
 * f32 kernels broadcast A's elements one at a time, so they read A where it lies:
 * element (i, k) is a[i * ars + k * acs] (a packed panel has ars = 1, acs = MR); the
 * others read packed panels only. */
typedef void (*ukernel_fn)(int64_t steps, const void *a, int64_t ars, int64_t acs, const void *b, float *c,
                           int64_t ldc, bool add);

typedef struct {
    const char *name;
    kiln__gemm_isa isa;
    kiln__gemm_type packed; /* the element type of the packed panels */
    bool round_bf16;        /* f32 panels holding values rounded to bf16 */
    int mr, nr, kstep;
    ukernel_fn run;
    ukernel_fn rows4, rows8; /* the same kernel for a tile of at most 4 or 8 rows of A, or NULL */
    bool amx; /* B panels in AMX's pair-interleaved 16-column halves */
} ukernel;

/* ---- micro-kernels ---- */

static void k_c(int64_t steps, const void *pa, int64_t ars, int64_t acs, const void *pb, float *c, int64_t ldc,
                bool add)
{
    enum { MR = 4, NR = 16 };
    const float *a = pa, *b = pb;
    float acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = add ? c[i * ldc + j] : 0.0f;
    for (int64_t k = 0; k < steps; k++, a += acs, b += NR)
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[i][j] += a[i * ars] * b[j];
    for (int i = 0; i < MR; i++) memcpy(c + i * ldc, acc[i], sizeof acc[i]);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void k_avx2(int64_t steps, const void *pa, int64_t ars, int64_t acs,
                                                        const void *pb, float *c, int64_t ldc, bool add)
{
    enum { MR = 6 };
    const float *a = pa, *b = pb;
    __m256 acc[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        acc[i][0] = add ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
        acc[i][1] = add ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < steps; k++, a += acs, b += 16) {
        __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            __m256 ai = _mm256_broadcast_ss(a + i * ars);
            acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(c + i * ldc, acc[i][0]);
        _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    }
}

/* The AVX-512 kernels' MR x 32 tile of C in registers: loaded (or zero) and stored. */
#define C_TILE_512_LOAD(acc, MR)                                                              \
    _Pragma("GCC unroll 12") for (int i = 0; i < (MR); i++) {                                 \
        (acc)[i][0] = add ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();               \
        (acc)[i][1] = add ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();          \
    }
#define C_TILE_512_STORE(acc, MR)                                                             \
    _Pragma("GCC unroll 12") for (int i = 0; i < (MR); i++) {                                 \
        _mm512_storeu_ps(c + i * ldc, (acc)[i][0]);                                           \
        _mm512_storeu_ps(c + i * ldc + 16, (acc)[i][1]);                                      \
    }

/* The f32 AVX-512 kernel for MR rows of A: 12 (the tiles), and 8 and 4 for a last tile
 * of fewer rows (the same arithmetic for each element: an edge tile of 4 rows costs a
 * third of a whole one, not all of it). */
#define K_AVX512(NAME, MR_)                                                                                   \
    __attribute__((target("avx512f"))) static void NAME(int64_t steps, const void *pa, int64_t ars, int64_t acs, \
                                                        const void *pb, float *c, int64_t ldc, bool add)       \
    {                                                                                                         \
        enum { MR = MR_ };                                                                                    \
        /* Rows 3q..3q+2 of A from base p[q] with the row stride r in the address (x86                       \
         * addressing takes one scaled index), so the loop moves four pointers. */                            \
        const char *p0 = pa, *p3 = p0 + 12 * ars, *p6 = p0 + 24 * ars, *p9 = p0 + 36 * ars;                   \
        const int64_t r = 4 * ars, step = 4 * acs;                                                            \
        const float *b = pb;                                                                                  \
        __m512 acc[MR][2];                                                                                    \
        C_TILE_512_LOAD(acc, MR);                                                                             \
        /* four k-steps a trip: a quarter of the loop's pointer and counter updates, which                   \
         * compete with the FMAs for ports (2048^3 at one thread 0.76-0.79 -> 0.83-0.84 of                    \
         * OpenBLAS; docs/perf-log.md) */                                                                     \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < steps;                                                \
                                     k++, p0 += step, p3 += step, p6 += step, p9 += step, b += 32)            \
        {                                                                                                     \
            __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);                                       \
            const char *base[4] = {p0, p3, p6, p9};                                                           \
            _Pragma("GCC unroll 12") for (int i = 0; i < MR; i++)                                             \
            {                                                                                                 \
                __m512 ai = _mm512_set1_ps(*(const float *)(base[i / 3] + i % 3 * r));                        \
                acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);                                               \
                acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);                                               \
            }                                                                                                 \
        }                                                                                                     \
        C_TILE_512_STORE(acc, MR);                                                                            \
    }
K_AVX512(k_avx512, 12)
K_AVX512(k_avx512_8, 8)
K_AVX512(k_avx512_4, 4)

/* vdpbf16ps: each f32 lane adds the products of one pair of bf16 along K, so a k-step
 * is a pair: A's pair for row i is one 32-bit word broadcast, B's pairs for 16 columns
 * are one register. */
__attribute__((target("avx512f,avx512bf16"))) static void k_avx512bf16(int64_t steps, const void *pa, int64_t ars,
                                                                      int64_t acs, const void *pb, float *c,
                                                                      int64_t ldc, bool add)
{
    (void)ars, (void)acs;
    enum { MR = 12 };
    const uint32_t *a = pa;
    const uint16_t *b = pb;
    __m512 acc[MR][2];
    C_TILE_512_LOAD(acc, MR);
    for (int64_t k = 0; k < steps; k++, a += MR, b += 64) {
        __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 32);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
    C_TILE_512_STORE(acc, MR);
}
/* AMX: eight tile registers of 16 rows x 64 bytes. Tiles 0-3 hold the 32 x 32 f32
 * block of C, 4-5 the two 16-row halves of A's 32 x 32 bf16 k-step, 6-7 the two
 * 16-column halves of B's, each as 16 rows of k-pairs (32 bf16: 16 columns x 2);
 * tdpbf16ps adds a 16 x 32 by 32 x 16 product into a C tile. A thread configures its
 * tiles once (the configuration is per thread and kept by the kernel's context switch). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;
static _Thread_local bool amx_configured;

__attribute__((target("amx-tile,amx-bf16,sse"))) static void k_amx(int64_t steps, const void *pa, int64_t ars, int64_t acs,
                                                                const void *pb, float *c, int64_t ldc, bool add)
{
    (void)ars, (void)acs;
    if (!amx_configured) {
        amx_config cfg = {.palette = 1};
        for (int i = 0; i < 8; i++) {
            cfg.colsb[i] = 64;
            cfg.rows[i] = 16;
        }
        _tile_loadconfig(&cfg);
        amx_configured = true;
    }
    const char *a = pa, *b = pb;
    size_t stride = sizeof(float) * (size_t)ldc;
    if (add) {
        _tile_loadd(0, c, stride);
        _tile_loadd(1, c + 16, stride);
        _tile_loadd(2, c + 16 * ldc, stride);
        _tile_loadd(3, c + 16 * ldc + 16, stride);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < steps; k++, a += 2048, b += 2048) {
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + 1024, 64);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 1024, 64);
        /* B's next k-step (or the next panel's first) into L1 while the unit works:
         * 3-4% on the config S shapes, docs/perf-log.md */
        for (int l = 0; l < 32; l++) _mm_prefetch(b + 2048 + 64 * l, _MM_HINT_T0);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + 16 * ldc, stride);
    _tile_stored(3, c + 16 * ldc + 16, stride);
}

/* Linux hands out AMX's tile state only to a process that asks (arch_prctl). */
static bool amx_permitted;
static void amx_ask(void)
{
    amx_permitted = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                    syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}
#endif

/* Every kernel, best first for each compute type. A bf16 product of two bf16 values is
 * exact in f32, so the f32 kernels on bf16-rounded panels compute bf16 GEMMs where the
 * processor lacks AVX512-BF16 (summing one product at a time where vdpbf16ps adds a
 * pair before the accumulator). */
static const ukernel kernels[] = {
#if defined(__x86_64__)
    {.name = "amx-bf16", .isa = KILN__GEMM_ISA_AMX, .packed = KILN__GEMM_BF16, .mr = 32, .nr = 32, .kstep = 32, .run = k_amx, .amx = true},
    {.name = "avx512-bf16", .isa = KILN__GEMM_ISA_AVX512BF16, .packed = KILN__GEMM_BF16, .mr = 12, .nr = 32, .kstep = 2, .run = k_avx512bf16},
    {.name = "avx512", .isa = KILN__GEMM_ISA_AVX512, .packed = KILN__GEMM_F32, .mr = 12, .nr = 32, .kstep = 1, .run = k_avx512, .rows4 = k_avx512_4, .rows8 = k_avx512_8},
    {.name = "avx512 (bf16 values)", .isa = KILN__GEMM_ISA_AVX512, .packed = KILN__GEMM_F32, .mr = 12, .nr = 32, .kstep = 1, .run = k_avx512, .rows4 = k_avx512_4, .rows8 = k_avx512_8, .round_bf16 = true},
    {.name = "avx2", .isa = KILN__GEMM_ISA_AVX2, .packed = KILN__GEMM_F32, .mr = 6, .nr = 16, .kstep = 1, .run = k_avx2},
    {.name = "avx2 (bf16 values)", .isa = KILN__GEMM_ISA_AVX2, .packed = KILN__GEMM_F32, .mr = 6, .nr = 16, .kstep = 1, .run = k_avx2, .round_bf16 = true},
#endif
    {.name = "c", .isa = KILN__GEMM_ISA_C, .packed = KILN__GEMM_F32, .mr = 4, .nr = 16, .kstep = 1, .run = k_c},
    {.name = "c (bf16 values)", .isa = KILN__GEMM_ISA_C, .packed = KILN__GEMM_F32, .mr = 4, .nr = 16, .kstep = 1, .run = k_c, .round_bf16 = true},
};

static bool runs_here(const ukernel *k)
{
#if defined(__x86_64__)
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (k->isa == KILN__GEMM_ISA_AMX) return pthread_once(&once, amx_ask) == 0 && amx_permitted;
    if ((k->isa == KILN__GEMM_ISA_AVX512 || k->isa == KILN__GEMM_ISA_AVX512BF16) && !__builtin_cpu_supports("avx512f"))
        return false;
    if (k->packed == KILN__GEMM_BF16 && !__builtin_cpu_supports("avx512bf16")) return false;
    if (k->isa == KILN__GEMM_ISA_AVX2 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return false;
#endif
    return true;
}

static const ukernel *pick(kiln__gemm_isa isa, kiln__gemm_type compute);

/* Multiply-adds a second of kernel k over panels a and b in L1, into tile c: the best of
 * five timings. */
static double kernel_rate(const ukernel *k, const void *a, const void *b, float *c)
{
    enum { STEPS = 128, REPS = 64 };
    double best = 0;
    for (int t = 0; t < 5; t++) {
        double t0 = kiln__now_s();
        for (int r = 0; r < REPS; r++) k->run(STEPS / k->kstep, a, 1, k->mr, b, c, k->nr, r > 0);
        double dt = kiln__now_s() - t0, rate = dt > 0 ? (double)STEPS * REPS * k->mr * k->nr / dt : 0;
        if (rate > best) best = rate;
    }
    return best;
}

/* Whether vdpbf16ps pays here. It does two multiply-adds per lane where an FMA does one,
 * but not every processor runs it at the FMA's rate: on Sapphire Rapids without AMX (a
 * virtual machine that hides it) it ran at 0.44 of the f32 FMAs' flops
 * (bench_fma_peak, docs/perf-log.md). So at first use both kernels run on panels in L1,
 * in turn, the best of several tries each, and vdpbf16ps is taken only when it gives at
 * least 1.25 times the f32 kernel's multiply-adds a second: a margin that keeps the
 * choice (and so the bits of every bf16 GEMM, which differ between the two in the
 * rounding of their sums) the same from run to run on one machine, unless the two are
 * close, where either is as good. KILN_OPT_GEMM_DPBF16=0 never takes it. */
static bool dpbf16_wins;
static void dpbf16_measure(void)
{
    const ukernel *dp = pick(KILN__GEMM_ISA_AVX512BF16, KILN__GEMM_BF16), *fma = pick(KILN__GEMM_ISA_AVX512, KILN__GEMM_BF16);
    if (!dp || !fma) {
        dpbf16_wins = dp != NULL;
        return;
    }
    /* zero panels (128 k of 32 rows or columns: 16 KiB in f32) and a tile of C */
    void *a = aligned_alloc(64, 128 * 32 * 4), *b = aligned_alloc(64, 128 * 32 * 4);
    float *c = aligned_alloc(64, MR_MAX * NR_MAX * 4);
    if (a && b && c) {
        memset(a, 0, 128 * 32 * 4);
        memset(b, 0, 128 * 32 * 4);
        double rd = 0, rf = 0;
        for (int round = 0; round < 3; round++) { /* in turn, so that a drift moves both */
            double x = kernel_rate(dp, a, b, c), y = kernel_rate(fma, a, b, c);
            rd = x > rd ? x : rd;
            rf = y > rf ? y : rf;
        }
        dpbf16_wins = rd >= 1.25 * rf;
    }
    free(a), free(b), free(c);
}

static bool dpbf16_pays(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!kiln__opt(KILN__OPT_GEMM_DPBF16)) return false;
    pthread_once(&once, dpbf16_measure);
    return dpbf16_wins;
}

/* The first kernel for `compute` that runs here (and is of `isa` unless AUTO; AUTO
 * passes over vdpbf16ps where it does not pay). */
static const ukernel *pick(kiln__gemm_isa isa, kiln__gemm_type compute)
{
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        const ukernel *k = &kernels[i];
        bool computes_bf16 = k->packed == KILN__GEMM_BF16 || k->round_bf16;
        if ((compute == KILN__GEMM_BF16) != computes_bf16) continue;
        if (!(isa == KILN__GEMM_ISA_AUTO || k->isa == isa) || !runs_here(k)) continue;
        if (isa == KILN__GEMM_ISA_AUTO && k->isa == KILN__GEMM_ISA_AVX512BF16 && !dpbf16_pays()) continue;
        return k;
    }
    return NULL;
}

const char *kiln__gemm_kernel_name(kiln__gemm_type compute)
{
    const ukernel *k = pick(KILN__GEMM_ISA_AUTO, compute);
    return k ? k->name : "none";
}

kiln__gemm_isa kiln__gemm_kernel_isa(kiln__gemm_type compute)
{
    const ukernel *k = pick(KILN__GEMM_ISA_AUTO, compute);
    return k ? k->isa : KILN__GEMM_ISA_AUTO;
}

/* ---- packing ---- */

/* Copies `rows` rows of n floats (source rows ss apart, destination rows ds apart) and
 * zeroes each destination row from n up to `width`. Rows of up to 32 floats go in one or
 * two masked AVX-512 moves where the kernel has AVX-512, the loop compiled for it (a
 * memcpy call of 48 or 128 bytes a row costs more than the copy: 9% of a GEMM whose B
 * rows are 32 floats, and a call a row still 19% of a transposed-A GEMM). */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void copy_rows_avx512(float *d, int64_t ds, const float *s, int64_t ss,
                                                                 int64_t rows, int64_t n, int64_t width)
{
    __mmask16 lo = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    __mmask16 hi = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
    for (int64_t r = 0; r < rows; r++, d += ds, s += ss) {
        _mm512_mask_storeu_ps(d, width >= 16 ? 0xffff : (__mmask16)((1u << width) - 1), _mm512_maskz_loadu_ps(lo, s));
        if (width > 16)
            _mm512_mask_storeu_ps(d + 16, width >= 32 ? 0xffff : (__mmask16)((1u << (width - 16)) - 1),
                                  _mm512_maskz_loadu_ps(hi, s + 16));
    }
}
#endif

/* `uk` tells whether the processor has AVX-512: its kernel does. */
static void copy_rows(const ukernel *uk, float *d, int64_t ds, const float *s, int64_t ss, int64_t rows, int64_t n,
                      int64_t width)
{
#if defined(__x86_64__)
    if (uk->isa == KILN__GEMM_ISA_AVX512 && width <= 32) {
        copy_rows_avx512(d, ds, s, ss, rows, n, width);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        memcpy(d + r * ds, s + r * ss, sizeof(float) * (size_t)n);
        memset(d + r * ds + n, 0, sizeof(float) * (size_t)(width - n));
    }
}

static float load(const kiln__gemm_operand *x, int64_t i)
{
    const uint16_t *h = x->p;
    return x->type == KILN__GEMM_F32    ? ((const float *)x->p)[i]
           : x->type == KILN__GEMM_BF16 ? kiln__bf16_to_f32(h[i])
                                        : kiln__f16_to_f32(h[i]);
}

#if defined(__x86_64__)
/* Packing for the AMX kernel, 16 elements at a time. lanes16 reads 16 contiguous
 * elements of an operand (f32 or bf16; lanes outside `m` read as zero) and gives each
 * one's bf16 bits in the low half of a 32-bit lane, rounded as kiln__f32_to_bf16 does
 * (nearest even, a NaN kept quiet), so that every path packs the same bits. */
#define AVX512_PACK __attribute__((target("avx512f,avx512bw,avx512vl")))
AVX512_PACK static inline __m512i lanes16(const kiln__gemm_operand *x, int64_t at, __mmask16 m)
{
    if (x->type == KILN__GEMM_BF16)
        return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x->p + at));
    __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, (const float *)x->p + at));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __mmask16 first_n(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* Transposes a 16 x 16 block of 32-bit words held in 16 registers (r[i] lane j becomes
 * r[j] lane i): pairs of words, then of double words, then 128-bit lanes twice. */
AVX512_PACK static inline void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* One f32 panel `tile` wide (a multiple of 16) of an operand whose K is contiguous
 * (ks == 1: a transposed B, as attention's K^T read from K), w of its tile elements
 * present: 16 x 16 blocks transposed in registers, where the plain loop went an element
 * at a time, writing a float every `tile` floats. */
AVX512_PACK static void pack_f32_k_contiguous(const float *src, int64_t ts, int64_t w, int64_t kc, int tile, float *out)
{
    __m512i r[16];
    for (int64_t h = 0; h < tile; h += 16)
        for (int64_t k0 = 0; k0 < kc; k0 += 16) {
            __mmask16 m = first_n(kc - k0);
            for (int c = 0; c < 16; c++)
                r[c] = h + c < w ? _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + (h + c) * ts + k0))
                                 : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t k = k0; k < k0 + 16 && k < kc; k++) _mm512_storeu_si512(out + k * tile + h, r[k - k0]);
        }
}

/* The 16 k-pairs of k = k0 .. k0 + 31 of a row (A) or column (B) whose k are
 * contiguous from `at`, zero past kc. */
AVX512_PACK static inline __m512i row_pairs(const kiln__gemm_operand *x, int64_t at, int64_t left)
{
    if (x->type == KILN__GEMM_BF16) { /* 32 bf16 along k are the 16 pairs as they lie */
        __mmask32 m = left >= 32 ? 0xffffffffu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1);
        return _mm512_maskz_loadu_epi16(m, (const uint16_t *)x->p + at);
    }
    __m512i lo = lanes16(x, at, first_n(left)), hi = lanes16(x, at + 16, first_n(left - 16));
    return _mm512_or_si512(
        _mm512_permutex2var_epi32(lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi),
        _mm512_slli_epi32(
            _mm512_permutex2var_epi32(lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi),
            16));
}

/* One 32-wide AMX panel of an operand whose tile dim (ts == 1) or K (ks == 1) is
 * contiguous: A panels are 32 rows of 32 k a k-step (row t's 16 pair words together);
 * B panels two 16-column halves of 16 k-pairs (pair p's 16 column words together).
 * Where the operand's order is the other one, 16 x 16 blocks of words are transposed
 * in registers. Returns false for other layouts (the generic packer takes them). */
AVX512_PACK static bool pack_amx(const kiln__gemm_operand *x, bool is_b, int64_t first, int64_t ts, int64_t ks,
                                 int64_t w, int64_t kc, uint16_t *out)
{
    int64_t groups = (kc + 31) / 32;
    uint32_t *ow = (uint32_t *)out;
    __m512i r[16];
    if (ks == 1) { /* each row (A) or column (B) holds its k contiguously */
        for (int64_t g = 0; g < groups; g++)
            for (int64_t h = 0; h < 2; h++) {
                for (int64_t c = 0; c < 16; c++) {
                    int64_t t = h * 16 + c;
                    r[c] = t < w ? row_pairs(x, first + t * ts + g * 32, kc - g * 32) : _mm512_setzero_si512();
                }
                if (!is_b) { /* A: row t's pairs in a row */
                    for (int64_t c = 0; c < 16; c++) _mm512_storeu_si512(ow + (g * 32 + h * 16 + c) * 16, r[c]);
                } else { /* B: pair p of the half's 16 columns in a row */
                    transpose16(r);
                    for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(ow + g * 512 + h * 256 + p * 16, r[p]);
                }
            }
        return true;
    }
    if (ts != 1) return false;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t h = 0; h < 2; h++) {
            __mmask16 m = first_n(w - h * 16);
            for (int64_t p = 0; p < 16; p++) { /* the 16 tile elements of the half at k-pair p */
                int64_t k = g * 32 + 2 * p;
                __m512i k0 = lanes16(x, first + k * ks + h * 16, k < kc ? m : 0);
                __m512i k1 = lanes16(x, first + (k + 1) * ks + h * 16, k + 1 < kc ? m : 0);
                r[p] = _mm512_or_si512(k0, _mm512_slli_epi32(k1, 16));
            }
            if (is_b) {
                for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(ow + g * 512 + h * 256 + p * 16, r[p]);
            } else { /* A: each row's 16 pairs in a row */
                transpose16(r);
                for (int64_t c = 0; c < 16; c++) _mm512_storeu_si512(ow + (g * 32 + h * 16 + c) * 16, r[c]);
            }
        }
    return true;
}

/* One `tile`-wide panel (tile <= 32) for the kernels on 16-bit products without AMX,
 * from a bf16 or f32 operand (f32 rounded to bf16 as lanes16 rounds), whose tile dim
 * (ts == 1) or K (ks == 1) is contiguous; false for other layouts. `pairs`: vdpbf16ps's
 * panel, for each k-pair the tile's 32-bit words (k even in the low half); else an f32
 * panel of bf16 values, for each k the tile's floats. Where K is contiguous, 16 x 16
 * blocks of words are transposed in registers. (The generic packer went an element at
 * a time: 30% of a bf16 training step on a processor without AMX.) */
AVX512_PACK static bool pack_16bit(const kiln__gemm_operand *x, bool pairs, int64_t first, int64_t ts, int64_t ks,
                                   int64_t w, int64_t kc, int tile, void *out)
{
    uint32_t *ow = out;
    int kstep = pairs ? 2 : 1;
    int64_t steps = (kc + kstep - 1) / kstep; /* k-steps of the panel */
    __m512i r[16];
    if (x->type == KILN__GEMM_F16 || (ts != 1 && ks != 1)) return false;
    for (int64_t h = 0; h < tile; h += 16) {
        __mmask16 m = first_n(w - h), keep = first_n(tile - h); /* elements present; lanes of the panel */
        if (ts == 1) { /* k-rows of the tile: one or two 16-lane loads a k-step */
            for (int64_t s = 0; s < steps; s++) {
                __m512i v;
                if (pairs) {
                    int64_t k = 2 * s;
                    __m512i k0 = lanes16(x, first + k * ks + h, m);
                    __m512i k1 = lanes16(x, first + (k + 1) * ks + h, k + 1 < kc ? m : 0);
                    v = _mm512_or_si512(k0, _mm512_slli_epi32(k1, 16));
                } else {
                    v = _mm512_slli_epi32(lanes16(x, first + s * ks + h, m), 16);
                }
                _mm512_mask_storeu_epi32(ow + s * tile + h, keep, v);
            }
            continue;
        }
        /* K contiguous: 16 k-steps of 16 tile elements, transposed */
        for (int64_t s0 = 0; s0 < steps; s0 += 16) {
            for (int c = 0; c < 16; c++) {
                int64_t t = h + c, at = first + t * ts + s0 * kstep, left = kc - s0 * kstep;
                if (t >= w) r[c] = _mm512_setzero_si512();
                else if (pairs) r[c] = row_pairs(x, at, left);
                else r[c] = _mm512_slli_epi32(lanes16(x, at, first_n(left)), 16);
            }
            transpose16(r);
            for (int64_t s = s0; s < s0 + 16 && s < steps; s++) _mm512_mask_storeu_epi32(ow + s * tile + h, keep, r[s - s0]);
        }
    }
    return true;
}

AVX512_PACK static void to_bf16_avx512(const float *src, uint16_t *dst, int64_t n)
{
    kiln__gemm_operand x = {src, KILN__GEMM_F32, 0, 1};
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first_n(n - i);
        _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(lanes16(&x, i, m)));
    }
}

AVX512_PACK static void from_bf16_avx512(const uint16_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first_n(n - i);
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src + i));
        _mm512_mask_storeu_ps(dst + i, m, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
}
#endif

static bool avx512_rows(void)
{
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
}

void kiln__f32_to_bf16_n(const float *src, uint16_t *dst, int64_t n)
{
#if defined(__x86_64__)
    if (avx512_rows()) {
        to_bf16_avx512(src, dst, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = kiln__f32_to_bf16(src[i]);
}

void kiln__bf16_to_f32_n(const uint16_t *src, float *dst, int64_t n)
{
#if defined(__x86_64__)
    if (avx512_rows()) {
        from_bf16_avx512(src, dst, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = kiln__bf16_to_f32(src[i]);
}

/* Packs `tile`-wide micro-panels of an operand's block: element (t, k) of the block, t in
 * [0, nt) along the tile dim (stride ts) and k in [0, kc) along K (stride ks), starting
 * at `first`. A panel holds, for each k-step, `tile` groups of kstep values; what lies
 * past nt or kc is zero. Panels follow each other, kpad = kc rounded up to kstep long. */
static void pack(const ukernel *uk, const kiln__gemm_operand *x, bool is_b, int64_t first, int64_t ts, int64_t ks,
                 int64_t nt, int64_t kc, int tile, void *out)
{
    int kstep = uk->kstep;
    int64_t kpad = (kc + kstep - 1) / kstep * kstep;
    float *of = out;
    uint16_t *oh = out;
    for (int64_t t0 = 0; t0 < nt; t0 += tile) {
        int64_t w = nt - t0 < tile ? nt - t0 : tile;
#if defined(__x86_64__)
        /* in registers: AMX's panels, and the 16-bit products' panels of the AVX-512 kernels */
        bool bf16 = uk->packed == KILN__GEMM_BF16;
        if (uk->amx ? pack_amx(x, is_b, first + t0 * ts, ts, ks, w, kc, oh)
                    : (uk->isa == KILN__GEMM_ISA_AVX512 || uk->isa == KILN__GEMM_ISA_AVX512BF16) &&
                          (uk->round_bf16 || bf16) && avx512_rows() &&
                          pack_16bit(x, bf16, first + t0 * ts, ts, ks, w, kc, tile, bf16 ? (void *)oh : (void *)of)) {
            of += kpad * tile;
            oh += kpad * tile;
            continue;
        }
        if (uk->isa == KILN__GEMM_ISA_AVX512 && uk->packed == KILN__GEMM_F32 && !uk->round_bf16 &&
            x->type == KILN__GEMM_F32 && ks == 1 && ts != 1 && tile % 16 == 0 && kiln__opt(KILN__OPT_PACK_TRANSPOSED) &&
            avx512_rows()) {
            pack_f32_k_contiguous((const float *)x->p + first + t0 * ts, ts, w, kc, tile, of);
            of += kpad * tile;
            oh += kpad * tile;
            continue;
        }
#endif
        if (uk->packed == KILN__GEMM_F32 && !uk->round_bf16 && x->type == KILN__GEMM_F32 && ts == 1 && w == tile) {
            const float *src = (const float *)x->p + first + t0;
            copy_rows(uk, of, tile, src, ks, kc, tile, tile);
        } else if (uk->packed == KILN__GEMM_F32 && !uk->round_bf16 && x->type == KILN__GEMM_F16 && (ts == 1 || ks == 1)) {
            /* f16 widened as it is packed: k-rows of the panel (tile dim contiguous), or
             * one tile element's kc values at a time (K contiguous; kc <= KC) */
            const uint16_t *src = (const uint16_t *)x->p + first + t0 * ts;
            float col[KILN__GEMM_KC];
            for (int64_t k = 0; ts == 1 && k < kc; k++) {
                kiln__f16_to_f32_n(src + k * ks, of + k * tile, w);
                memset(of + k * tile + w, 0, sizeof(float) * (size_t)(tile - w));
            }
            for (int t = 0; ts != 1 && t < tile; t++) {
                if (t < w) kiln__f16_to_f32_n(src + t * ts, col, kc);
                for (int64_t k = 0; k < kc; k++) of[k * tile + t] = t < w ? col[k] : 0.0f;
            }
        } else if (uk->packed == KILN__GEMM_F32 && !uk->round_bf16 && x->type == KILN__GEMM_F32 && ks == 1) {
            for (int t = 0; t < tile; t++) {
                const float *src = (const float *)x->p + first + (t0 + t) * ts;
                if (t < w)
                    for (int64_t k = 0; k < kc; k++) of[k * tile + t] = src[k];
                else
                    for (int64_t k = 0; k < kc; k++) of[k * tile + t] = 0.0f;
            }
        } else {
            for (int64_t k = 0; k < kpad; k++)
                for (int t = 0; t < tile; t++) {
                    float v = t < w && k < kc ? load(x, first + (t0 + t) * ts + k * ks) : 0.0f;
                    int64_t at = (k / kstep * tile + t) * kstep + k % kstep;
                    if (is_b && uk->amx) /* 16-column halves of k-pairs */
                        at = k / kstep * tile * kstep + t / 16 * 16 * kstep + k % kstep / 2 * 32 + t % 16 * 2 + k % 2;
                    if (uk->packed == KILN__GEMM_BF16) oh[at] = kiln__f32_to_bf16(v);
                    else of[at] = uk->round_bf16 ? kiln__bf16_to_f32(kiln__f32_to_bf16(v)) : v;
                }
        }
        of += kpad * tile;
        oh += kpad * tile;
    }
}

/* ---- the driver ---- */

/* Each thread keeps its packing buffers between calls (slot 0: the caller's packed B,
 * slot 1: an item's packed A, slot 2: an item's f32 sums when C is bf16, slot 3: the
 * product kiln__gemm_f32_serial adds in, slot 4: a K-outer item's own K block of B):
 * fresh memory would cost page faults on every GEMM. A thread's buffers are freed when
 * it exits. */
typedef struct {
    void *p[5];
    size_t n[5];
} buffers;
static pthread_key_t buffers_key;
static pthread_once_t buffers_once = PTHREAD_ONCE_INIT;
static void buffers_free(void *v)
{
    buffers *b = v;
    for (int i = 0; i < 5; i++) free(b->p[i]);
    free(b);
}
static void buffers_init(void) { pthread_key_create(&buffers_key, buffers_free); }

static atomic_bool refuse_buffers; /* kiln__gemm_refuse_buffers */
void kiln__gemm_refuse_buffers(bool refuse) { atomic_store(&refuse_buffers, refuse); }

static void *buffer(int slot, size_t bytes)
{
    if (atomic_load_explicit(&refuse_buffers, memory_order_relaxed)) return NULL;
    pthread_once(&buffers_once, buffers_init);
    buffers *b = pthread_getspecific(buffers_key);
    if (!b && (!(b = calloc(1, sizeof *b)) || pthread_setspecific(buffers_key, b))) {
        free(b);
        return NULL;
    }
    bytes = (bytes + 63) / 64 * 64;
    if (b->n[slot] < bytes) {
        void *p = aligned_alloc(64, bytes);
        if (!p) return NULL;
        free(b->p[slot]);
        b->p[slot] = p;
        b->n[slot] = bytes;
    }
    return b->p[slot];
}

typedef struct {
    const ukernel *uk;
    int64_t M, N, K, kc_max;
    kiln__gemm_operand A, B;
    float *C;         /* f32 C, or NULL when the result is bf16 or f16 */
    uint16_t *Cb;     /* bf16 C when the products are bf16's, else f16 C: an item sums into its own f32
                       * block, then rounds it here */
    int64_t ldc;
    bool accumulate;
    size_t es;         /* bytes per packed element */
    int64_t c0, nc;    /* this round's columns of B and C */
    int64_t npanels;   /* NR panels in the round */
    char *bpack;       /* the round's packed B: K block by K block, each npanels panels */
    int64_t mc, mblocks, panels_per_group, ngroups;
    int64_t tq, tr; /* row block b has tq + (b < tr) tiles: the first tr one more */
    float alpha;    /* f32 C, not accumulating: each tile scaled by it once whole, in L1 */
    kiln__epilogue *epi; /* run on each item's rows once they are rounded, or NULL */
    bool edge_rows;               /* KILN_OPT_GEMM_EDGE_ROWS */
    const kiln__gemm_panels *pre; /* B packed by the caller (kiln__gemm_f32_serial_panels), or NULL */
    int64_t pre_k0, pre_p0;       /* where this product's B starts in it: row, panel */
    bool failed;
} job;

static int64_t kpad_of(const job *j, int64_t kc) { return (kc + j->uk->kstep - 1) / j->uk->kstep * j->uk->kstep; }

/* Where K block starting at k0 (length kc) of panel p lies in the packed B. */
static char *bpanel(const job *j, int64_t k0, int64_t kc, int64_t p)
{
    if (j->pre) /* panels of all K rows in order: any K block of any panel is in place */
        return (char *)(j->pre->p + ((j->pre_p0 + j->c0 / j->uk->nr + p) * j->pre->K + j->pre_k0 + k0) * j->uk->nr);
    return j->bpack + ((k0 * j->npanels + p * kpad_of(j, kc)) * j->uk->nr) * (int64_t)j->es;
}

static void pack_b_range(void *ctx, int64_t begin, int64_t end)
{
    const job *j = ctx;
    int nr = j->uk->nr;
    for (int64_t p = begin; p < end; p++)
        for (int64_t k0 = 0; k0 < j->K; k0 += j->kc_max) {
            int64_t kc = j->K - k0 < j->kc_max ? j->K - k0 : j->kc_max;
            int64_t col = j->c0 + p * nr, w = j->c0 + j->nc - col < nr ? j->c0 + j->nc - col : nr;
            pack(j->uk, &j->B, true, k0 * j->B.rs + col * j->B.cs, j->B.cs, j->B.rs, w, kc, nr, bpanel(j, k0, kc, p));
        }
}

/* One MR x NR tile of C (row stride ldc); an edge tile runs the same kernel on a
 * full-size scratch tile (the kernel for at most 4 or 8 rows where there is one, with
 * KILN_OPT_GEMM_EDGE_ROWS), so that every element gets the same arithmetic wherever it
 * lies. */
static void tile(const job *j, int64_t steps, const void *a, int64_t ars, int64_t acs, const void *b, float *c,
                 int64_t ldc, int64_t m, int64_t n, bool add)
{
    const ukernel *uk = j->uk;
    ukernel_fn run = uk->run;
    int64_t rows = uk->mr;
    if (m < uk->mr && j->edge_rows) {
        if (m <= 4 && uk->rows4) run = uk->rows4, rows = 4;
        else if (m <= 8 && uk->rows8) run = uk->rows8, rows = 8;
    }
    if (m == rows && n == uk->nr) {
        run(steps, a, ars, acs, b, c, ldc, add);
        return;
    }
    float t[MR_MAX * NR_MAX] = {0};
    for (int64_t i = 0; i < m && add; i++) memcpy(t + i * uk->nr, c + i * ldc, sizeof(float) * (size_t)n);
    run(steps, a, ars, acs, b, t, uk->nr, add);
    for (int64_t i = 0; i < m; i++) memcpy(c + i * ldc, t + i * uk->nr, sizeof(float) * (size_t)n);
}

/* Where an f32 kernel reads rows [r, r + m) of A in K block [k0, k0 + kc): tile q (rows
 * r + q MR ...) starts at p + q * tile and has element (i, k) at [i * rs + k * cs].
 * Row-major A whose row stride spreads a tile's rows over L1's sets is read in place;
 * row-major A with rows a multiple of 2 KiB apart (which share one or two of L1's 64
 * sets and evict the packed B: measured 0.71 of OpenBLAS read in place,
 * docs/perf-log.md) is copied row by row with a padded stride; a transposed A, whose
 * k-th column of a tile is MR adjacent values, is packed into panels (MR values a k),
 * 16 at a time. Rows past m up to a whole tile are zero. A copy holds the same values
 * as A, so every path gives the same sums. */
typedef struct {
    const float *p;
    int64_t rs, cs, tile;
} a_view;

/* f16 A: never read in place; widened row by row into the padded stride, or (A
 * transposed) into panels of MR values a k, as f32 A would be copied. */
static a_view a_rows_f16(const job *j, int64_t r, int64_t m, int64_t k0, int64_t kc, float *buf)
{
    const kiln__gemm_operand *A = &j->A;
    const uint16_t *src = (const uint16_t *)A->p + r * A->rs + k0 * A->cs;
    int mr = j->uk->mr;
    int64_t rows = (m + mr - 1) / mr * mr;
    if (A->rs == 1 && A->cs != 1) {
        for (int64_t t = 0; t < rows; t += mr) {
            int64_t w = m - t < mr ? m - t : mr;
            float *d = buf + t / mr * kc * mr;
            for (int64_t k = 0; k < kc; k++) {
                kiln__f16_to_f32_n(src + t + k * A->cs, d + k * mr, w);
                memset(d + k * mr + w, 0, sizeof(float) * (size_t)(mr - w));
            }
        }
        return (a_view){buf, 1, mr, kc * mr};
    }
    int64_t ld = (kc + 15) / 16 * 16 + 16;
    for (int64_t i = 0; i < rows; i++) {
        if (i < m && A->cs == 1) kiln__f16_to_f32_n(src + i * A->rs, buf + i * ld, kc);
        else
            for (int64_t k = 0; k < kc; k++) buf[i * ld + k] = i < m ? kiln__f16_to_f32(src[i * A->rs + k * A->cs]) : 0.0f;
    }
    return (a_view){buf, ld, 1, mr * ld};
}

static a_view a_rows(const job *j, int64_t r, int64_t m, int64_t k0, int64_t kc, float *buf)
{
    const kiln__gemm_operand *A = &j->A;
    if (A->type == KILN__GEMM_F16) return a_rows_f16(j, r, m, k0, kc, buf);
    const float *src = (const float *)A->p + r * A->rs + k0 * A->cs;
    int mr = j->uk->mr;
    int64_t rows = (m + mr - 1) / mr * mr;
    if (A->cs == 1 && A->rs * 4 % 2048 != 0 && m == rows) return (a_view){src, A->rs, 1, mr * A->rs};
    if (A->rs == 1 && A->cs != 1) {
        for (int64_t t = 0; t < rows; t += mr)
            copy_rows(j->uk, buf + t / mr * kc * mr, mr, src + t, A->cs, kc, m - t < mr ? m - t : mr, mr);
        return (a_view){buf, 1, mr, kc * mr};
    }
    int64_t ld = (kc + 15) / 16 * 16 + 16;
    for (int64_t i = 0; i < rows; i++) {
        if (i < m && A->cs == 1) memcpy(buf + i * ld, src + i * A->rs, sizeof(float) * (size_t)kc);
        else
            for (int64_t k = 0; k < kc; k++) buf[i * ld + k] = i < m ? src[i * A->rs + k * A->cs] : 0.0f;
    }
    return (a_view){buf, ld, 1, mr * ld};
}

/* c (rows x n, n at most NR, row stride ldc) *= j->alpha, once its sums are whole (in
 * L1): in AVX-512 registers where the kernel is AVX-512's (a tile of attention's
 * scores: the scalar loop cost about as much as a third of the kernel's K = 64 sums),
 * the same products either way. */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void scale_tile_avx512(float *c, int64_t ldc, int64_t rows, int64_t n,
                                                                  float alpha)
{
    __m512 a = _mm512_set1_ps(alpha);
    __mmask16 lo = first_n(n), hi = first_n(n - 16);
    for (int64_t r = 0; r < rows; r++, c += ldc) {
        _mm512_mask_storeu_ps(c, lo, _mm512_mul_ps(_mm512_maskz_loadu_ps(lo, c), a));
        if (hi) _mm512_mask_storeu_ps(c + 16, hi, _mm512_mul_ps(_mm512_maskz_loadu_ps(hi, c + 16), a));
    }
}
#endif
static void scale_tile(const job *j, float *c, int64_t ldc, int64_t rows, int64_t n)
{
#if defined(__x86_64__)
    if (j->uk->isa == KILN__GEMM_ISA_AVX512 && n <= 32) {
        scale_tile_avx512(c, ldc, rows, n, j->alpha);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        for (int64_t x = 0; x < n; x++) c[r * ldc + x] *= j->alpha;
}

/* Row block mb's rows: [*r0, *r0 + *m) (tq + 1 tiles for the first tr blocks, tq after). */
static void block_rows(const job *j, int64_t mb, int64_t *r0, int64_t *m)
{
    *r0 = (mb * j->tq + (mb < j->tr ? mb : j->tr)) * j->uk->mr;
    *m = (j->tq + (mb < j->tr)) * j->uk->mr;
    if (*m > j->M - *r0) *m = j->M - *r0;
}

/* An f32 item's buffer for A (slot 1), in floats, and where the f32 kernels read rows
 * [r0, r0 + m) of A in K block k0: the whole tiles (*av), then the last partial one
 * (*edge, copied on its own after the room a_rows may take for the whole ones, so that
 * the whole ones can still be read in place). */
static int64_t a_floats(const job *j) { return (j->mc + j->uk->mr + 32) * (j->kc_max + 32); }
static void a_block(const job *j, int64_t r0, int64_t m, int64_t k0, int64_t kc, float *apack, a_view *av,
                    a_view *edge)
{
    int64_t whole = m / j->uk->mr * j->uk->mr;
    *av = a_rows(j, r0, whole, k0, kc, apack);
    *edge = whole < m ? a_rows(j, r0 + whole, m - whole, k0, kc, apack + (j->mc + 16) * (j->kc_max + 32)) : (a_view){0};
}

/* Tile i (its first row in the item) of an f32 item in K block [k0, k0 + kc): A from
 * the whole tiles' view or the edge's, then scaled by alpha once its sums are whole. */
static void f32_tile(const job *j, int64_t k0, int64_t kc, const a_view *av, const a_view *edge, int64_t whole,
                     int64_t i, const void *b, float *c, int64_t ldc, int64_t rows, int64_t n, bool add)
{
    if (i < whole) tile(j, kc, av->p + i / j->uk->mr * av->tile, av->rs, av->cs, b, c, ldc, rows, n, add);
    else tile(j, kc, edge->p, edge->rs, edge->cs, b, c, ldc, rows, n, add);
    if (j->alpha != 1 && k0 + kc == j->K) scale_tile(j, c, ldc, rows, n);
}

static void items(void *ctx, int64_t begin, int64_t end)
{
    job *j = ctx;
    const ukernel *uk = j->uk;
    bool f32 = uk->packed == KILN__GEMM_F32 && !uk->round_bf16 && j->A.type != KILN__GEMM_BF16;
    size_t abytes = f32 ? sizeof(float) * (size_t)a_floats(j) : (size_t)(j->mc * kpad_of(j, j->kc_max)) * j->es;
    void *apack = buffer(1, abytes);
    /* bf16 C: the item's m x (its panels' columns) f32 sums, rounded once at its end */
    int64_t sld = j->panels_per_group * uk->nr;
    float *sums = j->Cb ? buffer(2, sizeof(float) * (size_t)(j->mc * sld)) : NULL;
    if (!apack || (j->Cb && !sums)) {
        j->failed = true; /* a benign race: every writer stores true */
        return;
    }
    for (int64_t it = begin; it < end; it++) {
        int64_t mb = it % j->mblocks, g = it / j->mblocks, r0, m;
        block_rows(j, mb, &r0, &m);
        int64_t p0 = g * j->panels_per_group, p1 = p0 + j->panels_per_group;
        if (p1 > j->npanels) p1 = j->npanels;
        /* where tile (i, p) of the item goes: C itself, or the item's sums (whose
         * column 0 is the item's first panel) */
        float *cbase = j->Cb ? sums : j->C + r0 * j->ldc + j->c0;
        int64_t cld = j->Cb ? sld : j->ldc, ccol0 = j->Cb ? p0 * uk->nr : 0;
        for (int64_t k0 = 0; k0 < j->K; k0 += j->kc_max) {
            int64_t kc = j->K - k0 < j->kc_max ? j->K - k0 : j->kc_max, kpad = kpad_of(j, kc);
            int64_t whole = m / uk->mr * uk->mr;
            a_view av = {0}, edge = {0};
            if (f32) {
                a_block(j, r0, m, k0, kc, apack, &av, &edge);
            } else {
                pack(uk, &j->A, false, r0 * j->A.rs + k0 * j->A.cs, j->A.rs, j->A.cs, m, kc, uk->mr, apack);
            }
            bool add = k0 > 0 || j->accumulate;
            /* Row tiles outermost: an A tile is then read from L1 for every panel, and
             * the packed B streams past in order (faster than panels outermost on the
             * config S shapes: AMX 5%, AVX-512 3-7%, docs/perf-log.md). */
            int64_t ni = (m + uk->mr - 1) / uk->mr, np = p1 - p0;
            for (int64_t q = 0; q < ni * np; q++) {
                int64_t i = q / np * uk->mr, p = p0 + q % np;
                int64_t col = p * uk->nr, n = j->nc - col < uk->nr ? j->nc - col : uk->nr;
                const char *b = bpanel(j, k0, kc, p);
                float *c = cbase + i * cld + col - ccol0;
                int64_t rows = m - i < uk->mr ? m - i : uk->mr;
                if (f32) f32_tile(j, k0, kc, &av, &edge, whole, i, b, c, cld, rows, n, add);
                else /* (alpha is 1: kiln__gemm_f32_serial's operands are f32) */
                    tile(j, kpad / uk->kstep, (const char *)apack + i * kpad * (int64_t)j->es, 1, uk->mr, b, c, cld,
                         rows, n, add);
            }
        }
        if (j->Cb) { /* the item's sums are whole: round them once, while they are in cache */
            int64_t c0 = p0 * uk->nr, w = (p1 * uk->nr < j->nc ? p1 * uk->nr : j->nc) - c0;
            for (int64_t r = 0; r < m; r++) {
                uint16_t *d = j->Cb + (r0 + r) * j->ldc + j->c0 + c0;
                if (uk->packed == KILN__GEMM_F32 && !uk->round_bf16) kiln__f32_to_f16_n(sums + r * sld, d, w);
                else kiln__f32_to_bf16_n(sums + r * sld, d, w);
            }
            /* the item's rows are whole (it holds every column): the epilogue reads them
             * while they are in cache */
            if (j->epi) j->epi->fn(j->epi, r0, r0 + m);
        }
    }
}

/* The most panels of B a K-outer item packs (a K block of them 768 KiB on AVX-512, in
 * L2 beside its rows of A). */
#define KOUTER_PANELS 24

/* K-outer items (KILN_OPT_GEMM_K_OUTER): products with many K blocks and few rows, the
 * weight gradients X^T dY (M 256-1024, K 2048). Packing all of B first (6 MB for 2048 x
 * 768) sends each K block of it back to memory for the first row tile of every row
 * block, at the rate the kernel reads it (0.79-0.93 of OpenBLAS at one thread on these
 * shapes). Here an item is a block of rows and a group of B's panels: for each K block
 * it packs its panels' part of B and its rows' block of A itself, just before it sums
 * them, so both stay in L2 and no thread waits for another (the items share nothing;
 * each thread packs B for itself). The sums are kiln__gemm's: K blocks in order, each
 * through the same kernel. f32 C and kernels. */
static void kouter_items(void *ctx, int64_t begin, int64_t end)
{
    job *j = ctx;
    const ukernel *uk = j->uk;
    int nr = uk->nr, mr = uk->mr;
    float *apack = buffer(1, sizeof(float) * (size_t)a_floats(j));
    float *bp = buffer(4, sizeof(float) * (size_t)(KOUTER_PANELS * nr * j->kc_max));
    if (!apack || !bp) {
        j->failed = true; /* a benign race: every writer stores true */
        return;
    }
    for (int64_t it = begin; it < end; it++) {
        int64_t mb = it % j->mblocks, g = it / j->mblocks, r0, m;
        block_rows(j, mb, &r0, &m);
        int64_t whole = m / mr * mr, p0 = g * j->panels_per_group, p1 = p0 + j->panels_per_group;
        if (p1 > j->npanels) p1 = j->npanels;
        int64_t w = (p1 * nr < j->nc ? p1 * nr : j->nc) - p0 * nr; /* the group's columns */
        for (int64_t k0 = 0; k0 < j->K; k0 += j->kc_max) {
            int64_t kc = j->K - k0 < j->kc_max ? j->K - k0 : j->kc_max;
            pack(uk, &j->B, true, k0 * j->B.rs + (j->c0 + p0 * nr) * j->B.cs, j->B.cs, j->B.rs, w, kc, nr, bp);
            a_view av, edge;
            a_block(j, r0, m, k0, kc, apack, &av, &edge);
            bool add = k0 > 0 || j->accumulate;
            for (int64_t i = 0; i < m; i += mr)
                for (int64_t p = p0; p < p1; p++) {
                    int64_t col = p * nr, n = j->nc - col < nr ? j->nc - col : nr, rows = m - i < mr ? m - i : mr;
                    const float *b = bp + (p - p0) * kc * nr;
                    f32_tile(j, k0, kc, &av, &edge, whole, i, b, j->C + (r0 + i) * j->ldc + j->c0 + col, j->ldc, rows,
                             n, add);
                }
        }
    }
}

/* Whether kouter_items takes the product (see there) at nt threads: at least 4 K
 * blocks, M at most half of K and 1024 but at least 6 row tiles a thread (each thread
 * packs B's K blocks for itself), f32 throughout, no packed B given. */
static bool kouter_takes(const job *j, int64_t nt, const float *C, const kiln__gemm_panels *pre,
                         const kiln__epilogue *epi)
{
    return kiln__opt(KILN__OPT_GEMM_K_OUTER) && C && !pre && !epi && j->uk->packed == KILN__GEMM_F32 &&
           !j->uk->round_bf16 && j->A.type == KILN__GEMM_F32 && j->B.type == KILN__GEMM_F32 &&
           j->K >= 4 * j->kc_max && j->M <= j->K / 2 && j->M <= 1024 && j->M >= 6 * nt * j->uk->mr;
}

/* Runs the K-outer items over nt threads (kouter_takes said yes): a block of rows a
 * thread (equal tiles, the larger first), each with groups of whole panels, at most
 * KOUTER_PANELS: each thread packs B's K blocks for itself. Splitting the panels among
 * the threads instead (each packing all of A) was 1.5-2% slower in the two-thread step
 * over all the weight gradients, docs/perf-log.md; with KILN_OPT_GEMM_K_OUTER_PANELS it
 * is taken where B is wider than A is tall (N > M), where it packs less: each thread
 * then packs A (K x M) and its share of B, not its share of A and all of B (K x N). */
static bool run_k_outer(job *j, int64_t nt)
{
    int64_t tiles = (j->M + j->uk->mr - 1) / j->uk->mr;
    bool by_panels = nt > 1 && j->N > j->M && kiln__opt(KILN__OPT_GEMM_K_OUTER_PANELS);
    j->mblocks = by_panels ? 1 : nt; /* (a row split: kouter_takes gave each thread at least 6 tiles) */
    j->tq = tiles / j->mblocks, j->tr = tiles % j->mblocks, j->mc = (j->tq + (j->tr > 0)) * j->uk->mr;
    for (j->c0 = 0; j->c0 < j->N && !j->failed; j->c0 += NC) {
        j->nc = j->N - j->c0 < NC ? j->N - j->c0 : NC;
        j->npanels = (j->nc + j->uk->nr - 1) / j->uk->nr;
        j->ngroups = (j->npanels + KOUTER_PANELS - 1) / KOUTER_PANELS;
        if (by_panels) /* a multiple of the threads, as the panels allow */
            j->ngroups = (j->ngroups + nt - 1) / nt * nt;
        if (j->ngroups > j->npanels) j->ngroups = j->npanels;
        j->panels_per_group = (j->npanels + j->ngroups - 1) / j->ngroups;
        j->ngroups = (j->npanels + j->panels_per_group - 1) / j->panels_per_group;
        if (nt == 1) kouter_items(j, 0, j->ngroups);
        else kiln__parallel_items(j->mblocks * j->ngroups, kouter_items, j);
    }
    return !j->failed;
}

/* The driver: C f32 (C) or 16-bit (Cb, then not accumulating: bf16 for bf16 products,
 * f16 for f32 ones, as kiln__gemm_bf16 and kiln__gemm_f16 ask); over the pool, or on the
 * calling thread alone with `serial`. */
static bool run_on(bool serial, kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A,
                   kiln__gemm_operand B, float *C, uint16_t *Cb, int64_t ldc, bool accumulate, kiln__gemm_type compute,
                   kiln__epilogue *epi, float alpha, const kiln__gemm_panels *pre, int64_t pre_k0, int64_t pre_c0)
{
    assert(alpha == 1 || (C && !accumulate && compute == KILN__GEMM_F32 && A.type == KILN__GEMM_F32));
    /* (f16 operands are widened as packed, for the f32 kernels only) */
    assert(compute == KILN__GEMM_F32 || (A.type != KILN__GEMM_F16 && B.type != KILN__GEMM_F16));
    const ukernel *uk = pick(isa, compute);
    if (!uk) return false;
    if (M <= 0 || N <= 0) return true;
    if (N > NC || K <= 0) epi = NULL; /* an item holds every column only in a single round (below) */
    if (K <= 0) { /* (0 times alpha is 0) */
        for (int64_t i = 0; i < M && !accumulate; i++)
            if (Cb) memset(Cb + i * ldc, 0, sizeof(uint16_t) * (size_t)N);
            else memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
        return true;
    }
    job j = {.uk = uk, .M = M, .N = N, .K = K, .kc_max = KILN__GEMM_KC, .A = A, .B = B, .C = C, .Cb = Cb, .ldc = ldc,
             .accumulate = accumulate && !Cb, .es = uk->packed == KILN__GEMM_BF16 ? 2 : 4, .alpha = alpha,
             .edge_rows = kiln__opt(KILN__OPT_GEMM_EDGE_ROWS), .pre = pre, .pre_k0 = pre_k0, .pre_p0 = pre ? pre_c0 / uk->nr : 0};
    assert(!pre || (uk->nr == pre->nr && pre_c0 % uk->nr == 0 && pre_k0 + K <= pre->K));
    /* the threads that will run the items: one on this thread alone (serial, or called
     * inside a pool task, where kiln__parallel_for runs inline) */
    int64_t nt = !serial && !kiln__pool_inline() && kiln__pool_size() > 0 ? kiln__pool_size() : 1;
    if (kouter_takes(&j, nt, C, pre, epi)) return run_k_outer(&j, nt);
    /* Columns a round: NC, or (KILN_OPT_GEMM_NARROW_ROUNDS) as many as keep a K block of
     * packed B (KC rows, or all of a shorter K) within ROUND_BYTES, a multiple of NR:
     * with a K block of 4096 f32 columns (4 MiB) streamed from L3 by every row tile,
     * kiln's kernel ran 2048^3 6% and 4096^3 18-24% slower at one thread
     * (docs/perf-log.md). An epilogue needs an item to hold whole rows, so a product
     * with one (N within NC: see above) keeps a single round. */
    int64_t ncmax = NC;
    if (kiln__opt(KILN__OPT_GEMM_NARROW_ROUNDS) && !epi) {
        int64_t w = ROUND_BYTES / (kpad_of(&j, K < j.kc_max ? K : j.kc_max) * (int64_t)j.es) / uk->nr * uk->nr;
        if (w < ncmax) ncmax = w < uk->nr ? uk->nr : w;
    }
    int64_t kpacked = K / j.kc_max * j.kc_max + kpad_of(&j, K % j.kc_max);
    size_t bbytes = (size_t)kpacked * (size_t)((N < ncmax ? N : ncmax) + uk->nr) * j.es;
    j.bpack = pre ? NULL : buffer(0, bbytes);
    if (!pre && !j.bpack) return false;
    for (j.c0 = 0; j.c0 < N && !j.failed; j.c0 += ncmax) {
        j.nc = N - j.c0 < ncmax ? N - j.c0 : ncmax;
        j.npanels = (j.nc + uk->nr - 1) / uk->nr;
        if (pre) { /* packed already */
        } else if (serial) pack_b_range(&j, 0, j.npanels);
        else kiln__parallel_for(j.npanels, 4, pack_b_range, &j);
        /* Rows in blocks of at most 20 tiles, at least two blocks a thread where M
         * allows; when M is short the columns are split among the threads instead. */
        int64_t tiles = (M + uk->mr - 1) / uk->mr, per = (tiles + 2 * nt - 1) / (2 * nt);
        if (per > 20) per = 20;
        /* A bf16 result's item keeps its f32 sums (rows x the round's columns) in a
         * buffer of its own: at most about 512 KiB of them, or 4 tiles of rows, so that
         * they are still in L2 when rounded (3-12% on the config S shapes, perf log). */
        if (Cb) {
            int64_t cap = ((int64_t)512 << 10) / (4 * (j.nc + uk->nr) * uk->mr);
            if (cap < 4) cap = 4;
            if (per > cap) per = cap;
        }
        if (per < 1) per = 1;
        /* As many blocks as a multiple of the threads, of tiles / blocks tiles each (the
         * larger first), taken one at a time: they end level. Blocks of per tiles, the
         * last one short, in chunks of the pool's size left one thread up to 11% more
         * work on the config S step's shapes at two threads (docs/perf-log.md). */
        bool even = kiln__opt(KILN__OPT_GEMM_EVEN_BLOCKS);
        j.mblocks = (tiles + per - 1) / per;
        if (even && j.mblocks >= nt) j.mblocks = (j.mblocks + nt - 1) / nt * nt;
        if (j.mblocks > tiles) j.mblocks = tiles;
        j.tq = even ? tiles / j.mblocks : per;
        j.tr = even ? tiles % j.mblocks : 0;
        j.mc = (j.tq + (j.tr > 0)) * uk->mr;
        j.ngroups = j.mblocks >= 2 * nt || nt == 1 ? 1 : (2 * nt + j.mblocks - 1) / j.mblocks;
        if (j.ngroups > j.npanels) j.ngroups = j.npanels;
        j.panels_per_group = (j.npanels + j.ngroups - 1) / j.ngroups;
        j.ngroups = (j.npanels + j.panels_per_group - 1) / j.panels_per_group;
        j.epi = j.ngroups == 1 ? epi : NULL;
        if (serial) items(&j, 0, j.mblocks * j.ngroups);
        else if (even) kiln__parallel_items(j.mblocks * j.ngroups, items, &j);
        else kiln__parallel_for(j.mblocks * j.ngroups, 1, items, &j);
    }
    if (j.epi && !j.failed) j.epi->done = true;
    return !j.failed;
}

static bool run(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B,
                float *C, uint16_t *Cb, int64_t ldc, bool accumulate, kiln__gemm_type compute, kiln__epilogue *epi)
{
    return run_on(false, isa, M, N, K, A, B, C, Cb, ldc, accumulate, compute, epi, 1, NULL, 0, 0);
}

bool kiln__gemm_f32_serial(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, float alpha,
                           float beta, float *C, int64_t ldc)
{
    assert(beta == 0 || beta == 1);
    /* One thread runs every item in order, so the buffers are had before C is first
     * written: a failure leaves C as it was. */
    if (alpha == 1 || beta == 0) /* alpha is applied to each tile of C once its sums are whole */
        return run_on(true, KILN__GEMM_ISA_AUTO, M, N, K, A, B, C, NULL, ldc, beta != 0, KILN__GEMM_F32, NULL, alpha,
                      NULL, 0, 0);
    if (K <= 0 || M <= 0 || N <= 0) return true; /* C + alpha 0: C as it was, as cblas leaves it */
    float *t = buffer(3, sizeof(float) * (size_t)M * (size_t)N);
    if (!t || !run_on(true, KILN__GEMM_ISA_AUTO, M, N, K, A, B, t, NULL, N, false, KILN__GEMM_F32, NULL, 1, NULL, 0, 0))
        return false;
    for (int64_t i = 0; i < M; i++)
        for (int64_t c = 0; c < N; c++) C[i * ldc + c] += alpha * t[i * N + c];
    return true;
}

int64_t kiln__gemm_panel_width(void)
{
    const ukernel *uk = pick(KILN__GEMM_ISA_AUTO, KILN__GEMM_F32);
    return uk ? uk->nr : 0;
}

bool kiln__gemm_panels_init(kiln__gemm_panels *P, int64_t K, int64_t N)
{
    const ukernel *uk = pick(KILN__GEMM_ISA_AUTO, KILN__GEMM_F32);
    if (!uk || K < 1 || N < 1) return false;
    int64_t np = (N + uk->nr - 1) / uk->nr;
    size_t bytes = sizeof(float) * (size_t)(np * uk->nr) * (size_t)K;
    if (P->cap < bytes) {
        float *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!p) return false;
        free(P->p);
        P->p = p, P->cap = bytes;
    }
    P->K = K, P->N = N, P->nr = uk->nr;
    return true;
}

void kiln__gemm_panels_pack(kiln__gemm_panels *P, kiln__gemm_operand B)
{
    const ukernel *uk = pick(KILN__GEMM_ISA_AUTO, KILN__GEMM_F32);
    assert(uk && uk->nr == P->nr && B.type == KILN__GEMM_F32);
    /* each panel's K rows as one block: kstep is 1, so its layout is the K blocks' in turn */
    for (int64_t c = 0; c < P->N; c += P->nr)
        pack(uk, &B, true, c * B.cs, B.cs, B.rs, P->N - c < P->nr ? P->N - c : P->nr, P->K, (int)P->nr,
             P->p + c * P->K);
}

void kiln__gemm_panels_free(kiln__gemm_panels *P)
{
    free(P->p);
    *P = (kiln__gemm_panels){0};
}

bool kiln__gemm_f32_serial_panels(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, const kiln__gemm_panels *B,
                                  int64_t k0, int64_t c0, float alpha, float beta, float *C, int64_t ldc)
{
    assert(beta == 0 || beta == 1);
    if (alpha != 1 && beta != 0) return false;
    /* (B->nr is the kernel's: kiln__gemm_panels_init took it, and run_on asserts it) */
    if (c0 % B->nr || k0 + K > B->K || c0 + N > B->N) return false;
    return run_on(true, KILN__GEMM_ISA_AUTO, M, N, K, A, (kiln__gemm_operand){0}, C, NULL, ldc, beta != 0,
                  KILN__GEMM_F32, NULL, alpha, B, k0, c0);
}

bool kiln__gemm_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B,
                    float *C, int64_t ldc, bool accumulate, kiln__gemm_type compute)
{
    return run(isa, M, N, K, A, B, C, NULL, ldc, accumulate, compute, NULL);
}

bool kiln__gemm(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, float *C, int64_t ldc,
                bool accumulate, kiln__gemm_type compute)
{
    return run(KILN__GEMM_ISA_AUTO, M, N, K, A, B, C, NULL, ldc, accumulate, compute, NULL);
}

bool kiln__gemm_bf16_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A,
                          kiln__gemm_operand B, uint16_t *C, int64_t ldc)
{
    return run(isa, M, N, K, A, B, NULL, C, ldc, false, KILN__GEMM_BF16, NULL);
}

bool kiln__gemm_bf16(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, uint16_t *C,
                     int64_t ldc)
{
    return kiln__gemm_bf16_with(KILN__GEMM_ISA_AUTO, M, N, K, A, B, C, ldc);
}

bool kiln__gemm_bf16_epilogue(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B,
                              uint16_t *C, int64_t ldc, kiln__epilogue *epi)
{
    return run(KILN__GEMM_ISA_AUTO, M, N, K, A, B, NULL, C, ldc, false, KILN__GEMM_BF16, epi);
}

bool kiln__gemm_f16_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A,
                         kiln__gemm_operand B, uint16_t *C, int64_t ldc)
{
    return run(isa, M, N, K, A, B, NULL, C, ldc, false, KILN__GEMM_F32, NULL);
}

bool kiln__gemm_f16(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, uint16_t *C,
                    int64_t ldc)
{
    return kiln__gemm_f16_with(KILN__GEMM_ISA_AUTO, M, N, K, A, B, C, ldc);
}
