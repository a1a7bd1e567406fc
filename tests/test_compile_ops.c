/* Every op of the registry compiled alone against eager. Each case below is a small
 * function around one op (where the op is differentiable, with the backward of
 * sum(y * y) over its result, so that the backward ops are compiled too), run eagerly
 * and as a compiled graph (kiln_compiled_*: capture, passes, fusion, generated
 * kernels), twice each: on arguments of round 0, which the compiled function captures
 * with, then of round 1 (other values), which it runs through the same graph. Leaves
 * (captured tensors with gradients) have the same values every time, and the generator
 * is at the same state for the two sides.
 *
 * Oracle: the same function run eagerly. Compared: every result, every leaf's gradient,
 * and every argument after the run (in-place ops write into theirs; the others must
 * leave them as they were). Tolerances by dtype: f32 |got - want| <= 1e-5 (1 + |want|)
 * (generated kernels sum in another order and use the backend's polynomial exp); f64
 * 1e-12 (1 + |want|); integer and bool results exactly. Random ops draw the numbers the
 * eager call draws from the same generator state (docs/compile.md), so dropout masks
 * and rand are compared like any other result. On the cpu, the ops a case marks as
 * generated must not run through dispatch (loop_ir_after_fusion.txt of its debug
 * folder says which steps do).
 *
 * The first test fails, naming the op, when an op of the registry is no case's op; and
 * a case fails when its ops are not in its graph, as captured or after the cpu's
 * decompositions (check_min appears only there: AdamW's step check). On a device
 * (tests/on_device.sh) the cases check that device's compiled graphs. */
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
    int round; /* arguments of another round have other values; leaves never change */
    kiln_tensor_t *leaf[4];
    int n_leaf;
} env;

typedef struct {
    const char *name;
    kiln_graph_fn fn;
    int (*make)(env *e, kiln_tensor_t **in); /* makes the arguments, returns their count, and the leaves */
    int which;
    bool f64;             /* run in f64 as well as f32 */
    unsigned gen;         /* bit i: op[i] runs in generated kernels (cpu, f32) */
    kiln__op_id op[4];    /* the registry ops the case is for, up to KILN_OP_COUNT */
} op_case;

/* ---- making inputs ---- */

/* randn(seed) in e's dtype: an argument's values change with the round, a leaf's
 * (rnd0, pos0) do not. */
static kiln_tensor_t *rnd_at(env *e, const int64_t *shape, int nd, uint64_t seed, int round)
{
    kiln_manual_seed(seed + 1000 * (uint64_t)round);
    return kiln_cast(kiln_randn(shape, nd, KILN_DTYPE_F32), e->dt);
}
static kiln_tensor_t *rnd(env *e, const int64_t *shape, int nd, uint64_t seed)
{
    return rnd_at(e, shape, nd, seed, e->round);
}

static kiln_tensor_t *rnd0(env *e, const int64_t *shape, int nd, uint64_t seed)
{
    return rnd_at(e, shape, nd, seed, 0);
}

/* |randn| + 0.5: for log, sqrt, rsqrt, pow and divisors. */
static kiln_tensor_t *pos0(env *e, const int64_t *shape, int nd, uint64_t seed)
{
    return kiln_add_scalar(kiln_abs(rnd0(e, shape, nd, seed)), 0.5);
}

static kiln_tensor_t *leaf(env *e, kiln_tensor_t *t)
{
    t = kiln_contiguous(kiln_detach(t));
    kiln_tensor_set_requires_grad(t, true);
    assert_true(e->n_leaf < 4);
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
    if (!y) return kiln_last_status() != KILN_OK ? kiln_last_status() : kiln_error(KILN_ERR_INTERNAL, "no result");
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
    leaf(e, e->which >= 4 && e->which <= 6 ? pos0(e, S, 2, 1) : rnd0(e, S, 2, 1));
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
    case 12: y = kiln_softplus(x); break;
    }
    return finish(y, out, n_out);
}

