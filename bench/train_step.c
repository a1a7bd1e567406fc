/* bench/train_step: kiln training steps on reference config S (GPT-2 style, byte vocab
 * 256, T=128, C=256, 4 layers, 4 heads, B=16; forward, backward, clipping at norm 1,
 * AdamW: kiln_gpt_train_step), eager or with --compile as one compiled graph, either of
 * them with --replay recorded once and replayed without dispatch; the same
 * model, batch shape and step as tests/reference/train_step_torch.py. Prints one JSON line: median
 * tokens/s over the timed steps, peak RSS, and model FLOP utilisation against a given
 * peak. Run both through bench/train_step.sh, which reports the ratio. With --dist (under
 * mpirun) each rank takes its share of the batch of 16 and the gradients are averaged
 * (data-parallel), and with --expert-parallel the MoE blocks' experts are sharded over
 * the ranks; rank 0 prints, with the share of the step spent in the all-to-alls and in
 * the allreduces (bench/train_step_ep.sh). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include "bench.h"
#include "kiln/kiln.h"
#include "kiln/nn.h"
#include "kiln/optim.h"
#include "kiln/graph.h"

#define USAGE                                                                                           \
    "usage: bench_train_step [--threads N] [--steps N] [--warmup N] [--peak-gflops G]\n"                \
    "                        [--model gpt2|llama] [--compile] [--replay] [--device NAME] [--small]\n"        \
    "                        [--precision f32|bf16|f16]\n"                                            \
    "                        [--experts E --top-k K --shared S --expert-ffn F]  (--model llama: MoE blocks)\n" \
    "                        [--dist [--expert-parallel]]  (under mpirun: data-parallel, experts sharded)\n"

/* The compiled step, as a function a replay records (ctx: the compiled step). */
static kiln_status call_compiled(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    return kiln_compiled_call(ctx, in, n_in, out, 2, n_out);
}

