/* Graph capture and replay (kiln/graph.h). Oracle: the same function run eagerly on
 * the same inputs; since a run replays the recorded calls through the same kernels, the
 * results must be bitwise equal (tolerance 0). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "kiln/kiln.h"
#include "test_util.h"
#include "test_train.h"

static float *to_host(kiln_tensor_t *t)
{
    int64_t n = kiln_tensor_numel(t);
    float *p = malloc(sizeof *p * (size_t)n);
    assert_int_equal(kiln_tensor_to_host(t, p, sizeof *p * (size_t)n), KILN_OK);
    return p;
}

static kiln_tensor_t *randn(int64_t r, int64_t c, uint64_t seed)
{
    int64_t s[2] = {r, c};
    kiln_manual_seed(seed);
    return kiln_randn(s, 2, KILN_DTYPE_F32);
}

typedef struct {
    kiln_tensor_t *w1, *b1, *w2;
    bool unused, read_value, in_place;
} mlp_ctx;

/* An ordinary function of kiln ops: the one under test, eager and captured. */
static kiln_status mlp(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    mlp_ctx *c = ctx;
    kiln_tensor_t *h = kiln_gelu(kiln_add(kiln_matmul(in[0], c->w1), c->b1), true);
    if (c->unused) kiln_exp(h); /* nothing uses it: dead code */
    if (c->read_value) {
        double v;
        kiln_status s = kiln_tensor_item(kiln_sum(h, NULL, 0, false), &v);
        if (s != KILN_OK) return s;
    }
    if (c->in_place) {
        kiln_status s = kiln_add_(c->b1, kiln_sum(h, (int[]){0}, 1, true), 1.0); /* b1 += column sums of h */
        if (s != KILN_OK) return s;
    }
    out[0] = kiln_matmul(h, c->w2);
    out[1] = h;
    *n_out = 2;
    return out[0] && out[1] ? KILN_OK : kiln_last_status();
}

static void assert_same(kiln_tensor_t *a, kiln_tensor_t *b)
{
    assert_int_equal(kiln_tensor_numel(a), kiln_tensor_numel(b));
    float *x = to_host(a), *y = to_host(b);
    assert_memory_equal(x, y, sizeof(float) * (size_t)kiln_tensor_numel(a));
    free(x);
    free(y);
}

/* |a - b| <= tol * (1 + |b|) everywhere. */
static void assert_close(kiln_tensor_t *a, kiln_tensor_t *b, double tol)
{
    assert_int_equal(kiln_tensor_numel(a), kiln_tensor_numel(b));
    float *x = to_host(a), *y = to_host(b);
    for (int64_t i = 0; i < kiln_tensor_numel(a); i++)
        if (!(fabs((double)x[i] - y[i]) <= tol * (1 + fabs((double)y[i])))) fail_msg("element %lld: %g vs %g", (long long)i, x[i], y[i]);
    free(x);
    free(y);
}

static void capture_then_run_matches_eager(void **state)
{
    mlp_ctx c = {randn(16, 32, 1), randn(1, 32, 2), randn(32, 8, 3), false, false, false};
    kiln_tensor_t *x = randn(4, 16, 4), *x2 = randn(4, 16, 5);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(mlp, &c, &x, 1, &g), KILN_OK);
    assert_int_equal(kiln_graph_num_ops(g), 4); /* matmul, add, gelu, matmul */
    kiln_tensor_t *got[2], *want[2];
    int n;
    assert_int_equal(kiln_graph_run(g, &x2, 1, got, 2, &n), KILN_OK);
    assert_int_equal(n, 2);
    assert_int_equal(mlp(&c, &x2, 1, want, &n), KILN_OK);
    assert_same(got[0], want[0]);
    assert_same(got[1], want[1]);
    /* Parameters are captured by reference: a run after an update sees it. */
    assert_int_equal(kiln_mul_scalar_(c.w2, 2.0), KILN_OK);
    assert_int_equal(kiln_graph_run(g, &x2, 1, got, 2, &n), KILN_OK);
    assert_int_equal(mlp(&c, &x2, 1, want, &n), KILN_OK);
    assert_same(got[0], want[0]);
    /* The printed graph names the ops and the shapes. */
    char buf[4096] = "";
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    assert_int_equal(kiln_graph_print(g, f), KILN_OK);
    fclose(f);
    assert_non_null(strstr(buf, "gelu("));
    assert_non_null(strstr(buf, "f32[4,8]"));
    assert_non_null(strstr(buf, "input 0 f32[4,16]"));
    kiln_graph_free(g);
}

static void capture_records_and_computes_nothing(void **state)
{
    mlp_ctx c = {randn(16, 32, 1), randn(1, 32, 2), randn(32, 8, 3), false, false, true};
    float *before = to_host(c.b1);
    kiln_tensor_t *x = randn(4, 16, 4);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(mlp, &c, &x, 1, &g), KILN_OK);
    float *after = to_host(c.b1);
    assert_memory_equal(before, after, sizeof(float) * 32); /* the in-place update was recorded, not run */
    /* Each run applies it to the real tensor, as the eager function does. */
    mlp_ctx e = {kiln_contiguous(kiln_mul_scalar(c.w1, 1.0)), kiln_contiguous(kiln_mul_scalar(c.b1, 1.0)),
                 kiln_contiguous(kiln_mul_scalar(c.w2, 1.0)), false, false, true};
    kiln_tensor_t *got[2], *want[2];
    int n;
    for (int r = 0; r < 2; r++) {
        assert_int_equal(kiln_graph_run(g, &x, 1, got, 2, &n), KILN_OK);
        assert_int_equal(mlp(&e, &x, 1, want, &n), KILN_OK);
        assert_same(got[0], want[0]);
        assert_same(c.b1, e.b1);
    }
    free(before);
    free(after);
    kiln_graph_free(g);
}

static void dead_code_is_removed(void **state)
{
    mlp_ctx c = {randn(16, 32, 1), randn(1, 32, 2), randn(32, 8, 3), true, false, false};
    kiln_tensor_t *x = randn(4, 16, 4);
    kiln_graph_t *g;
    kiln_status st = kiln_graph_capture(mlp, &c, &x, 1, &g);
    if (st != KILN_OK) fail_msg("capture: %s", kiln_last_error());
    int before = kiln_graph_num_ops(g), removed = -1;
    assert_int_equal(kiln_graph_dce(g, &removed), KILN_OK);
    assert_int_equal(removed, 1);
    assert_int_equal(kiln_graph_num_ops(g), before - 1);
    kiln_tensor_t *got[2], *want[2];
    int n;
    assert_int_equal(kiln_graph_run(g, &x, 1, got, 2, &n), KILN_OK);
    assert_int_equal(mlp(&c, &x, 1, want, &n), KILN_OK);
    assert_same(got[0], want[0]);
    kiln_graph_free(g);
}

/* x * exp(arange(8) / 4) + exp(u), where u = ones(8) updated in place by x's first row:
 * exp(arange / 4) is a constant, u (and exp of it) is not. */
