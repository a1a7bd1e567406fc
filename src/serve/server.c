/* The OpenAI-compatible HTTP server in front of the engine.
 *
 * HTTP is libmicrohttpd: a Debian-packaged (libmicrohttpd-dev), maintained HTTP/1.1
 * stack in C with its own thread pool over epoll, request-size and idle-time limits,
 * and suspend/resume, which lets a waiting or streaming client hold no thread: its
 * connection is suspended until the engine has tokens for it, then resumed from the
 * engine's thread. JSON is jansson, which kiln already uses for configs (Debian's
 * libjansson-dev). Writing either by hand would only add places for bugs.
 *
 * A request's life: the access handler collects the body, parses it (openai.c),
 * renders chat messages, tokenizes, and submits one engine request per choice. A
 * "job" holds what the engine's callbacks produce; it is reference-counted (the
 * connection, the streamed response, and each engine request hold one) because the
 * HTTP side and the engine side end in either order. A watchdog thread cancels jobs
 * past the request timeout. A client that goes away is noticed when its connection is
 * next written to (MHD does not watch suspended sockets), that is at its next token,
 * and its engine requests are cancelled then. */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>
#include "kiln/io.h"
#include "core/util.h"
#include "kiln/serve.h"
#include "serve/openai.h"
#include "serve/page.h"

/* ---- metrics ---- */

enum { EP_COMPLETIONS, EP_CHAT, EP_MODELS, EP_HEALTH, EP_METRICS, EP_TOKENIZE, EP_DETOKENIZE, EP_PAGE, EP_OTHER, EP_COUNT };
static const char *ep_names[EP_COUNT] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                         "/metrics", "/tokenize", "/detokenize", "/", "other"};
static const int codes[] = {200, 204, 400, 401, 404, 405, 413, 415, 429, 500, 503, 504};
#define N_CODES ((int)(sizeof codes / sizeof codes[0]))
static const double ttft_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
#define N_TTFT ((int)(sizeof ttft_bounds / sizeof ttft_bounds[0]))

typedef struct {
    uint64_t requests[EP_COUNT][N_CODES + 1]; /* the last column: any other code */
    uint64_t prompt_tokens, generation_tokens;
    uint64_t ttft_buckets[N_TTFT + 1], ttft_count;
    double ttft_sum;
} metrics;

/* ---- the server ---- */

struct kiln_server {
    kiln_server_opts o;
    char *host, *api_key, *cors, *name_opt;
    struct MHD_Daemon *d;
    int port;
    atomic_bool loaded;
    kiln_gpt_t *model;
    kiln_tokenizer_t *tok;
    kiln_engine_t *engine;
    kiln__chat_template tmpl;
    char *name;
    int ctx, vocab;
    int32_t eot;

    pthread_mutex_t mu; /* metrics, the job list, counters */
    pthread_cond_t cv;
    metrics m;
    struct job *jobs; /* running jobs, for the watchdog */
    int n_suspended;  /* connections suspended now */
    uint64_t next_id;
    pthread_t watchdog;
    bool watchdog_started, stopping;
};

typedef struct {
    struct job *j;
    int index;
    uint64_t engine_id;
    bool submitted, finished;
    kiln_finish finish;
    kiln__textstream ts;
    int n_tok, cap_tok, lp_sent;
    int32_t *tok;       /* generated ids */
    size_t *tok_start;  /* byte offset of each token in ts.bytes */
    float *lp;          /* logprob of each token */
    int32_t *top_ids;   /* [n_tok * n_top] */
    float *top_lp;
} choice;

typedef struct job {
    pthread_mutex_t mu;
    int refs;
    kiln_server_t *srv;
    struct MHD_Connection *conn; /* NULL once the HTTP side is gone */
    bool suspended;
    kiln__oai_req req;
    const char *stops[KILN__MAX_STOPS];
    int n_stops;
    int n_prompt, n, n_done, n_top;
    choice ch[KILN__MAX_N];
    bool stream, done, ended, sent_role, first_token;
    atomic_bool timed_out;
    char *out; /* streamed bytes not yet sent */
    size_t out_len, out_cap, out_pos;
    double t_start;
    char id[48];
    long long created;
    struct job *next; /* in srv->jobs */
} job;

/* What one connection has collected. */
typedef struct {
    char *body;
    size_t len, cap;
    bool too_big, answered;
    int endpoint;
    job *j;
} conn_state;

kiln_server_opts kiln_server_opts_default(void)
{
    kiln_server_opts o = {
        .host = "127.0.0.1",
        .port = 8000,
        .api_key = NULL,
        .model_name = NULL,
        .cors_origin = "*",
        .http_threads = 4,
        .max_body = 1 << 20,
        .request_timeout = 300,
        .idle_timeout = 30,
        .max_tokens_default = 16,
        .engine = kiln_engine_opts_default(),
    };
    return o;
}

static void count_request(kiln_server_t *s, int ep, int code)
{
    int k = N_CODES;
    for (int i = 0; i < N_CODES; i++)
        if (codes[i] == code) k = i;
    pthread_mutex_lock(&s->mu);
    s->m.requests[ep][k]++;
    pthread_mutex_unlock(&s->mu);
}

/* ---- responses ---- */

static enum MHD_Result send_buf(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *type,
                                const char *body, size_t len, bool copy, const char *retry_after)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)body, copy ? MHD_RESPMEM_MUST_COPY : MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    if (type) MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Access-Control-Allow-Origin", s->cors);
    if (retry_after) MHD_add_response_header(r, "Retry-After", retry_after);
    if (s->api_key && code == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)code, r);
    MHD_destroy_response(r);
    count_request(s, ep, code);
    return ok;
}

static enum MHD_Result send_json(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, json_t *o)
{
    char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!t) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        return send_buf(s, c, ep, 500, "application/json", oom, sizeof oom - 1, false, NULL);
    }
    enum MHD_Result r = send_buf(s, c, ep, code, "application/json", t, strlen(t), true, NULL);
    free(t);
    return r;
}

static const char *error_type(int code)
{
    return code == 401 ? "authentication_error" : code == 404 ? "not_found_error" : code == 429 ? "rate_limit_error"
         : code >= 500 ? "server_error" : "invalid_request_error";
}

