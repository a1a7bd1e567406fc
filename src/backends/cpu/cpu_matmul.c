/* Batched matmul on the BLAS (BLIS or OpenBLAS, chosen at build time), or on kiln's
 * own GEMM (f32 with KILN_OPT_OWN_GEMM; bf16 always; f16 with KILN_OPT_OWN_GEMM_F16,
 * else widened to f32). Operands whose
 * last two dims are row-major or transposed go to the BLAS as they are; anything else
 * is copied first. A weight without batch dims is multiplied in one GEMM over all the
 * rows of the other operand, which is how Linear layers reach the BLAS. */
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "backends/cpu/cpu.h"
#include "backends/cpu/gemm.h"
#include "core/opts.h"
#include "core/util.h"

typedef struct {
    enum CBLAS_TRANSPOSE trans;
    int64_t ld;
} mat_layout;

/* Can the (rows, cols) matrix with strides (sr, sc) be passed to BLAS? */
static bool blas_layout(int64_t rows, int64_t cols, int64_t sr, int64_t sc, mat_layout *l)
{
    if (sc == 1 && (sr >= cols || rows == 1)) {
        l->trans = CblasNoTrans;
        l->ld = rows == 1 ? (cols > 0 ? cols : 1) : sr;
        return true;
    }
    if (sr == 1 && (sc >= rows || cols == 1)) {
        l->trans = CblasTrans;
        l->ld = cols == 1 ? (rows > 0 ? rows : 1) : sc;
        return true;
    }
    return false;
}

static void gemm1(kiln_dtype dt, mat_layout la, mat_layout lb, int64_t M, int64_t N, int64_t K, const char *A,
                  const char *B, char *C, int64_t ldc)
{
    if (dt == KILN_DTYPE_F32)
        cblas_sgemm(CblasRowMajor, la.trans, lb.trans, (int)M, (int)N, (int)K, 1.0f, (const float *)A, (int)la.ld,
                    (const float *)B, (int)lb.ld, 0.0f, (float *)C, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, la.trans, lb.trans, (int)M, (int)N, (int)K, 1.0, (const double *)A, (int)la.ld,
                    (const double *)B, (int)lb.ld, 0.0, (double *)C, (int)ldc);
}

/* With KILN_OPT_POOL_GEMM the BLAS runs single-threaded and kiln's own pool splits each
 * GEMM into blocks of rows (or columns, when there are more of them). One pool for all
 * the cores: the BLAS's OpenMP threads no longer spin against kiln's threads between
 * calls (docs/perf-log.md, "one thread pool for GEMM"). A block is a GEMM of whole
 * rows (columns), each element the same sum over K as in one call, so results are the
 * same with any number of threads. */
typedef struct {
    kiln_dtype dt;
    mat_layout la, lb;
    int64_t M, N, K, block;
    bool by_rows;
    const char *A, *B;
    char *C;
    size_t es;
} gemm_ctx;

static void gemm_blocks(void *c, int64_t b, int64_t e)
{
    const gemm_ctx *g = c;
    for (int64_t blk = b; blk < e; blk++) {
        int64_t lo = blk * g->block, n = (g->by_rows ? g->M : g->N) - lo;
        if (n > g->block) n = g->block;
        if (g->by_rows) {
            const char *A = g->A + (g->la.trans == CblasNoTrans ? lo * g->la.ld : lo) * (int64_t)g->es;
            gemm1(g->dt, g->la, g->lb, n, g->N, g->K, A, g->B, g->C + lo * g->N * (int64_t)g->es, g->N);
        } else {
            const char *B = g->B + (g->lb.trans == CblasNoTrans ? lo : lo * g->lb.ld) * (int64_t)g->es;
            gemm1(g->dt, g->la, g->lb, g->M, n, g->K, g->A, B, g->C + lo * (int64_t)g->es, g->N);
        }
    }
}

