/* Every op of the registry compiled alone against eager. Each case below is a small
 * function around one op (where the op is differentiable, with the backward of
 * sum(y * y) over its result, so that the backward ops are compiled too), run once
 * eagerly and once as a compiled graph (kiln_compiled_*: capture, passes, fusion,
 * generated kernels) on arguments and leaves made from the same seeds, with the
 * generator at the same state.
 *
 * Oracle: the same function run eagerly. Compared: every result, every leaf's gradient,
 * and every argument after the run (in-place ops write into theirs; the others must
 * leave them as they were). Tolerances by dtype: f32 |got - want| <= 1e-5 (1 + |want|)
 * (generated kernels sum in another order and use the backend's polynomial exp); f64
 * 1e-12 (1 + |want|); integer and bool results exactly. Random ops draw the numbers the
 * eager call draws from the same generator state (docs/compile.md), so dropout masks
 * and rand are compared like any other result.
 *
 * The first test fails, naming the op, when an op of the registry appears in no case's
 * graph, as captured or after every decomposition (check_min appears only there: the
 * range checks of cross_entropy's targets and of AdamW's step). On a device
 * (tests/on_device.sh) the same cases check that device's compiled graphs. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/kiln.h"
#include "kiln/dist.h"
#include "kiln/graph.h"
#include "graph/graph_impl.h"
#include "test_util.h"

#define MAX_IO 8
static char cache_dir[] = "/tmp/kiln-compile-ops-XXXXXX";
static kiln_pg_t *pg; /* a group of one: collectives run their whole path and copy nothing */

/* What a case's function sees: the dtype of its float tensors, its leaves (captured
 * tensors with gradients), and which variant of the op to take. */
typedef struct {
    kiln_dtype dt;
    int which;
    kiln_tensor_t *leaf[4];
    int n_leaf;
} env;

typedef struct {
    const char *name;
    kiln_graph_fn fn;
    int (*make)(env *e, kiln_tensor_t **in); /* makes the arguments, returns their count, and the leaves */
    int which;
    bool f64; /* run in f64 as well as f32 */
} op_case;

/* ---- making inputs ---- */

static kiln_tensor_t *rnd(env *e, const int64_t *shape, int nd, uint64_t seed)
{
    kiln_manual_seed(seed);
    return kiln_cast(kiln_randn(shape, nd, KILN_DTYPE_F32), e->dt);
}

/* |randn| + 0.5: for log, sqrt, rsqrt, pow and divisors. */
static kiln_tensor_t *pos(env *e, const int64_t *shape, int nd, uint64_t seed)
{
    return kiln_add_scalar(kiln_abs(rnd(e, shape, nd, seed)), 0.5);
}

static kiln_tensor_t *leaf(env *e, kiln_tensor_t *t)
{
    t = kiln_contiguous(kiln_detach(t));
    kiln_tensor_set_requires_grad(t, true);
    e->leaf[e->n_leaf++] = t;
    return t;
}

static kiln_tensor_t *ints(const int64_t *v, const int64_t *shape, int nd)
{
    return kiln_from_data(v, shape, nd, KILN_DTYPE_I64);
}

/* The function's end: y is the result; when it needs a gradient, backward of
 * sum(y * y) (a weighting that varies over y, so that a softmax's gradient is not 0). */
static kiln_status finish(kiln_tensor_t *y, kiln_tensor_t **out, int *n_out)
{
    if (!y) return kiln_last_status();
    out[0] = y;
    *n_out = 1;
    if (!kiln_tensor_requires_grad(y)) return KILN_OK;
    kiln_tensor_t *l = kiln_sum(kiln_mul(y, y), NULL, 0, false);
    return l ? kiln_backward(l) : kiln_last_status();
}

/* ---- the cases ---- */

static const int64_t S[2] = {7, 33}, ROW[1] = {33};

