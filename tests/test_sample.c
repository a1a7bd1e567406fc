/* The sampler: greedy, temperature, top-k, top-p, the (seed, index) draw, logprobs.
 * Oracles: softmax written out in double in this file; frequencies within 5 standard
 * deviations of the binomial over 20000 draws. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/serve.h"
#include "test_util.h"

enum { V = 6, DRAWS = 20000 };
static const float logits[V] = {1.0f, 2.5f, -1.0f, 2.0f, 0.0f, 0.5f};

static void softmax(double temp, double *p)
{
    double mx = -INFINITY, sum = 0;
    for (int v = 0; v < V; v++) mx = fmax(mx, logits[v] / temp);
    for (int v = 0; v < V; v++) sum += p[v] = exp(logits[v] / temp - mx);
    for (int v = 0; v < V; v++) p[v] /= sum;
}

static void frequencies(const kiln_sampling *s, double *f)
{
    void *scratch = malloc(kiln_sample_scratch_bytes(V));
    assert_non_null(scratch);
    memset(f, 0, sizeof(double) * V);
    for (int i = 0; i < DRAWS; i++) {
        int t = kiln_sample_token(logits, V, s, i, scratch);
        assert_true(t >= 0 && t < V);
        f[t] += 1.0 / DRAWS;
    }
    free(scratch);
}

static void assert_distribution(const double *f, const double *p)
{
    for (int v = 0; v < V; v++) {
        double sd = sqrt(p[v] * (1 - p[v]) / DRAWS);
        if (fabs(f[v] - p[v]) > 5 * sd + 1e-12)
            fail_msg("token %d drawn with frequency %.4f, softmax says %.4f (5 sd = %.4f)", v, f[v], p[v], 5 * sd);
    }
}

static void greedy_is_argmax(void **state)
{
    char scratch[256];
    assert_true(kiln_sample_scratch_bytes(V) <= sizeof scratch);
    kiln_sampling s = {.temperature = 0, .top_p = 1, .seed = 3};
    for (int i = 0; i < 10; i++) assert_int_equal(kiln_sample_token(logits, V, &s, i, scratch), 1);
    s = (kiln_sampling){.temperature = 1, .top_k = 1, .top_p = 1, .seed = 3};
    for (int i = 0; i < 10; i++) assert_int_equal(kiln_sample_token(logits, V, &s, i, scratch), 1);
    s = (kiln_sampling){.temperature = 1, .top_p = 1e-6, .seed = 3};
    for (int i = 0; i < 10; i++) assert_int_equal(kiln_sample_token(logits, V, &s, i, scratch), 1);
}

static void temperature_draws_follow_softmax(void **state)
{
    double f[V], p[V];
    kiln_sampling s = {.temperature = 1.0, .top_p = 1, .seed = 11};
    frequencies(&s, f);
    softmax(1.0, p);
    assert_distribution(f, p);
    s.temperature = 0.5;
    frequencies(&s, f);
    softmax(0.5, p);
    assert_distribution(f, p);
}

/* top_k = 3 keeps tokens 1, 3, 0 renormalized; top_p = 0.85 keeps the fewest likeliest
 * tokens whose mass reaches 0.85 (1 and 3: 0.481 + 0.292 = 0.773 < 0.85, then 0 too). */
static void top_k_and_top_p_cut_the_tail(void **state)
{
    double f[V], p[V], q[V] = {0};
    softmax(1.0, p);
    double kept = p[0] + p[1] + p[3];
    q[0] = p[0] / kept;
    q[1] = p[1] / kept;
    q[3] = p[3] / kept;
    kiln_sampling s = {.temperature = 1.0, .top_k = 3, .top_p = 1, .seed = 5};
    frequencies(&s, f);
    assert_distribution(f, q);
    assert_true(p[1] + p[3] < 0.85 && p[1] + p[3] + p[0] >= 0.85);
    s = (kiln_sampling){.temperature = 1.0, .top_k = 0, .top_p = 0.85, .seed = 5};
    frequencies(&s, f);
    assert_distribution(f, q);
}

