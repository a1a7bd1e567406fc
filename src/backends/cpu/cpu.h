/* Shared pieces of the cpu backend: the strided iterator and kernel declarations. */
#ifndef KILN_CPU_H
#define KILN_CPU_H

#include <cblas.h>

#include "core/kmath_c.h"
#include "core/dtype.h"
#include "core/tensor_impl.h"
#include "core/threadpool.h"
#include "core/intercept.h"
#include "backends/cpu/gemm.h"

#define CPU_MAX_OPS 4

/* Walks the elements of an output shape together with up to CPU_MAX_OPS operands
 * (operand 0 is the output), each with its own strides (0 where broadcast). Adjacent
 * dims that are contiguous for every operand are merged first, so the common cases
 * become one long inner row. */
typedef struct {
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    int nops;
    int64_t st[CPU_MAX_OPS][KILN_MAX_DIMS];
    char *base[CPU_MAX_OPS];
    size_t esize[CPU_MAX_OPS];
} cpu_iter;

/* p[k] points at the first element of operand k's row; s[k] is its inner stride in
 * elements; n is the row length. */
typedef void (*cpu_row_fn)(void *ctx, char **p, const int64_t *s, int64_t n);

/* ops[0] gives the iteration shape; the others broadcast to it. */
void cpu_iter_init(cpu_iter *it, int nops, kiln_tensor_t *const *ops);
/* Runs fn over every row, in parallel over rows. */
void cpu_iter_run(const cpu_iter *it, cpu_row_fn fn, void *ctx);
/* dst (any strides) = src broadcast to dst's shape, converting dtypes. */
void cpu_copy(kiln_tensor_t *dst, kiln_tensor_t *src);
/* A contiguous version of t: t itself, or a new copy in *tmp (free it after). */
kiln_tensor_t *cpu_contig(kiln_tensor_t *t, kiln_tensor_t **tmp);
/* Contiguous versions c[i] of n inputs, except those as_is (when given) takes as they
 * are; tmp[] holds the copies, which cpu_free_n frees. False when a copy failed. */
bool cpu_contig_n(kiln_tensor_t *const *in, int n, kiln_tensor_t **c, kiln_tensor_t **tmp,
                  bool (*as_is)(const kiln_tensor_t *));
void cpu_free_n(kiln_tensor_t **tmp, int n);
/* n values between f32 and f16 or bf16 (dt), the 16-bit side at stride s (elements),
 * rounded to nearest even: the copies' and the widened loops' conversions. */
void cpu_widen_row(float *dst, const void *src, int64_t s, int64_t n, kiln_dtype dt);
void cpu_narrow_row(void *dst, int64_t s, const float *src, int64_t n, kiln_dtype dt);
/* Whether a tensor among in and out is f16 or bf16. */
bool cpu_has_half(kiln_tensor_t *const *in, int n_in, kiln_tensor_t *const *out, int n_out);
/* Runs kernel k on f32 copies of the f16 and bf16 tensors among in and out, and rounds
 * those outputs back to their types (to nearest even): how the kernels that compute
 * only in f32 and f64 take the reduced types (the norms, softmaxes, cross-entropy, rope,
 * attention, and f16 matmul). None of them writes its inputs. */
kiln_status cpu_widened(kiln__kernel_fn k, KILN__KERNEL_ARGS);
/* The first statement of such a kernel: the widened run of itself for the reduced types. */
#define CPU_WIDEN(self) \
    if (cpu_has_half(in, n_in, out, n_out)) return cpu_widened(self, be, in, n_in, a, out, n_out)
/* kiln__check_indices on every index of idx (contiguous). */
static inline kiln_status cpu_check_indices(const char *op, const kiln_tensor_t *idx, int64_t limit,
                                            const int64_t *ignore, int64_t *count)
{
    return kiln__check_indices(op, kiln__data(idx), idx->dtype, kiln__numel(idx->ndim, idx->shape), limit, ignore, count);
}
/* dst (D, T) = src (T, D) with row stride ld, in AVX register blocks where the sizes
 * allow: attention's K^T and V^T, and flex attention's (the room above). */
void kiln__cpu_transpose_f32(float *dst, const float *src, int64_t T, int64_t D, int64_t ld);
void kiln__cpu_transpose_f64(double *dst, const double *src, int64_t T, int64_t D, int64_t ld);
/* cblas_sgemm's product, on kiln's own GEMM where KILN_OPT_OWN_GEMM is on (row-major, beta
 * 0 or 1, alpha not 0, and KILN_OPT_POOL_GEMM on), else the BLAS: attention's and flex
 * attention's f32 tiles. kiln's GEMM runs on the calling thread alone, as the BLAS does
 * inside a pool task with POOL_GEMM, so the results do not depend on the thread count. */
void kiln__cpu_sgemm(enum CBLAS_ORDER o, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                     float alpha, const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);
/* Attention's f32 products on kiln's GEMM with B packed once per kv head (gemm.h's
 * kiln__gemm_panels: K^T for the scores, V for P V, V^T for dO V^T, K for dS K), read
 * in place by every tile of query rows (dV += P^T dO and dK += dS^T Q, whose B changes
 * with the query block, stay on kiln__cpu_sgemm). kiln__cpu_att_panels_wanted_f32: whether
 * they are taken: KILN_OPT_ATT_PANELS and KILN_OPT_POOL_GEMM on, kiln's f32 kernel the
 * AVX-512 one (the only one measured against the BLAS here), and the key blocks
 * (kv_block; 0 for whole rows of keys) whole panels. The f64 versions have no panels
 * (false: the caller takes the BLAS). */