static int make_one(env *e, kiln_tensor_t **in)
{
    /* log, sqrt and rsqrt need positive inputs; the rest take both signs */
    leaf(e, e->which >= 4 && e->which <= 6 ? pos(e, S, 2, 1) : rnd(e, S, 2, 1));
    return 0;
}

static kiln_status unary(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0], *y = NULL;
    switch (e->which) {
    case 0: y = kiln_neg(x); break;
    case 1: y = kiln_abs(x); break;
    case 2: y = kiln_exp(x); break;
    case 3: y = kiln_tanh(x); break;
    case 4: y = kiln_log(x); break;
    case 5: y = kiln_sqrt(x); break;
    case 6: y = kiln_rsqrt(x); break;
    case 7: y = kiln_sigmoid(x); break;
    case 8: y = kiln_relu(x); break;
    case 9: y = kiln_gelu(x, true); break;
    case 10: y = kiln_gelu(x, false); break;
    case 11: y = kiln_silu(x); break;
    }
    return finish(y, out, n_out);
}

/* Two leaves; the second broadcast as a row. Divisors and powers' bases positive. */
static int make_two(env *e, kiln_tensor_t **in)
{
    bool p = e->which == 3 || e->which == 4;
    leaf(e, p ? pos(e, S, 2, 2) : rnd(e, S, 2, 2));
    leaf(e, p ? pos(e, ROW, 1, 3) : rnd(e, ROW, 1, 3));
    return 0;
}

static kiln_status binary(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *a = e->leaf[0], *b = e->leaf[1], *y = NULL;
    switch (e->which) {
    case 0: y = kiln_add(a, b); break;
    case 1: y = kiln_sub(a, b); break;
    case 2: y = kiln_mul(a, b); break;
    case 3: y = kiln_div(a, b); break;
    case 4: y = kiln_pow(a, b); break;
    case 5: y = kiln_maximum(a, b); break;
    case 6: y = kiln_minimum(a, b); break;
    case 7: y = kiln_where(kiln_lt(a, b), a, b); break;
    }
    return finish(y, out, n_out);
}

/* Comparisons on small integers held as floats, so that ties happen. */
static int make_cmp(env *e, kiln_tensor_t **in)
{
    int64_t v[2][12];
    for (int i = 0; i < 12; i++) {
        v[0][i] = i % 3;
        v[1][i] = (i * 7) % 4;
    }
    int64_t sh[2] = {3, 4};
    in[0] = kiln_cast(ints(v[0], sh, 2), e->dt);
    in[1] = kiln_cast(ints(v[1], sh, 2), e->dt);
    return 2;
}

static kiln_status compare(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *(*f[6])(kiln_tensor_t *, kiln_tensor_t *) = {kiln_eq, kiln_ne, kiln_lt, kiln_le, kiln_gt, kiln_ge};
    return finish(f[e->which](in[0], in[1]), out, n_out);
}

/* Casts: f32 <-> f64 with gradients; to i64 and bool without. */
static kiln_status casts(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0];
    kiln_dtype other = e->dt == KILN_DTYPE_F32 ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
    kiln_tensor_t *y = kiln_mul_scalar(kiln_cast(kiln_cast(x, other), e->dt), 3);
    out[1] = kiln_cast(kiln_mul_scalar(kiln_detach(x), 4), KILN_DTYPE_I64);
    kiln_status s = finish(y, out, n_out);
    *n_out = 2;
    return s;
}

/* Reductions: sum over dims with and without keepdim, over everything, a mean; max with
 * its gradient; argmax (no gradient). */
static int make_red(env *e, kiln_tensor_t **in)
{
    leaf(e, rnd(e, (int64_t[]){3, 5, 6}, 3, 4));
    return 0;
}

/* The same tensor as an argument, for argmax (no gradient). */
static int make_red_arg(env *e, kiln_tensor_t **in)
{
    in[0] = rnd(e, (int64_t[]){3, 5, 6}, 3, 4);
    return 1;
}

