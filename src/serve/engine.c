/* The serving engine: continuous batching over a paged KV cache.
 *
 * One thread runs the model. Each step it takes the cancellations and new requests
 * that arrived, admits waiting requests while there are sequence slots and KV blocks
 * for them, and runs one kiln_gpt_forward_paged over every running sequence at once:
 * one new token for each sequence that is decoding, and a chunk of the prompt for each
 * that is still prefilling (max_step_tokens in all). Sampling and the callbacks follow,
 * then the next step; requests join and leave between steps.
 *
 * KV blocks: a request reserves the blocks for its prompt and max_tokens when it is
 * admitted, so a running request never waits for memory and nothing has to be
 * preempted; a request that does not fit waits in the queue. A model with a sliding
 * window (kiln_gpt_kv_window) needs only the blocks that one step's rows can read, its
 * window plus a step's tokens: a request reserves at most that many (live_max), and a
 * block that falls wholly behind the window is reused for the sequence's next
 * positions, or freed once the sequence will not need it; such blocks are not shared
 * (the prefix cache is off for these models), so reuse never touches another's keys. A block that is full is
 * registered in the prefix cache under the hash of every token up to its end (and its
 * own tokens, compared on a hit, so a hash collision cannot hand out wrong keys). A new
 * request starts from the longest run of cached blocks that its prompt begins with;
 * shared blocks are reference-counted and only ever read. Freed blocks that are cached
 * stay reusable until the allocator needs them, least recently used first.
 *
 * Determinism: the model's rows do not depend on the other rows of a batch, and the
 * sampler is a pure function of (logits, seed, index), so a request gives the same
 * tokens alone, batched, or after a prefix-cache hit. */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kiln/serve.h"
#include "core/threadpool.h"
#include "core/util.h"

typedef struct seq {
    uint64_t id;
    struct seq *next;
    int32_t *tok;        /* prompt, then the generated tokens */
    int n_prompt, n_tok; /* n_tok: prompt + generated so far */
    int max_tokens, generated;
    kiln_sampling sp;
    int32_t *bias_ids; /* the request's logit_bias, copied (sp points at them) */
    float *bias_vals;
    int logprobs;
    kiln_engine_cb cb;
    void *user;
    int *blocks; /* position p is in blocks[p / block_len]; -1 once behind the window */
    int n_blocks; /* blocks assigned, in position order; those before lo are released */
    int lo;
    int *spare, n_spare; /* a windowed sequence's blocks held for its next positions */
    int take;            /* this step's new positions */
    uint64_t *hash; /* prefix hash of each block once it is full */
    int n_done;     /* positions whose keys and values are in the pool */
    int n_hashed;   /* leading blocks hashed (and registered when possible) */
    bool cancel_asked; /* by kiln_engine_cancel, under mu */
    bool cancelled;
    kiln_finish finish;
} seq;

typedef struct {
    int ref;
    bool cached;      /* registered in the prefix cache */
    uint64_t hash, parent;
    uint64_t last_used;
} block_meta;

struct kiln_engine {
    kiln_gpt_t *model;
    kiln_engine_opts o;
    int V, ctx, BS;
    int window, live_max; /* the model's window (0: none) and a sequence's most blocks */
    kiln_kv_pool_t *pool;

    /* Block allocator: free[] holds blocks that are neither used nor cached. */
    block_meta *meta;
    int32_t *block_tokens; /* [num_blocks * BS]: the tokens of each cached block */
    int *free_stack, n_free, n_evictable;
    uint64_t clock;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool started, stop;
    seq *wait_head, *wait_tail; /* under mu */
    int n_waiting;
    bool any_cancel; /* some sequence has cancel_asked, under mu */
    uint64_t next_id;

    /* Changed by the engine thread under mu (kiln_engine_cancel reads it under mu). */
    seq *running;
    int n_running;

    /* Step buffers, engine thread only. */
    int32_t *b_tok, *b_seq, *b_pos, *b_rows, *b_table;
    seq **b_row_seq;
    float *logits;
    void *scratch;       /* per row of a step: kiln_sample_token's candidates */
    size_t scratch_row;  /* bytes of each row's scratch */
    float *adjusted;     /* per row: the logits a penalty or a bias changed */
    int32_t *counts;     /* per row: kiln_sample_adjust's counts (zero between uses) */
    int32_t *picked;     /* per row: the token sampled */
    int top_ids[KILN_MAX_LOGPROBS];
    float top_lp[KILN_MAX_LOGPROBS];