typedef struct {
    kiln__gemm_panels kt, v, vt, k;
    char *t; /* a transposed copy's floats, with KILN_OPT_PACK_TRANSPOSED off */
    size_t tcap;
} kiln__cpu_att_panels;
bool kiln__cpu_att_panels_wanted_f32(int64_t kv_block);
static inline bool kiln__cpu_att_panels_wanted_f64(int64_t kv_block)
{
    (void)kv_block;
    return false;
}
void kiln__cpu_att_panels_free(kiln__cpu_att_panels *kp);
/* A kv head's panels from K and V (Tk x D, row strides ldk, ldv): the forward's K^T
 * and V, the backward's K^T, V^T and K (the transposes packed straight from K and V
 * in register blocks with KILN_OPT_PACK_TRANSPOSED, else from transposed copies). false (the panels then not to be
 * used) when out of memory. */
bool kiln__cpu_att_pack_fwd_f32(kiln__cpu_att_panels *kp, const float *K, int64_t ldk, const float *V, int64_t ldv,
                                int64_t Tk, int64_t D);
bool kiln__cpu_att_pack_bwd_f32(kiln__cpu_att_panels *kp, const float *K, int64_t ldk, const float *V, int64_t ldv,
                                int64_t Tk, int64_t D);
static inline bool kiln__cpu_att_pack_fwd_f64(kiln__cpu_att_panels *kp, const double *K, int64_t ldk, const double *V,
                                              int64_t ldv, int64_t Tk, int64_t D)
{
    (void)kp, (void)K, (void)ldk, (void)V, (void)ldv, (void)Tk, (void)D;
    return false;
}
static inline bool kiln__cpu_att_pack_bwd_f64(kiln__cpu_att_panels *kp, const double *K, int64_t ldk, const double *V,
                                              int64_t ldv, int64_t Tk, int64_t D)
{
    (void)kp, (void)K, (void)ldk, (void)V, (void)ldv, (void)Tk, (void)D;
    return false;
}
/* C (M x N) = alpha A B[k0.., c0..] + beta C from the panels B (A row-major, row stride
 * lda); false, nothing done, when B is NULL (or the product cannot take the panels). */
bool kiln__cpu_att_gemm_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                            const kiln__gemm_panels *B, int64_t k0, int64_t c0, float alpha, float beta, float *C,
                            int64_t ldc);
static inline bool kiln__cpu_att_gemm_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t lda,
                                          const kiln__gemm_panels *B, int64_t k0, int64_t c0, double alpha,
                                          double beta, double *C, int64_t ldc)
{
    (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)k0, (void)c0, (void)alpha, (void)beta, (void)C, (void)ldc;
    return false;
}
/* A row of attention's scores to its weights before they are normalized: row[j] =
 * exp(row[j] - m) for j < n, m the row's largest entry (*max; the maximum passes over
 * NaN entries, which come out NaN, and so does the sum); returns the new row's sum, in
 * double. A row with no entry above -inf becomes zeros, with *max -inf and the sum 0,
 * unless it holds a NaN: then the row, *max and the sum are NaN (as a softmax of it is,
 * and flex attention's dense path gives). f32: the fast exp
 * (kiln__fast_expf), with `vec` 16 lanes at a time in AVX-512 registers where the
 * processor has them, else plain loops (test_gemm checks both). */
double kiln__cpu_att_row_exp_f32(float *row, int64_t n, float *max, bool vec);
double kiln__cpu_att_row_exp_f64(double *row, int64_t n, double *max, bool vec); /* vec ignored */
/* A stack header viewing `t` with another shape/stride/offset (no references). */
void cpu_view(kiln_tensor_t *v, const kiln_tensor_t *t, int ndim, const int64_t *shape, const int64_t *stride,
              int64_t offset);

/* Hot loops are compiled three times, for x86-64-v4 (AVX-512 and FMA), x86-64-v3 (AVX2
 * and FMA) and plain x86-64, and the loader picks the clone the processor runs (GCC
 * function multiversioning). Each clone is one item of target_clones: an item
 * "avx2,fma" would be two clones, AVX2 without FMA and FMA without AVX2, which is what
 * kiln ran until 2026-12-06 (docs/perf-log.md). The sanitizer build keeps one version. */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(KILN_NO_CLONES)
#define KILN_SIMD __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KILN_SIMD
#endif

/* The fast-exp switch's exp (src/core/kmath.h, shared with the generated kernels). */
#define kiln__fast_expf km_exp_fast

/* Grain for parallel_for over elements (rows are split to about this many elements). */
#define CPU_GRAIN 16384

#define KILN_OP(ID, name, kind, nin, nout, nvis, writes, grad, save, amp) kiln_status kiln__cpu_##name(KILN__KERNEL_ARGS);
#include "core/ops.def"
#undef KILN_OP

/* matmul_rows_packed on q8_0 weights (cpu_rows_q8.c): a (M,K) f32 and w contiguous, out
 * (M,N) allocated. */
kiln_status kiln__cpu_matmul_rows_q8(kiln_tensor_t *a, kiln_tensor_t *w, kiln_tensor_t *out);

#endif