static kiln_status with_constants(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)ctx, (void)n_in;
    kiln_tensor_t *t = kiln_exp(kiln_mul_scalar(kiln_arange(0, 8, 1, KILN_DTYPE_F32), 0.25));
    kiln_tensor_t *u = kiln_full((int64_t[]){8}, 1, 1.0, KILN_DTYPE_F32);
    kiln_status s = u ? kiln_add_(u, kiln_squeeze(kiln_narrow(in[0], 0, 0, 1), 0), 1.0) : kiln_last_status();
    if (s != KILN_OK) return s;
    out[0] = kiln_add(kiln_mul(in[0], t), kiln_exp(u));
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

/* Oracle: the function run eagerly; the folded graph runs the same kernels, so bitwise.
 * The constant part folds (its ops disappear after DCE); the part updated in place
 * must not, or the run would use exp(1) instead of exp(1 + x[0]). */
static void constants_fold_and_updated_values_do_not(void **state)
{
    kiln_tensor_t *x = randn(3, 8, 7), *x2 = randn(3, 8, 8);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(with_constants, NULL, &x, 1, &g), KILN_OK);
    int before = kiln_graph_num_ops(g), folded = -1, removed = -1;
    assert_int_equal(kiln_graph_fold(g, &folded), KILN_OK);
    assert_int_equal(kiln_graph_dce(g, &removed), KILN_OK);
    assert_true(folded >= 2); /* the scaling and the exp of arange */
    assert_true(removed >= 1); /* arange itself */
    assert_int_equal(kiln_graph_num_ops(g), before - folded - removed);
    kiln_tensor_t *got, *want;
    int n;
    assert_int_equal(kiln_graph_run(g, &x2, 1, &got, 1, &n), KILN_OK);
    assert_int_equal(with_constants(NULL, &x2, 1, &want, &n), KILN_OK);
    assert_same(got, want);
    kiln_graph_free(g);
}

/* Several constants in a row, some folded before others are used: x + neg(1) + 3 * 4
 * (the review's case: folding must look each source up where it now is). */
static kiln_status constants_in_a_row(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)ctx, (void)n_in;
    int64_t one = 1;
    kiln_tensor_t *a = kiln_neg(kiln_full(&one, 1, 1.0, KILN_DTYPE_F32));
    kiln_tensor_t *b3 = kiln_full(&one, 1, 3.0, KILN_DTYPE_F32), *b4 = kiln_full(&one, 1, 4.0, KILN_DTYPE_F32);
    kiln_tensor_t *b5 = kiln_full(&one, 1, 5.0, KILN_DTYPE_F32);
    (void)b5;
    out[0] = kiln_add(kiln_add(in[0], a), kiln_mul(b3, b4));
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void folds_in_a_row_keep_their_sources(void **state)
{
    kiln_tensor_t *x = randn(2, 1, 3);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(constants_in_a_row, NULL, &x, 1, &g), KILN_OK);
    int folded = 0;
    assert_int_equal(kiln_graph_fold(g, &folded), KILN_OK);
    assert_int_equal(folded, 2); /* neg(1) and 3 * 4 */
    kiln_tensor_t *got, *want;
    int n;
    assert_int_equal(kiln_graph_run(g, &x, 1, &got, 1, &n), KILN_OK);
    assert_int_equal(constants_in_a_row(NULL, &x, 1, &want, &n), KILN_OK);
    assert_same(got, want);
    kiln_graph_free(g);
}

static void bad_uses_are_clear_errors(void **state)
{
    mlp_ctx c = {randn(16, 32, 1), randn(1, 32, 2), randn(32, 8, 3), false, true, false};
    kiln_tensor_t *x = randn(4, 16, 4);
    kiln_graph_t *g = (kiln_graph_t *)1;
    /* Reading a value while capturing: an error that names the op, and no graph. */
    assert_int_equal(kiln_graph_capture(mlp, &c, &x, 1, &g), KILN_ERR_UNSUPPORTED);
    assert_null(g);
    assert_non_null(strstr(kiln_last_error(), "data-dependent read"));
    assert_non_null(strstr(kiln_last_error(), "sum"));
    kiln_clear_error();
    c.read_value = false;
    assert_int_equal(kiln_graph_capture(mlp, &c, &x, 1, &g), KILN_OK);
    /* A run on another shape than the one captured. */
    kiln_tensor_t *wrong = randn(5, 16, 6), *got[2];
    int n;
    assert_int_equal(kiln_graph_run(g, &wrong, 1, got, 2, &n), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "f32[5,16]"));
    assert_non_null(strstr(kiln_last_error(), "f32[4,16]"));
    kiln_clear_error();
    assert_int_equal(kiln_graph_run(g, &x, 1, got, 1, &n), KILN_ERR_ARG); /* room for 1 of 2 outputs */
    kiln_clear_error();
    kiln_graph_free(g);
}

static int count_op(kiln_graph_t *g, const char *op);

/* Three dropouts of the same input (one never read) and a rand (scaled: an op whose
 * only input is the rand, which folding would compute once if it took the rand for a
 * constant): four draws. */
static kiln_status three_draws(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)ctx, (void)n_in;
    out[0] = kiln_dropout(in[0], 0.5, true);
    out[1] = kiln_dropout(in[0], 0.5, true);
    if (!kiln_dropout(in[0], 0.5, true)) return kiln_last_status(); /* drawn, never read */
    out[2] = kiln_mul_scalar(kiln_rand(kiln_tensor_shape(in[0]), kiln_tensor_ndim(in[0]), KILN_DTYPE_F32), 2.0);
    *n_out = 3;
    return out[0] && out[1] && out[2] ? KILN_OK : kiln_last_status();
}

static bool same_values(kiln_tensor_t *a, kiln_tensor_t *b)
{
    float *x = to_host(a), *y = to_host(b);
    bool same = !memcmp(x, y, sizeof(float) * (size_t)kiln_tensor_numel(a));
    free(x);
    free(y);
    return same;
}

/* Random ops in a graph draw when it runs. Oracle: the function called eagerly from the
 * same generator state (kiln_manual_seed), bitwise: capture draws nothing, each run
 * draws what the eager call would, a second run draws new numbers (the eager second
 * call's), folding leaves the rand alone (no inputs, yet no constant), CSE keeps the
 * dropouts of one input apart, and DCE keeps the one nothing reads (its draw comes
 * before the rand's). */
static void random_ops_draw_when_the_graph_runs(void **state)
{
    kiln_tensor_t *x = randn(4, 16, 4), *want[2][3], *got[2][3];
    int n;
    kiln_manual_seed(7);
    for (int r = 0; r < 2; r++) assert_int_equal(three_draws(NULL, &x, 1, want[r], &n), KILN_OK);
    kiln_graph_t *g;
    kiln_manual_seed(7);
    assert_int_equal(kiln_graph_capture(three_draws, NULL, &x, 1, &g), KILN_OK);
    int removed = -1, folded = -1;
    assert_int_equal(kiln_graph_fold(g, &folded), KILN_OK);
    assert_int_equal(folded, 0); /* rand has no inputs, but it is no constant: 2 rand stays */
    assert_int_equal(kiln_graph_cse(g, &removed), KILN_OK);
    assert_int_equal(kiln_graph_dce(g, &removed), KILN_OK);
    assert_int_equal(count_op(g, " dropout("), 3);
    assert_int_equal(count_op(g, " rand("), 1);
    for (int r = 0; r < 2; r++) {
        assert_int_equal(kiln_graph_run(g, &x, 1, got[r], 3, &n), KILN_OK);
        for (int i = 0; i < 3; i++) assert_close(got[r][i], want[r][i], 0);
    }
    assert_false(same_values(got[0][0], got[0][1]));
    assert_false(same_values(got[0][0], got[1][0]));
    assert_false(same_values(got[0][2], got[1][2]));
    kiln_graph_free(g);
}

