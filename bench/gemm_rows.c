/* bench/gemm_rows: why the serving engine's linear layers use kiln_matmul_rows, and
 * what it costs. For the weight shapes of a GPT layer (x (M,K) times W (N,K)^T, as
 * kiln_linear lays them out):
 *   invariance  whether row 0 of an M-row product is bitwise the row 0 of a 16-row
 *               product, for M = 1..16, through cblas_sgemm and through
 *               kiln_matmul_rows (the engine needs "yes" for every M);
 *   speed       median microseconds of one product at M = 1, 4, 16, 64, 512,
 *               interleaved: the BLAS; kiln_matmul_rows, which packs W on each call;
 *               kiln_matmul_rows_packed with W packed once (what the engine runs);
 *               the same with W packed as bf16 (kiln serve --weights bf16); and the
 *               ratios to the BLAS (< 1 means kiln is faster) and bf16 / f32 packed.
 *
 *   bench_gemm_rows [--reps N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "bench.h"
#include "kiln/kiln.h"

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void blas(const float *x, const float *w, float *y, int M, int N, int K)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);
}

/* wp: NULL for kiln_matmul_rows, else w packed for kiln_matmul_rows_packed. */
static void rows(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *wp, float *y, int M, int N)
{
    kiln_scope_begin();
    kiln_tensor_t *o = wp ? kiln_matmul_rows_packed(kiln_narrow(x, 0, 0, M), wp, N)
                          : kiln_matmul_rows(kiln_narrow(x, 0, 0, M), w);
    if (!o || kiln_tensor_to_host(o, y, sizeof(float) * (size_t)M * (size_t)N) != KILN_OK) {
        fprintf(stderr, "bench_gemm_rows: %s\n", kiln_last_error());
        exit(1);
    }
    kiln_scope_end();
}

int main(int argc, char **argv)
{
    int reps = 21;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_gemm_rows [--reps N]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 1000) reps = 21;
    /* (K, N): a width-384 GPT-2 layer (qkv, proj, fc, out) and its 256-token head, and a
     * width-128 layer (the demo model). */
    const int shapes[][2] = {{384, 1152}, {384, 384}, {384, 1536}, {1536, 384}, {384, 256},
                             {128, 384}, {128, 128}, {128, 512}, {512, 128}, {2048, 8192}};
    const int ns = (int)(sizeof shapes / sizeof shapes[0]), Ms[] = {1, 4, 16, 64, 512};
    printf("invariance: M values whose row 0 differs from the 16-row product's\n");
    printf("%-12s %-28s %s\n", "K x N", "cblas_sgemm", "kiln_matmul_rows");
    kiln_scope_begin();
    for (int s = 0; s < ns; s++) {
        int K = shapes[s][0], N = shapes[s][1], MX = 512;
        int64_t xs[2] = {MX, K}, ws[2] = {N, K};
        kiln_manual_seed(1);
        kiln_tensor_t *xt = kiln_randn(xs, 2, KILN_DTYPE_F32), *wt = kiln_randn(ws, 2, KILN_DTYPE_F32);
        float *x = malloc(sizeof(float) * (size_t)MX * (size_t)K), *w = malloc(sizeof(float) * (size_t)N * (size_t)K);
        float *ref = malloc(sizeof(float) * 16 * (size_t)N), *y = malloc(sizeof(float) * (size_t)MX * (size_t)N);
        kiln_tensor_to_host(xt, x, sizeof(float) * (size_t)MX * (size_t)K);
        kiln_tensor_to_host(wt, w, sizeof(float) * (size_t)N * (size_t)K);
        char db[128] = "", dr[128] = "";
        for (int pass = 0; pass < 2; pass++) {
            char *d = pass ? dr : db;
            if (pass) rows(xt, wt, NULL, ref, 16, N);
            else blas(x, w, ref, 16, N, K);
            for (int M = 1; M <= 16; M++) {
                if (pass) rows(xt, wt, NULL, y, M, N);
                else blas(x, w, y, M, N, K);
                if (memcmp(y, ref, sizeof(float) * (size_t)N))
                    snprintf(d + strlen(d), sizeof db - strlen(d), "%d ", M);
            }
            if (!*d) snprintf(d, sizeof db, "none");
        }
        printf("%4d x %-5d %-28s %s\n", K, N, db, dr);
        free(x);
        free(w);
        free(ref);
        free(y);
    }
    printf("\nspeed: median us per product over %d interleaved runs\n", reps);
    printf("%-12s %5s %10s %10s %10s %10s %7s %7s %9s\n", "K x N", "M", "BLAS", "rows", "packed", "bf16", "ratio",
           "ratio_p", "bf16/f32");
    for (int s = 0; s < ns; s++) {
        int K = shapes[s][0], N = shapes[s][1], MX = 512;
        int64_t xs[2] = {MX, K}, ws[2] = {N, K};
        kiln_tensor_t *xt = kiln_randn(xs, 2, KILN_DTYPE_F32), *wt = kiln_randn(ws, 2, KILN_DTYPE_F32);
        kiln_tensor_t *wp = kiln_matmul_rows_pack(wt), *wh = kiln_matmul_rows_pack(kiln_cast(wt, KILN_DTYPE_BF16));
        float *x = malloc(sizeof(float) * (size_t)MX * (size_t)K), *w = malloc(sizeof(float) * (size_t)N * (size_t)K);
        float *y = malloc(sizeof(float) * (size_t)MX * (size_t)N);
        kiln_tensor_to_host(xt, x, sizeof(float) * (size_t)MX * (size_t)K);
        kiln_tensor_to_host(wt, w, sizeof(float) * (size_t)N * (size_t)K);
        for (int mi = 0; mi < 5; mi++) {
            int M = Ms[mi];
            double tb[1000], tr[1000], tp[1000], th[1000];
            for (int r = 0; r < reps; r++) {
                double t0 = bench_now_s();
                blas(x, w, y, M, N, K);
                double t1 = bench_now_s();
                rows(xt, wt, NULL, y, M, N);
                double t2 = bench_now_s();
                rows(xt, wt, wp, y, M, N);
                double t3 = bench_now_s();
                rows(xt, wt, wh, y, M, N);
                double t4 = bench_now_s();
                tb[r] = (t1 - t0) * 1e6;
                tr[r] = (t2 - t1) * 1e6;
                tp[r] = (t3 - t2) * 1e6;
                th[r] = (t4 - t3) * 1e6;
            }
            double mb = median(tb, reps), mr = median(tr, reps), mp = median(tp, reps), mh = median(th, reps);
            printf("%4d x %-5d %5d %10.1f %10.1f %10.1f %10.1f %7.2f %7.2f %9.2f\n", K, N, M, mb, mr, mp, mh, mr / mb,
                   mp / mb, mh / mp);
        }
        free(x);
        free(w);
        free(y);
    }
    kiln_scope_end();
    printf("threads: %d\n", kiln_num_threads());
    return 0;
}