/* Two leaves; the second broadcast as a row. Divisors and powers' bases positive. */
static int make_two(env *e, kiln_tensor_t **in)
{
    bool p = e->which == 3 || e->which == 4;
    leaf(e, p ? pos0(e, S, 2, 2) : rnd0(e, S, 2, 2));
    leaf(e, p ? pos0(e, ROW, 1, 3) : rnd0(e, ROW, 1, 3));
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
    leaf(e, rnd0(e, (int64_t[]){3, 5, 6}, 3, 4));
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
        leaf(e, rnd0(e, (int64_t[]){9, 20}, 2, 5));
        leaf(e, rnd0(e, (int64_t[]){20, 13}, 2, 6));
    } else {
        leaf(e, rnd0(e, (int64_t[]){2, 3, 5, 8}, 4, 5));
        leaf(e, rnd0(e, (int64_t[]){8, 6}, 2, 6));
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
    leaf(e, rnd0(e, (int64_t[]){6, 5}, 2, 7));
    if (e->which <= 1) {
        in[0] = ints(idx, (int64_t[]){2, 3}, 2);
        return 1;
    }
    in[0] = ints(&gidx[0][0], (int64_t[]){5, 3}, 2);
    if (e->which == 3) leaf(e, rnd0(e, (int64_t[]){5, 3}, 2, 8)); /* scatter_add's source */
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
    leaf(e, rnd0(e, (int64_t[]){4, 3, 40}, 3, 9));
    leaf(e, kiln_add_scalar(rnd0(e, (int64_t[]){40}, 1, 10), 1));
    leaf(e, rnd0(e, (int64_t[]){40}, 1, 11));
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
    leaf(e, rnd0(e, (int64_t[]){10, 17}, 2, 12));
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
    leaf(e, rnd0(e, (int64_t[]){2, 3, 6, 8}, 4, 13));
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
        leaf(e, rnd0(e, (int64_t[]){2, 4, 5, 8}, 4, 14));
        leaf(e, rnd0(e, (int64_t[]){2, 2, 9, 8}, 4, 15));
        leaf(e, rnd0(e, (int64_t[]){2, 2, 9, 8}, 4, 16));
    } else {
        for (int i = 0; i < 3; i++) leaf(e, rnd0(e, (int64_t[]){1, 2, 7, 16}, 4, 17 + i));
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

/* Mixture-of-experts routing: topk of the arguments plus a leaf (values and indices);
 * assignments sorted by expert and their rows (x plus a leaf) multiplied by a leaf's
 * per-expert weights. Round 1's choices give other per-expert counts (one expert none),
 * which the graph of round 0 runs: the counts are data. */
static int make_moe(env *e, kiln_tensor_t **in)
{
    static const int64_t ind[2][5][2] = {{{0, 1}, {2, 3}, {1, 0}, {3, 3}, {2, 1}},
                                         {{3, 3}, {0, 3}, {3, 0}, {1, 3}, {0, 0}}};
    if (e->which == 0) {
        in[0] = rnd(e, (int64_t[]){6, 8}, 2, 40);
        leaf(e, rnd0(e, (int64_t[]){6, 8}, 2, 41));
        return 1;
    }
    in[0] = ints(&ind[e->round][0][0], (int64_t[]){5, 2}, 2);
    in[1] = rnd(e, (int64_t[]){10, 6}, 2, 42);
    leaf(e, rnd0(e, (int64_t[]){10, 6}, 2, 43));
    leaf(e, rnd0(e, (int64_t[]){4, 6, 3}, 3, 44));
    return 2;
}

static kiln_status moe(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    env *e = ctx;
    kiln_tensor_t *a, *b;
    kiln_status s = e->which == 0 ? kiln_topk(kiln_add(in[0], e->leaf[0]), 3, &a, &b) : kiln_moe_sort(in[0], 4, &a, &b);
    if (s != KILN_OK) return s;
    if (e->which == 0) {
        s = finish(a, out, n_out);
        out[(*n_out)++] = b;
        return s;
    }
    kiln_tensor_t *xs = kiln_index_select(kiln_add(in[1], e->leaf[0]), 0, a);
    s = finish(kiln_grouped_matmul(xs, e->leaf[1], b), out, n_out);
    out[(*n_out)++] = a;
    out[(*n_out)++] = b;
    return s;
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
    } else if (e->which == 2) {
        s = kiln_pg_allgather(pg, x, y);
    } else { /* 3 of the 4 rows to this rank, into 5 rows (the last 2 zeros); the counts 3 */
        int64_t one = 1, three = 3;
        kiln_tensor_t *rc;
        s = kiln_pg_all_to_all(pg, x, kiln_from_data(&three, &one, 1, KILN_DTYPE_I64), 5, &y, &rc);
        if (s == KILN_OK) y = kiln_mul(y, kiln_cast(kiln_sum(rc, NULL, 0, false), e->dt));
    }
    if (s != KILN_OK) return s;
    return finish(kiln_add_scalar(y, 1), out, n_out);
}

