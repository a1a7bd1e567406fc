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
#define DIM ((int)n->attrs.op.dim.dim)
#define ZEROS kiln_zeros(META(0)->shape, META(0)->ndim, G->dtype) /* shaped like input 0 */
#define BW(name) kiln_status kiln__bw_##name(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)

/* Sums g down to shape, undoing broadcasting. */
static kiln_tensor_t *sum_to(kiln_tensor_t *g, const int64_t *shape, int ndim)
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
    g = sum_to(g, META(i)->shape, META(i)->ndim);
    return g ? kiln_cast(g, META(i)->dtype) : NULL;
}

static kiln_status done(kiln_tensor_t **gin, int nin, kiln__node *n)
{
    for (int i = 0; i < nin; i++)
        if (n->needs_grad[i] && !gin[i])
            return kiln_last_status() ? kiln_last_status()
                                      : kiln_error(KILN_ERR_INTERNAL, "backward of %s: input %d's gradient was not made",
                                                   kiln__ops[n->op].name, i);
    return KILN_OK;
}

static kiln_tensor_t *as(kiln_tensor_t *mask, kiln_tensor_t *like) { return kiln_cast(mask, like->dtype); }

/* A binary op's formula: each input's gradient, where it needs one, summed to its shape. */
#define BINARY_BW(name, d0, d1)                              \
    BW(name)                                                 \
    {                                                        \
        if (NEED(0)) gin[0] = to_input(n, 0, (d0));          \
        if (NEED(1)) gin[1] = to_input(n, 1, (d1));          \
        return done(gin, 2, n);                              \
    }
BINARY_BW(add, G, G)
BINARY_BW(sub, G, kiln_neg(G))
BINARY_BW(mul, kiln_mul(G, X(1)), kiln_mul(G, X(0)))
BINARY_BW(div, kiln_div(G, X(1)), kiln_neg(kiln_div(kiln_mul(G, X(0)), kiln_mul(X(1), X(1)))))
BINARY_BW(pow, kiln_mul(kiln_mul(G, X(1)), kiln_pow(X(0), kiln_add_scalar(X(1), -1.0))),
          kiln_mul(kiln_mul(G, Y(0)), kiln_log(X(0))))

/* Ties split the gradient evenly, as PyTorch does. */
static kiln_status minmax(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin, bool is_max)
{
    kiln_tensor_t *win = is_max ? kiln_gt(X(0), X(1)) : kiln_lt(X(0), X(1));
    kiln_tensor_t *wa = kiln_add(as(win, G), kiln_mul_scalar(as(kiln_eq(X(0), X(1)), G), 0.5));
    if (NEED(0)) gin[0] = to_input(n, 0, kiln_mul(G, wa));
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_mul(G, kiln_add_scalar(kiln_neg(wa), 1.0)));
    return done(gin, 2, n);
}

BW(maximum) { return minmax(n, gout, gin, true); }
BW(minimum) { return minmax(n, gout, gin, false); }

/* A one-input op's formula: its gradient, from g and what the node saved. */
#define UNARY_BW(name, dx)          \
    BW(name)                        \
    {                               \
        gin[0] = (dx);              \
        return done(gin, 1, n);     \
    }

/* sign(x) (0 at 0) in like's dtype. */
static kiln_tensor_t *sign(kiln_tensor_t *x, kiln_tensor_t *like)
{
    kiln_tensor_t *zero = kiln_scalar(0, x->dtype);
    return kiln_sub(as(kiln_gt(x, zero), like), as(kiln_lt(x, zero), like));
}

/* The rows of include/kiln/pointwise.def whose grad column is X, Y or NONE: g * dy/dx
 * from the saved input x, the saved output y, or from g alone. */
UNARY_BW(neg, kiln_neg(G))
UNARY_BW(abs, kiln_mul(G, sign(X(0), G)))
UNARY_BW(exp, kiln_mul(G, Y(0)))
UNARY_BW(log, kiln_div(G, X(0)))
UNARY_BW(sqrt, kiln_div(kiln_mul_scalar(G, 0.5), Y(0)))
UNARY_BW(rsqrt, kiln_mul(kiln_mul_scalar(G, -0.5), kiln_mul(Y(0), kiln_mul(Y(0), Y(0)))))
UNARY_BW(tanh, kiln_mul(G, kiln_add_scalar(kiln_neg(kiln_mul(Y(0), Y(0))), 1.0)))
UNARY_BW(sigmoid, kiln_mul(G, kiln_mul(Y(0), kiln_add_scalar(kiln_neg(Y(0)), 1.0))))
UNARY_BW(relu, kiln_mul(G, as(kiln_gt(Y(0), kiln_scalar(0, Y(0)->dtype)), G)))

/* g * dy/dx by the op's backward op (x, g). */
static kiln_tensor_t *by_op(kiln__node *n, kiln__op_id op, kiln_tensor_t *g)
{
    kiln_tensor_t *in[2] = {X(0), g};
    return kiln__call(op, in, 2, &n->attrs);
}

UNARY_BW(gelu, by_op(n, KILN_OP_GELU_BACKWARD, G))

