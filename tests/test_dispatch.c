/* Dispatch's registration points (src/core/intercept.h): the order in which
 * interceptors see a call, a take, a refusal, data-access checks, suspension, quiet
 * dispatch, kernel providers and extension slots. The oracle is the order and the
 * values each mechanism is specified to give; results are checked against the cpu's
 * own add (exact: small integers in f32). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>
#include <cmocka.h>
#include "core/intercept.h"
#include "kiln/graph.h"
#include "kiln/ops.h"
#include "test_util.h"

/* A log of hook calls: "A.before", "B.after", ... */
static char trail[512];

static void note(const char *who, const char *what)
{
    size_t n = strlen(trail);
    snprintf(trail + n, sizeof trail - n, "%s%s.%s", n ? " " : "", who, what);
}

static kiln_status t_before(void *ctx, const kiln__call_info *c)
{
    note(ctx, "before");
    return KILN_OK;
}

static kiln_status t_after(void *ctx, const kiln__call_info *c)
{
    note(ctx, c->ran ? "after(ran)" : "after(not run)");
    return KILN_OK;
}

static kiln_status t_refuse(void *ctx, const kiln__call_info *c)
{
    note(ctx, "refuse");
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s: refused by test interceptor %s", kiln__ops[c->op].name, (char *)ctx);
}

static kiln_tensor_t *vec(float a, float b)
{
    float v[2] = {a, b};
    int64_t n = 2;
    return kiln_from_data(v, &n, 1, KILN_DTYPE_F32);
}

static void get2(kiln_tensor_t *t, float *out)
{
    assert_non_null(t);
    assert_int_equal(kiln_tensor_to_host(t, out, 2 * sizeof(float)), KILN_OK);
}

static void interceptors_run_in_order_around_the_kernel(void **state)
{
    kiln_tensor_t *x = vec(1, 2), *y = vec(10, 20);
    kiln__interceptor late = {.name = "late", .order = 60, .before = t_before, .after = t_after, .ctx = "late"};
    kiln__interceptor early = {.name = "early", .order = 5, .before = t_before, .after = t_after, .ctx = "early"};
    /* Pushed late first: the stack keeps them by order, not by push. */
    assert_int_equal(kiln__intercept_push(&late), KILN_OK);
    assert_int_equal(kiln__intercept_push(&early), KILN_OK);
    trail[0] = 0;
    kiln_tensor_t *z = kiln_add(x, y);
    kiln__intercept_pop(&early);
    kiln__intercept_pop(&late);
    assert_string_equal(trail, "early.before late.before early.after(ran) late.after(ran)");
    float v[2];
    get2(z, v);
    assert_true(v[0] == 11 && v[1] == 22);
    /* Popped: a new call is not seen. */
    trail[0] = 0;
    assert_non_null(kiln_add(x, y));
    assert_string_equal(trail, "");
}

/* Whether the output is tracked by autograd when this hook sees it. */
static kiln_status t_tracked(void *ctx, const kiln__call_info *c)
{
    *(bool *)ctx = kiln_tensor_requires_grad(c->out[0]);
    return KILN_OK;
}

static void process_wide_autograd_runs_between_by_its_order(void **state)
{
    /* Autograd (order 50) records the call after an order-5 interceptor saw it and
     * before an order-60 one does: only the order-60 one finds the output tracked. */
    kiln_tensor_t *x = vec(1, 2);
    kiln_tensor_set_requires_grad(x, true);
    bool at5 = true, at60 = false;
    kiln__interceptor early = {.name = "early", .order = 5, .after = t_tracked, .ctx = &at5};
    kiln__interceptor late = {.name = "late", .order = 60, .after = t_tracked, .ctx = &at60};
    assert_int_equal(kiln__intercept_push(&early), KILN_OK);
    assert_int_equal(kiln__intercept_push(&late), KILN_OK);
    kiln_tensor_t *y = kiln_mul(x, x);
    kiln__intercept_pop(&late);
    kiln__intercept_pop(&early);
    assert_non_null(y);
    assert_false(at5);
    assert_true(at60);
}

static void a_refusal_stops_the_call_before_anything_runs(void **state)
{
    kiln_tensor_t *x = vec(1, 2);
    kiln__interceptor no = {.name = "no", .order = 1, .before = t_refuse, .ctx = "no"};
    kiln__interceptor late = {.name = "late", .order = 60, .before = t_before, .after = t_after, .ctx = "late"};
    assert_int_equal(kiln__intercept_push(&no), KILN_OK);
    assert_int_equal(kiln__intercept_push(&late), KILN_OK);
    trail[0] = 0;
    assert_null(kiln_add(x, x));
    kiln__intercept_pop(&late);
    kiln__intercept_pop(&no);
    assert_int_equal(kiln_last_status(), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "refused by test interceptor no"));
    assert_string_equal(trail, "no.refuse");
    kiln_clear_error();
}

