/* The HTTP side: responses, the route table, and the callbacks libmicrohttpd calls
 * for each request. A route is a row of data (path, method, what it needs, handler);
 * the request handler collects the body, then walks the row's needs in order (method,
 * API key, a loaded model, a JSON body) and calls the handler. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "core/parse.h"
#include "serve/page.h"
#include "serve/server_impl.h"

/* ---- responses ---- */

enum MHD_Result kiln__serve_send_buf(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *type,
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
    kiln__serve_count_request(s, ep, code);
    return ok;
}

enum MHD_Result kiln__serve_send_json(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, json_t *o)
{
    char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!t) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        return kiln__serve_send_buf(s, c, ep, 500, "application/json", oom, sizeof oom - 1, false, NULL);
    }
    enum MHD_Result r = kiln__serve_send_buf(s, c, ep, code, "application/json", t, strlen(t), true, NULL);
    free(t);
    return r;
}

static const char *error_type(int code)
{
    return code == 401 ? "authentication_error" : code == 404 ? "not_found_error" : code == 429 ? "rate_limit_error"
         : code >= 500 ? "server_error" : "invalid_request_error";
}

enum MHD_Result kiln__serve_send_error(kiln_server_t *s, struct MHD_Connection *c, int ep, int code, const char *param,
                                       const char *err_code, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char *t = kiln__oai_error_json(msg, error_type(code), param, err_code);
    if (!t) return kiln__serve_send_json(s, c, ep, 500, NULL);
    enum MHD_Result r = kiln__serve_send_buf(s, c, ep, code, "application/json", t, strlen(t), true, code == 429 ? "1" : NULL);
    free(t);
    return r;
}

/* A CORS preflight, on any path. */
static enum MHD_Result preflight(kiln_server_t *s, struct MHD_Connection *conn, int ep)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", s->cors);
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", "Authorization, Content-Type");
    MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    enum MHD_Result ok = MHD_queue_response(conn, 204, r);
    MHD_destroy_response(r);
    kiln__serve_count_request(s, ep, 204);
    return ok;
}

static enum MHD_Result page(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    return kiln__serve_send_buf(s, conn, cs->endpoint, 200, "text/html; charset=utf-8", kiln__page_html,
                                kiln__page_html_len, false, NULL);
}

static enum MHD_Result health(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    bool up = atomic_load(&s->loaded);
    static const char ok[] = "{\"status\":\"ok\"}", loading[] = "{\"status\":\"loading\"}";
    return kiln__serve_send_buf(s, conn, cs->endpoint, up ? 200 : 503, "application/json", up ? ok : loading,
                                up ? sizeof ok - 1 : sizeof loading - 1, false, NULL);
}

/* ---- the routes ---- */

/* What a route needs of a request before its handler runs, checked in this order. */
enum {
    NEEDS_POST = 1 << 0,   /* the method is POST; without it, GET or HEAD (else 405) */
    NEEDS_KEY = 1 << 1,    /* the API key, when the server has one (else 401) */
    NEEDS_MODEL = 1 << 2,  /* a loaded model (else 503) */
    NEEDS_JSON = 1 << 3,   /* Content-Type: application/json (else 415) */
};

typedef struct {
    const char *path, *alias; /* alias: a second path to the same endpoint, or NULL */
    unsigned needs;
    kiln__serve_handler handler;
} route;

/* Indexed by endpoint. /health, /metrics and the page answer without the API key, and
 * the first two while the model loads. */
static const route routes[] = {
    [EP_COMPLETIONS] = {.path = "/v1/completions", .needs = NEEDS_POST | NEEDS_KEY | NEEDS_MODEL | NEEDS_JSON,
                        .handler = kiln__serve_completions},
    [EP_CHAT] = {.path = "/v1/chat/completions", .needs = NEEDS_POST | NEEDS_KEY | NEEDS_MODEL | NEEDS_JSON,
                 .handler = kiln__serve_chat_completions},
    [EP_MODELS] = {.path = "/v1/models", .needs = NEEDS_KEY | NEEDS_MODEL, .handler = kiln__serve_models},
    [EP_HEALTH] = {.path = "/health", .needs = 0, .handler = health},
    [EP_METRICS] = {.path = "/metrics", .needs = 0, .handler = kiln__serve_metrics},
    [EP_TOKENIZE] = {.path = "/tokenize", .needs = NEEDS_POST | NEEDS_KEY | NEEDS_MODEL | NEEDS_JSON,
                     .handler = kiln__serve_tokenize},
    [EP_DETOKENIZE] = {.path = "/detokenize", .needs = NEEDS_POST | NEEDS_KEY | NEEDS_MODEL | NEEDS_JSON,
                       .handler = kiln__serve_detokenize},
    [EP_PAGE] = {.path = "/", .alias = "/index.html", .needs = 0, .handler = page},
    [EP_PROPS] = {.path = "/v1/kiln/props", .needs = NEEDS_KEY | NEEDS_MODEL, .handler = kiln__serve_props},
};
_Static_assert(sizeof routes / sizeof routes[0] == EP_OTHER, "one route per endpoint");