/* Each case: its function and inputs, the registry ops it is for (KILN_OP_COUNT ends
 * the list), whether it runs in f64 too, and which of its ops must run inside generated
 * kernels on the cpu in f32 (a bit per op of the list: not one of them a step through
 * dispatch; the rest, matmul and attention say, run through the backend as in eager
 * code, and for them the case checks the graph around the kernel). f64 is left out
 * where the op or the case's input is f32 only (comparisons on integers, argmax, the
 * serving ops, the AdamW update) or where the numbers come from the generator (dropout,
 * rand, randn). */
#define END KILN_OP_COUNT
#define ONE(n, w, o, bo) \
    {.name = "unary_" n, .fn = unary, .make = make_one, .which = w, .f64 = true, .gen = 3, .op = {o, bo, END}}
#define TWO(n, w, o) \
    {.name = "binary_" n, .fn = binary, .make = make_two, .which = w, .f64 = true, .gen = 1, .op = {o, END}}
#define CMP(n, w, o) {.name = "compare_" n, .fn = compare, .make = make_cmp, .which = w, .gen = 1, .op = {o, END}}
static const op_case cases[] = {
    ONE("neg", 0, KILN_OP_NEG, END), ONE("abs", 1, KILN_OP_ABS, END), ONE("exp", 2, KILN_OP_EXP, END),
    ONE("tanh", 3, KILN_OP_TANH, END), ONE("log", 4, KILN_OP_LOG, END), ONE("sqrt", 5, KILN_OP_SQRT, END),
    ONE("rsqrt", 6, KILN_OP_RSQRT, END), ONE("sigmoid", 7, KILN_OP_SIGMOID, END), ONE("relu", 8, KILN_OP_RELU, END),
    ONE("gelu_tanh", 9, KILN_OP_GELU, KILN_OP_GELU_BACKWARD), ONE("gelu_erf", 10, KILN_OP_GELU, KILN_OP_GELU_BACKWARD),
    ONE("silu", 11, KILN_OP_SILU, KILN_OP_SILU_BACKWARD),
    ONE("softplus", 12, KILN_OP_SOFTPLUS, KILN_OP_SOFTPLUS_BACKWARD),
    TWO("add", 0, KILN_OP_ADD), TWO("sub", 1, KILN_OP_SUB), TWO("mul", 2, KILN_OP_MUL), TWO("div", 3, KILN_OP_DIV),
    TWO("pow", 4, KILN_OP_POW), TWO("maximum", 5, KILN_OP_MAXIMUM), TWO("minimum", 6, KILN_OP_MINIMUM),
    {.name = "binary_where_lt", .fn = binary, .make = make_two, .which = 7, .f64 = true, .gen = 3,
     .op = {KILN_OP_WHERE, KILN_OP_LT, END}},
    CMP("eq", 0, KILN_OP_EQ), CMP("ne", 1, KILN_OP_NE), CMP("lt", 2, KILN_OP_LT), CMP("le", 3, KILN_OP_LE),
    CMP("gt", 4, KILN_OP_GT), CMP("ge", 5, KILN_OP_GE),
    {.name = "cast", .fn = casts, .make = make_one, .f64 = true, .gen = 1, .op = {KILN_OP_CAST, END}},
    {.name = "sum_mean", .fn = reductions, .make = make_red, .which = 0, .f64 = true, .op = {KILN_OP_SUM, END}},
    {.name = "max", .fn = reductions, .make = make_red, .which = 1, .f64 = true, .op = {KILN_OP_MAX, END}},
    {.name = "argmax", .fn = reductions, .make = make_red_arg, .which = 2, .op = {KILN_OP_ARGMAX, END}},
    {.name = "softmax", .fn = softmaxes, .make = make_red, .which = 0, .f64 = true, .gen = 1,
     .op = {KILN_OP_SOFTMAX, END}},
    {.name = "log_softmax", .fn = softmaxes, .make = make_red, .which = 1, .f64 = true, .gen = 1,
     .op = {KILN_OP_LOG_SOFTMAX, END}},
    {.name = "matmul_2d", .fn = matmul, .make = make_mm, .which = 0, .f64 = true, .op = {KILN_OP_MATMUL, END}},
    {.name = "matmul_batched_broadcast", .fn = matmul, .make = make_mm, .which = 1, .f64 = true,
     .op = {KILN_OP_MATMUL, END}},
    {.name = "embedding", .fn = indexing, .make = make_index, .which = 0, .f64 = true,
     .op = {KILN_OP_EMBEDDING, KILN_OP_EMBEDDING_BACKWARD, END}},
    {.name = "index_select", .fn = indexing, .make = make_index, .which = 1, .f64 = true,
     .op = {KILN_OP_INDEX_SELECT, END}},
    {.name = "gather", .fn = indexing, .make = make_index, .which = 2, .f64 = true, .op = {KILN_OP_GATHER, END}},
    {.name = "scatter_add", .fn = indexing, .make = make_index, .which = 3, .f64 = true,
     .op = {KILN_OP_SCATTER_ADD, END}},
    {.name = "layer_norm", .fn = norms, .make = make_norm, .which = 0, .f64 = true, .gen = 1,
     .op = {KILN_OP_LAYER_NORM, KILN_OP_LAYER_NORM_BACKWARD, END}},
    {.name = "rms_norm", .fn = norms, .make = make_norm, .which = 1, .f64 = true, .gen = 1,
     .op = {KILN_OP_RMS_NORM, KILN_OP_RMS_NORM_BACKWARD, END}},
    {.name = "cross_entropy_ignore_index", .fn = cross_entropy, .make = make_ce, .f64 = true,
     .op = {KILN_OP_CROSS_ENTROPY, KILN_OP_CROSS_ENTROPY_BACKWARD, END}},
    {.name = "dropout", .fn = shaped, .make = make_x, .which = 0, .op = {KILN_OP_DROPOUT, END}},
    {.name = "cat", .fn = shaped, .make = make_x, .which = 1, .f64 = true, .op = {KILN_OP_CAT, END}},
    {.name = "tril_triu", .fn = shaped, .make = make_x, .which = 2, .f64 = true, .op = {KILN_OP_TRI, END}},
    {.name = "rope", .fn = shaped, .make = make_x, .which = 3, .f64 = true, .op = {KILN_OP_ROPE, END}},
    {.name = "attention_causal_gqa", .fn = attention, .make = make_att, .which = 0, .f64 = true,
     .op = {KILN_OP_ATTENTION, KILN_OP_ATTENTION_BACKWARD, END}},
    {.name = "attention", .fn = attention, .make = make_att, .which = 1, .f64 = true,
     .op = {KILN_OP_ATTENTION, KILN_OP_ATTENTION_BACKWARD, END}},
    {.name = "view", .fn = views, .make = make_x, .which = 0, .f64 = true, .op = {KILN_OP_VIEW, END}},
    {.name = "permute", .fn = views, .make = make_x, .which = 1, .f64 = true, .op = {KILN_OP_PERMUTE, END}},
    {.name = "slice", .fn = views, .make = make_x, .which = 2, .f64 = true, .op = {KILN_OP_SLICE, END}},
    {.name = "expand", .fn = views, .make = make_x, .which = 3, .f64 = true, .op = {KILN_OP_EXPAND, END}},
    {.name = "contiguous", .fn = views, .make = make_x, .which = 4, .f64 = true, .gen = 1,
     .op = {KILN_OP_CONTIGUOUS, END}},
    {.name = "full", .fn = makers, .make = make_none, .which = 0, .f64 = true, .op = {KILN_OP_FULL, END}},
    {.name = "arange", .fn = makers, .make = make_none, .which = 1, .f64 = true, .op = {KILN_OP_ARANGE, END}},
    {.name = "rand", .fn = makers, .make = make_none, .which = 2, .op = {KILN_OP_RAND, END}},
    {.name = "randn", .fn = makers, .make = make_none, .which = 3, .op = {KILN_OP_RAND, END}},
    {.name = "matmul_rows_packed", .fn = serving, .make = make_serving, .which = 0,
     .op = {KILN_OP_MATMUL_ROWS_PACKED, END}},
    {.name = "rope_at", .fn = serving, .make = make_serving, .which = 1, .op = {KILN_OP_ROPE_AT, END}},
    {.name = "paged_attention", .fn = serving, .make = make_serving, .which = 2, .op = {KILN_OP_PAGED_ATTENTION, END}},
    {.name = "topk", .fn = moe, .make = make_moe, .which = 0, .f64 = true, .op = {KILN_OP_TOPK, END}},
    {.name = "moe_sort_grouped_matmul", .fn = moe, .make = make_moe, .which = 1, .f64 = true,
     .op = {KILN_OP_MOE_SORT, KILN_OP_GROUPED_MATMUL, KILN_OP_GROUPED_MATMUL_BACKWARD, END}},
    {.name = "add_", .fn = inplace, .make = make_inplace, .which = 0, .f64 = true, .op = {KILN_OP_ADD_, END}},
    {.name = "scale_", .fn = inplace, .make = make_inplace, .which = 1, .f64 = true, .op = {KILN_OP_SCALE_, END}},
    {.name = "fill_", .fn = inplace, .make = make_inplace, .which = 2, .f64 = true, .op = {KILN_OP_FILL_, END}},
    {.name = "copy_", .fn = inplace, .make = make_inplace, .which = 3, .f64 = true, .op = {KILN_OP_COPY_, END}},
    {.name = "index_copy_", .fn = inplace, .make = make_inplace, .which = 4, .f64 = true,
     .op = {KILN_OP_INDEX_COPY_, END}},
    /* decomposed on the cpu: one kernel per update, its step checked by check_min */
    {.name = "adamw_", .fn = adamw, .make = make_adamw, .gen = 1, .op = {KILN_OP_ADAMW_, KILN_OP_CHECK_MIN, END}},
    /* On a group of one the collectives copy nothing, so these check the graph around
     * them (the allreduce started early and finished before its read), not the sums. */
    {.name = "allreduce_", .fn = collectives, .make = make_coll, .which = 0, .f64 = true,
     .op = {KILN_OP_ALLREDUCE_, END}},
    {.name = "reduce_scatter_", .fn = collectives, .make = make_coll, .which = 1, .f64 = true,
     .op = {KILN_OP_REDUCE_SCATTER_, END}},
    {.name = "allgather_", .fn = collectives, .make = make_coll, .which = 2, .f64 = true,
     .op = {KILN_OP_ALLGATHER_, END}},
    {.name = "all_to_all", .fn = collectives, .make = make_coll, .which = 3, .f64 = true,
     .op = {KILN_OP_ALL_TO_ALL, END}},
};
#define N_CASES (sizeof cases / sizeof cases[0])

