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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(greedy_is_argmax),
        cmocka_unit_test(temperature_draws_follow_softmax),
        cmocka_unit_test(top_k_and_top_p_cut_the_tail),
        cmocka_unit_test(top_p_keeps_a_prefix_that_lands_exactly_on_the_threshold),
        cmocka_unit_test(draws_are_a_function_of_seed_and_index),
        cmocka_unit_test(logprobs_are_log_softmax),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
