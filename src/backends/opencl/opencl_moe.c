/* The mixture-of-experts routing ops on an OpenCL device, host side (their kernels are
 * kernels.cl's kiln_topk, kiln_moe_sort, kiln_grouped and kiln_grouped_dw): topk and
 * moe_sort a work-item per row or expert, the grouped matmul one launch for every
 * expert, its row tiles found from the offsets on the device, so that the counts stay
 * data (a recorded step replays with other counts).
 *
 * Bad expert indices and offsets are errors with the cpu's messages: checked on the
 * host before an eager launch (the values are read back), and while a capture is
 * recorded checked by the kernels into the device's error word, which a replay reads
 * (opencl_capture.c). Kernels never read outside their buffers, whatever the values. */
#ifdef KILN_HAVE_OPENCL
#include <stdlib.h>
#include "backends/opencl/opencl_impl.h"
#include "core/dtype.h"
#include "core/opts.h"
#include "core/tensor_impl.h"

static kiln__karg buf_arg(const kiln_tensor_t *t) { return kiln__opencl_ptr_arg(kiln__data(t)); }
static kiln__karg i64_arg(int64_t v) { return kiln__opencl_i64_arg(v); }

/* The kernels' number for a float dtype (their moe_load, and the kernel of that type
 * in the tables below), or -1. */
static int float_code(kiln_dtype dt)
{
    switch (dt) {
    case KILN_DTYPE_F32: return 0;
    case KILN_DTYPE_F64: return 1;
    case KILN_DTYPE_BF16: return 2;
    case KILN_DTYPE_F16: return 3;
    default: return -1;
    }
}
static const int grouped_k[4] = {BK_grouped, BK_grouped_f64, BK_grouped_bf16, BK_grouped_f16};
static const int grouped_dw_k[4] = {BK_grouped_dw, BK_grouped_dw_f64, BK_grouped_dw_bf16, BK_grouped_dw_f16};

/* x (..., E) -> values, indices (..., k): a work-item per row of x (made dense). */
kiln_status kiln__opencl_topk(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *x = in[0];
    int dt = float_code(x->dtype);
    cl_kernel k = dt >= 0 && kiln__opt(KILN__OPT_CL_MOE) ? kiln__opencl_builtin(be, BK_topk) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_TOPK, in, n_in, a, out, n_out);
    int64_t E = x->shape[x->ndim - 1], rows = E ? kiln_tensor_numel(x) / E : 0;
    if (!rows) return KILN_OK;
    kiln_tensor_t *c = kiln__dense(x);
    if (!c) return kiln_last_status();
    kiln__karg args[] = {buf_arg(c), buf_arg(out[0]), buf_arg(out[1]), i64_arg(rows), i64_arg(E),
                         i64_arg(a->op.topk.k), i64_arg(dt), i64_arg((int64_t)kiln_dtype_size(x->dtype))};
    size_t grid = (size_t)rows;
    kiln_status s = kiln__opencl_launch(be, k, args, 8, &grid, NULL, 1);
    kiln_tensor_free(c); /* in-order queue: freed after the kernel that reads it */
    return s;
}

/* indices (any shape, row-major; i32 or i64) -> order (n), offsets (E + 1): a
 * work-item per expert and one for the offsets' last, on the indices made dense. */
kiln_status kiln__opencl_moe_sort(KILN__KERNEL_ARGS)
{
    cl_kernel k = kiln__opt(KILN__OPT_CL_MOE) ? kiln__opencl_builtin(be, BK_moe_sort) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_MOE_SORT, in, n_in, a, out, n_out);
    int64_t E = a->op.moe_sort.n_experts;
    kiln_tensor_t *c = kiln__dense(in[0]);
    if (!c) return kiln_last_status();
    kiln_status s = kiln__opencl_check_indices(be, "moe_sort", c, E, NULL);
    void *err = s == KILN_OK ? kiln__opencl_err_word(be) : NULL;
    if (s == KILN_OK && !err) s = kiln_last_status();
    if (s == KILN_OK) {
        kiln__karg args[] = {buf_arg(c), buf_arg(out[0]), buf_arg(out[1]), i64_arg(kiln_tensor_numel(c)), i64_arg(E),
                             i64_arg(c->dtype == KILN_DTYPE_I64), kiln__opencl_ptr_arg(err)};
        size_t grid = (size_t)(E + 1);
        s = kiln__opencl_launch(be, k, args, 7, &grid, NULL, 1);
    }
    kiln_tensor_free(c);
    return s;
}

/* The offsets (E + 1, any stride) read back and checked as the cpu checks them, before
 * an eager launch; while a capture is recorded the kernel checks them instead. */
static kiln_status check_offsets(kiln__backend *be, const char *op, kiln_tensor_t *off, int64_t M)
{
    if (((cl_dev *)be->ctx)->cap) return KILN_OK;
    int64_t n = off->shape[0];
    size_t isz = kiln_dtype_size(off->dtype);
    char *raw = malloc(isz * (size_t)n);
    int64_t *v = malloc(sizeof *v * (size_t)n);
    kiln_tensor_t *c = raw && v ? kiln__dense(off) : NULL;
    kiln_status s = !raw || !v ? kiln__err(KILN_ERR_OOM, "%s: out of memory for %lld offsets", op, (long long)n)
                  : !c        ? kiln_last_status()
                              : kiln__be_copy_d2h(be, raw, kiln__data(c), isz * (size_t)n);
    for (int64_t i = 0; s == KILN_OK && i < n; i++) v[i] = kiln__load_index(raw + i * (int64_t)isz, off->dtype);
    if (s == KILN_OK) s = kiln__check_offsets(op, v, n, M);
    kiln_tensor_free(c);
    free(raw);
    free(v);
    return s;
}

