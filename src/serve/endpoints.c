/* The endpoints that answer from the model and its tokenizer alone, without the
 * engine: /v1/models, /v1/kiln/props, /tokenize and /detokenize. */
#include <limits.h>
#include <stdlib.h>
#include <time.h>
#include "kiln/tokenizer.h"
#include "serve/server_impl.h"

enum MHD_Result kiln__serve_models(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", s->name, "object", "model", "created", (json_int_t)time(NULL),
                          "owned_by", "kiln", "max_model_len", s->ctx);
    return kiln__serve_send_json(s, conn, cs->endpoint, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", m));
}

/* The chat template as its JSON object (kiln's format, docs/serve.md), rebuilt from the
 * parsed one so that it shows what the server renders with, whatever its source. */
static json_t *template_json(const kiln__chat_template *t)
{
    json_t *o = json_pack("{s:s,s:s,s:s}", "prefix", t->prefix ? t->prefix : "", "message", t->message ? t->message : "",
                          "generation", t->generation ? t->generation : "");
    json_t *roles = json_object(), *stop = json_array();
    for (int i = 0; i < t->n_roles; i++) json_object_set_new(roles, t->role[i], json_string(t->role_message[i]));
    for (int i = 0; i < t->n_stop; i++) json_array_append_new(stop, json_string(t->stop[i]));
    if (o && t->n_roles) json_object_set(o, "roles", roles);
    if (o) json_object_set(o, "stop", stop);
    json_decref(roles);
    json_decref(stop);
    return o;
}

/* kiln's own read-only facts for the page (and any client): the model, its context,
 * the default max_tokens, and the chat template with a short conversation rendered by
 * it, exactly as /v1/chat/completions would prompt the model. */
enum MHD_Result kiln__serve_props(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    static const kiln__chat_msg example[] = {
        {.role = "system", .content = "You are terse."},
        {.role = "user", .content = "Hello?"},
        {.role = "assistant", .content = "Hi."},
        {.role = "user", .content = "What is a kiln?"},
    };
    char *shown = kiln__chat_render(&s->tmpl, example, (int)(sizeof example / sizeof example[0]));
    json_t *msgs = json_array();
    for (size_t i = 0; i < sizeof example / sizeof example[0]; i++)
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", example[i].role, "content", example[i].content));
    json_t *o = shown ? json_pack("{s:s,s:i,s:i,s:o,s:{s:o,s:s}}", "model", s->name, "max_model_len", s->ctx,
                                  "max_tokens_default", s->o.max_tokens_default, "chat_template", template_json(&s->tmpl),
                                  "chat_template_example", "messages", msgs, "prompt", shown)
                      : (json_decref(msgs), NULL);
    free(shown);
    return kiln__serve_send_json(s, conn, cs->endpoint, 200, o);
}

bool kiln__serve_encode(kiln_server_t *s, const char *text, size_t len, int32_t **ids, int *n)
{
    return kiln__serve_encode_plain(s, text, len, NULL, 0, ids, n);
}

bool kiln__serve_encode_plain(kiln_server_t *s, const char *text, size_t len, const kiln_text_span *plain, int n_plain,
                              int32_t **ids, int *n)
{
    size_t got = 0;
    if (kiln_tokenizer_encode_plain_new(s->tok, text, len, plain, n_plain, 0, ids, &got) != KILN_OK) return false;
    if (got > INT_MAX) {
        free(*ids);
        *ids = NULL;
        kiln_error(KILN_ERR_ARG, "the text makes %zu tokens", got);
        return false;
    }
    *n = (int)got;
    return true;
}

enum MHD_Result kiln__serve_tokenize(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    json_error_t je;
    json_t *o = json_loadb(cs->body ? cs->body : "", cs->len, 0, &je), *p = json_object_get(o, "prompt");
    if (!p) p = json_object_get(o, "text");
    if (!json_is_string(p)) {
        json_decref(o);
        return kiln__serve_send_error(s, conn, cs->endpoint, 400, "prompt", NULL, "want {\"prompt\": \"text\"}%s%s",
                                      o ? "" : ": ", o ? "" : je.text);
    }
    int32_t *ids;
    int n;
    bool ok = kiln__serve_encode(s, json_string_value(p), json_string_length(p), &ids, &n);
    json_decref(o);
    if (!ok)
        return kiln__serve_send_error(s, conn, cs->endpoint, 500, NULL, NULL, "could not tokenize: %s", kiln_last_error());
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    free(ids);
    return kiln__serve_send_json(s, conn, cs->endpoint, 200,
                                 json_pack("{s:o,s:i,s:i}", "tokens", a, "count", n, "max_model_len", s->ctx));
}

enum MHD_Result kiln__serve_detokenize(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    json_error_t je;
    json_t *o = json_loadb(cs->body ? cs->body : "", cs->len, 0, &je), *t = json_object_get(o, "tokens");
    size_t n = json_array_size(t);
    if (!json_is_array(t)) {
        json_decref(o);
        return kiln__serve_send_error(s, conn, cs->endpoint, 400, "tokens", NULL, "want {\"tokens\": [ids]}%s%s",
                                      o ? "" : ": ", o ? "" : je.text);
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
            return kiln__serve_send_error(s, conn, cs->endpoint, 400, "tokens", NULL,
                                          "tokens[%zu] is not a token id in [0, %d)", i, s->vocab);
        }
        kiln__textstream_push(&ts, b, len);
    }
    json_decref(o);
    size_t from, len;
    kiln__textstream_take(&ts, true, &from, &len);
    json_t *r = json_pack("{s:s%}", "prompt", ts.text ? ts.text : "", ts.n_text);
    kiln__textstream_free(&ts);
    return kiln__serve_send_json(s, conn, cs->endpoint, 200, r);
}
