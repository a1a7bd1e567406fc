/* Backward formulas, one per differentiable op in ops.def, written with kiln ops.
 * They run with grad mode off inside a scope that the engine closes; results are
 * returned in gin[i] for the inputs with needs_grad[i]. Shapes follow the node's
 * recorded input metadata. */
#include <math.h>
#include <string.h>
#include "core/opts.h"
#include "kiln/ops.h"
#include "ops/registry.h"

#define G (gout[0])
#define X(i) (n->saved_in[i])
#define Y(j) (n->saved_out[j])
#define NEED(i) (n->needs_grad[i])
#define META(i) (&n->in_meta[i])


/* Sums g down to shape, undoing broadcasting. */
kiln_tensor_t *kiln__sum_to(kiln_tensor_t *g, const int64_t *shape, int ndim)
{
    if (!g) return NULL;
    int dims[KILN_MAX_DIMS], nd = 0;
    int lead = g->ndim - ndim;
    for (int d = 0; d < g->ndim; d++) {
        int k = d - lead;
        if (k < 0 || (shape[k] == 1 && g->shape[d] != 1)) dims[nd++] = d;
    }
    kiln_tensor_t *r = nd ? kiln_sum(g, dims, nd, true) : g;
    if (r && (r->ndim != ndim || memcmp(r->shape, shape, sizeof(int64_t) * (size_t)ndim))) r = kiln_reshape(r, shape, ndim);
    return r;
}

/* The gradient for input i: summed to its shape and cast to its dtype. */
static kiln_tensor_t *to_input(kiln__node *n, int i, kiln_tensor_t *g)
{
    g = kiln__sum_to(g, META(i)->shape, META(i)->ndim);
    return g ? kiln_cast(g, META(i)->dtype) : NULL;
}

static kiln_status done(kiln_tensor_t **gin, int nin, kiln__node *n)
{
    for (int i = 0; i < nin; i++)
        if (n->needs_grad[i] && !gin[i]) return kiln_last_status() ? kiln_last_status() : KILN_ERR_INTERNAL;
    return KILN_OK;
}

static kiln_tensor_t *as(kiln_tensor_t *mask, kiln_tensor_t *like) { return kiln_cast(mask, like->dtype); }

kiln_status kiln__bw_add(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = to_input(n, 0, G);
    if (NEED(1)) gin[1] = to_input(n, 1, G);
    return done(gin, 2, n);
}

kiln_status kiln__bw_sub(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = to_input(n, 0, G);
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_neg(G));
    return done(gin, 2, n);
}

kiln_status kiln__bw_mul(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = to_input(n, 0, kiln_mul(G, X(1)));
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_mul(G, X(0)));
    return done(gin, 2, n);
}

kiln_status kiln__bw_div(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = to_input(n, 0, kiln_div(G, X(1)));
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_neg(kiln_div(kiln_mul(G, X(0)), kiln_mul(X(1), X(1)))));
    return done(gin, 2, n);
}

kiln_status kiln__bw_pow(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = to_input(n, 0, kiln_mul(kiln_mul(G, X(1)), kiln_pow(X(0), kiln_add_scalar(X(1), -1.0))));
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_mul(kiln_mul(G, Y(0)), kiln_log(X(0))));
    return done(gin, 2, n);
}

/* Ties split the gradient evenly, as PyTorch does. */
static kiln_status minmax(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin, bool is_max)
{
    kiln_tensor_t *win = is_max ? kiln_gt(X(0), X(1)) : kiln_lt(X(0), X(1));
    kiln_tensor_t *wa = kiln_add(as(win, G), kiln_mul_scalar(as(kiln_eq(X(0), X(1)), G), 0.5));
    if (NEED(0)) gin[0] = to_input(n, 0, kiln_mul(G, wa));
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_mul(G, kiln_add_scalar(kiln_neg(wa), 1.0)));
    return done(gin, 2, n);
}

kiln_status kiln__bw_maximum(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin) { return minmax(n, gout, gin, true); }
kiln_status kiln__bw_minimum(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin) { return minmax(n, gout, gin, false); }

/* The rows of include/kiln/pointwise.def whose grad column is X, Y or NONE: g * dy/dx
 * from the saved input x, the saved output y, or from g alone. */
