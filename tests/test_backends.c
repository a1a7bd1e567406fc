/* The backend contract (src/core/backend.h) and the devices behind it: registration
 * checks, device selection and its errors, moving tensors, the coverage table, and the
 * code the compiler generates for each backend's language — OpenCL C built by the
 * OpenCL platform, CUDA C compiled by NVRTC (which needs no GPU). Oracles: the cpu's
 * own result for moved tensors (bitwise: a copy), the compilers' verdicts. Op-by-op
 * numbers on each device are the conformance runs (tests/on_device.sh). */
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
#include "compile/compile_impl.h"
#include "core/backend.h"
#include "kiln/kiln.h"
#include "test_util.h"
#include "test_train.h"

const char *kiln__cuda_builtin_source(void);

static bool have_device(const char *name)
{
    for (int i = 0; i < kiln_device_count(); i++)
        if (!strcmp(kiln_device_name(i), name)) return true;
    return false;
}

static kiln_status no_info(kiln__backend *be, kiln__device_info *out) { return KILN_OK; }

static void registration_checks_version_and_entries(void **state)
{
    static const kiln__kernel_fn none[KILN_OP_COUNT];
    kiln__backend old = {.abi_version = 1, .name = "old-npu", .device_info = no_info, .kernels = none};
    assert_int_equal(kiln__backend_register(&old), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "old-npu"));
    assert_non_null(strstr(kiln_last_error(), "version 1"));
    kiln__backend half = {.abi_version = KILN_BACKEND_ABI_VERSION, .name = "half-npu", .device_info = no_info,
                          .kernels = none};
    assert_int_equal(kiln__backend_register(&half), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "lacks a required entry"));
    kiln__backend *cpu = kiln__backend_find("cpu");
    assert_int_equal(kiln__backend_register(cpu), KILN_ERR_ARG); /* the name is taken */
    kiln_clear_error();
}

static void a_missing_device_is_a_clear_error(void **state)
{
    assert_string_equal(kiln_device(), "cpu");
    assert_int_equal(kiln_set_device("npu:7"), KILN_ERR_DEVICE);
    assert_non_null(strstr(kiln_last_error(), "npu:7"));
    assert_non_null(strstr(kiln_last_error(), "cpu")); /* and what there is */
    assert_string_equal(kiln_device(), "cpu");
    kiln_tensor_t *x = kiln_ones((int64_t[]){3}, 1, KILN_DTYPE_F32);
    assert_null(kiln_tensor_to(x, "npu:7"));
    assert_non_null(strstr(kiln_last_error(), "npu:7"));
    kiln_clear_error();
}

/* Oracle: the cpu tensor itself; a round trip through the device is a copy, bitwise. */
static void tensors_move_and_mixed_devices_are_refused(void **state)
{
    if (!have_device("opencl:0")) skip();
    float v[6] = {1, -2, 3.5f, 4, 5, -6.25f}, back[6];
    kiln_tensor_t *x = kiln_from_data(v, (int64_t[]){2, 3}, 2, KILN_DTYPE_F32);
    kiln_tensor_t *d = kiln_tensor_to(kiln_transpose(x, 0, 1), "opencl"); /* a strided view moves as its values */
    assert_non_null(d);
    assert_string_equal(kiln_tensor_device(d), "opencl:0");
    assert_int_equal(kiln_tensor_to_host(kiln_tensor_to(d, "cpu"), back, sizeof back), KILN_OK);
    float want[6] = {1, 4, -2, 5, 3.5f, -6.25f};
    assert_memory_equal(back, want, sizeof want);
    assert_null(kiln_add(d, kiln_transpose(x, 0, 1)));
    assert_non_null(strstr(kiln_last_error(), "kiln_tensor_to"));
    kiln_clear_error();
}

static void coverage_table_says_how_each_op_runs(void **state)
{
    int matmul = -1, on_cpu = -1; /* on_cpu: rope, still on the cpu there */
    for (int i = 0; i < kiln_op_count(); i++) {
        if (!strcmp(kiln_op_name(i), "matmul")) matmul = i;
        if (!strcmp(kiln_op_name(i), "rope")) on_cpu = i;
    }
    assert_true(matmul >= 0 && on_cpu >= 0);
    assert_int_equal(kiln_device_op_support("cpu", matmul), KILN_OP_NATIVE);
    assert_int_equal(kiln_device_op_support("npu:7", matmul), KILN_OP_NONE);
    if (!have_device("opencl:0")) skip();
    assert_int_equal(kiln_device_op_support("opencl", matmul), KILN_OP_NATIVE);
    assert_int_equal(kiln_device_op_support("opencl", on_cpu), KILN_OP_ON_CPU); /* not yet */
}

