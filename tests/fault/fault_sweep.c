/* Allocation fault injection over kiln's API (issue 51's proof), SQLite's way: each
 * scenario below is run once to count its allocations, then again for each n with the
 * nth allocation failing (tests/fault/fault_alloc.c). Every run is a child process of
 * its own (started fresh: kiln initialised in it), so that a crash, a hang or a leak is
 * that run's alone. A run passes when the scenario returns an error that says why
 * (kiln_last_error set), or succeeds all the same with the result of a clean run (the
 * digest each scenario computes from its outputs); and when, after it, a clean run in
 * the same process still gets that result and leaves no more tensor memory than the
 * clean run did (a process-wide cache, as flex's, is allowed; a leak grows), and, in
 * the ASan build, LeakSanitizer finds no leak at its end.
 *   fault_sweep [SCENARIO] [--max-runs N]     KILN_FAULT_ALLOC=N: that one run alone
 *   fault_sweep --list                          the scenarios' names
 *   FAULT_INLINE=1 KILN_FAULT_ALLOC=N gdb --args fault_sweep SCENARIO    without a fork
 * Prints one line a scenario and 'N passed, N failed' at the end. */
#define _XOPEN_SOURCE 700 /* nftw */
#include <ftw.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "core/parse.h" /* the one strict number parser */
#include "core/util.h"    /* kiln__now_s */
#include "fault_alloc.h"
#include "kiln/dist.h"
#include "kiln/flex.h"
#include "kiln/graph.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/optim.h"
#include "kiln/serve.h"
#include "kiln/tokenizer.h"
#include "serve/openai.h" /* the formats the server speaks, without HTTP */

static char dir[256];

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path) != 0;
}

/* Removes path and everything under it (the sweep's files, a run's checkpoint). */
static void remove_tree(const char *path) { nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS); }

#define TRY(x)                                                                                                         \
    do {                                                                                                               \
        if (!(x)) {                                                                                                    \
            s = kiln_last_status() ? kiln_last_status() : KILN_ERR_INTERNAL;                                           \
            goto out;                                                                                                  \
        }                                                                                                              \
    } while (0)

/* ---- the scenarios: each frees all it made, whatever fails ---- */

/* Tracks t's gradients, as a careful caller does: out of memory, the tensor stays
 * untracked and kiln_last_error says so (kiln/ops.h), so the caller asks. */
static bool track(kiln_tensor_t *t)
{
    if (t) kiln_tensor_set_requires_grad(t, true);
    return t && kiln_tensor_requires_grad(t);
}

static kiln_status sc_autograd(double *digest)
{
    kiln_status s = KILN_OK;
    int64_t sa[2] = {4, 3}, sb[2] = {3, 5};
    kiln_tensor_t *a = kiln_randn(sa, 2, KILN_DTYPE_F32), *b = kiln_randn(sb, 2, KILN_DTYPE_F32);
    kiln_scope_begin();
    TRY(a && b && track(a));
    kiln_tensor_t *y = kiln_softmax(kiln_gelu(kiln_matmul(a, b), true), -1);
    TRY(y);
    kiln_tensor_t *loss = kiln_sum(kiln_mul(y, y), NULL, 0, false);
    TRY(loss);
    s = kiln_backward(loss);
    kiln_tensor_t *g = s == KILN_OK ? kiln_sum(kiln_tensor_grad(a), NULL, 0, false) : NULL;
    double v = 0, w = 0;
    if (s == KILN_OK) TRY(g && kiln_tensor_item(g, &v) == KILN_OK && kiln_tensor_item(loss, &w) == KILN_OK);
    *digest = v + w;
out:
    kiln_scope_end();
    kiln_tensor_free(a);
    kiln_tensor_free(b);
    return s;
}

static kiln_status sc_safetensors(double *digest)
{
    kiln_status s = KILN_OK;
    char path[400];
    snprintf(path, sizeof path, "%s/st.safetensors", dir);
    int64_t sh[2] = {3, 4};
    kiln_tensor_t *t[2] = {kiln_randn(sh, 2, KILN_DTYPE_F32), kiln_randn(sh, 1, KILN_DTYPE_BF16)};
    const char *names[2] = {"a", "b.c"};
    kiln_safetensors_t *f = NULL;
    TRY(t[0] && t[1]);
    const char *meta[] = {"format", "pt", NULL};
    if ((s = kiln_safetensors_save(path, names, t, 2, meta)) != KILN_OK) goto out;
    if ((s = kiln_safetensors_load(path, &f)) != KILN_OK) goto out;
    kiln_scope_begin();
    kiln_tensor_t *g = kiln_safetensors_get(f, "b.c"), *sum = g ? kiln_sum(kiln_cast(g, KILN_DTYPE_F32), NULL, 0, false) : NULL;
    s = sum ? kiln_tensor_item(sum, digest) : kiln_last_status();
    kiln_scope_end();
out:
    kiln_safetensors_free(f);
    kiln_tensor_free(t[0]);
    kiln_tensor_free(t[1]);
    return s;
}

static kiln_status sc_tokenizer(double *digest)
{
    static const char text[] = "the light was good and the darkness was upon the face of the deep waters; "
                               "and the light was good. <|endoftext|> caf\xc3\xa9 na\xc3\xafve 12345";
    kiln_status s;
    kiln_tokenizer_t *t = NULL, *u = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    char *back = NULL, path[400];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if ((s = kiln_tokenizer_train_bpe(text, sizeof text - 1, 280, &t)) != KILN_OK) goto out;
    if ((s = kiln_tokenizer_encode_new(t, text, sizeof text - 1, 0, &ids, &n)) != KILN_OK) goto out;
    if ((s = kiln_tokenizer_decode(t, ids, n, &back)) != KILN_OK) goto out;
    if (strcmp(back, text)) s = kiln_error(KILN_ERR_INTERNAL, "fault_sweep: the round trip changed the text");
    if (s == KILN_OK) s = kiln_tokenizer_save(t, path);
    if (s == KILN_OK) s = kiln_tokenizer_load(path, &u);
    *digest = (double)n;
    for (size_t i = 0; i < n; i++) *digest += (double)ids[i] * (double)(i + 1);
out:
    free(back);
    free(ids);
    kiln_tokenizer_free(t);
    kiln_tokenizer_free(u);
    return s;
}

