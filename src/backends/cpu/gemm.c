/* kiln's own GEMM (gemm.h): the blocking, packing and threading, and the micro-kernels.
 *
 * Loops, outermost first: column chunks of B (at most NC columns, packed once over the
 * pool), then work items of (MC rows) x (a group of NR-column panels) over the pool;
 * inside an item, K blocks of KC in order, each packing its rows of A once and running
 * the micro-kernel over every MR x NR tile of the item. A tile at an edge of C runs the
 * same micro-kernel on a full-size scratch tile, so that every element gets the same
 * arithmetic wherever it lies. */
#include "backends/cpu/gemm.h"
#include <stdlib.h>
#include <string.h>
#include "core/threadpool.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MR_MAX 12
#define NR_MAX 32
#define NC 4096 /* columns of B packed at once (a multiple of every NR) */

/* Runs `steps` k-steps (a k-step is one k for f32, a pair of k for bf16) of the packed
 * micro-panels a (MR rows) and b (NR columns) into the MR x NR tile c (row stride ldc):
 * c = sum, or c += sum with `add` (the sum then starts from c). */
typedef void (*ukernel_fn)(int64_t steps, const void *a, const void *b, float *c, int64_t ldc, bool add);

typedef struct {
    const char *name;
    kiln__gemm_isa isa;
    kiln__gemm_type packed; /* the element type of the packed panels */
    bool round_bf16;        /* f32 panels holding values rounded to bf16 */
    int mr, nr, kstep;
    ukernel_fn run;
} ukernel;

/* ---- micro-kernels ---- */

static void k_c(int64_t steps, const void *pa, const void *pb, float *c, int64_t ldc, bool add)
{
    enum { MR = 4, NR = 16 };
    const float *a = pa, *b = pb;
    float acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = add ? c[i * ldc + j] : 0.0f;
    for (int64_t k = 0; k < steps; k++, a += MR, b += NR)
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[i][j] += a[i] * b[j];
    for (int i = 0; i < MR; i++) memcpy(c + i * ldc, acc[i], sizeof acc[i]);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void k_avx2(int64_t steps, const void *pa, const void *pb, float *c,
                                                        int64_t ldc, bool add)
{
    enum { MR = 6 };
    const float *a = pa, *b = pb;
    __m256 acc[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        acc[i][0] = add ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
        acc[i][1] = add ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < steps; k++, a += MR, b += 16) {
        __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            __m256 ai = _mm256_broadcast_ss(a + i);
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

__attribute__((target("avx512f"))) static void k_avx512(int64_t steps, const void *pa, const void *pb, float *c,
                                                         int64_t ldc, bool add)
{
    enum { MR = 12 };
    const float *a = pa, *b = pb;
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        acc[i][0] = add ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
        acc[i][1] = add ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < steps; k++, a += MR, b += 32) {
        __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512 ai = _mm512_set1_ps(a[i]);
            acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * ldc, acc[i][0]);
        _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
    }
}

/* vdpbf16ps: each f32 lane adds the products of one pair of bf16 along K, so a k-step
 * is a pair: A's pair for row i is one 32-bit word broadcast, B's pairs for 16 columns
 * are one register. */
__attribute__((target("avx512f,avx512bf16"))) static void k_avx512bf16(int64_t steps, const void *pa, const void *pb,
                                                                      float *c, int64_t ldc, bool add)
{
    enum { MR = 12 };
    const uint32_t *a = pa;
    const uint16_t *b = pb;
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        acc[i][0] = add ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
        acc[i][1] = add ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < steps; k++, a += MR, b += 64) {
        __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 32);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * ldc, acc[i][0]);
        _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
    }
}
#endif

/* Every kernel, best first for each compute type. A bf16 product of two bf16 values is
 * exact in f32, so the f32 kernels on bf16-rounded panels compute bf16 GEMMs where the
 * processor lacks AVX512-BF16 (summing one product at a time where vdpbf16ps adds a
 * pair before the accumulator). */
static const ukernel kernels[] = {
#if defined(__x86_64__)
    {"avx512-bf16", KILN__GEMM_ISA_AVX512, KILN__GEMM_BF16, false, 12, 32, 2, k_avx512bf16},
    {"avx512", KILN__GEMM_ISA_AVX512, KILN__GEMM_F32, false, 12, 32, 1, k_avx512},
    {"avx512 (bf16 values)", KILN__GEMM_ISA_AVX512, KILN__GEMM_F32, true, 12, 32, 1, k_avx512},
    {"avx2", KILN__GEMM_ISA_AVX2, KILN__GEMM_F32, false, 6, 16, 1, k_avx2},
    {"avx2 (bf16 values)", KILN__GEMM_ISA_AVX2, KILN__GEMM_F32, true, 6, 16, 1, k_avx2},
#endif
    {"c", KILN__GEMM_ISA_C, KILN__GEMM_F32, false, 4, 16, 1, k_c},
    {"c (bf16 values)", KILN__GEMM_ISA_C, KILN__GEMM_F32, true, 4, 16, 1, k_c},
};