/* ---- running and comparing ---- */

static bool on_cpu(void)
{
    const char *dev = getenv("KILN_DEVICE");
    return !dev || !*dev || !strcmp(dev, "cpu");
}

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

/* Copies of what a run gave: its results, the leaves' gradients (then zeroed) and the
 * arguments as they are afterwards. */
static void keep_run(const op_case *c, const char *how, env *e, kiln_tensor_t *const *in, int n_in, run_result *r)
{
    for (int j = 0; j < r->n_out; j++) r->out[j] = kiln_clone(r->out[j]);
    r->n_leaf = e->n_leaf;
    for (int j = 0; j < e->n_leaf; j++) {
        kiln_tensor_t *g = kiln_tensor_grad(e->leaf[j]);
        if (!g) fail_msg("%s %s: leaf %d has no gradient", c->name, how, j);
        r->grad[j] = kiln_clone(g);
        kiln_tensor_zero_grad(e->leaf[j]);
    }
    r->n_arg = n_in;
    for (int j = 0; j < n_in; j++) r->arg[j] = kiln_clone(in[j]);
}

/* Makes the case's inputs (arguments from round `round`: 0 and 1 give other values;
 * leaves always the same) into e and in[]. */
static int make_inputs(const op_case *c, kiln_dtype dt, int round, env *e, kiln_tensor_t **in)
{
    *e = (env){.dt = dt, .which = c->which, .round = round};
    int n_in = c->make(e, in);
    assert_true(n_in <= MAX_IO && e->n_leaf <= 4);
    return n_in;
}

