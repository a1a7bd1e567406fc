/* Attention over a paged KV cache, for the serving engine: each query row attends to
 * the positions 0..p of its own sequence, whose keys and values sit in fixed-size
 * blocks named by a block table. Every (row, head) is computed alone and in one fixed
 * order, so a row's result does not depend on which other rows share the call. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"
#include "core/opts.h"
#include "kiln/ops.h"

/* Eight lanes in GCC's vector extension: ymm registers in the AVX2 clone, plain code
 * in the default one; the accumulators are named variables so that they stay in
 * registers. */
typedef float v8 __attribute__((vector_size(32)));

/* Macros, not functions: a vector argument to a function outside the AVX2 clone would
 * change the calling convention. */
#define LOAD8(dst, p) memcpy(&(dst), (p), sizeof(v8))
#define LANES_SUM(l) ((((l)[0] + (l)[4]) + ((l)[2] + (l)[6])) + (((l)[1] + (l)[5]) + ((l)[3] + (l)[7])))

typedef struct {
    const float *q;
    const void *k, *v; /* f32, f16 or bf16 */
    const int32_t *bt, *sp;
    float *out;
    int64_t H, Hkv, D, bl, max_blocks, max_pos;
    int64_t hg, per_row; /* heads per task, tasks per row */
    float scale;
    atomic_int oom;
    int64_t window; /* the variant (kiln_paged_variant): 0 every position */
    float softcap;  /* 0 none */
    int alibi;      /* 0 none, 1 before the soft cap, 2 after it */
} paged_ctx;

/* The first position a row at position p reads: the window's start. */
static inline int64_t paged_first(int64_t p, int64_t window) { return window > 0 && p >= window ? p - window + 1 : 0; }

/* The kernel for each KV cache type: f32, and f16 or bf16 widened to f32 on load. */
#define PATTR __attribute__((target_clones("arch=x86-64-v3", "default")))
#define PINL static inline __attribute__((always_inline))
#define KT float
#define KLOAD8(dst, p) LOAD8(dst, p)
#define KSCALAR(x) (x)
#define PSFX f32
#include "backends/cpu/cpu_paged_impl.h"
#undef KT

#define KT uint16_t
#define PATTR __attribute__((target_clones("arch=x86-64-v3", "default")))
#define KLOAD8(dst, p)                                                                                  \
    do {                                                                                              \
        u16x8 b_;                                                                                     \
        memcpy(&b_, (p), sizeof b_);                                                                  \
        u32x8 w_ = __builtin_convertvector(b_, u32x8) << 16;                                          \
        memcpy(&(dst), &w_, sizeof w_);                                                               \
    } while (0)
#define KSCALAR(x) kiln__bf16_to_f32(x)
#define PSFX bf16
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#include "backends/cpu/cpu_paged_impl.h"

/* f16 eight values at a time, for the KV pages and the packed weights alike: with
 * F16C's vcvtph2ps (an intrinsic: GCC 12 widens a _Float16 vector one element at a
 * time, which made f16 pages slower than f32 ones) in kernels compiled for AVX2, FMA
 * and F16C and picked at run time where f16c_usable, and one element at a time. */
#define F16_EACH8(dst, p)                                                                               \
    do {                                                                                              \
        for (int l_ = 0; l_ < 8; l_++) (dst)[l_] = kiln__f16_to_f32((p)[l_]);                          \
    } while (0)
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define F16_V3 1
#define F16C_TARGET "avx2,fma,f16c"
#define F16C8(dst, p)                                                                                   \
    do {                                                                                              \
        __m256 f_ = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)));             \
        memcpy(&(dst), &f_, sizeof f_);                                                               \
    } while (0)
#define KSCALAR(x) kiln__f16_to_f32(x)
#define PATTR __attribute__((target(F16C_TARGET)))
#undef PINL
#define PINL static inline __attribute__((always_inline, target(F16C_TARGET)))
#define KLOAD8(dst, p) F16C8(dst, p)
#define PSFX f16v3
#include "backends/cpu/cpu_paged_impl.h"
#undef PINL
#define PINL static inline __attribute__((always_inline))
#else
#define F16_V3 0
#endif
#define PATTR
#define KSCALAR(x) kiln__f16_to_f32(x)
#define KLOAD8(dst, p) F16_EACH8(dst, p)
#define PSFX f16
#include "backends/cpu/cpu_paged_impl.h"
#undef KT
#undef PINL

/* Whether the F16C kernels (pages and packed weights) run here: KILN_OPT_F16C and the
 * processor has what they are compiled for. */