static kiln_gpt_config tiny(void)
{
    kiln_gpt_config c = kiln_gpt_config_llama();
    c.n_layer = 1, c.n_head = 2, c.n_kv_head = 1, c.n_embd = 32, c.block_size = 16, c.vocab_size = 256;
    return c;
}

static kiln_status sc_gpt(double *digest)
{
    kiln_status s = KILN_OK;
    kiln_gpt_config c = tiny();
    kiln_gpt_t *m = NULL;
    if ((s = kiln_gpt_new(&c, 7, &m)) != KILN_OK) return s;
    kiln_scope_begin();
    kiln_tensor_t *idx = kiln_arange(0, 16, 1, KILN_DTYPE_I64), *tg = kiln_arange(1, 17, 1, KILN_DTYPE_I64), *loss = NULL;
    TRY(idx && tg);
    int64_t sh[2] = {2, 8};
    idx = kiln_reshape(idx, sh, 2), tg = kiln_reshape(tg, sh, 2);
    TRY(idx && tg);
    TRY(kiln_gpt_forward(m, idx, tg, true, &loss) && loss);
    s = kiln_backward(loss);
    if (s == KILN_OK) s = kiln_tensor_item(loss, digest);
    kiln_tensor_t *g = kiln_tensor_grad(kiln_gpt_param(m, 0, NULL));
    double v = 0;
    if (s == KILN_OK) TRY(g && kiln_tensor_item(kiln_sum(g, NULL, 0, false), &v) == KILN_OK);
    *digest += v;
out:
    kiln_scope_end();
    kiln_gpt_free(m);
    return s;
}

static kiln_status sc_hf_load(double *digest)
{
    char path[400];
    snprintf(path, sizeof path, "%s/hf", dir);
    kiln_gpt_t *m = NULL;
    kiln_tokenizer_t *t = NULL;
    char *tmpl = NULL;
    kiln_status s = kiln_model_load(path, &m, &t, &tmpl);
    if (s == KILN_OK) {
        kiln_scope_begin();
        kiln_tensor_t *p = kiln_gpt_param(m, 0, NULL), *sum = p ? kiln_sum(p, NULL, 0, false) : NULL;
        s = sum ? kiln_tensor_item(sum, digest) : kiln_last_status();
        kiln_scope_end();
    }
    kiln_gpt_free(m);
    kiln_tokenizer_free(t);
    free(tmpl);
    return s;
}

static kiln_status sc_flex(double *digest)
{
    kiln_flex_t *f = NULL, *g = NULL, *h = NULL;
    kiln_block_mask_t *bm = NULL;
    kiln_status s = kiln_flex_new("30.0 * tanh(score / 30.0) + (kv_idx - q_idx) * 0.25",
                                  "q_idx >= kv_idx && q_idx - kv_idx < 6", NULL, 0, &f);
    kiln_flex_inputs in = {.heads = 2};
    if (s == KILN_OK) s = kiln_flex_preset("window:4+softcap:20+alibi", &in, &g);
    if (s == KILN_OK) s = kiln_flex_and(f, g, &h);
    if (s == KILN_OK) s = kiln_block_mask_new(h, 1, 2, 16, 16, 4, 4, &bm);
    if (s == KILN_OK) {
        int64_t full, partial, empty;
        double density;
        kiln_block_mask_stats(bm, &full, &partial, &empty, &density);
        *digest = (double)full * 1e6 + (double)partial * 1e3 + (double)empty + density;
    }
    kiln_block_mask_free(bm);
    kiln_flex_free(f);
    kiln_flex_free(g);
    kiln_flex_free(h);
    return s;
}

/* A small function for the graph and compiler scenarios: a linear layer, gelu and a
 * squared loss, with backward (its gradient goes to w). ctx: w. */
static kiln_status mlp_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    kiln_tensor_t *h = kiln_gelu(kiln_matmul(in[0], ctx), true);
    kiln_tensor_t *loss = kiln_sum(kiln_mul(h, h), NULL, 0, false);
    if (!loss) return kiln_last_status();
    kiln_status s = kiln_backward(loss);
    out[0] = loss;
    *n_out = 1;
    return s;
}

/* The parameter those scenarios share: w (3, 5), requiring gradients. */
static kiln_tensor_t *mlp_weight(void)
{
    int64_t sw[2] = {3, 5};
    kiln_tensor_t *w = kiln_randn(sw, 2, KILN_DTYPE_F32);
    if (track(w)) return w;
    kiln_tensor_free(w);
    return NULL;
}

/* The sum of w's gradient (0 when it has none) into *v. */
static kiln_status grad_sum(kiln_tensor_t *w, double *v)
{
    kiln_tensor_t *g = kiln_tensor_grad(w), *sum = g ? kiln_sum(g, NULL, 0, false) : NULL;
    *v = 0;
    return !g ? KILN_OK : sum ? kiln_tensor_item(sum, v) : kiln_last_status();
}

