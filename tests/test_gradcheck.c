/* Gradients of every differentiable op against central finite differences, plus the
 * autograd engine's bookkeeping (accumulation, zero_grad, grad mode, freed graphs).
 *
 * The oracle: each case runs the op through the public API on f64 leaves, reduces the
 * output to L = sum(out * R) with a fixed random R, and compares dL/dx from
 * kiln_backward with (L(x + eps) - L(x - eps)) / (2 eps), eps = 1e-6, element by
 * element. Tolerance |analytic - fd| <= 1e-6 + 1e-6 |fd|: the truncation error is
 * O(eps^2) ~ 1e-12 and the rounding error ~ 1e-16 |L| / eps ~ 1e-10 for these sizes.
 *
 * Every op with a backward formula in the registry must have at least one case in
 * `cases` below; the first test fails, naming the op, when one is missing. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/dist.h"
#include "kiln/ops.h"
#include "core/kmath_c.h"
#include "ops/registry.h"

#define EPS 1e-6
#define TOL 1e-6

static int setup(void **state)
{
    kiln_clear_error();
    kiln_set_grad_enabled(true);
    kiln_scope_begin();
    return 0;
}

static int teardown(void **state)
{
    kiln_scope_end();
    return 0;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static double urand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1p-53;
}

static int64_t numel(int nd, const int64_t *sh)
{
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= sh[i];
    return n;
}

/* A leaf of dtype dt holding v, with requires_grad. */
static kiln_tensor_t *leaf_of(const double *v, int nd, const int64_t *sh, kiln_dtype dt)
{
    kiln_tensor_t *t = kiln_cast(kiln_from_data(v, sh, nd, KILN_DTYPE_F64), dt);
    assert_non_null(t);
    if (dt != KILN_DTYPE_F64) t = kiln_contiguous(kiln_detach(t)); /* a leaf, not the cast's output */
    kiln_tensor_set_requires_grad(t, true);
    return t;
}

/* An f64 leaf with values in [lo, hi]; away0: magnitudes in [lo, hi] with random signs
 * (keeps abs/relu/maximum away from their kinks). */
static kiln_tensor_t *leaf(int nd, const int64_t *sh, double lo, double hi, bool away0)
{
    int64_t n = numel(nd, sh);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) {
        v[i] = lo + (hi - lo) * urand();
        if (away0 && urand() < 0.5) v[i] = -v[i];
    }
    kiln_tensor_t *t = leaf_of(v, nd, sh, KILN_DTYPE_F64);
    free(v);
    return t;
}

static kiln_tensor_t *index_of(const int64_t *v, int nd, const int64_t *sh)
{
    kiln_tensor_t *t = kiln_from_data(v, sh, nd, KILN_DTYPE_I64);
    assert_non_null(t);
    return t;
}

static void read_f64(const kiln_tensor_t *t, double *out)
{
    kiln_tensor_t *c = kiln_cast((kiln_tensor_t *)t, KILN_DTYPE_F64);
    assert_non_null(c);
    assert_int_equal(kiln_tensor_to_host(c, out, kiln_tensor_nbytes(c)), KILN_OK);
}

typedef kiln_tensor_t *(*fwd_fn)(kiln_tensor_t *const *x, const void *ctx);

/* L = sum(out * R); R is made from host values each time. */
static kiln_tensor_t *loss_of(kiln_tensor_t *out, const double *R)
{
    if (!out) fail_msg("forward returned NULL: %s", kiln_last_error());
    kiln_tensor_t *r = kiln_from_data(R, kiln_tensor_shape(out), kiln_tensor_ndim(out), KILN_DTYPE_F64);
    return kiln_sum(kiln_mul(kiln_cast(out, KILN_DTYPE_F64), r), NULL, 0, false);
}

static double eval_loss(fwd_fn f, const void *ctx, kiln_tensor_t *const *x, const double *R)
{
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    double v = NAN;
    kiln_tensor_t *l = loss_of(f(x, ctx), R);
    if (kiln_tensor_item(l, &v) != KILN_OK) fail_msg("loss: %s", kiln_last_error());
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    return v;
}

static void write_f64(kiln_tensor_t *t, const double *v)
{
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    kiln_tensor_t *src = kiln_from_data(v, kiln_tensor_shape(t), kiln_tensor_ndim(t), KILN_DTYPE_F64);
    assert_int_equal(kiln_tensor_copy_(t, src), KILN_OK);
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
}

/* Checks the gradient of every input of x[0..n) that requires grad. */
static void gradcheck_eps(const char *what, fwd_fn f, const void *ctx, int n, kiln_tensor_t *const *x, double eps)
{
    kiln_scope_begin();
    for (int i = 0; i < n; i++) kiln_tensor_zero_grad(x[i]);
    kiln_tensor_t *out = f(x, ctx);
    if (!out) fail_msg("%s: forward returned NULL: %s", what, kiln_last_error());
    if (!kiln_tensor_requires_grad(out)) fail_msg("%s: the output is not tracked", what);
    int64_t no = kiln_tensor_numel(out);
    double *R = malloc(sizeof(double) * (size_t)(no ? no : 1));
    for (int64_t j = 0; j < no; j++) R[j] = 2 * urand() - 1;
    kiln_tensor_t *l = loss_of(out, R);
    if (kiln_backward(l) != KILN_OK) fail_msg("%s: backward: %s", what, kiln_last_error());
    for (int i = 0; i < n; i++) {
        if (!kiln_tensor_requires_grad(x[i])) continue;
        kiln_tensor_t *g = kiln_tensor_grad(x[i]);
        if (!g) fail_msg("%s: input %d got no gradient", what, i);
        assert_int_equal(kiln_tensor_ndim(g), kiln_tensor_ndim(x[i]));
        assert_memory_equal(kiln_tensor_shape(g), kiln_tensor_shape(x[i]), sizeof(int64_t) * (size_t)kiln_tensor_ndim(g));
        assert_int_equal(kiln_tensor_dtype(g), kiln_tensor_dtype(x[i]));
        int64_t m = kiln_tensor_numel(x[i]);
        double *h = malloc(sizeof(double) * (size_t)m), *ga = malloc(sizeof(double) * (size_t)m);
        read_f64(x[i], h);
        read_f64(g, ga);
        for (int64_t j = 0; j < m; j++) {
            double keep = h[j];
            h[j] = keep + eps;
            write_f64(x[i], h);
            double lp = eval_loss(f, ctx, x, R);
            h[j] = keep - eps;
            write_f64(x[i], h);
            double lm = eval_loss(f, ctx, x, R);
            h[j] = keep;
            write_f64(x[i], h);
            double fd = (lp - lm) / (2 * eps);
            if (!(fabs(ga[j] - fd) <= TOL + TOL * fabs(fd)))
                fail_msg("%s: d/d input %d [%lld]: backward %.12g, finite difference %.12g", what, i, (long long)j, ga[j], fd);
        }
        free(h);
        free(ga);
    }
    free(R);
    kiln_scope_end();
}

