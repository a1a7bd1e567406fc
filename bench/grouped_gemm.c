/* bench/grouped_gemm: kiln_grouped_matmul (a mixture-of-experts layer's product, one op
 * for all the experts) against one kiln_matmul of the same total size, the ratio the
 * issue asks to be at least 0.85.
 *
 * Sizes as a config-S MoE layer routes them: M = 2 * 16 * 256 = 8192 assignments (B 16,
 * T 256, top-2) over E = 8 experts, K = 256, N = 256 (an expert's up projection at
 * config S's width) and 128; f32. The counts are equal (1024 each) or skewed (weights
 * 1/(e+1), about 2800 down to 340 rows, none a multiple of 128). The peer is
 * kiln_matmul of x (M, K) by one (K, N) weight: the same flops in one GEMM.
 *
 *   forward   grouped (M,K) x (E,K,N) against (M,K) x (K,N);
 *   backward  the grouped backward op (dx and every dw[e]) against the two GEMMs of a
 *             matmul's backward, dY W^T and X^T dY.
 *
 * Repetitions alternate which side runs first; each side's median; the ratio is GEMM
 * time / grouped time (1.00: grouping costs nothing, above 1: grouped is faster).
 *
 * --device NAME makes every tensor there (opencl: the grouped ops' own kernels against
 * the backend's tiled matmul); each run is timed to kiln_device_synchronize.
 *
 *   bench_grouped_gemm [--threads N] [--reps N] [--device NAME]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/kiln.h"
#include "core/op_table.h"

#define E 8
#define M (2 * 16 * 256)
#define K 256

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    kiln_tensor_t *x, *w, *w0, *dy, *offsets;
} operands;

/* One side's run: seconds, or -1 on error. */
static double run(const operands *o, bool grouped, bool backward)
{
    kiln_scope_begin();
    double t0 = bench_now_s();
    bool ok;
    if (!backward) {
        ok = (grouped ? kiln_grouped_matmul(o->x, o->w, o->offsets) : kiln_matmul(o->x, o->w0)) != NULL;
    } else if (grouped) {
        kiln_tensor_t *in[4] = {o->dy, o->x, o->w, o->offsets}, *out[KILN__MAX_OUT] = {0};
        ok = kiln__dispatch(KILN_OP_GROUPED_MATMUL_BACKWARD, in, 4, &(kiln__attrs){0}, out) == KILN_OK;
        kiln_tensor_free(out[0]);
        kiln_tensor_free(out[1]);
    } else {
        ok = kiln_matmul(o->dy, kiln_transpose(o->w0, 0, 1)) && kiln_matmul(kiln_transpose(o->x, 0, 1), o->dy);
    }
    ok = ok && kiln_device_synchronize(kiln_device()) == KILN_OK;
    double t = bench_now_s() - t0;
    kiln_scope_end();
    return ok ? t : -1;
}

/* Median seconds of each side over reps interleaved repetitions, after 3 warm-ups. */
static int measure(const operands *o, bool backward, int reps, double *grouped_s, double *gemm_s)
{
    double *tg = malloc(sizeof *tg * (size_t)reps), *tm = malloc(sizeof *tm * (size_t)reps);
    int rc = tg && tm ? 0 : 1;
    for (int i = 0; i < 3 && !rc; i++) rc = run(o, true, backward) < 0 || run(o, false, backward) < 0;
    for (int i = 0; i < reps && !rc; i++) {
        bool first = i % 2;
        double a = run(o, first, backward), b = run(o, !first, backward);
        tg[i] = first ? a : b;
        tm[i] = first ? b : a;
        rc = a < 0 || b < 0;
    }
    if (!rc) {
        *grouped_s = median(tg, reps);
        *gemm_s = median(tm, reps);
    }
    free(tg);
    free(tm);
    return rc;
}

int main(int argc, char **argv)
{
    int threads = 0, reps = 31;
    const char *dev = "cpu";
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (i + 1 < argc && !strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (i + 1 < argc && !strcmp(argv[i], "--device")) dev = argv[i + 1];
        else {
            fprintf(stderr, "usage: bench_grouped_gemm [--threads N] [--reps N] [--device NAME]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (kiln_init(threads) != KILN_OK || kiln_set_device(dev) != KILN_OK) {
        fprintf(stderr, "bench_grouped_gemm: %s\n", kiln_last_error());
        return 1;
    }
    /* equal counts, and skewed ones: weights 1/(e+1), the rounding left to expert 0 */
    int64_t counts[2][E], left = M;
    double hsum = 0;
    for (int e = 0; e < E; e++) hsum += 1.0 / (e + 1);
    for (int e = E - 1; e >= 0; e--) {
        counts[0][e] = M / E;
        counts[1][e] = e ? (int64_t)(M / hsum / (e + 1)) : left;
        left -= counts[1][e];
    }
    printf("# bench_grouped_gemm: %s\n# device %s, kiln_num_threads() = %d, reps = %d (medians), f32, M %d K %d E %d\n",
           kiln_build_info(), kiln_device(), kiln_num_threads(), reps, M, K, E);
    printf("%-9s %-7s %5s %28s %11s %11s %8s %8s %7s\n", "pass", "counts", "N", "rows per expert", "grouped ms",
           "GEMM ms", "grp GF/s", "GEMM GF/s", "ratio");
    int rc = 0;
    const int64_t Ns[2] = {256, 128};
    for (int b = 0; b < 2 && !rc; b++)
        for (int n = 0; n < 2 && !rc; n++)
            for (int c = 0; c < 2 && !rc; c++) {
                int64_t N = Ns[n], off[E + 1] = {0};
                for (int e = 0; e < E; e++) off[e + 1] = off[e] + counts[c][e];
                kiln_manual_seed(7);
                operands o = {kiln_randn((int64_t[]){M, K}, 2, KILN_DTYPE_F32),
                              kiln_randn((int64_t[]){E, K, N}, 3, KILN_DTYPE_F32),
                              kiln_randn((int64_t[]){K, N}, 2, KILN_DTYPE_F32),
                              kiln_randn((int64_t[]){M, N}, 2, KILN_DTYPE_F32),
                              kiln_from_data(off, (int64_t[]){E + 1}, 1, KILN_DTYPE_I64)};
                double tg = 0, tm = 0;
                rc = !o.x || !o.w || !o.w0 || !o.dy || !o.offsets || measure(&o, b, reps, &tg, &tm);
                if (!rc) {
                    char rows[64];
                    snprintf(rows, sizeof rows, "%lld..%lld", (long long)counts[c][E - 1], (long long)counts[c][0]);
                    double flop = 2.0 * M * K * (double)N * (b ? 2 : 1);
                    printf("%-9s %-7s %5lld %28s %11.3f %11.3f %8.1f %8.1f %7.2f\n", b ? "backward" : "forward",
                           c ? "skewed" : "equal", (long long)N, rows, tg * 1e3, tm * 1e3, flop / tg * 1e-9,
                           flop / tm * 1e-9, tm / tg);
                }
                kiln_tensor_free(o.x);
                kiln_tensor_free(o.w);
                kiln_tensor_free(o.w0);
                kiln_tensor_free(o.dy);
                kiln_tensor_free(o.offsets);
            }
    if (rc) fprintf(stderr, "bench_grouped_gemm: %s\n", kiln_last_error());
    return rc;
}