    kiln_engine_stats st; /* under mu */
    char last_error[512]; /* under mu */
};

kiln_engine_opts kiln_engine_opts_default(void)
{
    return (kiln_engine_opts){
        .max_batch = 16,
        .max_queue = 64,
        .max_step_tokens = 512,
        .block_len = 16,
        .num_blocks = 0,
        .kv_memory_mb = 256,
        .prefix_cache = true,
        .kv_dtype = KILN_DTYPE_F32,
        .weight_dtype = KILN_DTYPE_F32,
        .weight_quant = KILN_WEIGHT_QUANT_NONE,
    };
}

const char *kiln_finish_name(kiln_finish f)
{
    static const char *const names[] = {[KILN_FINISH_NONE] = "none", [KILN_FINISH_LENGTH] = "length",
                                        [KILN_FINISH_STOP] = "stop", [KILN_FINISH_CANCELLED] = "cancelled",
                                        [KILN_FINISH_ERROR] = "error"};
    return (unsigned)f < sizeof names / sizeof names[0] && names[f] ? names[f] : "unknown";
}

/* ---- blocks ---- */

static uint64_t block_hash(uint64_t parent, const int32_t *t, int n)
{
    uint64_t h = kiln__mix64(parent ^ 0x6b696c6e2d6b7631ULL);
    for (int i = 0; i < n; i++) h = kiln__mix64(h ^ (uint64_t)(uint32_t)t[i]);
    return h;
}

/* A free block, evicting the least recently used cached one if need be; -1 if none. */
static int block_alloc(kiln_engine_t *e)
{
    int b = -1;
    if (e->n_free > 0) {
        b = e->free_stack[--e->n_free];
    } else if (e->n_evictable > 0) {
        /* A linear scan: evictions happen at admission only, and the pool holds a few
         * thousand blocks at most, so a heap would not pay for itself. */
        for (int i = 0; i < e->o.num_blocks; i++)
            if (e->meta[i].ref == 0 && e->meta[i].cached && (b < 0 || e->meta[i].last_used < e->meta[b].last_used)) b = i;
        if (b >= 0) {
            e->meta[b].cached = false;
            e->n_evictable--;
        }
    }
    if (b >= 0) {
        e->meta[b].ref = 1;
        e->meta[b].last_used = ++e->clock;
    }
    return b;
}

/* One more holder of block b, a cached one perhaps unused until now. */
static void block_hold(kiln_engine_t *e, int b)
{
    if (e->meta[b].ref++ == 0) e->n_evictable--;
    e->meta[b].last_used = ++e->clock;
}

static void block_release(kiln_engine_t *e, int b)
{
    block_meta *m = &e->meta[b];
    if (--m->ref > 0) return;
    m->last_used = ++e->clock;
    if (m->cached) e->n_evictable++;
    else e->free_stack[e->n_free++] = b;
}

/* The cached block holding these tokens after this prefix, or -1. */
static int cache_find(kiln_engine_t *e, uint64_t hash, uint64_t parent, const int32_t *t)
{
    for (int i = 0; i < e->o.num_blocks; i++) {
        const block_meta *m = &e->meta[i];
        if (m->cached && m->hash == hash && m->parent == parent &&
            !memcmp(e->block_tokens + (size_t)i * e->BS, t, sizeof *t * (size_t)e->BS))
            return i;
    }
    return -1;
}

/* Hashes the sequence's newly full blocks and registers them in the prefix cache. */
static void register_full_blocks(kiln_engine_t *e, seq *s)
{
    while ((s->n_hashed + 1) * e->BS <= s->n_done && s->n_hashed < s->n_blocks) {
        int j = s->n_hashed;
        uint64_t parent = j ? s->hash[j - 1] : 0;
        const int32_t *t = s->tok + (size_t)j * e->BS;
        s->hash[j] = block_hash(parent, t, e->BS);
        int b = s->blocks[j];
        if (e->o.prefix_cache && !e->meta[b].cached && cache_find(e, s->hash[j], parent, t) < 0) {
            e->meta[b].cached = true;
            e->meta[b].hash = s->hash[j];
            e->meta[b].parent = parent;
            memcpy(e->block_tokens + (size_t)b * e->BS, t, sizeof *t * (size_t)e->BS);
        }
        s->n_hashed++;
    }
}

/* ---- requests ---- */

static void seq_free(seq *s)
{
    if (s) KILN__FREE(s->tok, s->blocks, s->hash, s->spare, s->bias_ids, s->bias_vals, s);
}

