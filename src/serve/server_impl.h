/* The HTTP server's private parts, shared by its files:
 *
 *   server.c     the public side: options, start, load, free
 *   http.c       responses, the route table and the request callbacks MHD calls
 *   generate.c   /v1/completions and /v1/chat/completions: a request becomes engine requests
 *   endpoints.c  /v1/models, /v1/kiln/props, /tokenize, /detokenize
 *   jobs.c       a generation's job: its references, the engine's callback, the watchdog
 *   sse.c        the streamed response (server-sent events)
 *   json.c       the JSON shapes of an answer: choices, logprobs, usage
 *   metrics.c    the counters and the /metrics page
 *   reqlog.c     the request log: one line per finished request (kiln_server_opts.log_request)
 *
 * Locks: s->mu guards the metrics, the job list and the counters; j->mu guards a job.
 * Where both are held, j->mu is taken first. */
#ifndef KILN_SERVE_SERVER_IMPL_H
#define KILN_SERVE_SERVER_IMPL_H

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include "core/util.h"
#include "kiln/serve.h"
#include "serve/openai.h"

/* The endpoints: a row each in http.c's route table, and the label of the request
 * counters in /metrics (EP_OTHER: a path that no route has). */
enum { EP_COMPLETIONS, EP_CHAT, EP_MODELS, EP_HEALTH, EP_METRICS, EP_TOKENIZE, EP_DETOKENIZE, EP_PAGE, EP_PROPS, EP_OTHER, EP_COUNT };

/* Sizes of metrics.c's tables: the status codes counted one by one, and the buckets of
 * the time-to-first-token histogram. */
enum { KILN__SERVE_N_CODES = 12, KILN__SERVE_N_TTFT = 11 };

typedef struct {
    uint64_t requests[EP_COUNT][KILN__SERVE_N_CODES + 1]; /* the last column: any other code */
    uint64_t prompt_tokens; /* generated tokens are the engine's count */
    uint64_t ttft_buckets[KILN__SERVE_N_TTFT + 1], ttft_count;
    double ttft_sum;
} kiln__serve_metrics_t;

struct kiln_server {
    kiln_server_opts o;
    char *host, *api_key, *cors, *name_opt, *tmpl_opt; /* tmpl_opt: --chat-template */
    struct MHD_Daemon *d;
    int port;
    atomic_bool loaded;
    kiln_gpt_t *model;
    kiln_tokenizer_t *tok;
    kiln_engine_t *engine;
    kiln__chat_template tmpl;
    char *name;
    int ctx, vocab;
    int32_t eot, bos; /* the tokenizer's end and start of a text (-1: none) */

    pthread_mutex_t mu; /* metrics, the job list, counters */
    pthread_cond_t cv;
    kiln__serve_metrics_t m;
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

/* What the engine's callbacks produce for one request. It is reference-counted (the
 * connection, the streamed response, and each engine request hold one) because the
 * HTTP side and the engine side end in either order. */
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
    atomic_bool settled; /* done, readable without j->mu (shutdown waits for it) */
    atomic_bool timed_out;
    char *out; /* streamed bytes not yet sent */
    size_t out_len, out_cap, out_pos;
    double t_start;
    char id[48];
    long long created;
    struct job *next; /* in srv->jobs */
} job;

/* What one connection has collected for its current request. reqlog.c makes it when
 * the request line arrives, so that every request is logged once, those libmicrohttpd
 * refuses itself included; on_completed frees it. */
typedef struct {
    char *body;
    size_t len, cap;
    bool seen;     /* the access handler has been called for this request */
    bool too_big, answered;
    int endpoint;
    job *j;
    double t_start;      /* the request line's arrival (kiln__now_s) */
    char *target;        /* for the log: the request target as sent (at most KILN__LOG_TARGET bytes); else NULL */
    bool target_cut;     /* it was longer */
    char method[33];     /* for the log: the method as sent, cut at 32 bytes ("" before the handler saw it) */
    bool method_cut;
} conn_state;

/* An endpoint's handler: answers the request on conn (whose body is in cs). */
typedef enum MHD_Result (*kiln__serve_handler)(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);

/* ---- http.c ---- */

/* The callbacks MHD calls (MHD_AccessHandlerCallback, MHD_RequestCompletedCallback). */
enum MHD_Result kiln__serve_on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                       const char *version, const char *upload, size_t *upload_size, void **con_cls);
void kiln__serve_on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                              enum MHD_RequestTerminationCode toe);
/* The path of endpoint ep, as /metrics labels it ("other" for EP_OTHER). */
const char *kiln__serve_endpoint_name(int ep);
/* Queue a response and count it under endpoint ep. body is copied when copy is set,
 * else it must outlive the response. */
enum MHD_Result kiln__serve_send_buf(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *type,
                                     const char *body, size_t len, bool copy, const char *retry_after);