static kiln_status reductions(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0], *y = NULL; /* NULL for argmax */
    int d02[2] = {0, 2}, d1 = 1, dl = -1;
    if (e->which == 0)
        y = kiln_add(kiln_sum(x, d02, 2, false), kiln_mul(kiln_sum(x, NULL, 0, false), kiln_mean(x, d02, 2, false)));
    else if (e->which == 1)
        y = kiln_add(kiln_sum(kiln_max(x, &d1, 1, true), &dl, 1, false), kiln_max(x, d02, 2, false));
    else
        return finish(kiln_argmax(in[0], 1, false), out, n_out);
    return finish(y, out, n_out);
}

static kiln_status softmaxes(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0];
    return finish(e->which ? kiln_log_softmax(x, 1) : kiln_softmax(x, -1), out, n_out);
}

/* A plain 2-D product and a batched one whose second operand broadcasts. */
static int make_mm(env *e, kiln_tensor_t **in)
{
    if (e->which == 0) {
        leaf(e, rnd(e, (int64_t[]){9, 20}, 2, 5));
        leaf(e, rnd(e, (int64_t[]){20, 13}, 2, 6));
    } else {
        leaf(e, rnd(e, (int64_t[]){2, 3, 5, 8}, 4, 5));
        leaf(e, rnd(e, (int64_t[]){8, 6}, 2, 6));
    }
    return 0;
}

static kiln_status matmul(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    return finish(kiln_matmul(e->leaf[0], e->leaf[1]), out, n_out);
}

/* Indexing: repeated indices, so that the backward ops add rows together. */
static int make_index(env *e, kiln_tensor_t **in)
{
    static const int64_t idx[6] = {3, 0, 3, 5, 1, 3};
    static const int64_t gidx[5][3] = {{0, 2, 2}, {1, 1, 0}, {5, 3, 0}, {4, 4, 4}, {2, 0, 1}};
    leaf(e, rnd(e, (int64_t[]){6, 5}, 2, 7));
    if (e->which <= 1) {
        in[0] = ints(idx, (int64_t[]){2, 3}, 2);
        return 1;
    }
    in[0] = ints(&gidx[0][0], (int64_t[]){5, 3}, 2);
    if (e->which == 3) leaf(e, rnd(e, (int64_t[]){5, 3}, 2, 8)); /* scatter_add's source */
    return 1;
}

static kiln_status indexing(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *w = e->leaf[0], *y = NULL;
    if (e->which == 0) y = kiln_embedding(w, in[0]);
    else if (e->which == 1) y = kiln_index_select(w, 0, kiln_reshape(in[0], (int64_t[]){6}, 1));
    else if (e->which == 2) y = kiln_gather(kiln_transpose(w, 0, 1), 1, kiln_transpose(in[0], 0, 1));
    else y = kiln_scatter_add(w, 0, kiln_narrow(in[0], 1, 0, 3), e->leaf[1]);
    return finish(y, out, n_out);
}

static int make_norm(env *e, kiln_tensor_t **in)
{
    leaf(e, rnd(e, (int64_t[]){4, 3, 40}, 3, 9));
    leaf(e, kiln_add_scalar(rnd(e, (int64_t[]){40}, 1, 10), 1));
    leaf(e, rnd(e, (int64_t[]){40}, 1, 11));
    return 0;
}

static kiln_status norms(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0], *y;
    if (e->which == 0) {
        y = kiln_layer_norm(x, e->leaf[1], e->leaf[2], 1e-5);
    } else {
        /* the bias leaf takes part too, so that every leaf has a gradient */
        y = kiln_add(kiln_rms_norm(x, e->leaf[1], 1e-6), e->leaf[2]);
    }
    return finish(y, out, n_out);
}

/* Rows with ignore_index among the targets. */
static int make_ce(env *e, kiln_tensor_t **in)
{
    static const int64_t t[10] = {3, 0, 16, -1, 7, 7, 12, -1, 2, 1};
    leaf(e, rnd(e, (int64_t[]){10, 17}, 2, 12));
    in[0] = ints(t, (int64_t[]){10}, 1);
    return 1;
}

