/* bench/gemm: the f32 GEMMs of one config-S training step (GPT-2 style, B=16, T=128,
 * C=256, 4 layers, vocab 256, so N = B*T = 2048 rows) through kiln_matmul, with the
 * operands laid out the way kiln_linear and the matmul backward build them, against
 * cblas_sgemm called directly on the same buffers.
 *
 * Three parts, each printed as a table of medians:
 *   peak    a 1024^3 GEMM: the ceiling of the linked BLAS on this machine;
 *   shapes  every GEMM of a training step: forward x @ W^T, dX = dY @ W and
 *           dW^T = X^T @ dY (what kiln's autograd issues), plus dW = dY^T @ X (the same
 *           product the other way round, not counted in the step total);
 *   mix     GEMM and kiln_gelu on its (2048,1024) output back to back, against each
 *           alone after a rest: what a BLAS whose threads keep spinning after a GEMM
 *           costs kiln's own thread pool, and the other way round.
 * kiln and BLAS repetitions are interleaved and alternate which runs first, because
 * these machines are noisy; the ratio kiln/BLAS is of GFLOP/s (1.00 = no overhead).
 *
 *   bench_gemm [--threads N] [--reps N] [--rest-ms N] [--only peak|shapes|mix]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cblas.h>
#include "bench.h"
#include "kiln/kiln.h"
#include "core/tensor_impl.h"



/* Sorts v in place. */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The BLAS shared object this process really loaded (the Debian alternatives can
 * point libblis.so.4 at the openmp or the pthread build), read from /proc/self/maps. */
static void loaded_blas(char *out, size_t n)
{
    snprintf(out, n, "(not found in /proc/self/maps)");
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        if (!strstr(line, "libblis") && !strstr(line, "libopenblas")) continue;
        char *p = strchr(line, '/');
        if (!p) continue;
        p[strcspn(p, "\n")] = 0;
        snprintf(out, n, "%s", p);
        break;
    }
    fclose(f);
}

/* One GEMM C(M,N) = op(A) op(B). An operand with trans set is stored transposed —
 * A as (K,M), B as (N,K) — and reaches kiln_matmul as a kiln_transpose view. */
typedef struct {
    const char *name;
    int64_t M, N, K;
    bool ta, tb;
    int per_step; /* how many times one training step issues it; 0: not counted */
} gemm_case;

typedef struct {
    kiln_tensor_t *a, *b, *c; /* a, b as stored; c is the BLAS output (M,N) */
} operands;

static kiln_status operands_new(const gemm_case *g, operands *o)
{
    int64_t sa[2] = {g->ta ? g->K : g->M, g->ta ? g->M : g->K};
    int64_t sb[2] = {g->tb ? g->N : g->K, g->tb ? g->K : g->N};
    int64_t sc[2] = {g->M, g->N};
    o->a = kiln_randn(sa, 2, KILN_DTYPE_F32);
    o->b = kiln_randn(sb, 2, KILN_DTYPE_F32);
    o->c = kiln_zeros(sc, 2, KILN_DTYPE_F32);
    return o->a && o->b && o->c ? KILN_OK : kiln_last_status();
}

static void operands_free(operands *o)
{
    kiln_tensor_free(o->a);
    kiln_tensor_free(o->b);
    kiln_tensor_free(o->c);
}

/* kiln_matmul as kiln's layers call it, views included; returns seconds, or -1 on
 * error. With check set, also the largest |kiln - BLAS| relative to max |BLAS|. */
