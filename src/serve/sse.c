/* The streamed response: server-sent events. The engine's callbacks append events to
 * the job's buffer (under j->mu) and resume the connection; MHD's reader takes what is
 * buffered, and with nothing there suspends the connection, so a streaming client
 * holds no thread while it waits for its next token. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "serve/server_impl.h"

/* Appends to the stream buffer. Under j->mu. */
static void emit(job *j, const char *s, size_t n)
{
    if (!kiln__reserve(&j->out, &j->out_cap, j->out_len + n, 4096)) return; /* out of memory: the piece is lost */
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
}

/* One event: "data: <t>" and a blank line. */
static void emit_data(job *j, const char *t)
{
    emit(j, "data: ", 6);
    emit(j, t, strlen(t));
    emit(j, "\n\n", 2);
}

static void emit_event(job *j, json_t *o)
{
    char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!t) return;
    emit_data(j, t);
    free(t);
}

void kiln__serve_sse_chunk(job *j, choice *c, const char *text, size_t len, const char *finish)
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
    int upto = kiln__serve_tokens_in_text(c, c->ts.emitted);
    if (finish) upto = kiln__serve_tokens_in_text(c, c->ts.n_text);
    if (j->req.logprobs >= 0 && upto > c->lp_sent) {
        json_object_set_new(ch, "logprobs", kiln__serve_logprobs_json(j, c, c->lp_sent, upto));
        c->lp_sent = upto;
    } else {
        json_object_set_new(ch, "logprobs", json_null());
    }
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    json_t *o = kiln__serve_chunk_json(j);
    json_object_set_new(o, "choices", json_pack("[o]", ch));
    if (j->req.include_usage) json_object_set_new(o, "usage", json_null());
    emit_event(j, o);
}

void kiln__serve_sse_end(job *j)
{
    char msg[600];
    int code = kiln__serve_job_failure(j, msg, sizeof msg);
    if (code) {
        char *t = kiln__oai_error_json(msg, "server_error", NULL, code == 504 ? "timeout" : NULL);
        if (t) {
            emit_data(j, t);
            free(t);
        }
    } else if (j->req.include_usage) {
        json_t *o = kiln__serve_chunk_json(j);
        json_object_set_new(o, "choices", json_array());
        json_object_set_new(o, "usage", kiln__serve_usage_json(j));
        emit_event(j, o);
    }
    emit(j, "data: [DONE]\n\n", 14);
    j->ended = true;
}

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
        kiln__serve_job_suspend(j);
        r = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return r;
}

static void stream_free(void *cls)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    kiln__serve_job_cancel(j);
    pthread_mutex_unlock(&j->mu);
    kiln__serve_job_unref(j);
}

enum MHD_Result kiln__serve_sse_respond(kiln_server_t *s, struct MHD_Connection *conn, int ep, job *j)
{
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, j, stream_free);
    if (!r) {
        pthread_mutex_lock(&j->mu);
        kiln__serve_job_cancel(j);
        pthread_mutex_unlock(&j->mu);
        return kiln__serve_send_error(s, conn, ep, 500, NULL, NULL, "out of memory");
    }
    pthread_mutex_lock(&j->mu);
    j->refs++; /* the response's */
    pthread_mutex_unlock(&j->mu);
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "Access-Control-Allow-Origin", s->cors);
    enum MHD_Result ok = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r);
    kiln__serve_count_request(s, ep, 200);
    return ok;
}