static kiln_status cross_entropy(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    return finish(kiln_cross_entropy(e->leaf[0], in[0], -1), out, n_out);
}

static int make_x(env *e, kiln_tensor_t **in)
{
    leaf(e, rnd(e, (int64_t[]){2, 3, 6, 8}, 4, 13));
    return 0;
}

/* Dropout (a fresh mask from the generator), cat, tril/triu and rope. */
static kiln_status shaped(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0], *y = NULL;
    if (e->which == 0) y = kiln_dropout(x, 0.3, true);
    else if (e->which == 1)
        y = kiln_cat((kiln_tensor_t *[]){kiln_narrow(x, 2, 1, 3), x, kiln_mul_scalar(x, 2)}, 3, 2);
    else if (e->which == 2) y = kiln_add(kiln_tril(x, 0), kiln_mul_scalar(kiln_triu(x, 2), 3));
    else y = kiln_rope(x, 3, 10000.0);
    return finish(y, out, n_out);
}

/* Causal attention with grouped heads and Tq < Tk; plain attention. */
static int make_att(env *e, kiln_tensor_t **in)
{
    if (e->which == 0) {
        leaf(e, rnd(e, (int64_t[]){2, 4, 5, 8}, 4, 14));
        leaf(e, rnd(e, (int64_t[]){2, 2, 9, 8}, 4, 15));
        leaf(e, rnd(e, (int64_t[]){2, 2, 9, 8}, 4, 16));
    } else {
        for (int i = 0; i < 3; i++) leaf(e, rnd(e, (int64_t[]){1, 2, 7, 16}, 4, 17 + i));
    }
    return 0;
}

static kiln_status attention(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    return finish(kiln_attention(e->leaf[0], e->leaf[1], e->leaf[2], e->which == 0, 0), out, n_out);
}

/* Views alone: the result of each is the graph's output. */
static kiln_status views(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = e->leaf[0], *y = NULL;
    switch (e->which) {
    case 0: y = kiln_view(x, (int64_t[]){6, 48}, 2); break;
    case 1: y = kiln_permute(x, (int[]){2, 0, 3, 1}, 4); break;
    case 2: y = kiln_slice(x, 3, 1, 8, 3); break;
    case 3: y = kiln_expand(kiln_narrow(x, 1, 1, 1), (int64_t[]){2, 5, 6, 8}, 4); break;
    case 4: y = kiln_contiguous(kiln_transpose(x, 1, 3)); break;
    }
    return finish(y, out, n_out);
}

/* Tensors made inside the function: full, arange, rand and randn. */
static int make_none(env *e, kiln_tensor_t **in) { return 0; }

static kiln_status makers(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    int64_t sh[2] = {5, 9};
    kiln_tensor_t *y = NULL;
    if (e->which == 0) y = kiln_full(sh, 2, 2.5, e->dt);
    else if (e->which == 1) y = kiln_arange(-3, 9, 0.75, e->dt);
    else if (e->which == 2) y = kiln_rand(sh, 2, e->dt);
    else y = kiln_randn(sh, 2, e->dt);
    return finish(y, out, n_out);
}

/* Serving ops: a packed batch-invariant product (packed outside: packing is not an
 * op), rope at given positions, attention over paged keys and values. */