/* An operand as kiln's own GEMM reads it: a row-major or transposed matrix. */
static kiln__gemm_operand own_operand(const char *p, kiln__gemm_type t, mat_layout l)
{
    return l.trans == CblasNoTrans ? (kiln__gemm_operand){p, t, l.ld, 1} : (kiln__gemm_operand){p, t, 1, l.ld};
}

void kiln__cpu_sgemm(enum CBLAS_ORDER o, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                     float alpha, const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    /* alpha 0 stays with the BLAS, which then reads neither A nor B (an inf in them
     * would make NaNs of the product); so does everything with KILN_OPT_POOL_GEMM off,
     * where attention's tasks run one after another and the BLAS threads each tile */
    if (o == CblasRowMajor && (beta == 0 || beta == 1) && alpha != 0 && kiln__opt(KILN__OPT_OWN_GEMM) &&
        kiln__opt(KILN__OPT_POOL_GEMM) &&
        kiln__gemm_f32_serial(M, N, K, own_operand((const char *)A, KILN__GEMM_F32, (mat_layout){ta, lda}),
                              own_operand((const char *)B, KILN__GEMM_F32, (mat_layout){tb, ldb}), alpha, beta, C, ldc))
        return;
    cblas_sgemm(o, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

bool kiln__cpu_att_panels_wanted_f32(int64_t kv_block)
{
    int64_t nr = kiln__gemm_panel_width();
    return kiln__opt(KILN__OPT_ATT_PANELS) && kiln__opt(KILN__OPT_POOL_GEMM) && nr > 0 && kv_block % nr == 0 &&
           kiln__gemm_kernel_isa(KILN__GEMM_F32) == KILN__GEMM_ISA_AVX512;
}

void kiln__cpu_att_panels_free(kiln__cpu_att_panels *kp)
{
    kiln__gemm_panels_free(&kp->kt);
    kiln__gemm_panels_free(&kp->v);
    kiln__gemm_panels_free(&kp->vt);
    kiln__gemm_panels_free(&kp->k);
    free(kp->t);
    kp->t = NULL, kp->tcap = 0;
}

/* Packs B (K x N: element (k, n) at B[k rs + n cs]) into P; false when out of memory. */
static bool att_pack(kiln__gemm_panels *P, const float *B, int64_t K, int64_t N, int64_t rs, int64_t cs)
{
    if (!kiln__gemm_panels_init(P, K, N)) return false;
    kiln__gemm_panels_pack(P, (kiln__gemm_operand){B, KILN__GEMM_F32, rs, cs});
    return true;
}

/* P = the panels of X^T (D x Tk) for X (Tk x D, row stride ldx): packed from X itself
 * with KILN_OPT_PACK_TRANSPOSED, else from a transposed copy in kp's scratch, as until
 * 2026-12-07. */
static bool att_pack_t(kiln__cpu_att_panels *kp, kiln__gemm_panels *P, const float *X, int64_t ldx, int64_t Tk,
                       int64_t D)
{
    if (kiln__opt(KILN__OPT_PACK_TRANSPOSED)) return att_pack(P, X, D, Tk, 1, ldx);
    size_t bytes = sizeof(float) * (size_t)(D * Tk);
    if (!kiln__reserve(&kp->t, &kp->tcap, bytes, bytes)) return false;
    kiln__cpu_transpose_f32((float *)kp->t, X, Tk, D, ldx);
    return att_pack(P, (const float *)kp->t, D, Tk, Tk, 1);
}

bool kiln__cpu_att_pack_fwd_f32(kiln__cpu_att_panels *kp, const float *K, int64_t ldk, const float *V, int64_t ldv,
                                int64_t Tk, int64_t D)
{
    return att_pack_t(kp, &kp->kt, K, ldk, Tk, D) && att_pack(&kp->v, V, Tk, D, ldv, 1);
}

bool kiln__cpu_att_pack_bwd_f32(kiln__cpu_att_panels *kp, const float *K, int64_t ldk, const float *V, int64_t ldv,
                                int64_t Tk, int64_t D)
{
    return att_pack_t(kp, &kp->kt, K, ldk, Tk, D) && att_pack_t(kp, &kp->vt, V, ldv, Tk, D) &&
           att_pack(&kp->k, K, Tk, D, ldk, 1);
}

bool kiln__cpu_att_gemm_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                            const kiln__gemm_panels *B, int64_t k0, int64_t c0, float alpha, float beta, float *C,
                            int64_t ldc)
{
    return B && kiln__gemm_f32_serial_panels(M, N, K, (kiln__gemm_operand){A, KILN__GEMM_F32, lda, 1}, B, k0, c0, alpha,
                                             beta, C, ldc);
}

/* bf16 operands: kiln's own GEMM, products of bf16 values summed in f32 (AMX or
 * AVX512-BF16 where the processor has them), each result rounded once to bf16, as
 * PyTorch's bf16 matmul does; the BLAS has no bf16 GEMM to fall back to. f16 operands
 * with KILN_OPT_OWN_GEMM_F16: the same GEMM's f32 kernels (products of f16 values are
 * exact in f32), each operand widened as it is packed and each result rounded once to
 * f16 in cache, no widened copy of A, B or C (off by default: no faster than the
 * widened copies and the BLAS in a training step, docs/perf-log.md). */
static kiln_status gemm_half(kiln_dtype dt, mat_layout la, mat_layout lb, int64_t M, int64_t N, int64_t K,
                             const char *A, const char *B, char *C, kiln__epilogue *epi)
{
    kiln__gemm_type t = dt == KILN_DTYPE_BF16 ? KILN__GEMM_BF16 : KILN__GEMM_F16;
    kiln__gemm_operand a = own_operand(A, t, la), b = own_operand(B, t, lb);
    if (epi) epi->out = C;
    if (!(t == KILN__GEMM_BF16 ? kiln__gemm_bf16_epilogue(M, N, K, a, b, (uint16_t *)C, N, epi)
                               : kiln__gemm_f16(M, N, K, a, b, (uint16_t *)C, N)))
        return kiln__err(KILN_ERR_OOM, "matmul: out of memory for a %lld x %lld %s product", (long long)M,
                         (long long)N, kiln_dtype_name(dt));
    return KILN_OK;
}

static kiln_status gemm(kiln_dtype dt, mat_layout la, mat_layout lb, int64_t M, int64_t N, int64_t K, const char *A,
                        const char *B, char *C, kiln__epilogue *epi)
{
    if (kiln__is_half(dt)) return gemm_half(dt, la, lb, M, N, K, A, B, C, epi);
    /* kiln's GEMM threads itself over the pool; it fails only when out of memory for
     * its packing buffers, and the BLAS then does the product. */
    if (dt == KILN_DTYPE_F32 && kiln__opt(KILN__OPT_OWN_GEMM) &&
        kiln__gemm(M, N, K, own_operand(A, KILN__GEMM_F32, la), own_operand(B, KILN__GEMM_F32, lb), (float *)C, N,
                   false, KILN__GEMM_F32))
        return KILN_OK;
    /* Blocks of 128 rows or columns at least (big enough for the BLAS's own blocking),
     * and with KILN_OPT_GEMM_THREAD_BLOCKS one block per thread in multiples of 128:
     * every block call packs the other operand again, so fewer, larger blocks pack it
     * less often. The BLAS's blocked path sums each element over K the same way whatever
     * the block's size, so results do not depend on the thread count (tests/test_tensor.c
     * checks 1 to 4 threads bitwise). But OpenBLAS takes other, small-matrix kernels for
     * M N K <= 100^3 on AVX-512 cores, which sum differently: a GEMM whose 128-row blocks
     * could be that small keeps the fixed 128-row split at any thread count. */
    int64_t block = 128;
    bool by_rows = M >= N;
    if (kiln__opt(KILN__OPT_GEMM_THREAD_BLOCKS) && 128 * (by_rows ? N : M) * K > ((int64_t)1 << 22)) {
        int64_t nt = kiln_num_threads(), per = ((by_rows ? M : N) + nt - 1) / (nt > 0 ? nt : 1);
        block = (per + 127) / 128 * 128;
        if (block < 128) block = 128;
    }
    int64_t nblk = ((by_rows ? M : N) + block - 1) / block;
    if (!kiln__opt(KILN__OPT_POOL_GEMM) || nblk < 2 || M * N * K < (int64_t)1 << 18) {
        gemm1(dt, la, lb, M, N, K, A, B, C, N);
        return KILN_OK;
    }
    gemm_ctx g = {dt, la, lb, M, N, K, block, by_rows, A, B, C, kiln_dtype_size(dt)};
    kiln__parallel_for(nblk, 1, gemm_blocks, &g);
    return KILN_OK;
}

kiln_status kiln__cpu_matmul(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                             kiln_tensor_t *const *out, int n_out)
{
    if (in[0]->dtype == KILN_DTYPE_F16 && !kiln__opt(KILN__OPT_OWN_GEMM_F16))
        return cpu_widened(kiln__cpu_matmul, be, in, n_in, a, out, n_out);
    kiln_tensor_t *x = in[0], *y = in[1], *o = out[0], *tx = NULL, *ty = NULL;
    int nx = x->ndim, ny = y->ndim, no = o->ndim;
    int64_t M = o->shape[no - 2], N = o->shape[no - 1], K = x->shape[nx - 1];
    /* a compiled program's epilogue, for a bf16 result made in one GEMM */
    kiln__epilogue *epi = kiln__epilogue_take(kiln__numel(no, o->shape) / (N > 0 ? N : 1), N);
    if (o->dtype != KILN_DTYPE_BF16 || !kiln__is_contiguous(o)) epi = NULL;
    size_t es = kiln_dtype_size(o->dtype);
    if (K == 0) {
        memset(kiln__data(o), 0, es * (size_t)kiln__numel(no, o->shape));
        return KILN_OK;
    }
    mat_layout la = {CblasNoTrans, 1}, lb = {CblasNoTrans, 1};
    if (!blas_layout(M, K, x->stride[nx - 2], x->stride[nx - 1], &la)) {
        if (!(x = cpu_contig(x, &tx))) return kiln_last_status();
        blas_layout(M, K, x->stride[nx - 2], x->stride[nx - 1], &la);
    }
    if (!blas_layout(K, N, y->stride[ny - 2], y->stride[ny - 1], &lb)) {
        if (!(y = cpu_contig(y, &ty))) {
            kiln_tensor_free(tx);
            return kiln_last_status();
        }
        blas_layout(K, N, y->stride[ny - 2], y->stride[ny - 1], &lb);
    }
    int nb = no - 2;
    int64_t batches = kiln__numel(nb, o->shape);
    /* y without batch dims and x's batch dims stacked like rows: one GEMM. */
    bool y_batched = false;
    for (int d = 0; d < ny - 2; d++) y_batched |= y->shape[d] != 1;
    bool x_stacks = la.trans == CblasNoTrans && nx - 2 == nb;
    int64_t expect = x->stride[nx - 2] * M;
    for (int d = nb - 1; x_stacks && d >= 0; d--) {
        if (x->shape[d] != 1 && x->stride[d] != expect) x_stacks = false;
        expect *= x->shape[d];
    }
    if (x->stride[nx - 2] != la.ld) x_stacks = false; /* with M = 1, ld is K whatever the stride */
    kiln_status s = KILN_OK;
    if (!y_batched && x_stacks && batches > 1) {
        s = gemm(o->dtype, la, lb, M * batches, N, K, kiln__data(x), kiln__data(y), kiln__data(o), epi);
    } else {
        for (int64_t bi = 0; bi < batches && s == KILN_OK; bi++) {
            int64_t rem = bi, ox = 0, oy = 0;
            for (int d = nb - 1; d >= 0; d--) {
                int64_t i = rem % o->shape[d];
                rem /= o->shape[d];
                int jx = d - (nb - (nx - 2)), jy = d - (nb - (ny - 2));
                if (jx >= 0 && x->shape[jx] != 1) ox += i * x->stride[jx];
                if (jy >= 0 && y->shape[jy] != 1) oy += i * y->stride[jy];
            }
            s = gemm(o->dtype, la, lb, M, N, K, (const char *)kiln__data(x) + ox * (int64_t)es,
                     (const char *)kiln__data(y) + oy * (int64_t)es, (char *)kiln__data(o) + bi * M * N * (int64_t)es,
                     batches == 1 ? epi : NULL);
        }
    }
    kiln_tensor_free(tx);
    kiln_tensor_free(ty);
    return s;
}

/* ---- Grouped matmul (mixture of experts): one product per expert, in one kernel ---- */

/* One expert's product: C (M, N) = op(A) (M, K) op(B) (K, N), at the call's layouts, N
 * and element size. */
typedef struct {
    const char *A, *B;
    char *C;
    int64_t M, K;
} group_gemm;

typedef struct {
    kiln_dtype dt;
    mat_layout la, lb;
    int64_t N, block;
    size_t es;
    const group_gemm *g;
    const int64_t *task; /* (group, first row) pairs */
} grouped_ctx;

static void grouped_blocks(void *c, int64_t b, int64_t e)
{
    const grouped_ctx *k = c;
    for (int64_t t = b; t < e; t++) {
        const group_gemm *g = &k->g[k->task[2 * t]];
        int64_t lo = k->task[2 * t + 1], n = g->M - lo < k->block ? g->M - lo : k->block;
        const char *A = g->A + (k->la.trans == CblasNoTrans ? lo * k->la.ld : lo) * (int64_t)k->es;
        gemm1(k->dt, k->la, k->lb, n, k->N, g->K, A, g->B, g->C + lo * k->N * (int64_t)k->es, k->N);
    }
}

/* The products of groups g[0..n). f32 and f64 on the BLAS: with KILN_OPT_POOL_GEMM one
 * job over blocks of rows of every group, so that the threads take an expert of few
 * rows and a large one alike (blocks sized by matmul's rule, from the rows of all the
 * groups together); without it, one BLAS call (threaded by the BLAS) per group. kiln's
 * own GEMMs (bf16; f16 and f32 when switched on) thread themselves: one call per group. A
 * group with nothing to sum over (K = 0: an expert with no rows, in dw) gets zeros. */
static kiln_status grouped_gemm(kiln_dtype dt, mat_layout la, mat_layout lb, int64_t N, const group_gemm *g, int64_t n)
{
    size_t es = kiln_dtype_size(dt);
    int64_t rows = 0, kmax = 0, n_task = 0;
    for (int64_t i = 0; i < n; i++) {
        if (g[i].K == 0 && g[i].M > 0) memset(g[i].C, 0, es * (size_t)(g[i].M * N));
        if (g[i].K > 0) rows += g[i].M;
        if (g[i].K > kmax) kmax = g[i].K;
    }
    if (rows == 0 || N == 0) return KILN_OK;
    bool own = kiln__is_half(dt) || (dt == KILN_DTYPE_F32 && kiln__opt(KILN__OPT_OWN_GEMM));
    if (own || !kiln__opt(KILN__OPT_POOL_GEMM)) {
        kiln_status s = KILN_OK;
        for (int64_t i = 0; i < n && s == KILN_OK; i++) {
            if (g[i].M == 0 || g[i].K == 0) continue;
            if (kiln__is_half(dt)) {
                s = gemm_half(dt, la, lb, g[i].M, N, g[i].K, g[i].A, g[i].B, g[i].C, NULL);
            } else if (!own || !kiln__gemm(g[i].M, N, g[i].K, own_operand(g[i].A, KILN__GEMM_F32, la),
                                           own_operand(g[i].B, KILN__GEMM_F32, lb), (float *)g[i].C, N, false,
                                           KILN__GEMM_F32)) {
                gemm1(dt, la, lb, g[i].M, N, g[i].K, g[i].A, g[i].B, g[i].C, N);
            }
        }
        return s;
    }
    int64_t block = 128;
    if (kiln__opt(KILN__OPT_GEMM_THREAD_BLOCKS) && 128 * N * kmax > ((int64_t)1 << 22)) {
        int64_t nt = kiln_num_threads(), per = (rows + nt - 1) / (nt > 0 ? nt : 1);
        block = (per + 127) / 128 * 128;
        if (block < 128) block = 128;
    }
    for (int64_t i = 0; i < n; i++)
        if (g[i].K > 0) n_task += (g[i].M + block - 1) / block;
    int64_t *task = malloc(sizeof *task * 2 * (size_t)n_task);
    if (!task) return kiln__err(KILN_ERR_OOM, "grouped_matmul: out of memory for %lld blocks", (long long)n_task);
    n_task = 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t lo = 0; g[i].K > 0 && lo < g[i].M; lo += block) {
            task[2 * n_task] = i;
            task[2 * n_task++ + 1] = lo;
        }
    grouped_ctx k = {dt, la, lb, N, block, es, g, task};
    kiln__parallel_for(n_task, 1, grouped_blocks, &k);
    free(task);
    return KILN_OK;
}

