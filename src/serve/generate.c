/* /v1/completions and /v1/chat/completions: a request is parsed (openai.c), its chat
 * messages rendered and its prompt tokenized, and one engine request is submitted per
 * choice (n) into a new job. A streamed answer is then sse.c's; a plain one waits with
 * its connection suspended until the engine's last callback resumes it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "serve/server_impl.h"

enum MHD_Result kiln__serve_finish_plain(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    job *j = cs->j;
    char msg[600];
    pthread_mutex_lock(&j->mu);
    int code = kiln__serve_job_failure(j, msg, sizeof msg);
    json_t *o = code ? NULL : kiln__serve_completion_json(j);
    pthread_mutex_unlock(&j->mu);
    if (!code) return kiln__serve_send_json(s, conn, cs->endpoint, 200, o);
    return kiln__serve_send_error(s, conn, cs->endpoint, code, NULL, code == 504 ? "timeout" : NULL, "%s", msg);
}

static uint64_t random_seed(kiln_server_t *s)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    pthread_mutex_lock(&s->mu);
    uint64_t x = (uint64_t)t.tv_nsec ^ ((uint64_t)t.tv_sec << 32) ^ (++s->next_id * 0x9e3779b97f4a7c15ULL);
    pthread_mutex_unlock(&s->mu);
    return kiln__splitmix64(x);
}

/* Answers the request with an error and frees what was made of it. */
#define FAIL(...)                                               \
    do {                                                        \
        res = kiln__serve_send_error(s, conn, ep, __VA_ARGS__); \
        goto fail;                                              \
    } while (0)

static enum MHD_Result generate(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs, bool chat)
{
    int ep = cs->endpoint;
    job *j = calloc(1, sizeof *j);
    if (!j) return kiln__serve_send_error(s, conn, ep, 500, NULL, NULL, "out of memory");
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
    if (st) FAIL(st, param, NULL, "%s", err);
    if (q->model && strcmp(q->model, s->name))
        FAIL(404, "model", "model_not_found", "The model '%s' does not exist; this server has '%s'", q->model, s->name);
    if (chat) {
        kiln_text_span *spans = malloc(sizeof *spans * (size_t)q->n_msgs);
        char *p = spans ? kiln__chat_render_spans(&s->tmpl, q->msgs, q->n_msgs, spans) : NULL;
        bool ok = p && kiln__serve_encode_plain(s, p, strlen(p), q->parse_special ? NULL : spans,
                                                q->parse_special ? 0 : q->n_msgs, &ids, &n_ids);
        free(p);
        free(spans);
        if (!ok) FAIL(500, NULL, NULL, "could not render or tokenize the messages: %s", kiln_last_error());
    } else if (q->prompt) {
        if (!kiln__serve_encode(s, q->prompt, q->prompt_len, &ids, &n_ids))
            FAIL(500, NULL, NULL, "could not tokenize the prompt: %s", kiln_last_error());
    } else {
        ids = q->prompt_ids;
        n_ids = q->n_prompt_ids;
        q->prompt_ids = NULL;
        for (int i = 0; i < n_ids; i++)
            if (ids[i] >= s->vocab)
                FAIL(400, "prompt", NULL, "prompt token %d is %d, outside the vocabulary of %d", i, ids[i], s->vocab);
    }
    /* a prompt of text starts with the start-of-text token where the model's tokenizer
     * says so (kiln_tokenizer_adds_bos), as transformers and llama.cpp tokenize it; ids
     * given as ids are taken as they are */
    if ((chat || q->prompt) && n_ids > 0 && kiln_tokenizer_adds_bos(s->tok) && ids[0] != kiln_tokenizer_bos(s->tok)) {
        int32_t *more = realloc(ids, sizeof *ids * (size_t)(n_ids + 1));
        if (!more) FAIL(500, NULL, NULL, "out of memory");
        ids = more;
        memmove(ids + 1, ids, sizeof *ids * (size_t)n_ids);
        ids[0] = kiln_tokenizer_bos(s->tok);
        n_ids++;
    }
    if (n_ids == 0) { /* an empty prompt starts a document (in the buffer the tokenizer left, if any) */
        int32_t *one = s->bos >= 0 ? realloc(ids, sizeof *ids) : NULL;
        if (!one) FAIL(400, chat ? "messages" : "prompt", NULL, "the prompt is empty");
        ids = one;
        ids[0] = s->bos;
        n_ids = 1;
    }
    int room = s->ctx - n_ids;
    int max_tokens = q->max_tokens;
    if (max_tokens < 0) max_tokens = chat ? room : (s->o.max_tokens_default < room ? s->o.max_tokens_default : room);
    if (room < 1 || max_tokens > room)
        FAIL(400, q->max_tokens < 0 ? (chat ? "messages" : "prompt") : "max_tokens", "context_length_exceeded",
             "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the prompt, "
             "%d for the completion).", s->ctx, n_ids + (max_tokens > 0 ? max_tokens : 0), n_ids,
             max_tokens > 0 ? max_tokens : 0);
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
                                           .seed = seed + (uint64_t)i, .min_p = q->min_p,
                                           .presence_penalty = q->presence_penalty,
                                           .frequency_penalty = q->frequency_penalty,
                                           .repetition_penalty = q->repetition_penalty, .bias_ids = q->bias_ids,
                                           .bias_vals = q->bias_vals, .n_bias = q->n_bias},
                              .logprobs = q->logprobs, .cb = kiln__serve_on_token, .user = &j->ch[i]};
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
    kiln__serve_job_track(j);
    if (sub == KILN_OK) kiln__serve_count_prompt(s, n_ids);
    if (sub != KILN_OK) {
        kiln__serve_job_cancel(j);
        /* The choices that never ran count as finished; the others end as cancelled. */
        j->n_done += j->n - submitted;
        if (submitted == 0) {
            j->done = true;
            atomic_store(&j->settled, true);
        }
        pthread_mutex_unlock(&j->mu);
        if (sub == KILN_ERR_BUSY)
            return kiln__serve_send_error(s, conn, ep, 429, NULL, "queue_full", "the server is busy (%s); retry shortly",
                                          kiln_last_error());
        return kiln__serve_send_error(s, conn, ep, 400, NULL, NULL, "%s", kiln_last_error());
    }
    if (j->stream) {
        pthread_mutex_unlock(&j->mu);
        return kiln__serve_sse_respond(s, conn, ep, j);
    }
    if (!j->done) kiln__serve_job_suspend(j); /* the engine's last callback resumes it */
    bool done = j->done;
    pthread_mutex_unlock(&j->mu);
    return done ? kiln__serve_finish_plain(s, conn, cs) : MHD_YES;

fail:
    free(ids);
    kiln__oai_free(&j->req);
    pthread_mutex_destroy(&j->mu);
    free(j);
    return res;
}
#undef FAIL

enum MHD_Result kiln__serve_completions(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    return generate(s, conn, cs, false);
}

enum MHD_Result kiln__serve_chat_completions(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    return generate(s, conn, cs, true);
}