static int make_serving(env *e, kiln_tensor_t **in)
{
    if (e->which == 0) {
        in[0] = rnd(e, (int64_t[]){5, 24}, 2, 20);
        in[1] = kiln_matmul_rows_pack(rnd(e, (int64_t[]){19, 24}, 2, 21));
        return 2;
    }
    if (e->which == 1) {
        static const int64_t p[4] = {0, 7, 3, 30};
        in[0] = rnd(e, (int64_t[]){4, 2, 8}, 3, 22);
        in[1] = ints(p, (int64_t[]){4}, 1);
        return 2;
    }
    /* 2 sequences in blocks of 4 slots over 6 blocks; 3 query rows */
    static const int32_t table[2][3] = {{4, 1, 5}, {0, 2, 3}};
    static const int32_t sp[3][2] = {{0, 9}, {1, 2}, {0, 4}};
    in[0] = rnd(e, (int64_t[]){3, 4, 8}, 3, 23);
    in[1] = rnd(e, (int64_t[]){24, 2, 8}, 3, 24);
    in[2] = rnd(e, (int64_t[]){24, 2, 8}, 3, 25);
    in[3] = kiln_from_data(table, (int64_t[]){2, 3}, 2, KILN_DTYPE_I32);
    in[4] = kiln_from_data(sp, (int64_t[]){3, 2}, 2, KILN_DTYPE_I32);
    return 5;
}

static kiln_status serving(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *y;
    if (e->which == 0) y = kiln_matmul_rows_packed(in[0], in[1], 19);
    else if (e->which == 1) y = kiln_rope_at(in[0], in[1], 10000.0);
    else y = kiln_paged_attention(in[0], in[1], in[2], in[3], in[4], 4, 0);
    return finish(y, out, n_out);
}

/* In-place updates of the arguments (compared after the run): add_, scale_, fill_,
 * copy_ (into a slice), index_copy_. */
static int make_inplace(env *e, kiln_tensor_t **in)
{
    static const int64_t idx[3] = {4, 0, 2};
    in[0] = rnd(e, (int64_t[]){6, 10}, 2, 26);
    in[1] = rnd(e, (int64_t[]){6, 10}, 2, 27);
    in[2] = ints(idx, (int64_t[]){3}, 1);
    return 3;
}

static kiln_status inplace(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *d = in[0], *s = in[1];
    kiln_status st = KILN_OK;
    if (e->which == 0) st = kiln_add_(d, kiln_exp(s), -0.5);
    else if (e->which == 1) st = kiln_mul_scalar_(d, 1.5);
    else if (e->which == 2) st = kiln_fill_(kiln_narrow(d, 1, 2, 5), -2);
    else if (e->which == 3) st = kiln_tensor_copy_(kiln_narrow(d, 0, 1, 3), kiln_narrow(kiln_tanh(s), 0, 2, 3));
    else st = kiln_index_copy_(d, in[2], kiln_narrow(kiln_sigmoid(s), 0, 0, 3));
    if (st != KILN_OK) return st;
    return finish(kiln_sum(d, NULL, 0, false), out, n_out); /* read after the write */
}

/* The AdamW update on parameter, gradient and moments given as arguments, with the
 * learning rate, step count and gradient scale as tensors (decomposed into primitives
 * on the cpu, with a check_min on the step). */
static int make_adamw(env *e, kiln_tensor_t **in)
{
    int64_t sh[2] = {8, 12}, one[1] = {1};
    in[0] = rnd(e, sh, 2, 28);
    in[1] = rnd(e, sh, 2, 29);
    in[2] = kiln_mul_scalar(rnd(e, sh, 2, 30), 0.1);
    in[3] = kiln_mul_scalar(kiln_abs(rnd(e, sh, 2, 31)), 0.01);
    in[4] = kiln_full(one, 1, 3e-3, KILN_DTYPE_F32);
    in[5] = kiln_full(one, 1, 4, KILN_DTYPE_F32);
    in[6] = kiln_full(one, 1, 0.7, KILN_DTYPE_F32);
    return 7;
}

static kiln_status adamw(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    kiln_status s = kiln_adamw_step_(in[0], in[1], in[2], in[3], in[4], in[5], in[6], 0.9, 0.95, 1e-8, 0.1);
    if (s != KILN_OK) return s;
    return finish(kiln_mul_scalar(in[0], 2), out, n_out);
}

/* Collectives on a group of one: allreduce in place, reduce-scatter and allgather into
 * a second buffer. */