static int blocks_for(const kiln_engine_t *e, int positions) { return (positions + e->BS - 1) / e->BS; }

/* The blocks a request of this many positions holds at once: all of them, or for a
 * windowed model at most live_max. */
static int blocks_held(const kiln_engine_t *e, int positions)
{
    int n = blocks_for(e, positions);
    return n < e->live_max ? n : e->live_max;
}

/* Gives s its blocks: the cached prefix, then fresh ones. false if they are not there.
 * A prompt that is whole cached blocks still needs its last token computed, for the
 * logits of the first new token: its last block is copied from the cache (the cached
 * one stays as it is, shared blocks are only read) and that one token is recomputed
 * into the copy, bitwise as it was (rows do not depend on the batch). */
static bool try_admit(kiln_engine_t *e, seq *s)
{
    int need = blocks_held(e, s->n_prompt + s->max_tokens);
    int matched = 0;
    int max_match = e->o.prefix_cache ? s->n_prompt / e->BS : 0;
    uint64_t parent = 0;
    int *hit = s->blocks; /* matched block ids go straight into place */
    for (; matched < max_match; matched++) {
        const int32_t *t = s->tok + (size_t)matched * e->BS;
        uint64_t h = block_hash(parent, t, e->BS);
        int b = cache_find(e, h, parent, t);
        if (b < 0) break;
        hit[matched] = b;
        s->hash[matched] = h;
        parent = h;
    }
    int shared = matched, src = -1;
    if (matched > 0 && matched * e->BS == s->n_prompt) src = hit[--shared];
    int evictable_hits = src >= 0 && e->meta[src].ref == 0;
    for (int j = 0; j < shared; j++) evictable_hits += e->meta[hit[j]].ref == 0;
    if (e->n_free + e->n_evictable - evictable_hits < need - shared) return false;
    for (int j = 0; j < shared; j++) block_hold(e, hit[j]);
    int done = shared * e->BS;
    if (src >= 0) { /* held while its copy is made, so the allocator cannot take it */
        block_hold(e, src);
        s->blocks[shared] = block_alloc(e);
        if (kiln_kv_pool_copy_block(e->pool, s->blocks[shared], src) == KILN_OK) done = s->n_prompt - 1;
        else kiln_clear_error(); /* then the whole block is recomputed */
        block_release(e, src);
    }
    for (int j = src >= 0 ? shared + 1 : shared; j < need; j++) s->blocks[j] = block_alloc(e); /* counted above */
    s->n_blocks = need;
    s->n_done = done;
    s->n_hashed = shared;
    e->st.prefix_hit_tokens += (uint64_t)done;
    return true;
}

static void release_blocks(kiln_engine_t *e, seq *s)
{
    for (int j = s->lo; j < s->n_blocks; j++) block_release(e, s->blocks[j]);
    while (s->n_spare > 0) block_release(e, s->spare[--s->n_spare]);
    s->n_blocks = s->lo = 0;
}

/* ---- the engine thread ---- */

/* Takes the finished sequences out of the running list into *done. Under mu. */
static void collect_finished(kiln_engine_t *e, seq **done)
{
    for (seq **p = &e->running; *p;) {
        seq *s = *p;
        if (s->cancelled && s->finish == KILN_FINISH_NONE) s->finish = KILN_FINISH_CANCELLED;
        if (s->finish != KILN_FINISH_NONE) {
            *p = s->next;
            release_blocks(e, s);
            e->n_running--;
            s->next = *done;
            *done = s;
            e->st.requests_done++;
        } else {
            p = &s->next;
        }
    }
}

/* Marks the sequences kiln_engine_cancel asked for; waiting ones go to *done at once.
 * Under mu. */
static void apply_cancels(kiln_engine_t *e, seq **done)
{
    if (!e->any_cancel) return;
    for (seq *s = e->running; s; s = s->next)
        if (s->cancel_asked) s->cancelled = true;
    for (seq **p = &e->wait_head, *prev = NULL; *p;) {
        seq *s = *p;
        if (!s->cancel_asked) {
            prev = s;
            p = &s->next;
            continue;
        }
        *p = s->next;
        if (e->wait_tail == s) e->wait_tail = prev;
        e->n_waiting--;
        s->finish = KILN_FINISH_CANCELLED;
        s->next = *done;
        *done = s;
        e->st.requests_done++;
    }
    e->any_cancel = false;
}