typedef struct {
    kiln_tensor_t *b;
    bool update_between;
} cse_ctx;

/* exp(x) + b computed twice; with an in-place update of b between the two, the second
 * + b must not be merged with the first (exp(x) still is: the update does not write x). */
static kiln_status twice(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    cse_ctx *c = ctx;
    kiln_tensor_t *y1 = kiln_add(kiln_exp(in[0]), c->b);
    if (c->update_between && kiln_add_(c->b, in[0], 1.0) != KILN_OK) return kiln_last_status();
    kiln_tensor_t *y2 = kiln_add(kiln_exp(in[0]), c->b);
    out[0] = kiln_mul(y1, y2);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void repeated_ops_are_merged_but_not_across_updates(void **state)
{
    for (int upd = 0; upd < 2; upd++) {
        cse_ctx c = {randn(4, 16, 9), upd == 1};
        kiln_tensor_t *x = randn(4, 16, 4);
        kiln_graph_t *g;
        assert_int_equal(kiln_graph_capture(twice, &c, &x, 1, &g), KILN_OK);
        int before = kiln_graph_num_ops(g), merged = -1;
        assert_int_equal(kiln_graph_cse(g, &merged), KILN_OK);
        assert_int_equal(merged, upd ? 1 : 2); /* exp and add, once each; only exp across the update */
        assert_int_equal(kiln_graph_num_ops(g), before - merged);
        cse_ctx e = {kiln_contiguous(kiln_mul_scalar(c.b, 1.0)), upd == 1};
        kiln_tensor_t *got, *want;
        int n;
        assert_int_equal(kiln_graph_run(g, &x, 1, &got, 1, &n), KILN_OK);
        assert_int_equal(twice(&e, &x, 1, &want, &n), KILN_OK);
        assert_same(got, want);
        kiln_graph_free(g);
    }
}

/* The same op on the same input with other attributes: GELU's two forms, softmax over
 * either dim of a square, the sum over either dim (the same shape), and the input as
 * 512 rows of 8, 512 slices (ops that differ only in their start) added up. CSE finds
 * candidates through a hash of op, attributes and inputs: the pairs differ in the hash,
 * and the 512 slices fill enough of the table that lookups meet slices of other starts
 * on their way (about 30 times), where only the attributes tell them apart. */
static kiln_status same_inputs_other_attributes(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                                                int *n_out)
{
    (void)ctx, (void)n_in;
    int d0 = 0, d1 = 1;
    out[0] = kiln_sub(kiln_gelu(in[0], true), kiln_gelu(in[0], false));
    out[1] = kiln_sub(kiln_softmax(in[0], 0), kiln_softmax(in[0], 1));
    out[2] = kiln_sub(kiln_sum(in[0], &d0, 1, false), kiln_sum(in[0], &d1, 1, false));
    kiln_tensor_t *rows = kiln_reshape(in[0], (int64_t[]){512, 8}, 2);
    out[3] = kiln_narrow(rows, 0, 0, 1);
    for (int64_t r = 1; r < 512; r++) out[3] = kiln_add(out[3], kiln_narrow(rows, 0, r, 1));
    *n_out = 4;
    return out[0] && out[1] && out[2] && out[3] ? KILN_OK : kiln_last_status();
}

/* CSE merges an op only with one of the same attributes. Oracle: the function run
 * eagerly, bitwise; nothing to merge (each pair differs in an attribute). */
static void ops_with_other_attributes_are_not_merged(void **state)
{
    kiln_tensor_t *x = randn(64, 64, 5), *got[4], *want[4];
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(same_inputs_other_attributes, NULL, &x, 1, &g), KILN_OK);
    int merged = -1, n;
    assert_int_equal(kiln_graph_cse(g, &merged), KILN_OK);
    assert_int_equal(merged, 0);
    assert_int_equal(kiln_graph_run(g, &x, 1, got, 4, &n), KILN_OK);
    assert_int_equal(same_inputs_other_attributes(NULL, &x, 1, want, &n), KILN_OK);
    for (int i = 0; i < 4; i++) assert_same(got[i], want[i]);
    kiln_graph_free(g);
}

/* The passes treat arguments and captured tensors as separate memory around in-place
 * writes, so a run refuses an argument over the bytes of a captured tensor that the
 * graph updates (here b, given as x too), before anything runs: b is unchanged. */
static void an_input_over_an_updated_capture_is_refused(void **state)
{
    cse_ctx c = {randn(4, 16, 9), true};
    kiln_tensor_t *x = randn(4, 16, 4), *b0 = kiln_clone(c.b), *got;
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(twice, &c, &x, 1, &g), KILN_OK);
    int n;
    assert_int_equal(kiln_graph_run(g, &c.b, 1, &got, 1, &n), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "input 0 shares memory with captured tensor"));
    kiln_clear_error();
    assert_same(c.b, b0);
    assert_int_equal(kiln_graph_run(g, &x, 1, &got, 1, &n), KILN_OK);
    kiln_graph_free(g);
}

typedef struct {
    kiln_tensor_t *a, *b, *other;
} cse2_ctx;

/* exp(a) + b twice (captured tensors) with an update of an unrelated captured tensor
 * between them, and a zero tensor made twice with the first one updated in place in
 * between. */
static kiln_status twice_around_updates(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    cse2_ctx *c = ctx;
    kiln_tensor_t *y1 = kiln_add(kiln_exp(c->a), c->b);
    if (kiln_fill_(c->other, 2.0) != KILN_OK) return kiln_last_status();
    kiln_tensor_t *y2 = kiln_add(kiln_exp(c->a), c->b);
    kiln_tensor_t *z1 = kiln_zeros((int64_t[]){4, 16}, 2, KILN_DTYPE_F32);
    if (!z1 || kiln_add_(z1, in[0], 1.0) != KILN_OK) return kiln_last_status();
    kiln_tensor_t *z2 = kiln_zeros((int64_t[]){4, 16}, 2, KILN_DTYPE_F32);
    out[0] = kiln_add(kiln_mul(y1, y2), kiln_sub(z1, z2));
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

/* Oracle for the merge counts: which values the updates between them write. An update
 * of another tensor does not stop a merge; an update of a result does stop its twin
 * (made after it) from taking its place. */
static void merges_look_at_what_updates_write(void **state)
{
    cse2_ctx c = {randn(4, 16, 1), randn(4, 16, 2), randn(4, 16, 3)};
    kiln_tensor_t *x = randn(4, 16, 4);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(twice_around_updates, &c, &x, 1, &g), KILN_OK);
    int merged = -1;
    assert_int_equal(kiln_graph_cse(g, &merged), KILN_OK);
    assert_int_equal(merged, 2); /* exp(a) and + b; the second zeros stays */
    cse2_ctx e = {c.a, c.b, kiln_clone(c.other)};
    kiln_tensor_t *got, *want;
    int n;
    assert_int_equal(kiln_graph_run(g, &x, 1, &got, 1, &n), KILN_OK);
    assert_int_equal(twice_around_updates(&e, &x, 1, &want, &n), KILN_OK);
    assert_same(got, want);
    assert_same(c.other, e.other);
    kiln_graph_free(g);
}

