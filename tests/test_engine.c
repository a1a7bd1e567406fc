/* The serving engine: continuous batching, the paged KV cache and its prefix cache,
 * cancellation, the queue limit, and determinism (a request's tokens do not depend on
 * what it ran with). The oracle for the tokens themselves is the KV-cache decoding of
 * kiln_gpt_forward_cached, which tests/test_nn.c checks against the full forward. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kiln/kiln.h"
#include "test_util.h"

/* What one request produced, filled on the engine's thread. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int tokens[256];
    float logprobs[256];
    int n, finals, stop_after; /* stop_after > 0: the callback returns false at that many tokens */
    kiln_finish finish;
} result;

static void result_init(result *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void result_destroy(result *r)
{
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
}

static bool on_token(void *user, const kiln_token_event *ev, kiln_finish fin)
{
    result *r = user;
    pthread_mutex_lock(&r->mu);
    bool go = true;
    if (ev) {
        if (ev->index != r->n) fail_msg("token index %d arrived as token number %d", ev->index, r->n);
        if (r->n < 256) {
            r->tokens[r->n] = ev->token;
            r->logprobs[r->n] = ev->logprob;
        }
        r->n++;
        go = !(r->stop_after > 0 && r->n >= r->stop_after);
    } else {
        r->finals++;
        r->finish = fin;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return go;
}

/* Waits (at most 60 s) for the final callback. */
static void wait_done(result *r)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += 60;
    pthread_mutex_lock(&r->mu);
    while (!r->finals)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &t)) break;
    int finals = r->finals;
    pthread_mutex_unlock(&r->mu);
    assert_int_equal(finals, 1);
}

static kiln_gpt_t *model(void)
{
    kiln_gpt_config c = kiln_gpt_config_llama();
    c.n_layer = 2;
    c.n_head = 4;
    c.n_kv_head = 2;
    c.n_embd = 64;
    c.block_size = 96;
    c.vocab_size = 61;
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 11, &m), KILN_OK);
    return m;
}

static void prompt_of(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++) p[i] = (i * 7 + salt * 5 + i / 4) % 61;
}

static kiln_gen_request request(const int32_t *p, int n, int max_tokens, double temperature, uint64_t seed, result *r)
{
    kiln_gen_request q = {.prompt = p, .n_prompt = n, .max_tokens = max_tokens,
                          .sampling = {.temperature = temperature, .top_k = 0, .top_p = 1.0, .seed = seed},
                          .logprobs = 0, .cb = on_token, .user = r};
    return q;
}

/* The linear weights' packing of the engines made next (kiln_engine_opts.weight_quant). */
static kiln_weight_quant weight_quant = KILN_WEIGHT_QUANT_NONE;

static kiln_engine_t *engine_kv(kiln_gpt_t *m, int max_batch, int num_blocks, bool prefix, kiln_dtype kv)
{
    kiln_engine_opts o = kiln_engine_opts_default();
    o.kv_dtype = kv;
    o.weight_quant = weight_quant;
    o.max_batch = max_batch;
    o.num_blocks = num_blocks;
    o.block_len = 8;
    o.max_step_tokens = 40;
    o.prefix_cache = prefix;
    kiln_engine_t *e;
    assert_int_equal(kiln_engine_new(m, &o, &e), KILN_OK);
    return e;
}

static kiln_engine_t *engine(kiln_gpt_t *m, int max_batch, int num_blocks, bool prefix)
{
    return engine_kv(m, max_batch, num_blocks, prefix, KILN_DTYPE_F32);
}

/* want[0..G): the argmax tokens of the KV-cache decoding loop after prompt p. */
static void greedy_oracle(kiln_gpt_t *m, const int32_t *p, int P, int G, int *want)
{
    kiln_kv_cache_t *c;
    assert_int_equal(kiln_kv_cache_new(m, 1, &c), KILN_OK);
    int64_t shape[2] = {1, P};
    kiln_tensor_t *lg = kiln_gpt_forward_cached(m, c, kiln_from_data((void *)p, shape, 2, KILN_DTYPE_I32));
    for (int g = 0; g < G; g++) {
        int64_t T = kiln_tensor_dim(lg, 1);
        kiln_tensor_t *last = kiln_narrow(lg, 1, T - 1, 1);
        float v[61];
        assert_int_equal(kiln_tensor_to_host(kiln_contiguous(last), v, sizeof v), KILN_OK);
        int best = 0;
        for (int i = 1; i < 61; i++)
            if (v[i] > v[best]) best = i;
        want[g] = best;
        int32_t t = best;
        int64_t s1[2] = {1, 1};
        lg = kiln_gpt_forward_cached(m, c, kiln_from_data(&t, s1, 2, KILN_DTYPE_I32));
    }
    kiln_kv_cache_free(c);
}

