/* Attention over a paged KV cache, for the serving engine: each query row attends to
 * the positions 0..p of its own sequence, whose keys and values sit in fixed-size
 * blocks named by a block table. Every (row, head) is computed alone and in one fixed
 * order, so a row's result does not depend on which other rows share the call. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"

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
    const float *q, *k, *v;
    const int32_t *bt, *sp;
    float *out;
    int64_t H, Hkv, D, bl, max_blocks, max_pos;
    float scale;
    atomic_int oom;
} paged_ctx;

/* x . y in eight lanes, then the tail: one fixed order. */
static inline float dot(const float *x, const float *y, int64_t n)
{
    int64_t n8 = n / 8 * 8;
    v8 acc = {0};
    for (int64_t i = 0; i < n8; i += 8) {
        v8 a, b;
        LOAD8(a, x + i);
        LOAD8(b, y + i);
        acc += a * b;
    }
    float s = LANES_SUM(acc);
    for (int64_t i = n8; i < n; i++) s += x[i] * y[i];
    return s;
}

KILN_SIMD static void paged_range(void *c, int64_t b, int64_t e)
{
    paged_ctx *k = c;
    float *w = malloc(sizeof(float) * (size_t)k->max_pos);
    if (!w) {
        atomic_store(&k->oom, 1);
        return;
    }
    int64_t D = k->D, group = k->H / k->Hkv;
    for (int64_t t = b; t < e; t++) {
        int64_t n = t / k->H, h = t % k->H, kvh = h / group;
        int64_t seq = k->sp[n * 2], p = k->sp[n * 2 + 1];
        const int32_t *row = k->bt + seq * k->max_blocks;
        const float *q = k->q + t * D;
        float m = -INFINITY;
        for (int64_t j = 0; j <= p; j++) {
            int64_t slot = (int64_t)row[j / k->bl] * k->bl + j % k->bl;
            const float *kr = k->k + (slot * k->Hkv + kvh) * D;
            w[j] = dot(q, kr, D) * k->scale;
            if (w[j] > m) m = w[j];
        }
        float sum = 0;
        for (int64_t j = 0; j <= p; j++) {
            w[j] = expf(w[j] - m);
            sum += w[j];
        }
        float *o = k->out + t * D, inv = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) o[d] = 0;
        for (int64_t j = 0; j <= p; j++) {
            int64_t slot = (int64_t)row[j / k->bl] * k->bl + j % k->bl;
            const float *vr = k->v + (slot * k->Hkv + kvh) * D;
            float wj = w[j] * inv;
            for (int64_t d = 0; d < D; d++) o[d] += wj * vr[d];
        }
    }
    free(w);
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
                       c[3]->shape[1] * bl, (float)a->f[0], 0};
        int64_t tasks = N * k.H;
        kiln__parallel_for(tasks, 1 + CPU_GRAIN / (k.D * 64), paged_range, &k);
        if (atomic_load(&k.oom)) s = kiln__err(KILN_ERR_OOM, "paged_attention: out of memory for a score buffer");
    }
    for (int i = 0; i < 5; i++) kiln_tensor_free(tmp[i]);
    return s;
}

/* ---- matmul_rows: out (M,N) = a (M,K) w (N,K)^T, one fixed summation order ----
 * Each element is summed in 8 lanes over K (lane l takes k = l mod 8), the lanes added
 * in one fixed tree, then the tail; four rows of w share each pass over a row of a.
 * The blocks of w are split across threads, never the sum, so neither M, nor an
 * element's place in the output, nor the thread count changes a result. Written by
 * hand because the BLAS gives no such promise (see kiln_matmul_rows in ops.h). */
typedef struct {
    const float *a, *w;
    float *out;
    int64_t M, N, K;
} rows_ctx;