static void gradcheck(const char *what, fwd_fn f, const void *ctx, int n, kiln_tensor_t *const *x)
{
    gradcheck_eps(what, f, ctx, n, x, EPS);
}

#define GC(what, f, ctx, ...)                                                                       \
    do {                                                                                            \
        kiln_tensor_t *xs_[] = {__VA_ARGS__};                                                       \
        gradcheck(what, f, ctx, (int)(sizeof xs_ / sizeof xs_[0]), xs_);                            \
    } while (0)

/* ---- forward functions ---- */

typedef struct {
    kiln_tensor_t *(*u)(kiln_tensor_t *);
    kiln_tensor_t *(*b)(kiln_tensor_t *, kiln_tensor_t *);
} fn_ctx;

static kiln_tensor_t *f_unary(kiln_tensor_t *const *x, const void *c) { return ((const fn_ctx *)c)->u(x[0]); }
static kiln_tensor_t *f_binary(kiln_tensor_t *const *x, const void *c) { return ((const fn_ctx *)c)->b(x[0], x[1]); }

static void unary_case(kiln_tensor_t *(*u)(kiln_tensor_t *), const char *name, double lo, double hi, bool away0)
{
    int64_t sh[2] = {3, 4};
    fn_ctx c = {.u = u};
    GC(name, f_unary, &c, leaf(2, sh, lo, hi, away0));
}

/* Both broadcast directions: (2,3,4) op (3,1) and (3,1) op (2,3,4), then (4) op (2,1,4). */
static void binary_case(kiln_tensor_t *(*b)(kiln_tensor_t *, kiln_tensor_t *), const char *name, double lo, double hi,
                        double blo, double bhi, bool away0)
{
    int64_t s1[3] = {2, 3, 4}, s2[2] = {3, 1}, s3[1] = {4}, s4[3] = {2, 1, 4};
    fn_ctx c = {.b = b};
    char what[64];
    snprintf(what, sizeof what, "%s (2,3,4),(3,1)", name);
    GC(what, f_binary, &c, leaf(3, s1, lo, hi, away0), leaf(2, s2, blo, bhi, away0));
    snprintf(what, sizeof what, "%s (3,1),(2,3,4)", name);
    GC(what, f_binary, &c, leaf(2, s2, lo, hi, away0), leaf(3, s1, blo, bhi, away0));
    snprintf(what, sizeof what, "%s (4),(2,1,4)", name);
    GC(what, f_binary, &c, leaf(1, s3, lo, hi, away0), leaf(3, s4, blo, bhi, away0));
}

static void case_add(void)
{
    binary_case(kiln_add, "add", -2, 2, -2, 2, false);
}
static kiln_tensor_t *f_add_scalar(kiln_tensor_t *const *x, const void *c) { return kiln_add_scalar(x[0], 0.75); }
static void case_add_scalar(void)
{
    int64_t sh[2] = {2, 3};
    GC("add_scalar", f_add_scalar, NULL, leaf(2, sh, -1, 1, false));
}
static void case_sub(void) { binary_case(kiln_sub, "sub", -2, 2, -2, 2, false); }
static void case_mul(void) { binary_case(kiln_mul, "mul", -2, 2, -2, 2, false); }
static void case_div(void) { binary_case(kiln_div, "div", -2, 2, 0.5, 2, true); }
static void case_pow(void) { binary_case(kiln_pow, "pow", 0.5, 2, -1.5, 1.5, false); }
static void case_maximum(void) { binary_case(kiln_maximum, "maximum", -2, 2, -2, 2, false); }
static void case_minimum(void) { binary_case(kiln_minimum, "minimum", -2, 2, -2, 2, false); }
static kiln_tensor_t *gelu_erf(kiln_tensor_t *a) { return kiln_gelu(a, false); }
static kiln_tensor_t *gelu_tanh(kiln_tensor_t *a) { return kiln_gelu(a, true); }
static void case_neg(void) { unary_case(kiln_neg, "neg", -2, 2, false); }
static void case_abs(void) { unary_case(kiln_abs, "abs", 0.2, 2, true); }
static void case_exp(void) { unary_case(kiln_exp, "exp", -2, 2, false); }
static void case_log(void) { unary_case(kiln_log, "log", 0.3, 3, false); }
static void case_sqrt(void) { unary_case(kiln_sqrt, "sqrt", 0.3, 3, false); }
static void case_rsqrt(void) { unary_case(kiln_rsqrt, "rsqrt", 0.3, 3, false); }
static void case_tanh(void) { unary_case(kiln_tanh, "tanh", -2, 2, false); }
static void case_sigmoid(void) { unary_case(kiln_sigmoid, "sigmoid", -4, 4, false); }
static void case_relu(void) { unary_case(kiln_relu, "relu", 0.2, 2, true); }
static void case_gelu(void)
{
    unary_case(gelu_erf, "gelu erf", -3, 3, false);
    unary_case(gelu_tanh, "gelu tanh", -3, 3, false);
}
static void case_silu(void) { unary_case(kiln_silu, "silu", -4, 4, false); }
static void case_softplus(void) { unary_case(kiln_softplus, "softplus", -4, 4, false); }
static void case_square(void) { unary_case(kiln_square, "square (x used twice)", -2, 2, false); }

static kiln_tensor_t *f_where(kiln_tensor_t *const *x, const void *c)
{
    return kiln_where((kiln_tensor_t *)c, x[0], x[1]);
}
static void case_where(void)
{
    int64_t sc[3] = {2, 1, 4}, sa[2] = {3, 4}, sb[3] = {2, 3, 1};
    double cv[8];
    for (int i = 0; i < 8; i++) cv[i] = i % 3 == 0;
    kiln_tensor_t *cond = kiln_cast(kiln_from_data(cv, sc, 3, KILN_DTYPE_F64), KILN_DTYPE_BOOL);
    GC("where", f_where, cond, leaf(2, sa, -1, 1, false), leaf(3, sb, -1, 1, false));
}

/* The loss is linear in a cast's output, so with inputs and eps on a 2^-8 grid every
 * perturbation is exact in f32 and the finite difference is exact. */
