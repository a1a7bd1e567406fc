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