/* y = (x w) * scale; backward of sum(y) where grad mode is on and w wants a gradient. */
typedef struct {
    kiln_tensor_t *w;
    double scale;
} scaled_ctx;

static kiln_status scaled(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    scaled_ctx *c = ctx;
    kiln_tensor_t *y = kiln_mul_scalar(kiln_matmul(in[0], c->w), c->scale);
    out[0] = y;
    *n_out = 1;
    if (!y) return kiln_last_status();
    return kiln_tensor_requires_grad(y) ? kiln_backward(kiln_sum(y, NULL, 0, false)) : KILN_OK;
}

/* Runs scaled compiled and eagerly on x: the results, and w's gradients (or their
 * absence), agree within 1e-5. */
static void check_scaled(kiln_compiled_t *fnc, scaled_ctx *c, kiln_tensor_t *x)
{
    kiln_tensor_t *got[1], *want[1];
    int n;
    kiln_tensor_zero_grad(c->w);
    if (kiln_compiled_call(fnc, &x, 1, got, 1, &n) != KILN_OK) fail_msg("compiled: %s", kiln_last_error());
    kiln_tensor_t *gg = kiln_tensor_grad(c->w) ? kiln_clone(kiln_tensor_grad(c->w)) : NULL;
    kiln_tensor_zero_grad(c->w);
    assert_int_equal(scaled(c, &x, 1, want, &n), KILN_OK);
    assert_close(got[0], want[0], 1e-5);
    kiln_tensor_t *gw = kiln_tensor_grad(c->w);
    assert_int_equal(gg != NULL, gw != NULL);
    if (gg) assert_close(gg, gw, 1e-5);
    kiln_tensor_zero_grad(c->w);
}

/* The guards past shapes: a declared attribute, grad mode and whether a captured tensor
 * requires gradients each capture again when they change (the log names the guard, old
 * -> new), and each graph then gives eager's results and gradients. An input that
 * requires gradients is an error (the graph would give it none), and so is declaring an
 * attribute after the first call. */
static void guards_on_attributes_grad_mode_and_requires_grad(void **state)
{
    test_setenv("KILN_LOGS", "recompiles", 1);
    scaled_ctx c = {kiln_keep(randn(16, 8, 1)), 2.0};
    kiln_tensor_set_requires_grad(c.w, true);
    kiln_compiled_t *fnc;
    assert_int_equal(kiln_compiled_new(scaled, &c, "scaled", &fnc), KILN_OK);
    assert_int_equal(kiln_compiled_guard(fnc, "scale", &c.scale, sizeof c.scale), KILN_OK);
    kiln_tensor_t *x = randn(4, 16, 2);
    test_stderr cap;
    assert_true(test_stderr_begin(&cap));
    check_scaled(fnc, &c, x); /* graph 0 */
    check_scaled(fnc, &c, x); /* reused */
    c.scale = 3.0;
    check_scaled(fnc, &c, x); /* graph 1 */
    bool prev = kiln_set_grad_enabled(false);
    check_scaled(fnc, &c, x); /* graph 2: no backward */
    kiln_set_grad_enabled(prev);
    kiln_tensor_set_requires_grad(c.w, false);
    check_scaled(fnc, &c, x); /* graph 3: w frozen */
    char buf[2048];
    test_stderr_end(&cap, buf, sizeof buf);
    test_unsetenv("KILN_LOGS");
    uint64_t calls, hits, recompiles;
    int graphs;
    kiln_compiled_stats(fnc, &calls, &hits, &recompiles, &graphs);
    assert_int_equal(graphs, 4);
    assert_int_equal(hits, 1);
    if (!strstr(buf, "attribute scale changed: 2 -> 3") || !strstr(buf, "grad mode changed: on -> off") ||
        !strstr(buf, "captured tensor 0 (f32[16,8]) requires_grad changed: true -> false"))
        fail_msg("recompiles log:\n%s", buf);
    kiln_tensor_t *xg = kiln_contiguous(kiln_detach(x)), *got[1];
    kiln_tensor_set_requires_grad(xg, true);
    int n;
    kiln_status s = kiln_compiled_call(fnc, &xg, 1, got, 1, &n);
    if (s != KILN_ERR_UNSUPPORTED || !strstr(kiln_last_error(), "input 0 requires gradients"))
        fail_msg("an input that requires gradients: status %d, %s", s, kiln_last_error());
    s = kiln_compiled_guard(fnc, "late", &c.scale, sizeof c.scale);
    if (s != KILN_ERR_ARG || !strstr(kiln_last_error(), "before the first call"))
        fail_msg("a guard declared after a call: status %d, %s", s, kiln_last_error());
    kiln_clear_error();
    kiln_compiled_free(fnc);
    kiln_tensor_free(c.w);
}

/* Guards: the same shape reuses its graph, a new one captures again (and the log says
 * which guard failed, old -> new), and past the limit calls run eagerly with one
 * warning; every result equals the eager function's. */
static void guards_reuse_recompile_and_fall_back(void **state)
{
    test_setenv("KILN_LOGS", "recompiles", 1);
    test_setenv("KILN_RECOMPILE_LIMIT", "2", 1);
    char dbg[] = "/tmp/kiln-graph-test-XXXXXX";
    assert_non_null(mkdtemp(dbg));
    test_setenv("KILN_DEBUG_DIR", dbg, 1);
    mlp_ctx c = {randn(16, 32, 1), randn(1, 32, 2), randn(32, 8, 3), false, false, false};
    kiln_compiled_t *fnc;
    assert_int_equal(kiln_compiled_new(mlp, &c, "mlp", &fnc), KILN_OK);
    kiln_tensor_t *xs[4] = {randn(4, 16, 4), randn(4, 16, 5), randn(5, 16, 6), randn(6, 16, 7)};
    test_stderr cap;
    assert_true(test_stderr_begin(&cap));
    for (int i = 0; i < 4; i++) {
        kiln_tensor_t *got[2], *want[2];
        int n;
        assert_int_equal(kiln_compiled_call(fnc, &xs[i], 1, got, 2, &n), KILN_OK);
        assert_int_equal(mlp(&c, &xs[i], 1, want, &n), KILN_OK);
        assert_close(got[0], want[0], 1e-5); /* compiled: generated kernels, not bitwise */
    }
    char buf[2048];
    test_stderr_end(&cap, buf, sizeof buf);
    uint64_t calls, hits, recompiles;
    int graphs;
    kiln_compiled_stats(fnc, &calls, &hits, &recompiles, &graphs);
    assert_int_equal(calls, 4);
    assert_int_equal(hits, 1);       /* the second f32[4,16] call */
    assert_int_equal(recompiles, 1); /* f32[5,16] */
    assert_int_equal(graphs, 2);     /* f32[6,16] ran eagerly */
    assert_non_null(strstr(buf, "input 0 shape changed: f32[4,16] -> f32[5,16]"));
    assert_non_null(strstr(buf, "now run eagerly"));
    /* KILN_DEBUG_DIR: a folder per graph, with the graph before and after its passes. */
    char path[256], text[2048] = "";
    snprintf(path, sizeof path, "%s/mlp-1/after_passes.txt", dbg);
    assert_true(test_read_text(path, text, sizeof text));
    assert_non_null(strstr(text, "gelu("));
    snprintf(path, sizeof path, "%s/mlp-1/guards.txt", dbg);
    assert_true(test_read_text(path, text, sizeof text));
    assert_non_null(strstr(text, "input 0 is f32[5,16]"));
    snprintf(path, sizeof path, "%s/mlp-0/captured.txt", dbg);
    assert_int_equal(access(path, R_OK), 0);
    char cmd[300]; /* leave nothing behind */
    snprintf(cmd, sizeof cmd, "rm -rf %s", dbg);
    assert_int_equal(system(cmd), 0);
    test_unsetenv("KILN_DEBUG_DIR");
    kiln_compiled_free(fnc);
    test_unsetenv("KILN_LOGS");
    test_unsetenv("KILN_RECOMPILE_LIMIT");
}