/* top-p keeps the fewest likeliest tokens whose mass reaches top_p: a prefix whose mass
 * equals top_p exactly is enough. Oracles computed by hand here, on logits whose f32
 * probabilities are exact binary fractions (so the sums compare exactly):
 *   - two equal logits, top_p = 0.5: the first token (ties go by id) holds 0.5, which
 *     reaches 0.5, so token 0 is drawn every time and token 1 never. A sampler that
 *     cuts only past the threshold keeps both, and then draws token 1 half the time:
 *     the chance that it never shows in 2000 draws is 2^-2000.
 *   - logits {0, -ln 2, -ln 2}: probabilities 1/2, 1/4, 1/4 (exp(-ln 2) rounds to 0.5f
 *     exactly), top_p = 0.75: tokens 0 and 1 reach 0.75 exactly, so token 2 is never
 *     drawn and 0 and 1 come 2/3 and 1/3 of the time (within 5 standard deviations of
 *     the binomial over DRAWS draws, as above). Cutting past the threshold keeps token 2
 *     too, drawn a quarter of the time. */
static void top_p_keeps_a_prefix_that_lands_exactly_on_the_threshold(void **state)
{
    char scratch[256];
    const float two[2] = {0.7f, 0.7f};
    kiln_sampling s = {.temperature = 1.0, .top_p = 0.5, .seed = 9};
    for (int i = 0; i < 2000; i++)
        if (kiln_sample_token(two, 2, &s, i, scratch) != 0)
            fail_msg("draw %d: token 1 drawn, but token 0 alone already holds top_p = 0.5 of the mass", i);
    const float three[3] = {0.0f, -0.69314718f, -0.69314718f};
    const double want[3] = {2.0 / 3.0, 1.0 / 3.0, 0};
    double f[3] = {0};
    s = (kiln_sampling){.temperature = 1.0, .top_p = 0.75, .seed = 17};
    for (int i = 0; i < DRAWS; i++) f[kiln_sample_token(three, 3, &s, i, scratch)] += 1.0 / DRAWS;
    if (f[2] != 0) fail_msg("token 2 drawn with frequency %.4f: tokens 0 and 1 already reach top_p = 0.75", f[2]);
    for (int v = 0; v < 2; v++) {
        double sd = sqrt(want[v] * (1 - want[v]) / DRAWS);
        if (fabs(f[v] - want[v]) > 5 * sd)
            fail_msg("token %d drawn with frequency %.4f, want %.4f (5 sd = %.4f)", v, f[v], want[v], 5 * sd);
    }
}

/* The draw depends on (seed, index) only: the same pair gives the same token in any
 * order of calls, and another seed gives another sequence. */
static void draws_are_a_function_of_seed_and_index(void **state)
{
    char scratch[256];
    kiln_sampling a = {.temperature = 1.0, .top_p = 1, .seed = 42}, b = a;
    b.seed = 43;
    int fwd[64], differ = 0;
    for (int i = 0; i < 64; i++) fwd[i] = kiln_sample_token(logits, V, &a, i, scratch);
    for (int i = 63; i >= 0; i--) {
        assert_int_equal(kiln_sample_token(logits, V, &a, i, scratch), fwd[i]);
        differ += kiln_sample_token(logits, V, &b, i, scratch) != fwd[i];
    }
    assert_true(differ > 10);
}

static void logprobs_are_log_softmax(void **state)
{
    double p[V];
    softmax(1.0, p);
    int ids[3];
    float lp[3];
    float l = kiln_token_logprobs(logits, V, 4, 3, ids, lp);
    assert_near(l, log(p[4]), 1e-6);
    const int want[3] = {1, 3, 0};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(ids[k], want[k]);
        assert_near(lp[k], log(p[want[k]]), 1e-6);
    }
    assert_true(isinf(kiln_token_logprobs(logits, V, V, 0, NULL, NULL)));
}