/* offsets (E + 1) read into off[] and checked: they rise from 0 or more to at most M. */
static kiln_status read_offsets(const char *op, kiln_tensor_t *t, int64_t M, int64_t *off)
{
    kiln_tensor_t *tmp, *c = cpu_contig(t, &tmp);
    if (!c) return kiln_last_status();
    int64_t n = c->shape[0];
    size_t isz = kiln_dtype_size(c->dtype);
    for (int64_t i = 0; i < n; i++) off[i] = kiln__load_index((const char *)kiln__data(c) + i * (int64_t)isz, c->dtype);
    kiln_tensor_free(tmp);
    return kiln__check_offsets(op, off, n, M);
}

/* Contiguous copies of in[0..n) (tmp[] to free) and the checked offsets in[n] (E + 1
 * values in a new *off); rows rows of x. */
static kiln_status grouped_inputs(const char *op, kiln_tensor_t *const *in, int n, int64_t rows, kiln_tensor_t **c,
                                  kiln_tensor_t **tmp, int64_t **off)
{
    *off = NULL;
    if (!cpu_contig_n(in, n, c, tmp, NULL)) return kiln_last_status();
    int64_t E1 = in[n]->shape[0];
    if (!(*off = malloc(sizeof **off * (size_t)E1)))
        return kiln__err(KILN_ERR_OOM, "%s: out of memory for %lld offsets", op, (long long)E1);
    return read_offsets(op, in[n], rows, *off);
}