static double time_kiln(const gemm_case *g, const operands *o, double *check)
{
    kiln_scope_begin();
    double t0 = bench_now_s();
    kiln_tensor_t *a = g->ta ? kiln_transpose(o->a, 0, 1) : o->a;
    kiln_tensor_t *b = g->tb ? kiln_transpose(o->b, 0, 1) : o->b;
    kiln_tensor_t *y = kiln_matmul(a, b);
    double t = bench_now_s() - t0;
    if (y && check) {
        const float *p = kiln__data(y), *q = kiln__data(o->c);
        double err = 0, mag = 0;
        for (int64_t i = 0; i < g->M * g->N; i++) {
            err = fmax(err, fabs((double)p[i] - (double)q[i]));
            mag = fmax(mag, fabs((double)q[i]));
        }
        *check = mag > 0 ? err / mag : err;
    }
    kiln_scope_end();
    return y ? t : -1;
}

static double time_blas(const gemm_case *g, const operands *o)
{
    const float *a = kiln__data(o->a), *b = kiln__data(o->b);
    float *c = kiln__data(o->c);
    double t0 = bench_now_s();
    cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans, (int)g->M,
                (int)g->N, (int)g->K, 1.0f, a, (int)(g->ta ? g->M : g->K), b, (int)(g->tb ? g->K : g->N), 0.0f, c,
                (int)g->N);
    return bench_now_s() - t0;
}

typedef struct {
    double kiln_s, blas_s, rel_err;
} gemm_result;

/* Median seconds of each side over reps interleaved repetitions (after warmup). */
static kiln_status run_case(const gemm_case *g, int reps, int warmup, gemm_result *r)
{
    operands o;
    if (operands_new(g, &o) != KILN_OK) {
        operands_free(&o);
        return kiln_last_status();
    }
    double *tk = malloc(sizeof *tk * (size_t)reps), *tb = malloc(sizeof *tb * (size_t)reps);
    kiln_status st = tk && tb ? KILN_OK : KILN_ERR_OOM;
    for (int i = 0; i < warmup && st == KILN_OK; i++) {
        time_blas(g, &o);
        if (time_kiln(g, &o, NULL) < 0) st = kiln_last_status();
    }
    time_blas(g, &o);
    if (st == KILN_OK && time_kiln(g, &o, &r->rel_err) < 0) st = kiln_last_status();
    for (int i = 0; i < reps && st == KILN_OK; i++) {
        if (i % 2) {
            tb[i] = time_blas(g, &o);
            tk[i] = time_kiln(g, &o, NULL);
        } else {
            tk[i] = time_kiln(g, &o, NULL);
            tb[i] = time_blas(g, &o);
        }
        if (tk[i] < 0) st = kiln_last_status();
    }
    if (st == KILN_OK) {
        r->kiln_s = median(tk, reps);
        r->blas_s = median(tb, reps);
    }
    free(tk);
    free(tb);
    operands_free(&o);
    return st;
}

static double gflops(const gemm_case *g, double s) { return 2.0 * (double)g->M * g->N * g->K / s * 1e-9; }

static const char *layout(const gemm_case *g)
{
    static const char *names[4] = {"NN", "NT", "TN", "TT"};
    return names[(g->ta ? 2 : 0) + (g->tb ? 1 : 0)];
}

static int bench_peak(int reps)
{
    const gemm_case g = {"square 1024^3", 1024, 1024, 1024, false, false, 0};
    gemm_result r;
    if (run_case(&g, reps, 3, &r) != KILN_OK) return 1;
    printf("\n## peak\n%-22s %6s %6s %6s %3s %4s %10s %10s %6s\n", "gemm", "M", "N", "K", "op", "x",
           "kiln GF/s", "BLAS GF/s", "ratio");
    printf("%-22s %6lld %6lld %6lld %3s %4s %10.1f %10.1f %6.2f\n", g.name, (long long)g.M, (long long)g.N,
           (long long)g.K, layout(&g), "", gflops(&g, r.kiln_s), gflops(&g, r.blas_s), r.blas_s / r.kiln_s);
    return 0;
}

