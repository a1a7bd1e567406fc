/* bench/adamw: the AdamW update of every parameter of reference config S (GPT-2 style,
 * 4 layers, C = 256), two ways in one run: eagerly, one call of the backend's fused
 * adamw_ kernel per parameter (the peer), and compiled, where the update is decomposed
 * into primitives and each parameter's becomes one generated kernel that stores p, m
 * and v in place. Prints one JSON line with the median ms per update over ROUNDS
 * interleaved rounds of N updates each, eager / compiled, and the largest difference
 * between the two runs' parameters after the same updates.
 *   build/bench_adamw [--threads N] [--updates N] [--rounds N] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/graph.h"
#include "kiln/kiln.h"
#include "kiln/nn.h"
#include "kiln/ops.h"

typedef struct {
    int n;
    kiln_tensor_t **p, **g, **m, **v, *gscale;
} state;

static kiln_status update(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    state *s = ctx;
    *n_out = 0;
    for (int i = 0; i < s->n; i++) {
        kiln_status st = kiln_adamw_step_(s->p[i], s->g[i], s->m[i], s->v[i], in[0], in[1], s->gscale, 0.9, 0.95, 1e-8, 0.1);
        if (st != KILN_OK) return st;
    }
    return KILN_OK;
}

static void state_new(const kiln_gpt_t *model, state *s)
{
    s->n = kiln_gpt_num_params(model);
    kiln_tensor_t ***arr[4] = {&s->p, &s->g, &s->m, &s->v};
    for (int a = 0; a < 4; a++) *arr[a] = calloc((size_t)s->n, sizeof(kiln_tensor_t *));
    for (int i = 0; i < s->n; i++) {
        kiln_tensor_t *w = kiln_gpt_param(model, i, NULL);
        const int64_t *sh = kiln_tensor_shape(w);
        int nd = kiln_tensor_ndim(w);
        s->p[i] = kiln_keep(kiln_clone(w));
        kiln_manual_seed(100 + (uint64_t)i);
        s->g[i] = kiln_keep(kiln_mul(kiln_randn(sh, nd, KILN_DTYPE_F32), kiln_scalar(1e-2, KILN_DTYPE_F32)));
        s->m[i] = kiln_keep(kiln_zeros(sh, nd, KILN_DTYPE_F32));
        s->v[i] = kiln_keep(kiln_zeros(sh, nd, KILN_DTYPE_F32));
    }
    double one = 1;
    s->gscale = kiln_keep(kiln_from_data(&one, (int64_t[]){1}, 1, KILN_DTYPE_F64));
}

static int cmp(const void *a, const void *b) { return bench_cmp_double(a, b); }

int main(int argc, char **argv)
{
    int threads = 2, updates = 20, rounds = 5;
    for (int i = 1; i < argc; i++) {
        bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--updates") && has) updates = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && has) rounds = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_adamw [--threads N] [--updates N] [--rounds 1..64]\n");
            return 2;
        }
    }
    if (threads < 1 || updates < 1 || rounds < 1 || rounds > 64) {
        fprintf(stderr, "bench_adamw: --threads and --updates must be >= 1, --rounds 1..64\n");
        return 2;
    }
    kiln_init(threads);
    kiln_set_grad_enabled(false); /* an optimizer's update, not something to differentiate */
    kiln_gpt_config cfg = kiln_gpt_config_gpt2();
    kiln_gpt_t *model;
    if (kiln_gpt_new(&cfg, 1234, &model) != KILN_OK) {
        fprintf(stderr, "bench_adamw: %s\n", kiln_last_error());
        return 1;
    }
    state eager, comp;
    state_new(model, &eager);
    state_new(model, &comp);
    kiln_compiled_t *fc;
    if (kiln_compiled_new(update, &comp, "adamw", &fc) != KILN_OK) {
        fprintf(stderr, "bench_adamw: %s\n", kiln_last_error());
        return 1;
    }
    double te[64], tc[64], lr = 1e-3;
    int64_t one = 1, t[2] = {0, 0};
    for (int r = 0; r < rounds; r++) {
        for (int mode = 0; mode < 2; mode++) {
            double t0 = bench_now_s();
            for (int u = 0; u < updates; u++) {
                kiln_scope_begin();
                double step = (double)(++t[mode]);
                kiln_tensor_t *in[2] = {kiln_from_data(&lr, &one, 1, KILN_DTYPE_F64),
                                        kiln_from_data(&step, &one, 1, KILN_DTYPE_F64)};
                kiln_tensor_t *none[1];
                int n;
                kiln_status s = mode ? kiln_compiled_call(fc, in, 2, none, 1, &n) : update(&eager, in, 2, none, &n);
                kiln_scope_end();
                if (s != KILN_OK) {
                    fprintf(stderr, "bench_adamw: %s\n", kiln_last_error());
                    return 1;
                }
            }
            (mode ? tc : te)[r] = (bench_now_s() - t0) / updates * 1e3;
        }
    }
    qsort(te, (size_t)rounds, sizeof(double), cmp);
    qsort(tc, (size_t)rounds, sizeof(double), cmp);
    /* Both ran the same updates: their parameters agree to rounding (checked here so
     * that a fast wrong kernel cannot pass for a fast one). */
    double worst = 0;
    for (int i = 0; i < eager.n; i++) {
        kiln_tensor_t *d = kiln_max(kiln_abs(kiln_sub(eager.p[i], comp.p[i])), NULL, 0, false);
        double x;
        if (!d || kiln_tensor_item(d, &x) != KILN_OK) return 1;
        if (x > worst || x != x) worst = x != x ? 1e30 : x;
    }
    int kernels = 0, ops = 0;
    kiln_compiled_plan(fc, 0, &kernels, &ops, NULL, NULL);
    printf("{\"bench\":\"adamw\",\"params\":%d,\"elements\":%lld,\"threads\":%d,\"eager_ms\":%.3f,\"compiled_ms\":%.3f,"
           "\"eager_over_compiled\":%.3f,\"kernels\":%d,\"ops\":%d,\"max_abs_diff\":%.3g}\n", eager.n, (long long)kiln_gpt_param_elements(model),
           threads, te[rounds / 2], tc[rounds / 2], te[rounds / 2] / tc[rounds / 2], kernels, ops, worst);
    kiln_compiled_free(fc);
    kiln_gpt_free(model);
    return 0;
}
