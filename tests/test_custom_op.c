/* Custom ops (kiln/op.h): an op defined at run time is an op like the built-in ones —
 * eager on every device (its own kernel, or the cpu's with copies), autograd, graph
 * capture, compiled (fused when it gave an expression, else a step of its own), replay,
 * the op listing — and a bad declaration or call is a clear error. Oracles: the same
 * computation written with kiln's built-in ops (themselves checked against PyTorch in
 * test_alignment), to 1e-6 relative unless said. Also run on the OpenCL device
 * (test_custom_op_opencl), where scale_by runs its OpenCL C kernel and relu2 the
 * compiler's generated one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include "kiln/kiln.h"
#include "test_util.h"

static int scale_by = -1, relu2 = -1, pair = -1, softsign = -1;

static void like_input0(const kiln_op_args *a, kiln_op_meta *m)
{
    m->dtype = kiln_tensor_dtype(a->in[0]);
    m->ndim = kiln_tensor_ndim(a->in[0]);
    memcpy(m->shape, kiln_tensor_shape(a->in[0]), sizeof(int64_t) * (size_t)m->ndim);
}

static kiln_status scale_shape(const kiln_op_args *a, kiln_op_meta *out)
{
    if (kiln_tensor_dtype(a->in[0]) != KILN_DTYPE_F32) return kiln_error(KILN_ERR_DTYPE, "x must be f32");
    if (a->attr[0].f == 13) return kiln_error(KILN_ERR_ARG, "13 is an unlucky scale");
    like_input0(a, out);
    return KILN_OK;
}

static kiln_status scale_cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]);
    float *y = kiln_op_data(a->out[0]);
    for (int64_t i = 0; i < kiln_tensor_numel(a->in[0]); i++) y[i] = (float)(x[i] * (float)a->attr[0].f);
    return KILN_OK;
}

static kiln_status scale_backward(const kiln_op_args *a, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln_mul_scalar(gout[0], a->attr[0].f);
    return gin[0] ? KILN_OK : kiln_last_status();
}

/* One work-item per element; each tensor a (buffer, byte offset) pair. */
static const char scale_cl[] =
    "__kernel void scale_by(__global const float *x, ulong xo, __global float *y, ulong yo, long n, long cols,\n"
    "                       float s)\n"
    "{\n"
    "    long i = get_global_id(0);\n"
    "    __global const float *xp = (__global const float *)((__global const char *)x + xo);\n"
    "    __global float *yp = (__global float *)((__global char *)y + yo);\n"
    "    if (i < n) yp[i] = xp[i] * s;\n"
    "}\n";

static kiln_status relu2_cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]);
    float *y = kiln_op_data(a->out[0]);
    float s = (float)a->attr[0].f;
    for (int64_t i = 0; i < kiln_tensor_numel(a->in[0]); i++) y[i] = x[i] > 0 ? s * x[i] * x[i] : 0;
    return KILN_OK;
}

/* d/dx s x^2 [x > 0] = 2 s x [x > 0] */
static kiln_status relu2_backward(const kiln_op_args *a, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    kiln_tensor_t *x = a->in[0];
    gin[0] = kiln_mul(gout[0], kiln_mul_scalar(kiln_relu(x), 2 * a->attr[0].f));
    return gin[0] ? KILN_OK : kiln_last_status();
}

/* Two outputs, the second hidden: y = x + 1 (visible), x * 2 kept. */
static kiln_status pair_shape(const kiln_op_args *a, kiln_op_meta *out)
{
    like_input0(a, &out[0]);
    like_input0(a, &out[1]);
    return KILN_OK;
}

static kiln_status pair_cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]);
    float *y = kiln_op_data(a->out[0]), *h = kiln_op_data(a->out[1]);
    for (int64_t i = 0; i < kiln_tensor_numel(a->in[0]); i++) y[i] = x[i] + 1, h[i] = x[i] * 2;
    return KILN_OK;
}

/* softsign(x) = x / (1 + |x|): a cpu kernel and a decomposition into kiln ops. */
static kiln_status softsign_shape(const kiln_op_args *a, kiln_op_meta *out)
{
    like_input0(a, out);
    return KILN_OK;
}