static int bench_shapes(int reps)
{
    /* Linear layers of config S: W stored (out, in); rows = B*T. */
    static const struct {
        const char *name;
        int64_t in, out;
        int count;
    } layers[] = {
        {"qkv", 256, 768, 4},   {"attn.proj", 256, 256, 4}, {"mlp.fc", 256, 1024, 4},
        {"mlp.proj", 1024, 256, 4}, {"lm_head", 256, 256, 1}, /* tied with the (256,256) embedding */
    };
    const int64_t rows = 2048;
    printf("\n## shapes (config S, one training step)\n%-22s %6s %6s %6s %3s %4s %10s %10s %6s %8s\n", "gemm", "M",
           "N", "K", "op", "x", "kiln GF/s", "BLAS GF/s", "ratio", "rel.err");
    double step_k = 0, step_b = 0, step_flop = 0;
    for (size_t l = 0; l < sizeof layers / sizeof layers[0]; l++) {
        int64_t in = layers[l].in, out = layers[l].out;
        int c = layers[l].count;
        gemm_case cases[4] = {
            {"fwd x@W^T", rows, out, in, false, true, c},
            {"dX=dY@W", rows, in, out, false, false, c},
            {"dW^T=X^T@dY", in, out, rows, true, false, c},
            {"(dW=dY^T@X)", out, in, rows, true, false, 0},
        };
        for (int i = 0; i < 4; i++) {
            const gemm_case *g = &cases[i];
            gemm_result r;
            if (run_case(g, reps, 2, &r) != KILN_OK) return 1;
            char label[64];
            snprintf(label, sizeof label, "%s %s", layers[l].name, g->name);
            printf("%-22s %6lld %6lld %6lld %3s %4d %10.1f %10.1f %6.2f %8.1e\n", label, (long long)g->M,
                   (long long)g->N, (long long)g->K, layout(g), g->per_step, gflops(g, r.kiln_s),
                   gflops(g, r.blas_s), r.blas_s / r.kiln_s, r.rel_err);
            step_k += g->per_step * r.kiln_s;
            step_b += g->per_step * r.blas_s;
            step_flop += g->per_step * 2.0 * (double)g->M * g->N * g->K;
        }
    }
    printf("%-22s %6s %6s %6s %3s %4s %10.1f %10.1f %6.2f\n", "step total", "", "", "", "", "", step_flop / step_k * 1e-9,
           step_flop / step_b * 1e-9, step_b / step_k);
    printf("GEMM time per step: kiln %.1f ms, BLAS %.1f ms (%.2f GFLOP)\n", step_k * 1e3, step_b * 1e3,
           step_flop * 1e-9);
    return 0;
}

/* mlp.fc forward then gelu on its output, as GPT-2's MLP runs them. Per repetition:
 * "loop": GEMM, gelu, GEMM, gelu back to back, as in a training step, timing the second
 * pair; "rested": each op alone after a rest of rest_ms, long enough for a BLAS thread
 * that spins after its work (libgomp's GOMP_SPINCOUNT, OpenBLAS's thread timeout) to
 * have gone to sleep. loop / rested is what the two thread pools cost each other. */
static kiln_tensor_t *fc(kiln_tensor_t *x, kiln_tensor_t *w) { return kiln_matmul(x, kiln_transpose(w, 0, 1)); }