static bool runs_here(const ukernel *k)
{
#if defined(__x86_64__)
    if (k->isa == KILN__GEMM_ISA_AVX512 && !__builtin_cpu_supports("avx512f")) return false;
    if (k->packed == KILN__GEMM_BF16 && !__builtin_cpu_supports("avx512bf16")) return false;
    if (k->isa == KILN__GEMM_ISA_AVX2 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return false;
#endif
    return true;
}

/* The first kernel for `compute` that runs here (and is of `isa` unless AUTO). */
static const ukernel *pick(kiln__gemm_isa isa, kiln__gemm_type compute)
{
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        const ukernel *k = &kernels[i];
        bool computes_bf16 = k->packed == KILN__GEMM_BF16 || k->round_bf16;
        if ((compute == KILN__GEMM_BF16) != computes_bf16) continue;
        if ((isa == KILN__GEMM_ISA_AUTO || k->isa == isa) && runs_here(k)) return k;
    }
    return NULL;
}

const char *kiln__gemm_kernel_name(kiln__gemm_type compute)
{
    const ukernel *k = pick(KILN__GEMM_ISA_AUTO, compute);
    return k ? k->name : "none";
}

/* ---- packing ---- */

static float load(const kiln__gemm_operand *x, int64_t i)
{
    return x->type == KILN__GEMM_F32 ? ((const float *)x->p)[i] : kiln__bf16_to_f32(((const uint16_t *)x->p)[i]);
}

/* Packs `tile`-wide micro-panels of an operand's block: element (t, k) of the block, t in
 * [0, nt) along the tile dim (stride ts) and k in [0, kc) along K (stride ks), starting
 * at `first`. A panel holds, for each k-step, `tile` groups of kstep values; what lies
 * past nt or kc is zero. Panels follow each other, kpad = kc rounded up to kstep long. */
static void pack(const ukernel *uk, const kiln__gemm_operand *x, int64_t first, int64_t ts, int64_t ks, int64_t nt,
                 int64_t kc, int tile, void *out)
{
    int kstep = uk->kstep;
    int64_t kpad = (kc + kstep - 1) / kstep * kstep;
    float *of = out;
    uint16_t *oh = out;
    for (int64_t t0 = 0; t0 < nt; t0 += tile) {
        int64_t w = nt - t0 < tile ? nt - t0 : tile;
        if (uk->packed == KILN__GEMM_F32 && !uk->round_bf16 && x->type == KILN__GEMM_F32 && ts == 1 && w == tile) {
            const float *src = (const float *)x->p + first + t0;
            for (int64_t k = 0; k < kc; k++) memcpy(of + k * tile, src + k * ks, sizeof(float) * (size_t)tile);
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
                    if (uk->packed == KILN__GEMM_BF16) oh[at] = kiln__f32_to_bf16(v);
                    else of[at] = uk->round_bf16 ? kiln__bf16_to_f32(kiln__f32_to_bf16(v)) : v;
                }
        }
        of += kpad * tile;
        oh += kpad * tile;
    }
}

/* ---- the driver ---- */

typedef struct {
    const ukernel *uk;
    int64_t M, N, K, kc_max;
    kiln__gemm_operand A, B;
    float *C;
    int64_t ldc;
    bool accumulate;
    size_t es;         /* bytes per packed element */
    int64_t c0, nc;    /* this round's columns of B and C */
    int64_t npanels;   /* NR panels in the round */
    char *bpack;       /* the round's packed B: K block by K block, each npanels panels */
    int64_t mc, mblocks, panels_per_group, ngroups;
    bool failed;
} job;

static int64_t kpad_of(const job *j, int64_t kc) { return (kc + j->uk->kstep - 1) / j->uk->kstep * j->uk->kstep; }

/* Where K block starting at k0 (length kc) of panel p lies in the packed B. */
static char *bpanel(const job *j, int64_t k0, int64_t kc, int64_t p)
{
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
            pack(j->uk, &j->B, k0 * j->B.rs + col * j->B.cs, j->B.cs, j->B.rs, w, kc, nr, bpanel(j, k0, kc, p));
        }
}

static void tile(const job *j, int64_t steps, const void *a, const void *b, float *c, int64_t m, int64_t n, bool add)
{
    const ukernel *uk = j->uk;
    if (m == uk->mr && n == uk->nr) {
        uk->run(steps, a, b, c, j->ldc, add);
        return;
    }
    float t[MR_MAX * NR_MAX] = {0};
    for (int64_t i = 0; i < m && add; i++) memcpy(t + i * uk->nr, c + i * j->ldc, sizeof(float) * (size_t)n);
    uk->run(steps, a, b, t, uk->nr, add);
    for (int64_t i = 0; i < m; i++) memcpy(c + i * j->ldc, t + i * uk->nr, sizeof(float) * (size_t)n);
}