/* Takes a call: outputs of the inferred shape filled with 7, no kernel. */
static kiln_status t_take(void *ctx, kiln__call_info *c, bool *taken)
{
    note(ctx, "take");
    void *off = kiln__intercept_suspend(); /* its own full is not a call to take */
    c->out[0] = kiln_keep(kiln_full(c->meta[0].shape, c->meta[0].ndim, 7, c->meta[0].dtype));
    kiln__intercept_resume(off);
    *taken = true;
    return KILN_OK;
}

static void a_take_replaces_the_kernel_and_later_interceptors_still_see_it(void **state)
{
    kiln_tensor_t *x = vec(1, 2);
    kiln__interceptor tk = {.name = "taker", .order = 5, .take = t_take, .ctx = "taker"};
    kiln__interceptor late = {.name = "late", .order = 60, .after = t_after, .ctx = "late"};
    assert_int_equal(kiln__intercept_push(&tk), KILN_OK);
    assert_int_equal(kiln__intercept_push(&late), KILN_OK);
    trail[0] = 0;
    kiln_tensor_t *z = kiln_add(x, x);
    kiln__intercept_pop(&late);
    kiln__intercept_pop(&tk);
    assert_string_equal(trail, "taker.take late.after(not run)");
    float v[2];
    get2(z, v);
    assert_true(v[0] == 7 && v[1] == 7);
}

static kiln_status t_no_reads(void *ctx, const kiln_tensor_t *t, const char *what)
{
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s refused by %s", what, (char *)ctx);
}

static void suspend_takes_the_stack_off_and_resume_puts_it_back(void **state)
{
    kiln_tensor_t *x = vec(1, 2);
    kiln__interceptor w = {.name = "watch", .order = 5, .before = t_before, .data_access = t_no_reads, .ctx = "watch"};
    assert_int_equal(kiln__intercept_push(&w), KILN_OK);
    double v;
    assert_int_equal(kiln_tensor_item(kiln_sum(x, NULL, 0, false), &v), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "item refused by watch"));
    kiln_clear_error();
    assert_true(kiln__intercept_find("watch") == &w);
    void *token = kiln_graph_suspend();
    assert_non_null(token);
    assert_null(kiln__intercept_find("watch"));
    trail[0] = 0;
    kiln_tensor_t *s = kiln_sum(x, NULL, 0, false);
    assert_int_equal(kiln_tensor_item(s, &v), KILN_OK);
    assert_true(v == 3);
    assert_string_equal(trail, "");
    kiln_graph_resume(token);
    assert_true(kiln__intercept_find("watch") == &w);
    assert_non_null(kiln_add(x, x));
    assert_string_equal(trail, "watch.before");
    kiln__intercept_pop(&w);
}

static void quiet_dispatch_is_seen_by_no_interceptor(void **state)
{
    kiln_tensor_t *x = vec(1, 2);
    kiln_tensor_set_requires_grad(x, true);
    kiln__interceptor w = {.name = "watch", .order = 5, .before = t_before, .after = t_after, .ctx = "watch"};
    assert_int_equal(kiln__intercept_push(&w), KILN_OK);
    trail[0] = 0;
    kiln_tensor_t *in[2] = {x, x}, *out = NULL;
    kiln__attrs a = {0};
    assert_int_equal(kiln__dispatch_quiet(KILN_OP_ADD, in, 2, &a, &out), KILN_OK);
    kiln__intercept_pop(&w);
    assert_string_equal(trail, "");
    assert_false(kiln_tensor_requires_grad(out)); /* autograd did not record it either */
    kiln_tensor_free(out);
}

/* A provider ahead of the backend's kernel, for ADD on f32 while `armed`: writes -1. */
static bool armed;
static kiln_status t_provider(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                              kiln_tensor_t *const *out, int n_out, bool *handled)
{
    *handled = armed && op == KILN_OP_ADD;
    if (*handled) {
        float m[2] = {-1, -1};
        memcpy(kiln__data(out[0]), m, sizeof m);
    }
    return KILN_OK;
}
static const kiln__provider test_provider = {.name = "test", .order = -1, .run = t_provider};

static kiln_status t_which(void *ctx, const kiln__call_info *c)
{
    note(c->ran ? c->ran->name : "none", "ran");
    return KILN_OK;
}

static void providers_are_asked_in_order_and_the_call_says_who_ran_it(void **state)
{
    static bool registered;
    if (!registered) assert_int_equal(kiln__provider_register(&test_provider), KILN_OK);
    registered = true;
    kiln_tensor_t *x = vec(1, 2);
    kiln__interceptor w = {.name = "which", .order = 5, .after = t_which};
    assert_int_equal(kiln__intercept_push(&w), KILN_OK);
    trail[0] = 0;
    armed = true;
    kiln_tensor_t *z = kiln_add(x, x);
    armed = false;
    kiln_tensor_t *u = kiln_add(x, x);
    kiln__intercept_pop(&w);
    assert_string_equal(trail, "test.ran kernel.ran");
    float v[2];
    get2(z, v);
    assert_true(v[0] == -1 && v[1] == -1);
    get2(u, v);
    assert_true(v[0] == 2 && v[1] == 4);
}