#define UNARY_BW(name, dx)                                                                    \
    kiln_status kiln__bw_##name(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin) \
    {                                                                                         \
        gin[0] = (dx);                                                                        \
        return done(gin, 1, n);                                                               \
    }

/* sign(x) (0 at 0) in like's dtype. */
static kiln_tensor_t *sign(kiln_tensor_t *x, kiln_tensor_t *like)
{
    kiln_tensor_t *zero = kiln_scalar(0, x->dtype);
    return kiln_sub(as(kiln_gt(x, zero), like), as(kiln_lt(x, zero), like));
}

UNARY_BW(neg, kiln_neg(G))
UNARY_BW(abs, kiln_mul(G, sign(X(0), G)))
UNARY_BW(exp, kiln_mul(G, Y(0)))
UNARY_BW(log, kiln_div(G, X(0)))
UNARY_BW(sqrt, kiln_div(kiln_mul_scalar(G, 0.5), Y(0)))
UNARY_BW(rsqrt, kiln_mul(kiln_mul_scalar(G, -0.5), kiln_mul(Y(0), kiln_mul(Y(0), Y(0)))))
UNARY_BW(tanh, kiln_mul(G, kiln_add_scalar(kiln_neg(kiln_mul(Y(0), Y(0))), 1.0)))
UNARY_BW(sigmoid, kiln_mul(G, kiln_mul(Y(0), kiln_add_scalar(kiln_neg(Y(0)), 1.0))))
UNARY_BW(relu, kiln_mul(G, as(kiln_gt(Y(0), kiln_scalar(0, Y(0)->dtype)), G)))

kiln_status kiln__bw_gelu(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *in[2] = {X(0), G};
    gin[0] = kiln__call(KILN_OP_GELU_BACKWARD, in, 2, &n->attrs);
    return done(gin, 1, n);
}

kiln_status kiln__bw_where(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *zero = kiln_scalar(0, G->dtype);
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_where(X(0), G, zero));
    if (NEED(2)) gin[2] = to_input(n, 2, kiln_where(X(0), zero, G));
    n->needs_grad[0] = false; /* the condition has no gradient */
    return done(gin, 3, n);
}

kiln_status kiln__bw_cast(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln_cast(G, META(0)->dtype);
    return done(gin, 1, n);
}

/* G reshaped so that the reduced dims are back (size 1), ready to broadcast. */
static kiln_tensor_t *unreduce(kiln__node *n, kiln_tensor_t *g)
{
    const kiln__meta *m = META(0);
    int64_t shape[KILN_MAX_DIMS];
    for (int d = 0; d < m->ndim; d++) {
        bool red = n->attrs.ndim == 0;
        for (int k = 0; k < n->attrs.ndim; k++) red |= n->attrs.shape[k] == d;
        shape[d] = red ? 1 : m->shape[d];
    }
    return kiln_reshape(g, shape, m->ndim);
}

kiln_status kiln__bw_sum(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln_expand(unreduce(n, G), META(0)->shape, META(0)->ndim);
    return done(gin, 1, n);
}

kiln_status kiln__bw_max(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *mask = as(kiln_eq(X(0), unreduce(n, Y(0))), G);
    int dims[KILN_MAX_DIMS];
    for (int k = 0; k < n->attrs.ndim; k++) dims[k] = (int)n->attrs.shape[k];
    kiln_tensor_t *count = kiln_sum(mask, dims, n->attrs.ndim, true);
    gin[0] = kiln_mul(kiln_div(mask, count), unreduce(n, G));
    return done(gin, 1, n);
}

kiln_status kiln__bw_softmax(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    int dim = (int)n->attrs.op.dim.dim;
    kiln_tensor_t *dot = kiln_sum(kiln_mul(G, Y(0)), &dim, 1, true);
    gin[0] = kiln_mul(Y(0), kiln_sub(G, dot));
    return done(gin, 1, n);
}

kiln_status kiln__bw_log_softmax(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    int dim = (int)n->attrs.op.dim.dim;
    gin[0] = kiln_sub(G, kiln_mul(kiln_exp(Y(0)), kiln_sum(G, &dim, 1, true)));
    return done(gin, 1, n);
}