static void opencl_compiler_failure_is_a_structured_error(void **state)
{
    if (!have_device("opencl:0")) skip();
    kiln__backend *be = kiln__backend_find("opencl:0");
    void *k = NULL;
    assert_int_equal(be->compile_kernel(be, "__kernel void broken(__global float *x) { x[0] = y; }", "broken", &k),
                     KILN_ERR_COMPILE);
    assert_non_null(strstr(kiln_last_error(), "broken"));
    assert_non_null(strstr(kiln_last_error(), ".cl"));
    assert_non_null(strstr(kiln_last_error(), ".log"));
    kiln_clear_error();
}

typedef struct {
    int which;
} gen_ctx;

/* Three graphs the generator must handle: a pointwise chain, a softmax (a reduction
 * with a prologue and epilogue), and layer norm (two reductions, three outputs). */
static kiln_status small_graph(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const gen_ctx *c = ctx;
    if (c->which == 0) out[0] = kiln_gelu(kiln_add(kiln_mul(in[0], in[0]), in[0]), true);
    else if (c->which == 1) out[0] = kiln_softmax(in[0], 1);
    else out[0] = kiln_layer_norm(in[0], NULL, NULL, 1e-5);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void generated_cuda_c_compiles_with_nvrtc(void **state)
{
    skip_without_nvrtc();
    char *ptx = NULL;
    kiln_tensor_t *x = kiln_ones((int64_t[]){8, 40}, 2, KILN_DTYPE_F32);
    for (int which = 0; which < 3; which++) {
        gen_ctx c = {which};
        kiln_graph_t *g;
        assert_int_equal(kiln_graph_capture(small_graph, &c, &x, 1, &g), KILN_OK);
        assert_int_equal(kiln_graph_decompose(g, NULL), KILN_OK);
        kc_options o;
        kiln__compile_options(&o);
        kiln__program *p;
        assert_int_equal(kiln__program_build(g, &o, &p), KILN_OK);
        assert_true(p->n_k >= 1);
        char *src;
        assert_int_equal(kiln__codegen_cuda(p, &src), KILN_OK);
        kiln_status s = kiln__cuda_nvrtc(src, p->k[0].name, 9, 0, &ptx);
        if (s != KILN_OK) fail_msg("graph %d: %s\n%s", which, kiln_last_error(), src);
        for (int i = 0; i < p->n_k; i++) {
            char entry[128];
            snprintf(entry, sizeof entry, ".entry %s", p->k[i].name);
            if (!strstr(ptx, entry)) fail_msg("graph %d: the PTX has no %s", which, entry);
        }
        free(ptx);
        free(src);
        kiln__program_free(p);
        kiln_graph_free(g);
    }
    assert_int_equal(kiln__cuda_nvrtc(kiln__cuda_builtin_source(), "builtin", 9, 0, &ptx), KILN_OK);
    assert_non_null(strstr(ptx, ".entry kiln_adamw_"));
    free(ptx);
    /* A kernel NVRTC refuses: the error names it and keeps the source. */
    assert_int_equal(kiln__cuda_nvrtc("extern \"C\" __global__ void bad() { undefined_thing(); }", "bad", 9, 0, &ptx),
                     KILN_ERR_COMPILE);
    assert_non_null(strstr(kiln_last_error(), "bad"));
    assert_non_null(strstr(kiln_last_error(), ".cu"));
    kiln_clear_error();
}

/* Step it's batch (2 x 16 tokens of 40) and learning rate, as kiln_gpt_train_step takes them. */
static void step_batch(int it, kiln_tensor_t **in)
{
    int64_t x[2][16], y[2][16];
    for (int i = 0; i < 32; i++) x[i / 16][i % 16] = (i * 7 + it * 3) % 40, y[i / 16][i % 16] = (i * 5 + it) % 40;
    double lr = 3e-3 / (it + 1);
    in[0] = kiln_from_data(x, (int64_t[]){2, 16}, 2, KILN_DTYPE_I64);
    in[1] = kiln_from_data(y, (int64_t[]){2, 16}, 2, KILN_DTYPE_I64);
    in[2] = kiln_from_data(&lr, (int64_t[]){1}, 1, KILN_DTYPE_F64);
}

/* The twins' parameters are bitwise equal. */
static void same_weights(const char *device, const test_trainer *a, const test_trainer *b)
{
    for (int i = 0; i < a->np; i++) {
        int64_t n = kiln_tensor_numel(a->ps[i]);
        float *wa = malloc(sizeof(float) * (size_t)n), *wb = malloc(sizeof(float) * (size_t)n);
        assert_int_equal(kiln_tensor_to_host(a->ps[i], wa, sizeof(float) * (size_t)n), KILN_OK);
        assert_int_equal(kiln_tensor_to_host(b->ps[i], wb, sizeof(float) * (size_t)n), KILN_OK);
        if (memcmp(wa, wb, sizeof(float) * (size_t)n)) fail_msg("%s: parameter %d differs after the replays", device, i);
        free(wa);
        free(wb);
    }
}

/* Oracle: the same kiln_gpt_train_step run eagerly on a twin model (same seed). Step 1
 * recorded, steps 2..5 replayed, each on a new batch with a new learning rate: the
 * losses and the final weights are bitwise eager's (the same kernels, in the same
 * order, on the same values), on each device here. A new shape is refused. With moe,
 * every block is a mixture of 4 experts (top-2), whose routing changes from step to
 * step and is data of the recording: nothing of the block comes from host memory. */
static void replayed_training_steps_match_eager(const char *device, bool moe)
{
    assert_int_equal(kiln_set_device(device), KILN_OK);
    kiln_gpt_config cfg = test_small_gpt2(2);
    if (moe) cfg.mlp = KILN_MLP_SWIGLU, cfg.n_routed_experts = 4, cfg.moe_top_k = 2;
    test_trainer t[2];
    for (int k = 0; k < 2; k++) test_trainer_new(&t[k], &cfg, 3, 1.0);
    kiln_replay_t *r = NULL;
    for (int it = 0; it < 5; it++) {
        kiln_scope_begin();
        double got, want;
        kiln_tensor_t *in[3];
        step_batch(it, in);
        kiln_tensor_t *a[2], *b[2];
        int n;
        assert_int_equal(kiln_gpt_train_step(&t[0].step, in, 3, a, &n), KILN_OK);
        kiln_status s = it == 0 ? kiln_replay_record(kiln_gpt_train_step, &t[1].step, in, 3, &r, b, 2, &n)
                                : kiln_replay_run(r, in, 3, b, 2, &n);
        if (s != KILN_OK) fail_msg("%s step %d: %s", device, it, kiln_last_error());
        assert_int_equal(kiln_tensor_item(a[0], &want), KILN_OK);
        assert_int_equal(kiln_tensor_item(b[0], &got), KILN_OK);
        if (got != want) fail_msg("%s step %d: replayed loss %.9g, eager %.9g", device, it, got, want);
        kiln_scope_end();
    }
    assert_true(kiln_replay_num_launches(r) > 50);
    /* On opencl every launch of the step stays on the device, so the whole step is one
     * command buffer (the losses above came from it); the cpu has no capture entries. */
    char why[256];
    bool native = kiln_replay_native(r, why, sizeof why);
    if (moe) {
        /* (on opencl some of the block's index ops run on the cpu with copies) */
    } else if (!strcmp(device, "cpu")) {
        assert_false(native);
        assert_non_null(strstr(why, "no graph capture"));
    } else if (!native || !strstr(why, "own graph")) {
        fail_msg("%s: the step is %s", device, why);
    }
    same_weights(device, &t[0], &t[1]);
    assert_int_equal(kiln_optim_steps(t[1].opt), 5);
    kiln_scope_begin();
    double lr = 1e-3;
    kiln_tensor_t *wrong[3] = {kiln_zeros((int64_t[]){3, 16}, 2, KILN_DTYPE_I64), kiln_zeros((int64_t[]){3, 16}, 2, KILN_DTYPE_I64),
                               kiln_from_data(&lr, (int64_t[]){1}, 1, KILN_DTYPE_F64)}, *b[2];
    int n;
    assert_int_equal(kiln_replay_run(r, wrong, 3, b, 2, &n), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "record it again"));
    kiln_clear_error();
    kiln_scope_end();
    kiln_replay_free(r);
    for (int k = 0; k < 2; k++) test_trainer_free(&t[k]);
    kiln_set_device("cpu");
}