static enum MHD_Result send_error(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *param,
                                  const char *err_code, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static enum MHD_Result send_error(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *param,
                                  const char *err_code, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char *t = kiln__oai_error_json(msg, error_type(code), param, err_code);
    if (!t) return send_json(s, c, ep, 500, NULL);
    enum MHD_Result r = send_buf(s, c, ep, code, "application/json", t, strlen(t), true, code == 429 ? "1" : NULL);
    free(t);
    return r;
}

/* ---- jobs ---- */

static void job_unref(job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    kiln_server_t *s = j->srv;
    pthread_mutex_lock(&s->mu);
    for (job **p = &s->jobs; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            break;
        }
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        kiln__textstream_free(&c->ts);
        free(c->tok);
        free(c->tok_start);
        free(c->lp);
        free(c->top_ids);
        free(c->top_lp);
    }
    kiln__oai_free(&j->req);
    free(j->out);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

/* Resumes the connection if it waits for us. Under j->mu. */
static void wake(job *j)
{
    if (j->suspended && j->conn) {
        j->suspended = false;
        MHD_resume_connection(j->conn);
        pthread_mutex_lock(&j->srv->mu);
        /* Only shutdown waits for the count to reach zero; a broadcast per token would
         * wake the watchdog thousands of times a second, onto the compute cores. */
        if (--j->srv->n_suspended == 0 && j->srv->stopping) pthread_cond_broadcast(&j->srv->cv);
        pthread_mutex_unlock(&j->srv->mu);
    }
}

static void suspend(job *j)
{
    j->suspended = true;
    MHD_suspend_connection(j->conn);
    pthread_mutex_lock(&j->srv->mu);
    j->srv->n_suspended++;
    pthread_mutex_unlock(&j->srv->mu);
}

/* Appends to the stream buffer. Under j->mu. */
static void emit(job *j, const char *s, size_t n)
{
    if (j->out_len + n > j->out_cap) {
        size_t cap = j->out_cap ? j->out_cap : 4096;
        while (cap < j->out_len + n) cap *= 2;
        char *p = realloc(j->out, cap);
        if (!p) return; /* out of memory: this piece is lost, the stream goes on */
        j->out = p;
        j->out_cap = cap;
    }
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
}

static void emit_event(job *j, json_t *o)
{
    char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!t) return;
    emit(j, "data: ", 6);
    emit(j, t, strlen(t));
    emit(j, "\n\n", 2);
    free(t);
}

/* A token's text for logprobs: the token's bytes if they are UTF-8 on their own, else
 * "bytes:\xNN..." as OpenAI writes partial characters. */
static json_t *token_string(kiln_server_t *s, int32_t id)
{
    size_t n;
    const char *b = kiln_tokenizer_token_bytes(s->tok, id, &n);
    if (!b) return json_string("");
    json_t *t = json_stringn(b, n);
    if (t && !memchr(b, 0, n)) return t;
    json_decref(t);
    char buf[256] = "bytes:";
    size_t o = 6;
    for (size_t i = 0; i < n && o + 5 < sizeof buf; i++) o += (size_t)snprintf(buf + o, sizeof buf - o, "\\x%02x", (unsigned char)b[i]);
    return json_string(buf);
}

static json_t *token_bytes(kiln_server_t *s, int32_t id)
{
    size_t n;
    const unsigned char *b = (const unsigned char *)kiln_tokenizer_token_bytes(s->tok, id, &n);
    json_t *a = json_array();
    for (size_t i = 0; b && i < n; i++) json_array_append_new(a, json_integer(b[i]));
    return a;
}

/* Logprobs of tokens [from, to) of c, in the completions or the chat shape. */
static json_t *logprobs_json(job *j, choice *c, int from, int to)
{
    kiln_server_t *s = j->srv;
    if (j->req.chat) {
        json_t *content = json_array();
        for (int i = from; i < to; i++) {
            json_t *top = json_array();
            for (int k = 0; k < j->n_top; k++) {
                int32_t id = c->top_ids[i * j->n_top + k];
                json_array_append_new(top, json_pack("{s:o,s:f,s:o}", "token", token_string(s, id), "logprob",
                                                     (double)c->top_lp[i * j->n_top + k], "bytes", token_bytes(s, id)));
            }
            json_array_append_new(content, json_pack("{s:o,s:f,s:o,s:o}", "token", token_string(s, c->tok[i]), "logprob",
                                                     (double)c->lp[i], "bytes", token_bytes(s, c->tok[i]), "top_logprobs", top));
        }
        return json_pack("{s:o}", "content", content);
    }
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (int i = from; i < to; i++) {
        json_array_append_new(toks, token_string(s, c->tok[i]));
        json_array_append_new(lps, json_real((double)c->lp[i]));
        json_t *top = json_object();
        for (int k = 0; k < j->n_top; k++) {
            json_t *ts = token_string(s, c->top_ids[i * j->n_top + k]);
            json_object_set_new(top, json_string_value(ts), json_real((double)c->top_lp[i * j->n_top + k]));
            json_decref(ts);
        }
        json_array_append_new(tops, top);
        json_array_append_new(offs, json_integer((json_int_t)c->tok_start[i]));
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops, "text_offset", offs);
}

/* Tokens whose first byte lies in the final text: those the client is told about. */
static int tokens_in_text(const choice *c, size_t text_len)
{
    int k = 0;
    while (k < c->n_tok && c->tok_start[k] < text_len) k++;
    return k;
}

static const char *finish_reason(const choice *c)
{
    return c->finish == KILN_FINISH_LENGTH ? "length" : "stop";
}

static json_t *chunk_base(job *j)
{
    return json_pack("{s:s,s:s,s:I,s:s}", "id", j->id, "object", j->req.chat ? "chat.completion.chunk" : "text_completion",
                     "created", (json_int_t)j->created, "model", j->srv->name);
}

/* One streamed chunk for choice c: text delta, logprobs of the tokens it completes,
 * and the finish reason when it is the last. Under j->mu. */