static kiln_status softsign_cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]);
    float *y = kiln_op_data(a->out[0]);
    for (int64_t i = 0; i < kiln_tensor_numel(a->in[0]); i++) y[i] = x[i] / (1 + fabsf(x[i]));
    return KILN_OK;
}

static kiln_status softsign_dec(const kiln_op_args *a, kiln_tensor_t **out)
{
    out[0] = kiln_div(a->in[0], kiln_add_scalar(kiln_abs(a->in[0]), 1));
    return out[0] ? KILN_OK : kiln_last_status();
}

static void define_ops(void)
{
    if (scale_by >= 0) return;
    const kiln_op_kernel sk[] = {{.device = "cpu", .fn = scale_cpu},
                                 {.device = "opencl", .source = scale_cl, .entry = "scale_by"}};
    assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "scale_by", .n_in = 1, .n_out = 1, .attrs = "scale:f64",
                                                    .shape = scale_shape, .kernels = sk, .n_kernels = 2,
                                                    .backward = scale_backward},
                                    &scale_by),
                     KILN_OK);
    const kiln_op_kernel rk[] = {{.device = "cpu", .fn = relu2_cpu}};
    assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "relu2", .n_in = 1, .n_out = 1, .attrs = "s:f64",
                                                    .kernels = rk, .n_kernels = 1, .backward = relu2_backward,
                                                    .expr = "x0 > 0 ? a0 * x0 * x0 : 0.0f"},
                                    &relu2),
                     KILN_OK);
    const kiln_op_kernel ssk[] = {{.device = "cpu", .fn = softsign_cpu}};
    assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "softsign", .n_in = 1, .n_out = 1, .shape = softsign_shape,
                                                    .kernels = ssk, .n_kernels = 1, .decompose = softsign_dec},
                                    &softsign),
                     KILN_OK);
    const kiln_op_kernel pk[] = {{.device = "cpu", .fn = pair_cpu}};
    assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "pair_hidden", .n_in = 1, .n_out = 2, .n_visible = 1,
                                                    .shape = pair_shape, .kernels = pk, .n_kernels = 1},
                                    &pair),
                     KILN_OK);
}

static kiln_tensor_t *randn(int64_t r, int64_t c, uint64_t seed)
{
    kiln_manual_seed(seed);
    int64_t shape[2] = {r, c};
    return kiln_randn(shape, 2, KILN_DTYPE_F32);
}

static void assert_close(kiln_tensor_t *a, kiln_tensor_t *b, double tol)
{
    char why[256];
    if (!test_close(a, b, tol, why, sizeof why)) fail_msg("%s", why);
}

static kiln_status wrong_shape(const kiln_op_args *a, kiln_op_meta *out)
{
    out->dtype = KILN_DTYPE_F32;
    out->ndim = 1;
    out->shape[0] = kiln_tensor_numel(a->in[0]) * 2;
    return KILN_OK;
}

static kiln_tensor_t *call1(int op, kiln_tensor_t *x, double attr)
{
    return kiln_op_call(op, &x, 1, &(kiln_op_value){.f = attr}, op == pair || op == softsign ? 0 : 1);
}

static void eager_matches_the_builtin_ops(void **state)
{
    define_ops();
    kiln_tensor_t *x = randn(37, 19, 1);
    assert_close(call1(scale_by, x, 2.5), kiln_mul_scalar(x, 2.5), 1e-6);
    assert_close(call1(relu2, x, 0.75), kiln_mul_scalar(kiln_mul(kiln_relu(x), kiln_relu(x)), 0.75), 1e-6);
    assert_close(call1(pair, x, 0), kiln_add_scalar(x, 1), 1e-6);
    /* an expression op broadcasts its inputs */
    assert_string_equal(kiln_tensor_device(x), kiln_tensor_device(call1(scale_by, x, 1)));
}