static void replay_on_cpu(void **state) { replayed_training_steps_match_eager("cpu", false); }
static void moe_replay_on_cpu(void **state) { replayed_training_steps_match_eager("cpu", true); }

static void replay_on_opencl(void **state)
{
    if (!have_device("opencl:0")) skip();
    replayed_training_steps_match_eager("opencl:0", false);
}

static void moe_replay_on_opencl(void **state)
{
    if (!have_device("opencl:0")) skip();
    replayed_training_steps_match_eager("opencl:0", true);
}

/* The compiled training step called inside a recording (ctx: the compiled step). */
static kiln_status call_compiled_step(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    return kiln_compiled_call(ctx, in, n_in, out, 2, n_out);
}

/* A compiled training step recorded as a replay: its generated kernels are launches of
 * the replay too. Oracle: the same compiled step on a twin model, called each step
 * (the same kernels in the same order on the same values): losses and final weights
 * bitwise equal, on each device here. Step 1 compiles (a capture inside a recording is
 * refused, with the reason), step 2 is recorded, steps 3..6 replayed. */
static void replayed_compiled_steps_match_compiled(const char *device)
{
    assert_int_equal(kiln_set_device(device), KILN_OK);
    kiln_gpt_config cfg = test_small_gpt2(2);
    test_trainer t[2];
    kiln_compiled_t *c[2];
    for (int k = 0; k < 2; k++) {
        test_trainer_new(&t[k], &cfg, 3, 1.0);
        assert_int_equal(kiln_compiled_new(kiln_gpt_train_step, &t[k].step, "train_step", &c[k]), KILN_OK);
    }
    kiln_replay_t *r = NULL;
    for (int it = 0; it < 6; it++) {
        kiln_scope_begin();
        double got, want;
        kiln_tensor_t *in[3];
        step_batch(it, in);
        kiln_tensor_t *a[2], *b[2];
        int n;
        assert_int_equal(kiln_compiled_call(c[0], in, 3, a, 2, &n), KILN_OK);
        if (it == 0) { /* compiling inside a recording is refused; then compiled as usual */
            kiln_status s = kiln_replay_record(call_compiled_step, c[1], in, 3, &r, b, 2, &n);
            if (s != KILN_ERR_UNSUPPORTED || !strstr(kiln_last_error(), "call it once") || r)
                fail_msg("%s: recording a first call: status %d, %s", device, s, kiln_last_error());
            kiln_clear_error();
        }
        kiln_status s = it == 0   ? kiln_compiled_call(c[1], in, 3, b, 2, &n)
                        : it == 1 ? kiln_replay_record(call_compiled_step, c[1], in, 3, &r, b, 2, &n)
                                  : kiln_replay_run(r, in, 3, b, 2, &n);
        if (s != KILN_OK) fail_msg("%s step %d: %s", device, it, kiln_last_error());
        assert_int_equal(kiln_tensor_item(a[0], &want), KILN_OK);
        assert_int_equal(kiln_tensor_item(b[0], &got), KILN_OK);
        if (got != want) fail_msg("%s step %d: replayed loss %.9g, compiled %.9g", device, it, got, want);
        kiln_scope_end();
    }
    int kernels, ops;
    assert_int_equal(kiln_compiled_plan(c[1], 0, &kernels, &ops, NULL, NULL), KILN_OK);
    assert_true(kernels > 5);
    if (kiln_replay_num_launches(r) < kernels) fail_msg("%s: %d launches for %d generated kernels", device,
                                                        kiln_replay_num_launches(r), kernels);
    same_weights(device, &t[0], &t[1]);
    kiln_replay_free(r); /* before the compiled step its launches run */
    for (int k = 0; k < 2; k++) {
        kiln_compiled_free(c[k]);
        test_trainer_free(&t[k]);
    }
    kiln_set_device("cpu");
}

