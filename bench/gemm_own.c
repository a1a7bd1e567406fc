/* bench/gemm_own: kiln's own GEMM (src/backends/cpu/gemm.h) against OpenBLAS and BLIS
 * in one process (each BLAS opened with dlopen into its own symbol scope), on the GEMMs
 * of one config-S training step (GPT-2 style, B*T = 2048 rows, C = 256, 4 layers:
 * forward X W^T, dX = dY W, dW^T = X^T dY) and on square sizes, in f32 and with bf16
 * products (kiln only: Debian's BLAS libraries have no bf16 GEMM). Engines alternate
 * which runs first in each repetition, because these machines are noisy; each figure is
 * a median. The ceilings (bench/peak.h) are measured in the same run at the same thread
 * count: f32 against the AVX-512 (else AVX2) FMA peak, bf16 against the peak of the
 * instruction its kernel runs on (AMX, vdpbf16ps, or the f32 FMA where kiln multiplies
 * bf16 values on the f32 kernels: gemm.c's dpbf16_pays).
 *
 *   bench_gemm_own [--threads N] [--reps N] [--rest-ms N] [--only shapes|square] [--max-square N]
 *
 * Between two engines' runs the process rests (--rest-ms, default 20), so that one
 * library's idle threads, still spinning after its call, do not run against the next
 * engine's. One more engine, "OB/pool", is OpenBLAS as kiln's f32 matmul runs it with
 * KILN_OPT_POOL_GEMM: one thread inside each task of kiln's pool, the product split into
 * a block of rows (or columns) a thread (src/backends/cpu/cpu_matmul.c's gemm), so no
 * library's threads spin against another's: the comparison the training step makes. Run it through bench/gemm.sh, which makes OpenBLAS use its best kernels on
 * processors its detection misreads (OPENBLAS_CORETYPE) and BLIS's OpenMP threads
 * sleep when idle. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "peak.h"
#include "kiln/kiln.h"
#include "backends/cpu/gemm.h"
#include "core/threadpool.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 }; /* the CBLAS enum values */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef struct {
    const char *name;
    sgemm_fn sgemm;
    void (*set_threads)(int);
    int threads;
    bool pooled; /* one thread in each task of kiln's pool, as KILN_OPT_POOL_GEMM runs it */
} blas;

/* Opens a BLAS in a scope of its own and sets its thread count; false if absent. */
static bool blas_open(blas *b, const char *name, const char *soname, const char *set_threads, int threads)
{
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    b->name = name;
    b->sgemm = h ? (sgemm_fn)dlsym(h, "cblas_sgemm") : NULL;
    void (*st)(int) = h ? (void (*)(int))dlsym(h, set_threads) : NULL;
    if (st) st(threads);
    b->set_threads = st;
    b->threads = threads;
    b->pooled = false;
    const char *(*core)(void) = h ? (const char *(*)(void))dlsym(h, "openblas_get_corename") : NULL;
    printf("# %s: %s%s%s\n", name, b->sgemm ? soname : "not found", core ? ", core " : "", core ? core() : "");
    return b->sgemm != NULL;
}

typedef struct {
    const char *name;
    int64_t M, N, K;
    bool ta, tb; /* A stored (K, M), B stored (N, K) */
    int per_step;
} gemm_case;

typedef struct {
    float *a, *b, *c;
    uint16_t *a16, *b16, *c16;
} operands;

static float *randn(int64_t n, uint64_t *s)
{
    float *p = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    for (int64_t i = 0; p && i < n; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((*s >> 40) / (double)(1 << 24)) - 0.5f;
    }
    return p;
}

static uint16_t *to_bf16(const float *x, int64_t n)
{
    uint16_t *p = malloc(sizeof *p * (size_t)n);
    for (int64_t i = 0; p && i < n; i++) p[i] = kiln__f32_to_bf16(x[i]);
    return p;
}

static kiln__gemm_operand op_a(const gemm_case *g, const void *p, kiln__gemm_type t)
{
    return (kiln__gemm_operand){p, t, g->ta ? 1 : g->K, g->ta ? g->M : 1};
}
static kiln__gemm_operand op_b(const gemm_case *g, const void *p, kiln__gemm_type t)
{
    return (kiln__gemm_operand){p, t, g->tb ? 1 : g->N, g->tb ? g->K : 1};
}