static void admit(kiln_engine_t *e)
{
    while (e->wait_head && e->n_running < e->o.max_batch) {
        seq *s = e->wait_head;
        if (!try_admit(e, s)) break; /* first come, first served: the head waits for memory */
        e->wait_head = s->next;
        if (!e->wait_head) e->wait_tail = NULL;
        e->n_waiting--;
        /* Append, so the running list keeps admission order (the batch's row order). */
        s->next = NULL;
        seq **p = &e->running;
        while (*p) p = &(*p)->next;
        *p = s;
        e->n_running++;
    }
}

static void finish_all(seq *done)
{
    while (done) {
        seq *n = done->next;
        done->cb(done->user, NULL, done->finish);
        seq_free(done);
        done = n;
    }
}

/* A windowed sequence about to write positions up to end - 1, reading back to its
 * first new position's window: the blocks wholly before that are released, kept as
 * spares while the sequence has positions not yet given a block, and the blocks up to
 * end - 1 assigned from the spares. live_max covers a step's reach, so the spares
 * suffice; false (an internal fault, not input) if they do not. */
static bool slide(kiln_engine_t *e, seq *s, int end)
{
    int first = s->n_done >= e->window ? s->n_done - e->window + 1 : 0;
    int future = blocks_for(e, s->n_prompt + s->max_tokens) - s->n_blocks;
    for (; s->lo < first / e->BS && s->lo < s->n_blocks; s->lo++) {
        int b = s->blocks[s->lo];
        s->blocks[s->lo] = -1;
        if (s->n_spare < future) s->spare[s->n_spare++] = b;
        else block_release(e, b);
    }
    while (s->n_blocks <= (end - 1) / e->BS) {
        if (s->n_spare == 0) return false;
        s->blocks[s->n_blocks++] = s->spare[--s->n_spare];
    }
    return true;
}

/* Lays out one step's batch; returns the number of tokens (0: nothing to run). */
static int build_batch(kiln_engine_t *e, kiln_paged_batch *b)
{
    int n = 0, rows = 0, si = 0, max_blocks = 1;
    int budget = e->o.max_step_tokens;
    /* Decoding sequences first: one token each, always in the step. */
    for (seq *s = e->running; s; s = s->next)
        if (s->n_done >= s->n_prompt) budget--;
    for (seq *s = e->running; s; s = s->next) {
        int take = s->n_tok - s->n_done;
        if (s->n_done < s->n_prompt) { /* prefill: a chunk within the budget */
            take = take < budget ? take : budget;
            budget -= take;
        }
        s->take = take;
        if (e->window && take > 0 && !slide(e, s, s->n_done + take)) {
            snprintf(e->last_error, sizeof e->last_error, "engine: a windowed sequence ran out of its reserved KV "
                     "blocks (an internal fault)");
            s->finish = KILN_FINISH_ERROR;
            s->take = 0;
        }
        max_blocks = s->n_blocks > max_blocks ? s->n_blocks : max_blocks;
    }
    for (seq *s = e->running; s; s = s->next, si++) {
        int take = s->take;
        for (int k = 0; k < take; k++) {
            e->b_tok[n] = s->tok[s->n_done + k];
            e->b_seq[n] = si;
            e->b_pos[n] = s->n_done + k;
            n++;
        }
        for (int j = 0; j < max_blocks; j++) /* blocks behind the window are not read: any valid id */
            e->b_table[si * max_blocks + j] = j < s->n_blocks && s->blocks[j] >= 0 ? s->blocks[j] : 0;
        if (take > 0 && s->n_done + take == s->n_tok) {
            e->b_rows[rows] = n - 1;
            e->b_row_seq[rows++] = s;
        }
    }
    *b = (kiln_paged_batch){
        .n_tokens = n, .tokens = e->b_tok, .seq = e->b_seq, .pos = e->b_pos,
        .n_seqs = si, .max_blocks = max_blocks, .block_table = e->b_table,
        .n_logits = rows, .logit_rows = e->b_rows,
    };
    return n;
}

/* Advances each sequence past what the step fed it. */
static void advance(kiln_engine_t *e, const kiln_paged_batch *b)
{
    int si = 0, i = 0;
    for (seq *s = e->running; s; s = s->next, si++) {
        int fed = 0;
        while (i < b->n_tokens && b->seq[i] == si) fed++, i++;
        s->n_done += fed;
        register_full_blocks(e, s);
    }
}

/* Rows [b, end) of a step: each row's logits adjusted (penalties, bias) and its token
 * drawn, with the row's own scratch, so that rows run on the pool in any split and a
 * row's token is what it would be alone. */