static kiln_tensor_t *f_cast(kiln_tensor_t *const *x, const void *c) { return kiln_cast(x[0], *(const kiln_dtype *)c); }
static void case_cast(void)
{
    int64_t sh[2] = {3, 4};
    double v[12];
    for (int i = 0; i < 12; i++) v[i] = (double)((int)(urand() * 512) - 256) / 256;
    kiln_dtype to64 = KILN_DTYPE_F64, to32 = KILN_DTYPE_F32;
    kiln_tensor_t *x32 = leaf_of(v, 2, sh, KILN_DTYPE_F32), *x64 = leaf_of(v, 2, sh, KILN_DTYPE_F64);
    kiln_tensor_t *a[1] = {x32}, *b[1] = {x64};
    gradcheck_eps("cast f32->f64", f_cast, &to64, 1, a, 0x1p-8);
    gradcheck_eps("cast f64->f32", f_cast, &to32, 1, b, 0x1p-8);
}

typedef struct {
    int dims[3], nd;
    bool keepdim;
    int correction;
} red_ctx;

static kiln_tensor_t *f_sum(kiln_tensor_t *const *x, const void *c)
{
    const red_ctx *r = c;
    return kiln_sum(x[0], r->nd ? r->dims : NULL, r->nd, r->keepdim);
}
static kiln_tensor_t *f_max(kiln_tensor_t *const *x, const void *c)
{
    const red_ctx *r = c;
    return kiln_max(x[0], r->nd ? r->dims : NULL, r->nd, r->keepdim);
}
static kiln_tensor_t *f_mean(kiln_tensor_t *const *x, const void *c)
{
    const red_ctx *r = c;
    return kiln_mean(x[0], r->nd ? r->dims : NULL, r->nd, r->keepdim);
}
static kiln_tensor_t *f_var(kiln_tensor_t *const *x, const void *c)
{
    const red_ctx *r = c;
    return kiln_var(x[0], r->nd ? r->dims : NULL, r->nd, r->correction, r->keepdim);
}
static kiln_tensor_t *f_logsumexp(kiln_tensor_t *const *x, const void *c)
{
    const red_ctx *r = c;
    return kiln_logsumexp(x[0], r->nd ? r->dims : NULL, r->nd, r->keepdim);
}

static const red_ctx red_sets[4] = {
    {{0, 2}, 2, true, 0}, {{-1}, 1, false, 1}, {{1}, 1, true, 1}, {{0}, 0, false, 0},
};

static void reduction_cases(const char *name, fwd_fn f)
{
    int64_t sh[3] = {2, 3, 4};
    for (int s = 0; s < 4; s++) {
        char what[64];
        snprintf(what, sizeof what, "%s set %d keepdim %d", name, s, red_sets[s].keepdim);
        GC(what, f, &red_sets[s], leaf(3, sh, -2, 2, false));
    }
}

static void case_sum(void) { reduction_cases("sum", f_sum); }
static void case_max(void) { reduction_cases("max", f_max); }
static void case_mean(void) { reduction_cases("mean", f_mean); }
static void case_var(void) { reduction_cases("var", f_var); }
static void case_logsumexp(void) { reduction_cases("logsumexp", f_logsumexp); }

static kiln_tensor_t *f_softmax(kiln_tensor_t *const *x, const void *c) { return kiln_softmax(x[0], *(const int *)c); }
static kiln_tensor_t *f_log_softmax(kiln_tensor_t *const *x, const void *c) { return kiln_log_softmax(x[0], *(const int *)c); }
static void case_softmax(void)
{
    int64_t sh[3] = {2, 3, 4};
    static const int dims[3] = {1, -1, 0};
    for (int k = 0; k < 3; k++) GC("softmax", f_softmax, &dims[k], leaf(3, sh, -2, 2, false));
}
static void case_log_softmax(void)
{
    int64_t sh[3] = {2, 3, 4};
    static const int dims[3] = {1, -1, 0};
    for (int k = 0; k < 3; k++) GC("log_softmax", f_log_softmax, &dims[k], leaf(3, sh, -2, 2, false));
}

static kiln_tensor_t *f_matmul(kiln_tensor_t *const *x, const void *c) { return kiln_matmul(x[0], x[1]); }
static kiln_tensor_t *f_matmul_bt(kiln_tensor_t *const *x, const void *c)
{
    return kiln_matmul(x[0], kiln_transpose(x[1], 0, 1));
}
static void case_matmul(void)
{
    struct {
        int na, nb;
        int64_t sa[4], sb[4];
    } cs[6] = {
        {2, 2, {3, 4}, {4, 5}},       {4, 3, {2, 1, 3, 4}, {3, 4, 5}}, {3, 2, {2, 3, 4}, {4, 5}},
        {1, 2, {4}, {4, 5}},          {2, 1, {3, 4}, {4}},             {1, 3, {4}, {2, 4, 3}},
    };
    for (int k = 0; k < 6; k++) {
        char what[48];
        snprintf(what, sizeof what, "matmul %dD@%dD #%d", cs[k].na, cs[k].nb, k);
        GC(what, f_matmul, NULL, leaf(cs[k].na, cs[k].sa, -1, 1, false), leaf(cs[k].nb, cs[k].sb, -1, 1, false));
    }
    int64_t sa[2] = {3, 4}, sbt[2] = {5, 4};
    GC("matmul transposed b", f_matmul_bt, NULL, leaf(2, sa, -1, 1, false), leaf(2, sbt, -1, 1, false));
}

static kiln_tensor_t *f_embedding(kiln_tensor_t *const *x, const void *c) { return kiln_embedding(x[0], (kiln_tensor_t *)c); }
static void case_embedding(void)
{
    int64_t ws[2] = {5, 3}, is[2] = {2, 3};
    const int64_t idx[6] = {4, 0, 4, 2, 2, 4};
    GC("embedding", f_embedding, index_of(idx, 2, is), leaf(2, ws, -1, 1, false));
}

/* topk's values: the gradient lands on the chosen positions (inputs distinct by far more
 * than eps, so the choice does not move). */
static kiln_tensor_t *f_topk(kiln_tensor_t *const *x, const void *c)
{
    kiln_tensor_t *val, *idx;
    return kiln_topk(x[0], 3, &val, &idx) == KILN_OK ? val : NULL;
}
static void case_topk(void)
{
    int64_t sh[2] = {4, 6};
    GC("topk k 3", f_topk, NULL, leaf(2, sh, -1, 1, false));
}

/* grouped_matmul over 3 experts, the second without rows, rows 0 and 8 routed to none. */
static kiln_tensor_t *f_grouped_matmul(kiln_tensor_t *const *x, const void *c)
{
    return kiln_grouped_matmul(x[0], x[1], (kiln_tensor_t *)c);
}
static void case_grouped_matmul(void)
{
    int64_t xs[2] = {9, 4}, ws[3] = {3, 4, 5}, os[1] = {4};
    const int64_t off[4] = {1, 4, 4, 8};
    GC("grouped_matmul", f_grouped_matmul, index_of(off, 1, os), leaf(2, xs, -1, 1, false), leaf(3, ws, -1, 1, false));
}