static void compiled_replay_on_cpu(void **state) { replayed_compiled_steps_match_compiled("cpu"); }

static void compiled_replay_on_opencl(void **state)
{
    if (!have_device("opencl:0")) skip();
    replayed_compiled_steps_match_compiled("opencl:0");
}

/* A step whose every launch stays on the device: w += -0.1 * softmax(layer_norm(gelu(x @ w)))
 * (matmul and add_ are the backend's kernels, the rest generated), returning y. */
static kiln_status device_step(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    kiln_tensor_t *w = ctx;
    kiln_tensor_t *y = kiln_softmax(kiln_layer_norm(kiln_gelu(kiln_matmul(in[0], w), true), NULL, NULL, 1e-5), -1);
    kiln_status s = y ? kiln_add_(w, y, -0.1) : kiln_last_status();
    out[0] = y;
    *n_out = 1;
    return s;
}

/* Oracle: the same step run eagerly on a twin weight. Recorded once, the launch list is
 * captured as the device's own graph (a command buffer through cl_khr_command_buffer on
 * PoCL, a CUDA graph on a GPU); each run on
 * new inputs gives eager's outputs and leaves eager's weight, bitwise (the same kernels
 * on the same values), so the buffer reads the new contents of its input and carries
 * the in-place update from run to run. */