/* A product split over kiln's pool as cpu_matmul.c's gemm splits it (with its default
 * switches): by rows when M >= N, else by columns, one block a thread in multiples of
 * 128 once a 128-wide block's product passes 2^22 multiply-adds, else 128 wide. */
typedef struct {
    const blas *b;
    const gemm_case *g;
    const operands *o;
    int64_t block;
    bool by_rows;
} pooled_job;

static void pooled_blocks(void *ctx, int64_t b0, int64_t b1)
{
    const pooled_job *p = ctx;
    const gemm_case *g = p->g;
    for (int64_t blk = b0; blk < b1; blk++) {
        int64_t s = blk * p->block, dim = p->by_rows ? g->M : g->N, w = dim - s < p->block ? dim - s : p->block;
        int lda = (int)(g->ta ? g->M : g->K), ldb = (int)(g->tb ? g->K : g->N);
        const float *A = p->o->a, *B = p->o->b;
        float *C = p->o->c;
        if (p->by_rows) {
            A += g->ta ? s : s * g->K;
            C += s * g->N;
        } else {
            B += g->tb ? s * g->K : s;
            C += s;
        }
        p->b->sgemm(ROW_MAJOR, g->ta ? TRANS : NO_TRANS, g->tb ? TRANS : NO_TRANS, (int)(p->by_rows ? w : g->M),
                    (int)(p->by_rows ? g->N : w), (int)g->K, 1.0f, A, lda, B, ldb, 0.0f, C, (int)g->N);
    }
}

static void run_pooled(const blas *b, const gemm_case *g, const operands *o)
{
    pooled_job p = {b, g, o, 128, g->M >= g->N};
    int64_t dim = p.by_rows ? g->M : g->N, other = p.by_rows ? g->N : g->M, nt = kiln_num_threads();
    if (128 * other * g->K > ((int64_t)1 << 22)) {
        int64_t per = (dim + nt - 1) / (nt > 0 ? nt : 1);
        p.block = (per + 127) / 128 * 128;
    }
    int64_t nblk = (dim + p.block - 1) / p.block;
    if (nblk < 2 || g->M * g->N * g->K < (int64_t)1 << 18) {
        p.block = dim;
        nblk = 1;
    }
    kiln__parallel_for(nblk, 1, pooled_blocks, &p);
}

/* Engine e's seconds for one GEMM: 0 kiln f32, 1 kiln bf16 (bf16 operands and result, as
 * a bf16 matmul runs it), 2.. a BLAS. */
static double run(int e, const gemm_case *g, operands *o, const blas *bl)
{
    if (e >= 2 && bl[e - 2].set_threads) bl[e - 2].set_threads(bl[e - 2].pooled ? 1 : bl[e - 2].threads);
    double t0 = bench_now_s();
    if (e == 0) kiln__gemm(g->M, g->N, g->K, op_a(g, o->a, KILN__GEMM_F32), op_b(g, o->b, KILN__GEMM_F32), o->c, g->N,
                           false, KILN__GEMM_F32);
    else if (e == 1)
        kiln__gemm_bf16(g->M, g->N, g->K, op_a(g, o->a16, KILN__GEMM_BF16), op_b(g, o->b16, KILN__GEMM_BF16), o->c16,
                        g->N);
    else if (bl[e - 2].pooled)
        run_pooled(&bl[e - 2], g, o);
    else
        bl[e - 2].sgemm(ROW_MAJOR, g->ta ? TRANS : NO_TRANS, g->tb ? TRANS : NO_TRANS, (int)g->M, (int)g->N,
                        (int)g->K, 1.0f, o->a, (int)(g->ta ? g->M : g->K), o->b, (int)(g->tb ? g->K : g->N), 0.0f,
                        o->c, (int)g->N);
    return bench_now_s() - t0;
}

#define MAX_ENGINES 5
static double gflops(const gemm_case *g, double s) { return 2.0 * (double)g->M * (double)g->N * (double)g->K / s * 1e-9; }

/* Median GFLOP/s of each engine over reps interleaved repetitions; also the largest
 * difference of kiln f32 and of the other BLAS engines (OB/pool's blocks included) from
 * the first BLAS, relative to the largest |value|. */
