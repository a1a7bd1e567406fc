/* The endpoints that answer from the model and its tokenizer alone, without the
 * engine: /v1/models, /tokenize and /detokenize. */
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