/* Sends o (taken; NULL sends a 500 "out of memory") as the JSON body. */
enum MHD_Result kiln__serve_send_json(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, json_t *o);
/* Sends an OpenAI-shaped error. */
enum MHD_Result kiln__serve_send_error(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *param,
                                       const char *err_code, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));

/* ---- reqlog.c ---- */

/* The most bytes of a request target the log keeps. */
#define KILN__LOG_TARGET 1000
/* MHD's URI log callback: makes the request's conn_state (its *con_cls) as its request
 * line arrives. */
void *kiln__serve_on_uri(void *cls, const char *uri, struct MHD_Connection *conn);
/* Logs the request of cs, which has ended, through the server's log_request (on_completed). */
void kiln__serve_log_request(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);

/* ---- generate.c ---- */

enum MHD_Result kiln__serve_completions(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);
enum MHD_Result kiln__serve_chat_completions(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);
/* The answer to a finished non-streamed job (cs->j). */
enum MHD_Result kiln__serve_finish_plain(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);

/* ---- endpoints.c ---- */

enum MHD_Result kiln__serve_models(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);
/* kiln's facts for the page: the model, its context and the chat template. */
enum MHD_Result kiln__serve_props(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);
enum MHD_Result kiln__serve_tokenize(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);
enum MHD_Result kiln__serve_detokenize(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);
/* Tokenizes text; *ids is malloc'd. */
bool kiln__serve_encode(kiln_server_t *s, const char *text, size_t len, int32_t **ids, int *n);
/* The same with special tokens not recognised inside plain[0..n_plain) (chat contents). */
bool kiln__serve_encode_plain(kiln_server_t *s, const char *text, size_t len, const kiln_text_span *plain, int n_plain,
                              int32_t **ids, int *n);

/* ---- jobs.c ---- */

/* Drops one reference; the last frees the job and takes it off the watchdog's list. */
void kiln__serve_job_unref(job *j);
/* Puts j on the watchdog's list. */
void kiln__serve_job_track(job *j);
/* 0 when every choice of j finished; else the status for its failure (504 timed out,
 * 500 an engine error, 503 shutting down), with the message in msg. Under j->mu. */
int kiln__serve_job_failure(job *j, char *msg, size_t n);
/* Cancels j's engine requests that still run. Under j->mu. */
void kiln__serve_job_cancel(job *j);
/* Suspends j's connection until the engine has something for it. Under j->mu. */
void kiln__serve_job_suspend(job *j);
/* The engine's callback (kiln_engine_cb); user is a choice. */
bool kiln__serve_on_token(void *user, const kiln_token_event *ev, kiln_finish fin);
/* How j ended, for the request log (kiln_request_log.end), into buf; its prompt and
 * generated tokens into *prompt and *completion. Under j->mu. */
void kiln__serve_job_outcome(job *j, char *buf, size_t n, int *prompt, int *completion);
/* The watchdog thread: cancels jobs that run past the request timeout. */
void *kiln__serve_watchdog_main(void *arg);
/* Stops the watchdog, cancels every job, and waits (bounded) until no connection is
 * suspended, so that MHD can be stopped. */
void kiln__serve_jobs_stop(kiln_server_t *s);

/* ---- sse.c ---- */

/* One streamed chunk for choice c: text delta, logprobs of the tokens it completes,
 * and the finish reason when it is the last. Under j->mu. */
void kiln__serve_sse_chunk(job *j, choice *c, const char *text, size_t len, const char *finish);
/* The stream's last events: an error if a choice failed, else the usage when asked
 * for; then [DONE]. Under j->mu. */
void kiln__serve_sse_end(job *j);
/* Answers conn with j's stream; the response holds a reference to j. */
enum MHD_Result kiln__serve_sse_respond(kiln_server_t *s, struct MHD_Connection *conn, int ep, job *j);

/* ---- json.c ---- */

/* Logprobs of tokens [from, to) of c, in the completions or the chat shape. */
json_t *kiln__serve_logprobs_json(job *j, choice *c, int from, int to);
/* Tokens whose first byte lies in the final text: those the client is told about. */
int kiln__serve_tokens_in_text(const choice *c, size_t text_len);
const char *kiln__serve_finish_reason(const choice *c);
/* The fields every streamed chunk starts with. */
json_t *kiln__serve_chunk_json(job *j);
json_t *kiln__serve_usage_json(job *j);
/* The whole answer to a non-streamed request. */
json_t *kiln__serve_completion_json(job *j);

/* ---- metrics.c ---- */

void kiln__serve_count_request(kiln_server_t *s, int ep, int code);
void kiln__serve_count_ttft(kiln_server_t *s, double seconds);
void kiln__serve_count_prompt(kiln_server_t *s, int n_tokens);
enum MHD_Result kiln__serve_metrics(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs);

#endif