static void replay_as_a_device_graph(const char *dev)
{
    assert_int_equal(kiln_set_device(dev), KILN_OK);
    float w0[64], x0[64];
    for (int i = 0; i < 64; i++) w0[i] = (float)((i * 37 % 17) - 8) / 16.0f;
    kiln_tensor_t *we = kiln_tensor_to(kiln_from_data(w0, (int64_t[]){8, 8}, 2, KILN_DTYPE_F32), dev);
    kiln_tensor_t *wr = kiln_tensor_to(kiln_from_data(w0, (int64_t[]){8, 8}, 2, KILN_DTYPE_F32), dev);
    kiln_replay_t *r = NULL;
    for (int it = 0; it < 5; it++) {
        kiln_scope_begin();
        for (int i = 0; i < 64; i++) x0[i] = (float)(((i + 5 * it) * 13 % 23) - 11) / 8.0f;
        kiln_tensor_t *x = kiln_tensor_to(kiln_from_data(x0, (int64_t[]){8, 8}, 2, KILN_DTYPE_F32), dev);
        kiln_tensor_t *ye, *yr;
        int n;
        assert_int_equal(device_step(we, &x, 1, &ye, &n), KILN_OK);
        kiln_status s = it == 0 ? kiln_replay_record(device_step, wr, &x, 1, &r, &yr, 1, &n) : kiln_replay_run(r, &x, 1, &yr, 1, &n);
        if (s != KILN_OK) fail_msg("step %d: %s", it, kiln_last_error());
        if (it == 0) {
            char why[256];
            if (!kiln_replay_native(r, why, sizeof why)) fail_msg("not captured: %s", why);
            assert_non_null(strstr(why, "'s own graph"));
        }
        float a[64], b[64];
        assert_int_equal(kiln_tensor_to_host(ye, a, sizeof a), KILN_OK);
        assert_int_equal(kiln_tensor_to_host(yr, b, sizeof b), KILN_OK);
        if (memcmp(a, b, sizeof a)) fail_msg("%s step %d: the device graph's output differs from eager's", dev, it);
        kiln_scope_end();
    }
    float a[64], b[64];
    assert_int_equal(kiln_tensor_to_host(we, a, sizeof a), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(wr, b, sizeof b), KILN_OK);
    assert_memory_equal(a, b, sizeof a);
    assert_true(memcmp(a, w0, sizeof a) != 0); /* the updates happened */
    kiln_replay_free(r);
    kiln_set_device("cpu");
}

static void replay_as_a_command_buffer(void **state)
{
    if (!have_device("opencl:0")) skip();
    replay_as_a_device_graph("opencl:0");
}

static void replay_as_a_cuda_graph(void **state)
{
    if (!have_device("cuda:0")) {
        print_message("skipped: no cuda device (%s)\n", kiln_cuda_status());
        skip();
    }
    replay_as_a_device_graph("cuda:0");
}

/* A copy_ to another dtype: the backend's copy_ kernel hands it to the cpu (through the
 * host), which a command buffer cannot hold. */
static kiln_status casts_through_the_host(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    kiln_tensor_t *y = kiln_gelu(in[0], true), *z = ctx;
    kiln_status s = y ? kiln_tensor_copy_(z, y) : kiln_last_status();
    out[0] = z;
    *n_out = 1;
    return s;
}

/* A list with a kernel that goes through the host cannot be a command buffer: the
 * capture fails there, says where, and the launch list runs instead, reading new inputs
 * (oracle: eager on the same values, bitwise). */
static void a_list_that_reads_back_stays_a_launch_list(void **state)
{
    if (!have_device("opencl:0")) skip();
    assert_int_equal(kiln_set_device("opencl:0"), KILN_OK);
    kiln_tensor_t *ze = kiln_zeros((int64_t[]){6, 4}, 2, KILN_DTYPE_F64), *zr = kiln_zeros((int64_t[]){6, 4}, 2, KILN_DTYPE_F64);
    kiln_replay_t *r = NULL;
    for (int it = 0; it < 3; it++) {
        kiln_scope_begin();
        float v[24];
        for (int i = 0; i < 24; i++) v[i] = (float)((i * 5 + it * 3) % 13) / 4.0f - 1.5f;
        kiln_tensor_t *x = kiln_tensor_to(kiln_from_data(v, (int64_t[]){6, 4}, 2, KILN_DTYPE_F32), "opencl:0"), *ye, *yr;
        int n;
        assert_int_equal(casts_through_the_host(ze, &x, 1, &ye, &n), KILN_OK);
        kiln_status s = it == 0 ? kiln_replay_record(casts_through_the_host, zr, &x, 1, &r, &yr, 1, &n)
                                : kiln_replay_run(r, &x, 1, &yr, 1, &n);
        if (s != KILN_OK) fail_msg("step %d: %s", it, kiln_last_error());
        char why[256];
        assert_false(kiln_replay_native(r, why, sizeof why));
        if (!strstr(why, "could not capture it at launch 1 (copy_)") || !strstr(why, "a copy to the host"))
            fail_msg("why: %s", why);
        double a[24], b[24];
        assert_int_equal(kiln_tensor_to_host(ye, a, sizeof a), KILN_OK);
        assert_int_equal(kiln_tensor_to_host(yr, b, sizeof b), KILN_OK);
        assert_memory_equal(a, b, sizeof a);
        kiln_scope_end();
    }
    kiln_replay_free(r);
    kiln_set_device("cpu");
}

