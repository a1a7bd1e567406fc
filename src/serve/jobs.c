/* A generation's job: what the engine's callbacks produce for one HTTP request, with
 * one engine request per choice. The job is reference-counted (the connection, the
 * streamed response, and each engine request hold one) because the HTTP side and the
 * engine side end in either order. A watchdog thread cancels jobs past the request
 * timeout. A client that goes away is noticed when its connection is next written to
 * (MHD does not watch suspended sockets), that is at its next token, and its engine
 * requests are cancelled then. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kiln/tokenizer.h"
#include "serve/server_impl.h"

void kiln__serve_job_unref(job *j)
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
        KILN__FREE(c->tok, c->tok_start, c->lp, c->top_ids, c->top_lp);
    }
    kiln__oai_free(&j->req);
    free(j->out);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

void kiln__serve_job_track(job *j)
{
    kiln_server_t *s = j->srv;
    pthread_mutex_lock(&s->mu);
    j->next = s->jobs;
    s->jobs = j;
    pthread_mutex_unlock(&s->mu);
}

void kiln__serve_job_cancel(job *j)
{
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].submitted && !j->ch[i].finished) kiln_engine_cancel(j->srv->engine, j->ch[i].engine_id);
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

void kiln__serve_job_suspend(job *j)
{
    j->suspended = true;
    MHD_suspend_connection(j->conn);
    pthread_mutex_lock(&j->srv->mu);
    j->srv->n_suspended++;
    pthread_mutex_unlock(&j->srv->mu);
}

/* Whether a choice failed: an engine error, or cancelled before a stop string ended it. */
static bool choice_failed(const choice *c)
{
    return c->finish == KILN_FINISH_ERROR || (c->finish == KILN_FINISH_CANCELLED && !c->ts.stopped);
}

int kiln__serve_job_failure(job *j, char *msg, size_t n)
{
    bool failed = false;
    for (int i = 0; i < j->n; i++) failed |= choice_failed(&j->ch[i]);
    if (!failed) return 0;
    if (atomic_load(&j->timed_out)) {
        snprintf(msg, n, "the request ran past the server's timeout of %g s", j->srv->o.request_timeout);
        return 504;
    }
    char e[512];
    kiln_engine_last_error(j->srv->engine, e, sizeof e);
    snprintf(msg, n, "generation stopped: %s", *e ? e : "the server is shutting down");
    return *e ? 500 : 503;
}

/* How choice c ended, for the request log; NULL for one that never ran. */
static const char *choice_end(job *j, const choice *c)
{
    if (!c->submitted) return NULL;
    if (!c->finished) return "cancelled"; /* still running when its connection ended: the client left */
    if (c->finish == KILN_FINISH_ERROR) return "error";
    if (choice_failed(c)) return atomic_load(&j->timed_out) ? "timeout" : "cancelled";
    return kiln__serve_finish_reason(c);
}

void kiln__serve_job_outcome(job *j, char *buf, size_t n, int *prompt, int *completion)
{
    /* A request that failed is its failure, the worst of its choices' (an error, then a
     * timeout, then a cancellation); else its choices' finish reasons, each once, in the
     * order of the choices. */
    static const char *const failures[] = {"error", "timeout", "cancelled"};
    bool ran = false;
    int gen = 0, worst = 3;
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0; i < j->n; i++) {
        ran |= j->ch[i].submitted;
        gen += j->ch[i].n_tok;
        const char *e = choice_end(j, &j->ch[i]);
        for (int f = 0; e && f < worst; f++)
            if (!strcmp(e, failures[f])) worst = f;
        bool have = false;
        for (int p = 0; p < i && e && !have; p++) {
            const char *q = choice_end(j, &j->ch[p]);
            have = q && !strcmp(q, e);
        }
        if (e && !have && k + strlen(e) + 2 <= n) k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? "," : "", e);
    }
    if (worst < 3) snprintf(buf, n, "%s", failures[worst]);
    else if (!k) snprintf(buf, n, "-");
    *prompt = ran ? j->n_prompt : 0;
    *completion = gen;
}