/* ---- the partial selection against a full sort ---- */

typedef struct {
    float p;
    int id;
} ref_cand;

static int ref_order(const void *a, const void *b)
{
    const ref_cand *x = a, *y = b;
    return x->p < y->p ? 1 : x->p > y->p ? -1 : x->id - y->id;
}

/* The sampler as it was specified before partial selection: every probability (computed
 * as kiln_sample_token computes it, in float from double sums), the whole vocabulary
 * sorted, the top_k / top_p / min_p cut, the (seed, index) draw. */
static int ref_sample(const float *lg, int n, const kiln_sampling *s, int64_t index)
{
    ref_cand *c = malloc(sizeof *c * (size_t)n);
    float mx = -INFINITY;
    for (int v = 0; v < n; v++) mx = lg[v] > mx ? lg[v] : mx;
    double sum = 0;
    for (int v = 0; v < n; v++) c[v].id = v, c[v].p = (float)exp((lg[v] - mx) / s->temperature), sum += c[v].p;
    for (int v = 0; v < n; v++) c[v].p = (float)(c[v].p / sum);
    qsort(c, (size_t)n, sizeof *c, ref_order);
    int keep = s->top_k > 0 && s->top_k < n ? s->top_k : n;
    double cum = 0;
    for (int k = 0; k < keep; k++) {
        if (k > 0 && s->min_p > 0 && c[k].p < s->min_p * c[0].p) {
            keep = k;
            break;
        }
        cum += c[k].p;
        if (cum >= s->top_p) {
            keep = k + 1;
            break;
        }
    }
    double total = 0;
    for (int k = 0; k < keep; k++) total += c[k].p;
    /* splitmix64, as the sampler's draw */
    uint64_t z = (uint64_t)index + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull, z = (z ^ (z >> 27)) * 0x94d049bb133111ebull, z ^= z >> 31;
    uint64_t h = s->seed ^ z;
    h += 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull, h = (h ^ (h >> 27)) * 0x94d049bb133111ebull, h ^= h >> 31;
    double u = (double)(h >> 11) * (1.0 / 9007199254740992.0) * total;
    int out = c[keep - 1].id;
    for (int k = 0; k < keep; k++) {
        u -= c[k].p;
        if (u <= 0) {
            out = c[k].id;
            break;
        }
    }
    free(c);
    return out;
}

/* On a 50,000-token vocabulary (logits peaked and flat, ties included), every setting of
 * top_k, top_p and min_p draws the token the full sort draws, index after index. */