/* The ops of the first block of loop_ir_after_fusion.txt that run through dispatch
 * ("  op     NAME -> ...") include none of c's ops marked for generated kernels. */
static void check_generated(const op_case *c, const char *dir)
{
    char path[512], text[16384] = "";
    snprintf(path, sizeof path, "%s/%s-0/loop_ir_after_fusion.txt", dir, c->name);
    if (!test_read_text(path, text, sizeof text)) fail_msg("%s: no %s", c->name, path);
    if (!strstr(text, "  kernel ")) fail_msg("%s: no generated kernel:\n%s", c->name, text);
    for (int i = 0; c->op[i] != END; i++) {
        if (!(c->gen >> i & 1)) continue;
        char step[80];
        snprintf(step, sizeof step, "  op     %s -> ", kiln__ops[c->op[i]].name);
        if (strstr(text, step)) fail_msg("%s: %s runs through dispatch, not in a generated kernel:\n%s", c->name,
                                         kiln__ops[c->op[i]].name, text);
    }
}

/* Eager on round 0 and round 1 arguments (want[0], want[1]); compiled, one function
 * called on round 0 (it captures) and on round 1 (it reuses the graph on new values):
 * got[0], got[1]. */
static void run_both(const op_case *c, kiln_dtype dt, run_result want[2], run_result got[2], const char *dir)
{
    env e;
    kiln_tensor_t *in[MAX_IO];
    for (int round = 0; round < 2; round++) {
        int n_in = make_inputs(c, dt, round, &e, in);
        kiln_manual_seed(1234 + round);
        want[round].n_out = 0;
        kiln_status s = c->fn(&e, in, n_in, want[round].out, &want[round].n_out);
        if (s != KILN_OK) fail_msg("%s (%s) eager: %s", c->name, kiln_dtype_name(dt), kiln_last_error());
        keep_run(c, "eager", &e, in, n_in, &want[round]);
    }
    env ce; /* the compiled function's: its leaves are captured */
    kiln_compiled_t *cf;
    if (dir) test_setenv("KILN_DEBUG_DIR", dir, 1);
    for (int round = 0; round < 2; round++) {
        int n_in = make_inputs(c, dt, round, round ? &e : &ce, in);
        if (!round) assert_int_equal(kiln_compiled_new(c->fn, &ce, c->name, &cf), KILN_OK);
        kiln_manual_seed(1234 + round);
        got[round].n_out = 0;
        kiln_status s = kiln_compiled_call(cf, in, n_in, got[round].out, MAX_IO, &got[round].n_out);
        if (s != KILN_OK) fail_msg("%s (%s) compiled: %s", c->name, kiln_dtype_name(dt), kiln_last_error());
        keep_run(c, "compiled", &ce, in, n_in, &got[round]);
    }
    test_unsetenv("KILN_DEBUG_DIR");
    uint64_t hits;
    kiln_compiled_stats(cf, NULL, &hits, NULL, NULL);
    kiln_compiled_free(cf);
    assert_int_equal(hits, 1); /* the second call ran the graph of the first */
}