static bool f16c_usable(void)
{
#if F16_V3
    __builtin_cpu_init();
    return kiln__opt(KILN__OPT_F16C) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

/* The f16 kernel, chosen once. */
static kiln__range_fn f16_kernel = paged_range_f16;
static pthread_once_t f16_once = PTHREAD_ONCE_INIT;

static void f16_pick(void)
{
#if F16_V3
    if (f16c_usable()) f16_kernel = paged_range_f16v3;
#endif
}

static kiln__range_fn paged_kernel(kiln_dtype kv)
{
    if (kv == KILN_DTYPE_BF16) return paged_range_bf16;
    if (kv != KILN_DTYPE_F16) return paged_range_f32;
    pthread_once(&f16_once, f16_pick);
    return f16_kernel;
}

/* Every sequence index, position and block id is checked before any is used. */
static kiln_status check_pages(const int32_t *bt, const int32_t *sp, int64_t N, int64_t n_seqs, int64_t max_blocks,
                               int64_t bl, int64_t n_blocks, int64_t window)
{
    for (int64_t n = 0; n < N; n++) {
        int64_t seq = sp[n * 2], p = sp[n * 2 + 1];
        if (seq < 0 || seq >= n_seqs || p < 0 || p >= max_blocks * bl)
            return kiln__err(KILN_ERR_INDEX, "paged_attention: row %lld names sequence %lld position %lld; the block "
                             "table holds %lld sequences of %lld positions", (long long)n, (long long)seq, (long long)p,
                             (long long)n_seqs, (long long)(max_blocks * bl));
        for (int64_t j = paged_first(p, window) / bl; j <= p / bl; j++) {
            int32_t blk = bt[seq * max_blocks + j];
            if (blk < 0 || blk >= n_blocks)
                return kiln__err(KILN_ERR_INDEX, "paged_attention: block table row %lld entry %lld is %d, outside [0, %lld)",
                                 (long long)seq, (long long)j, blk, (long long)n_blocks);
        }
    }
    return KILN_OK;
}

kiln_status kiln__cpu_paged_attention(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *c[5], *tmp[5];
    kiln_status s = cpu_contig_n(in, 5, c, tmp, NULL) ? KILN_OK : kiln_last_status();
    int64_t N = s == KILN_OK ? c[0]->shape[0] : 0, bl = a->op.paged_attention.block_len;
    if (s == KILN_OK)
        s = check_pages(kiln__data(c[3]), kiln__data(c[4]), N, c[3]->shape[0], c[3]->shape[1], bl, c[1]->shape[0] / bl,
                        a->op.paged_attention.v.window);
    if (s == KILN_OK && N > 0) {
        paged_ctx k = {kiln__data(c[0]), kiln__data(c[1]), kiln__data(c[2]), kiln__data(c[3]), kiln__data(c[4]),
                       kiln__data(out[0]), c[0]->shape[1], c[1]->shape[1], c[0]->shape[2], bl, c[3]->shape[1],
                       c[3]->shape[1] * bl, 0, 0, (float)a->op.paged_attention.scale, 0,
                       a->op.paged_attention.v.window, (float)a->op.paged_attention.v.softcap,
                       a->op.paged_attention.v.alibi ? 1 + a->op.paged_attention.v.alibi_after_softcap : 0};
        /* Whole rows when there are enough of them to share out; else rows split into
         * head groups, so that one decoding sequence still uses every thread. */
        int64_t want = 2 * kiln__pool_size(), split = N >= want ? 1 : (want + N - 1) / N;
        if (split > k.H) split = k.H;
        k.hg = (k.H + split - 1) / split;
        k.per_row = (k.H + k.hg - 1) / k.hg;
        kiln__parallel_for(N * k.per_row, 1, paged_kernel(c[1]->dtype), &k);
        if (atomic_load(&k.oom)) s = kiln__err(KILN_ERR_OOM, "paged_attention: out of memory for a score buffer");
    }
    cpu_free_n(tmp, 5);
    return s;
}

/* ---- matmul_rows_packed: out (M,N) = a (M,K) w (N,K)^T with w packed in panels ----
 * Written by hand because the BLAS rounds a row differently depending on how many rows
 * share the product (see kiln_matmul_rows in ops.h); here each element is one chain of
 * multiply-adds over k in order, and threads split the panels, never a sum. */
typedef float v16 __attribute__((vector_size(64)));
static bool rows_wide; /* the AVX-512 kernel: KILN_OPT_ROWS_AVX512 and a CPU with AVX-512F */
static bool rows_f16c; /* f16 weights through vcvtph2ps (f16c_usable) */
static pthread_once_t rows_once = PTHREAD_ONCE_INIT;

static void rows_pick(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    rows_wide = kiln__opt(KILN__OPT_ROWS_AVX512) && __builtin_cpu_supports("avx512f");
#endif
    rows_f16c = f16c_usable();
}

typedef struct {
    const float *a;
    const void *w; /* f32, bf16 or f16 panels */
    float *out;
    int64_t M, N, K, P; /* P panels of KILN_ROWS_PANEL columns */
} packed_ctx;

/* Weights packed as f32, or as bf16 or f16 (half the bytes to stream: a serving model's
 * weights held in 16 bits) widened exactly as they are loaded, so a product is the f32
 * one of the 16-bit weight values. f16 is widened by F16C's vcvtph2ps (every processor
 * with the x86-64-v3 set has it; the plain clone converts one element at a time). */
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef int32_t i16 __attribute__((vector_size(64)));
#define LOAD_F32(v, p) memcpy(&(v), (p), sizeof(v))
#define LOAD_BF16(H, I, v, p)                                  \
    do {                                                       \
        H h_;                                                  \
        memcpy(&h_, (p), sizeof h_);                           \
        I i_ = __builtin_convertvector(h_, I) << 16;           \
        memcpy(&(v), &i_, sizeof(v));                          \
    } while (0)

/* Eight lanes: tiles of 4 rows by one panel (two vectors), eight sums in registers. */
#define KV v8
#define KGROUP 1
#define KMR 4
#define KBCAST(s) ((v8){s, s, s, s, s, s, s, s})
#define KATTR __attribute__((target_clones("arch=x86-64-v3", "default")))
#define KSFX p8
#define KWT float
#define KLOADW(v, p) LOAD_F32(v, p)
#include "backends/cpu/cpu_packed_impl.h"
#define KSFX p8b
#define KWT uint16_t
#define KLOADW(v, p) LOAD_BF16(h8, i8, v, p)
#include "backends/cpu/cpu_packed_impl.h"
/* f16: the F16C loads where rows_f16c, else one element at a time (as the pages). */
#if F16_V3
#undef KATTR
#define KATTR __attribute__((target(F16C_TARGET)))
#define KINL static inline __attribute__((always_inline, target(F16C_TARGET)))
#define KSFX p8h
#define KWT uint16_t
#define KLOADW(v, p) F16C8(v, p)
#include "backends/cpu/cpu_packed_impl.h"
#endif
#undef KATTR
#define KATTR
#define KSFX p8hc
#define KWT uint16_t
#define KLOADW(v, p) F16_EACH8(v, p)
#include "backends/cpu/cpu_packed_impl.h"
#undef KV
#undef KGROUP
#undef KMR
#undef KBCAST
#undef KATTR

#if defined(__x86_64__) && defined(__GNUC__)
#define ROWS_WIDE 1
/* Sixteen lanes: tiles of 8 rows by three panels, 24 of the 32 registers. */
#define KV v16
#define KGROUP 3
#define KMR 8
#define KBCAST(s) ((v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s})
#define KATTR __attribute__((target("arch=x86-64-v4")))
#define KSFX p16
#define KWT float
#define KLOADW(v, p) LOAD_F32(v, p)
#include "backends/cpu/cpu_packed_impl.h"
#define KSFX p16b
#define KWT uint16_t
#define KLOADW(v, p) LOAD_BF16(h16, i16, v, p)
#include "backends/cpu/cpu_packed_impl.h"
#define KINL static inline __attribute__((always_inline, target("avx512f")))
#define KSFX p16h
#define KWT uint16_t
#define KLOADW(v, p)                                                                                    \
    do {                                                                                              \
        __m512 f_ = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)));          \
        memcpy(&(v), &f_, sizeof(v));                                                                 \
    } while (0)