/* all_to_all on a group of one: the first 4 of x's 5 rows sent (to this rank), into 7
 * rows (3 of zeros); the gradient comes back by the reverse exchange, the unsent row's
 * zero. (The exchange between ranks: tests/dist/dist_probe.c.) */
static kiln_tensor_t *f_all_to_all(kiln_tensor_t *const *x, const void *c)
{
    static kiln_pg_t *pg; /* the op keeps the group's pointer for its backward: kept for the process */
    kiln_tensor_t *y = NULL, *rc;
    int64_t one = 1;
    const int64_t four = 4;
    if (pg || kiln_pg_new_from_env(&pg) == KILN_OK)
        kiln_pg_all_to_all(pg, x[0], kiln_from_data(&four, &one, 1, KILN_DTYPE_I64), 7, &y, &rc);
    (void)c;
    return y;
}
static void case_all_to_all(void)
{
    int64_t sh[2] = {5, 3};
    GC("all_to_all one rank", f_all_to_all, NULL, leaf(2, sh, -1, 1, false));
}

typedef struct {
    int dim;
    kiln_tensor_t *idx;
} idx_ctx;

static kiln_tensor_t *f_index_select(kiln_tensor_t *const *x, const void *c)
{
    const idx_ctx *k = c;
    return kiln_index_select(x[0], k->dim, k->idx);
}
static kiln_tensor_t *f_gather(kiln_tensor_t *const *x, const void *c)
{
    const idx_ctx *k = c;
    return kiln_gather(x[0], k->dim, k->idx);
}
static kiln_tensor_t *f_scatter_add(kiln_tensor_t *const *x, const void *c)
{
    const idx_ctx *k = c;
    return kiln_scatter_add(x[0], k->dim, k->idx, x[1]);
}

static void case_index_select(void)
{
    int64_t sh[3] = {3, 4, 2}, n = 3;
    const int64_t idx[3] = {3, 0, 3};
    idx_ctx c = {1, index_of(idx, 1, &n)};
    GC("index_select dim 1", f_index_select, &c, leaf(3, sh, -1, 1, false));
    idx_ctx c0 = {-3, index_of(idx + 1, 1, (int64_t[]){2})};
    GC("index_select dim -3", f_index_select, &c0, leaf(3, (int64_t[]){4, 2, 2}, -1, 1, false));
}

static void case_gather(void)
{
    int64_t sh[2] = {3, 4}, is[2] = {3, 2}, is0[2] = {2, 4};
    const int64_t i1[6] = {3, 0, 1, 1, 0, 0};
    const int64_t i0[8] = {2, 0, 1, 2, 0, 0, 2, 1};
    idx_ctx c1 = {1, index_of(i1, 2, is)}, c0 = {0, index_of(i0, 2, is0)};
    GC("gather dim 1", f_gather, &c1, leaf(2, sh, -1, 1, false));
    GC("gather dim 0", f_gather, &c0, leaf(2, sh, -1, 1, false));
}

static void case_scatter_add(void)
{
    int64_t sh[2] = {3, 4}, is[2] = {2, 4};
    const int64_t idx[8] = {0, 2, 2, 0, 0, 2, 1, 0};
    idx_ctx c = {0, index_of(idx, 2, is)};
    GC("scatter_add", f_scatter_add, &c, leaf(2, sh, -1, 1, false), leaf(2, is, -1, 1, false));
}

static kiln_tensor_t *f_layer_norm(kiln_tensor_t *const *x, const void *c) { return kiln_layer_norm(x[0], x[1], x[2], 1e-5); }
static kiln_tensor_t *f_layer_norm_bare(kiln_tensor_t *const *x, const void *c) { return kiln_layer_norm(x[0], NULL, NULL, 1e-5); }
static kiln_tensor_t *f_rms_norm(kiln_tensor_t *const *x, const void *c) { return kiln_rms_norm(x[0], x[1], 1e-6); }
static void case_layer_norm(void)
{
    int64_t sh[3] = {2, 3, 5}, c = 5;
    GC("layer_norm x, weight, bias", f_layer_norm, NULL, leaf(3, sh, -2, 2, false), leaf(1, &c, 0.5, 1.5, false),
       leaf(1, &c, -1, 1, false));
    GC("layer_norm without parameters", f_layer_norm_bare, NULL, leaf(3, sh, -2, 2, false));
}
static void case_rms_norm(void)
{
    int64_t sh[2] = {4, 6}, c = 6;
    GC("rms_norm x, weight", f_rms_norm, NULL, leaf(2, sh, -2, 2, false), leaf(1, &c, 0.5, 1.5, false));
}

static kiln_tensor_t *f_cross_entropy(kiln_tensor_t *const *x, const void *c)
{
    return kiln_cross_entropy(x[0], (kiln_tensor_t *)c, -100);
}
static void case_cross_entropy(void)
{
    int64_t sh[2] = {4, 5}, n = 4;
    const int64_t t[4] = {1, -100, 4, 0};
    GC("cross_entropy with an ignored target", f_cross_entropy, index_of(t, 1, &n), leaf(2, sh, -2, 2, false));
}

/* Reseeding before each evaluation gives finite differences the same mask. */
static kiln_tensor_t *f_dropout(kiln_tensor_t *const *x, const void *c)
{
    kiln_manual_seed(77);
    return kiln_dropout(x[0], 0.4, true);
}
static void case_dropout(void)
{
    int64_t sh[2] = {4, 5};
    GC("dropout", f_dropout, NULL, leaf(2, sh, -1, 1, false));
}

static kiln_tensor_t *f_cat(kiln_tensor_t *const *x, const void *c) { return kiln_cat(x, 3, *(const int *)c); }
static void case_cat(void)
{
    int64_t s1[2] = {2, 3}, s2[2] = {2, 1}, s3[2] = {2, 2};
    kiln_tensor_t *fixed = leaf(2, s2, -1, 1, false);
    kiln_tensor_set_requires_grad(fixed, false);
    static const int dim = -1;
    GC("cat dim -1, one input without grad", f_cat, &dim, leaf(2, s1, -1, 1, false), fixed, leaf(2, s3, -1, 1, false));
}

static kiln_tensor_t *f_tril(kiln_tensor_t *const *x, const void *c) { return kiln_tril(x[0], 0); }
static kiln_tensor_t *f_triu(kiln_tensor_t *const *x, const void *c) { return kiln_triu(x[0], 1); }
static void case_tri(void)
{
    int64_t sh[3] = {2, 3, 4};
    GC("tril", f_tril, NULL, leaf(3, sh, -1, 1, false));
    GC("triu k=1", f_triu, NULL, leaf(3, sh, -1, 1, false));
}

static kiln_tensor_t *f_rope(kiln_tensor_t *const *x, const void *c) { return kiln_rope(x[0], 3, 10000); }
static void case_rope(void)
{
    int64_t sh[4] = {1, 2, 3, 8};
    GC("rope", f_rope, NULL, leaf(4, sh, -1, 1, false));
}