static int bench_mix(int reps, int rest_ms)
{
    const int64_t sx[2] = {2048, 256}, sw[2] = {1024, 256};
    kiln_tensor_t *x = kiln_randn(sx, 2, KILN_DTYPE_F32), *w = kiln_randn(sw, 2, KILN_DTYPE_F32);
    double *v[4];
    for (int i = 0; i < 4; i++) v[i] = malloc(sizeof *v[i] * (size_t)reps);
    if (!x || !w || !v[0] || !v[1] || !v[2] || !v[3]) return 1;
    int bad = 0;
    for (int i = -2; i < reps && !bad; i++) { /* two warm-up rounds */
        kiln_scope_begin();
        kiln_tensor_t *h = fc(x, w), *y = kiln_gelu(h, true);
        double t0 = bench_now_s();
        h = fc(x, w);
        double t1 = bench_now_s();
        y = kiln_gelu(h, true);
        double t2 = bench_now_s();
        bad |= !y;
        kiln_scope_end();

        kiln_scope_begin();
        h = fc(x, w);
        bench_sleep_ms(rest_ms);
        double t3 = bench_now_s();
        y = kiln_gelu(h, true);
        double t4 = bench_now_s();
        bench_sleep_ms(rest_ms);
        double t5 = bench_now_s();
        h = fc(x, w);
        double t6 = bench_now_s();
        bad |= !y || !h;
        kiln_scope_end();
        if (i < 0) continue;
        v[0][i] = t1 - t0; /* gemm in the loop (after a gelu) */
        v[1][i] = t6 - t5; /* gemm rested */
        v[2][i] = t2 - t1; /* gelu in the loop (after a gemm) */
        v[3][i] = t4 - t3; /* gelu rested */
    }
    kiln_tensor_free(x);
    kiln_tensor_free(w);
    if (bad) return 1;
    double m[4];
    for (int i = 0; i < 4; i++) {
        m[i] = median(v[i], reps);
        free(v[i]);
    }
    printf("\n## mix: mlp.fc GEMM (2048x256 @ 256x1024) and kiln_gelu (2048,1024), rest %d ms\n", rest_ms);
    printf("%-28s %9s\n", "median", "ms");
    printf("%-28s %9.3f\n", "gemm in loop", m[0] * 1e3);
    printf("%-28s %9.3f\n", "gemm rested", m[1] * 1e3);
    printf("%-28s %9.3f\n", "gelu in loop", m[2] * 1e3);
    printf("%-28s %9.3f\n", "gelu rested", m[3] * 1e3);
    printf("%-28s %9.3f\n", "pair in loop", (m[0] + m[2]) * 1e3);
    printf("slowdown in the loop: gemm %.2fx, gelu %.2fx, pair %.2fx\n", m[0] / m[1], m[2] / m[3],
           (m[0] + m[2]) / (m[1] + m[3]));
    return 0;
}

int main(int argc, char **argv)
{
    int threads = 0, reps = 21, rest_ms = 150;
    const char *only = NULL;
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (i + 1 < argc && !strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (i + 1 < argc && !strcmp(argv[i], "--rest-ms")) rest_ms = atoi(argv[i + 1]);
        else if (i + 1 < argc && !strcmp(argv[i], "--only")) only = argv[i + 1];
        else {
            fprintf(stderr, "usage: bench_gemm [--threads N] [--reps N] [--rest-ms N] [--only peak|shapes|mix]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (rest_ms < 0) rest_ms = 0;
    /* kiln_init also sets the BLAS thread count (bli_thread_set_num_threads or
     * openblas_set_num_threads), overriding BLIS_NUM_THREADS / OPENBLAS_NUM_THREADS. */
    if (kiln_init(threads) != KILN_OK) {
        fprintf(stderr, "bench_gemm: %s\n", kiln_last_error());
        return 1;
    }
    char lib[512];
    loaded_blas(lib, sizeof lib);
    const char *wp = getenv("OMP_WAIT_POLICY");
    printf("# bench_gemm: %s\n# blas library: %s\n# kiln_num_threads() = %d, OMP_WAIT_POLICY=%s, reps=%d (medians)\n",
           kiln_build_info(), lib, kiln_num_threads(), wp ? wp : "(unset)", reps);
    int rc = 0;
    if (!only || !strcmp(only, "peak")) rc |= bench_peak(reps);
    if (!only || !strcmp(only, "shapes")) rc |= bench_shapes(reps);
    if (!only || !strcmp(only, "mix")) rc |= bench_mix(reps, rest_ms);
    if (rc) fprintf(stderr, "bench_gemm: %s\n", kiln_last_error());
    return rc;
}
