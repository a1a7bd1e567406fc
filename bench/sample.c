/* The sampler's cost per token at real vocabulary sizes (issue 52 item 8):
 *     build/bench_sample [V ...]            (default 50000 151936)
 * For each V, logits shaped like a language model's (a few likely tokens over a normal
 * tail), kiln_sample_token with greedy, temperature 0.8 + top_p 0.95, top_k 40, min_p
 * 0.05, and top_p 0.95 over a whole-vocabulary sort (the sampler before partial
 * selection, kept here as the baseline), alternated in rounds; medians of the rounds in
 * microseconds a token, and each against greedy. One thread: the engine samples a step's
 * rows in parallel, one row a task. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/serve.h"

typedef struct {
    float p;
    int id;
} cand;

static int by_prob(const void *a, const void *b)
{
    float x = ((const cand *)a)->p, y = ((const cand *)b)->p;
    return x < y ? 1 : x > y ? -1 : ((const cand *)a)->id - ((const cand *)b)->id;
}

/* The baseline: softmax, a sort of the whole vocabulary, the top_p cut, a draw. */
static int full_sort(const float *lg, int V, double temp, double top_p, uint64_t i, cand *c)
{
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = lg[v] > mx ? lg[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; v++) c[v].id = v, c[v].p = (float)exp((lg[v] - mx) / temp), sum += c[v].p;
    for (int v = 0; v < V; v++) c[v].p = (float)(c[v].p / sum);
    qsort(c, (size_t)V, sizeof *c, by_prob);
    double cum = 0;
    int keep = V;
    for (int k = 0; k < V; k++)
        if ((cum += c[k].p) >= top_p) {
            keep = k + 1;
            break;
        }
    double u = (double)((i * 0x9e3779b97f4a7c15ull) >> 11) * (1.0 / 9007199254740992.0) * cum;
    for (int k = 0; k < keep; k++)
        if ((u -= c[k].p) <= 0) return c[k].id;
    return c[keep - 1].id;
}

int main(int argc, char **argv)
{
    int sizes[8] = {50000, 151936}, n_sizes = 2;
    if (argc > 1) n_sizes = 0;
    for (int a = 1; a < argc && n_sizes < 8; a++) sizes[n_sizes++] = atoi(argv[a]);
    enum { ROUNDS = 7, TOKENS = 40, KINDS = 5 };
    const char *names[KINDS] = {"greedy", "top_p 0.95 (T 0.8)", "top_k 40", "min_p 0.05", "top_p 0.95, full sort"};
    const kiln_sampling sp[4] = {
        {.temperature = 0, .top_p = 1}, {.temperature = 0.8, .top_p = 0.95}, {.temperature = 0.8, .top_k = 40, .top_p = 1},
        {.temperature = 0.8, .top_p = 1, .min_p = 0.05}};
    for (int si = 0; si < n_sizes; si++) {
        int V = sizes[si];
        float *lg = malloc(sizeof *lg * (size_t)V);
        void *scratch = malloc(kiln_sample_scratch_bytes(V));
        if (!lg || !scratch) return 1;
        uint64_t x = 1;
        for (int v = 0; v < V; v++) { /* a normal tail (Box-Muller), sd 2, and a few strong tokens */
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            double u1 = ((x >> 11) + 1) * (1.0 / 9007199254740993.0);
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            double u2 = (x >> 11) * (1.0 / 9007199254740992.0);
            lg[v] = (float)(2.0 * sqrt(-2 * log(u1)) * cos(2 * M_PI * u2)) + (v % 9973 == 0 ? 12.0f : 0.0f);
        }
        double t[KINDS][ROUNDS];
        volatile int sink = 0;
        for (int r = 0; r < ROUNDS; r++)
            for (int k = 0; k < KINDS; k++) {
                double t0 = bench_now_s();
                for (int i = 0; i < TOKENS; i++)
                    sink += k < 4 ? kiln_sample_token(lg, V, &sp[k], i, scratch) : full_sort(lg, V, 0.8, 0.95, (uint64_t)i, scratch);
                t[k][r] = (bench_now_s() - t0) / TOKENS * 1e6;
            }
        printf("V %d (medians of %d rounds of %d tokens, us a token):\n", V, ROUNDS, TOKENS);
        double greedy = 0;
        for (int k = 0; k < KINDS; k++) {
            qsort(t[k], ROUNDS, sizeof(double), bench_cmp_double);
            if (k == 0) greedy = t[k][ROUNDS / 2];
            printf("  %-24s %9.1f us  (%.2fx greedy)\n", names[k], t[k][ROUNDS / 2], t[k][ROUNDS / 2] / greedy);
        }
        free(lg);
        free(scratch);
        (void)sink;
    }
    return 0;
}
