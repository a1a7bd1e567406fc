/* kiln/serve.h — serving a trained model: token sampling, the continuous-batching
 * engine over a paged KV cache, and the OpenAI-compatible HTTP server.
 *
 * A worked example (the engine alone; `kiln serve` puts the HTTP server in front):
 *
 *     static bool on_token(void *user, const kiln_token_event *ev, kiln_finish fin)
 *     {
 *         if (ev) printf("token %d (logprob %.3f)\n", ev->token, ev->logprob);
 *         else printf("done: %s\n", kiln_finish_name(fin));
 *         return true;                          // false: stop this request here
 *     }
 *     ...
 *     kiln_engine_t *e;
 *     kiln_engine_opts o = kiln_engine_opts_default();
 *     if (kiln_engine_new(model, &o, &e) != KILN_OK) die(kiln_last_error());
 *     kiln_gen_request r = {.prompt = ids, .n_prompt = n, .max_tokens = 50,
 *                           .sampling = {.temperature = 0.8, .top_p = 1, .seed = 7},
 *                           .logprobs = -1, .cb = on_token, .user = NULL};
 *     uint64_t id;
 *     kiln_engine_submit(e, &r, &id);           // on_token runs on the engine's thread
 *     ...
 *     kiln_engine_free(e);                      // cancels what is left, then returns
 */
#ifndef KILN_SERVE_H
#define KILN_SERVE_H

#include <stddef.h>
#include <stdint.h>
#include "kiln/nn.h"
#include "kiln/tokenizer.h"

/* The most alternatives a request may ask logprobs for (OpenAI's limit). */
#define KILN_MAX_LOGPROBS 20