static void emit_chunk(job *j, choice *c, const char *text, size_t len, const char *finish)
{
    json_t *ch = json_pack("{s:i}", "index", c->index);
    if (j->req.chat) {
        json_t *delta = json_object();
        if (!j->sent_role) {
            json_object_set_new(delta, "role", json_string("assistant"));
        }
        if (len || !finish) json_object_set_new(delta, "content", json_stringn(text, len));
        json_object_set_new(ch, "delta", delta);
    } else {
        json_object_set_new(ch, "text", json_stringn(text, len));
    }
    int upto = tokens_in_text(c, c->ts.emitted);
    if (finish) upto = tokens_in_text(c, c->ts.n_text);
    if (j->req.logprobs >= 0 && upto > c->lp_sent) {
        json_object_set_new(ch, "logprobs", logprobs_json(j, c, c->lp_sent, upto));
        c->lp_sent = upto;
    } else {
        json_object_set_new(ch, "logprobs", json_null());
    }
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    json_t *o = chunk_base(j);
    json_object_set_new(o, "choices", json_pack("[o]", ch));
    if (j->req.include_usage) json_object_set_new(o, "usage", json_null());
    emit_event(j, o);
}

static json_t *usage_json(job *j)
{
    int gen = 0;
    for (int i = 0; i < j->n; i++) gen += j->ch[i].n_tok;
    return json_pack("{s:i,s:i,s:i}", "prompt_tokens", j->n_prompt, "completion_tokens", gen, "total_tokens",
                     j->n_prompt + gen);
}

static bool grow_tokens(job *j, choice *c)
{
    if (c->n_tok < c->cap_tok) return true;
    int cap = c->cap_tok ? c->cap_tok * 2 : 64;
    int32_t *t = realloc(c->tok, sizeof *t * (size_t)cap);
    if (t) c->tok = t;
    size_t *st = realloc(c->tok_start, sizeof *st * (size_t)cap);
    if (st) c->tok_start = st;
    float *lp = realloc(c->lp, sizeof *lp * (size_t)cap);
    if (lp) c->lp = lp;
    if (!t || !st || !lp) return false;
    if (j->n_top > 0) {
        int32_t *ti = realloc(c->top_ids, sizeof *ti * (size_t)cap * (size_t)j->n_top);
        if (ti) c->top_ids = ti;
        float *tl = realloc(c->top_lp, sizeof *tl * (size_t)cap * (size_t)j->n_top);
        if (tl) c->top_lp = tl;
        if (!ti || !tl) return false;
    }
    c->cap_tok = cap;
    return true;
}

/* The engine's callback, on the engine's thread. */
static bool on_token(void *user, const kiln_token_event *ev, kiln_finish fin)
{
    choice *c = user;
    job *j = c->j;
    kiln_server_t *s = j->srv;
    pthread_mutex_lock(&j->mu);
    bool go = true;
    if (ev) {
        if (!j->first_token) {
            j->first_token = true;
            double t = kiln__now_s() - j->t_start;
            pthread_mutex_lock(&s->mu);
            int b = 0;
            while (b < N_TTFT && t > ttft_bounds[b]) b++;
            s->m.ttft_buckets[b]++;
            s->m.ttft_count++;
            s->m.ttft_sum += t;
            pthread_mutex_unlock(&s->mu);
        }
        if (ev->token == s->eot) {
            go = false; /* the end-of-text token ends the answer and is not part of it */
        } else if (grow_tokens(j, c)) {
            size_t n;
            const char *b = kiln_tokenizer_token_bytes(s->tok, ev->token, &n);
            c->tok[c->n_tok] = ev->token;
            c->tok_start[c->n_tok] = c->ts.n_bytes;
            c->lp[c->n_tok] = ev->logprob;
            for (int k = 0; k < j->n_top && k < ev->n_top; k++) {
                c->top_ids[c->n_tok * j->n_top + k] = ev->top_ids[k];
                c->top_lp[c->n_tok * j->n_top + k] = ev->top_logprobs[k];
            }
            c->n_tok++;
            if (!kiln__textstream_push(&c->ts, b ? b : "", n)) go = false;
            size_t from, len;
            kiln__textstream_take(&c->ts, false, &from, &len);
            if (c->ts.stopped) go = false;
            if (j->stream && len) {
                emit_chunk(j, c, c->ts.text + from, len, NULL);
                j->sent_role = true;
            }
        } else {
            go = false;
        }
        if (!j->conn || atomic_load(&j->timed_out)) go = false;
    } else {
        c->finished = true;
        c->finish = fin;
        size_t from, len;
        kiln__textstream_take(&c->ts, true, &from, &len);
        if (c->ts.stopped && fin != KILN_FINISH_ERROR && fin != KILN_FINISH_CANCELLED) c->finish = KILN_FINISH_STOP;
        bool failed = fin == KILN_FINISH_ERROR || (fin == KILN_FINISH_CANCELLED && !c->ts.stopped);
        if (j->stream && !failed) {
            emit_chunk(j, c, c->ts.text + from, len, finish_reason(c));
            j->sent_role = true;
        }
        pthread_mutex_lock(&s->mu);
        s->m.generation_tokens += (uint64_t)c->n_tok;
        pthread_mutex_unlock(&s->mu);
        if (++j->n_done == j->n) {
            j->done = true;
            if (j->stream) {
                bool any_failed = false;
                for (int i = 0; i < j->n; i++)
                    any_failed |= j->ch[i].finish == KILN_FINISH_ERROR ||
                                  (j->ch[i].finish == KILN_FINISH_CANCELLED && !j->ch[i].ts.stopped);
                if (any_failed) {
                    char msg[600];
                    if (atomic_load(&j->timed_out))
                        snprintf(msg, sizeof msg, "the request ran past the server's timeout of %g s", s->o.request_timeout);
                    else {
                        char e[512];
                        kiln_engine_last_error(s->engine, e, sizeof e);
                        snprintf(msg, sizeof msg, "generation stopped: %s", *e ? e : "the server is shutting down");
                    }
                    char *t = kiln__oai_error_json(msg, "server_error", NULL, atomic_load(&j->timed_out) ? "timeout" : NULL);
                    if (t) {
                        emit(j, "data: ", 6);
                        emit(j, t, strlen(t));
                        emit(j, "\n\n", 2);
                        free(t);
                    }
                } else if (j->req.include_usage) {
                    json_t *o = chunk_base(j);
                    json_object_set_new(o, "choices", json_array());
                    json_object_set_new(o, "usage", usage_json(j));
                    emit_event(j, o);
                }
                emit(j, "data: [DONE]\n\n", 14);
                j->ended = true;
            }
        }
    }
    wake(j);
    pthread_mutex_unlock(&j->mu);
    if (!ev) job_unref(j); /* the engine's reference */
    return go;
}