/* Graph capture, every pass, the listing, two runs, and a recorded replay run twice. */
static kiln_status sc_graph(double *digest)
{
    kiln_status s = KILN_OK;
    int64_t sx[2] = {4, 3};
    kiln_tensor_t *w = mlp_weight(), *x = kiln_randn(sx, 2, KILN_DTYPE_F32), *out[2] = {NULL, NULL};
    kiln_graph_t *g = NULL;
    kiln_replay_t *r = NULL;
    int n = 0, removed = 0;
    double v = 0;
    kiln_scope_begin();
    TRY(w && x);
    if ((s = kiln_graph_capture(mlp_fn, w, &x, 1, &g)) != KILN_OK) goto out;
    if ((s = kiln_graph_decompose(g, &removed)) != KILN_OK || (s = kiln_graph_fold(g, &removed)) != KILN_OK ||
        (s = kiln_graph_cse(g, &removed)) != KILN_OK || (s = kiln_graph_recompute(g, &removed)) != KILN_OK ||
        (s = kiln_graph_merge_slices(g, &removed)) != KILN_OK || (s = kiln_graph_sink_views(g, &removed)) != KILN_OK ||
        (s = kiln_graph_hoist_siblings(g, &removed)) != KILN_OK || (s = kiln_graph_dce(g, &removed)) != KILN_OK)
        goto out;
    FILE *null = fopen("/dev/null", "w");
    s = null ? kiln_graph_print(g, null) : kiln_error(KILN_ERR_IO, "fault_sweep: cannot open /dev/null");
    if (null) fclose(null);
    if (s != KILN_OK) goto out;
    for (int i = 0; i < 2; i++) {
        if ((s = kiln_graph_run(g, &x, 1, out, 2, &n)) != KILN_OK) goto out;
        TRY(n == 1 && kiln_tensor_item(out[0], &v) == KILN_OK);
        *digest += v;
    }
    if ((s = kiln_replay_record(mlp_fn, w, &x, 1, &r, out, 2, &n)) != KILN_OK) goto out;
    for (int i = 0; i < 2; i++) {
        if ((s = kiln_replay_run(r, &x, 1, out, 2, &n)) != KILN_OK) goto out;
        TRY(n == 1 && kiln_tensor_item(out[0], &v) == KILN_OK);
        *digest += v;
    }
    if ((s = grad_sum(w, &v)) == KILN_OK) *digest += v;
out:
    kiln_replay_free(r);
    kiln_graph_free(g);
    kiln_scope_end();
    kiln_tensor_free(x);
    kiln_tensor_free(w);
    return s;
}

/* A compiled function: compiled at its first call (generated kernels, built by the
 * system compiler once and then found in the sweep's kernel cache), a hit at its second,
 * captured and compiled again for another shape at its third. */
static kiln_status sc_compiled(double *digest)
{
    kiln_status s = KILN_OK;
    int64_t sx[2] = {4, 3}, sy[2] = {2, 3};
    kiln_tensor_t *w = mlp_weight(), *x = kiln_randn(sx, 2, KILN_DTYPE_F32), *y = kiln_randn(sy, 2, KILN_DTYPE_F32);
    kiln_tensor_t *out[2] = {NULL, NULL};
    kiln_compiled_t *c = NULL;
    int n = 0;
    double v = 0;
    kiln_scope_begin();
    TRY(w && x && y);
    if ((s = kiln_compiled_new(mlp_fn, w, "fault", &c)) != KILN_OK) goto out;
    kiln_tensor_t *args[3] = {x, x, y};
    for (int i = 0; i < 3; i++) {
        if ((s = kiln_compiled_call(c, &args[i], 1, out, 2, &n)) != KILN_OK) goto out;
        TRY(n == 1 && kiln_tensor_item(out[0], &v) == KILN_OK);
        *digest += v;
    }
    uint64_t calls = 0, hits = 0, recompiles = 0;
    int graphs = 0;
    kiln_compiled_stats(c, &calls, &hits, &recompiles, &graphs);
    *digest += (double)(calls * 1000 + hits * 100 + recompiles * 10 + (uint64_t)graphs);
    if ((s = grad_sum(w, &v)) == KILN_OK) *digest += v;
out:
    kiln_compiled_free(c);
    kiln_scope_end();
    kiln_tensor_free(x);
    kiln_tensor_free(y);
    kiln_tensor_free(w);
    return s;
}

/* The serving engine in process: a greedy request with logprobs, and from its first
 * token's callback (on the engine's thread, so the order of allocations is the same
 * every run) a sampled one that shares its prompt's first blocks (a prefix-cache hit),
 * batched with it, and a third cancelled while it waits. The main thread waits for
 * every final call. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kiln_engine_t *e;
    int pending;       /* requests whose final call has not come */
    double digest;
    kiln_status err;   /* a failure on the engine's thread, with its message */
    char msg[512];
} serve_run;

typedef struct {
    serve_run *run;
    int k;
} serve_req;

static const int32_t serve_prompt[9] = {5, 17, 33, 2, 9, 40, 41, 3, 60};

static bool serve_cb(void *user, const kiln_token_event *ev, kiln_finish fin);

static kiln_status serve_submit(serve_run *run, serve_req *q, uint64_t *id)
{
    kiln_gen_request r = {.prompt = serve_prompt, .n_prompt = q->k ? 9 : 8, .max_tokens = q->k ? 3 : 4,
                          .sampling = {.temperature = q->k ? 0.8 : 0, .top_k = 20, .top_p = 0.9, .seed = 7},
                          .logprobs = q->k ? -1 : 2, .cb = serve_cb, .user = q};
    pthread_mutex_lock(&run->mu);
    run->pending++; /* before the engine can finish it */
    pthread_mutex_unlock(&run->mu);
    kiln_status s = kiln_engine_submit(run->e, &r, id);
    if (s != KILN_OK) {
        pthread_mutex_lock(&run->mu);
        run->pending--;
        pthread_mutex_unlock(&run->mu);
    }
    return s;
}

static bool serve_cb(void *user, const kiln_token_event *ev, kiln_finish fin)
{
    serve_req *q = user;
    serve_run *run = q->run;
    if (ev) {
        run->digest += (double)ev->token * (ev->index + 1) * (q->k + 1) + (q->k ? 0 : ev->logprob + ev->top_ids[1]);
        if (q->k == 0 && ev->index == 0) {
            uint64_t id = 0;
            kiln_status s = serve_submit(run, q + 1, NULL);
            if (s == KILN_OK) s = serve_submit(run, q + 2, &id);
            kiln_engine_cancel(run->e, id); /* (0, if it was not queued, is ignored) */
            if (s != KILN_OK && !run->err) {
                run->err = s;
                snprintf(run->msg, sizeof run->msg, "%s", kiln_last_error());
            }
        }
        return true;
    }
    pthread_mutex_lock(&run->mu);
    run->digest += 1e6 * fin * (q->k + 1);
    if (fin == KILN_FINISH_ERROR && !run->err) {
        run->err = KILN_ERR_INTERNAL;
        kiln_engine_last_error(run->e, run->msg, sizeof run->msg);
    }
    run->pending--;
    pthread_cond_signal(&run->cv);
    pthread_mutex_unlock(&run->mu);
    return true;
}