/* Zeroes rows [0, off[0]) and [off[E], M) of the (M, cols) matrix o: no expert's. */
static void zero_unrouted(kiln_tensor_t *o, const int64_t *off, int64_t E)
{
    size_t row = kiln_dtype_size(o->dtype) * (size_t)o->shape[1];
    char *p = kiln__data(o);
    memset(p, 0, row * (size_t)off[0]);
    memset(p + row * (size_t)off[E], 0, row * (size_t)(o->shape[0] - off[E]));
}

/* x (M, K), w (E, K, N), offsets (E + 1) -> (M, N): rows off[e] .. off[e+1]-1 of x times
 * w[e]. */
kiln_status kiln__cpu_grouped_matmul(KILN__KERNEL_ARGS)
{
    if (in[0]->dtype == KILN_DTYPE_F16 && !kiln__opt(KILN__OPT_OWN_GEMM_F16))
        return cpu_widened(kiln__cpu_grouped_matmul, be, in, n_in, a, out, n_out);
    kiln_tensor_t *c[2], *tmp[2] = {0}, *o = out[0];
    int64_t *off, M = in[0]->shape[0], K = in[0]->shape[1], E = in[1]->shape[0], N = in[1]->shape[2];
    kiln_status s = grouped_inputs("grouped_matmul", in, 2, M, c, tmp, &off);
    group_gemm *g = s == KILN_OK ? malloc(sizeof *g * (size_t)(E ? E : 1)) : NULL;
    if (s == KILN_OK && !g) s = kiln__err(KILN_ERR_OOM, "grouped_matmul: out of memory for %lld experts", (long long)E);
    if (s == KILN_OK) {
        size_t es = kiln_dtype_size(o->dtype);
        const char *x = kiln__data(c[0]), *w = kiln__data(c[1]);
        char *y = kiln__data(o);
        zero_unrouted(o, off, E);
        for (int64_t e = 0; e < E; e++)
            g[e] = (group_gemm){x + off[e] * K * (int64_t)es, w + e * K * N * (int64_t)es, y + off[e] * N * (int64_t)es,
                                off[e + 1] - off[e], K};
        s = grouped_gemm(o->dtype, (mat_layout){CblasNoTrans, K ? K : 1}, (mat_layout){CblasNoTrans, N ? N : 1}, N,
                         g, E);
    }
    free(g);
    free(off);
    cpu_free_n(tmp, 2);
    return s;
}