static void autograd_runs_the_ops_backward(void **state)
{
    define_ops();
    kiln_tensor_t *x = randn(8, 33, 2), *ref = kiln_detach(x);
    kiln_tensor_set_requires_grad(x, true);
    kiln_tensor_set_requires_grad(ref, true);
    kiln_tensor_t *loss = kiln_sum(kiln_mul(call1(relu2, call1(scale_by, x, -1.5), 0.5), x), NULL, 0, false);
    kiln_tensor_t *r = kiln_mul_scalar(ref, -1.5);
    kiln_tensor_t *rl = kiln_sum(kiln_mul(kiln_mul_scalar(kiln_mul(kiln_relu(r), kiln_relu(r)), 0.5), ref), NULL, 0, false);
    assert_int_equal(kiln_backward(loss), KILN_OK);
    assert_int_equal(kiln_backward(rl), KILN_OK);
    assert_close(loss, rl, 1e-6);
    assert_close(kiln_tensor_grad(x), kiln_tensor_grad(ref), 1e-5);
    /* pair_hidden has no backward: a loss through it is refused by name */
    kiln_tensor_t *p = kiln_sum(call1(pair, x, 0), NULL, 0, false);
    assert_non_null(p);
    assert_int_not_equal(kiln_backward(p), KILN_OK);
    kiln_clear_error();
}

/* twin: y = a + b, whose backward (wrongly, but a custom backward may) hands one fresh
 * tensor, twice the output's gradient, to both inputs. */
static kiln_status twin_cpu(const kiln_op_args *a)
{
    const float *x0 = kiln_op_data(a->in[0]), *x1 = kiln_op_data(a->in[1]);
    float *y = kiln_op_data(a->out[0]);
    for (int64_t i = 0; i < kiln_tensor_numel(a->in[0]); i++) y[i] = x0[i] + x1[i];
    return KILN_OK;
}

static kiln_status twin_shape(const kiln_op_args *a, kiln_op_meta *out)
{
    like_input0(a, out);
    return KILN_OK;
}

static kiln_status twin_backward(const kiln_op_args *a, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    (void)a;
    gin[0] = gin[1] = kiln_mul_scalar(gout[0], 2.0);
    return gin[0] ? KILN_OK : kiln_last_status();
}

/* A leaf's gradient is never the tensor another node will read later: twin hands its
 * fresh gradient g to the leaf a and to t = 3a's node, and u = 5a's node adds into a's
 * gradient before t's node reads g (the backward runs twin's node, then u's, then t's).
 * Had a's gradient been g itself (KILN_OPT_STEAL_GRAD without its check that no other
 * input of the node gets the tensor), t's node would read 2 + 5 where g was 2, and a's
 * gradient come out 7 + 21 = 28. Oracle: the backward's own arithmetic, 2 + 2 x 3 + 5 =
 * 13, exact. */
static void a_gradient_handed_to_two_inputs_is_not_taken(void **state)
{
    (void)state;
    static int twin = -1;
    const kiln_op_kernel tk[] = {{.device = "cpu", .fn = twin_cpu}};
    if (twin < 0)
        assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "twin", .n_in = 2, .n_out = 1, .shape = twin_shape, .kernels = tk,
                                                        .n_kernels = 1, .backward = twin_backward},
                                        &twin),
                         KILN_OK);
    int64_t n = 1 << 14; /* a size the allocator holds exactly (a rounded one is never taken) */
    kiln_tensor_t *a = kiln_full(&n, 1, 1, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(a, true);
    kiln_tensor_t *in[2] = {a, kiln_mul_scalar(a, 3)};
    kiln_tensor_t *y = kiln_op_call(twin, in, 2, NULL, 0);
    assert_non_null(y);
    kiln_tensor_t *loss = kiln_add(kiln_sum(y, NULL, 0, false), kiln_sum(kiln_mul_scalar(a, 5), NULL, 0, false));
    assert_int_equal(kiln_backward(loss), KILN_OK);
    static float g[1 << 14];
    assert_int_equal(kiln_tensor_to_host(kiln_tensor_grad(a), g, sizeof g), KILN_OK);
    for (int i = 0; i < n; i++) assert_true(g[i] == 13.0f);
}

typedef struct {
    bool fused_only;
} fn_ctx;