static kiln_status sc_serve(double *digest)
{
    kiln_gpt_config c = tiny();
    kiln_gpt_t *m = NULL;
    serve_run run = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    serve_req q[3] = {{&run, 0}, {&run, 1}, {&run, 2}};
    kiln_engine_opts o = kiln_engine_opts_default();
    o.max_batch = 2, o.max_step_tokens = 8, o.block_len = 4, o.num_blocks = 12;
    kiln_status s = kiln_gpt_new(&c, 7, &m);
    if (s == KILN_OK) s = kiln_engine_new(m, &o, &run.e);
    if (s == KILN_OK) s = serve_submit(&run, &q[0], NULL);
    pthread_mutex_lock(&run.mu);
    while (run.pending > 0) pthread_cond_wait(&run.cv, &run.mu);
    pthread_mutex_unlock(&run.mu);
    kiln_engine_free(run.e);
    kiln_gpt_free(m);
    if (s == KILN_OK && run.err) {
        /* the engine's thread's message, said here (an empty one stays empty: a bad run) */
        if (*run.msg) s = kiln_error(run.err, "%s", run.msg);
        else kiln_clear_error(), s = run.err;
    }
    *digest = run.digest;
    return s;
}

/* The parameters of the optimizer and distributed scenarios: w (4, 3) and b (3),
 * requiring gradients. */
static kiln_status two_params(kiln_tensor_t **p)
{
    int64_t sw[2] = {4, 3}, sb[1] = {3};
    p[0] = kiln_randn(sw, 2, KILN_DTYPE_F32), p[1] = kiln_randn(sb, 1, KILN_DTYPE_F32);
    return track(p[0]) && track(p[1]) ? KILN_OK : kiln_last_status();
}

/* Adds the gradients of sum((x w + b)^2) for a new x (2, 4) into those parameters. */
static kiln_status params_backward(kiln_tensor_t **p)
{
    int64_t sx[2] = {2, 4};
    kiln_scope_begin();
    kiln_tensor_t *x = kiln_randn(sx, 2, KILN_DTYPE_F32), *y = x ? kiln_add(kiln_matmul(x, p[0]), p[1]) : NULL;
    kiln_tensor_t *loss = y ? kiln_sum(kiln_mul(y, y), NULL, 0, false) : NULL;
    kiln_status s = loss ? kiln_backward(loss) : kiln_last_status();
    kiln_scope_end();
    return s;
}

/* The sum of every element of p[0..n) into *v. */
static kiln_status params_sum(kiln_tensor_t *const *p, int n, double *v)
{
    *v = 0;
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    for (int i = 0; i < n && s == KILN_OK; i++) {
        kiln_tensor_t *sum = kiln_sum(p[i], NULL, 0, false);
        double x = 0;
        s = sum ? kiln_tensor_item(sum, &x) : kiln_last_status();
        *v += x * (i + 1);
    }
    kiln_scope_end();
    return s;
}

/* AdamW: clipping, a step, a step with the rate and the clipping as tensors; SGD with
 * momentum; the state read and restored. */
static kiln_status sc_optim(double *digest)
{
    kiln_tensor_t *p[2] = {NULL, NULL}, *lr = NULL;
    kiln_optim_t *adam = NULL, *sgd = NULL;
    double norm = 0, v = 0;
    kiln_status s = two_params(p);
    if (s == KILN_OK) s = kiln_adamw_new(p, 2, NULL, 0.9, 0.95, 1e-8, 0.1, &adam);
    if (s == KILN_OK) s = params_backward(p);
    if (s == KILN_OK) s = kiln_clip_grad_norm(p, 2, 1.0, &norm);
    if (s == KILN_OK) s = kiln_optim_step(adam, 1e-2);
    if (s == KILN_OK) kiln_optim_zero_grad(adam), s = params_backward(p);
    if (s == KILN_OK) s = (lr = kiln_scalar(1e-2, KILN_DTYPE_F32)) ? KILN_OK : kiln_last_status();
    if (s == KILN_OK) {
        kiln_scope_begin();
        kiln_tensor_t *gn = NULL;
        s = kiln_grad_norm(p, 2, &gn);
        kiln_tensor_t *coef = s == KILN_OK ? kiln_clip_coef(gn, 1.0) : NULL;
        if (s == KILN_OK) s = coef ? kiln_optim_step_t(adam, lr, coef) : kiln_last_status();
        kiln_scope_end();
    }
    if (s == KILN_OK) s = kiln_sgd_new(p, 2, NULL, 0.9, 0.01, &sgd);
    if (s == KILN_OK) s = kiln_optim_step(sgd, 1e-2);
    if (s == KILN_OK) s = kiln_optim_step(sgd, 1e-2);
    if (s == KILN_OK) s = kiln_optim_set_state(adam, 5, 0, 1, kiln_optim_state(adam, 0, 0));
    if (s == KILN_OK) s = params_sum(p, 2, &v);
    *digest = v + norm + (double)kiln_optim_steps(adam) * 100;
    kiln_optim_free(sgd);
    kiln_optim_free(adam);
    kiln_tensor_free(lr);
    kiln_tensor_free(p[0]);
    kiln_tensor_free(p[1]);
    return s;
}

/* A process group of one (its collectives run the same path, the all-to-all of expert
 * parallelism too), DDP's gradient buckets around a backward, ZeRO-1 steps and its
 * sharded checkpoint saved and loaded. */