/* out[r][j] = x[r] . w[j] for two rows of x and four of w. */
__attribute__((target_clones("arch=x86-64-v3", "default"))) static void dot_2x4(const float *const *x, const float *const *w, int64_t K, float out[2][4])
{
    int64_t K8 = K / 8 * 8;
    v8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    for (int64_t i = 0; i < K8; i += 8) {
        v8 x0, x1, w0, w1, w2, w3;
        LOAD8(x0, x[0] + i);
        LOAD8(x1, x[1] + i);
        LOAD8(w0, w[0] + i);
        LOAD8(w1, w[1] + i);
        LOAD8(w2, w[2] + i);
        LOAD8(w3, w[3] + i);
        a00 += x0 * w0;
        a01 += x0 * w1;
        a02 += x0 * w2;
        a03 += x0 * w3;
        a10 += x1 * w0;
        a11 += x1 * w1;
        a12 += x1 * w2;
        a13 += x1 * w3;
    }
    v8 acc[2][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}};
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) {
            float s = LANES_SUM(acc[r][j]);
            for (int64_t i = K8; i < K; i++) s += x[r][i] * w[j][i];
            out[r][j] = s;
        }
}

/* The same sums for one row of x: an odd last row, summed exactly as dot_2x4 would. */
__attribute__((target_clones("arch=x86-64-v3", "default"))) static void dot_1x4(const float *x, const float *const *w, int64_t K, float out[4])
{
    int64_t K8 = K / 8 * 8;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < K8; i += 8) {
        v8 x0, w0, w1, w2, w3;
        LOAD8(x0, x + i);
        LOAD8(w0, w[0] + i);
        LOAD8(w1, w[1] + i);
        LOAD8(w2, w[2] + i);
        LOAD8(w3, w[3] + i);
        a0 += x0 * w0;
        a1 += x0 * w1;
        a2 += x0 * w2;
        a3 += x0 * w3;
    }
    v8 acc[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4; j++) {
        float s = LANES_SUM(acc[j]);
        for (int64_t i = K8; i < K; i++) s += x[i] * w[j][i];
        out[j] = s;
    }
}

/* Rows of a go in pairs, for eight independent sums in flight, and an odd last row
 * through dot_1x4 (a last block of w repeats its last row); each element is summed by
 * the same sequence of operations wherever it sits. */
static void rows_range(void *c, int64_t b, int64_t e)
{
    const rows_ctx *k = c;
    int64_t K = k->K;
    for (int64_t blk = b; blk < e; blk++) {
        int64_t n0 = blk * 4;
        const float *w[4];
        for (int j = 0; j < 4; j++) w[j] = k->w + (n0 + j < k->N ? n0 + j : k->N - 1) * K;
        for (int64_t m = 0; m < k->M; m += 2) {
            float o[2][4];
            if (m + 1 < k->M) dot_2x4((const float *[2]){k->a + m * K, k->a + (m + 1) * K}, w, K, o);
            else dot_1x4(k->a + m * K, w, K, o[0]);
            for (int r = 0; r < 2 && m + r < k->M; r++)
                for (int j = 0; j < 4 && n0 + j < k->N; j++) k->out[(m + r) * k->N + n0 + j] = o[r][j];
        }
    }
}

kiln_status kiln__cpu_matmul_rows(K_ARGS)
{
    kiln_tensor_t *ta, *tw, *ca = cpu_contig(in[0], &ta), *cw = cpu_contig(in[1], &tw);
    kiln_status s = ca && cw ? KILN_OK : kiln_last_status();
    if (s == KILN_OK) {
        rows_ctx k = {kiln__data(ca), kiln__data(cw), kiln__data(out[0]), ca->shape[0], cw->shape[0], ca->shape[1]};
        int64_t blocks = (k.N + 3) / 4, work = k.M * k.K * 4;
        kiln__parallel_for(blocks, 1 + CPU_GRAIN * 4 / (work ? work : 1), rows_range, &k);
    }
    kiln_tensor_free(ta);
    kiln_tensor_free(tw);
    return s;
}