/* ---- the streamed response ---- */

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    ssize_t r;
    if (j->out_pos < j->out_len) {
        size_t n = j->out_len - j->out_pos < max ? j->out_len - j->out_pos : max;
        memcpy(buf, j->out + j->out_pos, n);
        j->out_pos += n;
        if (j->out_pos == j->out_len) j->out_pos = j->out_len = 0;
        r = (ssize_t)n;
    } else if (j->ended) {
        r = MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        suspend(j);
        r = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return r;
}

static void cancel_job(job *j)
{
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].submitted && !j->ch[i].finished) kiln_engine_cancel(j->srv->engine, j->ch[i].engine_id);
}

static void stream_free(void *cls)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    cancel_job(j);
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
}

/* ---- generation ---- */

static json_t *completion_json(job *j)
{
    json_t *choices = json_array();
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        json_t *ch = json_pack("{s:i}", "index", i);
        json_t *text = json_stringn(c->ts.text ? c->ts.text : "", c->ts.n_text);
        if (j->req.chat) json_object_set_new(ch, "message", json_pack("{s:s,s:o}", "role", "assistant", "content", text));
        else json_object_set_new(ch, "text", text);
        int upto = tokens_in_text(c, c->ts.n_text);
        json_object_set_new(ch, "logprobs", j->req.logprobs >= 0 ? logprobs_json(j, c, 0, upto) : json_null());
        json_object_set_new(ch, "finish_reason", json_string(finish_reason(c)));
        json_array_append_new(choices, ch);
    }
    json_t *o = json_pack("{s:s,s:s,s:I,s:s}", "id", j->id, "object", j->req.chat ? "chat.completion" : "text_completion",
                          "created", (json_int_t)j->created, "model", j->srv->name);
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage_json(j));
    return o;
}

/* The answer to a finished non-streamed job. */
static enum MHD_Result finish_plain(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    job *j = cs->j;
    pthread_mutex_lock(&j->mu);
    bool failed = false;
    for (int i = 0; i < j->n; i++)
        failed |= j->ch[i].finish == KILN_FINISH_ERROR || (j->ch[i].finish == KILN_FINISH_CANCELLED && !j->ch[i].ts.stopped);
    json_t *o = failed ? NULL : completion_json(j);
    bool timed_out = atomic_load(&j->timed_out);
    pthread_mutex_unlock(&j->mu);
    if (!failed) return send_json(s, conn, cs->endpoint, 200, o);
    if (timed_out)
        return send_error(s, conn, cs->endpoint, 504, NULL, "timeout", "the request ran past the server's timeout of %g s",
                          s->o.request_timeout);
    char e[512];
    kiln_engine_last_error(s->engine, e, sizeof e);
    return send_error(s, conn, cs->endpoint, *e ? 500 : 503, NULL, NULL, "generation stopped: %s",
                      *e ? e : "the server is shutting down");
}

static uint64_t random_seed(kiln_server_t *s)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    pthread_mutex_lock(&s->mu);
    uint64_t x = (uint64_t)t.tv_nsec ^ ((uint64_t)t.tv_sec << 32) ^ (++s->next_id * 0x9e3779b97f4a7c15ULL);
    pthread_mutex_unlock(&s->mu);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    return x ^ (x >> 29);
}

/* Tokenizes text; *ids is malloc'd. */
static bool encode(kiln_server_t *s, const char *text, size_t len, int32_t **ids, int *n)
{
    size_t cap = len + 16, got = 0;
    *ids = malloc(sizeof **ids * cap);
    if (!*ids) return false;
    if (kiln_tokenizer_encode(s->tok, text, len, *ids, cap, &got) != KILN_OK) {
        free(*ids);
        *ids = NULL;
        return false;
    }
    *n = (int)got;
    return true;
}