/* Greedy tokens equal the argmax of the KV-cache decoding loop. */
static void greedy_matches_the_kv_cache_loop(void **state)
{
    kiln_gpt_t *m = model();
    enum { P = 21, G = 30 };
    int32_t p[P];
    prompt_of(p, P, 1);
    int want[G];
    greedy_oracle(m, p, P, G, want);

    kiln_engine_t *e = engine(m, 4, 64, true);
    result r;
    result_init(&r);
    kiln_gen_request q = request(p, P, G, 0.0, 0, &r);
    uint64_t id;
    assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
    wait_done(&r);
    assert_int_equal(r.finish, KILN_FINISH_LENGTH);
    assert_int_equal(r.n, G);
    assert_memory_equal(r.tokens, want, sizeof want);
    kiln_engine_free(e);
    result_destroy(&r);
    kiln_gpt_free(m);
}

/* A sliding-window model (window 12, soft-capped scores) holds at most live_max = 8
 * blocks of 8 positions per request (the window plus a step's 40 tokens), reusing the
 * blocks its window has passed: a request of 81 positions (11 blocks) runs in a cache
 * of 9 blocks, which would refuse it without a window, and three such requests share a
 * cache of 17, two at a time, the third waiting for memory. Every request's greedy
 * tokens equal the KV-cache decoding loop's (kiln sample's path, whose window
 * test_nn checks against the full forward), and every block is free at the end. */
static void windowed_model_decodes_in_bounded_blocks(void **state)
{
    kiln_gpt_t *plain = model();
    kiln_gpt_config c = *kiln_gpt_get_config(plain);
    snprintf(c.attention, sizeof c.attention, "window:12+softcap:5");
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 11, &m), KILN_OK);
    enum { P = 21, G = 60, N = 3 };
    int32_t p[N][P];
    int want[N][G];
    for (int i = 0; i < N; i++) {
        prompt_of(p[i], P, 4 + i);
        greedy_oracle(m, p[i], P, G, want[i]);
    }
    for (int round = 0; round < 2; round++) {
        int n = round ? N : 1;
        kiln_engine_t *e = engine(m, 4, round ? 17 : 9, false);
        result r[N];
        uint64_t id;
        for (int i = 0; i < n; i++) {
            result_init(&r[i]);
            kiln_gen_request q = request(p[i], P, G, 0.0, 0, &r[i]);
            assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
        }
        for (int i = 0; i < n; i++) {
            wait_done(&r[i]);
            assert_int_equal(r[i].finish, KILN_FINISH_LENGTH);
            assert_int_equal(r[i].n, G);
            assert_memory_equal(r[i].tokens, want[i], sizeof want[i]);
            result_destroy(&r[i]);
        }
        kiln_engine_stats st;
        kiln_engine_get_stats(e, &st);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        kiln_engine_free(e);
    }
    /* the same request without the window needs all 11 blocks: refused by 9 */
    kiln_engine_t *e = engine(plain, 4, 9, false);
    result r;
    result_init(&r);
    kiln_gen_request q = request(p[0], P, G, 0.0, 0, &r);
    uint64_t id;
    assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "11 KV blocks"));
    kiln_clear_error();
    kiln_engine_free(e);
    result_destroy(&r);
    kiln_gpt_free(m);
    kiln_gpt_free(plain);
}

/* A seeded, sampled request gives bitwise the same tokens and logprobs alone and
 * batched with seven others (whose prompts differ in length, so prefill chunks and
 * decode rows mix in the same steps); with an f32 and with an f16 KV cache, and with the
 * linear weights in q8_0 blocks (activations quantized per row). */
static void same_seed_alone_or_batched(kiln_dtype kv)
{
    kiln_gpt_t *m = model();
    enum { G = 40 };
    int32_t p[8][50];
    for (int i = 0; i < 8; i++) prompt_of(p[i], 50, i + 3);
    result alone;
    result_init(&alone);
    kiln_engine_t *e = engine_kv(m, 8, 128, false, kv);
    kiln_gen_request q = request(p[0], 33, G, 0.9, 1234, &alone);
    uint64_t id;
    assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
    wait_done(&alone);
    kiln_engine_free(e);

    e = engine_kv(m, 8, 128, false, kv);
    result many[8];
    for (int i = 7; i >= 0; i--) { /* ours last, so it joins a running batch */
        result_init(&many[i]);
        kiln_gen_request qi = i ? request(p[i], 10 + 5 * i, G, 0.9, 99 + i, &many[i]) : q;
        qi.user = &many[i];
        assert_int_equal(kiln_engine_submit(e, &qi, &id), KILN_OK);
    }
    for (int i = 0; i < 8; i++) wait_done(&many[i]);
    kiln_engine_stats st;
    kiln_engine_get_stats(e, &st);
    assert_true(st.steps < 8 * (G + 1)); /* they really shared steps */
    assert_int_equal(many[0].n, G);
    assert_memory_equal(many[0].tokens, alone.tokens, sizeof(int) * G);
    assert_memory_equal(many[0].logprobs, alone.logprobs, sizeof(float) * G);
    kiln_engine_free(e);
    for (int i = 0; i < 8; i++) result_destroy(&many[i]);
    result_destroy(&alone);
    kiln_gpt_free(m);
}