static void check_case(const op_case *c, kiln_dtype dt)
{
    char dir[256] = "";
    bool gen = c->gen && dt == KILN_DTYPE_F32 && on_cpu();
    if (gen) snprintf(dir, sizeof dir, "%s/debug-%s", cache_dir, c->name);
    run_result want[2], got[2];
    run_both(c, dt, want, got, gen ? dir : NULL);
    if (gen) check_generated(c, dir);
    char what[160];
    for (int round = 0; round < 2; round++) {
        assert_int_equal(got[round].n_out, want[round].n_out);
        for (int k = 0; k < 3; k++) {
            const run_result *g = &got[round], *w = &want[round];
            int n = k == 0 ? w->n_out : k == 1 ? w->n_leaf : w->n_arg;
            for (int j = 0; j < n; j++) {
                kiln_tensor_t *gt = k == 0 ? g->out[j] : k == 1 ? g->grad[j] : g->arg[j];
                kiln_tensor_t *wt = k == 0 ? w->out[j] : k == 1 ? w->grad[j] : w->arg[j];
                snprintf(what, sizeof what, "%s (%s, call %d): %s %d", c->name, kiln_dtype_name(dt), round + 1,
                         k == 0 ? "result" : k == 1 ? "gradient of leaf" : "argument after the run", j);
                double err = rel_err(what, gt, wt), tol = tol_of(kiln_tensor_dtype(wt));
                if (!(err <= tol)) fail_msg("%s differs from eager by %g (tolerance %g)", what, err, tol);
            }
        }
    }
}