static kiln_status fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const fn_ctx *c = ctx;
    kiln_tensor_t *s = kiln_add(in[0], in[1]);
    out[0] = c->fused_only ? kiln_exp(call1(relu2, s, 0.25)) : kiln_add(call1(scale_by, s, 3), call1(pair, in[1], 0));
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void compiled_matches_eager_and_fuses_expressions(void **state)
{
    define_ops();
    kiln_tensor_t *in[2] = {randn(16, 48, 3), randn(16, 48, 4)};
    for (int fused = 0; fused < 2; fused++) {
        fn_ctx c = {fused};
        kiln_tensor_t *eager[1];
        int n = 0;
        assert_int_equal(fn(&c, in, 2, eager, &n), KILN_OK);
        kiln_compiled_t *cf;
        assert_int_equal(kiln_compiled_new(fn, &c, fused ? "fused" : "steps", &cf), KILN_OK);
        kiln_tensor_t *out[1] = {0};
        assert_int_equal(kiln_compiled_call(cf, in, 2, out, 1, &n), KILN_OK);
        assert_close(out[0], eager[0], 1e-5);
        int kernels = -1, ops = -1;
        assert_int_equal(kiln_compiled_plan(cf, 0, &kernels, &ops, NULL, NULL), KILN_OK);
        if (fused) { /* add, relu2 and exp: one generated kernel, nothing through dispatch */
            assert_int_equal(kernels, 1);
            assert_int_equal(ops, 0);
        } else { /* scale_by and pair_hidden: steps of their own */
            assert_true(ops >= 2);
        }
        kiln_compiled_free(cf);
    }
}

static kiln_status softsign_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    out[0] = kiln_mul_scalar(call1(softsign, kiln_add(in[0], in[1]), 0), 2);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

/* A decomposition is what the compiler fuses where the op is not kept whole: on a
 * device without a kernel of its own for it (OpenCL here), or with
 * KILN_COMPILE_DECOMPOSE=all; on the cpu, by default, its own kernel is a step. */
static void a_decomposition_is_fused_where_it_is_taken(void **state)
{
    define_ops();
    kiln_tensor_t *in[2] = {randn(9, 40, 10), randn(9, 40, 11)};
    bool device = strcmp(kiln_device(), "cpu") != 0;
    for (int all = 0; all < 2; all++) {
        if (all) test_setenv("KILN_COMPILE_DECOMPOSE", "all", 1);
        kiln_tensor_t *eager[1], *out[1] = {0};
        int n;
        assert_int_equal(softsign_fn(NULL, in, 2, eager, &n), KILN_OK);
        assert_close(eager[0], kiln_mul_scalar(kiln_div(kiln_add(in[0], in[1]),
                                                        kiln_add_scalar(kiln_abs(kiln_add(in[0], in[1])), 1)), 2), 1e-6);
        kiln_compiled_t *cf;
        assert_int_equal(kiln_compiled_new(softsign_fn, NULL, all ? "softsign_all" : "softsign", &cf), KILN_OK);
        assert_int_equal(kiln_compiled_call(cf, in, 2, out, 1, &n), KILN_OK);
        assert_close(out[0], eager[0], 1e-6);
        int kernels = -1, ops = -1;
        assert_int_equal(kiln_compiled_plan(cf, 0, &kernels, &ops, NULL, NULL), KILN_OK);
        if (all || device) { /* add, abs, add, div, mul: one kernel */
            assert_int_equal(ops, 0);
            assert_int_equal(kernels, 1);
        } else {
            assert_int_equal(ops, 1);
        }
        kiln_compiled_free(cf);
        if (all) test_unsetenv("KILN_COMPILE_DECOMPOSE");
    }
}

static void graph_capture_and_replay_run_it(void **state)
{
    define_ops();
    kiln_tensor_t *in[2] = {randn(5, 7, 5), randn(5, 7, 6)};
    fn_ctx c = {false};
    kiln_graph_t *g;
    assert_int_equal(kiln_graph_capture(fn, &c, in, 2, &g), KILN_OK);
    char text[8192] = "";
    FILE *f = fmemopen(text, sizeof text - 1, "w");
    assert_int_equal(kiln_graph_print(g, f), KILN_OK);
    fclose(f);
    if (!strstr(text, "scale_by") || !strstr(text, "pair_hidden")) fail_msg("%s", text);
    kiln_tensor_t *eager[1], *out[1];
    int n;
    assert_int_equal(fn(&c, in, 2, eager, &n), KILN_OK);
    assert_int_equal(kiln_graph_run(g, in, 2, out, 1, &n), KILN_OK);
    assert_close(out[0], eager[0], 1e-6);
    kiln_graph_free(g);
    kiln_replay_t *r;
    assert_int_equal(kiln_replay_record(fn, &c, in, 2, &r, out, 1, &n), KILN_OK);
    kiln_tensor_t *in2[2] = {randn(5, 7, 7), randn(5, 7, 8)};
    assert_int_equal(fn(&c, in2, 2, eager, &n), KILN_OK);
    assert_int_equal(kiln_replay_run(r, in2, 2, out, 1, &n), KILN_OK);
    assert_close(out[0], eager[0], 1e-6);
    kiln_replay_free(r);
}