static int make_coll(env *e, kiln_tensor_t **in)
{
    in[0] = rnd(e, (int64_t[]){4, 6}, 2, 32);
    return 1;
}

static kiln_status collectives(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *x = kiln_mul_scalar(in[0], 3), *y = kiln_zeros((int64_t[]){4, 6}, 2, e->dt);
    kiln_status s;
    if (e->which == 0) {
        s = kiln_pg_allreduce(pg, x, KILN_REDUCE_AVG);
        y = x;
    } else if (e->which == 1) {
        s = kiln_pg_reduce_scatter(pg, x, y, KILN_REDUCE_SUM);
    } else {
        s = kiln_pg_allgather(pg, x, y);
    }
    if (s != KILN_OK) return s;
    return finish(kiln_add_scalar(y, 1), out, n_out);
}

#define ONE(n, w, f64) {"unary_" n, unary, make_one, w, f64}
#define TWO(n, w) {"binary_" n, binary, make_two, w, true}
static const op_case cases[] = {
    ONE("neg", 0, true), ONE("abs", 1, true), ONE("exp", 2, true), ONE("tanh", 3, true), ONE("log", 4, true),
    ONE("sqrt", 5, true), ONE("rsqrt", 6, true), ONE("sigmoid", 7, true), ONE("relu", 8, true),
    ONE("gelu_tanh", 9, true), ONE("gelu_erf", 10, true), ONE("silu", 11, true),
    TWO("add", 0), TWO("sub", 1), TWO("mul", 2), TWO("div", 3), TWO("pow", 4), TWO("maximum", 5),
    TWO("minimum", 6), TWO("where_lt", 7),
    {"compare_eq", compare, make_cmp, 0, false}, {"compare_ne", compare, make_cmp, 1, false},
    {"compare_lt", compare, make_cmp, 2, false}, {"compare_le", compare, make_cmp, 3, false},
    {"compare_gt", compare, make_cmp, 4, false}, {"compare_ge", compare, make_cmp, 5, false},
    {"cast", casts, make_one, 0, true},
    {"sum_mean", reductions, make_red, 0, true}, {"max", reductions, make_red, 1, true},
    {"argmax", reductions, make_red_arg, 2, false},
    {"softmax", softmaxes, make_red, 0, true}, {"log_softmax", softmaxes, make_red, 1, true},
    {"matmul_2d", matmul, make_mm, 0, true}, {"matmul_batched_broadcast", matmul, make_mm, 1, true},
    {"embedding", indexing, make_index, 0, true}, {"index_select", indexing, make_index, 1, true},
    {"gather", indexing, make_index, 2, true}, {"scatter_add", indexing, make_index, 3, true},
    {"layer_norm", norms, make_norm, 0, true}, {"rms_norm", norms, make_norm, 1, true},
    {"cross_entropy_ignore_index", cross_entropy, make_ce, 0, true},
    {"dropout", shaped, make_x, 0, false}, {"cat", shaped, make_x, 1, true},
    {"tril_triu", shaped, make_x, 2, true}, {"rope", shaped, make_x, 3, true},
    {"attention_causal_gqa", attention, make_att, 0, true}, {"attention", attention, make_att, 1, true},
    {"view", views, make_x, 0, true}, {"permute", views, make_x, 1, true}, {"slice", views, make_x, 2, true},
    {"expand", views, make_x, 3, true}, {"contiguous", views, make_x, 4, true},
    {"full", makers, make_none, 0, true}, {"arange", makers, make_none, 1, true},
    {"rand", makers, make_none, 2, false}, {"randn", makers, make_none, 3, false},
    {"matmul_rows_packed", serving, make_serving, 0, false}, {"rope_at", serving, make_serving, 1, false},
    {"paged_attention", serving, make_serving, 2, false},
    {"add_", inplace, make_inplace, 0, true}, {"scale_", inplace, make_inplace, 1, true},
    {"fill_", inplace, make_inplace, 2, true}, {"copy_", inplace, make_inplace, 3, true},
    {"index_copy_", inplace, make_inplace, 4, true},
    {"adamw_", adamw, make_adamw, 0, false},
    {"allreduce_", collectives, make_coll, 0, true}, {"reduce_scatter_", collectives, make_coll, 1, true},
    {"allgather_", collectives, make_coll, 2, true},
};
#define N_CASES (sizeof cases / sizeof cases[0])