static void run_case(void **state)
{
    const op_case *c = *state;
    check_case(c, KILN_DTYPE_F32);
    if (c->f64) check_case(c, KILN_DTYPE_F64);
}

/* Every op of the registry is some case's op, and each case's ops are in its graph: as
 * captured, or after the decompositions (the cpu's: check_min comes from AdamW's). */
static void every_op_has_a_case(void **state)
{
    bool listed[KILN_OP_COUNT] = {0};
    for (size_t i = 0; i < N_CASES; i++) {
        const op_case *c = &cases[i];
        env e;
        kiln_tensor_t *in[MAX_IO];
        int n_in = make_inputs(c, KILN_DTYPE_F32, 0, &e, in);
        kiln_graph_t *g;
        if (kiln_graph_capture(c->fn, &e, in, n_in, &g) != KILN_OK) fail_msg("%s: %s", c->name, kiln_last_error());
        bool seen[KILN_OP_COUNT] = {0};
        for (int pass = 0; pass < 2; pass++) {
            for (int k = 0; k < g->n_nd; k++) seen[g->nd[k].op] = true;
            int n;
            if (!pass) assert_int_equal(kiln_graph_decompose(g, &n), KILN_OK);
        }
        kiln_graph_free(g);
        for (int j = 0; j < e.n_leaf; j++) kiln_tensor_zero_grad(e.leaf[j]);
        for (int k = 0; c->op[k] != END; k++) {
            if (!seen[c->op[k]]) fail_msg("case %s: its op %s is not in its graph", c->name, kiln__ops[c->op[k]].name);
            listed[c->op[k]] = true;
        }
    }
    int missing = 0;
    for (int op = 0; op < KILN_OP_COUNT; op++)
        if (!listed[op]) {
            print_error("op '%s' is in no case of tests/test_compile_ops.c\n", kiln__ops[op].name);
            missing++;
        }
    if (missing) fail_msg("%d op(s) of the registry never compiled alone", missing);
}

/* A failed case may leave its debug folder set. */
static int teardown_case(void **state)
{
    test_unsetenv("KILN_DEBUG_DIR");
    return teardown(state);
}

int main(void)
{
    assert_non_null(mkdtemp(cache_dir));
    test_setenv("KILN_CACHE_DIR", cache_dir, 1);
    test_unsetenv("KILN_WORLD_SIZE");
    if (kiln_pg_new_from_env(&pg) != KILN_OK) {
        fprintf(stderr, "test_compile_ops: no process group of one: %s\n", kiln_last_error());
        return 1;
    }
    /* The coverage check is about this file's table; on a device (tests/on_device.sh)
     * the cases run and it is left out, since the decompositions differ there. */
    struct CMUnitTest tests[N_CASES + 1];
    size_t n = 0;
    if (on_cpu())
        tests[n++] = (struct CMUnitTest){.name = "every_op_has_a_case", .test_func = every_op_has_a_case,
                                         .setup_func = setup, .teardown_func = teardown};
    else
        printf("left out on %s (the cpu run has it): every_op_has_a_case\n", getenv("KILN_DEVICE"));
    for (size_t i = 0; i < N_CASES; i++)
        tests[n++] = (struct CMUnitTest){.name = cases[i].name, .test_func = run_case, .setup_func = setup,
                                         .teardown_func = teardown_case, .initial_state = (void *)&cases[i]};
    if (getenv("KILN_TEST_FILTER")) cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
    int rc = _cmocka_run_group_tests("test_compile_ops", tests, n, NULL, NULL);
    kiln_pg_free(pg);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", cache_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", cache_dir);
    return rc;
}