static void listed_with_the_builtin_ops(void **state)
{
    define_ops();
    assert_int_equal(kiln_op_find("scale_by"), scale_by);
    assert_int_equal(kiln_op_find("add") >= 0, true);
    assert_int_equal(kiln_op_find("no_such_op"), -1);
    assert_true(scale_by < kiln_op_count() && relu2 < kiln_op_count());
    assert_string_equal(kiln_op_name(relu2), "relu2");
    assert_int_equal(kiln_device_op_support("cpu", scale_by), KILN_OP_NATIVE);
    if (kiln_device_count() > 1 && !strncmp(kiln_device_name(1), "opencl", 6)) {
        assert_int_equal(kiln_device_op_support("opencl:0", scale_by), KILN_OP_NATIVE); /* its OpenCL C kernel */
        assert_int_not_equal(kiln_device_op_support("opencl:0", pair), KILN_OP_NONE);    /* the cpu's, with copies */
    }
}

static kiln_status define_error(const kiln_op_decl *d, const char *want)
{
    int id = -1;
    int before = kiln_op_count();
    kiln_status s = kiln_op_define(d, &id);
    if (s == KILN_OK || !strstr(kiln_last_error(), want))
        fail_msg("%s: %s (wanted an error naming '%s')", d->name ? d->name : "(null)", kiln_last_error(), want);
    assert_int_equal(kiln_op_count(), before); /* nothing defined */
    kiln_clear_error();
    return s;
}

static void bad_declarations_are_refused_by_name(void **state)
{
    define_ops();
    const kiln_op_kernel cpu[] = {{.device = "cpu", .fn = scale_cpu}};
    kiln_op_decl d = {.name = "add", .n_in = 1, .n_out = 1, .shape = scale_shape, .kernels = cpu, .n_kernels = 1};
    assert_int_equal(define_error(&d, "add: a built-in op has that name"), KILN_ERR_ARG);
    d.name = "scale_by";
    define_error(&d, "a custom op has that name");
    d.name = "fine";
    d.attrs = "eps:f32";
    define_error(&d, "'eps:f32' is not name:f64 or name:i64");
    d.attrs = NULL;
    d.n_out = 5;
    define_error(&d, "n_out 5");
    d.n_out = 1;
    d.n_kernels = 0;
    define_error(&d, "no cpu kernel");
    const kiln_op_kernel both[] = {{.device = "cpu", .fn = scale_cpu, .source = "x", .entry = "x"}};
    d.kernels = both;
    d.n_kernels = 1;
    define_error(&d, "both fn and source");
    d.kernels = cpu;
    d.expr = "x0 + x1";
    define_error(&d, "x1 names no input");
    d.expr = "x0; system(0)";
    define_error(&d, "';' at 2 is not part of an expression");
    d.expr = "x0 + system(0)";
    define_error(&d, "'system' is not x<i>, a<k>, a number");
    d.expr = "x0 // comment";
    define_error(&d, "'//' at 3 is not part of an expression");
    d.expr = "x0 + n";
    define_error(&d, "'n' is not x<i>");
    d.expr = "x0 + km_exp";
    define_error(&d, "'km_exp' is not x<i>");
    d.expr = "x0 + (x0";
    define_error(&d, "unbalanced parentheses");
    d.expr = NULL;
    d.attrs = "a:f64,a:i64";
    define_error(&d, "'a' is named twice");
    d.attrs = "a:f64,";
    define_error(&d, "a ',' ends");
    d.attrs = "9a:f64";
    define_error(&d, "'9a:f64' is not name:f64 or name:i64");
    d.attrs = NULL;
    d.expr = NULL;
    d.name = "not a name";
    define_error(&d, "not an identifier");
    d.name = "fine";
    d.shape = NULL;
    define_error(&d, "no shape function");
    if (kiln_device_count() > 1 && !strncmp(kiln_device_name(1), "opencl", 6)) {
        char was[64];
        snprintf(was, sizeof was, "%s", kiln_device());
        kiln_set_device(kiln_device_name(1)); /* the device is open: its kernel is built when defined */
        kiln_set_device(was);
        const kiln_op_kernel broken[] = {{.device = "cpu", .fn = scale_cpu},
                                         {.device = "opencl", .source = "__kernel void k( { }", .entry = "k"}};
        d.shape = scale_shape;
        d.kernels = broken;
        d.n_kernels = 2;
        define_error(&d, "fine: its opencl kernel k does not build");
    }
}