static void items(void *ctx, int64_t begin, int64_t end)
{
    job *j = ctx;
    const ukernel *uk = j->uk;
    void *apack = aligned_alloc(64, (size_t)(j->mc * kpad_of(j, j->kc_max)) * j->es);
    if (!apack) {
        j->failed = true; /* a benign race: every writer stores true */
        return;
    }
    for (int64_t it = begin; it < end; it++) {
        int64_t mb = it % j->mblocks, g = it / j->mblocks;
        int64_t r0 = mb * j->mc, m = j->M - r0 < j->mc ? j->M - r0 : j->mc;
        int64_t p0 = g * j->panels_per_group, p1 = p0 + j->panels_per_group;
        if (p1 > j->npanels) p1 = j->npanels;
        for (int64_t k0 = 0; k0 < j->K; k0 += j->kc_max) {
            int64_t kc = j->K - k0 < j->kc_max ? j->K - k0 : j->kc_max, kpad = kpad_of(j, kc);
            pack(uk, &j->A, r0 * j->A.rs + k0 * j->A.cs, j->A.rs, j->A.cs, m, kc, uk->mr, apack);
            bool add = k0 > 0 || j->accumulate;
            for (int64_t p = p0; p < p1; p++) {
                int64_t col = p * uk->nr, n = j->nc - col < uk->nr ? j->nc - col : uk->nr;
                const char *b = bpanel(j, k0, kc, p);
                for (int64_t i = 0; i < m; i += uk->mr)
                    tile(j, kpad / uk->kstep, (const char *)apack + i * kpad * (int64_t)j->es, b,
                         j->C + (r0 + i) * j->ldc + j->c0 + col, m - i < uk->mr ? m - i : uk->mr, n, add);
            }
        }
    }
    free(apack);
}

bool kiln__gemm_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B,
                    float *C, int64_t ldc, bool accumulate, kiln__gemm_type compute)
{
    const ukernel *uk = pick(isa, compute);
    if (!uk) return false;
    if (M <= 0 || N <= 0) return true;
    if (K <= 0) {
        for (int64_t i = 0; i < M && !accumulate; i++) memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
        return true;
    }
    job j = {.uk = uk, .M = M, .N = N, .K = K, .kc_max = KILN__GEMM_KC, .A = A, .B = B, .C = C, .ldc = ldc,
             .accumulate = accumulate, .es = uk->packed == KILN__GEMM_BF16 ? 2 : 4};
    int64_t nt = kiln__pool_size() > 0 ? kiln__pool_size() : 1;
    size_t bbytes = (size_t)(K / j.kc_max * j.kc_max + kpad_of(&j, K % j.kc_max)) * (size_t)((N < NC ? N : NC) + uk->nr) * j.es;
    j.bpack = aligned_alloc(64, (bbytes + 63) / 64 * 64);
    if (!j.bpack) return false;
    for (j.c0 = 0; j.c0 < N && !j.failed; j.c0 += NC) {
        j.nc = N - j.c0 < NC ? N - j.c0 : NC;
        j.npanels = (j.nc + uk->nr - 1) / uk->nr;
        kiln__parallel_for(j.npanels, 4, pack_b_range, &j);
        /* Rows in blocks of at most 20 tiles, at least two blocks a thread where M
         * allows; when M is short the columns are split among the threads instead. */
        int64_t tiles = (M + uk->mr - 1) / uk->mr, per = (tiles + 2 * nt - 1) / (2 * nt);
        if (per > 20) per = 20;
        if (per < 1) per = 1;
        j.mc = per * uk->mr;
        j.mblocks = (M + j.mc - 1) / j.mc;
        j.ngroups = j.mblocks >= 2 * nt ? 1 : (2 * nt + j.mblocks - 1) / j.mblocks;
        if (j.ngroups > j.npanels) j.ngroups = j.npanels;
        j.panels_per_group = (j.npanels + j.ngroups - 1) / j.ngroups;
        j.ngroups = (j.npanels + j.panels_per_group - 1) / j.panels_per_group;
        kiln__parallel_for(j.mblocks * j.ngroups, 1, items, &j);
    }
    free(j.bpack);
    return !j.failed;
}

bool kiln__gemm(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, float *C, int64_t ldc,
                bool accumulate, kiln__gemm_type compute)
{
    return kiln__gemm_with(KILN__GEMM_ISA_AUTO, M, N, K, A, B, C, ldc, accumulate, compute);
}