/* out (M, cols) = A (M, depth) times expert x's B (depth, cols) for its rows, zero for
 * the rows of none: one launch of kiln_grouped, a 16x16 work-group per 64x64 tile of
 * the output, with as many row tiles as M's and one more per expert and per unrouted
 * segment (moe_tile in kernels.cl places them; the spare ones return). A's strides
 * (sam, sak), B's (sbe, sbk, sbn) by expert, depth and column. */
static kiln_status grouped_rows(kiln__backend *be, cl_kernel k, const kiln_tensor_t *A, const kiln_tensor_t *B,
                                const kiln_tensor_t *off, kiln_tensor_t *out, int64_t depth, int64_t E, int64_t sam,
                                int64_t sak, int64_t sbe, int64_t sbk, int64_t sbn, void *err)
{
    int64_t M = out->shape[0], cols = out->shape[1];
    kiln__karg args[] = {buf_arg(A), buf_arg(B), buf_arg(out), buf_arg(off), i64_arg(M), i64_arg(cols),
                         i64_arg(depth), i64_arg(E), i64_arg(sam), i64_arg(sak), i64_arg(sbe), i64_arg(sbk),
                         i64_arg(sbn), i64_arg(off->stride[0]), i64_arg(off->dtype == KILN_DTYPE_I64),
                         kiln__opencl_ptr_arg(err)};
    size_t grid[2] = {(size_t)((cols + 63) / 64 * 16), (size_t)(((M + 63) / 64 + E + 2) * 16)}, block[2] = {16, 16};
    return kiln__opencl_launch(be, k, args, (int)(sizeof args / sizeof args[0]), grid, block, 2);
}

/* x (M, K), w (E, K, N), offsets (E + 1) -> (M, N), at any strides. */
kiln_status kiln__opencl_grouped_matmul(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *x = in[0], *w = in[1], *off = in[2], *o = out[0];
    int dt = float_code(x->dtype);
    cl_kernel k = dt >= 0 && kiln__opt(KILN__OPT_CL_MOE) ? kiln__opencl_builtin(be, grouped_k[dt]) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_GROUPED_MATMUL, in, n_in, a, out, n_out);
    int64_t M = x->shape[0], K = x->shape[1], E = w->shape[0];
    kiln_status s = check_offsets(be, "grouped_matmul", off, M);
    void *err = s == KILN_OK ? kiln__opencl_err_word(be) : NULL;
    if (s != KILN_OK || !err) return s != KILN_OK ? s : kiln_last_status();
    return grouped_rows(be, k, x, w, off, o, K, E, x->stride[0], x->stride[1], w->stride[0], w->stride[1],
                        w->stride[2], err);
}

/* (g (M, N), x (M, K), w (E, K, N), offsets) -> dx (M, K) = g_e w[e]^T (kiln_grouped on w
 * read transposed), dw (E, K, N), dw[e] = x_e^T g_e (kiln_grouped_dw, a work-group per
 * expert and 64x64 tile; zero for an expert without rows). */
kiln_status kiln__opencl_grouped_matmul_backward(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *g = in[0], *x = in[1], *w = in[2], *off = in[3];
    int dt = float_code(x->dtype);
    cl_kernel kx = dt >= 0 && kiln__opt(KILN__OPT_CL_MOE) ? kiln__opencl_builtin(be, grouped_k[dt]) : NULL;
    cl_kernel kw = kx ? kiln__opencl_builtin(be, grouped_dw_k[dt]) : NULL;
    if (!kw) return kiln__cpu_fallback(be, KILN_OP_GROUPED_MATMUL_BACKWARD, in, n_in, a, out, n_out);
    int64_t M = x->shape[0], K = x->shape[1], E = w->shape[0], N = w->shape[2];
    kiln_status s = check_offsets(be, "grouped_matmul backward", off, M);
    void *err = s == KILN_OK ? kiln__opencl_err_word(be) : NULL;
    if (s != KILN_OK || !err) return s != KILN_OK ? s : kiln_last_status();
    if (M && K)
        s = grouped_rows(be, kx, g, w, off, out[0], N, E, g->stride[0], g->stride[1], w->stride[0], w->stride[2],
                         w->stride[1], err);
    if (s != KILN_OK || !E || !K || !N) return s;
    kiln__karg args[] = {buf_arg(x), buf_arg(g), buf_arg(out[1]), buf_arg(off), i64_arg(M), i64_arg(N), i64_arg(K),
                         i64_arg(E), i64_arg(x->stride[0]), i64_arg(x->stride[1]), i64_arg(g->stride[0]),
                         i64_arg(g->stride[1]), i64_arg(off->stride[0]), i64_arg(off->dtype == KILN_DTYPE_I64)};
    /* work-group (expert + E column tile, row tile) */
    size_t grid[2] = {(size_t)((N + 63) / 64 * 16 * E), (size_t)((K + 63) / 64 * 16)}, block[2] = {16, 16};
    return kiln__opencl_launch(be, kw, args, (int)(sizeof args / sizeof args[0]), grid, block, 2);
}
#endif