static void sample_range(void *ctx, int64_t b, int64_t end)
{
    kiln_engine_t *e = ctx;
    for (int64_t r = b; r < end; r++) {
        seq *s = e->b_row_seq[r];
        if (s->cancelled) continue;
        const float *lg = e->logits + (size_t)r * e->V;
        if (kiln_sampling_adjusts(&s->sp)) {
            float *adj = e->adjusted + (size_t)r * e->V;
            memcpy(adj, lg, sizeof(float) * (size_t)e->V);
            kiln_sample_adjust(adj, e->V, &s->sp, s->tok, s->n_prompt, s->n_tok, e->counts + (size_t)r * e->V);
            lg = adj;
        }
        e->picked[r] = kiln_sample_token(lg, e->V, &s->sp, s->generated, (char *)e->scratch + (size_t)r * e->scratch_row);
    }
}

/* Samples each row's next token (the rows in parallel) and tells the callbacks, in row
 * order. Runs without mu. Log-probabilities are the model's, before any adjustment. */
static void sample_rows(kiln_engine_t *e, int rows)
{
    kiln__parallel_for(rows, 1, sample_range, e);
    for (int r = 0; r < rows; r++) {
        seq *s = e->b_row_seq[r];
        if (s->cancelled) continue;
        const float *lg = e->logits + (size_t)r * e->V;
        int t = e->picked[r];
        kiln_token_event ev = {.token = t, .index = s->generated, .logprob = 0, .n_top = 0};
        if (s->logprobs >= 0) {
            ev.logprob = kiln_token_logprobs(lg, e->V, t, s->logprobs, e->top_ids, e->top_lp);
            ev.n_top = s->logprobs;
            ev.top_ids = e->top_ids;
            ev.top_logprobs = e->top_lp;
        }
        s->tok[s->n_tok++] = t;
        s->generated++;
        if (!s->cb(s->user, &ev, KILN_FINISH_NONE)) s->finish = KILN_FINISH_STOP;
        else if (s->generated >= s->max_tokens || s->n_tok >= e->ctx) s->finish = KILN_FINISH_LENGTH;
    }
}

