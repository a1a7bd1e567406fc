/* Token sampling on the host: temperature, top-k, top-p, and log-probabilities.
 * The random draw is a hash of (seed, index), not a stream, so a token's choice does
 * not depend on what else ran before it or beside it in a batch. */
#include <math.h>
#include <stdbool.h>
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

/* ---- the k likeliest in by_prob's order, without sorting the rest ---- */

/* Whether a comes after b in by_prob's order (less likely, or as likely with a larger id). */
static bool after(const cand *a, const cand *b) { return a->p < b->p || (a->p == b->p && a->id > b->id); }

/* c[0..k) of a min-heap whose top is the first in by_prob's order to drop: sift i down. */
static void sift(cand *c, int k, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && after(&c[l], &c[w])) w = l;
        if (r < k && after(&c[r], &c[w])) w = r;
        if (w == i) return;
        cand t = c[i];
        c[i] = c[w], c[w] = t, i = w;
    }
}

/* Moves the k first of c[0..V) in by_prob's order to c[0..k), sorted; the rest is left
 * in c[k..V) in no order. O(V log k): a bounded heap of the best seen, then a sort of
 * it. The same prefix a full sort gives, since the order is total. */
static void select_top(cand *c, int V, int k)
{
    if (k >= V) {
        qsort(c, (size_t)V, sizeof *c, by_prob);
        return;
    }
    for (int i = k / 2 - 1; i >= 0; i--) sift(c, k, i);
    for (int v = k; v < V; v++)
        if (after(&c[0], &c[v])) {
            cand t = c[0];
            c[0] = c[v], c[v] = t;
            sift(c, k, 0);
        }
    qsort(c, (size_t)k, sizeof *c, by_prob);
}

/* How many of the sorted c[0..n) survive top_p (the smallest prefix reaching it) and
 * min_p (those at least min_p times as likely as the first); *done: whether the cut
 * fell inside the prefix, so that the candidates past n cannot change it. */
static int cut(const cand *c, int n, const kiln_sampling *s, bool *done)
{
    double cum = 0, floor_p = s->min_p > 0 ? s->min_p * c[0].p : 0;
    for (int k = 0; k < n; k++) {
        if (k > 0 && c[k].p < floor_p) {
            *done = true;
            return k;
        }
        cum += c[k].p;
        if (cum >= s->top_p) {
            *done = true;
            return k + 1;
        }
    }
    *done = false;
    return n;
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
    bool top_k = s->top_k > 0 && s->top_k < V, truncate = top_k || s->top_p < 1 || s->min_p > 0;
    /* Only the cut needs an order, and only as far as the cut: the likeliest first, in
     * widening prefixes (64, 256, ...) until top_p or min_p falls inside one, top_k at
     * most; a full sort only when the cut lies that far out. Without a cut the draw walks
     * ids in order. */
    if (truncate) {
        int limit = top_k ? s->top_k : V;
        for (int n = limit < 64 ? limit : 64;; n = n > limit / 4 ? limit : n * 4) {
            select_top(c, V, n);
            bool done;
            keep = cut(c, n, s, &done);
            if (done || n == limit) break;
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

/* ---- logit adjustments ---- */

bool kiln_sampling_adjusts(const kiln_sampling *s)
{
    return s && ((s->n_bias > 0 && s->bias_ids && s->bias_vals) || s->presence_penalty != 0 ||
                 s->frequency_penalty != 0 || (s->repetition_penalty > 0 && s->repetition_penalty != 1));
}

void kiln_sample_adjust(float *logits, int V, const kiln_sampling *s, const int32_t *tok, int n_prompt, int n_tok,
                        int32_t *counts)
{
    if (!logits || !s || !counts) return;
    for (int i = 0; s->bias_ids && s->bias_vals && i < s->n_bias; i++)
        if (s->bias_ids[i] >= 0 && s->bias_ids[i] < V) logits[s->bias_ids[i]] += s->bias_vals[i];
    if (s->repetition_penalty > 0 && s->repetition_penalty != 1) {
        float rp = (float)s->repetition_penalty;
        for (int i = 0; i < n_tok; i++) {
            int32_t t = tok[i];
            if (t < 0 || t >= V || counts[t]) continue;
            counts[t] = 1; /* (each token once) */
            logits[t] = logits[t] > 0 ? logits[t] / rp : logits[t] * rp;
        }
        for (int i = 0; i < n_tok; i++)
            if (tok[i] >= 0 && tok[i] < V) counts[tok[i]] = 0;
    }
    if (s->presence_penalty != 0 || s->frequency_penalty != 0) {
        for (int i = n_prompt; i < n_tok; i++)
            if (tok[i] >= 0 && tok[i] < V) counts[tok[i]]++;
        for (int i = n_prompt; i < n_tok; i++) {
            int32_t t = tok[i];
            if (t < 0 || t >= V || !counts[t]) continue;
            logits[t] -= (float)(s->presence_penalty + s->frequency_penalty * counts[t]);
            counts[t] = 0; /* (each token once, then the scratch is zero again) */
        }
    }
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