static enum MHD_Result generate(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs, bool chat)
{
    int ep = cs->endpoint;
    job *j = calloc(1, sizeof *j);
    if (!j) return send_error(s, conn, ep, 500, NULL, NULL, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    j->srv = s;
    j->refs = 1;
    char err[512];
    const char *param = NULL;
    int st = kiln__oai_parse(cs->body, cs->len, chat, &j->req, err, sizeof err, &param);
    kiln__oai_req *q = &j->req;
    enum MHD_Result res;
    int32_t *ids = NULL;
    int n_ids = 0;
    if (st) {
        res = send_error(s, conn, ep, st, param, NULL, "%s", err);
        goto fail;
    }
    if (q->model && strcmp(q->model, s->name)) {
        res = send_error(s, conn, ep, 404, "model", "model_not_found", "The model '%s' does not exist; this server has '%s'",
                         q->model, s->name);
        goto fail;
    }
    if (chat) {
        char *p = kiln__chat_render(&s->tmpl, q->msgs, q->n_msgs);
        bool ok = p && encode(s, p, strlen(p), &ids, &n_ids);
        free(p);
        if (!ok) {
            res = send_error(s, conn, ep, 500, NULL, NULL, "could not render or tokenize the messages: %s", kiln_last_error());
            goto fail;
        }
    } else if (q->prompt) {
        if (!encode(s, q->prompt, q->prompt_len, &ids, &n_ids)) {
            res = send_error(s, conn, ep, 500, NULL, NULL, "could not tokenize the prompt: %s", kiln_last_error());
            goto fail;
        }
    } else {
        ids = q->prompt_ids;
        n_ids = q->n_prompt_ids;
        q->prompt_ids = NULL;
        for (int i = 0; i < n_ids; i++)
            if (ids[i] >= s->vocab) {
                res = send_error(s, conn, ep, 400, "prompt", NULL, "prompt token %d is %d, outside the vocabulary of %d", i,
                                 ids[i], s->vocab);
                goto fail;
            }
    }
    if (n_ids == 0) {
        if (s->eot >= 0 && (ids = malloc(sizeof *ids))) { /* an empty prompt starts a document */
            ids[0] = s->eot;
            n_ids = 1;
        } else {
            res = send_error(s, conn, ep, 400, chat ? "messages" : "prompt", NULL, "the prompt is empty");
            goto fail;
        }
    }
    int room = s->ctx - n_ids;
    int max_tokens = q->max_tokens;
    if (max_tokens < 0) max_tokens = chat ? room : (s->o.max_tokens_default < room ? s->o.max_tokens_default : room);
    if (room < 1 || max_tokens > room) {
        res = send_error(s, conn, ep, 400, q->max_tokens < 0 ? (chat ? "messages" : "prompt") : "max_tokens",
                         "context_length_exceeded",
                         "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in "
                         "the prompt, %d for the completion).", s->ctx, n_ids + (max_tokens > 0 ? max_tokens : 0), n_ids,
                         max_tokens > 0 ? max_tokens : 0);
        goto fail;
    }
    j->n_prompt = n_ids;
    j->n = q->n;
    j->n_top = q->logprobs > 0 ? q->logprobs : 0;
    j->stream = q->stream;
    j->t_start = kiln__now_s();
    j->created = (long long)time(NULL);
    uint64_t seed = q->has_seed ? q->seed : random_seed(s);
    snprintf(j->id, sizeof j->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl", (unsigned long long)random_seed(s));
    for (int i = 0; i < q->n_stop; i++) j->stops[j->n_stops++] = q->stop[i];
    if (chat)
        for (int i = 0; i < s->tmpl.n_stop && j->n_stops < KILN__MAX_STOPS; i++) j->stops[j->n_stops++] = s->tmpl.stop[i];
    for (int i = 0; i < j->n; i++) {
        j->ch[i].j = j;
        j->ch[i].index = i;
        kiln__textstream_init(&j->ch[i].ts, j->stops, j->n_stops);
    }
    /* The engine may call back at once: everything it touches is ready before submit. */
    j->conn = conn;
    cs->j = j;
    pthread_mutex_lock(&j->mu);
    kiln_status sub = KILN_OK;
    int submitted = 0;
    for (int i = 0; i < j->n && sub == KILN_OK; i++) {
        kiln_gen_request r = {.prompt = ids, .n_prompt = n_ids, .max_tokens = max_tokens,
                              .sampling = {.temperature = q->temperature, .top_k = q->top_k, .top_p = q->top_p,
                                           .seed = seed + (uint64_t)i},
                              .logprobs = q->logprobs, .cb = on_token, .user = &j->ch[i]};
        j->refs++;
        sub = kiln_engine_submit(s->engine, &r, &j->ch[i].engine_id);
        if (sub == KILN_OK) {
            j->ch[i].submitted = true;
            submitted++;
        } else {
            j->refs--;
        }
    }
    free(ids);
    ids = NULL;
    /* On the watchdog's list once the engine ids are set; they do not change after. */
    pthread_mutex_lock(&s->mu);
    j->next = s->jobs;
    s->jobs = j;
    if (sub == KILN_OK) s->m.prompt_tokens += (uint64_t)n_ids;
    pthread_mutex_unlock(&s->mu);
    if (sub != KILN_OK) {
        cancel_job(j);
        /* The choices that never ran count as finished; the others end as cancelled. */
        j->n_done += j->n - submitted;
        if (submitted == 0) j->done = true;
        pthread_mutex_unlock(&j->mu);
        if (sub == KILN_ERR_BUSY)
            return send_error(s, conn, ep, 429, NULL, "queue_full", "the server is busy (%s); retry shortly",
                              kiln_last_error());
        return send_error(s, conn, ep, 400, NULL, NULL, "%s", kiln_last_error());
    }
    if (j->stream) {
        pthread_mutex_unlock(&j->mu);
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, j, stream_free);
        if (!r) {
            pthread_mutex_lock(&j->mu);
            cancel_job(j);
            pthread_mutex_unlock(&j->mu);
            return send_error(s, conn, ep, 500, NULL, NULL, "out of memory");
        }
        pthread_mutex_lock(&j->mu);
        j->refs++; /* the response's */
        pthread_mutex_unlock(&j->mu);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "Access-Control-Allow-Origin", s->cors);
        enum MHD_Result ok = MHD_queue_response(conn, 200, r);
        MHD_destroy_response(r);
        count_request(s, ep, 200);
        return ok;
    }
    if (!j->done) suspend(j); /* the engine's last callback resumes it */
    bool done = j->done;
    pthread_mutex_unlock(&j->mu);
    return done ? finish_plain(s, conn, cs) : MHD_YES;

fail:
    free(ids);
    kiln__oai_free(&j->req);
    pthread_mutex_destroy(&j->mu);
    free(j);
    return res;
}

/* ---- the other endpoints ---- */

static enum MHD_Result tokenize(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    json_error_t je;
    json_t *o = json_loadb(cs->body ? cs->body : "", cs->len, 0, &je), *p = json_object_get(o, "prompt");
    if (!p) p = json_object_get(o, "text");
    if (!json_is_string(p)) {
        json_decref(o);
        return send_error(s, conn, cs->endpoint, 400, "prompt", NULL, "want {\"prompt\": \"text\"}%s%s", o ? "" : ": ",
                          o ? "" : je.text);
    }
    int32_t *ids;
    int n;
    bool ok = encode(s, json_string_value(p), json_string_length(p), &ids, &n);
    json_decref(o);
    if (!ok) return send_error(s, conn, cs->endpoint, 500, NULL, NULL, "could not tokenize: %s", kiln_last_error());
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    free(ids);
    return send_json(s, conn, cs->endpoint, 200, json_pack("{s:o,s:i,s:i}", "tokens", a, "count", n, "max_model_len", s->ctx));
}

