/* bench/decode_q8: decode tokens/s of the serving engine's paged forward
 * (kiln_gpt_forward_paged, one new token for each of S sequences a step) on one model
 * with its linear weights packed as f32, bf16 and q8_0 (kiln_kv_pool_new_quant), side
 * by side: ROUNDS rounds, each timing STEPS steps (after 2 warm-up steps) of every
 * packing in turn, at S = 1 and S = 16. Prints one JSON line per (round, S, packing)
 * and a summary line with the medians, the ratios to f32 and the bytes of linear
 * weights each step streams (bench/decode_q8.sh turns those into a fraction of the
 * machine's read bandwidth).
 *   build/bench_decode_q8 MODEL [--threads N] [--steps N] [--rounds N] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/kiln.h"

enum { NW = 3, MB = 8, BL = 16 };
static const char *const names[NW] = {"f32", "bf16", "q8_0"};

/* Bytes of the linear weights (the head included) as each packing holds them: f32 4,
 * bf16 2, q8_0 34/32 a weight (every width here is a multiple of 32). */
static double weight_params(const kiln_gpt_config *c)
{
    double C = c->n_embd, H = c->n_head, Hkv = c->n_kv_head ? c->n_kv_head : c->n_head, hs = C / H;
    double F = kiln_gpt_ffn_hidden(c), mats = c->mlp == KILN_MLP_SWIGLU ? 3 : 2;
    return c->n_layer * (C * (C + 2 * Hkv * hs) + C * C + mats * C * F) + (double)c->vocab_size * C;
}

/* The median step time (s) of STEPS decode steps of S sequences from position pos0. */
static double steps_s(kiln_gpt_t *m, kiln_kv_pool_t *p, int S, int steps, int pos0, const kiln_gpt_config *c)
{
    int32_t table[16 * MB], tk[16], sq[16], ps[16], lr[16];
    for (int i = 0; i < 16 * MB; i++) table[i] = i;
    double *t = malloc(sizeof *t * (size_t)steps);
    for (int step = 0; step < steps + 2; step++) {
        for (int s = 0; s < S; s++) tk[s] = (s * 7 + step) % c->vocab_size, sq[s] = s, ps[s] = pos0 + step, lr[s] = s;
        kiln_paged_batch b = {S, tk, sq, ps, 16, MB, table, S, lr};
        double t0 = bench_now_s();
        kiln_scope_begin();
        kiln_tensor_t *lg = kiln_gpt_forward_paged(m, p, &b);
        kiln_scope_end();
        if (!lg) {
            free(t);
            return -1;
        }
        if (step >= 2) t[step - 2] = bench_now_s() - t0;
    }
    qsort(t, (size_t)steps, sizeof *t, bench_cmp_double);
    double med = t[steps / 2];
    free(t);
    return med;
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    int threads = 0, steps = 8, rounds = 3;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--steps")) steps = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--rounds")) rounds = atoi(argv[++i]);
        else if (argv[i][0] != '-' && !path) path = argv[i];
        else path = NULL, i = argc;
    }
    if (!path || steps < 1 || steps > 60 || rounds < 1) {
        fprintf(stderr, "usage: bench_decode_q8 MODEL [--threads N] [--steps 1..60] [--rounds N]\n");
        return 2;
    }
    kiln_init(threads);
    kiln_gpt_t *m;
    struct kiln_tokenizer *tok;
    if (kiln_model_load(path, &m, &tok, NULL) != KILN_OK) {
        fprintf(stderr, "bench_decode_q8: %s\n", kiln_last_error());
        return 1;
    }
    const kiln_gpt_config *c = kiln_gpt_get_config(m);
    kiln_kv_pool_t *p[NW];
    kiln_dtype dt[NW] = {KILN_DTYPE_F32, KILN_DTYPE_BF16, KILN_DTYPE_F32};
    kiln_weight_quant q[NW] = {KILN_WEIGHT_QUANT_NONE, KILN_WEIGHT_QUANT_NONE, KILN_WEIGHT_QUANT_Q8_0};
    for (int w = 0; w < NW; w++)
        if (kiln_kv_pool_new_quant(m, 16 * MB, BL, KILN_DTYPE_F32, dt[w], q[w], &p[w]) != KILN_OK) {
            fprintf(stderr, "bench_decode_q8: %s\n", kiln_last_error());
            return 1;
        }
    double params = weight_params(c), bytes[NW] = {4 * params, 2 * params, 34.0 / 32 * params};
    const int seqs[2] = {1, 16};
    double *tok_s = malloc(sizeof *tok_s * (size_t)(2 * NW * rounds));
    for (int r = 0; r < rounds; r++)
        for (int si = 0; si < 2; si++)
            for (int w = 0; w < NW; w++) {
                int S = seqs[si];
                /* each round decodes from a fresh position range, within the pool's
                 * blocks and the model's context */
                int room = (MB * BL < c->block_size ? MB * BL : c->block_size) - steps - 2;
                double s = steps_s(m, p[w], S, steps, room > 0 ? (r * (steps + 2)) % room : 0, c);
                if (s < 0) {
                    fprintf(stderr, "bench_decode_q8: %s\n", kiln_last_error());
                    return 1;
                }
                tok_s[(si * NW + w) * rounds + r] = S / s;
                printf("{\"round\":%d,\"seqs\":%d,\"weights\":\"%s\",\"step_ms\":%.2f,\"tok_s\":%.2f}\n", r, S, names[w],
                       s * 1e3, S / s);
                fflush(stdout);
            }
    printf("{\"summary\":true,\"threads\":%d,\"linear_params\":%.0f", kiln_num_threads(), params);
    for (int si = 0; si < 2; si++) {
        double med[NW];
        for (int w = 0; w < NW; w++) {
            double *v = tok_s + (si * NW + w) * rounds;
            qsort(v, (size_t)rounds, sizeof *v, bench_cmp_double);
            med[w] = v[rounds / 2];
            printf(",\"%s_s%d_tok_s\":%.2f,\"%s_s%d_GBps\":%.2f", names[w], seqs[si], med[w], names[w], seqs[si],
                   bytes[w] * med[w] / seqs[si] / 1e9);
        }
        printf(",\"bf16_over_f32_s%d\":%.3f,\"q8_0_over_f32_s%d\":%.3f,\"q8_0_over_bf16_s%d\":%.3f", seqs[si],
               med[1] / med[0], seqs[si], med[2] / med[0], seqs[si], med[2] / med[1]);
    }
    printf("}\n");
    for (int w = 0; w < NW; w++) kiln_kv_pool_free(p[w]);
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    free(tok_s);
    return 0;
}