static bool grow_tokens(job *j, choice *c)
{
    if (c->n_tok < c->cap_tok) return true;
    int cap = c->cap_tok ? c->cap_tok * 2 : 64;
    size_t top = (size_t)cap * (size_t)j->n_top;
    void *tmp;
    if (!KILN__RESIZE(c->tok, cap, tmp) || !KILN__RESIZE(c->tok_start, cap, tmp) || !KILN__RESIZE(c->lp, cap, tmp) ||
        (top && (!KILN__RESIZE(c->top_ids, top, tmp) || !KILN__RESIZE(c->top_lp, top, tmp))))
        return false;
    c->cap_tok = cap;
    return true;
}

/* The engine's callback, on the engine's thread. */
bool kiln__serve_on_token(void *user, const kiln_token_event *ev, kiln_finish fin)
{
    choice *c = user;
    job *j = c->j;
    kiln_server_t *s = j->srv;
    pthread_mutex_lock(&j->mu);
    bool go = true;
    if (ev) {
        /* past --timeout: cancelled here, at the token, as the watchdog would at its next look (every
         * 0.1 s), so that a short timeout is kept however fast the tokens come */
        if (!atomic_load(&j->timed_out) && kiln__now_s() - j->t_start > s->o.request_timeout &&
            !atomic_exchange(&j->timed_out, true))
            kiln__serve_job_cancel(j);
        if (!j->first_token) {
            j->first_token = true;
            kiln__serve_count_ttft(s, kiln__now_s() - j->t_start);
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
                kiln__serve_sse_chunk(j, c, c->ts.text + from, len, NULL);
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
        if (j->stream && !choice_failed(c)) {
            kiln__serve_sse_chunk(j, c, c->ts.text + from, len, kiln__serve_finish_reason(c));
            j->sent_role = true;
        }
        if (++j->n_done == j->n) {
            j->done = true;
            if (j->stream) kiln__serve_sse_end(j);
            atomic_store(&j->settled, true);
        }
    }
    wake(j);
    pthread_mutex_unlock(&j->mu);
    if (!ev) kiln__serve_job_unref(j); /* the engine's reference */
    return go;
}

/* The realtime clock ms milliseconds from now, for pthread_cond_timedwait. */
static struct timespec deadline_in_ms(long ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_nsec += ms * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

void *kiln__serve_watchdog_main(void *arg)
{
    kiln_server_t *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        struct timespec t = deadline_in_ms(100);
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

/* Whether every job has had all its engine callbacks. Under s->mu. */
static bool jobs_settled(kiln_server_t *s)
{
    for (job *j = s->jobs; j; j = j->next)
        if (!atomic_load(&j->settled)) return false;
    return true;
}

void kiln__serve_jobs_stop(kiln_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->watchdog_started) pthread_join(s->watchdog, NULL);
    s->watchdog_started = false;
    /* Cancel what runs: each final callback ends its stream and resumes its connection.
     * MHD must not be stopped with a connection suspended, so wait (bounded) for them;
     * the engine stays alive until MHD is stopped, since closing a stream cancels. No
     * connection suspended is not enough: a stream's connection, resumed by one choice's
     * callback, suspends again while the job has more to come, so the wait is also for
     * every job to have had all its callbacks (a job done suspends no more). */
    pthread_mutex_lock(&s->mu);
    for (job *j = s->jobs; j && s->engine; j = j->next)
        for (int i = 0; i < j->n; i++)
            if (j->ch[i].submitted) kiln_engine_cancel(s->engine, j->ch[i].engine_id);
    for (int i = 0; i < 100 && (s->n_suspended > 0 || !jobs_settled(s)); i++) {
        struct timespec t = deadline_in_ms(50);
        pthread_cond_timedwait(&s->cv, &s->mu, &t);
    }
    pthread_mutex_unlock(&s->mu);
}
