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

#define K_ARGS kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t *const *out, int n_out

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
} paged_ctx;

/* The kernel for each KV cache type: f32, and f16 or bf16 widened to f32 on load. */
#define PATTR __attribute__((target_clones("arch=x86-64-v3", "default")))
#define PINL static inline __attribute__((always_inline))
#define KT float
#define KLOAD8(dst, p) LOAD8(dst, p)
#define KSCALAR(x) (x)
#define PSFX f32
#include "backends/cpu/cpu_paged_impl.h"
#undef KT
#undef KLOAD8
#undef PSFX

#define KT uint16_t
#define KLOAD8(dst, p)                                                                                  \
    do {                                                                                              \
        u16x8 b_;                                                                                     \
        memcpy(&b_, (p), sizeof b_);                                                                  \
        u32x8 w_ = __builtin_convertvector(b_, u32x8) << 16;                                          \
        memcpy(&(dst), &w_, sizeof w_);                                                               \
    } while (0)
#undef KSCALAR
#define KSCALAR(x) kiln__bf16_to_f32(x)
#define PSFX bf16
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#include "backends/cpu/cpu_paged_impl.h"
#undef KLOAD8
#undef KSCALAR
#undef PSFX
#undef PATTR

/* f16 twice: with F16C's vcvtph2ps (an intrinsic: GCC 12 widens a _Float16 vector one
 * element at a time, which made f16 pages slower than f32 ones), picked at run time
 * where the processor has it, and a portable one. */
#define KSCALAR(x) kiln__f16_to_f32(x)
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define F16_V3 1
#define PATTR __attribute__((target("arch=x86-64-v3")))
#undef PINL
#define PINL static inline __attribute__((always_inline, target("arch=x86-64-v3")))
#define KLOAD8(dst, p)                                                                                  \
    do {                                                                                              \
        __m256 f_ = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)));             \
        memcpy(&(dst), &f_, sizeof f_);                                                               \
    } while (0)
#define PSFX f16v3
#include "backends/cpu/cpu_paged_impl.h"
#undef KLOAD8
#undef PSFX
#undef PATTR
#undef PINL
#define PINL static inline __attribute__((always_inline))
#else
#define F16_V3 0
#endif
#define PATTR
#define KLOAD8(dst, p)                                                                                  \
    do {                                                                                              \
        for (int l_ = 0; l_ < 8; l_++) (dst)[l_] = kiln__f16_to_f32((p)[l_]);                          \
    } while (0)
#define PSFX f16
#include "backends/cpu/cpu_paged_impl.h"
#undef KT
#undef KLOAD8
#undef KSCALAR
#undef PSFX
#undef PATTR
#undef PINL