/* embedding, captured: indices are checked by the kernel into the device's error word
 * (no host between the commands), so a bad index on a later run is KILN_ERR_INDEX from
 * that run, not a read outside the table; a good run after it works again. */
static kiln_status embeds(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    out[0] = kiln_gelu(kiln_embedding(ctx, in[0]), true);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void a_bad_index_in_a_captured_step_is_an_error(void **state)
{
    if (!have_device("opencl:0")) skip();
    assert_int_equal(kiln_set_device("opencl:0"), KILN_OK);
    float w0[40];
    for (int i = 0; i < 40; i++) w0[i] = (float)(i % 9) / 4.0f - 1.0f;
    kiln_tensor_t *w = kiln_tensor_to(kiln_from_data(w0, (int64_t[]){10, 4}, 2, KILN_DTYPE_F32), "opencl:0");
    int64_t good[6] = {1, 2, 3, 4, 5, 9}, bad[6] = {1, 2, 99, 4, 5, 9};
    kiln_tensor_t *x = kiln_tensor_to(kiln_from_data(good, (int64_t[]){6}, 1, KILN_DTYPE_I64), "opencl:0"), *y, *ye;
    kiln_tensor_t *xb = kiln_tensor_to(kiln_from_data(bad, (int64_t[]){6}, 1, KILN_DTYPE_I64), "opencl:0");
    kiln_replay_t *r = NULL;
    int n;
    assert_int_equal(kiln_replay_record(embeds, w, &x, 1, &r, &y, 1, &n), KILN_OK);
    char why[256];
    if (!kiln_replay_native(r, why, sizeof why)) fail_msg("not captured: %s", why);
    assert_int_equal(kiln_replay_run(r, &xb, 1, &y, 1, &n), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "replayed step"));
    kiln_clear_error();
    assert_int_equal(embeds(w, &xb, 1, &ye, &n), KILN_ERR_INDEX); /* eagerly: the host says which */
    assert_non_null(strstr(kiln_last_error(), "index 99 at position 2"));
    kiln_clear_error();
    /* (the run above copied the bad indices into x, the recorded input: good ones anew) */
    kiln_tensor_t *x2 = kiln_tensor_to(kiln_from_data(good, (int64_t[]){6}, 1, KILN_DTYPE_I64), "opencl:0");
    assert_int_equal(kiln_replay_run(r, &x2, 1, &y, 1, &n), KILN_OK);
    assert_int_equal(embeds(w, &x2, 1, &ye, &n), KILN_OK);
    float a[24], b[24];
    assert_int_equal(kiln_tensor_to_host(y, a, sizeof a), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(ye, b, sizeof b), KILN_OK);
    assert_memory_equal(a, b, sizeof a);
    kiln_replay_free(r);
    kiln_set_device("cpu");
}

static kiln_status reads_a_value(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    double v;
    kiln_status s = kiln_tensor_item(kiln_sum(in[0], NULL, 0, false), &v);
    out[0] = in[0];
    *n_out = 1;
    return s;
}

static kiln_status writes_from_host(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    float v[4] = {1, 2, 3, 4};
    out[0] = kiln_add(in[0], kiln_from_data(v, (int64_t[]){4}, 1, KILN_DTYPE_F32));
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void recording_refuses_reads_and_random_ops(void **state)
{
    kiln_tensor_t *x = kiln_ones((int64_t[]){4}, 1, KILN_DTYPE_F32), *out[1];
    kiln_replay_t *r = (kiln_replay_t *)1;
    int n;
    assert_int_equal(kiln_replay_record(reads_a_value, NULL, &x, 1, &r, out, 1, &n), KILN_ERR_UNSUPPORTED);
    assert_null(r);
    assert_non_null(strstr(kiln_last_error(), "recording a replay"));
    kiln_clear_error();
    /* A write from host memory is not a launch: it would not be replayed. */
    assert_int_equal(kiln_replay_record(writes_from_host, NULL, &x, 1, &r, out, 1, &n), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "from_host"));
    kiln_clear_error();
}

/* Pinned memory is optional: where a backend has none (cpu, OpenCL), pinning says so
 * and succeeds; a NULL or empty buffer is nothing to pin; a checkpoint of device tensors
 * (which pins its staging buffer where it can) saves and loads back bitwise. */