static void *engine_main(void *arg)
{
    kiln_engine_t *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        seq *done = NULL;
        apply_cancels(e, &done);
        if (e->stop) {
            for (seq *s = e->running; s; s = s->next) s->cancelled = true;
            while (e->wait_head) {
                seq *s = e->wait_head;
                e->wait_head = s->next;
                s->finish = KILN_FINISH_CANCELLED;
                s->next = done;
                done = s;
            }
            e->wait_tail = NULL;
            e->n_waiting = 0;
        }
        collect_finished(e, &done);
        if (!e->stop) admit(e);
        e->st.running = e->n_running;
        e->st.waiting = e->n_waiting;
        e->st.kv_blocks_free = e->n_free + e->n_evictable;
        if (done) { /* callbacks run without the lock: they may cancel or submit */
            pthread_mutex_unlock(&e->mu);
            finish_all(done);
            pthread_mutex_lock(&e->mu);
            continue;
        }
        if (e->stop && !e->running) break;
        if (!e->running) {
            pthread_cond_wait(&e->cv, &e->mu);
            continue;
        }
        kiln_paged_batch b;
        int n = build_batch(e, &b);
        pthread_mutex_unlock(&e->mu);

        double t0 = kiln__now_s();
        kiln_status st = KILN_OK;
        if (n > 0) {
            kiln_scope_begin();
            kiln_tensor_t *lg = kiln_gpt_forward_paged(e->model, e->pool, &b);
            st = lg ? kiln_tensor_to_host(lg, e->logits, sizeof(float) * (size_t)b.n_logits * (size_t)e->V)
                    : kiln_last_status();
            kiln_scope_end();
        }
        double dt = kiln__now_s() - t0;
        char msg[512] = "";
        if (st != KILN_OK) snprintf(msg, sizeof msg, "%s", kiln_last_error());
        else sample_rows(e, b.n_logits);

        pthread_mutex_lock(&e->mu);
        if (st != KILN_OK) {
            snprintf(e->last_error, sizeof e->last_error, "%s", msg);
            for (seq *s = e->running; s; s = s->next) s->finish = KILN_FINISH_ERROR;
        } else {
            advance(e, &b);
        }
        e->st.steps++;
        e->st.busy_seconds += dt;
        e->st.generated_tokens += (uint64_t)(st == KILN_OK ? b.n_logits : 0);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* ---- the public side ---- */

static kiln_status check_opts(const kiln_engine_opts *o)
{
    if (o->max_batch < 1 || o->max_batch > 4096) return kiln_error(KILN_ERR_ARG, "engine: max_batch %d is not in 1..4096", o->max_batch);
    if (o->max_queue < 0) return kiln_error(KILN_ERR_ARG, "engine: max_queue %d < 0", o->max_queue);
    if (o->block_len < 1 || o->block_len > 1024) return kiln_error(KILN_ERR_ARG, "engine: block_len %d is not in 1..1024", o->block_len);
    if (o->max_step_tokens <= o->max_batch)
        return kiln_error(KILN_ERR_ARG, "engine: max_step_tokens %d must exceed max_batch %d, or prompts never advance",
                          o->max_step_tokens, o->max_batch);
    if (o->num_blocks < 0 || (o->num_blocks == 0 && o->kv_memory_mb < 1))
        return kiln_error(KILN_ERR_ARG, "engine: give num_blocks >= 1 or kv_memory_mb >= 1");
    if (!kiln_dtype_is_f32_or_half(o->kv_dtype))
        return kiln_error(KILN_ERR_ARG, "engine: kv_dtype %s; the KV cache is f32, f16 or bf16",
                          kiln_dtype_name(o->kv_dtype));
    if (!kiln_dtype_is_f32_or_half(o->weight_dtype))
        return kiln_error(KILN_ERR_ARG, "engine: weight_dtype %s; decoding reads its weights as f32, bf16 or f16",
                          kiln_dtype_name(o->weight_dtype));
    if (o->weight_quant != KILN_WEIGHT_QUANT_NONE &&
        (o->weight_quant != KILN_WEIGHT_QUANT_Q8_0 || o->weight_dtype != KILN_DTYPE_F32))
        return kiln_error(KILN_ERR_ARG, "engine: weight_quant %d with weight_dtype %s; q8_0 weights are made from f32",
                          (int)o->weight_quant, kiln_dtype_name(o->weight_dtype));
    return KILN_OK;
}

kiln_status kiln_engine_new(kiln_gpt_t *model, const kiln_engine_opts *opts, kiln_engine_t **out)
{
    if (!model || !out) return kiln_error(KILN_ERR_ARG, "engine_new: model and out must not be NULL");
    *out = NULL;
    kiln_engine_opts o = opts ? *opts : kiln_engine_opts_default();
    kiln_status s = check_opts(&o);
    if (s != KILN_OK) return s;
    const kiln_gpt_config *c = kiln_gpt_get_config(model);
    if (o.num_blocks == 0) {
        int64_t per = kiln_kv_pool_block_bytes(model, o.block_len, o.kv_dtype);
        int64_t n = per > 0 ? o.kv_memory_mb * 1024 * 1024 / per : 0;
        o.num_blocks = (int)(n > 1 << 20 ? 1 << 20 : n);
        if (o.num_blocks < 1)
            return kiln_error(KILN_ERR_ARG, "engine: %lld MiB holds no KV block of %lld bytes", (long long)o.kv_memory_mb,
                              (long long)per);
    }
    kiln_engine_t *e = calloc(1, sizeof *e);
    if (!e) return kiln_error(KILN_ERR_OOM, "engine_new: out of memory");
    e->model = model;
    e->o = o;
    e->V = c->vocab_size;
    e->ctx = c->block_size;
    e->BS = o.block_len;
    int64_t window = kiln_gpt_kv_window(model);
    e->window = window < e->ctx ? (int)window : 0; /* a window as wide as the context is none */
    e->live_max = e->window ? blocks_for(e, e->window - 1 + o.max_step_tokens) + 1 : INT_MAX;
    if (e->window) e->o.prefix_cache = false; /* its blocks are reused, so not shared */
    int tokens = o.max_step_tokens, nb = o.num_blocks, maxb = blocks_for(e, e->ctx + 1);
    e->meta = calloc((size_t)nb, sizeof *e->meta);
    e->block_tokens = malloc(sizeof(int32_t) * (size_t)nb * (size_t)e->BS);
    e->free_stack = malloc(sizeof(int) * (size_t)nb);
    /* The step's int32 buffers in one block: b_tok, b_seq, b_pos, b_rows, b_table. */
    if ((e->b_tok = malloc(sizeof(int32_t) * (3 * (size_t)tokens + (size_t)o.max_batch * (1 + (size_t)maxb))))) {
        e->b_seq = e->b_tok + tokens;
        e->b_pos = e->b_seq + tokens;
        e->b_rows = e->b_pos + tokens;
        e->b_table = e->b_rows + o.max_batch;
    }
    e->b_row_seq = malloc(sizeof(seq *) * (size_t)o.max_batch);
    e->logits = malloc(sizeof(float) * (size_t)o.max_batch * (size_t)e->V);
    e->scratch_row = (kiln_sample_scratch_bytes(e->V) + 63) / 64 * 64;
    e->scratch = malloc(e->scratch_row * (size_t)o.max_batch);
    e->adjusted = malloc(sizeof(float) * (size_t)o.max_batch * (size_t)e->V);
    e->counts = calloc((size_t)o.max_batch * (size_t)e->V, sizeof *e->counts);
    e->picked = malloc(sizeof *e->picked * (size_t)o.max_batch);
    if (!e->meta || !e->block_tokens || !e->free_stack || !e->b_tok || !e->b_row_seq || !e->logits || !e->scratch ||
        !e->adjusted || !e->counts || !e->picked) {
        kiln_engine_free(e);
        return kiln_error(KILN_ERR_OOM, "engine_new: out of memory for %d KV blocks", nb);
    }
    for (int i = nb - 1; i >= 0; i--) e->free_stack[e->n_free++] = i; /* block 0 on top */
    if ((s = kiln_kv_pool_new_quant(model, nb, e->BS, o.kv_dtype, o.weight_dtype, o.weight_quant, &e->pool)) != KILN_OK) {
        kiln_engine_free(e);
        return s;
    }
    e->st.kv_blocks_total = nb;
    e->st.kv_blocks_free = nb;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->next_id = 1;
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
        kiln_engine_free(e);
        return kiln_error(KILN_ERR_INTERNAL, "engine_new: cannot start the engine thread");
    }
    e->started = true;
    *out = e;
    return KILN_OK;
}