static kiln_tensor_t *f_attention(kiln_tensor_t *const *x, const void *c)
{
    return kiln_attention(x[0], x[1], x[2], *(const bool *)c, 0);
}
/* q, k, v as the heads of one fused projection x (B, T, 3 * H * D), and the output
 * back in (B, T, H, D): attention reads and its backward gets strided rows. */
static kiln_tensor_t *f_attention_heads(kiln_tensor_t *const *x, const void *c)
{
    (void)c;
    kiln_tensor_t *part[3];
    int64_t sizes[3] = {8, 8, 8}, sh[4] = {1, 5, 2, 4};
    if (kiln_split(x[0], sizes, 3, -1, part) != KILN_OK) return NULL;
    kiln_tensor_t *h[3];
    for (int i = 0; i < 3; i++) h[i] = kiln_transpose(kiln_reshape(part[i], sh, 4), 1, 2);
    return kiln_transpose(kiln_attention(h[0], h[1], h[2], true, 0), 1, 2);
}
static void case_attention(void)
{
    int64_t sq[4] = {1, 2, 4, 4}, sk[4] = {1, 2, 4, 4};
    static const bool off = false, on = true;
    GC("attention", f_attention, &off, leaf(4, sq, -1, 1, false), leaf(4, sk, -1, 1, false), leaf(4, sk, -1, 1, false));
    int64_t gq[4] = {1, 4, 3, 4}, gk[4] = {1, 2, 5, 4};
    GC("attention GQA causal Tq<Tk", f_attention, &on, leaf(4, gq, -1, 1, false), leaf(4, gk, -1, 1, false),
       leaf(4, gk, -1, 1, false));
    int64_t sx[3] = {1, 5, 24};
    GC("attention on the heads of a fused projection", f_attention_heads, NULL, leaf(3, sx, -1, 1, false));
}

static kiln_tensor_t *f_reshape(kiln_tensor_t *const *x, const void *c)
{
    int64_t s[2] = {6, 4};
    return kiln_reshape(x[0], s, 2);
}
static kiln_tensor_t *f_view(kiln_tensor_t *const *x, const void *c)
{
    int64_t s[3] = {4, -1, 2};
    return kiln_view(x[0], s, 3);
}
static kiln_tensor_t *f_reshape_copy(kiln_tensor_t *const *x, const void *c)
{
    int64_t s[1] = {-1};
    return kiln_reshape(kiln_transpose(x[0], 0, 2), s, 1);
}
static kiln_tensor_t *f_squeeze(kiln_tensor_t *const *x, const void *c) { return kiln_unsqueeze(kiln_squeeze(x[0], 1), 0); }
static void case_view(void)
{
    int64_t sh[3] = {2, 3, 4}, s1[3] = {2, 1, 3};
    GC("reshape", f_reshape, NULL, leaf(3, sh, -1, 1, false));
    GC("view", f_view, NULL, leaf(3, sh, -1, 1, false));
    GC("reshape of a transpose (copies)", f_reshape_copy, NULL, leaf(3, sh, -1, 1, false));
    GC("squeeze, unsqueeze", f_squeeze, NULL, leaf(3, s1, -1, 1, false));
}

static kiln_tensor_t *f_permute(kiln_tensor_t *const *x, const void *c)
{
    int order[3] = {2, 0, 1};
    return kiln_permute(x[0], order, 3);
}
static kiln_tensor_t *f_transpose(kiln_tensor_t *const *x, const void *c) { return kiln_transpose(x[0], -1, 0); }
static void case_permute(void)
{
    int64_t sh[3] = {2, 3, 4};
    GC("permute", f_permute, NULL, leaf(3, sh, -1, 1, false));
    GC("transpose", f_transpose, NULL, leaf(3, sh, -1, 1, false));
}

static kiln_tensor_t *f_slice(kiln_tensor_t *const *x, const void *c) { return kiln_slice(x[0], 1, 1, 6, 2); }
static kiln_tensor_t *f_narrow(kiln_tensor_t *const *x, const void *c) { return kiln_narrow(x[0], -1, 1, 2); }
static void case_slice(void)
{
    int64_t sh[2] = {3, 7};
    GC("slice with step", f_slice, NULL, leaf(2, sh, -1, 1, false));
    GC("narrow", f_narrow, NULL, leaf(2, sh, -1, 1, false));
}

static kiln_tensor_t *f_expand(kiln_tensor_t *const *x, const void *c)
{
    int64_t to[3] = {2, 3, 4};
    return kiln_expand(x[0], to, 3);
}
static void case_expand(void)
{
    int64_t sh[2] = {3, 1};
    GC("expand", f_expand, NULL, leaf(2, sh, -1, 1, false));
}

static kiln_tensor_t *f_contiguous(kiln_tensor_t *const *x, const void *c) { return kiln_contiguous(kiln_transpose(x[0], 0, 1)); }
static kiln_tensor_t *f_clone(kiln_tensor_t *const *x, const void *c) { return kiln_clone(x[0]); }
static void case_contiguous(void)
{
    int64_t sh[2] = {3, 4};
    GC("contiguous of a transpose", f_contiguous, NULL, leaf(2, sh, -1, 1, false));
    GC("clone", f_clone, NULL, leaf(2, sh, -1, 1, false));
}

/* ---- the table: op id -> cases ---- */

typedef struct {
    kiln__op_id op;
    const char *name;
    void (*run)(void);
} grad_case;

