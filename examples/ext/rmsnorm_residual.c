/* A fused residual add and RMS norm, as a kiln extension module (docs/ext.md):
 *
 *     h = x + r                        the new residual stream
 *     y = h / sqrt(mean(h^2) + eps) * w   over the last dim
 *
 * one pass over each row instead of two ops and three, with its backward written
 * with kiln ops. Kernels: C on the cpu, OpenCL C (rmsnorm_residual.cl, built by the
 * OpenCL backend when the module is loaded), and CUDA (rmsnorm_residual.cu) where the
 * module was built with it.
 *
 *     kiln ext build rmsnorm_residual.c rmsnorm_residual.cl --out build/ext --name rmsnorm
 *     kiln ext load build/ext/librmsnorm.so
 *
 * Called as kiln_op_run(kiln_op_find("rmsnorm_residual"), (x, r, w), 3, {eps}, 1, out):
 * out[0] = y, out[1] = h; a third output, 1/rms of each row, is kept for the backward. */
#include <math.h>
#include <string.h>
#include "kiln/ext.h"

KILN_EXT_MODULE;

/* The CUDA kernel's launcher, when rmsnorm_residual.cu was built into the module. */
__attribute__((weak)) kiln_status rmsnorm_residual_cuda(const kiln_op_args *a);

static kiln_status shape(const kiln_op_args *a, kiln_op_meta *out)
{
    kiln_tensor_t *x = a->in[0], *r = a->in[1], *w = a->in[2];
    int nd = kiln_tensor_ndim(x);
    const int64_t *xs = kiln_tensor_shape(x);
    for (int i = 0; i < 3; i++)
        if (kiln_tensor_dtype(a->in[i]) != KILN_DTYPE_F32)
            return kiln_error(KILN_ERR_DTYPE, "x, r and w must be f32 (input %d is not)", i);
    if (nd < 1 || kiln_tensor_ndim(r) != nd || memcmp(kiln_tensor_shape(r), xs, sizeof(int64_t) * (size_t)nd))
        return kiln_error(KILN_ERR_SHAPE, "r must have x's shape, and x at least one dim");
    if (kiln_tensor_ndim(w) != 1 || kiln_tensor_shape(w)[0] != xs[nd - 1])
        return kiln_error(KILN_ERR_SHAPE, "w must be one dim of x's last, %lld", (long long)xs[nd - 1]);
    for (int j = 0; j < 3; j++) {
        out[j].dtype = KILN_DTYPE_F32;
        out[j].ndim = nd;
        memcpy(out[j].shape, xs, sizeof(int64_t) * (size_t)nd);
    }
    out[2].shape[nd - 1] = 1; /* 1/rms, one a row */
    return KILN_OK;
}

static kiln_status cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]), *r = kiln_op_data(a->in[1]), *w = kiln_op_data(a->in[2]);
    float *y = kiln_op_data(a->out[0]), *h = kiln_op_data(a->out[1]), *rstd = kiln_op_data(a->out[2]);
    int64_t cols = kiln_tensor_shape(a->in[2])[0], rows = cols ? kiln_tensor_numel(a->in[0]) / cols : 0;
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * cols, *ri = r + i * cols;
        float *hi = h + i * cols, *yi = y + i * cols;
        float ss = 0;
        for (int64_t j = 0; j < cols; j++) {
            hi[j] = xi[j] + ri[j];
            ss += hi[j] * hi[j];
        }
        float inv = 1.0f / sqrtf(ss / (float)cols + (float)a->attr[0].f);
        rstd[i] = inv;
        for (int64_t j = 0; j < cols; j++) yi[j] = hi[j] * inv * w[j];
    }
    return KILN_OK;
}

/* With n = h / rms: dh = (gy w - n mean(gy w n)) / rms (+ gh), dw = the rows' sum of gy n;
 * dx = dr = dh. */
static kiln_status backward(const kiln_op_args *a, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *w = a->in[2], *h = a->out[1], *rstd = a->out[2], *gy = gout[0], *gh = gout[1];
    int nd = kiln_tensor_ndim(h), last = nd - 1, rows[KILN_MAX_DIMS];
    kiln_tensor_t *dh = gh, *dw = NULL;
    if (gy) {
        kiln_tensor_t *n = kiln_mul(h, rstd), *gw = kiln_mul(gy, w);
        kiln_tensor_t *m = kiln_mul_scalar(kiln_sum(kiln_mul(gw, n), &last, 1, true), 1.0 / (double)kiln_tensor_shape(h)[last]);
        kiln_tensor_t *d = kiln_mul(kiln_sub(gw, kiln_mul(n, m)), rstd);
        dh = gh ? kiln_add(d, gh) : d;
        for (int i = 0; i < last; i++) rows[i] = i;
        dw = last ? kiln_sum(kiln_mul(gy, n), rows, last, false) : kiln_mul(gy, n);
    } else {
        dw = kiln_zeros(kiln_tensor_shape(w), 1, KILN_DTYPE_F32);
    }
    gin[0] = dh;
    gin[1] = dh;
    gin[2] = dw;
    return dh && dw ? KILN_OK : kiln_last_status();
}

kiln_status kiln_ext_init(const kiln_ext_module *m)
{
    kiln_op_kernel k[3] = {{.device = "cpu", .fn = cpu}};
    int n = 1;
    const char *cl = m->source(m, "rmsnorm_residual.cl");
    if (cl) k[n++] = (kiln_op_kernel){.device = "opencl", .source = cl, .entry = "rmsnorm_residual",
                                      .grid = KILN_OP_GRID_ROWS};
    else kiln_clear_error(); /* built without it: the cpu's kernel serves OpenCL too, with copies */
    if (rmsnorm_residual_cuda) k[n++] = (kiln_op_kernel){.device = "cuda", .fn = rmsnorm_residual_cuda};
    int id;
    return kiln_op_define(&(kiln_op_decl){.name = "rmsnorm_residual", .n_in = 3, .n_out = 3, .n_visible = 2,
                                          .attrs = "eps:f64", .shape = shape, .kernels = k, .n_kernels = n,
                                          .backward = backward},
                          &id);
}