/* The expressions' edges: an op of four inputs (more than a generated kernel's
 * operands: its own step), an infinite attribute, a negative integer one (pasted in
 * parentheses), each compiled against eager (its C kernel). */
static kiln_status sum4_cpu(const kiln_op_args *a)
{
    const float *x[4];
    for (int i = 0; i < 4; i++) x[i] = kiln_op_data(a->in[i]);
    float *y = kiln_op_data(a->out[0]);
    for (int64_t i = 0; i < kiln_tensor_numel(a->out[0]); i++) y[i] = x[0][i] + x[1][i] * x[2][i] - x[3][i];
    return KILN_OK;
}

static kiln_status clamp_cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]);
    float *y = kiln_op_data(a->out[0]);
    for (int64_t i = 0; i < kiln_tensor_numel(a->out[0]); i++)
        y[i] = fminf(fmaxf(x[i] - (float)a->attr[2].i, (float)a->attr[0].f), (float)a->attr[1].f);
    return KILN_OK;
}

static int sum4 = -1, clamp = -1;

typedef struct {
    kiln_op_value attr[3];
} edge_ctx;

static kiln_status edge_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const edge_ctx *e = ctx;
    kiln_tensor_t *four[4] = {kiln_exp(in[0]), in[1], in[0], in[1]};
    kiln_tensor_t *s4 = kiln_op_call(sum4, four, 4, NULL, 0);
    kiln_tensor_t *c = kiln_neg(s4);
    out[0] = kiln_mul_scalar(kiln_op_call(clamp, &c, 1, e->attr, 3), 3);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void expression_edges_compile_as_they_run(void **state)
{
    if (sum4 < 0) {
        const kiln_op_kernel k4[] = {{.device = "cpu", .fn = sum4_cpu}}, kc[] = {{.device = "cpu", .fn = clamp_cpu}};
        assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "sum4", .n_in = 4, .n_out = 1, .kernels = k4,
                                                        .n_kernels = 1, .expr = "x0 + x1 * x2 - x3"},
                                        &sum4),
                         KILN_OK);
        assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "clamp3", .n_in = 1, .n_out = 1,
                                                        .attrs = "lo:f64,hi:f64,shift:i64", .kernels = kc,
                                                        .n_kernels = 1, .expr = "km_min(km_max(x0 - a2, a0), a1)"},
                                        &clamp),
                         KILN_OK);
    }
    kiln_tensor_t *in[2] = {randn(6, 20, 12), randn(6, 20, 13)};
    edge_ctx e = {{{.f = -1.5}, {.f = INFINITY}, {.i = -2}}};
    kiln_tensor_t *eager[1], *out[1] = {0};
    int n;
    assert_int_equal(edge_fn(&e, in, 2, eager, &n), KILN_OK);
    kiln_compiled_t *cf;
    assert_int_equal(kiln_compiled_new(edge_fn, &e, "edges", &cf), KILN_OK);
    if (kiln_compiled_call(cf, in, 2, out, 1, &n) != KILN_OK) fail_msg("%s", kiln_last_error());
    assert_close(out[0], eager[0], 1e-5);
    kiln_compiled_free(cf);
}

/* A backward that gives a gradient of another dtype than its input's is refused. */
static kiln_status bad_backward(const kiln_op_args *a, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    gin[0] = kiln_cast(gout[0], KILN_DTYPE_F64);
    return gin[0] ? KILN_OK : kiln_last_status();
}