typedef struct {
    kiln_gpt_t *m;
} gpt_ctx;

static kiln_status gpt_logits(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    gpt_ctx *c = ctx;
    out[0] = kiln_gpt_forward(c->m, in[0], NULL, false, NULL);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static kiln_gpt_config tiny(bool llama)
{
    kiln_gpt_config cfg = llama ? kiln_gpt_config_llama() : kiln_gpt_config_gpt2();
    cfg.n_layer = 2;
    cfg.n_head = 4;
    cfg.n_kv_head = llama ? 2 : 4;
    cfg.n_embd = 32;
    cfg.block_size = 16;
    cfg.vocab_size = 50;
    return cfg;
}

/* The model code, unchanged, captured: GPT-2 and LLaMA style forwards. */
static void gpt_forward_captures(bool llama)
{
    kiln_gpt_config cfg = tiny(llama);
    gpt_ctx c;
    assert_int_equal(kiln_gpt_new(&cfg, 11, &c.m), KILN_OK);
    int64_t ids[2][12], s[2] = {2, 12};
    for (int i = 0; i < 24; i++) ids[i / 12][i % 12] = (i * 7 + 3) % 50;
    kiln_tensor_t *x = kiln_from_data(ids, s, 2, KILN_DTYPE_I64);
    for (int i = 0; i < 24; i++) ids[i / 12][i % 12] = (i * 5 + 1) % 50;
    kiln_tensor_t *x2 = kiln_from_data(ids, s, 2, KILN_DTYPE_I64);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(gpt_logits, &c, &x, 1, &g), KILN_OK);
    assert_true(kiln_graph_num_ops(g) > 20);
    kiln_tensor_t *got, *want;
    int n;
    assert_int_equal(kiln_graph_run(g, &x2, 1, &got, 1, &n), KILN_OK);
    assert_int_equal(gpt_logits(&c, &x2, 1, &want, &n), KILN_OK);
    assert_same(got, want);
    kiln_graph_free(g);
    kiln_gpt_free(c.m);
}

/* Oracle: eager forward + backward from zeroed gradients; the graph's run must leave
 * bitwise the same loss and the same gradient in every parameter, and must not touch
 * the gradients while capturing. */
static void backward_is_captured_into_the_graph(void **state)
{
    kiln_gpt_config cfg = tiny(false);
    gpt_ctx c;
    assert_int_equal(kiln_gpt_new(&cfg, 5, &c.m), KILN_OK);
    int64_t ids[2][13], s[2] = {2, 12};
    for (int i = 0; i < 26; i++) ids[i / 13][i % 13] = (i * 7 + 3) % 50;
    int64_t xi[2][12], yi[2][12];
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 12; t++) xi[b][t] = ids[b][t], yi[b][t] = ids[b][t + 1];
    kiln_tensor_t *xy[2] = {kiln_from_data(xi, s, 2, KILN_DTYPE_I64), kiln_from_data(yi, s, 2, KILN_DTYPE_I64)};
    int np = kiln_gpt_num_params(c.m);
    kiln_graph_t *g;
    kiln_status st = kiln_graph_capture(kiln_gpt_loss_backward, c.m, xy, 2, &g);
    if (st != KILN_OK) fail_msg("capture: %s", kiln_last_error());
    for (int i = 0; i < np; i++) assert_null(kiln_tensor_grad(kiln_gpt_param(c.m, i, NULL)));
    kiln_tensor_t *want_loss = NULL;
    int n;
    assert_int_equal(kiln_gpt_loss_backward(c.m, xy, 2, &want_loss, &n), KILN_OK);
    float **want = malloc(sizeof *want * (size_t)np);
    for (int i = 0; i < np; i++) {
        kiln_tensor_t *p = kiln_gpt_param(c.m, i, NULL);
        want[i] = to_host(kiln_tensor_grad(p));
        kiln_tensor_zero_grad(p);
    }
    kiln_tensor_t *got_loss = NULL;
    assert_int_equal(kiln_graph_run(g, xy, 2, &got_loss, 1, &n), KILN_OK);
    assert_same(got_loss, want_loss);
    for (int i = 0; i < np; i++) {
        const char *name;
        kiln_tensor_t *p = kiln_gpt_param(c.m, i, &name);
        kiln_tensor_t *gr = kiln_tensor_grad(p);
        if (!gr) fail_msg("no gradient for %s after the run", name);
        float *got = to_host(gr);
        if (memcmp(got, want[i], sizeof(float) * (size_t)kiln_tensor_numel(p)))
            fail_msg("the gradient of %s differs from eager backward", name);
        free(got);
        free(want[i]);
    }
    free(want);
    kiln_graph_free(g);
    kiln_gpt_free(c.m);
}

typedef struct {
    kiln_gpt_t *m;
    kiln_optim_t *opt;
} old_step_ctx;

/* A step written with the number-taking optimizer call: cannot be captured. */
static kiln_status step_with_number_lr(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    old_step_ctx *c = ctx;
    kiln_status s = kiln_gpt_loss_backward(c->m, in, 2, out, n_out);
    return s == KILN_OK ? kiln_optim_step(c->opt, 1e-3) : s;
}

/* Oracle: the same kiln_gpt_train_step run eagerly on a twin model (same seed). The
 * whole step (forward, backward, clipping, AdamW) captured once and run three times,
 * each with its own learning rate, leaves bitwise the eager losses, norms, weights
 * and step count, and no gradient in any parameter. */