static void pinning_is_optional_and_checkpoints_work_without_it(void **state)
{
    bool pinned = true;
    char buf[64];
    assert_int_equal(kiln_host_pin("cpu", buf, sizeof buf, &pinned), KILN_OK);
    assert_false(pinned);
    pinned = true;
    assert_int_equal(kiln_host_pin("cpu", NULL, 0, &pinned), KILN_OK);
    assert_false(pinned);
    assert_int_equal(kiln_host_unpin("cpu", NULL), KILN_OK);
    assert_int_equal(kiln_host_pin("npu:7", buf, sizeof buf, &pinned), KILN_ERR_DEVICE);
    kiln_clear_error();
    if (!have_device("opencl:0")) skip();
    assert_int_equal(kiln_host_pin("opencl", buf, sizeof buf, &pinned), KILN_OK);
    assert_false(pinned);
    float v[6] = {1, 2, 3, 4, 5, 6}, back[6];
    kiln_tensor_t *t = kiln_tensor_to(kiln_from_data(v, (int64_t[]){2, 3}, 2, KILN_DTYPE_F32), "opencl");
    const char *names[1] = {"w"};
    char path[] = "/tmp/kiln-pin-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK);
    kiln_safetensors_t *f;
    assert_int_equal(kiln_safetensors_load(path, &f), KILN_OK);
    kiln_tensor_t *w = kiln_safetensors_get(f, "w");
    assert_non_null(w);
    assert_int_equal(kiln_tensor_to_host(w, back, sizeof back), KILN_OK);
    assert_memory_equal(back, v, sizeof v);
    kiln_safetensors_free(f);
    unlink(path);
}

/* One process: collectives on device tensors are copies on that device (the data is
 * already where it goes); oracle: the input values. */
static void one_rank_collectives_on_a_device(void **state)
{
    if (!have_device("opencl:0")) skip();
    kiln_pg_t *pg;
    assert_int_equal(kiln_pg_new_from_env(&pg), KILN_OK);
    assert_int_equal(kiln_pg_world_size(pg), 1);
    float v[4] = {1, 2, 3, 4}, back[4];
    kiln_tensor_t *in = kiln_tensor_to(kiln_from_data(v, (int64_t[]){4}, 1, KILN_DTYPE_F32), "opencl");
    kiln_tensor_t *out = kiln_tensor_to(kiln_zeros((int64_t[]){4}, 1, KILN_DTYPE_F32), "opencl");
    assert_int_equal(kiln_pg_allgather(pg, in, out), KILN_OK);
    assert_int_equal(kiln_pg_allreduce(pg, in, KILN_REDUCE_AVG), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(out, back, sizeof back), KILN_OK);
    assert_memory_equal(back, v, sizeof v);
    assert_int_equal(kiln_tensor_to_host(in, back, sizeof back), KILN_OK);
    assert_memory_equal(back, v, sizeof v);
    kiln_pg_free(pg);
}

/* A model made on opencl:0 and trained while the current device is the cpu: the
 * optimizer's state, the backward formulas' zeros and scalars follow the tensors, and
 * the loss is the cpu twin's (oracle: the same step on the cpu, within 1e-5). */
static void a_step_follows_the_model_device(void **state)
{
    if (!have_device("opencl:0")) skip();
    kiln_gpt_config cfg = kiln_gpt_config_gpt2();
    cfg.n_layer = 1;
    cfg.n_head = 2;
    cfg.n_kv_head = 2;
    cfg.n_embd = 16;
    cfg.block_size = 8;
    cfg.vocab_size = 20;
    double loss[2][2];
    for (int k = 0; k < 2; k++) {
        assert_int_equal(kiln_set_device(k ? "opencl" : "cpu"), KILN_OK);
        test_trainer t;
        test_trainer_new(&t, &cfg, 1, 1.0);
        int64_t x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8] = {2, 3, 4, 5, 6, 7, 8, 9};
        kiln_tensor_t *in[3] = {kiln_from_data(x, (int64_t[]){1, 8}, 2, KILN_DTYPE_I64),
                                kiln_from_data(y, (int64_t[]){1, 8}, 2, KILN_DTYPE_I64), NULL};
        kiln_set_device("cpu"); /* the model stays where it was made */
        double lr = 1e-2;
        in[2] = kiln_from_data(&lr, (int64_t[]){1}, 1, KILN_DTYPE_F64);
        for (int it = 0; it < 2; it++) {
            kiln_tensor_t *out[2];
            int n;
            kiln_status s = kiln_gpt_train_step(&t.step, in, 3, out, &n);
            if (s != KILN_OK) fail_msg("device %d step %d: %s", k, it, kiln_last_error());
            assert_int_equal(kiln_tensor_item(out[0], &loss[k][it]), KILN_OK);
        }
        test_trainer_free(&t);
    }
    for (int it = 0; it < 2; it++)
        if (!(fabs(loss[1][it] - loss[0][it]) <= 1e-5 * fabs(loss[0][it])))
            fail_msg("step %d: opencl %.9g, cpu %.9g", it, loss[1][it], loss[0][it]);
}