int main(int argc, char **argv)
{
    int threads = 0, steps = 20, warmup = 3;
    double peak_gflops = 0;
    const char *model = "gpt2", *device = "cpu", *precision = "f32";
    bool compile = false, replay = false, small = false, dist = false, ep = false;
    int experts = 0, top_k = 2, shared = 0, expert_ffn = 0;
    for (int i = 1; i < argc; i += 2) {
        if (!strcmp(argv[i], "--compile")) {
            compile = true;
            i--;
        } else if (!strcmp(argv[i], "--replay")) {
            replay = true;
            i--;
        } else if (!strcmp(argv[i], "--small")) {
            small = true;
            i--;
        } else if (!strcmp(argv[i], "--dist") || !strcmp(argv[i], "--expert-parallel")) {
            dist = true;
            ep |= !strcmp(argv[i], "--expert-parallel");
            i--;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("%s", USAGE);
            return 0;
        } else if (i + 1 >= argc) {
            fprintf(stderr, "bench_train_step: %s needs a value\n", argv[i]);
            return 2;
        } else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--device")) device = argv[i + 1];
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--warmup")) warmup = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--peak-gflops")) peak_gflops = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--model")) model = argv[i + 1];
        else if (!strcmp(argv[i], "--precision")) precision = argv[i + 1];
        else if (!strcmp(argv[i], "--experts")) experts = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--top-k")) top_k = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--shared")) shared = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--expert-ffn")) expert_ffn = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench_train_step: unknown option %s\n%s", argv[i], USAGE);
            return 2;
        }
    }
    if (steps < 1) steps = 1;
    kiln_init(threads);
    if (kiln_set_device(device) != KILN_OK) {
        fprintf(stderr, "bench_train_step: %s\n", kiln_last_error());
        return 1;
    }
    kiln_gpt_config c = strcmp(model, "llama") ? kiln_gpt_config_gpt2() : kiln_gpt_config_llama();
    if (small) { /* where per-op overhead shows: 2 layers, C=64, T=32 */
        c.n_layer = 2;
        c.n_embd = 64;
        c.block_size = 32;
    }
    c.n_routed_experts = experts; /* every block an MoE block (docs/model.md) */
    c.moe_top_k = top_k;
    c.n_shared_experts = shared;
    c.moe_ffn = expert_ffn;
    kiln_gpt_t *m;
    if (kiln_gpt_new(&c, 1234, &m) != KILN_OK) {
        fprintf(stderr, "bench_train_step: %s\n", kiln_last_error());
        return 1;
    }
    kiln_dtype prec;
    if (kiln_dtype_parse(precision, &prec) != KILN_OK || kiln_gpt_set_precision(m, prec) != KILN_OK) {
        fprintf(stderr, "bench_train_step: --precision %s: f32, bf16 or f16\n", precision);
        return 2;
    }
    double n_params = (double)kiln_gpt_param_elements(m); /* before any sharding */
    kiln_pg_t *pg = NULL;
    if (dist && (kiln_pg_new_from_env(&pg) != KILN_OK || (ep && kiln_gpt_shard_experts(m, pg) != KILN_OK))) {
        fprintf(stderr, "bench_train_step: %s\n", kiln_last_error());
        return 1;
    }
    int rank = kiln_pg_rank(pg), world = kiln_pg_world_size(pg);
    int np = kiln_gpt_num_params(m);
    kiln_tensor_t **ps = malloc(sizeof *ps * (size_t)np);
    for (int i = 0; i < np; i++) ps[i] = kiln_gpt_param(m, i, NULL);
    kiln_optim_t *opt;
    kiln_adamw_new(ps, np, NULL, 0.9, 0.95, 1e-8, 0.1, &opt);
    const int B = 16, T = c.block_size, Bl = B / world; /* the global batch, this rank's share */
    if (B % world) {
        fprintf(stderr, "bench_train_step: the batch of %d does not split over %d ranks\n", B, world);
        return 2;
    }
    int64_t *buf = malloc(sizeof *buf * (size_t)(B * (T + 1)));
    double *times = malloc(sizeof *times * (size_t)steps);
    uint64_t rng = 42;
    kiln_compiled_t *step = NULL;
    kiln_replay_t *rp = NULL; /* --replay: step 1 recorded, the rest replayed */
    kiln_loss_scaler scaler = kiln_loss_scaler_default(); /* f16: torch.amp.GradScaler's defaults, as the peer */
    /* forward, backward, clipping at norm 1, AdamW */
    kiln_gpt_step fn = {m, opt, ps, np, 1.0, 1, world > 1 ? pg : NULL, NULL, prec == KILN_DTYPE_F16};
    int n_in = 3 + fn.scaled; /* f16: the loss scale is the step's fourth input */
    if (compile && kiln_compiled_new(kiln_gpt_train_step, &fn, "train_step", &step) != KILN_OK) {
        fprintf(stderr, "bench_train_step: %s\n", kiln_last_error());
        return 1;
    }
    double first_call_s = 0, a2a0 = 0, a2a1 = 0, ar0 = 0, ar1 = 0;
    for (int s = 0; s < warmup + steps; s++) {
        if (pg && s == warmup) {
            kiln_pg_time_in(pg, "all_to_all", NULL, &a2a0);
            kiln_pg_time_in(pg, "allreduce", NULL, &ar0);
        }
        for (int i = 0; i < B * (T + 1); i++) {
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            buf[i] = (int64_t)(rng >> 56);
        }
        double t0 = bench_now_s();
        kiln_scope_begin();
        kiln_tensor_t *all = kiln_from_data(buf + (size_t)rank * Bl * (T + 1), (int64_t[]){Bl, T + 1}, 2, KILN_DTYPE_I64);
        kiln_tensor_t *x = kiln_contiguous(kiln_narrow(all, 1, 0, T)), *y = kiln_contiguous(kiln_narrow(all, 1, 1, T));
        double lr = 3e-4, loss = 0;
        double norm;
        kiln_tensor_t *in[4] = {x, y, kiln_from_data(&lr, (int64_t[]){1}, 1, KILN_DTYPE_F64),
                                kiln_from_data(&scaler.scale, (int64_t[]){1}, 1, KILN_DTYPE_F64)}, *out[2];
        int n_out = 0;
        /* --compile --replay: step 1 compiles, step 2 is recorded, the rest replayed */
        kiln_status st = rp                  ? kiln_replay_run(rp, in, n_in, out, 2, &n_out)
                         : replay && step && s > 0
                             ? kiln_replay_record(call_compiled, step, in, n_in, &rp, out, 2, &n_out)
                         : step    ? kiln_compiled_call(step, in, n_in, out, 2, &n_out)
                         : !replay ? kiln_gpt_train_step(&fn, in, n_in, out, &n_out)
                                   : kiln_replay_record(kiln_gpt_train_step, &fn, in, n_in, &rp, out, 2, &n_out);
        if (st == KILN_OK) st = kiln_tensor_item(out[0], &loss);
        if (st == KILN_OK && fn.scaled && (st = kiln_tensor_item(out[1], &norm)) == KILN_OK)
            kiln_loss_scaler_update(&scaler, norm);
        if (s == 0) first_call_s = bench_now_s() - t0;
        if (st != KILN_OK) {
            fprintf(stderr, "bench_train_step: %s\n", kiln_last_error());
            return 1;
        }
        kiln_scope_end();
        if (s >= warmup) times[s - warmup] = bench_now_s() - t0;
    }
    double total = 0;
    for (int s = 0; s < steps; s++) total += times[s];
    if (pg) {
        kiln_pg_time_in(pg, "all_to_all", NULL, &a2a1);
        kiln_pg_time_in(pg, "allreduce", NULL, &ar1);
    }
    qsort(times, (size_t)steps, sizeof *times, bench_cmp_double);
    double med = times[steps / 2], tps = B * T / med;
    /* Model FLOPs per token: 6 N for the weights plus 6 L T C for attention
     * (forward 2, backward 4; causal halves QK^T and PV, which 12 L T C / 2 gives); N
     * counts the weights a token uses (an MoE block's k routed experts, not all E). */
    if (experts > 0) {
        int64_t Fe = kiln_gpt_moe_ffn(&c), per_expert = 3 * (int64_t)c.n_embd * Fe;
        n_params -= (double)c.n_layer * (double)(experts - top_k) * (double)per_expert;
    }
    double flops_per_token = 6.0 * n_params + 6.0 * c.n_layer * T * c.n_embd;
    double gflops = flops_per_token * tps / 1e9;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    const char *engine = step && replay ? "kiln-compile-replay" : step ? "kiln-compile" : replay ? "kiln-replay" : "kiln";
    if (rank == 0)
        printf("{\"engine\":\"%s\",\"world\":%d,\"expert_parallel\":%s,\"a2a_share\":%.4f,\"allreduce_share\":%.4f,"
               "\"experts\":%d,\"top_k\":%d,\"shared\":%d,\"expert_ffn\":%d,\"precision\":\"%s\",\"device\":\"%s\","
               "\"first_step_s\":%.3f,\"model\":\"%s\",\"threads\":%d,\"steps\":%d,\"median_step_ms\":%.1f,"
               "\"tokens_per_s\":%.1f,\"model_gflops\":%.2f,\"mfu\":%.4f,\"peak_rss_mb\":%.1f}\n",
               engine, world, ep ? "true" : "false", (a2a1 - a2a0) / total, (ar1 - ar0) / total, experts, top_k, shared,
               experts ? kiln_gpt_moe_ffn(&c) : 0, precision, kiln_device(), first_call_s, model, kiln_num_threads(), steps,
               med * 1e3, tps, gflops, peak_gflops > 0 ? gflops / peak_gflops : 0.0, (double)ru.ru_maxrss / 1024.0);
    kiln_compiled_free(step);
    kiln_replay_free(rp);
    kiln_optim_free(opt);
    kiln_gpt_free(m);
    kiln_pg_free(pg);
    free(ps);
    free(buf);
    free(times);
    return 0;
}