static int released;
static void t_release(void *v) { released += (int)(intptr_t)v; }

static void an_extension_slot_is_released_with_its_tensor_and_kept_by_detach_when_asked(void **state)
{
    static int slot = -2, kept = -2;
    if (slot == -2) slot = kiln__ext_register("test", t_release, false);
    if (kept == -2) kept = kiln__ext_register("test kept", NULL, true);
    assert_true(slot >= 0 && kept >= 0 && slot != kept);
    /* Owned values cannot be copied into aliases. */
    assert_int_equal(kiln__ext_register("bad", t_release, true), -1);
    kiln_tensor_t *x = vec(1, 2);
    kiln_tensor_retain(x);
    x->ext[slot] = (void *)(intptr_t)5;
    x->ext[kept] = (void *)(intptr_t)9;
    kiln_tensor_t *d = kiln__tensor_detach(x);
    assert_non_null(d);
    assert_null(kiln__ext(d, slot));
    assert_true(kiln__ext(d, kept) == (void *)(intptr_t)9);
    released = 0;
    kiln_tensor_free(d);
    assert_int_equal(released, 0);
    kiln_tensor_free(x); /* the scope still holds it */
    assert_int_equal(released, 0);
    kiln_scope_end();
    assert_int_equal(released, 5);
    kiln_scope_begin();
}

/* The op table's columns agree with each other: an op writes inputs exactly when it has
 * no outputs (in-place and collective ops), the views are the kind VIEW, and every op
 * of pointwise.def is POINTWISE with its backward op beside it. */
static void op_table_columns_agree(void **state)
{
    for (int op = 0; op < KILN_OP_COUNT; op++) {
        const kiln__op_def *d = &kiln__ops[op];
        if ((d->n_out == 0) != (d->writes != 0)) fail_msg("%s: n_out %d but writes 0x%x", d->name, d->n_out, d->writes);
        if (d->n_out == 0 && d->kind != KILN__KIND_INPLACE && d->kind != KILN__KIND_COLLECTIVE)
            fail_msg("%s: writes its inputs but is of kind %d", d->name, d->kind);
        if (d->is_view != (d->kind == KILN__KIND_VIEW)) fail_msg("%s: is_view and kind disagree", d->name);
        if (d->n_in >= 0 && d->writes >> d->n_in) fail_msg("%s: writes an input it does not have", d->name);
        if (kiln__op_math[op].name && d->kind != KILN__KIND_POINTWISE) fail_msg("%s: from pointwise.def, not POINTWISE", d->name);
    }
    assert_int_equal(kiln__ops[KILN_OP_ADAMW_].writes, 0xD); /* p, m, v */
    assert_true(kiln__op_math[KILN_OP_SOFTPLUS].name && !kiln__op_math[KILN_OP_SOFTPLUS].dx);
    assert_true(kiln__op_math[KILN_OP_SOFTPLUS_BACKWARD].dx);
}

/* CSE and the kernel caches compare attributes byte for byte: attributes made with a
 * designated initializer and made field by field on a zeroed struct must be the same
 * bytes (padding and the union's unused bytes zero) on the compiler kiln is built with. */
static void attributes_compare_bytewise_however_made(void **state)
{
    kiln__attrs a = {.op.rope = {.theta = 10000, .pos0 = 3}}, b;
    memset(&b, 0, sizeof b);
    b.op.rope.theta = 10000;
    b.op.rope.pos0 = 3;
    assert_memory_equal(&a, &b, sizeof a);
    kiln__attrs c = {0}, d;
    memset(&d, 0, sizeof d);
    c.op.check = (kiln__check_attrs){.min = 1, .what = KILN__CHECK_ADAMW_STEP};
    d.op.check.min = 1;
    d.op.check.what = KILN__CHECK_ADAMW_STEP;
    assert_memory_equal(&c, &d, sizeof c);
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(interceptors_run_in_order_around_the_kernel),
        T(process_wide_autograd_runs_between_by_its_order),
        T(a_refusal_stops_the_call_before_anything_runs),
        T(a_take_replaces_the_kernel_and_later_interceptors_still_see_it),
        T(suspend_takes_the_stack_off_and_resume_puts_it_back),
        T(quiet_dispatch_is_seen_by_no_interceptor),
        T(providers_are_asked_in_order_and_the_call_says_who_ran_it),
        T(an_extension_slot_is_released_with_its_tensor_and_kept_by_detach_when_asked),
        T(op_table_columns_agree),
        T(attributes_compare_bytewise_however_made),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
