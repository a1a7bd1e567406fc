/* Token sampling on the host: temperature, top-k, top-p, and log-probabilities.
 * The random draw is a hash of (seed, index), not a stream, so a token's choice does
 * not depend on what else ran before it or beside it in a batch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "kiln/serve.h"

typedef struct {
    float p;
    int id;
} cand;

/* Likeliest first; ties by id, so the order is total and the sort deterministic. */
static int by_prob(const void *a, const void *b)
{
    float x = ((const cand *)a)->p, y = ((const cand *)b)->p;
    return x < y ? 1 : x > y ? -1 : ((const cand *)a)->id - ((const cand *)b)->id;
}

size_t kiln_sample_scratch_bytes(int V) { return sizeof(cand) * (size_t)(V > 0 ? V : 1); }

static int argmax(const float *logits, int V)
{
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}

int kiln_sample_token(const float *logits, int V, const kiln_sampling *s, int64_t index, void *scratch)
{
    if (!logits || V < 1 || !s || !scratch) return 0;
    if (!(s->temperature > 0)) return argmax(logits, V);
    cand *c = scratch;
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    if (!isfinite(mx)) return argmax(logits, V); /* NaN or inf logits: nothing to sample from */
    double sum = 0;
    for (int v = 0; v < V; v++) {
        c[v].id = v;
        c[v].p = (float)exp((logits[v] - mx) / s->temperature);
        sum += c[v].p;
    }
    for (int v = 0; v < V; v++) c[v].p = (float)(c[v].p / sum);
    int keep = V;
    bool truncate = (s->top_k > 0 && s->top_k < V) || s->top_p < 1;
    /* Sorting is only needed to cut the tail; without a cut the draw walks ids in order. */
    if (truncate) {
        qsort(c, (size_t)V, sizeof *c, by_prob);
        if (s->top_k > 0 && s->top_k < V) keep = s->top_k;
        double cum = 0;
        for (int k = 0; k < keep; k++) {
            cum += c[k].p;
            if (cum >= s->top_p) {
                keep = k + 1;
                break;
            }
        }
    }
    double total = 0;
    for (int k = 0; k < keep; k++) total += c[k].p;
    uint64_t h = kiln__splitmix64(s->seed ^ kiln__splitmix64((uint64_t)index));
    double u = (double)(h >> 11) * (1.0 / 9007199254740992.0) * total;
    for (int k = 0; k < keep; k++) {
        u -= c[k].p;
        if (u <= 0) return c[k].id;
    }
    return c[keep - 1].id;
}

float kiln_token_logprobs(const float *logits, int V, int token, int top_n, int *top_ids, float *top_logprobs)
{
    if (!logits || V < 1) return -INFINITY;
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; v++) sum += exp((double)logits[v] - mx);
    double lse = mx + log(sum);
    /* The top_n by a partial selection: top_n is at most 20, so n * V is small. */
    if (top_n > V) top_n = V;
    for (int k = 0; k < top_n && top_ids && top_logprobs; k++) {
        int best = -1;
        for (int v = 0; v < V; v++) {
            bool taken = false;
            for (int j = 0; j < k && !taken; j++) taken = top_ids[j] == v;
            if (!taken && (best < 0 || logits[v] > logits[best])) best = v;
        }
        top_ids[k] = best;
        top_logprobs[k] = (float)(logits[best] - lse);
    }
    if (token < 0 || token >= V) return -INFINITY;
    return (float)(logits[token] - lse);
}