static void bad_calls_are_clear_errors(void **state)
{
    define_ops();
    kiln_tensor_t *x = randn(3, 4, 9);
    assert_null(call1(scale_by, x, 13));
    if (!strstr(kiln_last_error(), "scale_by: 13 is an unlucky scale")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    kiln_tensor_t *xi = kiln_cast(x, KILN_DTYPE_I64);
    assert_null(call1(scale_by, xi, 1));
    if (!strstr(kiln_last_error(), "scale_by: x must be f32")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    assert_null(kiln_op_call(scale_by, &x, 1, NULL, 0));
    if (!strstr(kiln_last_error(), "scale_by: 0 attributes given, it takes 1")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    kiln_tensor_t *two[2] = {x, x};
    assert_null(kiln_op_call(scale_by, two, 2, &(kiln_op_value){.f = 1}, 1));
    if (!strstr(kiln_last_error(), "2 inputs given, it takes 1")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    assert_null(kiln_op_call(kiln_op_find("add"), two, 2, NULL, 0));
    if (!strstr(kiln_last_error(), "add is a built-in op")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    assert_null(kiln_op_call(9999, &x, 1, NULL, 0));
    if (!strstr(kiln_last_error(), "9999 is not an op's id")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    /* an error from before a call that succeeds is kept, as every op keeps it */
    kiln_error(KILN_ERR_SHAPE, "an earlier failure");
    assert_non_null(call1(scale_by, x, 2));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_string_equal(kiln_last_error(), "an earlier failure");
    kiln_clear_error();
    /* an expression op whose shape function gives another shape than its inputs' */
    static int wrong = -1;
    const kiln_op_kernel wk[] = {{.device = "cpu", .fn = scale_cpu}};
    if (wrong < 0)
        assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "wrong_shape", .n_in = 1, .n_out = 1, .attrs = "s:f64",
                                                        .shape = wrong_shape, .kernels = wk, .n_kernels = 1,
                                                        .expr = "x0 * a0"},
                                        &wrong),
                         KILN_OK);
    assert_null(call1(wrong, x, 1));
    if (!strstr(kiln_last_error(), "wrong_shape: its shape function gave the output another shape"))
        fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    /* a backward's gradient of the wrong dtype */
    static int badbw = -1;
    if (badbw < 0)
        assert_int_equal(kiln_op_define(&(kiln_op_decl){.name = "bad_backward", .n_in = 1, .n_out = 1, .attrs = "s:f64",
                                                        .shape = scale_shape, .kernels = wk, .n_kernels = 1,
                                                        .backward = bad_backward},
                                        &badbw),
                         KILN_OK);
    kiln_tensor_t *xg = kiln_detach(x);
    kiln_tensor_set_requires_grad(xg, true);
    assert_int_equal(kiln_backward(kiln_sum(call1(badbw, xg, 2), NULL, 0, false)), KILN_ERR_AUTOGRAD);
    if (!strstr(kiln_last_error(), "bad_backward: its backward gave input 0 a gradient f64")) fail_msg("%s", kiln_last_error());
    kiln_clear_error();
    kiln_tensor_t *null_in = NULL;
    assert_null(kiln_op_call(scale_by, &null_in, 1, &(kiln_op_value){.f = 1}, 1));
    kiln_clear_error();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(eager_matches_the_builtin_ops, setup, teardown),
        cmocka_unit_test_setup_teardown(autograd_runs_the_ops_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(a_gradient_handed_to_two_inputs_is_not_taken, setup, teardown),
        cmocka_unit_test_setup_teardown(compiled_matches_eager_and_fuses_expressions, setup, teardown),
        cmocka_unit_test_setup_teardown(a_decomposition_is_fused_where_it_is_taken, setup, teardown),
        cmocka_unit_test_setup_teardown(graph_capture_and_replay_run_it, setup, teardown),
        cmocka_unit_test_setup_teardown(listed_with_the_builtin_ops, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_declarations_are_refused_by_name, setup, teardown),
        cmocka_unit_test_setup_teardown(expression_edges_compile_as_they_run, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_calls_are_clear_errors, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
