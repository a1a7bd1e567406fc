/* Decompositions: composite ops written with primitive ones, for the compiler, which
 * fuses the primitives (src/compile/). Each gives the op's outputs (hidden ones too, with
 * the shapes inference gives them) as new references in out[]. Called in capture mode
 * by kiln_graph_decompose, so the kiln ops below are recorded, not run.
 *
 * Not decomposed, and why: cross_entropy checks that every target is in range, a
 * decision on data that a graph of primitives would drop; attention and the backward
 * ops stay fused kernels of the backend. */
#include "kiln/ops.h"
#include "ops/registry.h"

static kiln_status give(kiln_tensor_t **out, int n, kiln_tensor_t *const *res)
{
    for (int j = 0; j < n; j++)
        if (!res[j]) return kiln_last_status();
    for (int j = 0; j < n; j++) out[j] = kiln_tensor_retain(res[j]);
    return KILN_OK;
}

/* max, x - max and sum(exp(x - max)) along dim, all kept for the two softmaxes. */
static void softmax_parts(kiln_tensor_t *x, int dim, kiln_tensor_t **shifted, kiln_tensor_t **e, kiln_tensor_t **s)
{
    kiln_tensor_t *m = kiln_max(x, &dim, 1, true);
    *shifted = kiln_sub(x, m);
    *e = kiln_exp(*shifted);
    *s = kiln_sum(*e, &dim, 1, true);
}

static kiln_status dec_softmax(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *sh, *e, *s;
    softmax_parts(in[0], kiln__norm_dim((int)a->i[0], in[0]->ndim), &sh, &e, &s);
    kiln_tensor_t *y = kiln_div(e, s);
    return give(out, 1, &y);
}

static kiln_status dec_log_softmax(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *sh, *e, *s;
    softmax_parts(in[0], kiln__norm_dim((int)a->i[0], in[0]->ndim), &sh, &e, &s);
    kiln_tensor_t *y = kiln_sub(sh, kiln_log(s));
    return give(out, 1, &y);
}

/* The statistics of the norms have the input's shape without its last dim. */
static kiln_tensor_t *drop_last(kiln_tensor_t *t)
{
    if (!t) return NULL;
    int nd = kiln_tensor_ndim(t);
    return kiln_view(t, kiln_tensor_shape(t), nd - 1);
}

/* layer_norm(x, w, b) along the last dim: y = (x - mean) * rstd * w + b, with the
 * biased variance; also mean and rstd, which backward reads. */
static kiln_status dec_layer_norm(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *x = in[0];
    int d = kiln_tensor_ndim(x) - 1;
    kiln_dtype dt = kiln_tensor_dtype(x);
    kiln_tensor_t *inv_c = kiln_scalar(1.0 / (double)kiln_tensor_shape(x)[d], dt);
    kiln_tensor_t *mean = kiln_mul(kiln_sum(x, &d, 1, true), inv_c);
    kiln_tensor_t *xc = kiln_sub(x, mean);
    kiln_tensor_t *var = kiln_mul(kiln_sum(kiln_mul(xc, xc), &d, 1, true), inv_c);
    kiln_tensor_t *rstd = kiln_rsqrt(kiln_add(var, kiln_scalar(a->f[0], dt)));
    kiln_tensor_t *res[3] = {kiln_add(kiln_mul(kiln_mul(xc, rstd), in[1]), in[2]), drop_last(mean), drop_last(rstd)};
    return give(out, 3, res);
}

/* rms_norm(x, w): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps). */
static kiln_status dec_rms_norm(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *x = in[0];
    int d = kiln_tensor_ndim(x) - 1;
    kiln_dtype dt = kiln_tensor_dtype(x);
    kiln_tensor_t *ms = kiln_mul(kiln_sum(kiln_mul(x, x), &d, 1, true), kiln_scalar(1.0 / (double)kiln_tensor_shape(x)[d], dt));
    kiln_tensor_t *rstd = kiln_rsqrt(kiln_add(ms, kiln_scalar(a->f[0], dt)));
    kiln_tensor_t *res[2] = {kiln_mul(kiln_mul(x, rstd), in[1]), drop_last(rstd)};
    return give(out, 2, res);
}

kiln__decompose_fn kiln__decomposition(kiln__op_id op)
{
    switch (op) {
    case KILN_OP_SOFTMAX: return dec_softmax;
    case KILN_OP_LOG_SOFTMAX: return dec_log_softmax;
    case KILN_OP_LAYER_NORM: return dec_layer_norm;
    case KILN_OP_RMS_NORM: return dec_rms_norm;
    default: return NULL;
    }
}
