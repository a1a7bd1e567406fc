/* bench/decode_moe: one decoding step of the serving engine's paged forward
 * (kiln_gpt_forward_paged) for S sequences, one new token each, of a LLaMA-style
 * config S model with mixture-of-experts blocks (8 experts of width 232, top-2, one
 * shared) and optionally multi-head latent attention (--mla: latent 64, rotary 16), and
 * the same model dense, side by side: the best of --steps steps after 3 warm-up steps.
 * Prints one JSON line.
 *   build/bench_decode_moe [--threads N] [--seqs S] [--steps N] [--mla] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/kiln.h"

/* The best step time of model c decoding S sequences (ms); < 0 on an error. */
static double best_step_ms(const kiln_gpt_config *c, int S, int steps)
{
    kiln_gpt_t *m;
    kiln_kv_pool_t *p;
    if (kiln_gpt_new(c, 1, &m) != KILN_OK) return -1;
    enum { MB = 8 };
    if (kiln_kv_pool_new(m, S * MB, 16, KILN_DTYPE_F32, &p) != KILN_OK) {
        kiln_gpt_free(m);
        return -1;
    }
    int32_t *table = malloc(sizeof *table * (size_t)(S * MB)), *v = malloc(sizeof *v * (size_t)(4 * S));
    int32_t *tk = v, *sq = v + S, *ps = v + 2 * S, *lr = v + 3 * S;
    for (int i = 0; i < S * MB; i++) table[i] = i;
    double best = 1e30;
    for (int step = 0; step < steps + 3; step++) {
        for (int s = 0; s < S; s++) tk[s] = (s * 7 + step) % c->vocab_size, sq[s] = s, ps[s] = step, lr[s] = s;
        kiln_paged_batch b = {S, tk, sq, ps, S, MB, table, S, lr};
        double t0 = bench_now_s();
        kiln_scope_begin();
        kiln_tensor_t *lg = kiln_gpt_forward_paged(m, p, &b);
        kiln_scope_end();
        double dt = bench_now_s() - t0;
        if (!lg) {
            best = -1;
            break;
        }
        if (step >= 3 && dt < best) best = dt;
    }
    free(table), free(v);
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
    return best * 1e3;
}

int main(int argc, char **argv)
{
    int threads = 0, S = 16, steps = 20;
    bool mla = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mla")) mla = true;
        else if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--seqs")) S = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--steps")) steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_decode_moe [--threads N] [--seqs S] [--steps N] [--mla]\n");
            return 2;
        }
    }
    if (S < 1 || S > 128 || steps < 1) {
        fprintf(stderr, "bench_decode_moe: --seqs in 1..128, --steps >= 1\n");
        return 2;
    }
    kiln_init(threads);
    kiln_gpt_config dense = kiln_gpt_config_llama(), moe = dense;
    moe.n_routed_experts = 8, moe.moe_top_k = 2, moe.n_shared_experts = 1, moe.moe_ffn = 232;
    if (mla) moe.mla_kv_rank = 64, moe.mla_rope_dim = 16;
    double d = best_step_ms(&dense, S, steps), e = best_step_ms(&moe, S, steps);
    if (d < 0 || e < 0) {
        fprintf(stderr, "bench_decode_moe: %s\n", kiln_last_error());
        return 1;
    }
    printf("{\"bench\":\"decode_moe\",\"threads\":%d,\"seqs\":%d,\"mla\":%s,\"dense_step_ms\":%.3f,\"moe_step_ms\":%.3f,"
           "\"moe_over_dense\":%.3f}\n", kiln_num_threads(), S, mla ? "true" : "false", d, e, e / d);
    return 0;
}