static void whole_training_step_is_one_graph(void **state)
{
    kiln_gpt_config cfg = tiny(true);
    test_trainer t[2];
    for (int k = 0; k < 2; k++) test_trainer_new(&t[k], &cfg, 9, 0.5);
    kiln_gpt_t *m[2] = {t[0].m, t[1].m};
    kiln_optim_t *opt[2] = {t[0].opt, t[1].opt};
    kiln_tensor_t **ps[2] = {t[0].ps, t[1].ps};
    kiln_gpt_step st[2] = {t[0].step, t[1].step};
    int np = t[0].np;
    int64_t xi[2][12], yi[2][12], s2[2] = {2, 12}, one = 1;
    for (int i = 0; i < 24; i++) xi[i / 12][i % 12] = (i * 7 + 3) % 50, yi[i / 12][i % 12] = (i * 5 + 2) % 50;
    double lr0 = 1e-2;
    kiln_tensor_t *in[3] = {kiln_from_data(xi, s2, 2, KILN_DTYPE_I64), kiln_from_data(yi, s2, 2, KILN_DTYPE_I64),
                            kiln_from_data(&lr0, &one, 1, KILN_DTYPE_F64)};
    kiln_graph_t *g;
    kiln_status s = kiln_graph_capture(kiln_gpt_train_step, &st[1], in, 3, &g);
    if (s != KILN_OK) fail_msg("capture: %s", kiln_last_error());
    assert_int_equal(kiln_optim_steps(opt[1]), 0); /* capturing takes no step */
    for (int it = 0; it < 3; it++) {
        double lr = 1e-2 / (it + 1);
        kiln_tensor_t *args[3] = {in[0], in[1], kiln_from_data(&lr, &one, 1, KILN_DTYPE_F64)};
        kiln_tensor_t *want[2], *got[2];
        int n;
        assert_int_equal(kiln_gpt_train_step(&st[0], args, 3, want, &n), KILN_OK);
        assert_int_equal(kiln_graph_run(g, args, 3, got, 2, &n), KILN_OK);
        assert_int_equal(n, 2);
        assert_same(got[0], want[0]);
        double gn, wn; /* the norms, f64 */
        assert_int_equal(kiln_tensor_item(got[1], &gn), KILN_OK);
        assert_int_equal(kiln_tensor_item(want[1], &wn), KILN_OK);
        assert_true(gn == wn && wn > 0.5); /* and clipping took part */
    }
    assert_int_equal(kiln_optim_steps(opt[1]), 3);
    for (int i = 0; i < np; i++) {
        assert_same(ps[1][i], ps[0][i]);
        assert_null(kiln_tensor_grad(ps[1][i]));
    }
    /* A gradient left in a parameter before a run: the graph cannot add to it. */
    kiln_tensor_t *loss;
    int n;
    assert_int_equal(kiln_gpt_loss_backward(m[1], in, 2, &loss, &n), KILN_OK);
    kiln_tensor_t *got[2];
    assert_int_equal(kiln_graph_run(g, in, 3, got, 2, &n), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "zero the gradients"));
    kiln_clear_error();
    kiln_graph_free(g);
    /* The same when capturing, and a learning rate given as a number. */
    kiln_graph_t *g2 = (kiln_graph_t *)1;
    assert_int_equal(kiln_graph_capture(kiln_gpt_train_step, &st[1], in, 3, &g2), KILN_ERR_UNSUPPORTED);
    assert_null(g2);
    assert_non_null(strstr(kiln_last_error(), "already held one"));
    kiln_clear_error();
    kiln_optim_zero_grad(opt[1]);
    old_step_ctx oc = {m[1], opt[1]};
    assert_int_equal(kiln_graph_capture(step_with_number_lr, &oc, in, 2, &g2), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "kiln_optim_step_t"));
    kiln_clear_error();
    assert_int_equal(kiln_optim_steps(opt[1]), 3);
    for (int k = 0; k < 2; k++) test_trainer_free(&t[k]);
}

/* Counts "op(" in the printed graph. */
/* g's listing (kiln_graph_print), malloc'd. */
static char *listing(kiln_graph_t *g)
{
    size_t cap = 1 << 20;
    char *buf = calloc(cap, 1);
    FILE *f = fmemopen(buf, cap - 1, "w");
    assert_int_equal(kiln_graph_print(g, f), KILN_OK);
    fclose(f);
    return buf;
}

static int count_op(kiln_graph_t *g, const char *op)
{
    char *buf = listing(g);
    int n = 0;
    for (const char *p = buf; (p = strstr(p, op)); p++) n++;
    free(buf);
    return n;
}

/* Saved or recomputed. Oracle: the same step run eagerly on a twin model. After the
 * pass a GELU output read by the forward matmul and again far later by the
 * weight-gradient matmul is computed a second time for that late read (one more gelu in
 * the graph); a run of the recomputed graph gives bitwise the eager losses
 * and weights (the copy is the same kernel on the same values). */
static void recomputed_activations_match_eager(void **state)
{
    kiln_gpt_config cfg = tiny(false);
    test_trainer t[2];
    for (int k = 0; k < 2; k++) test_trainer_new(&t[k], &cfg, 9, 0.5);
    int64_t xi[2][12], yi[2][12], s2[2] = {2, 12}, one = 1;
    for (int i = 0; i < 24; i++) xi[i / 12][i % 12] = (i * 7 + 3) % 50, yi[i / 12][i % 12] = (i * 5 + 2) % 50;
    double lr0 = 1e-2;
    kiln_tensor_t *in[3] = {kiln_from_data(xi, s2, 2, KILN_DTYPE_I64), kiln_from_data(yi, s2, 2, KILN_DTYPE_I64),
                            kiln_from_data(&lr0, &one, 1, KILN_DTYPE_F64)};
    kiln_graph_t *g;
    kiln_status s = kiln_graph_capture(kiln_gpt_train_step, &t[1].step, in, 3, &g);
    if (s != KILN_OK) fail_msg("capture: %s", kiln_last_error());
    int gelus = count_op(g, " gelu("), recomputed = -1;
    assert_int_equal(gelus, cfg.n_layer);
    assert_int_equal(kiln_graph_recompute(g, &recomputed), KILN_OK);
    assert_true(recomputed >= 1);
    /* The first layer's at least: the last one's backward follows its forward closely. */
    assert_true(count_op(g, " gelu(") > gelus);
    for (int it = 0; it < 3; it++) {
        double lr = 1e-2 / (it + 1);
        kiln_tensor_t *args[3] = {in[0], in[1], kiln_from_data(&lr, &one, 1, KILN_DTYPE_F64)};
        kiln_tensor_t *want[2], *got[2];
        int n;
        assert_int_equal(kiln_gpt_train_step(&t[0].step, args, 3, want, &n), KILN_OK);
        assert_int_equal(kiln_graph_run(g, args, 3, got, 2, &n), KILN_OK);
        assert_same(got[0], want[0]);
    }
    for (int i = 0; i < t[0].np; i++) assert_same(t[1].ps[i], t[0].ps[i]);
    kiln_graph_free(g);
    for (int k = 0; k < 2; k++) test_trainer_free(&t[k]);
}

/* A leaf read through three slices of its last dim (q | k | v), each slice's gradient
 * its own formula: ctx holds the leaf and the slices' bounds. */
typedef struct {
    kiln_tensor_t *x;
    int64_t lo[3], hi[3];
    bool read_fill; /* also return the first slice's gradient scatter (see below) */
} slices_ctx;

static kiln_status three_slices(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)in, (void)n_in;
    slices_ctx *c = ctx;
    kiln_tensor_t *q = kiln_slice(c->x, 1, c->lo[0], c->hi[0], 1), *k = kiln_slice(c->x, 1, c->lo[1], c->hi[1], 1);
    kiln_tensor_t *v = kiln_slice(c->x, 1, c->lo[2], c->hi[2], 1);
    kiln_tensor_t *loss = kiln_add(kiln_add(kiln_sum(kiln_mul_scalar(q, 2.0), NULL, 0, false),
                                            kiln_sum(kiln_exp(k), NULL, 0, false)),
                                   kiln_sum(kiln_mul(v, v), NULL, 0, false));
    out[0] = loss;
    *n_out = 1;
    return loss ? kiln_backward(loss) : kiln_last_status();
}