static kiln_status sc_dist(double *digest)
{
    kiln_pg_t *pg = NULL;
    kiln_ddp_t *ddp = NULL;
    kiln_zero1_t *z = NULL;
    kiln_tensor_t *p[2] = {NULL, NULL}, *gathered = NULL, *part = NULL;
    kiln_pg_work_t *work = NULL;
    double norm = 0, v = 0;
    int64_t s12[1] = {12}, s3[1] = {3};
    kiln_status s = kiln_pg_new_from_env(&pg);
    if (s == KILN_OK) s = two_params(p);
    if (s == KILN_OK) s = kiln_ddp_new(pg, p, 2, 16, 32, &ddp);
    if (s == KILN_OK) s = kiln_ddp_begin(ddp);
    if (s == KILN_OK) s = params_backward(p);
    if (s == KILN_OK) s = kiln_ddp_finish(ddp);
    if (s == KILN_OK) s = kiln_pg_allreduce(pg, p[0], KILN_REDUCE_AVG);
    if (s == KILN_OK) s = kiln_pg_broadcast(pg, p[1], 0);
    if (s == KILN_OK) s = kiln_pg_barrier(pg);
    if (s == KILN_OK) s = kiln_pg_allreduce_async(pg, p[1], KILN_REDUCE_SUM, &work);
    if (s == KILN_OK) s = kiln_pg_work_wait(work);
    if (s == KILN_OK) s = (gathered = kiln_zeros(s3, 1, KILN_DTYPE_F32)) ? KILN_OK : kiln_last_status();
    if (s == KILN_OK) s = kiln_pg_allgather(pg, p[1], gathered);
    if (s == KILN_OK) s = (part = kiln_zeros(s12, 1, KILN_DTYPE_F32)) ? KILN_OK : kiln_last_status();
    if (s == KILN_OK) {
        kiln_scope_begin();
        kiln_tensor_t *flat = kiln_reshape(p[0], (int64_t[]){12}, 1);
        s = flat ? kiln_pg_reduce_scatter(pg, flat, part, KILN_REDUCE_SUM) : kiln_last_status();
        kiln_scope_end();
    }
    if (s == KILN_OK) { /* the exchange of expert parallelism: 3 of w's 4 rows to this rank */
        kiln_scope_begin();
        int64_t three = 3;
        kiln_tensor_t *counts = kiln_from_data(&three, (int64_t[]){1}, 1, KILN_DTYPE_I64), *y = NULL, *got = NULL;
        s = counts ? kiln_pg_all_to_all(pg, p[0], counts, 4, &y, &got) : kiln_last_status();
        kiln_tensor_t *sum = s == KILN_OK ? kiln_sum(y, NULL, 0, false) : NULL;
        if (s == KILN_OK) s = sum ? kiln_tensor_item(sum, &v) : kiln_last_status();
        kiln_scope_end();
        *digest += v;
    }
    if (s == KILN_OK) s = kiln_pg_check_step(pg);
    if (s == KILN_OK) s = kiln_zero1_new(pg, p, 2, NULL, 0.9, 0.95, 1e-8, 0.1, NULL, &z);
    if (s == KILN_OK) s = kiln_zero1_step(z, 1e-2, 1.0, &norm);
    char ckpt[400]; /* this run's sharded checkpoint, saved, committed and loaded back */
    snprintf(ckpt, sizeof ckpt, "%s/zero1-%d", dir, (int)getpid());
    if (s == KILN_OK) s = mkdir(ckpt, 0755) == 0 ? KILN_OK : kiln_error(KILN_ERR_IO, "fault_sweep: mkdir %s", ckpt);
    if (s == KILN_OK) s = kiln_zero1_save(z, ckpt, 1);
    if (s == KILN_OK) s = kiln_zero1_commit(ckpt, 1, 1, -1);
    if (s == KILN_OK) s = kiln_zero1_step(z, 1e-2, 1.0, &norm);
    if (s == KILN_OK) s = kiln_zero1_load(z, ckpt, 1);
    if (s == KILN_OK) s = kiln_zero1_step(z, 1e-2, 1.0, &norm);
    remove_tree(ckpt);
    if (s == KILN_OK) s = params_sum(p, 2, &v);
    *digest += v + norm + (double)kiln_ddp_num_buckets(ddp);
    kiln_zero1_free(z);
    kiln_ddp_free(ddp);
    kiln_tensor_free(gathered);
    kiln_tensor_free(part);
    kiln_tensor_free(p[0]);
    kiln_tensor_free(p[1]);
    kiln_pg_free(pg);
    return s;
}

/* A whole training step of the tiny LLaMA compiled (forward, loss, backward, clipping
 * and AdamW in one graph; kiln_gpt_train_step), called twice: compiled at the first
 * call (kernels from the sweep's cache after the first clean run), a hit at the second. */
static kiln_status sc_train_step(double *digest)
{
    kiln_gpt_config c = tiny();
    kiln_gpt_t *m = NULL;
    kiln_optim_t *opt = NULL;
    kiln_compiled_t *step = NULL;
    kiln_tensor_t *ps[64];
    kiln_status s = kiln_gpt_new(&c, 7, &m);
    int np = s == KILN_OK ? kiln_gpt_num_params(m) : 0;
    if (np > 64) s = kiln_error(KILN_ERR_INTERNAL, "fault_sweep: %d parameters", np);
    for (int i = 0; s == KILN_OK && i < np; i++) ps[i] = kiln_gpt_param(m, i, NULL);
    if (s == KILN_OK) s = kiln_adamw_new(ps, np, NULL, 0.9, 0.95, 1e-8, 0.1, &opt);
    kiln_gpt_step st = {m, opt, ps, np, 1.0, 1, NULL, NULL, false};
    if (s == KILN_OK) s = kiln_compiled_new(kiln_gpt_train_step, &st, "fault_train", &step);
    for (int it = 0; it < 2 && s == KILN_OK; it++) {
        kiln_scope_begin();
        int64_t sh[2] = {2, 8};
        kiln_tensor_t *idx = kiln_reshape(kiln_arange(it, 16 + it, 1, KILN_DTYPE_I64), sh, 2);
        kiln_tensor_t *tg = kiln_reshape(kiln_arange(1 + it, 17 + it, 1, KILN_DTYPE_I64), sh, 2);
        kiln_tensor_t *lr = kiln_scalar(1e-2, KILN_DTYPE_F32), *out[2] = {NULL, NULL};
        int n = 0;
        double loss = 0, norm = 0;
        if (!idx || !tg || !lr) s = kiln_last_status();
        else s = kiln_compiled_call(step, (kiln_tensor_t *[]){idx, tg, lr}, 3, out, 2, &n);
        if (s == KILN_OK && n != 2) s = kiln_error(KILN_ERR_INTERNAL, "fault_sweep: the step gave %d outputs", n);
        if (s == KILN_OK) s = kiln_tensor_item(out[0], &loss);
        if (s == KILN_OK) s = kiln_tensor_item(out[1], &norm);
        *digest += loss + norm * 1e-3;
        kiln_scope_end();
    }
    double v = 0;
    if (s == KILN_OK) s = params_sum(ps, 1, &v);
    *digest += v;
    kiln_compiled_free(step);
    kiln_optim_free(opt);
    kiln_gpt_free(m);
    return s;
}