/* Is t a 2-D matrix laid out by columns (a transposed view of a contiguous one, as
 * kiln_linear's weight is)? */
static bool by_columns(const kiln_tensor_t *t)
{
    return t->ndim == 2 && t->shape[0] > 1 && t->shape[1] > 1 && t->stride[0] == 1 && t->stride[1] == t->shape[0];
}

kiln_status kiln__bw_matmul(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = to_input(n, 0, kiln_matmul(G, kiln_transpose(X(1), -1, -2)));
    /* dB = A^T G; for a B laid out by columns, computed as (G^T A)^T, so that dB has B's
     * layout and the gradient of the matrix B views (a linear layer's weight) comes out
     * contiguous, not transposed: the norm and the optimizer then read it in order. */
    if (NEED(1) && by_columns(X(1)) && X(0)->ndim == 2 && G->ndim == 2 && kiln__opt(KILN__OPT_GRAD_LAYOUT))
        gin[1] = to_input(n, 1, kiln_transpose(kiln_matmul(kiln_transpose(G, 0, 1), X(0)), 0, 1));
    else if (NEED(1))
        gin[1] = to_input(n, 1, kiln_matmul(kiln_transpose(X(0), -1, -2), G));
    return done(gin, 2, n);
}

kiln_status kiln__bw_embedding(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln__attrs a = {0};
    a.op.embedding_backward.vocab = META(0)->shape[0];
    kiln_tensor_t *in[2] = {G, X(1)};
    gin[0] = kiln__call(KILN_OP_EMBEDDING_BACKWARD, in, 2, &a);
    n->needs_grad[1] = false;
    return done(gin, 2, n);
}

/* idx expanded along the other dims so that scatter_add can place whole slices. */
static kiln_tensor_t *slice_index(kiln_tensor_t *idx, const kiln_tensor_t *g, int dim)
{
    int64_t shape[KILN_MAX_DIMS];
    for (int d = 0; d < g->ndim; d++) shape[d] = d == dim ? idx->shape[0] : 1;
    kiln_tensor_t *r = kiln_reshape(idx, shape, g->ndim);
    return kiln_expand(r, g->shape, g->ndim);
}

kiln_status kiln__bw_index_select(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    int dim = (int)n->attrs.op.dim.dim;
    kiln_tensor_t *z = kiln_zeros(META(0)->shape, META(0)->ndim, G->dtype);
    gin[0] = kiln_scatter_add(z, dim, slice_index(X(1), G, dim), G);
    n->needs_grad[1] = false;
    return done(gin, 2, n);
}

kiln_status kiln__bw_gather(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *z = kiln_zeros(META(0)->shape, META(0)->ndim, G->dtype);
    gin[0] = kiln_scatter_add(z, (int)n->attrs.op.dim.dim, X(1), G);
    n->needs_grad[1] = false;
    return done(gin, 2, n);
}

kiln_status kiln__bw_scatter_add(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    if (NEED(0)) gin[0] = G;
    if (NEED(2)) gin[2] = kiln_gather(G, (int)n->attrs.op.dim.dim, X(1));
    n->needs_grad[1] = false;
    return done(gin, 3, n);
}

static kiln_status set_outputs(kiln__node *n, kiln_tensor_t **out, int k, kiln_tensor_t **gin, const int *map)
{
    for (int j = 0; j < k; j++) {
        int i = map[j];
        if (i >= 0 && NEED(i)) gin[i] = kiln__scoped(out[j]);
        else kiln_tensor_free(out[j]);
    }
    return KILN_OK;
}

kiln_status kiln__bw_layer_norm(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *in[5] = {G, X(0), X(1), Y(1), Y(2)}, *out[3] = {0};
    kiln_status s = kiln__dispatch(KILN_OP_LAYER_NORM_BACKWARD, in, 5, &n->attrs, out);
    if (s != KILN_OK) return s;
    static const int map[3] = {0, 1, 2};
    return set_outputs(n, out, 3, gin, map);
}