void kiln_engine_free(kiln_engine_t *e)
{
    if (!e) return;
    if (e->started) {
        pthread_mutex_lock(&e->mu);
        e->stop = true;
        pthread_cond_signal(&e->cv);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
    }
    kiln_kv_pool_free(e->pool);
    KILN__FREE(e->meta, e->block_tokens, e->free_stack, e->b_tok, e->b_row_seq, e->logits, e->scratch, e->adjusted,
               e->counts, e->picked, e);
}

kiln_status kiln_engine_submit(kiln_engine_t *e, const kiln_gen_request *r, uint64_t *id)
{
    if (!e || !r || !r->cb) return kiln_error(KILN_ERR_ARG, "engine_submit: engine, request and callback must not be NULL");
    if (!r->prompt || r->n_prompt < 1) return kiln_error(KILN_ERR_ARG, "engine_submit: the prompt is empty");
    if (r->max_tokens < 1) return kiln_error(KILN_ERR_ARG, "engine_submit: max_tokens %d < 1", r->max_tokens);
    if ((int64_t)r->n_prompt + r->max_tokens > e->ctx)
        return kiln_error(KILN_ERR_ARG,
                          "engine_submit: the prompt's %d tokens plus max_tokens %d exceed the model's context of %d",
                          r->n_prompt, r->max_tokens, e->ctx);
    if (r->logprobs < -1 || r->logprobs > KILN_MAX_LOGPROBS)
        return kiln_error(KILN_ERR_ARG, "engine_submit: logprobs %d is not in -1..%d", r->logprobs, KILN_MAX_LOGPROBS);
    const kiln_sampling *sp = &r->sampling;
    if (!(sp->temperature >= 0) || !(sp->top_p > 0 && sp->top_p <= 1) || sp->top_k < 0)
        return kiln_error(KILN_ERR_ARG, "engine_submit: temperature %g, top_p %g, top_k %d: want >= 0, (0, 1], >= 0",
                          sp->temperature, sp->top_p, sp->top_k);
    if (!(sp->min_p >= 0 && sp->min_p <= 1) || !(fabs(sp->presence_penalty) <= 2) || !(fabs(sp->frequency_penalty) <= 2) ||
        !(sp->repetition_penalty >= 0 && isfinite(sp->repetition_penalty)) || sp->n_bias < 0 ||
        (sp->n_bias > 0 && (!sp->bias_ids || !sp->bias_vals)))
        return kiln_error(KILN_ERR_ARG, "engine_submit: min_p %g, presence_penalty %g, frequency_penalty %g, "
                          "repetition_penalty %g, %d biases: want 0..1, -2..2, -2..2, >= 0 and the biases given",
                          sp->min_p, sp->presence_penalty, sp->frequency_penalty, sp->repetition_penalty, sp->n_bias);
    for (int i = 0; i < sp->n_bias; i++)
        if (sp->bias_ids[i] < 0 || sp->bias_ids[i] >= e->V || !isfinite(sp->bias_vals[i]))
            return kiln_error(KILN_ERR_INDEX, "engine_submit: logit_bias %d: token %d (bias %g), outside the vocabulary of "
                              "%d or not finite", i, sp->bias_ids[i], sp->bias_vals[i], e->V);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->V)
            return kiln_error(KILN_ERR_INDEX, "engine_submit: prompt token %d is %d, outside the vocabulary of %d", i,
                              r->prompt[i], e->V);
    int need = blocks_for(e, r->n_prompt + r->max_tokens), held = blocks_held(e, r->n_prompt + r->max_tokens);
    if (held > e->o.num_blocks)
        return kiln_error(KILN_ERR_ARG, "engine_submit: the request needs %d KV blocks at once, the cache has %d", held,
                          e->o.num_blocks);
    seq *s = calloc(1, sizeof *s);
    int cap = r->n_prompt + r->max_tokens;
    if (s) {
        s->tok = malloc(sizeof *s->tok * (size_t)cap);
        s->blocks = malloc(sizeof *s->blocks * (size_t)need);
        s->hash = malloc(sizeof *s->hash * (size_t)need);
        s->spare = malloc(sizeof *s->spare * (size_t)held);
    }
    if (!s || !s->tok || !s->blocks || !s->hash || !s->spare) {
        seq_free(s);
        return kiln_error(KILN_ERR_OOM, "engine_submit: out of memory");
    }
    memcpy(s->tok, r->prompt, sizeof *s->tok * (size_t)r->n_prompt);
    s->n_prompt = s->n_tok = r->n_prompt;
    s->max_tokens = r->max_tokens;
    s->sp = r->sampling;
    if (sp->n_bias > 0) { /* the request's arrays are the caller's: copied, as the prompt is */
        s->bias_ids = malloc(sizeof *s->bias_ids * (size_t)sp->n_bias);
        s->bias_vals = malloc(sizeof *s->bias_vals * (size_t)sp->n_bias);
        if (!s->bias_ids || !s->bias_vals) {
            seq_free(s);
            return kiln_error(KILN_ERR_OOM, "engine_submit: out of memory");
        }
        memcpy(s->bias_ids, sp->bias_ids, sizeof *s->bias_ids * (size_t)sp->n_bias);
        memcpy(s->bias_vals, sp->bias_vals, sizeof *s->bias_vals * (size_t)sp->n_bias);
    }
    s->sp.bias_ids = s->bias_ids;
    s->sp.bias_vals = s->bias_vals;
    s->logprobs = r->logprobs;
    s->cb = r->cb;
    s->user = r->user;
    pthread_mutex_lock(&e->mu);
    if (e->stop || e->n_waiting >= e->o.max_queue) {
        int w = e->n_waiting;
        pthread_mutex_unlock(&e->mu);
        seq_free(s);
        return kiln_error(KILN_ERR_BUSY, "engine_submit: %d requests are waiting already (max_queue %d)", w, e->o.max_queue);
    }
    s->id = e->next_id++;
    if (e->wait_tail) e->wait_tail->next = s;
    else e->wait_head = s;
    e->wait_tail = s;
    e->n_waiting++;
    e->st.prompt_tokens += (uint64_t)r->n_prompt;
    if (id) *id = s->id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return KILN_OK;
}

void kiln_engine_cancel(kiln_engine_t *e, uint64_t id)
{
    if (!e || !id) return;
    /* Marked on the request itself, so that a cancel needs no memory and cannot fail. */
    pthread_mutex_lock(&e->mu);
    for (int list = 0; list < 2; list++)
        for (seq *s = list ? e->wait_head : e->running; s; s = s->next)
            if (s->id == id) {
                s->cancel_asked = e->any_cancel = true;
                pthread_cond_signal(&e->cv);
            }
    pthread_mutex_unlock(&e->mu);
}

void kiln_engine_get_stats(kiln_engine_t *e, kiln_engine_stats *out)
{
    if (!e || !out) return;
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    pthread_mutex_unlock(&e->mu);
}

int kiln_engine_context_len(const kiln_engine_t *e) { return e ? e->ctx : 0; }

void kiln_engine_last_error(kiln_engine_t *e, char *buf, size_t n)
{
    if (!e || !buf || !n) return;
    pthread_mutex_lock(&e->mu);
    snprintf(buf, n, "%s", e->last_error);
    pthread_mutex_unlock(&e->mu);
}