#include "backends/cpu/cpu_packed_impl.h"
#undef KV
#undef KGROUP
#undef KMR
#undef KBCAST
#undef KATTR
#else
#define ROWS_WIDE 0
#endif

kiln_status kiln__cpu_matmul_rows_packed(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *ta, *tw, *ca = cpu_contig(in[0], &ta), *cw = cpu_contig(in[1], &tw);
    kiln_status s = ca && cw ? KILN_OK : kiln_last_status();
    if (s == KILN_OK && cw->dtype == KILN_DTYPE_U8) {
        s = kiln__cpu_matmul_rows_q8(ca, cw, out[0]);
    } else if (s == KILN_OK && ca->shape[0] > 0) {
        pthread_once(&rows_once, rows_pick);
        packed_ctx k = {kiln__data(ca), kiln__data(cw), kiln__data(out[0]), ca->shape[0], out[0]->shape[1],
                        ca->shape[1], cw->shape[0]};
        int t = cw->dtype == KILN_DTYPE_BF16 ? 1 : cw->dtype == KILN_DTYPE_F16 ? 2 : 0;
        kiln__range_fn f16 = packed_range_p8hc;
#if F16_V3
        if (rows_f16c) f16 = packed_range_p8h;
#endif
        kiln__range_fn fn = t == 1 ? packed_range_p8b : t == 2 ? f16 : packed_range_p8;
        int64_t group = 1;
#if ROWS_WIDE
        if (rows_wide && (t != 2 || rows_f16c)) { /* KILN_OPT_F16C=0: f16 one element at a time */
            fn = t == 1 ? packed_range_p16b : t == 2 ? packed_range_p16h : packed_range_p16;
            group = 3;
        }
#endif
        int64_t groups = (k.P + group - 1) / group, work = k.M * k.K * group * KILN_ROWS_PANEL;
        kiln__parallel_for(groups, 1 + CPU_GRAIN * 4 / (work ? work : 1), fn, &k);
    }
    kiln_tensor_free(ta);
    kiln_tensor_free(tw);
    return s;
}