/* (g (M, N), x (M, K), w (E, K, N), offsets) -> dx (M, K) = grouped(g, w[e]^T) and
 * dw (E, K, N), dw[e] = x_e^T g_e (zero for an expert without rows). */
kiln_status kiln__cpu_grouped_matmul_backward(KILN__KERNEL_ARGS)
{
    if (in[0]->dtype == KILN_DTYPE_F16 && !kiln__opt(KILN__OPT_OWN_GEMM_F16))
        return cpu_widened(kiln__cpu_grouped_matmul_backward, be, in, n_in, a, out, n_out);
    kiln_tensor_t *c[3], *tmp[3] = {0}, *dx = out[0], *dw = out[1];
    int64_t *off, M = in[1]->shape[0], K = in[1]->shape[1], E = in[2]->shape[0], N = in[2]->shape[2];
    kiln_status s = grouped_inputs("grouped_matmul backward", in, 3, M, c, tmp, &off);
    group_gemm *g = s == KILN_OK ? malloc(sizeof *g * (size_t)(E ? 2 * E : 1)) : NULL;
    if (s == KILN_OK && !g) s = kiln__err(KILN_ERR_OOM, "grouped_matmul backward: out of memory for %lld experts",
                                          (long long)E);
    if (s == KILN_OK) {
        int64_t es = (int64_t)kiln_dtype_size(dx->dtype);
        const char *gy = kiln__data(c[0]), *x = kiln__data(c[1]), *w = kiln__data(c[2]);
        char *gx = kiln__data(dx), *gw = kiln__data(dw);
        zero_unrouted(dx, off, E);
        for (int64_t e = 0; e < E; e++) {
            int64_t rows = off[e + 1] - off[e];
            g[e] = (group_gemm){gy + off[e] * N * es, w + e * K * N * es, gx + off[e] * K * es, rows, N};
            g[E + e] = (group_gemm){x + off[e] * K * es, gy + off[e] * N * es, gw + e * K * N * es, K, rows};
        }
        mat_layout byrow_n = {CblasNoTrans, N ? N : 1}, trans_n = {CblasTrans, N ? N : 1},
                   trans_k = {CblasTrans, K ? K : 1};
        s = grouped_gemm(dx->dtype, byrow_n, trans_n, K, g, E);
        if (s == KILN_OK) s = grouped_gemm(dw->dtype, trans_k, byrow_n, N, g + E, E);
    }
    free(g);
    free(off);
    cpu_free_n(tmp, 3);
    return s;
}