static kiln__range_fn paged_kernel(kiln_dtype kv)
{
    if (kv == KILN_DTYPE_BF16) return paged_range_bf16;
    if (kv != KILN_DTYPE_F16) return paged_range_f32;
#if F16_V3
    __builtin_cpu_init();
    if (kiln__opt(KILN__OPT_F16C) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return paged_range_f16v3;
#endif
    return paged_range_f16;
}

/* Every sequence index, position and block id is checked before any is used. */
static kiln_status check_pages(const int32_t *bt, const int32_t *sp, int64_t N, int64_t n_seqs, int64_t max_blocks,
                               int64_t bl, int64_t n_blocks)
{
    for (int64_t n = 0; n < N; n++) {
        int64_t seq = sp[n * 2], p = sp[n * 2 + 1];
        if (seq < 0 || seq >= n_seqs || p < 0 || p >= max_blocks * bl)
            return kiln__err(KILN_ERR_INDEX, "paged_attention: row %lld names sequence %lld position %lld; the block "
                             "table holds %lld sequences of %lld positions", (long long)n, (long long)seq, (long long)p,
                             (long long)n_seqs, (long long)(max_blocks * bl));
        for (int64_t j = 0; j <= p / bl; j++) {
            int32_t blk = bt[seq * max_blocks + j];
            if (blk < 0 || blk >= n_blocks)
                return kiln__err(KILN_ERR_INDEX, "paged_attention: block table row %lld entry %lld is %d, outside [0, %lld)",
                                 (long long)seq, (long long)j, blk, (long long)n_blocks);
        }
    }
    return KILN_OK;
}

kiln_status kiln__cpu_paged_attention(K_ARGS)
{
    kiln_tensor_t *c[5], *tmp[5] = {0};
    kiln_status s = KILN_OK;
    for (int i = 0; i < 5 && s == KILN_OK; i++)
        if (!(c[i] = cpu_contig(in[i], &tmp[i]))) s = kiln_last_status();
    int64_t N = s == KILN_OK ? c[0]->shape[0] : 0, bl = a->i[0];
    if (s == KILN_OK)
        s = check_pages(kiln__data(c[3]), kiln__data(c[4]), N, c[3]->shape[0], c[3]->shape[1], bl, c[1]->shape[0] / bl);
    if (s == KILN_OK && N > 0) {
        paged_ctx k = {kiln__data(c[0]), kiln__data(c[1]), kiln__data(c[2]), kiln__data(c[3]), kiln__data(c[4]),
                       kiln__data(out[0]), c[0]->shape[1], c[1]->shape[1], c[0]->shape[2], bl, c[3]->shape[1],
                       c[3]->shape[1] * bl, 0, 0, (float)a->f[0], 0};
        /* Whole rows when there are enough of them to share out; else rows split into
         * head groups, so that one decoding sequence still uses every thread. */
        int64_t want = 2 * kiln__pool_size(), split = N >= want ? 1 : (want + N - 1) / N;
        if (split > k.H) split = k.H;
        k.hg = (k.H + split - 1) / split;
        k.per_row = (k.H + k.hg - 1) / k.hg;
        kiln__parallel_for(N * k.per_row, 1, paged_kernel(c[1]->dtype), &k);
        if (atomic_load(&k.oom)) s = kiln__err(KILN_ERR_OOM, "paged_attention: out of memory for a score buffer");
    }
    for (int i = 0; i < 5; i++) kiln_tensor_free(tmp[i]);
    return s;
}

/* ---- matmul_rows: out (M,N) = a (M,K) w (N,K)^T, one fixed summation order ----
 * Each element is summed in L lanes over K (lane l takes k = l mod L; L is 8, or 16
 * with AVX-512), the lanes added in one fixed tree, then the tail; four rows of w
 * share each pass over a row of a. The blocks of w are split across threads, never
 * the sum, and rows are tiled, never split, so neither M, nor an element's place in
 * the output, nor the thread count changes a result. Written by
 * hand because the BLAS gives no such promise (see kiln_matmul_rows in ops.h). */
typedef struct {
    const float *a, *w;
    float *out;
    int64_t M, N, K;
    int64_t tile; /* rows of a per pass over the blocks of w */
} rows_ctx;

/* The kernels, written once in cpu_rows_impl.h for a lane count: eight lanes (an
 * AVX2+FMA clone and a plain one) and, on x86-64, sixteen (AVX-512), chosen once per
 * process, so every row of every call is summed by the same kernel family. */
#define RV v8
#define RQUAD 0
#define RSFX 8
#define RLANES_SUM LANES_SUM
#define RATTR __attribute__((target_clones("arch=x86-64-v3", "default")))
#include "backends/cpu/cpu_rows_impl.h"
#undef RV
#undef RQUAD
#undef RSFX
#undef RLANES_SUM
#undef RATTR

#if defined(__x86_64__) && defined(__GNUC__)
#define ROWS_WIDE 1
typedef float v16 __attribute__((vector_size(64)));
/* Sixteen lanes folded to eight (lane l plus lane l + 8), then the eight-lane tree. */
#define LANES16_SUM(l)                                                                                 \
    (((((l)[0] + (l)[8]) + ((l)[4] + (l)[12])) + (((l)[2] + (l)[10]) + ((l)[6] + (l)[14]))) +          \
     ((((l)[1] + (l)[9]) + ((l)[5] + (l)[13])) + (((l)[3] + (l)[11]) + ((l)[7] + (l)[15]))))
/* The sixteen sums of dot_4x4 at once, by the same tree as LANES16_SUM for each: fold
 * lanes l + 8 onto l, then l + 4, l + 2, l + 1, two accumulators' lanes side by side
 * in each shuffle (a + b is b + a in IEEE arithmetic, and the tree is the same), so
 * the results are bitwise those of dot_2x4_16 and dot_1x4_16. */
#define SV __builtin_shufflevector
__attribute__((target("arch=x86-64-v4"))) static inline void quad_reduce(v16 a[4][4], float out[4][4])
{
    v16 p[8], q[4], t[2];
    for (int i = 0; i < 8; i++) {
        v16 x = a[i / 2][i % 2 * 2], y = a[i / 2][i % 2 * 2 + 1];
        p[i] = SV(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SV(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++)
        q[i] = SV(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SV(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        t[i] = SV(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SV(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    v16 u = SV(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
            SV(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    memcpy(out, &u, sizeof u);
}
#undef SV
#define RQUAD_REDUCE quad_reduce
#define RV v16
#define RQUAD 1
#define RSFX 16
#define RLANES_SUM LANES16_SUM
#define RATTR __attribute__((target("arch=x86-64-v4")))
#include "backends/cpu/cpu_rows_impl.h"
#undef RV
#undef RQUAD
#undef RQUAD_REDUCE
#undef RSFX
#undef RLANES_SUM
#undef RATTR
#else
#define ROWS_WIDE 0
#endif

typedef void (*dot_2x4_fn)(const float *const *x, const float *const *w, int64_t K, float out[2][4]);
typedef void (*dot_1x4_fn)(const float *x, const float *const *w, int64_t K, float out[4]);
typedef void (*dot_4x4_fn)(const float *const *x, const float *const *w, int64_t K, float out[4][4]);
static dot_4x4_fn dot_4x4; /* NULL: rows go in pairs */
static dot_2x4_fn dot_2x4 = dot_2x4_8;
static dot_1x4_fn dot_1x4 = dot_1x4_8;
static pthread_once_t rows_once = PTHREAD_ONCE_INIT;

/* KILN_OPT_ROWS_AVX512, where the CPU has AVX-512F; then KILN_OPT_ROWS_QUAD. */
static void rows_pick(void)
{
#if ROWS_WIDE
    __builtin_cpu_init();
    if (kiln__opt(KILN__OPT_ROWS_AVX512) && __builtin_cpu_supports("avx512f")) {
        dot_2x4 = dot_2x4_16;
        dot_1x4 = dot_1x4_16;
        if (kiln__opt(KILN__OPT_ROWS_QUAD)) dot_4x4 = dot_4x4_16;
    }
#endif
}

/* Rows of a go in fours where dot_4x4 is on, then in pairs, for eight independent sums
 * in flight, and an odd last row of a tile through dot_1x4 (a last block of w repeats its last row); each element is
 * summed by the same sequence of operations wherever it sits. */
static void rows_range(void *c, int64_t b, int64_t e)
{
    const rows_ctx *k = c;
    int64_t K = k->K;
    for (int64_t m0 = 0; m0 < k->M; m0 += k->tile) {
        int64_t m1 = m0 + k->tile < k->M ? m0 + k->tile : k->M;
        for (int64_t blk = b; blk < e; blk++) {
            int64_t n0 = blk * 4;
            const float *w[4];
            for (int j = 0; j < 4; j++) w[j] = k->w + (n0 + j < k->N ? n0 + j : k->N - 1) * K;
            int64_t m = m0;
            if (dot_4x4)
                for (; m + 4 <= m1; m += 4) {
                    float o[4][4];
                    dot_4x4((const float *[4]){k->a + m * K, k->a + (m + 1) * K, k->a + (m + 2) * K, k->a + (m + 3) * K},
                            w, K, o);
                    for (int r = 0; r < 4; r++)
                        for (int j = 0; j < 4 && n0 + j < k->N; j++) k->out[(m + r) * k->N + n0 + j] = o[r][j];
                }
            for (; m < m1; m += 2) {
                float o[2][4];
                if (m + 1 < m1) dot_2x4((const float *[2]){k->a + m * K, k->a + (m + 1) * K}, w, K, o);
                else dot_1x4(k->a + m * K, w, K, o[0]);
                for (int r = 0; r < 2 && m + r < m1; r++)
                    for (int j = 0; j < 4 && n0 + j < k->N; j++) k->out[(m + r) * k->N + n0 + j] = o[r][j];
            }
        }
    }
}

kiln_status kiln__cpu_matmul_rows(K_ARGS)
{
    kiln_tensor_t *ta, *tw, *ca = cpu_contig(in[0], &ta), *cw = cpu_contig(in[1], &tw);
    kiln_status s = ca && cw ? KILN_OK : kiln_last_status();
    if (s == KILN_OK) {
        rows_ctx k = {kiln__data(ca), kiln__data(cw), kiln__data(out[0]), ca->shape[0], cw->shape[0], ca->shape[1], 0};
        pthread_once(&rows_once, rows_pick);
        /* KILN_OPT_ROWS_TILE: rows of a in tiles of about 128 KiB (L2-resident), each
         * tile over all of this thread's blocks of w; else all rows per block. */
        k.tile = k.M;
        if (kiln__opt(KILN__OPT_ROWS_TILE)) {
            k.tile = (128 << 10) / (4 * (k.K ? k.K : 1)) / 2 * 2;
            if (k.tile < 16) k.tile = 16;
        }
        int64_t blocks = (k.N + 3) / 4, work = k.M * k.K * 4;
        kiln__parallel_for(blocks, 1 + CPU_GRAIN * 4 / (work ? work : 1), rows_range, &k);
    }
    kiln_tensor_free(ta);
    kiln_tensor_free(tw);
    return s;
}

/* ---- matmul_rows_packed: out (M,N) = a (M,K) times w packed in panels ---- */
typedef struct {
    const float *a, *w;
    float *out;
    int64_t M, N, K, P; /* P panels of KILN_ROWS_PANEL columns */
} packed_ctx;

/* Eight lanes: tiles of 4 rows by one panel (two vectors), eight sums in registers. */
#define KV v8
#define KSFX p8
#define KGROUP 1
#define KMR 4
#define KBCAST(s) ((v8){s, s, s, s, s, s, s, s})
#define KATTR __attribute__((target_clones("arch=x86-64-v3", "default")))
#include "backends/cpu/cpu_packed_impl.h"
#undef KV
#undef KSFX
#undef KGROUP
#undef KMR
#undef KBCAST
#undef KATTR

#if ROWS_WIDE
/* Sixteen lanes: tiles of 8 rows by three panels, 24 of the 32 registers. */
#define KV v16
#define KSFX p16
#define KGROUP 3
#define KMR 8
#define KBCAST(s) ((v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s})
#define KATTR __attribute__((target("arch=x86-64-v4")))
#include "backends/cpu/cpu_packed_impl.h"
#undef KV
#undef KSFX
#undef KGROUP
#undef KMR
#undef KBCAST
#undef KATTR
#endif

kiln_status kiln__cpu_matmul_rows_packed(K_ARGS)
{
    kiln_tensor_t *ta, *tw, *ca = cpu_contig(in[0], &ta), *cw = cpu_contig(in[1], &tw);
    kiln_status s = ca && cw ? KILN_OK : kiln_last_status();
    if (s == KILN_OK && ca->shape[0] > 0) {
        pthread_once(&rows_once, rows_pick);
        packed_ctx k = {kiln__data(ca), kiln__data(cw), kiln__data(out[0]), ca->shape[0], out[0]->shape[1],
                        ca->shape[1], cw->shape[0]};
        kiln__range_fn fn = packed_range_p8;
        int64_t group = 1;
#if ROWS_WIDE
        if (dot_2x4 == dot_2x4_16) { /* the AVX-512 family was picked */
            fn = packed_range_p16;
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