BW(where)
{
    kiln_tensor_t *zero = kiln_scalar(0, G->dtype);
    if (NEED(1)) gin[1] = to_input(n, 1, kiln_where(X(0), G, zero));
    if (NEED(2)) gin[2] = to_input(n, 2, kiln_where(X(0), zero, G));
    n->needs_grad[0] = false; /* the condition has no gradient */
    return done(gin, 3, n);
}

UNARY_BW(cast, kiln_cast(G, META(0)->dtype))

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

UNARY_BW(sum, kiln_expand(unreduce(n, G), META(0)->shape, META(0)->ndim))

BW(max)
{
    kiln_tensor_t *mask = as(kiln_eq(X(0), unreduce(n, Y(0))), G);
    int dims[KILN_MAX_DIMS];
    for (int k = 0; k < n->attrs.ndim; k++) dims[k] = (int)n->attrs.shape[k];
    kiln_tensor_t *count = kiln_sum(mask, dims, n->attrs.ndim, true);
    gin[0] = kiln_mul(kiln_div(mask, count), unreduce(n, G));
    return done(gin, 1, n);
}

/* t summed along the softmaxes' dim, kept. */
static kiln_tensor_t *sum_dim(kiln_tensor_t *t, int dim) { return kiln_sum(t, &dim, 1, true); }

UNARY_BW(softmax, kiln_mul(Y(0), kiln_sub(G, sum_dim(kiln_mul(G, Y(0)), DIM))))
UNARY_BW(log_softmax, kiln_sub(G, kiln_mul(kiln_exp(Y(0)), sum_dim(G, DIM))))

/* Is t a 2-D matrix laid out by columns (a transposed view of a contiguous one, as
 * kiln_linear's weight is)? */
static bool by_columns(const kiln_tensor_t *t)
{
    return t->ndim == 2 && t->shape[0] > 1 && t->shape[1] > 1 && t->stride[0] == 1 && t->stride[1] == t->shape[0];
}

BW(matmul)
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

/* An op whose input 1 is an index, which has no gradient: input 0's. */
#define INDEXED_BW(name, dx)             \
    BW(name)                             \
    {                                    \
        gin[0] = (dx);                   \
        n->needs_grad[1] = false;        \
        return done(gin, 2, n);          \
    }

/* idx expanded along the other dims so that scatter_add can place whole slices. */
static kiln_tensor_t *slice_index(kiln_tensor_t *idx, const kiln_tensor_t *g, int dim)
{
    int64_t shape[KILN_MAX_DIMS];
    for (int d = 0; d < g->ndim; d++) shape[d] = d == dim ? idx->shape[0] : 1;
    kiln_tensor_t *r = kiln_reshape(idx, shape, g->ndim);
    return kiln_expand(r, g->shape, g->ndim);
}

INDEXED_BW(embedding, kiln__call(KILN_OP_EMBEDDING_BACKWARD, (kiln_tensor_t *[2]){G, X(1)}, 2,
                                 &(kiln__attrs){.op.embedding_backward.vocab = META(0)->shape[0]}))
/* Rows of a matrix (dim 0, a vector of indices: the MoE tokens' rows) are added back as
 * whole rows, as an embedding's gradient (KILN_OPT_INDEX_ROWS_GRAD); else element by
 * element through an index the shape of G. */
static bool rows_of_matrix(const kiln__node *n, const kiln_tensor_t *g)
{
    return kiln__opt(KILN__OPT_INDEX_ROWS_GRAD) && n->attrs.op.dim.dim == 0 && META(0)->ndim == 2 && X(1)->ndim == 1 &&
           g->ndim == 2 && kiln_dtype_is_float(g->dtype);
}
INDEXED_BW(index_select, rows_of_matrix(n, G) ? kiln__call(KILN_OP_EMBEDDING_BACKWARD, (kiln_tensor_t *[2]){G, X(1)}, 2,
                                                        &(kiln__attrs){.op.embedding_backward.vocab = META(0)->shape[0]})
                                           : kiln_scatter_add(ZEROS, DIM, slice_index(X(1), G, DIM), G))
INDEXED_BW(gather, kiln_scatter_add(ZEROS, DIM, X(1), G))
INDEXED_BW(cross_entropy, kiln__call(KILN_OP_CROSS_ENTROPY_BACKWARD, (kiln_tensor_t *[4]){G, X(0), X(1), Y(1)}, 4, &n->attrs))

BW(scatter_add)
{
    if (NEED(0)) gin[0] = G;
    if (NEED(2)) gin[2] = kiln_gather(G, DIM, X(1));
    n->needs_grad[1] = false;
    return done(gin, 3, n);
}

/* A fused backward op's outputs are the inputs' gradients, in order: each kept where
 * its input needs one. */