/* Oracle: eager backward on the same leaf. Disjoint slices: the gradient's three zero
 * fills and two adds become one fill with three copies into it, and the gradient is
 * eager's (0 + g is g; tolerance 0, compared as numbers). With k overlapping q, the
 * gradients of q and v (disjoint) still merge, but k's must not (a sum over the overlap
 * is not a copy), and the gradient is still eager's. */
static void slice_scatters_merge_only_when_disjoint(void **state)
{
    for (int overlap = 0; overlap < 2; overlap++) {
        slices_ctx c = {randn(4, 12, 11), {0, 4, 8}, {4, 8, 12}, false};
        if (overlap) c.lo[1] = 2; /* k = x[:, 2:8] overlaps q */
        kiln_tensor_set_requires_grad(c.x, true);
        kiln_tensor_t *want_loss;
        int n;
        assert_int_equal(three_slices(&c, NULL, 0, &want_loss, &n), KILN_OK);
        kiln_tensor_t *want = kiln_clone(kiln_tensor_grad(c.x));
        kiln_tensor_zero_grad(c.x);
        kiln_graph_t *g;
        kiln_status st = kiln_graph_capture(three_slices, &c, NULL, 0, &g);
        if (st != KILN_OK) fail_msg("capture: %s", kiln_last_error());
        assert_int_equal(count_op(g, " full(") >= 3, true);
        int fills = count_op(g, " full("), merged = -1, removed;
        assert_int_equal(kiln_graph_merge_slices(g, &merged), KILN_OK);
        assert_int_equal(kiln_graph_dce(g, &removed), KILN_OK);
        assert_int_equal(merged, overlap ? 1 : 2);
        assert_int_equal(count_op(g, " full("), overlap ? fills - 1 : fills - 2);
        kiln_tensor_t *got_loss;
        assert_int_equal(kiln_graph_run(g, NULL, 0, &got_loss, 1, &n), KILN_OK);
        assert_close(got_loss, want_loss, 0);
        assert_close(kiln_tensor_grad(c.x), want, 0);
        kiln_graph_free(g);
    }
}

/* Six allreduces in a row on one group: a = 2x, t = (3x)^T (a view whose base is
 * returned), b = exp(x), the argument y itself, and two overlapping views v1, v2 (rows
 * 0-3 and 2-5) of a captured tensor c; then a, t, y and v1 are updated in place (t's
 * update must reach its base, y's the caller's buffer, v1's the captured c). */
typedef struct {
    kiln_pg_t *pg;
    kiln_tensor_t *c;
} ar_ctx;

static kiln_status six_allreduces(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    ar_ctx *c = ctx;
    kiln_tensor_t *a = kiln_mul_scalar(in[0], 2.0), *base = kiln_mul_scalar(in[0], 3.0), *b = kiln_exp(in[0]);
    kiln_tensor_t *t = kiln_transpose(base, 0, 1), *v1 = kiln_narrow(c->c, 0, 0, 4), *v2 = kiln_narrow(c->c, 0, 2, 4);
    kiln_tensor_t *ts[6] = {a, t, b, in[1], v1, v2};
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < 6; i++) s = kiln_pg_allreduce(c->pg, ts[i], KILN_REDUCE_AVG);
    if (s == KILN_OK) s = kiln_mul_scalar_(a, 0.5);
    if (s == KILN_OK) s = kiln_mul_scalar_(t, 5.0);
    if (s == KILN_OK) s = kiln_add_(in[1], b, 1.0);
    if (s == KILN_OK) s = kiln_mul_scalar_(v1, 2.0);
    if (s != KILN_OK) return s;
    out[0] = kiln_add(kiln_mul(a, b), kiln_transpose(t, 0, 1));
    out[1] = base;
    out[2] = kiln_mul(in[1], b);
    *n_out = 3;
    return out[0] && out[2] ? KILN_OK : kiln_last_status();
}

/* Oracle: the function run eagerly on a group of one, whose allreduce leaves the data as
 * it is, so that every value read after the coalesced allreduces (from the flat
 * buffer's ranges, or copied back), the base of t, the caller's y and the captured c
 * must be eager's bitwise (tolerance 0). With a bucket that holds them all, a to v1 (128
 * bytes each, v1 64) become one allreduce and v2, which overlaps v1, stays its own; with
 * 256 bytes, a|t and b|y merge; with 64, nothing does. The group counts one collective
 * per bucket; copies back go only into t, y and v1 (the buffer's ranges are read for a
 * and b). */
static void allreduces_coalesce_into_buckets(void **state)
{
    test_unsetenv("KILN_WORLD_SIZE");
    ar_ctx c = {NULL, randn(8, 4, 23)};
    assert_int_equal(kiln_pg_new_from_env(&c.pg), KILN_OK);
    kiln_tensor_t *x = randn(8, 4, 21), *y = randn(8, 4, 22), *y_eager = kiln_clone(y), *c0 = kiln_clone(c.c);
    kiln_tensor_t *want[3], *in[2] = {x, y_eager};
    int n;
    assert_int_equal(six_allreduces(&c, in, 2, want, &n), KILN_OK);
    kiln_tensor_t *c_eager = kiln_clone(c.c);
    struct {
        int64_t bucket;
        int merged, collectives, copies;
    } cases[] = {{1 << 20, 4, 2, 3}, {256, 2, 4, 2}, {64, 0, 6, 0}};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(kiln_tensor_copy_(c.c, c0), KILN_OK);
        kiln_graph_t *g;
        kiln_tensor_t *ex[2] = {x, y};
        kiln_status st = kiln_graph_capture(six_allreduces, &c, ex, 2, &g);
        if (st != KILN_OK) fail_msg("capture: %s", kiln_last_error());
        assert_int_equal(count_op(g, "allreduce_("), 6);
        int merged = -1;
        assert_int_equal(kiln_graph_coalesce_allreduce(g, cases[k].bucket, &merged), KILN_OK);
        assert_int_equal(merged, cases[k].merged);
        assert_int_equal(count_op(g, "allreduce_("), cases[k].collectives);
        assert_int_equal(count_op(g, "copy_("), cases[k].copies);
        kiln_tensor_t *y2 = kiln_clone(y), *args[2] = {x, y2}, *got[3];
        uint64_t seq = kiln_pg_seq(c.pg);
        assert_int_equal(kiln_graph_run(g, args, 2, got, 3, &n), KILN_OK);
        assert_int_equal(n, 3);
        assert_int_equal(kiln_pg_seq(c.pg) - seq, (uint64_t)cases[k].collectives);
        for (int i = 0; i < 3; i++) assert_close(got[i], want[i], 0);
        assert_close(y2, y_eager, 0);
        assert_close(c.c, c_eager, 0);
        kiln_graph_free(g);
    }
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(six_allreduces, &c, (kiln_tensor_t *[]){x, y}, 2, &g), KILN_OK);
    assert_int_equal(kiln_graph_coalesce_allreduce(g, 0, NULL), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "bucket"));
    kiln_graph_free(g);
    kiln_pg_free(c.pg);
}

/* Two siblings over x on either side of a matmul, and two over a captured c on either
 * side of an in-place update of c. */
typedef struct {
    kiln_tensor_t *w, *c;
} hoist_ctx;