/* ---- running and comparing ---- */

static double tol_of(kiln_dtype dt)
{
    return dt == KILN_DTYPE_F32 ? 1e-5 : dt == KILN_DTYPE_F64 ? 1e-12 : 0;
}

/* Largest |got - want| / (1 + |want|), after checking shape and dtype. Integers and
 * bools go through f64 exactly (the cases' values are small). */
static double rel_err(const char *what, kiln_tensor_t *got, kiln_tensor_t *want)
{
    if (kiln_tensor_dtype(got) != kiln_tensor_dtype(want)) fail_msg("%s: dtype differs from eager's", what);
    assert_int_equal(kiln_tensor_ndim(got), kiln_tensor_ndim(want));
    if (memcmp(kiln_tensor_shape(got), kiln_tensor_shape(want), sizeof(int64_t) * (size_t)kiln_tensor_ndim(want)))
        fail_msg("%s: shape differs from eager's", what);
    int64_t n = kiln_tensor_numel(want);
    double *a = malloc(sizeof *a * (size_t)(n + 1)), *b = malloc(sizeof *b * (size_t)(n + 1));
    assert_int_equal(kiln_tensor_to_host(kiln_cast(got, KILN_DTYPE_F64), a, sizeof *a * (size_t)n), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(kiln_cast(want, KILN_DTYPE_F64), b, sizeof *b * (size_t)n), KILN_OK);
    double m = test_max_rel_err(a, b, n);
    free(a);
    free(b);
    return m;
}

typedef struct {
    kiln_tensor_t *out[MAX_IO], *grad[4], *arg[MAX_IO];
    int n_out, n_leaf, n_arg;
} run_result;

/* Makes the case's inputs afresh and runs it eagerly or compiled, keeping copies of the
 * results, the leaves' gradients and the arguments as they are afterwards. */
static void run_once(const op_case *c, kiln_dtype dt, bool compiled, run_result *r)
{
    env e = {dt, c->which, {0}, 0};
    kiln_tensor_t *in[MAX_IO];
    int n_in = c->make(&e, in);
    kiln_manual_seed(1234);
    kiln_status s;
    if (compiled) {
        kiln_compiled_t *cf;
        assert_int_equal(kiln_compiled_new(c->fn, &e, c->name, &cf), KILN_OK);
        s = kiln_compiled_call(cf, in, n_in, r->out, MAX_IO, &r->n_out);
        kiln_compiled_free(cf);
    } else {
        s = c->fn(&e, in, n_in, r->out, &r->n_out);
    }
    if (s != KILN_OK) fail_msg("%s (%s) %s: %s", c->name, kiln_dtype_name(dt), compiled ? "compiled" : "eager", kiln_last_error());
    for (int j = 0; j < r->n_out; j++) r->out[j] = kiln_clone(r->out[j]);
    r->n_leaf = e.n_leaf;
    for (int j = 0; j < e.n_leaf; j++) {
        kiln_tensor_t *g = kiln_tensor_grad(e.leaf[j]);
        if (!g) fail_msg("%s (%s) %s: leaf %d has no gradient", c->name, kiln_dtype_name(dt), compiled ? "compiled" : "eager", j);
        r->grad[j] = kiln_clone(g);
        kiln_tensor_zero_grad(e.leaf[j]);
    }
    r->n_arg = n_in;
    for (int j = 0; j < n_in; j++) r->arg[j] = kiln_clone(in[j]);
}