static enum MHD_Result detokenize(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    json_error_t je;
    json_t *o = json_loadb(cs->body ? cs->body : "", cs->len, 0, &je), *t = json_object_get(o, "tokens");
    size_t n = json_array_size(t);
    if (!json_is_array(t)) {
        json_decref(o);
        return send_error(s, conn, cs->endpoint, 400, "tokens", NULL, "want {\"tokens\": [ids]}%s%s", o ? "" : ": ",
                          o ? "" : je.text);
    }
    kiln__textstream ts;
    kiln__textstream_init(&ts, NULL, 0);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(t, i);
        size_t len;
        const char *b = json_is_integer(e) && json_integer_value(e) >= 0 && json_integer_value(e) < s->vocab
                            ? kiln_tokenizer_token_bytes(s->tok, (int32_t)json_integer_value(e), &len)
                            : NULL;
        if (!b) {
            kiln__textstream_free(&ts);
            json_decref(o);
            return send_error(s, conn, cs->endpoint, 400, "tokens", NULL, "tokens[%zu] is not a token id in [0, %d)", i,
                              s->vocab);
        }
        kiln__textstream_push(&ts, b, len);
    }
    json_decref(o);
    size_t from, len;
    kiln__textstream_take(&ts, true, &from, &len);
    json_t *r = json_pack("{s:s%}", "prompt", ts.text ? ts.text : "", ts.n_text);
    kiln__textstream_free(&ts);
    return send_json(s, conn, cs->endpoint, 200, r);
}

static enum MHD_Result models(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", s->name, "object", "model", "created", (json_int_t)time(NULL),
                          "owned_by", "kiln", "max_model_len", s->ctx);
    return send_json(s, conn, cs->endpoint, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", m));
}

static enum MHD_Result metrics_page(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    kiln_engine_stats es = {0};
    if (atomic_load(&s->loaded)) kiln_engine_get_stats(s->engine, &es);
    size_t cap = 16384, len = 0;
    char *b = malloc(cap);
    if (!b) return send_error(s, conn, cs->endpoint, 500, NULL, NULL, "out of memory");
#define P(...) (len += (size_t)snprintf(b + len, len < cap ? cap - len : 0, __VA_ARGS__))
    pthread_mutex_lock(&s->mu);
    metrics m = s->m;
    pthread_mutex_unlock(&s->mu);
    P("# HELP kiln_requests_total HTTP requests answered, by endpoint and status code.\n# TYPE kiln_requests_total counter\n");
    for (int e = 0; e < EP_COUNT; e++)
        for (int k = 0; k <= N_CODES; k++)
            if (m.requests[e][k]) {
                if (k < N_CODES) P("kiln_requests_total{endpoint=\"%s\",code=\"%d\"} %llu\n", ep_names[e], codes[k], (unsigned long long)m.requests[e][k]);
                else P("kiln_requests_total{endpoint=\"%s\",code=\"other\"} %llu\n", ep_names[e], (unsigned long long)m.requests[e][k]);
            }
    P("# HELP kiln_prompt_tokens_total Prompt tokens of accepted generation requests.\n# TYPE kiln_prompt_tokens_total counter\n");
    P("kiln_prompt_tokens_total %llu\n", (unsigned long long)m.prompt_tokens);
    P("# HELP kiln_generation_tokens_total Tokens generated.\n# TYPE kiln_generation_tokens_total counter\n");
    P("kiln_generation_tokens_total %llu\n", (unsigned long long)es.generated_tokens);
    P("# HELP kiln_queue_depth Requests waiting for a batch slot or KV memory.\n# TYPE kiln_queue_depth gauge\n");
    P("kiln_queue_depth %d\n", es.waiting);
    P("# HELP kiln_running_requests Sequences in the running batch.\n# TYPE kiln_running_requests gauge\n");
    P("kiln_running_requests %d\n", es.running);
    P("# HELP kiln_kv_blocks_free KV cache blocks free or reclaimable.\n# TYPE kiln_kv_blocks_free gauge\n");
    P("kiln_kv_blocks_free %d\n", es.kv_blocks_free);
    P("# HELP kiln_kv_blocks_total KV cache blocks.\n# TYPE kiln_kv_blocks_total gauge\n");
    P("kiln_kv_blocks_total %d\n", es.kv_blocks_total);
    P("# HELP kiln_prefix_cache_hit_tokens_total Prompt tokens whose keys and values came from the prefix cache.\n"
      "# TYPE kiln_prefix_cache_hit_tokens_total counter\n");
    P("kiln_prefix_cache_hit_tokens_total %llu\n", (unsigned long long)es.prefix_hit_tokens);
    P("# HELP kiln_engine_steps_total Batched model steps.\n# TYPE kiln_engine_steps_total counter\n");
    P("kiln_engine_steps_total %llu\n", (unsigned long long)es.steps);
    P("# HELP kiln_generation_tokens_per_second Tokens generated per second of model time, since start.\n"
      "# TYPE kiln_generation_tokens_per_second gauge\n");
    P("kiln_generation_tokens_per_second %.3f\n", es.busy_seconds > 0 ? (double)es.generated_tokens / es.busy_seconds : 0.0);
    P("# HELP kiln_time_to_first_token_seconds From a request's arrival to its first token.\n"
      "# TYPE kiln_time_to_first_token_seconds histogram\n");
    uint64_t cum = 0;
    for (int i = 0; i < N_TTFT; i++) {
        cum += m.ttft_buckets[i];
        P("kiln_time_to_first_token_seconds_bucket{le=\"%g\"} %llu\n", ttft_bounds[i], (unsigned long long)cum);
    }
    cum += m.ttft_buckets[N_TTFT];
    P("kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    P("kiln_time_to_first_token_seconds_sum %.6f\n", m.ttft_sum);
    P("kiln_time_to_first_token_seconds_count %llu\n", (unsigned long long)m.ttft_count);
#undef P
    enum MHD_Result r = len < cap ? send_buf(s, conn, cs->endpoint, 200, "text/plain; version=0.0.4", b, len, true, NULL)
                                  : send_error(s, conn, cs->endpoint, 500, NULL, NULL, "metrics page too long");
    free(b);
    return r;
}

/* ---- routing ---- */

static int endpoint_of(const char *url)
{
    for (int e = 0; e < EP_OTHER; e++)
        if (!strcmp(url, ep_names[e])) return e;
    if (!strcmp(url, "/index.html")) return EP_PAGE;
    return EP_OTHER;
}

static bool authorized(kiln_server_t *s, struct MHD_Connection *conn)
{
    if (!s->api_key) return true;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7)) return false;
    h += 7;
    size_t a = strlen(h), b = strlen(s->api_key);
    unsigned diff = a != b;
    for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned)(h[i] ^ s->api_key[i]); /* no early exit */
    return diff == 0;
}