/* Export: the tiny LLaMA written as a Hugging Face folder (bf16) and as a GGUF file
 * (q8_0), then the folder read back. */
static kiln_status sc_export(double *digest)
{
    kiln_gpt_config c = tiny();
    kiln_gpt_t *m = NULL, *back = NULL;
    kiln_tokenizer_t *t = kiln_tokenizer_byte();
    char hf[400], gguf[400];
    snprintf(hf, sizeof hf, "%s/export-%d", dir, (int)getpid());
    snprintf(gguf, sizeof gguf, "%s/export-%d.gguf", dir, (int)getpid());
    kiln_status s = t ? kiln_gpt_new(&c, 7, &m) : kiln_last_status();
    if (s == KILN_OK) s = kiln_hf_save(m, t, hf, KILN_DTYPE_BF16);
    if (s == KILN_OK) s = kiln_gguf_save(m, t, gguf, KILN_DTYPE_F16, true);
    if (s == KILN_OK) s = kiln_hf_load(hf, &back);
    struct stat st;
    if (s == KILN_OK && stat(gguf, &st) != 0) s = kiln_error(KILN_ERR_IO, "fault_sweep: no %s", gguf);
    double v = 0;
    if (s == KILN_OK) s = params_sum((kiln_tensor_t *[]){kiln_gpt_param(back, 0, NULL)}, 1, &v);
    if (s == KILN_OK) *digest = v + (double)st.st_size;
    remove_tree(hf);
    remove(gguf);
    kiln_gpt_free(back);
    kiln_gpt_free(m);
    kiln_tokenizer_free(t);
    return s;
}

/* The OpenAI formats, as the server uses them without HTTP: a chat request parsed, the
 * default chat template parsed and rendered over its messages, an error body, and the
 * generated bytes streamed as text up to a stop string. A request refused while an
 * allocation failed must say so, not blame the request (a 400 naming a field). Only
 * kiln's own allocations fail here: jansson 2.14 drops bytes without a word when one of
 * its own fails (a string it reads loses a character, an object key it writes is left
 * out), which no caller can see (docs/reliability.md). */
static kiln_status openai_run(double *digest);

static kiln_status sc_openai(double *digest)
{
    fault_json(false);
    kiln_status s = openai_run(digest);
    fault_json(true);
    return s;
}

static kiln_status openai_run(double *digest)
{
    static const char body[] =
        "{\"model\": \"m\", \"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, {\"role\": \"user\", "
        "\"content\": \"caf\\u00e9 <|im_end|> 12\"}], \"max_tokens\": 5, \"temperature\": 0.5, \"top_p\": 0.9, "
        "\"stop\": [\"zz\", \"\\nuser:\"], \"seed\": 3, \"logprobs\": true, \"top_logprobs\": 2, \"stream\": true, "
        "\"stream_options\": {\"include_usage\": true}}";
    static const char *const pieces[] = {"Hel", "lo caf\xc3", "\xa9 z", "z tail"};
    kiln__oai_req r;
    kiln__chat_template t = {0};
    kiln__textstream ts;
    char err[512] = "", *prompt = NULL, *ej = NULL;
    const char *param = NULL;
    bool parsed = false, have_t = false, have_ts = false;
    kiln_status s = KILN_OK;
    int st = kiln__oai_parse(body, sizeof body - 1, true, &r, err, sizeof err, &param);
    parsed = true;
    if (st != 0) {
        if (*err && fault_fired() && !strstr(err, "memory")) {
            fprintf(stderr, "fault openai: refused with %d '%s' (param %s) where an allocation failed\n", st, err,
                    param ? param : "none");
            kiln_clear_error(); /* (a verdict of its own: an error that names the wrong problem) */
            s = KILN_ERR_INTERNAL;
        } else if (*err) {
            s = kiln_error(KILN_ERR_OOM, "openai: %d %s", st, err);
        } else {
            kiln_clear_error(), s = KILN_ERR_INTERNAL;
        }
        goto out;
    }
    have_t = kiln__chat_template_parse(kiln_chat_template_default(), &t, err, sizeof err);
    if (!have_t) {
        s = *err ? kiln_error(KILN_ERR_OOM, "chat template: %s", err) : (kiln_clear_error(), KILN_ERR_INTERNAL);
        goto out;
    }
    if (!(prompt = kiln__chat_render(&t, r.msgs, r.n_msgs)) ||
        !(ej = kiln__oai_error_json("bad \"thing\"", "invalid_request_error", "messages", NULL))) {
        s = kiln_error(KILN_ERR_OOM, "openai: out of memory");
        goto out;
    }
    kiln__textstream_init(&ts, (const char *const *)r.stop, r.n_stop);
    have_ts = true;
    size_t sent = 0, from, len;
    uint64_t h = 0;
    for (int i = 0; i < 4 && !ts.stopped; i++) {
        if (!kiln__textstream_push(&ts, pieces[i], strlen(pieces[i]))) {
            s = kiln_error(KILN_ERR_OOM, "openai: out of memory streaming the text");
            goto out;
        }
        kiln__textstream_take(&ts, i == 3, &from, &len);
        for (size_t k = 0; k < len; k++) h = h * 31 + (unsigned char)ts.text[from + k];
        sent += len;
    }
    *digest = (double)strlen(prompt) * 1e3 + (double)strlen(ej) + (double)sent * 1e6 + (double)(h % 1000003) * 1e-7 +
              r.n_msgs + r.n_stop * 10 + r.logprobs * 100 + t.n_stop * 1e-3 + (ts.stopped ? 0.5 : 0);
out:
    if (have_ts) kiln__textstream_free(&ts);
    if (have_t) kiln__chat_template_free(&t);
    if (parsed) kiln__oai_free(&r);
    free(prompt);
    free(ej);
    return s;
}