static kiln_status by_fused(kiln__node *n, kiln__op_id op, kiln_tensor_t *const *in, kiln_tensor_t **gin)
{
    kiln_tensor_t *out[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch(op, in, kiln__ops[op].n_in, &n->attrs, out);
    for (int j = 0; j < kiln__ops[op].n_out; j++) {
        if (s != KILN_OK || !NEED(j)) kiln_tensor_free(out[j]);
        /* (a scope that cannot grow frees the tensor and says so: an error, not a zero gradient) */
        else if (!(gin[j] = kiln__scoped(out[j]))) s = kiln_last_status();
    }
    return s;
}

BW(layer_norm) { return by_fused(n, KILN_OP_LAYER_NORM_BACKWARD, (kiln_tensor_t *[5]){G, X(0), X(1), Y(1), Y(2)}, gin); }
BW(rms_norm) { return by_fused(n, KILN_OP_RMS_NORM_BACKWARD, (kiln_tensor_t *[4]){G, X(0), X(1), Y(1)}, gin); }

BW(attention)
{
    kiln_tensor_t *in[6] = {kiln_contiguous(G), X(0), X(1), X(2), Y(0), Y(1)};
    return by_fused(n, KILN_OP_ATTENTION_BACKWARD, in, gin);
}

/* topk: the values' gradient scattered back to the chosen positions of x (the indices,
 * output 1), zero elsewhere; the indices have none. */
BW(topk)
{
    kiln_tensor_t *z = kiln_zeros(META(0)->shape, META(0)->ndim, META(0)->dtype);
    gin[0] = G ? kiln_scatter_add(z, META(0)->ndim - 1, Y(1), G) : z;
    return done(gin, 1, n);
}

/* grouped_matmul: dx = grouped(g, w[e]^T), dw[e] = x_e^T g_e, both by one backward op;
 * the offsets have no gradient. */
BW(grouped_matmul)
{
    n->needs_grad[2] = false;
    return by_fused(n, KILN_OP_GROUPED_MATMUL_BACKWARD, (kiln_tensor_t *[4]){kiln_contiguous(G), X(0), X(1), X(2)}, gin);
}

/* all_to_all: each row's gradient goes back to the rank it came from by the same
 * exchange the other way: the rows received from each rank (recv_counts, output 1) sent
 * back to it, into x's rows, where they land in the order they were sent. Rows of x
 * that were sent nowhere get zeros. */
BW(all_to_all)
{
    n->needs_grad[1] = false;
    kiln__attrs a = n->attrs;
    a.op.collective.rows = META(0)->shape[0];
    kiln_tensor_t *g = G ? kiln_contiguous(G) : kiln_zeros(n->out_meta[0].shape, n->out_meta[0].ndim, META(0)->dtype);
    kiln_tensor_t *in[2] = {g, Y(1)}, *out[KILN__MAX_OUT] = {0};
    kiln_status s = g ? kiln__dispatch(KILN_OP_ALL_TO_ALL, in, 2, &a, out) : kiln_last_status();
    if (s != KILN_OK) return s;
    kiln_tensor_free(out[1]);
    gin[0] = kiln__scoped(out[0]);
    return done(gin, 1, n);
}

UNARY_BW(dropout, kiln_mul_scalar(kiln_mul(G, kiln_cast(Y(1), G->dtype)), 1.0 / (1.0 - n->attrs.op.dropout.p)))

BW(cat)
{
    int64_t at = 0;
    for (int i = 0; i < n->n_in; i++) {
        int64_t len = META(i)->shape[DIM];
        if (NEED(i)) gin[i] = kiln_narrow(G, DIM, at, len);
        at += len;
    }
    return done(gin, n->n_in, n);
}

UNARY_BW(tri, n->attrs.op.tri.upper ? kiln_triu(G, n->attrs.op.tri.k) : kiln_tril(G, n->attrs.op.tri.k))

BW(rope)
{
    kiln__attrs a = n->attrs;
    a.op.rope.inverse = !a.op.rope.inverse; /* the inverse rotation */
    gin[0] = kiln__call(KILN_OP_ROPE, gout, 1, &a);
    return done(gin, 1, n);
}

UNARY_BW(view, kiln_reshape(G, META(0)->shape, META(0)->ndim))

BW(permute)
{
    int inv[KILN_MAX_DIMS];
    for (int d = 0; d < n->attrs.ndim; d++) inv[n->attrs.shape[d]] = d;
    gin[0] = kiln_permute(G, inv, n->attrs.ndim);
    return done(gin, 1, n);
}

BW(slice)
{
    kiln_tensor_t *z = ZEROS;
    if (!z) return kiln_last_status();
    kiln_tensor_t *view = kiln__call(KILN_OP_SLICE, &z, 1, &n->attrs);
    kiln_status s = view ? kiln_tensor_copy_(view, G) : kiln_last_status();
    if (s != KILN_OK) return s;
    gin[0] = z;
    return KILN_OK;
}

UNARY_BW(expand, sum_to(G, META(0)->shape, META(0)->ndim))
UNARY_BW(contiguous, G)

/* The rows of include/kiln/pointwise.def with a backward op: g * dy/dx, by it. */
#define KILN_PW(ID, name, dtypes, grad, fast) KILN__PW_IF_OP(grad, UNARY_BW(name, by_op(n, KILN_OP_##ID##_BACKWARD, G)))
#include "kiln/pointwise.def"
#undef KILN_PW