const char *kiln__serve_endpoint_name(int ep)
{
    return ep >= 0 && ep < EP_OTHER ? routes[ep].path : "other";
}

static int endpoint_of(const char *url)
{
    for (int e = 0; e < EP_OTHER; e++)
        if (!strcmp(url, routes[e].path) || (routes[e].alias && !strcmp(url, routes[e].alias))) return e;
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

static enum MHD_Result route_request(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs, const char *url,
                                     const char *method)
{
    int ep = cs->endpoint;
    if (!strcmp(method, "OPTIONS")) return preflight(s, conn, ep);
    if (ep == EP_OTHER)
        return kiln__serve_send_error(s, conn, ep, 404, NULL, "not_found", "no endpoint %s %s", method, url);
    const route *r = &routes[ep];
    bool post = r->needs & NEEDS_POST;
    if (post ? strcmp(method, "POST") : strcmp(method, "GET") && strcmp(method, "HEAD"))
        return kiln__serve_send_error(s, conn, ep, 405, NULL, "method_not_allowed", "%s takes %s, not %s", url,
                                      post ? "POST" : "GET", method);
    if ((r->needs & NEEDS_KEY) && !authorized(s, conn))
        return kiln__serve_send_error(s, conn, ep, 401, NULL, "invalid_api_key",
                                      "missing or wrong API key (Authorization: Bearer KEY)");
    if ((r->needs & NEEDS_MODEL) && !atomic_load(&s->loaded))
        return kiln__serve_send_error(s, conn, ep, 503, NULL, "loading", "the model is still loading");
    if ((r->needs & NEEDS_JSON) && !is_json(conn))
        return kiln__serve_send_error(s, conn, ep, 415, NULL, "unsupported_media_type",
                                      "POST %s needs Content-Type: application/json", url);
    return r->handler(s, conn, cs);
}

/* ---- the callbacks ---- */

enum MHD_Result kiln__serve_on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                       const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    kiln_server_t *s = cls;
    conn_state *cs = *con_cls;
    if (!cs || !cs->seen) {
        if (!cs) { /* (kiln__serve_on_uri makes it, memory allowing) */
            if (!(cs = calloc(1, sizeof *cs))) return MHD_NO;
            cs->t_start = kiln__now_s();
        }
        *con_cls = cs;
        cs->seen = true;
        cs->endpoint = endpoint_of(url);
        if (s->o.log_request) {
            size_t n = strlen(method);
            cs->method_cut = n > sizeof cs->method - 1;
            memcpy(cs->method, method, cs->method_cut ? sizeof cs->method - 1 : n);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        int64_t n = 0;
        /* core/parse.h's strict reading: "12abc", "-1", " 5", "0x10" or a count past int64 is a 400 */
        if (cl && kiln__parse_i64(cl, 0, INT64_MAX, "Content-Length", &n) != KILN_OK) {
            char why[256];
            snprintf(why, sizeof why, "%s", kiln_last_error());
            cs->answered = true;
            return kiln__serve_send_error(s, conn, cs->endpoint, 400, NULL, NULL, "%s", why);
        }
        if (cl && (uint64_t)n > s->o.max_body) { /* refuse before reading the body */
            cs->answered = true;
            return kiln__serve_send_error(s, conn, cs->endpoint, 413, NULL, "body_too_large",
                                          "the request body of %s bytes is over the limit of %zu", cl, s->o.max_body);
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
            if (!kiln__reserve(&cs->body, &cs->cap, cs->len + *upload_size + 1, 4096)) return MHD_NO;
            memcpy(cs->body + cs->len, upload, *upload_size);
            cs->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cs->j && !cs->j->stream) { /* resumed: the engine is done with a non-streamed request */
        pthread_mutex_lock(&cs->j->mu);
        bool done = cs->j->done;
        if (!done) kiln__serve_job_suspend(cs->j);
        pthread_mutex_unlock(&cs->j->mu);
        if (!done) return MHD_YES;
        return kiln__serve_finish_plain(s, conn, cs);
    }
    if (cs->answered) return MHD_YES;
    cs->answered = true;
    if (cs->too_big)
        return kiln__serve_send_error(s, conn, cs->endpoint, 413, NULL, "body_too_large",
                                      "the request body is over the limit of %zu bytes", s->o.max_body);
    return route_request(s, conn, cs, url, method);
}

/* The connection is done with this request: it answered, or the client went away. */
void kiln__serve_on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    conn_state *cs = *con_cls;
    if (!cs) return;
    kiln__serve_log_request(cls, conn, cs);
    if (cs->j) {
        job *j = cs->j;
        pthread_mutex_lock(&j->mu);
        j->conn = NULL;
        kiln__serve_job_cancel(j);
        pthread_mutex_unlock(&j->mu);
        kiln__serve_job_unref(j);
    }
    free(cs->body);
    free(cs->target);
    free(cs);
    *con_cls = NULL;
}