/* Flex attention forward and backward on the fused cpu kernels (generated once, then
 * found in the kernel cache), with a block mask, and the mask as a tensor. */
static kiln_status sc_flex_attention(double *digest)
{
    kiln_status s = KILN_OK;
    int64_t sq[4] = {1, 2, 8, 4}, skv[4] = {1, 1, 8, 4};
    kiln_tensor_t *t[3] = {kiln_randn(sq, 4, KILN_DTYPE_F32), kiln_randn(skv, 4, KILN_DTYPE_F32),
                           kiln_randn(skv, 4, KILN_DTYPE_F32)};
    kiln_flex_t *f = NULL;
    kiln_block_mask_t *bm = NULL;
    double v = 0;
    kiln_scope_begin();
    TRY(track(t[0]) && track(t[1]) && track(t[2]));
    if ((s = kiln_flex_preset("causal+softcap:20", NULL, &f)) != KILN_OK) goto out;
    if ((s = kiln_block_mask_new(f, 1, 2, 8, 8, 4, 4, &bm)) != KILN_OK) goto out;
    kiln_tensor_t *lse = NULL, *y = kiln_flex_attention(t[0], t[1], t[2], f, bm, 0, &lse);
    TRY(y && lse);
    kiln_tensor_t *mask = kiln_flex_block_mask(f, 1, 2, 8, 8, 4, 4);
    kiln_tensor_t *y2 = mask ? kiln_flex_attention_masked(t[0], t[1], t[2], f, mask, 0, NULL) : NULL;
    kiln_tensor_t *loss = y2 ? kiln_add(kiln_sum(kiln_mul(y, y2), NULL, 0, false), kiln_sum(lse, NULL, 0, false)) : NULL;
    TRY(loss);
    if ((s = kiln_backward(loss)) != KILN_OK || (s = kiln_tensor_item(loss, digest)) != KILN_OK) goto out;
    for (int i = 0; i < 3 && s == KILN_OK; i++)
        if ((s = grad_sum(t[i], &v)) == KILN_OK) *digest += v * (i + 2);
out:
    kiln_scope_end();
    kiln_block_mask_free(bm);
    kiln_flex_free(f);
    for (int i = 0; i < 3; i++) kiln_tensor_free(t[i]);
    return s;
}

static const struct {
    const char *name;
    kiln_status (*run)(double *digest);
} scenarios[] = {
    {"autograd", sc_autograd}, {"safetensors", sc_safetensors}, {"tokenizer", sc_tokenizer},
    {"gpt", sc_gpt},           {"hf_load", sc_hf_load},         {"flex", sc_flex},
    {"graph", sc_graph},       {"compiled", sc_compiled},       {"serve", sc_serve},
    {"optim", sc_optim},       {"dist", sc_dist},               {"flex_attention", sc_flex_attention},
    {"train_step", sc_train_step}, {"export", sc_export},   {"openai", sc_openai},
};

/* ---- the runs ---- */

/* A child's verdict, its exit status: none is 1 or 23, the sanitizers' own (an ASan or
 * UBSan report ends a process with 1, LeakSanitizer's at exit with 23), so that a
 * sanitizer's report is never taken for a verdict. */
enum { OK_ERROR = 40, OK_SUCCEEDED, NO_MESSAGE, LEAKED, WRONG, BROKEN, LSAN_LEAK };

/* LeakSanitizer's check, in the ASan build (NULL in the others). A child ends with
 * _exit, which skips the check LeakSanitizer makes at exit, so it asks for one itself. */
int __lsan_do_recoverable_leak_check(void) __attribute__((weak));

/* What a run tells the sweep: the allocations it counted, the digest of its results, and
 * the tensor memory it left (a process-wide cache: flex's compiled modifiers). */
typedef struct {
    long count;
    double digest;
    long long left;
} report;

/* In the child: kiln set up, the scenario run with the nth allocation failing, then run
 * again with none failing: the library must still work (the same digest as ref's) and
 * leave no more memory than a clean run does (a leak grows, a cache does not). */
static int child(int sc, long n, const report *ref, int report_fd)
{
    alarm(120); /* a hang is a failure: SIGALRM ends it */
    kiln_init(1);
    size_t before = kiln_memory_allocated();
    kiln_clear_error();
    double digest = 0;
    fault_arm(n);
    kiln_manual_seed(1234); /* every run draws the same numbers */
    kiln_status s = scenarios[sc].run(&digest);
    report r = {fault_count(), digest, (long long)(kiln_memory_allocated() - before)};
    fault_arm(0);
    if (report_fd >= 0) (void)!write(report_fd, &r, sizeof r);
    const char *name = scenarios[sc].name;
    if (s != KILN_OK && (!strcmp(kiln_last_error(), "no error") || !*kiln_last_error())) {
        fprintf(stderr, "fault %s n=%ld: status %d without a message\n", name, n, s);
        return NO_MESSAGE;
    }
    if (s == KILN_OK && ref && digest != ref->digest) {
        fprintf(stderr, "fault %s n=%ld: succeeded with a different result (%.17g, not %.17g)\n", name, n, digest,
                ref->digest);
        return WRONG;
    }
    kiln_manual_seed(1234);
    digest = 0;
    kiln_status s2 = scenarios[sc].run(&digest);
    long long left = (long long)(kiln_memory_allocated() - before);
    if (s2 != KILN_OK || (ref && digest != ref->digest)) {
        fprintf(stderr, "fault %s n=%ld: status %d, then a clean run %s (%s; %.17g, not %.17g)\n", name, n, s,
                s2 ? "fails" : "differs", kiln_last_error(), digest, ref ? ref->digest : 0.0);
        return BROKEN;
    }
    long long cache = ref ? ref->left : r.left;
    if (left != cache) {
        fprintf(stderr, "fault %s n=%ld: %lld tensor bytes left after a clean run where %lld are cached (status %d: "
                "%s)\n", name, n, left, cache, s, kiln_last_error());
        return LEAKED;
    }
    return s == KILN_OK ? OK_SUCCEEDED : OK_ERROR;
}