/* Attention at the size of config S (B=8 of its 16, H=4, T=128, D=64, causal), forward
 * and backward, on opencl:0 against the cpu's kernels (oracle; 1e-4 relative: the device
 * sums in another order). Small shapes do not show what a full grid does. */
static void attention_at_full_size_matches_the_cpu(void **state)
{
    if (!have_device("opencl:0")) skip();
    int64_t sh[4] = {8, 4, 128, 64};
    kiln_manual_seed(11);
    kiln_tensor_t *q = kiln_randn(sh, 4, KILN_DTYPE_F32), *k = kiln_randn(sh, 4, KILN_DTYPE_F32);
    kiln_tensor_t *v = kiln_randn(sh, 4, KILN_DTYPE_F32), *g = kiln_randn(sh, 4, KILN_DTYPE_F32);
    kiln_tensor_t *res[2][4];
    for (int dev = 0; dev < 2; dev++) {
        const char *name = dev ? "opencl" : "cpu";
        kiln_tensor_t *qq = kiln_tensor_to(q, name), *kk = kiln_tensor_to(k, name), *vv = kiln_tensor_to(v, name);
        kiln_tensor_set_requires_grad(qq, true);
        kiln_tensor_set_requires_grad(kk, true);
        kiln_tensor_set_requires_grad(vv, true);
        kiln_tensor_t *o = kiln_attention(qq, kk, vv, true, 0.125);
        assert_non_null(o);
        assert_int_equal(kiln_backward_with(o, kiln_tensor_to(g, name)), KILN_OK);
        res[dev][0] = kiln_tensor_to(o, "cpu");
        res[dev][1] = kiln_tensor_to(kiln_tensor_grad(qq), "cpu");
        res[dev][2] = kiln_tensor_to(kiln_tensor_grad(kk), "cpu");
        res[dev][3] = kiln_tensor_to(kiln_tensor_grad(vv), "cpu");
    }
    int64_t n = 8 * 4 * 128 * 64;
    float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(kiln_tensor_to_host(res[1][r], a, sizeof(float) * (size_t)n), KILN_OK);
        assert_int_equal(kiln_tensor_to_host(res[0][r], b, sizeof(float) * (size_t)n), KILN_OK);
        double worst = 0;
        for (int64_t i = 0; i < n; i++) {
            double e = fabs((double)a[i] - b[i]) / (1 + fabs((double)b[i]));
            if (e > worst || e != e) worst = e != e ? INFINITY : e;
        }
        if (!(worst <= 1e-4)) fail_msg("result %d (o, dq, dk, dv): opencl differs from the cpu by %g", r, worst);
    }
    free(a);
    free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(registration_checks_version_and_entries, setup, teardown),
        cmocka_unit_test_setup_teardown(a_missing_device_is_a_clear_error, setup, teardown),
        cmocka_unit_test_setup_teardown(tensors_move_and_mixed_devices_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(coverage_table_says_how_each_op_runs, setup, teardown),
        cmocka_unit_test_setup_teardown(opencl_compiler_failure_is_a_structured_error, setup, teardown),
        cmocka_unit_test_setup_teardown(generated_cuda_c_compiles_with_nvrtc, setup, teardown),
        cmocka_unit_test_setup_teardown(replay_on_cpu, setup, teardown),
        cmocka_unit_test_setup_teardown(replay_on_opencl, setup, teardown),
        cmocka_unit_test_setup_teardown(moe_replay_on_cpu, setup, teardown),
        cmocka_unit_test_setup_teardown(moe_replay_on_opencl, setup, teardown),
        cmocka_unit_test_setup_teardown(compiled_replay_on_cpu, setup, teardown),
        cmocka_unit_test_setup_teardown(compiled_replay_on_opencl, setup, teardown),
        cmocka_unit_test_setup_teardown(replay_as_a_command_buffer, setup, teardown),
        cmocka_unit_test_setup_teardown(replay_as_a_cuda_graph, setup, teardown),
        cmocka_unit_test_setup_teardown(a_list_that_reads_back_stays_a_launch_list, setup, teardown),
        cmocka_unit_test_setup_teardown(a_bad_index_in_a_captured_step_is_an_error, setup, teardown),
        cmocka_unit_test_setup_teardown(recording_refuses_reads_and_random_ops, setup, teardown),
        cmocka_unit_test_setup_teardown(pinning_is_optional_and_checkpoints_work_without_it, setup, teardown),
        cmocka_unit_test_setup_teardown(one_rank_collectives_on_a_device, setup, teardown),
        cmocka_unit_test_setup_teardown(a_step_follows_the_model_device, setup, teardown),
        cmocka_unit_test_setup_teardown(attention_at_full_size_matches_the_cpu, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