static bool is_json(struct MHD_Connection *conn)
{
    const char *t = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type");
    if (!t) return false;
    while (*t == ' ') t++;
    return !strncasecmp(t, "application/json", 16) && (t[16] == '\0' || t[16] == ';' || t[16] == ' ');
}

static enum MHD_Result route(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs, const char *url,
                             const char *method)
{
    int ep = cs->endpoint;
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (!strcmp(method, "OPTIONS")) {
        struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Access-Control-Allow-Origin", s->cors);
        MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        MHD_add_response_header(r, "Access-Control-Allow-Headers", "Authorization, Content-Type");
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
        enum MHD_Result ok = MHD_queue_response(conn, 204, r);
        MHD_destroy_response(r);
        count_request(s, ep, 204);
        return ok;
    }
    if (ep == EP_OTHER) return send_error(s, conn, ep, 404, NULL, "not_found", "no endpoint %s %s", method, url);
    bool wants_post = ep == EP_COMPLETIONS || ep == EP_CHAT || ep == EP_TOKENIZE || ep == EP_DETOKENIZE;
    if (wants_post ? !post : !get)
        return send_error(s, conn, ep, 405, NULL, "method_not_allowed", "%s takes %s, not %s", url,
                          wants_post ? "POST" : "GET", method);
    if (ep == EP_PAGE)
        return send_buf(s, conn, ep, 200, "text/html; charset=utf-8", kiln__page_html, kiln__page_html_len, false, NULL);
    if (ep == EP_HEALTH) {
        bool up = atomic_load(&s->loaded);
        static const char ok[] = "{\"status\":\"ok\"}", loading[] = "{\"status\":\"loading\"}";
        return send_buf(s, conn, ep, up ? 200 : 503, "application/json", up ? ok : loading,
                        up ? sizeof ok - 1 : sizeof loading - 1, false, NULL);
    }
    if (ep == EP_METRICS) return metrics_page(s, conn, cs);
    if (!authorized(s, conn))
        return send_error(s, conn, ep, 401, NULL, "invalid_api_key", "missing or wrong API key (Authorization: Bearer KEY)");
    if (!atomic_load(&s->loaded)) return send_error(s, conn, ep, 503, NULL, "loading", "the model is still loading");
    if (ep == EP_MODELS) return models(s, conn, cs);
    if (!is_json(conn))
        return send_error(s, conn, ep, 415, NULL, "unsupported_media_type", "POST %s needs Content-Type: application/json",
                          url);
    if (ep == EP_TOKENIZE) return tokenize(s, conn, cs);
    if (ep == EP_DETOKENIZE) return detokenize(s, conn, cs);
    return generate(s, conn, cs, ep == EP_CHAT);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    kiln_server_t *s = cls;
    conn_state *cs = *con_cls;
    if (!cs) {
        if (!(cs = calloc(1, sizeof *cs))) return MHD_NO;
        cs->endpoint = endpoint_of(url);
        *con_cls = cs;
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > s->o.max_body) { /* refuse before reading the body */
            cs->answered = true;
            return send_error(s, conn, cs->endpoint, 413, NULL, "body_too_large", "the request body of %s bytes is over the "
                              "limit of %zu", cl, s->o.max_body);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cs->too_big && cs->len + *upload_size > s->o.max_body) {
            cs->too_big = true;
            free(cs->body);
            cs->body = NULL;
            cs->len = cs->cap = 0;
        }
        if (!cs->too_big) {
            if (cs->len + *upload_size + 1 > cs->cap) {
                size_t cap = cs->cap ? cs->cap : 4096;
                while (cap < cs->len + *upload_size + 1) cap *= 2;
                char *p = realloc(cs->body, cap);
                if (!p) return MHD_NO;
                cs->body = p;
                cs->cap = cap;
            }
            memcpy(cs->body + cs->len, upload, *upload_size);
            cs->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cs->j && !cs->j->stream) { /* resumed: the engine is done with a non-streamed request */
        pthread_mutex_lock(&cs->j->mu);
        bool done = cs->j->done;
        if (!done) suspend(cs->j);
        pthread_mutex_unlock(&cs->j->mu);
        if (!done) return MHD_YES;
        return finish_plain(s, conn, cs);
    }
    if (cs->answered) return MHD_YES;
    cs->answered = true;
    if (cs->too_big)
        return send_error(s, conn, cs->endpoint, 413, NULL, "body_too_large", "the request body is over the limit of %zu bytes",
                          s->o.max_body);
    return route(s, conn, cs, url, method);
}

/* The connection is done with this request: it answered, or the client went away. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    conn_state *cs = *con_cls;
    if (!cs) return;
    if (cs->j) {
        job *j = cs->j;
        pthread_mutex_lock(&j->mu);
        j->conn = NULL;
        cancel_job(j);
        pthread_mutex_unlock(&j->mu);
        job_unref(j);
    }
    free(cs->body);
    free(cs);
    *con_cls = NULL;
}

/* Cancels jobs that ran past the request timeout. */
static void *watchdog_main(void *arg)
{
    kiln_server_t *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 100 * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &t);
        double now = kiln__now_s();
        for (job *j = s->jobs; j; j = j->next)
            if (now - j->t_start > s->o.request_timeout && !atomic_exchange(&j->timed_out, true))
                for (int i = 0; i < j->n; i++)
                    if (j->ch[i].submitted) kiln_engine_cancel(s->engine, j->ch[i].engine_id);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- the public side ---- */

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