static void same_seed_same_tokens_alone_or_batched(void **state)
{
    same_seed_alone_or_batched(KILN_DTYPE_F32);
    same_seed_alone_or_batched(KILN_DTYPE_F16);
    weight_quant = KILN_WEIGHT_QUANT_Q8_0;
    same_seed_alone_or_batched(KILN_DTYPE_F32);
    weight_quant = KILN_WEIGHT_QUANT_NONE;
}

/* The second request with the same 40-token prompt reuses its KV blocks and still
 * gives the tokens of an engine without a prefix cache. */
/* Prompt length P in blocks of 8: a 44-token prompt reuses its 5 whole blocks (40
 * tokens) and computes the other 4; a 40-token prompt is all cached blocks, and reuses
 * 39 tokens: its last block is copied and its last token recomputed. Either way the
 * tokens and logprobs are those of an engine without a prefix cache, and every block
 * is free after. */
static void prefix_case(int P, uint64_t hit_tokens)
{
    kiln_gpt_t *m = model();
    int32_t p[44];
    prompt_of(p, P, 9);
    result a, b, ref;
    result_init(&a);
    result_init(&b);
    result_init(&ref);
    uint64_t id;
    kiln_engine_t *e = engine(m, 4, 64, false);
    kiln_gen_request q = request(p, P, 20, 0.7, 5, &ref);
    assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
    wait_done(&ref);
    kiln_engine_free(e);

    e = engine(m, 4, 64, true);
    q.user = &a;
    assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
    wait_done(&a);
    q.user = &b;
    assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
    wait_done(&b);
    kiln_engine_stats st;
    kiln_engine_get_stats(e, &st);
    assert_int_equal(st.prefix_hit_tokens, hit_tokens);
    assert_memory_equal(a.tokens, ref.tokens, sizeof(int) * 20);
    assert_memory_equal(b.tokens, ref.tokens, sizeof(int) * 20);
    /* and bitwise the same logprobs: a wrong key would move them, if not the draws */
    assert_memory_equal(a.logprobs, ref.logprobs, sizeof(float) * 20);
    assert_memory_equal(b.logprobs, ref.logprobs, sizeof(float) * 20);
    assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
    kiln_engine_free(e);
    result_destroy(&a);
    result_destroy(&b);
    result_destroy(&ref);
    kiln_gpt_free(m);
}

static void prefix_cache_hits_give_the_same_tokens(void **state)
{
    prefix_case(44, 40);
    prefix_case(40, 39);
}

/* Cancelling a running request ends it with CANCELLED and frees its blocks; a
 * callback returning false ends it with STOP; each gets exactly one final call. */
static void cancel_and_stop_free_the_blocks(void **state)
{
    kiln_gpt_t *m = model();
    kiln_engine_t *e = engine(m, 4, 64, false);
    int32_t p[30];
    prompt_of(p, 30, 2);
    result a, b;
    result_init(&a);
    result_init(&b);
    b.stop_after = 3;
    kiln_gen_request qa = request(p, 30, 60, 1.0, 1, &a), qb = request(p, 30, 60, 1.0, 2, &b);
    uint64_t ia, ib;
    assert_int_equal(kiln_engine_submit(e, &qa, &ia), KILN_OK);
    assert_int_equal(kiln_engine_submit(e, &qb, &ib), KILN_OK);
    kiln_engine_cancel(e, ia);
    wait_done(&a);
    wait_done(&b);
    assert_int_equal(a.finish, KILN_FINISH_CANCELLED);
    assert_true(a.n < 60);
    assert_int_equal(b.finish, KILN_FINISH_STOP);
    assert_int_equal(b.n, 3);
    kiln_engine_cancel(e, ia); /* finished ids are ignored */
    kiln_engine_cancel(e, 987654);
    kiln_engine_stats st;
    kiln_engine_get_stats(e, &st);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
    kiln_engine_free(e);
    result_destroy(&a);
    result_destroy(&b);
    kiln_gpt_free(m);
}