static void bench_case(const gemm_case *g, int reps, int rest_ms, const blas *bl, int nblas, double *gf, double *rel)
{
    uint64_t seed = 42;
    operands o = {randn(g->M * g->K, &seed), randn(g->K * g->N, &seed), randn(g->M * g->N, &seed), NULL, NULL, NULL};
    o.c16 = malloc(sizeof(uint16_t) * (size_t)(g->M * g->N));
    o.a16 = to_bf16(o.a, g->M * g->K);
    o.b16 = to_bf16(o.b, g->K * g->N);
    int ne = 2 + nblas;
    double t[MAX_ENGINES][64];
    *rel = NAN;
    if (nblas > 0) {
        float *ref = malloc(sizeof(float) * (size_t)(g->M * g->N));
        run(2, g, &o, bl);
        memcpy(ref, o.c, sizeof(float) * (size_t)(g->M * g->N));
        double err = 0, mag = 0;
        for (int e = 0; e < ne; e++) { /* kiln f32 and every BLAS engine but the reference */
            if (e == 1 || e == 2) continue;
            run(e, g, &o, bl);
            for (int64_t i = 0; i < g->M * g->N; i++) {
                err = fmax(err, fabs((double)o.c[i] - ref[i]));
                mag = fmax(mag, fabs((double)ref[i]));
            }
        }
        *rel = err / mag;
        free(ref);
    }
    for (int e = 0; e < ne; e++) run(e, g, &o, bl); /* warm up */
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < ne; k++) {
            int e = (k + r) % ne;
            bench_sleep_ms(rest_ms);
            t[e][r] = run(e, g, &o, bl);
        }
    for (int e = 0; e < ne; e++) {
        qsort(t[e], (size_t)reps, sizeof(double), bench_cmp_double);
        gf[e] = gflops(g, t[e][reps / 2]);
    }
    free(o.a), free(o.b), free(o.c), free(o.a16), free(o.b16), free(o.c16);
}

static const char *layout(const gemm_case *g)
{
    static const char *names[4] = {"NN", "NT", "TN", "TT"};
    return names[(g->ta ? 2 : 0) + (g->tb ? 1 : 0)];
}