kiln_status kiln_server_start(const kiln_server_opts *o, kiln_server_t **out)
{
    if (!o || !out) return kiln_error(KILN_ERR_ARG, "server_start: opts and out must not be NULL");
    *out = NULL;
    if (o->port < 0 || o->port > 65535) return kiln_error(KILN_ERR_ARG, "server: port %d is not in 0..65535", o->port);
    if (o->http_threads < 1 || o->http_threads > 1024)
        return kiln_error(KILN_ERR_ARG, "server: http_threads %d is not in 1..1024", o->http_threads);
    if (o->max_body < 16) return kiln_error(KILN_ERR_ARG, "server: max_body %zu is under 16 bytes", o->max_body);
    if (!(o->request_timeout > 0)) return kiln_error(KILN_ERR_ARG, "server: request_timeout must be positive");
    if (o->max_tokens_default < 1) return kiln_error(KILN_ERR_ARG, "server: max_tokens_default must be >= 1");
    if (o->idle_timeout < 1) return kiln_error(KILN_ERR_ARG, "server: idle_timeout must be >= 1 second");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    const char *host = o->host ? o->host : "127.0.0.1";
    if (inet_pton(AF_INET, !strcmp(host, "localhost") ? "127.0.0.1" : host, &addr.sin_addr) != 1)
        return kiln_error(KILN_ERR_ARG, "server: host '%s' is not an IPv4 address", host);
    kiln_server_t *s = calloc(1, sizeof *s);
    if (!s) return kiln_error(KILN_ERR_OOM, "server_start: out of memory");
    s->o = *o;
    s->host = strdup(host);
    s->api_key = dup_or_null(o->api_key && *o->api_key ? o->api_key : NULL);
    s->cors = strdup(o->cors_origin ? o->cors_origin : "*");
    s->name_opt = dup_or_null(o->model_name);
    s->o.host = s->host;
    s->o.api_key = s->api_key;
    s->o.cors_origin = s->cors;
    s->o.model_name = s->name_opt;
    s->eot = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (!s->host || !s->cors || (o->api_key && *o->api_key && !s->api_key) || (o->model_name && !s->name_opt)) {
        kiln_server_free(s);
        return kiln_error(KILN_ERR_OOM, "server_start: out of memory");
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, &addr,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)o->http_threads, MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)o->idle_timeout, MHD_OPTION_CONNECTION_LIMIT, (unsigned)1024, MHD_OPTION_NOTIFY_COMPLETED,
                            on_completed, s, MHD_OPTION_END);
    if (!s->d) {
        kiln_server_free(s);
        return kiln_error(KILN_ERR_IO, "server: cannot listen on %s:%d (in use, or not allowed)", host, o->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : o->port;
    if (pthread_create(&s->watchdog, NULL, watchdog_main, s) == 0) s->watchdog_started = true;
    *out = s;
    return KILN_OK;
}

int kiln_server_port(const kiln_server_t *s) { return s ? s->port : 0; }

/* The model's name: the run folder's, or the file's without ".safetensors". */
static char *name_from_path(const char *path)
{
    char *p = strdup(path), *e = p ? p + strlen(p) : NULL;
    if (!p) return NULL;
    while (e > p + 1 && e[-1] == '/') *--e = '\0';
    size_t n = strlen(p);
    if (n > 12 && !strcmp(p + n - 12, ".safetensors")) {
        p[n - 12] = '\0';
        char *slash = strrchr(p, '/');
        if (slash && !strcmp(slash + 1, "model")) *slash = '\0'; /* run/model.safetensors: the run's name */
    }
    char *slash = strrchr(p, '/');
    char *name = strdup(slash && slash[1] ? slash + 1 : p);
    free(p);
    return name;
}

kiln_status kiln_server_load(kiln_server_t *s, const char *model_path)
{
    if (!s || !model_path) return kiln_error(KILN_ERR_ARG, "server_load: server and path must not be NULL");
    if (atomic_load(&s->loaded)) return kiln_error(KILN_ERR_ARG, "server_load: a model is loaded already");
    char *tmpl = NULL;
    kiln_status st = kiln_model_load(model_path, &s->model, &s->tok, &tmpl);
    if (st != KILN_OK) return st;
    char err[256];
    bool ok = kiln__chat_template_parse(tmpl ? tmpl : kiln_chat_template_default(), &s->tmpl, err, sizeof err);
    free(tmpl);
    if (!ok) return kiln_error(KILN_ERR_FORMAT, "%s: %s", model_path, err);
    s->name = s->name_opt ? strdup(s->name_opt) : name_from_path(model_path);
    if (!s->name) return kiln_error(KILN_ERR_OOM, "server_load: out of memory");
    s->ctx = kiln_gpt_get_config(s->model)->block_size;
    s->vocab = kiln_gpt_get_config(s->model)->vocab_size;
    if (kiln_tokenizer_vocab_size(s->tok) > s->vocab)
        return kiln_error(KILN_ERR_FORMAT, "%s: the tokenizer has %d tokens, the model %d", model_path,
                          kiln_tokenizer_vocab_size(s->tok), s->vocab);
    s->eot = kiln_tokenizer_eot(s->tok);
    if ((st = kiln_engine_new(s->model, &s->o.engine, &s->engine)) != KILN_OK) return st;
    atomic_store(&s->loaded, true);
    return KILN_OK;
}

void kiln_server_free(kiln_server_t *s)
{
    if (!s) return;
    if (s->d) MHD_quiesce_daemon(s->d); /* no new connections */
    atomic_store(&s->loaded, false);    /* and requests on open ones get 503 */
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->watchdog_started) pthread_join(s->watchdog, NULL);
    s->watchdog_started = false;
    /* Cancel what runs: each final callback ends its stream and resumes its connection.
     * MHD must not be stopped with a connection suspended, so wait (bounded) for them;
     * the engine stays alive until MHD is stopped, since closing a stream cancels. */
    pthread_mutex_lock(&s->mu);
    for (job *j = s->jobs; j && s->engine; j = j->next)
        for (int i = 0; i < j->n; i++)
            if (j->ch[i].submitted) kiln_engine_cancel(s->engine, j->ch[i].engine_id);
    for (int i = 0; i < 100 && s->n_suspended > 0; i++) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 50 * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &t);
    }
    pthread_mutex_unlock(&s->mu);
    if (s->d) MHD_stop_daemon(s->d);
    kiln_engine_free(s->engine);
    kiln__chat_template_free(&s->tmpl);
    kiln_tokenizer_free(s->tok);
    kiln_gpt_free(s->model);
    free(s->name);
    free(s->host);
    free(s->api_key);
    free(s->cors);
    free(s->name_opt);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