static const grad_case cases[] = {
    {KILN_OP_ADD, "gradcheck_add_broadcast", case_add},
    {KILN_OP_ADD, "gradcheck_add_scalar", case_add_scalar},
    {KILN_OP_SUB, "gradcheck_sub_broadcast", case_sub},
    {KILN_OP_MUL, "gradcheck_mul_broadcast", case_mul},
    {KILN_OP_MUL, "gradcheck_square_uses_x_twice", case_square},
    {KILN_OP_DIV, "gradcheck_div_broadcast", case_div},
    {KILN_OP_POW, "gradcheck_pow_broadcast", case_pow},
    {KILN_OP_MAXIMUM, "gradcheck_maximum_broadcast", case_maximum},
    {KILN_OP_MINIMUM, "gradcheck_minimum_broadcast", case_minimum},
    {KILN_OP_NEG, "gradcheck_neg", case_neg},
    {KILN_OP_ABS, "gradcheck_abs", case_abs},
    {KILN_OP_EXP, "gradcheck_exp", case_exp},
    {KILN_OP_LOG, "gradcheck_log", case_log},
    {KILN_OP_SQRT, "gradcheck_sqrt", case_sqrt},
    {KILN_OP_RSQRT, "gradcheck_rsqrt", case_rsqrt},
    {KILN_OP_TANH, "gradcheck_tanh", case_tanh},
    {KILN_OP_SIGMOID, "gradcheck_sigmoid", case_sigmoid},
    {KILN_OP_RELU, "gradcheck_relu", case_relu},
    {KILN_OP_GELU, "gradcheck_gelu_both_forms", case_gelu},
    {KILN_OP_SILU, "gradcheck_silu", case_silu},
    {KILN_OP_SOFTPLUS, "gradcheck_softplus", case_softplus},
    {KILN_OP_WHERE, "gradcheck_where_broadcast", case_where},
    {KILN_OP_CAST, "gradcheck_cast_both_ways", case_cast},
    {KILN_OP_SUM, "gradcheck_sum_keepdim_and_not", case_sum},
    {KILN_OP_SUM, "gradcheck_mean", case_mean},
    {KILN_OP_SUM, "gradcheck_var", case_var},
    {KILN_OP_SUM, "gradcheck_logsumexp", case_logsumexp},
    {KILN_OP_MAX, "gradcheck_max_keepdim_and_not", case_max},
    {KILN_OP_SOFTMAX, "gradcheck_softmax", case_softmax},
    {KILN_OP_LOG_SOFTMAX, "gradcheck_log_softmax", case_log_softmax},
    {KILN_OP_MATMUL, "gradcheck_matmul_shapes", case_matmul},
    {KILN_OP_EMBEDDING, "gradcheck_embedding_repeated_rows", case_embedding},
    {KILN_OP_INDEX_SELECT, "gradcheck_index_select", case_index_select},
    {KILN_OP_GATHER, "gradcheck_gather", case_gather},
    {KILN_OP_SCATTER_ADD, "gradcheck_scatter_add", case_scatter_add},
    {KILN_OP_LAYER_NORM, "gradcheck_layer_norm_weight_and_bias", case_layer_norm},
    {KILN_OP_RMS_NORM, "gradcheck_rms_norm", case_rms_norm},
    {KILN_OP_CROSS_ENTROPY, "gradcheck_cross_entropy_ignore_index", case_cross_entropy},
    {KILN_OP_DROPOUT, "gradcheck_dropout_fixed_mask", case_dropout},
    {KILN_OP_CAT, "gradcheck_cat", case_cat},
    {KILN_OP_TRI, "gradcheck_tril_triu", case_tri},
    {KILN_OP_ROPE, "gradcheck_rope", case_rope},
    {KILN_OP_ATTENTION, "gradcheck_attention_plain_and_gqa_causal", case_attention},
    {KILN_OP_TOPK, "gradcheck_topk_values", case_topk},
    {KILN_OP_ALL_TO_ALL, "gradcheck_all_to_all_one_rank", case_all_to_all},
    {KILN_OP_GROUPED_MATMUL, "gradcheck_grouped_matmul_empty_expert_and_unrouted_rows", case_grouped_matmul},
    {KILN_OP_VIEW, "gradcheck_view_reshape", case_view},
    {KILN_OP_PERMUTE, "gradcheck_permute_transpose", case_permute},
    {KILN_OP_SLICE, "gradcheck_slice_narrow", case_slice},
    {KILN_OP_EXPAND, "gradcheck_expand", case_expand},
    {KILN_OP_CONTIGUOUS, "gradcheck_contiguous_clone", case_contiguous},
};
#define N_CASES (sizeof cases / sizeof cases[0])

/* ---- f32 derivatives against closed forms ----
 *
 * The cases above run in f64, and the f32 backward kernels are another code path
 * (kmath.h's f-suffixed functions, the fast-exp forms). Here every pointwise row of
 * include/kiln/pointwise.def, and both GELUs, runs on f32 leaves: L = sum(op(x) * R),
 * and dL/dx from kiln_backward is compared with R * f'(x), f' written out in closed form
 * in double below from the f32 value of x. Tolerance |got - want| <= 2e-5 (1 + |want|):
 * the f32 rounding of a few operations (~1e-7 relative) and the polynomial exp and tanh
 * of the fast-exp forms (~1e-7 absolute). kmath.h's two forms of each derivative that
 * has them (exact and fast) are checked against the same closed forms directly, so that
 * the form the KILN_OPT_FAST_EXP switch does not pick is checked too. */
#define F32_TOL 2e-5
#define SQ2PI 0.7978845608028654 /* sqrt(2 / pi) */
static double sigm(double x) { return 1 / (1 + exp(-x)); }
static double d_neg(double x) { (void)x; return -1; }
static double d_abs(double x) { return x > 0 ? 1 : -1; }
static double d_exp(double x) { return exp(x); }
static double d_log(double x) { return 1 / x; }
static double d_sqrt(double x) { return 0.5 / sqrt(x); }
static double d_rsqrt(double x) { return -0.5 * pow(x, -1.5); }
static double d_tanh(double x) { return 1 - tanh(x) * tanh(x); }
static double d_sigmoid(double x) { return sigm(x) * (1 - sigm(x)); }
static double d_relu(double x) { return x > 0; }
static double d_silu(double x) { return sigm(x) + x * sigm(x) * (1 - sigm(x)); }
static double d_softplus(double x) { return sigm(x); }
/* 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3) */
static double d_gelu_tanh(double x)
{
    double u = SQ2PI * (x + 0.044715 * x * x * x), t = tanh(u);
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * SQ2PI * (1 + 3 * 0.044715 * x * x);
}
/* x Phi(x): Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) */
static double d_gelu_erf(double x) { return 0.5 * (1 + erf(x / sqrt(2.0))) + x * exp(-0.5 * x * x) * 0.3989422804014327; }

typedef struct {
    const char *name;
    double (*d)(double);
    double lo, hi; /* x in [lo, hi] */
    bool away0;    /* magnitudes in [lo, hi], random signs (abs, relu: off the kink) */
} f32_deriv;

static const f32_deriv f32_derivs[] = {
    {"neg", d_neg, -3, 3, false},          {"abs", d_abs, 0.2, 3, true},
    {"exp", d_exp, -3, 3, false},          {"log", d_log, 0.3, 3, false},
    {"sqrt", d_sqrt, 0.3, 3, false},       {"rsqrt", d_rsqrt, 0.3, 3, false},
    {"tanh", d_tanh, -3, 3, false},        {"sigmoid", d_sigmoid, -5, 5, false},
    {"relu", d_relu, 0.2, 3, true},        {"silu", d_silu, -5, 5, false},
    {"softplus", d_softplus, -5, 25, false}, /* past 20, its linear branch */
    {"gelu_tanh", d_gelu_tanh, -4, 4, false}, {"gelu_erf", d_gelu_erf, -4, 4, false},
};