#ifdef __cplusplus
extern "C" {
#endif

/* ---- sampling ---- */

typedef struct {
    double temperature; /* 0 = greedy (argmax) */
    int top_k;          /* 0 = all tokens */
    double top_p;       /* in (0, 1]; 1 = all tokens */
    uint64_t seed;
    /* Zero for each of these is off (a zeroed struct samples as before them). */
    double min_p;              /* keep the tokens at least min_p times as likely as the likeliest (0..1) */
    double presence_penalty;   /* subtracted once from the logit of each token generated so far (-2..2) */
    double frequency_penalty;  /* subtracted from it once per time it was generated (-2..2) */
    double repetition_penalty; /* > 0: a logit of a token in the prompt or the output is divided by it
                                  when positive, multiplied when negative (1 or 0: off) */
    const int32_t *bias_ids;   /* logit_bias: bias_vals[i] added to token bias_ids[i]'s logit */
    const float *bias_vals;
    int n_bias;
} kiln_sampling;

/* Bytes of scratch kiln_sample_token needs for a vocabulary of V tokens. */
size_t kiln_sample_scratch_bytes(int V);
/* Whether s changes the logits before sampling (a logit bias or a penalty is set). */
bool kiln_sampling_adjusts(const kiln_sampling *s);
/* The logits as s adjusts them, in order: logit_bias added; then repetition_penalty
 * over the distinct tokens of tok[0..n_tok) (prompt and output, as transformers'
 * RepetitionPenaltyLogitsProcessor); then presence and frequency penalties over the
 * output tok[n_prompt..n_tok) (as OpenAI and vLLM define them). logits (V) are changed
 * in place; counts is scratch of V ints, zero on entry and left zero. */
void kiln_sample_adjust(float *logits, int V, const kiln_sampling *s, const int32_t *tok, int n_prompt, int n_tok,
                        int32_t *counts);
/* Picks token number `index` of a sequence from logits (V). The choice is a pure
 * function of (logits, params, seed, index), so it does not depend on batching.
 * scratch holds kiln_sample_scratch_bytes(V) bytes. */
int kiln_sample_token(const float *logits, int V, const kiln_sampling *s, int64_t index, void *scratch);
/* The log-probability of `token` under softmax(logits) (temperature 1), and the top_n
 * likeliest tokens with theirs in top_ids/top_logprobs (top_n may be 0). */
float kiln_token_logprobs(const float *logits, int V, int token, int top_n, int *top_ids, float *top_logprobs);

/* ---- the engine ---- */

typedef struct {
    int max_batch;           /* sequences decoded together in one step (default 16) */
    int max_queue;           /* waiting requests before submit says KILN_ERR_BUSY (default 64) */
    int max_step_tokens;     /* prompt tokens prefilled in one step, all requests (default 512) */
    int block_len;           /* positions per KV block (default 16) */
    int num_blocks;          /* KV blocks; 0 = from kv_memory_mb */
    int64_t kv_memory_mb;    /* KV cache size when num_blocks is 0 (default 256) */
    bool prefix_cache;       /* share the KV blocks of a common prompt prefix (default on) */
    kiln_dtype kv_dtype;     /* KV cache storage: f32 (default), or f16 / bf16 for half the bytes */
    /* The linear layers' packed weights as decoding reads them: f32 (default), or bf16
     * (rounded once: half the bytes held and streamed per token; sums stay f32) */
    kiln_dtype weight_dtype;
    /* KILN_WEIGHT_QUANT_Q8_0 (kiln/nn.h): the linear weights held and streamed in ggml's
     * q8_0 blocks instead (weight_dtype then f32); default KILN_WEIGHT_QUANT_NONE */
    kiln_weight_quant weight_quant;
} kiln_engine_opts;

kiln_engine_opts kiln_engine_opts_default(void);

typedef enum {
    KILN_FINISH_NONE = 0,  /* still running */
    KILN_FINISH_LENGTH,    /* max_tokens reached, or the model's context is full */
    KILN_FINISH_STOP,      /* the callback returned false (a stop sequence, say) */
    KILN_FINISH_CANCELLED, /* kiln_engine_cancel, or the engine is being freed */
    KILN_FINISH_ERROR,     /* the model failed; kiln_engine_last_error says why */
} kiln_finish;
const char *kiln_finish_name(kiln_finish f); /* "length", "stop", "cancelled", "error" */

typedef struct {
    int token;
    int index;                  /* 0 for the first generated token */
    float logprob;              /* of token; only when the request asked for logprobs */
    int n_top;                  /* alternatives below (the request's logprobs count) */
    const int *top_ids;         /* borrowed for the call */
    const float *top_logprobs;
} kiln_token_event;

/* Called on the engine's thread for each generated token (ev != NULL, finish NONE) and
 * once at the end (ev NULL, finish says why); after the last call the engine never
 * touches user again. Returning false from a token call ends the request with
 * KILN_FINISH_STOP. A callback must be quick: it runs between batched steps. */
typedef bool (*kiln_engine_cb)(void *user, const kiln_token_event *ev, kiln_finish finish);

typedef struct {
    const int32_t *prompt; /* copied at submit */
    int n_prompt;          /* >= 1 */
    int max_tokens;        /* >= 1; prompt + max_tokens must fit the model's block_size */
    kiln_sampling sampling;
    int logprobs;          /* -1: none; 0..KILN_MAX_LOGPROBS: the token's logprob and this many alternatives */
    kiln_engine_cb cb;
    void *user;
} kiln_gen_request;

typedef struct kiln_engine kiln_engine_t;

/* Starts the engine's thread over model (borrowed; it must outlive the engine). */
kiln_status kiln_engine_new(kiln_gpt_t *model, const kiln_engine_opts *o, kiln_engine_t **out);
/* Cancels every request (each callback gets its final call), stops the thread, frees. */
void kiln_engine_free(kiln_engine_t *e);
/* Queues a request. KILN_ERR_BUSY when max_queue requests are waiting, KILN_ERR_ARG for
 * a request that can never run (it says why). On failure cb is never called. */
kiln_status kiln_engine_submit(kiln_engine_t *e, const kiln_gen_request *r, uint64_t *id);
/* Asks the engine to drop a request (queued or running) and free its KV blocks before
 * its next step; its callback gets a final KILN_FINISH_CANCELLED call. Unknown or
 * finished ids are ignored. Safe from any thread, including inside a callback; it needs
 * no memory, so it never fails. */
void kiln_engine_cancel(kiln_engine_t *e, uint64_t id);

typedef struct {
    int running, waiting;           /* requests now */
    int kv_blocks_total, kv_blocks_free;
    uint64_t requests_done, prompt_tokens, generated_tokens, prefix_hit_tokens;
    uint64_t steps;
    double busy_seconds;            /* time spent in model steps */
} kiln_engine_stats;
void kiln_engine_get_stats(kiln_engine_t *e, kiln_engine_stats *out);
int kiln_engine_context_len(const kiln_engine_t *e); /* the model's block_size */
/* The message of the last model failure (KILN_FINISH_ERROR), or "" if none. Copied into buf. */
void kiln_engine_last_error(kiln_engine_t *e, char *buf, size_t n);

/* ---- chat templates ----
 * A chat template is a JSON object stored in a checkpoint's "chat_template" metadata:
 *     {"message": "{role}: {content}\n", "generation": "assistant:", "stop": ["\nuser:"]}
 * Each message renders as "message" with {role} and {content} replaced (or as
 * "roles"[its role], where the template gives one); "prefix" (optional) comes first;
 * "generation" follows the last message and the model continues from there; "stop"
 * lists strings that end an answer (added to the request's own). kiln train writes
 * this default one. */
const char *kiln_chat_template_default(void);
/* The families of Hugging Face chat templates (tokenizer_config.json's "chat_template",
 * a Jinja program) in this format, recognized by their markers: "chatml" (<|im_start|>:
 * Qwen and others), "llama3" (<|start_header_id|>) and "mistral" ([INST]). By name, or
 * NULL. */
const char *kiln_chat_template_named(const char *name);
/* The template of a Hugging Face folder's tokenizer_config.json in this format (a new
 * string in *out; NULL when the folder has none). A template of no known family is
 * KILN_ERR_UNSUPPORTED with a message that names it and --chat-template. */
kiln_status kiln_chat_template_from_hf(const char *dir, char **out);

/* ---- the HTTP server ---- */

/* One finished request, as kiln_server_opts.log_request receives it: once per request
 * whose request line arrived, after its response was sent in full (a stream too) or its
 * connection ended. The strings are borrowed for the call. Whatever the client sent
 * (method, target) is escaped: a byte outside printable ASCII, a space or a backslash
 * is written \xHH (\\ for a backslash), so a request cannot add a line or a field. */
typedef struct {
    const char *line;       /* all of it, in kiln's format (docs/serve.md), without a newline */
    double time;            /* when the request ended, seconds since the epoch */
    const char *client;     /* "127.0.0.1:53412" */
    const char *method;     /* "POST"; "-" where libmicrohttpd refused the request before kiln saw it */
    const char *target;     /* the path and query as sent (percent-encoding kept), escaped, cut at 1,000
                             * characters with "..." */
    int status;             /* the HTTP status sent; 0 when none was (the client left, or timed out, first) */
    int prompt_tokens;      /* a generation's prompt (0 for other requests, or one refused before it ran) */
    int completion_tokens;  /* tokens generated, all choices together (as its usage says) */
    double ms;              /* from the request line's arrival to the end */
    /* How a generation ended: "cancelled" (the client left first, or the server
     * stopped), "timeout" (past request_timeout), "error" (the model failed), the worst
     * where choices differ; else "stop" or "length" (each choice's finish_reason, joined
     * with ',' where choices differ); "-" for other requests. */
    const char *end;
} kiln_request_log;

/* Called on one of the server's HTTP threads, several at once: it must be quick and
 * thread-safe (a line that blocks holds that thread). */
typedef void (*kiln_request_log_fn)(void *user, const kiln_request_log *r);

/* A kiln_request_log_fn that writes r->line and a newline to stderr in one write(2), so
 * lines of concurrent requests never interleave; a write that fails (a closed pipe, a
 * full disk) drops the line and raises no SIGPIPE. user is unused. What `kiln serve
 * --log-requests` uses. */
void kiln_request_log_stderr(void *user, const kiln_request_log *r);

typedef struct {
    const char *host;        /* default "127.0.0.1" */
    int port;                /* default 8000; 0 = any free port (see kiln_server_port) */
    const char *api_key;     /* NULL: no auth; else "Authorization: Bearer KEY" on /v1 */
    const char *model_name;  /* the id in /v1/models and responses; default: the run folder's name */
    const char *cors_origin; /* Access-Control-Allow-Origin; default "*" */
    int http_threads;        /* libmicrohttpd's pool (default 4) */
    size_t max_body;         /* request body limit in bytes (default 1 MiB) */
    double request_timeout;  /* seconds a request may take in all (default 300) */
    int idle_timeout;        /* seconds a connection may send nothing before it is dropped (default 30) */
    int max_tokens_default;  /* when a request names none (default 16, as OpenAI's completions) */
    const char *chat_template; /* in place of the model's: a template (JSON), a family name
                                * (kiln_chat_template_named) or a file holding one; NULL: the model's */
    kiln_engine_opts engine;
    kiln_request_log_fn log_request; /* one call per finished request; NULL (default): none */
    void *log_user;                  /* log_request's user */
} kiln_server_opts;

kiln_server_opts kiln_server_opts_default(void);

typedef struct kiln_server kiln_server_t;

/* A server with these options, not yet listening: kiln_server_load then
 * kiln_server_listen, so that nothing answers before the model is known to load (what
 * `kiln serve` does). Errors: an option out of range (KILN_ERR_ARG). */
kiln_status kiln_server_new(const kiln_server_opts *o, kiln_server_t **out);
/* Binds host:port and starts answering. A port in use is KILN_ERR_IO saying so. */
kiln_status kiln_server_listen(kiln_server_t *s);
/* kiln_server_new and kiln_server_listen at once: /health answers 503 until a model is
 * loaded. */
kiln_status kiln_server_start(const kiln_server_opts *o, kiln_server_t **out);
int kiln_server_port(const kiln_server_t *s);
/* Loads a checkpoint (a run folder or model.safetensors, as `kiln sample` takes), its
 * tokenizer and chat template, and starts serving it; /health then answers 200. */
kiln_status kiln_server_load(kiln_server_t *s, const char *model_path);
/* Stops listening, cancels what is running, frees. */
void kiln_server_free(kiln_server_t *s);
/* The version of libmicrohttpd the server runs on ("0.9.75"), for kiln doctor. */
const char *kiln_server_http_version(void);

#ifdef __cplusplus
}
#endif
#endif