static void check_case(const op_case *c, kiln_dtype dt)
{
    run_result want, got;
    kiln_scope_begin();
    run_once(c, dt, false, &want);
    run_once(c, dt, true, &got);
    assert_int_equal(got.n_out, want.n_out);
    char what[160];
    for (int k = 0; k < 3; k++) {
        int n = k == 0 ? want.n_out : k == 1 ? want.n_leaf : want.n_arg;
        for (int j = 0; j < n; j++) {
            kiln_tensor_t *g = k == 0 ? got.out[j] : k == 1 ? got.grad[j] : got.arg[j];
            kiln_tensor_t *w = k == 0 ? want.out[j] : k == 1 ? want.grad[j] : want.arg[j];
            snprintf(what, sizeof what, "%s (%s): %s %d", c->name, kiln_dtype_name(dt),
                     k == 0 ? "result" : k == 1 ? "gradient of leaf" : "argument after the run", j);
            double err = rel_err(what, g, w), tol = tol_of(kiln_tensor_dtype(w));
            if (!(err <= tol)) fail_msg("%s differs from eager by %g (tolerance %g)", what, err, tol);
        }
    }
    kiln_scope_end();
}

static void run_case(void **state)
{
    const op_case *c = *state;
    check_case(c, KILN_DTYPE_F32);
    if (c->f64) check_case(c, KILN_DTYPE_F64);
}

/* Every op of the registry is in some case's graph: as captured (backward ops come from
 * the cases' backward), or after every decomposition there is (KILN_COMPILE_DECOMPOSE=all:
 * the same on every device). */
static void every_op_has_a_case(void **state)
{
    bool seen[KILN_OP_COUNT] = {0};
    for (size_t i = 0; i < N_CASES; i++) {
        const op_case *c = &cases[i];
        env e = {KILN_DTYPE_F32, c->which, {0}, 0};
        kiln_tensor_t *in[MAX_IO];
        int n_in = c->make(&e, in);
        kiln_graph_t *g;
        if (kiln_graph_capture(c->fn, &e, in, n_in, &g) != KILN_OK) fail_msg("%s: %s", c->name, kiln_last_error());
        for (int pass = 0; pass < 2; pass++) {
            for (int k = 0; k < g->n_nd; k++) seen[g->nd[k].op] = true;
            int n;
            if (!pass) assert_int_equal(kiln__graph_decompose(g, true, &n), KILN_OK);
        }
        kiln_graph_free(g);
        for (int j = 0; j < e.n_leaf; j++) kiln_tensor_zero_grad(e.leaf[j]);
    }
    int missing = 0;
    for (int op = 0; op < KILN_OP_COUNT; op++)
        if (!seen[op]) {
            print_error("op '%s' is in no case of tests/test_compile_ops.c\n", kiln__ops[op].name);
            missing++;
        }
    if (missing) fail_msg("%d op(s) of the registry never compiled alone", missing);
}

int main(void)
{
    assert_non_null(mkdtemp(cache_dir));
    setenv("KILN_CACHE_DIR", cache_dir, 1);
    unsetenv("KILN_WORLD_SIZE");
    if (kiln_pg_new_from_env(&pg) != KILN_OK) {
        fprintf(stderr, "test_compile_ops: no process group of one: %s\n", kiln_last_error());
        return 1;
    }
    struct CMUnitTest tests[N_CASES + 1];
    tests[0] = (struct CMUnitTest)cmocka_unit_test_setup_teardown(every_op_has_a_case, setup, teardown);
    for (size_t i = 0; i < N_CASES; i++) {
        tests[i + 1] = (struct CMUnitTest){cases[i].name, run_case, setup, teardown, (void *)&cases[i]};
    }
    if (getenv("KILN_TEST_FILTER")) cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
    int rc = _cmocka_run_group_tests("test_compile_ops", tests, N_CASES + 1, NULL, NULL);
    kiln_pg_free(pg);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", cache_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", cache_dir);
    return rc;
}