/* With room for one request's blocks at a time, the second waits and then runs; past
 * max_queue, submit says BUSY; requests that can never run are refused up front. */
static void memory_waits_queue_limits_and_bad_requests(void **state)
{
    kiln_gpt_t *m = model();
    kiln_engine_opts o = kiln_engine_opts_default();
    o.max_batch = 4;
    o.num_blocks = 10; /* 80 positions: one request of 30 + 40 at a time */
    o.block_len = 8;
    o.max_queue = 1;
    o.max_step_tokens = 40;
    o.prefix_cache = false;
    kiln_engine_t *e;
    o.kv_dtype = KILN_DTYPE_I32; /* not a KV cache type: refused, and named */
    assert_int_equal(kiln_engine_new(m, &o, &e), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "kv_dtype"));
    kiln_clear_error();
    o.kv_dtype = KILN_DTYPE_F32;
    assert_int_equal(kiln_engine_new(m, &o, &e), KILN_OK);
    int32_t p[30];
    prompt_of(p, 30, 4);
    result r[3];
    uint64_t id;
    for (int i = 0; i < 3; i++) result_init(&r[i]);
    kiln_gen_request q0 = request(p, 30, 40, 0.5, 1, &r[0]), q1 = request(p, 30, 40, 0.5, 2, &r[1]);
    kiln_gen_request q2 = request(p, 30, 40, 0.5, 3, &r[2]);
    assert_int_equal(kiln_engine_submit(e, &q0, &id), KILN_OK);
    /* Wait until the first runs, so that the queue holds exactly the next one. */
    for (int i = 0; i < 2000; i++) {
        kiln_engine_stats st;
        kiln_engine_get_stats(e, &st);
        if (st.running == 1) break;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    assert_int_equal(kiln_engine_submit(e, &q1, &id), KILN_OK);
    kiln_status s = kiln_engine_submit(e, &q2, &id);
    if (s == KILN_OK) {
        /* The first finished in the meantime and the second was admitted; fine, but
         * then this one must have been queued behind it. */
        wait_done(&r[2]);
    } else {
        assert_int_equal(s, KILN_ERR_BUSY);
        assert_non_null(strstr(kiln_last_error(), "max_queue"));
        kiln_clear_error();
    }
    wait_done(&r[0]);
    wait_done(&r[1]);
    assert_int_equal(r[0].n, 40);
    assert_int_equal(r[1].n, 40);

    kiln_gen_request bad = request(p, 30, 90, 0.5, 1, &r[2]); /* 120 > block_size 96 */
    assert_int_equal(kiln_engine_submit(e, &bad, &id), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "96"));
    bad = request(p, 0, 5, 0.5, 1, &r[2]);
    assert_int_equal(kiln_engine_submit(e, &bad, &id), KILN_ERR_ARG);
    int32_t oov[2] = {3, 61};
    bad = request(oov, 2, 5, 0.5, 1, &r[2]);
    assert_int_equal(kiln_engine_submit(e, &bad, &id), KILN_ERR_INDEX);
    bad = request(p, 30, 5, -1.0, 1, &r[2]);
    assert_int_equal(kiln_engine_submit(e, &bad, &id), KILN_ERR_ARG);
    kiln_clear_error();
    kiln_engine_free(e);
    for (int i = 0; i < 3; i++) result_destroy(&r[i]);
    kiln_gpt_free(m);
}

/* Freeing the engine with requests queued and running gives each its final call. */
static void free_cancels_what_is_left(void **state)
{
    kiln_gpt_t *m = model();
    kiln_engine_t *e = engine(m, 2, 64, true);
    int32_t p[20];
    prompt_of(p, 20, 6);
    result r[5];
    uint64_t id;
    for (int i = 0; i < 5; i++) {
        result_init(&r[i]);
        kiln_gen_request q = request(p, 20, 70, 1.0, (uint64_t)i, &r[i]);
        assert_int_equal(kiln_engine_submit(e, &q, &id), KILN_OK);
    }
    kiln_engine_free(e);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(r[i].finals, 1);
        assert_true(r[i].finish == KILN_FINISH_CANCELLED || r[i].finish == KILN_FINISH_LENGTH);
        result_destroy(&r[i]);
    }
    kiln_gpt_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(greedy_matches_the_kv_cache_loop, setup, teardown),
        cmocka_unit_test_setup_teardown(windowed_model_decodes_in_bounded_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(same_seed_same_tokens_alone_or_batched, setup, teardown),
        cmocka_unit_test_setup_teardown(prefix_cache_hits_give_the_same_tokens, setup, teardown),
        cmocka_unit_test_setup_teardown(cancel_and_stop_free_the_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(memory_waits_queue_limits_and_bad_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(free_cancels_what_is_left, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
