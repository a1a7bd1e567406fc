/* bench/epilogue_panels: would a matmul's pointwise epilogue (bias add, then GELU, the
 * fused kernel kiln compile runs after the BLAS call) be cheaper inside the GEMM? A
 * BLAS call cannot run our code on its output tile, so "inside" on the cpu means row
 * panels: each thread multiplies P rows at a time and runs the epilogue on those rows
 * while they are still in its cache. Against that: every panel call packs the whole B
 * operand again. For config S's MLP shapes, x (M,K) times W (N,K)^T on 2 threads (each
 * its half of the rows, the BLAS single-threaded inside, as kiln's pool runs it),
 * median milliseconds of: the whole half then the epilogue over it (what kiln does),
 * and panels of 64, 128, 256 rows, each with and without the epilogue, interleaved.
 *
 *   bench_epilogue_panels [--reps N]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "bench.h"
#include "kiln/kiln.h"

typedef struct {
    int M, N, K, panel;
    bool epilogue;
    const float *a, *b, *bias;
    float *c, *h;
} job;

typedef struct {
    const job *j;
    int r0, r1;
} part;

/* c = c + bias (the pre-activation, kept for backward), h = gelu(c), tanh form with a
 * rational tanh that vectorizes: as cheap per element as kiln's generated kernel, so
 * that the epilogue is bound by memory as that kernel is (with libm's tanhf it would be
 * bound by arithmetic, and no cache placement would show). */
static void epilogue(const job *j, int r0, int r1)
{
    for (int i = r0; i < r1; i++) {
        float *c = j->c + (size_t)i * j->N, *h = j->h + (size_t)i * j->N;
        for (int n = 0; n < j->N; n++) {
            float x = c[n] + j->bias[n], u = 0.7978845608f * (x + 0.044715f * x * x * x);
            float th = u * (27.0f + u * u) / (27.0f + 9.0f * u * u);
            th = th > 1.0f ? 1.0f : th < -1.0f ? -1.0f : th;
            c[n] = x;
            h[n] = 0.5f * x * (1.0f + th);
        }
    }
}

static void *run_part(void *arg)
{
    const part *p = arg;
    const job *j = p->j;
    int step = j->panel ? j->panel : p->r1 - p->r0;
    for (int i = p->r0; i < p->r1; i += step) {
        int m = i + step <= p->r1 ? step : p->r1 - i;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, j->N, j->K, 1.0f, j->a + (size_t)i * j->K, j->K, j->b,
                    j->K, 0.0f, j->c + (size_t)i * j->N, j->N);
        if (j->panel && j->epilogue) epilogue(j, i, i + m);
    }
    if (!j->panel && j->epilogue) epilogue(j, p->r0, p->r1);
    return NULL;
}

static double run_ms(const job *j)
{
    part p[2] = {{j, 0, j->M / 2}, {j, j->M / 2, j->M}};
    pthread_t t[2];
    double t0 = bench_now_s();
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, run_part, &p[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    return 1e3 * (bench_now_s() - t0);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    int reps = 21;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: bench_epilogue_panels [--reps N]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 1000) reps = 21;
    kiln_init(1); /* the BLAS single-threaded: the two threads here are the pool's */
    static const int shapes[][3] = {{2048, 1024, 256}, {2048, 256, 1024}}; /* mlp.fc, mlp.proj */
    static const int panels[] = {0, 64, 128, 256};
    enum { NP = sizeof panels / sizeof panels[0] };
    printf("# bench_epilogue_panels: median ms of x (M,K) W(N,K)^T + bias + GELU on 2 threads, %d reps\n", reps);
    printf("# panel 0: the whole half, then the epilogue (kiln today)\n");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        float *a = malloc(sizeof(float) * (size_t)M * K), *b = malloc(sizeof(float) * (size_t)N * K);
        float *c = malloc(sizeof(float) * (size_t)M * N), *h = malloc(sizeof(float) * (size_t)M * N);
        float *bias = malloc(sizeof(float) * (size_t)N);
        if (!a || !b || !c || !h || !bias) {
            fprintf(stderr, "bench_epilogue_panels: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < (size_t)M * K; i++) a[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
        for (size_t i = 0; i < (size_t)N * K; i++) b[i] = (float)((i * 104729) % 1000) / 1000.0f - 0.5f;
        for (int n = 0; n < N; n++) bias[n] = 0.01f * (float)n;
        double *t = malloc(sizeof(double) * (size_t)reps * NP * 2);
        for (int r = 0; r < reps; r++)
            for (int q = 0; q < NP; q++)
                for (int e = 0; e < 2; e++) {
                    job j = {M, N, K, panels[q], e == 1, a, b, bias, c, h};
                    t[((size_t)q * 2 + (size_t)e) * (size_t)reps + (size_t)r] = run_ms(&j);
                }
        for (int q = 0; q < NP; q++) {
            double g = median(t + (size_t)q * 2 * (size_t)reps, reps);
            double ge = median(t + ((size_t)q * 2 + 1) * (size_t)reps, reps);
            printf("M %d N %d K %d  panel %3d:  gemm %6.3f ms  gemm+epilogue %6.3f ms\n", M, N, K, panels[q], g, ge);
        }
        free(t), free(a), free(b), free(c), free(h), free(bias);
    }
    return 0;
}