static kiln_status siblings(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    hoist_ctx *h = ctx;
    kiln_tensor_t *a = kiln_exp(in[0]), *m = kiln_matmul(in[0], h->w), *b = kiln_tanh(in[0]);
    kiln_tensor_t *e = kiln_exp(h->c);
    kiln_status s = kiln_mul_scalar_(h->c, 2.0);
    kiln_tensor_t *t = kiln_tanh(h->c);
    out[0] = kiln_add(a, b);
    out[1] = m;
    out[2] = kiln_add(e, t);
    *n_out = 3;
    return s != KILN_OK ? s : out[0] && out[2] ? KILN_OK : kiln_last_status();
}

/* Position of the first line of g's listing that contains what (-1: none). */
static int line_of(kiln_graph_t *g, const char *what)
{
    char *buf = listing(g);
    int line = -1, k = 0;
    for (char *p = buf, *e; *p && line < 0; p = e + 1, k++) {
        e = strchr(p, '\n');
        if (!e) break;
        *e = 0;
        if (strstr(p, what)) line = k;
    }
    free(buf);
    return line;
}

/* Hoisting: the tanh of x moves up past the matmul to its sibling exp (they then share a
 * kernel), the tanh of c does not move past the update of c. Oracle: eager, bitwise (the
 * same ops on the same values), c included. */
static void siblings_hoist_but_not_past_writes(void **state)
{
    hoist_ctx h = {randn(16, 8, 31), randn(4, 16, 32)};
    kiln_tensor_t *x = randn(4, 16, 33), *c0 = kiln_clone(h.c), *want[3], *got[3];
    int n;
    assert_int_equal(siblings(&h, &x, 1, want, &n), KILN_OK);
    kiln_tensor_t *c_eager = kiln_clone(h.c);
    assert_int_equal(kiln_tensor_copy_(h.c, c0), KILN_OK);
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(siblings, &h, &x, 1, &g), KILN_OK);
    assert_true(line_of(g, " tanh(%1)") > line_of(g, " matmul("));
    int moved = -1;
    assert_int_equal(kiln_graph_hoist_siblings(g, &moved), KILN_OK);
    assert_int_equal(moved, 1); /* not the tanh of c, which would read c before its update */
    assert_true(line_of(g, " tanh(%1)") < line_of(g, " matmul("));
    assert_true(line_of(g, " tanh(%1)") == line_of(g, " exp(%1)") + 1);
    assert_int_equal(kiln_graph_run(g, &x, 1, got, 3, &n), KILN_OK);
    for (int i = 0; i < 3; i++) assert_close(got[i], want[i], 0);
    assert_close(h.c, c_eager, 0);
    kiln_graph_free(g);
}

static void gpt2_forward_captures(void **state) { gpt_forward_captures(false); }
static void llama_forward_captures(void **state) { gpt_forward_captures(true); }

/* kiln_detach inside a captured function: the alias stands for the same value of the
 * graph (it used to lose it and fail as "belongs to another graph's capture"). Oracle:
 * the same function run eagerly, bitwise. */
static kiln_status detached_square(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    out[0] = kiln_mul(kiln_detach(in[0]), in[0]);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void detach_inside_a_capture_keeps_the_value(void **state)
{
    kiln_tensor_t *x = randn(3, 5, 11), *got[1], *want[1];
    kiln_graph_t *g = NULL;
    int n = 0;
    assert_int_equal(kiln_graph_capture(detached_square, NULL, &x, 1, &g), KILN_OK);
    assert_int_equal(kiln_graph_run(g, &x, 1, got, 1, &n), KILN_OK);
    assert_int_equal(detached_square(NULL, &x, 1, want, &n), KILN_OK);
    assert_same(got[0], want[0]);
    kiln_graph_free(g);
}

/* A function that suspends its capture or recording and returns without resuming it
 * gets a clear error, and a later capture on the thread works as usual (no suspension
 * left behind that a stray resume could bring back). */
static kiln_status suspends_and_leaves(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    out[0] = kiln_mul(in[0], in[0]);
    (void)kiln_graph_suspend();
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void a_suspension_left_open_is_an_error(void **state)
{
    kiln_tensor_t *x = randn(2, 3, 12), *got[1], *want[1];
    kiln_graph_t *g = (kiln_graph_t *)1;
    assert_int_equal(kiln_graph_capture(suspends_and_leaves, NULL, &x, 1, &g), KILN_ERR_ARG);
    assert_null(g);
    assert_non_null(strstr(kiln_last_error(), "without resuming"));
    kiln_clear_error();
    kiln_replay_t *r = (kiln_replay_t *)1;
    int n = 0;
    assert_int_equal(kiln_replay_record(suspends_and_leaves, NULL, &x, 1, &r, got, 1, &n), KILN_ERR_ARG);
    assert_null(r);
    assert_non_null(strstr(kiln_last_error(), "without resuming"));
    kiln_clear_error();
    assert_int_equal(kiln_graph_capture(detached_square, NULL, &x, 1, &g), KILN_OK);
    assert_int_equal(kiln_graph_run(g, &x, 1, got, 1, &n), KILN_OK);
    assert_int_equal(detached_square(NULL, &x, 1, want, &n), KILN_OK);
    assert_same(got[0], want[0]);
    kiln_graph_free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(detach_inside_a_capture_keeps_the_value, setup, teardown),
        cmocka_unit_test_setup_teardown(a_suspension_left_open_is_an_error, setup, teardown),
        cmocka_unit_test_setup_teardown(capture_then_run_matches_eager, setup, teardown),
        cmocka_unit_test_setup_teardown(capture_records_and_computes_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(dead_code_is_removed, setup, teardown),
        cmocka_unit_test_setup_teardown(constants_fold_and_updated_values_do_not, setup, teardown),
        cmocka_unit_test_setup_teardown(folds_in_a_row_keep_their_sources, setup, teardown),
        cmocka_unit_test_setup_teardown(ops_with_other_attributes_are_not_merged, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_uses_are_clear_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(merges_look_at_what_updates_write, setup, teardown),
        cmocka_unit_test_setup_teardown(an_input_over_an_updated_capture_is_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(repeated_ops_are_merged_but_not_across_updates, setup, teardown),
        cmocka_unit_test_setup_teardown(guards_reuse_recompile_and_fall_back, setup, teardown),
        cmocka_unit_test_setup_teardown(guards_on_attributes_grad_mode_and_requires_grad, setup, teardown),
        cmocka_unit_test_setup_teardown(gpt2_forward_captures, setup, teardown),
        cmocka_unit_test_setup_teardown(backward_is_captured_into_the_graph, setup, teardown),
        cmocka_unit_test_setup_teardown(llama_forward_captures, setup, teardown),
        cmocka_unit_test_setup_teardown(whole_training_step_is_one_graph, setup, teardown),
        cmocka_unit_test_setup_teardown(recomputed_activations_match_eager, setup, teardown),
        cmocka_unit_test_setup_teardown(slice_scatters_merge_only_when_disjoint, setup, teardown),
        cmocka_unit_test_setup_teardown(allreduces_coalesce_into_buckets, setup, teardown),
        cmocka_unit_test_setup_teardown(random_ops_draw_when_the_graph_runs, setup, teardown),
        cmocka_unit_test_setup_teardown(siblings_hoist_but_not_past_writes, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