static void partial_selection_draws_what_a_full_sort_draws(void **state)
{
    (void)state;
    enum { BIG = 50000 };
    float *lg = malloc(sizeof *lg * BIG);
    void *scratch = malloc(kiln_sample_scratch_bytes(BIG));
    assert_non_null(lg);
    assert_non_null(scratch);
    uint64_t x = 7;
    for (int shape = 0; shape < 3; shape++) {
        for (int v = 0; v < BIG; v++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            float r = (float)((x >> 40) & 0xFFFF) / 65536.0f;
            lg[v] = shape == 0 ? 12 * r * r * r : shape == 1 ? r : (float)((x >> 40) % 8); /* peaked, flat, ties */
        }
        const kiln_sampling cases[] = {
            {.temperature = 0.8, .top_p = 0.95, .seed = 1},   {.temperature = 1, .top_p = 0.5, .seed = 2},
            {.temperature = 1, .top_k = 40, .top_p = 1, .seed = 3}, {.temperature = 0.7, .top_k = 1000, .top_p = 0.9, .seed = 4},
            {.temperature = 1, .top_p = 1, .min_p = 0.05, .seed = 5}, {.temperature = 1.3, .top_p = 0.99, .min_p = 0.01, .seed = 6},
            {.temperature = 1, .top_k = 70000, .top_p = 0.999, .seed = 7}, {.temperature = 2, .top_p = 0.9999, .seed = 8},
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
            for (int64_t i = 0; i < 12; i++) {
                int got = kiln_sample_token(lg, BIG, &cases[k], i, scratch), want = ref_sample(lg, BIG, &cases[k], i);
                if (got != want) fail_msg("shape %d case %zu index %lld: %d, the full sort %d", shape, k, (long long)i, got, want);
            }
    }
    free(lg);
    free(scratch);
}

/* min_p keeps the tokens at least min_p times as likely as the likeliest: at temperature
 * 1 the kept ones are drawn in proportion to their softmax, the others never. */
static void min_p_keeps_the_tokens_near_the_likeliest(void **state)
{
    (void)state;
    double p[V], f[V];
    softmax(1.0, p);
    kiln_sampling s = {.temperature = 1.0, .top_p = 1, .min_p = 0.5, .seed = 13};
    frequencies(&s, f);
    double kept = 0, q[V];
    for (int v = 0; v < V; v++) kept += p[v] >= 0.5 * p[1] ? p[v] : 0; /* token 1 is the likeliest */
    for (int v = 0; v < V; v++) q[v] = p[v] >= 0.5 * p[1] ? p[v] / kept : 0;
    assert_distribution(f, q);
}

/* The adjustments, against their formulas written out here: logit_bias added; the
 * repetition penalty (transformers') once per distinct token of prompt and output,
 * dividing a positive logit and multiplying a negative one; presence and frequency
 * penalties (OpenAI's) over the output only: presence once, frequency per occurrence. */
static void adjustments_follow_their_formulas(void **state)
{
    (void)state;
    float got[V], want[V];
    const int32_t tok[] = {1, 2, 1, /* output: */ 3, 3, 5, 2};
    const int n_prompt = 3, n_tok = 7;
    int32_t counts[V] = {0};
    const int32_t bias_ids[] = {4, 0};
    const float bias_vals[] = {1.5f, -3.0f};
    kiln_sampling s = {.temperature = 1, .top_p = 1, .repetition_penalty = 1.25, .presence_penalty = 0.5,
                       .frequency_penalty = 0.25, .bias_ids = bias_ids, .bias_vals = bias_vals, .n_bias = 2};
    assert_true(kiln_sampling_adjusts(&s));
    memcpy(got, logits, sizeof got);
    kiln_sample_adjust(got, V, &s, tok, n_prompt, n_tok, counts);
    for (int v = 0; v < V; v++) {
        float l = logits[v] + (v == 4 ? 1.5f : v == 0 ? -3.0f : 0.0f);
        bool seen = v == 1 || v == 2 || v == 3 || v == 5;
        if (seen) l = l > 0 ? l / 1.25f : l * 1.25f;
        int out = v == 3 ? 2 : v == 5 || v == 2 ? 1 : 0; /* occurrences in the output */
        if (out) l -= (float)(0.5 + 0.25 * out);
        want[v] = l;
        assert_float_equal(got[v], want[v], 1e-6);
        assert_int_equal(counts[v], 0); /* the scratch is left zero */
    }
    kiln_sampling off = {.temperature = 1, .top_p = 1, .repetition_penalty = 1};
    assert_false(kiln_sampling_adjusts(&off));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(greedy_is_argmax),
        cmocka_unit_test(temperature_draws_follow_softmax),
        cmocka_unit_test(top_k_and_top_p_cut_the_tail),
        cmocka_unit_test(top_p_keeps_a_prefix_that_lands_exactly_on_the_threshold),
        cmocka_unit_test(draws_are_a_function_of_seed_and_index),
        cmocka_unit_test(logprobs_are_log_softmax),
        cmocka_unit_test(partial_selection_draws_what_a_full_sort_draws),
        cmocka_unit_test(min_p_keeps_the_tokens_near_the_likeliest),
        cmocka_unit_test(adjustments_follow_their_formulas),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