kiln_status kiln__bw_rms_norm(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *in[4] = {G, X(0), X(1), Y(1)}, *out[2] = {0};
    kiln_status s = kiln__dispatch(KILN_OP_RMS_NORM_BACKWARD, in, 4, &n->attrs, out);
    if (s != KILN_OK) return s;
    static const int map[2] = {0, 1};
    return set_outputs(n, out, 2, gin, map);
}

kiln_status kiln__bw_cross_entropy(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *in[4] = {G, X(0), X(1), Y(1)};
    gin[0] = kiln__call(KILN_OP_CROSS_ENTROPY_BACKWARD, in, 4, &n->attrs);
    n->needs_grad[1] = false;
    return done(gin, 2, n);
}

kiln_status kiln__bw_attention(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *in[6] = {kiln_contiguous(G), X(0), X(1), X(2), Y(0), Y(1)}, *out[3] = {0};
    kiln_status s = kiln__dispatch(KILN_OP_ATTENTION_BACKWARD, in, 6, &n->attrs, out);
    if (s != KILN_OK) return s;
    static const int map[3] = {0, 1, 2};
    return set_outputs(n, out, 3, gin, map);
}

kiln_status kiln__bw_dropout(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln_mul_scalar(kiln_mul(G, kiln_cast(Y(1), G->dtype)), 1.0 / (1.0 - n->attrs.op.dropout.p));
    return done(gin, 1, n);
}

kiln_status kiln__bw_cat(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    int dim = (int)n->attrs.op.dim.dim;
    int64_t at = 0;
    for (int i = 0; i < n->n_in; i++) {
        int64_t len = META(i)->shape[dim];
        if (NEED(i)) gin[i] = kiln_narrow(G, dim, at, len);
        at += len;
    }
    return done(gin, n->n_in, n);
}

kiln_status kiln__bw_tri(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = n->attrs.op.tri.upper ? kiln_triu(G, n->attrs.op.tri.k) : kiln_tril(G, n->attrs.op.tri.k);
    return done(gin, 1, n);
}

kiln_status kiln__bw_rope(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln__attrs a = n->attrs;
    a.op.rope.inverse = !a.op.rope.inverse; /* the inverse rotation */
    kiln_tensor_t *g = G;
    gin[0] = kiln__call(KILN_OP_ROPE, &g, 1, &a);
    return done(gin, 1, n);
}

kiln_status kiln__bw_view(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln_reshape(G, META(0)->shape, META(0)->ndim);
    return done(gin, 1, n);
}

kiln_status kiln__bw_permute(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    int inv[KILN_MAX_DIMS];
    for (int d = 0; d < n->attrs.ndim; d++) inv[n->attrs.shape[d]] = d;
    gin[0] = kiln_permute(G, inv, n->attrs.ndim);
    return done(gin, 1, n);
}

kiln_status kiln__bw_slice(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *z = kiln_zeros(META(0)->shape, META(0)->ndim, G->dtype);
    if (!z) return kiln_last_status();
    kiln_tensor_t *in = z;
    kiln_tensor_t *view = kiln__call(KILN_OP_SLICE, &in, 1, &n->attrs);
    kiln_status s = view ? kiln_tensor_copy_(view, G) : kiln_last_status();
    if (s != KILN_OK) return s;
    gin[0] = z;
    return KILN_OK;
}

kiln_status kiln__bw_expand(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln__sum_to(G, META(0)->shape, META(0)->ndim);
    return done(gin, 1, n);
}

kiln_status kiln__bw_contiguous(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = G;
    return done(gin, 1, n);
}

/* The rows of include/kiln/pointwise.def with a backward op: g * dy/dx, by it. */
#define KILN_PW(ID, name, dtypes, grad, fast)                                                          \
    KILN__PW_IF_OP(grad, kiln_status kiln__bw_##name(kiln__node *n, kiln_tensor_t *const *gout,      \
                                                     kiln_tensor_t **gin) {                         \
        kiln_tensor_t *in[2] = {X(0), G};                                                           \
        gin[0] = kiln__call(KILN_OP_##ID##_BACKWARD, in, 2, &n->attrs);                             \
        return done(gin, 1, n);                                                                     \
    })
#include "kiln/pointwise.def"
#undef KILN_PW