int main(int argc, char **argv)
{
    int threads = 0, reps = 9, max_square = 2048, rest_ms = 20;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--reps")) reps = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--only")) only = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--rest-ms")) rest_ms = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--max-square")) max_square = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_gemm_own [--threads N] [--reps N] [--rest-ms N] [--only shapes|square] "
                            "[--max-square N]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (reps > 64) reps = 64;
    if (kiln_init(threads) != KILN_OK) return 1;
    threads = kiln_num_threads();
    blas bl[3];
    int nblas = 0;
    bool openblas = blas_open(&bl[nblas], "OpenBLAS", "libopenblas.so.0", "openblas_set_num_threads", threads);
    nblas += openblas;
    nblas += blas_open(&bl[nblas], "BLIS", "libblis.so.4", "bli_thread_set_num_threads", threads);
    if (openblas) {
        bl[nblas] = bl[0];
        bl[nblas].name = "OB/pool";
        bl[nblas++].pooled = true;
    }
    peak_isa f32_isa = peak_supported(PEAK_AVX512) ? PEAK_AVX512 : PEAK_AVX2;
    /* bf16 against the peak of the instruction kiln's bf16 kernel runs on: AMX's,
     * vdpbf16ps's, or (the f32 kernels on bf16 values) the f32 FMA's */
    const char *bk = kiln__gemm_kernel_name(KILN__GEMM_BF16);
    peak_isa bf16_isa = !strcmp(bk, "amx-bf16") ? PEAK_AMX_BF16 : !strcmp(bk, "avx512-bf16") ? PEAK_AVX512_BF16 : f32_isa;
    double f32_peak = peak_run(f32_isa, threads, 20000000L), bf16_peak = peak_run(bf16_isa, threads, 20000000L);
    if (bf16_peak <= 0) bf16_peak = f32_peak; /* bf16 then runs on the f32 kernels */
    if (bf16_isa == f32_isa && peak_supported(PEAK_AVX512_BF16)) /* the instruction it passed over */
        printf("# vdpbf16ps (bench/peak.h avx512-bf16): %.1f GFLOP/s\n", peak_run(PEAK_AVX512_BF16, threads, 20000000L));
    printf("# threads %d; kernels: f32 %s, bf16 %s; peaks: f32 (%s) %.1f GFLOP/s, bf16 (%s) %.1f GFLOP/s\n", threads,
           kiln__gemm_kernel_name(KILN__GEMM_F32), kiln__gemm_kernel_name(KILN__GEMM_BF16), peak_names[f32_isa],
           f32_peak, peak_names[bf16_isa], bf16_peak);
    if (bf16_isa == PEAK_AMX_BF16) /* what a 2 x 2 AMX kernel can reach: one tile load a tdpbf16ps */
        printf("# amx with its tile loads from L1 (bench/peak.h amx-loads): %.1f GFLOP/s\n",
               peak_run(PEAK_AMX_LOADS, threads, 20000000L));

    gemm_case cases[64];
    int n = 0;
    if (!only || !strcmp(only, "shapes")) {
        static const struct {
            const char *name;
            int64_t in, out;
            int count;
        } layers[] = {{"qkv", 256, 768, 4},      {"attn.proj", 256, 256, 4}, {"mlp.fc", 256, 1024, 4},
                      {"mlp.proj", 1024, 256, 4}, {"lm_head", 256, 256, 1}};
        for (size_t l = 0; l < sizeof layers / sizeof layers[0]; l++) {
            int64_t in = layers[l].in, out = layers[l].out, rows = 2048;
            cases[n++] = (gemm_case){layers[l].name, rows, out, in, false, true, layers[l].count};
            cases[n++] = (gemm_case){layers[l].name, rows, in, out, false, false, layers[l].count};
            cases[n++] = (gemm_case){layers[l].name, in, out, rows, true, false, layers[l].count};
        }
    }
    if (!only || !strcmp(only, "square"))
        for (int64_t s = 256; s <= max_square && n < 64; s *= 2) cases[n++] = (gemm_case){"square", s, s, s, false, false, 0};

    printf("%-10s %5s %5s %5s %3s | %9s %5s %9s %5s |", "gemm", "M", "N", "K", "op", "kiln f32", "peak", "kiln bf16",
           "peak");
    for (int b = 0; b < nblas; b++) printf(" %9s", bl[b].name);
    printf(" |");
    for (int b = 0; b < nblas; b++) printf(" kiln/%-3d", b + 1);
    printf(" | %8s\n", "rel.err");
    double step[MAX_ENGINES] = {0};
    for (int c = 0; c < n; c++) {
        const gemm_case *g = &cases[c];
        double gf[MAX_ENGINES] = {0}, rel;
        bench_case(g, reps, rest_ms, bl, nblas, gf, &rel);
        printf("%-10s %5lld %5lld %5lld %3s | %9.1f %5.2f %9.1f %5.2f |", g->name, (long long)g->M, (long long)g->N,
               (long long)g->K, layout(g), gf[0], gf[0] / f32_peak, gf[1], gf[1] / bf16_peak);
        for (int b = 0; b < nblas; b++) printf(" %9.1f", gf[2 + b]);
        printf(" |");
        for (int b = 0; b < nblas; b++) printf(" %8.2f", gf[2 + b] > 0 ? gf[0] / gf[2 + b] : NAN);
        printf(" | %8.1e\n", rel);
        for (int e = 0; e < 2 + nblas; e++)
            if (gf[e] > 0) step[e] += g->per_step * 2.0 * (double)g->M * (double)g->N * (double)g->K / gf[e] * 1e-6;
    }
    if (step[0] > 0 && cases[0].per_step) {
        printf("config S step's GEMMs, ms: kiln f32 %.2f, kiln bf16 %.2f", step[0], step[1]);
        for (int b = 0; b < nblas; b++) printf(", %s %.2f", bl[b].name, step[2 + b]);
        printf("; kiln f32");
        for (int b = 0; b < nblas; b++) printf("%s / %s %.2f", b ? "," : "", bl[b].name, step[2 + b] / step[0]);
        printf(" (time ratio, >1 = kiln faster)\n");
    }
    return 0;
}