/* Runs one child; its exit status (or 128 + the signal that ended it). */
static int spawn(int sc, long n, const report *ref, report *got)
{
    int fds[2];
    if (pipe(fds) != 0) return 200;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        int st = child(sc, n, ref, fds[1]);
        if ((st == OK_ERROR || st == OK_SUCCEEDED) && __lsan_do_recoverable_leak_check &&
            __lsan_do_recoverable_leak_check())
            st = LSAN_LEAK; /* (its report is on stderr) */
        _exit(st);
    }
    close(fds[1]);
    report r = {-1, 0, 0};
    if (read(fds[0], &r, sizeof r) != (ssize_t)sizeof r) r.count = -1;
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    if (got) *got = r;
    return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
}

static int setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln-fault-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) { /* the HF folder hf_load reads: made in a child, so the parent stays fresh */
        kiln_gpt_config c = tiny();
        kiln_gpt_t *m = NULL;
        kiln_tokenizer_t *t = kiln_tokenizer_byte();
        char path[400];
        snprintf(path, sizeof path, "%s/hf", dir);
        int bad = kiln_gpt_new(&c, 7, &m) != KILN_OK || kiln_hf_save(m, t, path, KILN_DTYPE_BF16) != KILN_OK;
        if (bad) fprintf(stderr, "fault_sweep: set-up: %s\n", kiln_last_error());
        _exit(bad);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return !WIFEXITED(st) || WEXITSTATUS(st) != 0;
}

int main(int argc, char **argv)
{
    const char *only = NULL;
    int64_t max_runs = 400, at = 0;
    size_t n_sc = sizeof scenarios / sizeof scenarios[0];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--list")) { /* (tests.cmake's list of ctest cases is checked against it) */
            for (size_t sc = 0; sc < n_sc; sc++) printf("%s%s", sc ? " " : "", scenarios[sc].name);
            return printf("\n"), 0;
        }
        if (strcmp(argv[i], "--max-runs") || i + 1 == argc) only = argv[i];
        else if (kiln__parse_i64(argv[++i], 1, INT64_MAX, "--max-runs", &max_runs) != KILN_OK)
            return fprintf(stderr, "fault_sweep: %s\n", kiln_last_error()), 2;
    }
    size_t known = 0;
    for (size_t sc = 0; only && sc < n_sc; sc++) known += !strcmp(only, scenarios[sc].name);
    if (only && !known) return fprintf(stderr, "fault_sweep: no scenario '%s' (--list names them)\n", only), 2;
    setenv("KILN_NUM_THREADS", "1", 1); /* one thread: the nth allocation is the same one every run */
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    unsetenv("KILN_WORLD_SIZE"); /* dist: a group of one process */
    json_set_alloc_funcs(fault_json_malloc, free);
    if (setup()) return 1;
    char cache[300]; /* the kernel cache of this sweep: the first clean run fills it, the rest find their kernels */
    snprintf(cache, sizeof cache, "%s/kernel-cache", dir);
    setenv("KILN_CACHE_DIR", cache, 1);
    const char *one = getenv("KILN_FAULT_ALLOC"); /* (src/core/env.def lists it) */
    if (one && kiln__parse_i64(one, 0, 1 << 30, "KILN_FAULT_ALLOC", &at) != KILN_OK)
        return fprintf(stderr, "fault_sweep: %s\n", kiln_last_error()), 2;
    if (at == 0) one = NULL; /* (0: sweep them all, as env.def says) */
    if (one && only && getenv("FAULT_INLINE")) /* one run in this process, for a debugger */
        for (size_t sc = 0; sc < n_sc; sc++)
            if (!strcmp(only, scenarios[sc].name)) {
                int st = child((int)sc, (long)at, NULL, -1);
                return st == OK_ERROR || st == OK_SUCCEEDED ? 0 : st;
            }
    int passed = 0, failed = 0;
    for (size_t sc = 0; sc < n_sc; sc++) {
        if (only && strcmp(only, scenarios[sc].name)) continue;
        report ref;
        int st = spawn((int)sc, 0, NULL, &ref);
        long k = ref.count;
        if (st != OK_SUCCEEDED || k <= 0) {
            printf("FAIL  %s: does not run without faults (exit %d)\n", scenarios[sc].name, st);
            failed++;
            continue;
        }
        long step = k > max_runs ? (k + max_runs - 1) / max_runs : 1, first = 1;
        if (one) first = (long)at, k = first, step = 1;
        int errors = 0, succeeded = 0, bad = 0;
        double t0 = kiln__now_s();
        for (long n = first; n <= k; n += step) {
            st = spawn((int)sc, n, &ref, NULL);
            if (st == OK_ERROR) errors++;
            else if (st == OK_SUCCEEDED) succeeded++;
            else {
                bad++;
                printf("      %s: allocation %ld failing: %s (exit %d)\n", scenarios[sc].name, n,
                       st > 128 ? "crashed or hung" : st == LEAKED ? "leaked tensor memory" :
                       st == NO_MESSAGE ? "an error without a message" : st == WRONG ? "a wrong result" :
                       st == BROKEN ? "the library broken after it" : st == LSAN_LEAK ? "a leak (LeakSanitizer)" :
                       "a sanitizer's report or another failure", st);
            }
        }
        printf("%s  %s: %ld allocations, %d runs each failing one (every %ld): %d errors said, %d recovered, %d bad "
               "(%.0f s)\n", bad ? "FAIL" : "ok  ", scenarios[sc].name, one ? 1 : k, errors + succeeded + bad, step,
               errors, succeeded, bad, kiln__now_s() - t0);
        bad ? failed++ : passed++;
    }
    remove_tree(dir);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