static const f32_deriv *f32_deriv_of(const char *name)
{
    for (size_t k = 0; k < sizeof f32_derivs / sizeof f32_derivs[0]; k++)
        if (!strcmp(f32_derivs[k].name, name)) return &f32_derivs[k];
    return NULL;
}

static void check_f32_derivative(const char *name, kiln_tensor_t *(*op)(kiln_tensor_t *))
{
    const f32_deriv *d = f32_deriv_of(name);
    if (!d) fail_msg("pointwise op %s has no closed-form derivative in tests/test_gradcheck.c's f32_derivs", name);
    enum { N = 203 }; /* odd: the kernels' vector tails */
    double xv[N], rv[N], got[N];
    for (int j = 0; j < N; j++) {
        xv[j] = d->lo + (d->hi - d->lo) * urand();
        if (d->away0 && urand() < 0.5) xv[j] = -xv[j];
        xv[j] = (float)xv[j];
        rv[j] = (float)(2 * urand() - 1);
    }
    int64_t n = N;
    kiln_scope_begin();
    kiln_tensor_t *x = leaf_of(xv, 1, &n, KILN_DTYPE_F32);
    kiln_tensor_t *r = kiln_cast(kiln_from_data(rv, &n, 1, KILN_DTYPE_F64), KILN_DTYPE_F32);
    kiln_tensor_t *y = op(x);
    if (!y) fail_msg("%s: %s", name, kiln_last_error());
    assert_int_equal(kiln_tensor_dtype(y), KILN_DTYPE_F32);
    if (kiln_backward(kiln_sum(kiln_mul(y, r), NULL, 0, false)) != KILN_OK) fail_msg("%s: backward: %s", name, kiln_last_error());
    kiln_tensor_t *g = kiln_tensor_grad(x);
    assert_non_null(g);
    assert_int_equal(kiln_tensor_dtype(g), KILN_DTYPE_F32);
    read_f64(g, got);
    for (int j = 0; j < N; j++) {
        double want = rv[j] * d->d(xv[j]);
        if (!(fabs(got[j] - want) <= F32_TOL * (1 + fabs(want))))
            fail_msg("%s f32: d/dx at x = %.9g (weight %.6g): backward %.9g, closed form %.9g", name, xv[j], rv[j], got[j],
                     want);
    }
    kiln_scope_end();
}

/* kmath.h's function f against the closed form d on [lo, hi]. */
static void check_kmath_derivative(const char *what, float (*f)(float), const char *name, double lo, double hi)
{
    const f32_deriv *d = f32_deriv_of(name);
    assert_non_null(d);
    for (int j = 0; j <= 400; j++) {
        float x = (float)(lo + (hi - lo) * j / 400);
        double got = f(x), want = d->d(x);
        if (!(fabs(got - want) <= F32_TOL * (1 + fabs(want))))
            fail_msg("%s(%.9g) = %.9g, closed form %.9g", what, (double)x, got, want);
    }
}
static float kmf_gelu_grad_tanh(float x) { return km_gelu_grad_tanh(x); }
static float kmf_gelu_grad_fast(float x) { return km_gelu_grad_fast(x); }
static float kmf_gelu_grad_erf(float x) { return km_gelu_grad_erf(x); }
static float kmf_silu_dx(float x) { return km_silu_dx(x); }
static float kmf_silu_dx_fast(float x) { return km_silu_dx_fast(x); }
static float kmf_softplus_dx(float x) { return km_softplus_dx(x); }

static void test_f32_derivatives_of_every_pointwise_op_match_closed_forms(void **state)
{
#define KILN_PW(ID, name, dtypes, grad, fast) check_f32_derivative(#name, kiln_##name);
#include "kiln/pointwise.def"
#undef KILN_PW
    check_f32_derivative("gelu_tanh", gelu_tanh);
    check_f32_derivative("gelu_erf", gelu_erf);
    check_kmath_derivative("km_gelu_grad_tanh", kmf_gelu_grad_tanh, "gelu_tanh", -6, 6);
    check_kmath_derivative("km_gelu_grad_fast", kmf_gelu_grad_fast, "gelu_tanh", -6, 6);
    check_kmath_derivative("km_gelu_grad_erf", kmf_gelu_grad_erf, "gelu_erf", -6, 6);
    check_kmath_derivative("km_silu_dx", kmf_silu_dx, "silu", -8, 8);
    check_kmath_derivative("km_silu_dx_fast", kmf_silu_dx_fast, "silu", -8, 8);
    check_kmath_derivative("km_softplus_dx", kmf_softplus_dx, "softplus", -8, 25);
}

static void test_every_differentiable_op_has_a_gradcheck_case(void **state)
{
    int missing = 0;
    for (int op = 0; op < KILN_OP_COUNT; op++) {
        if (!kiln__op_backward[op]) continue;
        bool found = false;
        for (size_t k = 0; k < N_CASES && !found; k++) found = cases[k].op == (kiln__op_id)op;
        if (!found) {
            print_error("op '%s' has a backward formula but no gradcheck case in tests/test_gradcheck.c\n",
                        kiln__ops[op].name);
            missing++;
        }
    }
    if (missing) fail_msg("%d differentiable op(s) without a gradcheck case", missing);
}

static void run_case(void **state)
{
    const grad_case *c = *state;
    c->run();
}

/* ---- the engine ---- */

static void test_gradients_accumulate_across_backward_calls(void **state)
{
    int64_t n = 3;
    const double v[3] = {1, -2, 0.5};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    for (int k = 0; k < 2; k++) {
        kiln_scope_begin();
        assert_int_equal(kiln_backward(kiln_sum(kiln_mul(x, x), NULL, 0, false)), KILN_OK);
        kiln_scope_end();
    }
    double g[3];
    read_f64(kiln_tensor_grad(x), g);
    for (int i = 0; i < 3; i++) assert_true(g[i] == 4 * v[i]); /* 2 * (2x), exact */
}

static void test_zero_grad_drops_the_gradient(void **state)
{
    int64_t n = 2;
    const double v[2] = {1, 2};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    assert_int_equal(kiln_backward(kiln_sum(x, NULL, 0, false)), KILN_OK);
    assert_non_null(kiln_tensor_grad(x));
    kiln_tensor_zero_grad(x);
    assert_null(kiln_tensor_grad(x));
    assert_int_equal(kiln_backward(kiln_sum(kiln_mul_scalar(x, 3), NULL, 0, false)), KILN_OK);
    double g[2];
    read_f64(kiln_tensor_grad(x), g);
    assert_true(g[0] == 3 && g[1] == 3);
}

static void test_grad_mode_off_records_nothing(void **state)
{
    int64_t n = 2;
    const double v[2] = {1, 2};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    bool prev = kiln_set_grad_enabled(false);
    assert_true(prev);
    assert_false(kiln_grad_enabled());
    kiln_tensor_t *y = kiln_sum(kiln_exp(x), NULL, 0, false);
    kiln_set_grad_enabled(true);
    assert_non_null(y);
    assert_false(kiln_tensor_requires_grad(y));
    assert_int_equal(kiln_backward(y), KILN_ERR_AUTOGRAD);
    assert_null(kiln_tensor_grad(x));
}

static void test_second_backward_on_a_freed_graph_is_an_autograd_error(void **state)
{
    int64_t n = 2;
    const double v[2] = {1, 2};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    kiln_tensor_t *y = kiln_sum(kiln_mul(x, x), NULL, 0, false);
    assert_int_equal(kiln_backward(y), KILN_OK);
    assert_int_equal(kiln_backward(y), KILN_ERR_AUTOGRAD);
    assert_non_null(strstr(kiln_last_error(), "backward"));
    /* A graph that shares a freed part also refuses. */
    kiln_clear_error();
    kiln_tensor_t *h = kiln_exp(x);
    kiln_tensor_t *a = kiln_sum(h, NULL, 0, false), *b = kiln_sum(kiln_mul_scalar(h, 2), NULL, 0, false);
    assert_int_equal(kiln_backward(a), KILN_OK);
    assert_int_equal(kiln_backward(b), KILN_ERR_AUTOGRAD);
}

static void test_a_tensor_used_twice_gets_the_summed_gradient(void **state)
{
    int64_t n = 3;
    const double v[3] = {1, -2, 0.5};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    kiln_tensor_t *h = kiln_mul_scalar(x, 2); /* a non-leaf used by two consumers */
    kiln_tensor_t *y = kiln_sum(kiln_add(kiln_mul(h, x), kiln_exp(h)), NULL, 0, false);
    assert_int_equal(kiln_backward(y), KILN_OK);
    double g[3];
    read_f64(kiln_tensor_grad(x), g);
    /* y = sum(2x^2 + e^(2x)): dy/dx = 4x + 2 e^(2x) */
    for (int i = 0; i < 3; i++) assert_true(fabs(g[i] - (4 * v[i] + 2 * exp(2 * v[i]))) < 1e-12 * (1 + fabs(g[i])));
}

/* An index computed from a tracked tensor (cast to i64) makes an edge that backward
 * cannot follow; it must not stop the gradient reaching the tensor's other users. */
static void test_an_index_derived_from_a_tracked_tensor_does_not_block_gradients(void **state)
{
    int64_t n = 3, ws[2] = {4, 2};
    const double v[3] = {1, 3, 2};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    kiln_tensor_t *w = kiln_ones(ws, 2, KILN_DTYPE_F64);
    kiln_tensor_t *h = kiln_mul_scalar(x, 1);
    kiln_tensor_t *idx = kiln_cast(h, KILN_DTYPE_I64);
    kiln_tensor_t *y = kiln_add(kiln_sum(kiln_embedding(w, idx), NULL, 0, false), kiln_sum(kiln_mul(h, h), NULL, 0, false));
    assert_int_equal(kiln_backward(y), KILN_OK);
    kiln_tensor_t *g = kiln_tensor_grad(x);
    if (!g) fail_msg("x got no gradient");
    double gv[3];
    read_f64(g, gv);
    for (int i = 0; i < 3; i++) assert_true(gv[i] == 2 * v[i]);
}

static void test_backward_of_a_non_scalar_root_needs_a_seed(void **state)
{
    int64_t n = 3;
    const double v[3] = {1, 2, 3}, s[3] = {1, 10, 100};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    kiln_tensor_t *y = kiln_mul(x, x);
    assert_int_equal(kiln_backward(y), KILN_ERR_SHAPE);
    kiln_clear_error();
    assert_int_equal(kiln_backward_with(y, kiln_from_data(s, &n, 1, KILN_DTYPE_F64)), KILN_OK);
    double g[3];
    read_f64(kiln_tensor_grad(x), g);
    for (int i = 0; i < 3; i++) assert_true(g[i] == 2 * v[i] * s[i]);
}

static void test_detach_cuts_the_graph(void **state)
{
    int64_t n = 2;
    const double v[2] = {1, 2};
    kiln_tensor_t *x = leaf_of(v, 1, &n, KILN_DTYPE_F64);
    kiln_tensor_t *d = kiln_detach(kiln_mul(x, x));
    assert_false(kiln_tensor_requires_grad(d));
    kiln_tensor_t *y = kiln_sum(kiln_mul(d, x), NULL, 0, false);
    assert_int_equal(kiln_backward(y), KILN_OK);
    double g[2];
    read_f64(kiln_tensor_grad(x), g);
    assert_true(g[0] == 1 && g[1] == 4); /* d = x^2 treated as a constant */
}

static void test_backward_frees_the_graph_memory(void **state)
{
    int64_t sh[2] = {32, 32};
    kiln_tensor_t *x = leaf(2, sh, -1, 1, false);
    size_t base = kiln_memory_allocated();
    kiln_scope_begin();
    kiln_tensor_t *y = kiln_sum(kiln_tanh(kiln_matmul(x, kiln_exp(x))), NULL, 0, false);
    assert_int_equal(kiln_backward(y), KILN_OK);
    kiln_scope_end();
    /* What remains is x's gradient: 32*32 f64 = 8192 bytes, a whole size class. */
    assert_non_null(kiln_tensor_grad(x));
    assert_int_equal(kiln_memory_allocated() - base, 8192);
}

int main(void)
{
    struct CMUnitTest *tests = calloc(N_CASES + 16, sizeof *tests);
    size_t k = 0;
#define ADD(f) tests[k++] = (struct CMUnitTest)cmocka_unit_test_setup_teardown(f, setup, teardown)
    ADD(test_every_differentiable_op_has_a_gradcheck_case);
    for (size_t i = 0; i < N_CASES; i++)
        tests[k++] = (struct CMUnitTest){cases[i].name, run_case, setup, teardown, (void *)&cases[i]};
    ADD(test_f32_derivatives_of_every_pointwise_op_match_closed_forms);
    ADD(test_gradients_accumulate_across_backward_calls);
    ADD(test_zero_grad_drops_the_gradient);
    ADD(test_grad_mode_off_records_nothing);
    ADD(test_second_backward_on_a_freed_graph_is_an_autograd_error);
    ADD(test_a_tensor_used_twice_gets_the_summed_gradient);
    ADD(test_an_index_derived_from_a_tracked_tensor_does_not_block_gradients);
    ADD(test_backward_of_a_non_scalar_root_needs_a_seed);
    ADD(test_detach_cuts_the_graph);
    ADD(test_backward_frees_the_graph_memory);
#undef ADD
    int rc = _cmocka_run_group_tests("test_gradcheck", tests, k, NULL, NULL);
    free(tests);
    return rc;
}
