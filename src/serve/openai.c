/* The OpenAI request format, checked field by field, and the client-side text of a
 * generation (UTF-8 repair, stop strings, what may be streamed yet). */
#include <jansson.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "kiln/serve.h" /* KILN_MAX_LOGPROBS */
#include "serve/openai.h"

/* ---- requests ---- */

typedef struct {
    char *err;
    size_t n_err;
    const char **param;
} ctx;

static int bad(ctx *c, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->n_err, fmt, ap);
    va_end(ap);
    *c->param = param;
    return 400;
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

enum { T_INT, T_NUM, T_NUM_OPEN /* (lo, hi] */, T_BOOL };

/* key's value into *out, an int, a double or a bool by type, a number within its range;
 * absent and null keep *out. */
static int get(ctx *c, json_t *o, const char *key, int type, double lo, double hi, void *out)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    bool open = type == T_NUM_OPEN, real = type == T_NUM || open;
    if (type == T_BOOL && !json_is_boolean(v)) return bad(c, key, "'%s' must be true or false", key);
    if (type == T_INT && !json_is_integer(v)) return bad(c, key, "'%s' must be an integer", key);
    if (real && !json_is_number(v)) return bad(c, key, "'%s' must be a number", key);
    long long i = json_integer_value(v);
    double x = json_number_value(v);
    if (type == T_INT && (i < lo || i > hi))
        return bad(c, key, "'%s' is %lld; it must be in [%lld, %lld]", key, i, (long long)lo, (long long)hi);
    if (real && (!(open ? x > lo : x >= lo) || !(x <= hi)))
        return bad(c, key, "'%s' is %g; it must be in %s%g, %g]", key, x, open ? "(" : "[", lo, hi);
    if (type == T_INT) *(int *)out = (int)i;
    else if (type == T_BOOL) *(bool *)out = json_is_true(v);
    else *(double *)out = x;
    return 0;
}

static int parse_prompt(ctx *c, json_t *v, kiln__oai_req *r)
{
    if (!v || json_is_null(v)) return bad(c, "prompt", "'prompt' is required");
    if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
        v = json_array_get(v, 0); /* a batch of one prompt */
    if (json_is_string(v)) {
        r->prompt_len = json_string_length(v);
        if (!(r->prompt = dup_n(json_string_value(v), r->prompt_len))) return bad(c, NULL, "out of memory");
        return 0;
    }
    if (json_is_array(v) && json_array_size(v) == 1 && json_is_array(json_array_get(v, 0)))
        v = json_array_get(v, 0); /* a batch of one token list */
    if (!json_is_array(v) || json_array_size(v) == 0)
        return bad(c, "prompt", "'prompt' must be a string, a list of one string, or a non-empty list of token ids");
    size_t n = json_array_size(v);
    if (n > (1u << 24)) return bad(c, "prompt", "'prompt' has %zu token ids", n);
    if (!(r->prompt_ids = malloc(sizeof(int32_t) * n))) return bad(c, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX)
            return bad(c, "prompt", "'prompt' item %zu is not a token id (a non-negative integer)", i);
        r->prompt_ids[i] = (int32_t)json_integer_value(e);
    }
    r->n_prompt_ids = (int)n;
    return 0;
}

/* content: a string, null, or a list of {"type": "text", "text": ...} parts. */
static int parse_content(ctx *c, json_t *v, size_t i, char **out)
{
    if (!v || json_is_null(v) || json_is_string(v)) {
        *out = json_is_string(v) ? dup_n(json_string_value(v), json_string_length(v)) : dup_n("", 0);
        return *out ? 0 : bad(c, NULL, "out of memory");
    }
    if (!json_is_array(v)) return bad(c, "messages", "messages[%zu].content must be a string or a list of text parts", i);
    size_t total = 0, k;
    json_t *p;
    json_array_foreach(v, k, p)
    {
        json_t *ty = json_object_get(p, "type"), *tx = json_object_get(p, "text");
        if (!json_is_object(p) || !json_is_string(ty) || strcmp(json_string_value(ty), "text") || !json_is_string(tx))
            return bad(c, "messages", "messages[%zu].content[%zu] must be {\"type\": \"text\", \"text\": ...}", i, k);
        total += json_string_length(tx);
    }
    if (!(*out = malloc(total + 1))) return bad(c, NULL, "out of memory");
    size_t o = 0;
    json_array_foreach(v, k, p)
    {
        json_t *tx = json_object_get(p, "text");
        memcpy(*out + o, json_string_value(tx), json_string_length(tx));
        o += json_string_length(tx);
    }
    (*out)[o] = '\0';
    return 0;
}

static int parse_messages(ctx *c, json_t *v, kiln__oai_req *r)
{
    if (!v || json_is_null(v)) return bad(c, "messages", "'messages' is required");
    if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > 4096)
        return bad(c, "messages", "'messages' must be a list of 1 to 4096 messages");
    size_t n = json_array_size(v);
    if (!(r->msgs = calloc(n, sizeof *r->msgs))) return bad(c, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i), *role = json_object_get(m, "role");
        if (!json_is_object(m)) return bad(c, "messages", "messages[%zu] must be an object", i);
        if (!json_is_string(role) || json_string_length(role) == 0 || json_string_length(role) > 64)
            return bad(c, "messages", "messages[%zu].role must be a non-empty string", i);
        if (!kiln__chat_role_known(json_string_value(role)))
            return bad(c, "messages", "messages[%zu].role '%.64s' is not one of system, developer, user, assistant, "
                       "tool and function", i, json_string_value(role));
        r->n_msgs = (int)i + 1;
        if (!(r->msgs[i].role = dup_n(json_string_value(role), json_string_length(role)))) return bad(c, NULL, "out of memory");
        int s = parse_content(c, json_object_get(m, "content"), i, &r->msgs[i].content);
        if (s) return s;
    }
    return 0;
}

static int parse_stop(ctx *c, json_t *v, kiln__oai_req *r)
{
    if (!v || json_is_null(v)) return 0;
    bool list = json_is_array(v);
    size_t n = list ? json_array_size(v) : 1;
    if (n > 4) return bad(c, "stop", "'stop' has %zu strings; at most 4", n);
    for (size_t i = 0; i < n; i++) {
        json_t *e = list ? json_array_get(v, i) : v;
        if (!json_is_string(e) || json_string_length(e) == 0 || json_string_length(e) > 256)
            return bad(c, "stop", "'stop' must be a string or a list of up to 4 non-empty strings");
        if (!(r->stop[r->n_stop] = dup_n(json_string_value(e), json_string_length(e)))) return bad(c, NULL, "out of memory");
        r->n_stop++;
    }
    return 0;
}

/* logit_bias: {"token id": bias, ...}, ids as decimal strings (OpenAI's form), biases in
 * -100..100; at most 1024 of them. Whether each id is in the vocabulary is the engine's
 * check (it knows the vocabulary). */
static int parse_logit_bias(ctx *c, json_t *v, kiln__oai_req *r)
{
    if (!v || json_is_null(v)) return 0;
    if (!json_is_object(v)) return bad(c, "logit_bias", "'logit_bias' must be an object of token ids to biases");
    size_t n = json_object_size(v);
    if (n > 1024) return bad(c, "logit_bias", "'logit_bias' holds more than 1024 tokens");
    r->bias_ids = malloc(sizeof *r->bias_ids * (n ? n : 1));
    r->bias_vals = malloc(sizeof *r->bias_vals * (n ? n : 1));
    if (!r->bias_ids || !r->bias_vals) return bad(c, NULL, "out of memory");
    const char *k;
    json_t *b;
    json_object_foreach(v, k, b)
    {
        char *end = NULL; /* (digits only: strtol alone would take " 5" and "+5") */
        long id = k[0] >= '0' && k[0] <= '9' ? strtol(k, &end, 10) : -1;
        if (id < 0 || *end || id > INT32_MAX || (k[0] == '0' && k[1]))
            return bad(c, "logit_bias", "'logit_bias' keys must be token ids (decimal integers)");
        if (!json_is_number(b) || !(json_number_value(b) >= -100 && json_number_value(b) <= 100))
            return bad(c, "logit_bias", "'logit_bias' values must be numbers from -100 to 100");
        r->bias_ids[r->n_bias] = (int32_t)id;
        r->bias_vals[r->n_bias++] = (float)json_number_value(b);
    }
    return 0;
}

static int parse_object(ctx *c, json_t *o, bool chat, kiln__oai_req *r)
{
    json_t *v = json_object_get(o, "model");
    if (v && !json_is_null(v)) {
        if (!json_is_string(v)) return bad(c, "model", "'model' must be a string");
        if (!(r->model = dup_n(json_string_value(v), json_string_length(v)))) return bad(c, NULL, "out of memory");
    }
    int s = chat ? parse_messages(c, json_object_get(o, "messages"), r) : parse_prompt(c, json_object_get(o, "prompt"), r);
    if (s) return s;
    const double max_tok = 1 << 24;
    if ((s = get(c, o, "max_tokens", T_INT, 1, max_tok, &r->max_tokens))) return s;
    if (chat && (s = get(c, o, "max_completion_tokens", T_INT, 1, max_tok, &r->max_tokens))) return s;
    if ((s = get(c, o, "temperature", T_NUM, 0, 2, &r->temperature))) return s;
    if ((s = get(c, o, "top_p", T_NUM_OPEN, 0, 1, &r->top_p))) return s;
    if ((s = get(c, o, "top_k", T_INT, 0, 1 << 24, &r->top_k))) return s;
    if ((s = get(c, o, "min_p", T_NUM, 0, 1, &r->min_p))) return s;
    if ((s = get(c, o, "presence_penalty", T_NUM, -2, 2, &r->presence_penalty))) return s;
    if ((s = get(c, o, "frequency_penalty", T_NUM, -2, 2, &r->frequency_penalty))) return s;
    if ((s = get(c, o, "repetition_penalty", T_NUM, 0, 100, &r->repetition_penalty))) return s;
    if ((s = parse_logit_bias(c, json_object_get(o, "logit_bias"), r))) return s;
    if ((s = get(c, o, "n", T_INT, 1, KILN__MAX_N, &r->n))) return s;
    if ((s = parse_stop(c, json_object_get(o, "stop"), r))) return s;
    v = json_object_get(o, "seed");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v)) return bad(c, "seed", "'seed' must be an integer");
        r->has_seed = true;
        r->seed = (uint64_t)json_integer_value(v);
    }
    if ((s = get(c, o, "stream", T_BOOL, 0, 0, &r->stream))) return s;
    v = json_object_get(o, "stream_options");
    if (v && !json_is_null(v)) {
        if (!json_is_object(v)) return bad(c, "stream_options", "'stream_options' must be an object");
        json_t *iu = json_object_get(v, "include_usage");
        if (iu && !json_is_null(iu) && !json_is_boolean(iu))
            return bad(c, "stream_options", "'stream_options.include_usage' must be true or false");
        r->include_usage = json_is_true(iu);
    }
    if (chat && (s = get(c, o, "parse_special", T_BOOL, 0, 0, &r->parse_special))) return s;
    if (chat) {
        bool lp = false;
        int top = 0;
        if ((s = get(c, o, "logprobs", T_BOOL, 0, 0, &lp))) return s;
        if ((s = get(c, o, "top_logprobs", T_INT, 0, KILN_MAX_LOGPROBS, &top))) return s;
        r->logprobs = lp ? top : -1;
    } else {
        if ((s = get(c, o, "logprobs", T_INT, 0, KILN_MAX_LOGPROBS, &r->logprobs))) return s;
    }
    return 0;
}

int kiln__oai_parse(const char *body, size_t len, bool chat, kiln__oai_req *r, char *err, size_t n_err,
                    const char **param)
{
    memset(r, 0, sizeof *r);
    r->chat = chat;
    r->max_tokens = -1;
    r->temperature = 1.0;
    r->top_p = 1.0;
    r->n = 1;
    r->logprobs = -1;
    *param = NULL;
    ctx c = {err, n_err, param};
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", body ? len : 0, JSON_REJECT_DUPLICATES, &je);
    if (!o) return bad(&c, NULL, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    int s = json_is_object(o) ? parse_object(&c, o, chat, r) : bad(&c, NULL, "the body must be a JSON object");
    json_decref(o);
    return s;
}

void kiln__oai_free(kiln__oai_req *r)
{
    if (!r) return;
    KILN__FREE(r->model, r->prompt, r->prompt_ids, r->bias_ids, r->bias_vals);
    for (int i = 0; i < r->n_msgs; i++) {
        free(r->msgs[i].role);
        free(r->msgs[i].content);
    }
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

char *kiln__oai_error_json(const char *message, const char *type, const char *param, const char *code)
{
    message = message ? message : "";
    /* A message may quote the client (a path, percent-decoded to any bytes), and JSON
     * strings are UTF-8: where it is not, its bytes past ASCII become '?' rather than
     * the whole answer failing */
    char *ascii = NULL;
    json_t *m = json_string(message);
    if (!m && (ascii = strdup(message))) {
        for (char *c = ascii; *c; c++)
            if ((unsigned char)*c >= 0x80) *c = '?';
        m = json_string(ascii);
    }
    free(ascii);
    json_t *o = m ? json_pack("{s:{s:o,s:s,s:s?,s:s?}}", "error", "message", m, "type",
                              type ? type : "invalid_request_error", "param", param, "code", code)
                  : NULL;
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* ---- the text of a generation ---- */

void kiln__textstream_init(kiln__textstream *ts, const char *const *stop, int n_stop)
{
    memset(ts, 0, sizeof *ts);
    ts->stop = stop;
    ts->n_stop = n_stop;
}

void kiln__textstream_free(kiln__textstream *ts)
{
    free(ts->bytes);
    free(ts->text);
    memset(ts, 0, sizeof *ts);
}

bool kiln__textstream_push(kiln__textstream *ts, const char *bytes, size_t n)
{
    if (!kiln__reserve(&ts->bytes, &ts->cap_bytes, ts->n_bytes + n + 1, 64)) return false;
    memcpy(ts->bytes + ts->n_bytes, bytes, n);
    ts->n_bytes += n;
    return true;
}

/* The length of the UTF-8 character starting at s[0..n) (1..4), 0 when it is cut off
 * at n but valid so far, -1 when it is invalid (then one byte is replaced). */
static int utf8_char(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    int len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : -1;
    if (len < 0 || c == 0xC0 || c == 0xC1 || c > 0xF4) return -1;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return 0;
        unsigned d = s[i];
        if ((d & 0xC0) != 0x80) return -1;
        /* overlong, surrogate and past-U+10FFFF forms, caught at the second byte */
        if (i == 1 && ((c == 0xE0 && d < 0xA0) || (c == 0xED && d > 0x9F) || (c == 0xF0 && d < 0x90) ||
                       (c == 0xF4 && d > 0x8F)))
            return -1;
    }
    return len;
}

/* ts->text = bytes as valid UTF-8 (NUL and invalid bytes become U+FFFD); a trailing
 * cut-off character is left out unless end. */
static bool repair(kiln__textstream *ts, bool end)
{
    if (!kiln__reserve(&ts->text, &ts->cap_text, ts->n_bytes * 3 + 4, 64)) return false;
    const unsigned char *b = (const unsigned char *)ts->bytes;
    size_t i = 0, o = 0;
    while (i < ts->n_bytes) {
        int l = b[i] ? utf8_char(b + i, ts->n_bytes - i) : -1;
        if (l == 0 && !end) break;
        if (l > 0) {
            memcpy(ts->text + o, b + i, (size_t)l);
            o += (size_t)l;
            i += (size_t)l;
        } else { /* invalid, or cut off at the end */
            memcpy(ts->text + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i += 1;
            if (l == 0) {
                /* a cut-off character at the very end counts as one replacement */
                while (i < ts->n_bytes && (b[i] & 0xC0) == 0x80) i++;
            }
        }
    }
    ts->text[o] = '\0';
    ts->n_text = o;
    return true;
}

void kiln__textstream_take(kiln__textstream *ts, bool end, size_t *from, size_t *len)
{
    *from = ts->emitted;
    *len = 0;
    if (ts->stopped) return;
    if (!repair(ts, end)) return; /* out of memory: nothing more becomes final */
    /* The earliest stop string, searched where a new one could start. */
    size_t maxl = 0;
    for (int k = 0; k < ts->n_stop; k++) maxl = strlen(ts->stop[k]) > maxl ? strlen(ts->stop[k]) : maxl;
    size_t start = ts->emitted > maxl ? ts->emitted - maxl : 0, cut = ts->n_text;
    for (int k = 0; k < ts->n_stop; k++) {
        size_t l = strlen(ts->stop[k]);
        for (size_t i = start; i + l <= ts->n_text && i < cut; i++)
            if (!memcmp(ts->text + i, ts->stop[k], l)) {
                cut = i;
                ts->stopped = true;
                break;
            }
    }
    size_t safe = cut;
    if (!ts->stopped && !end) {
        /* Hold back a tail that is the start of a stop string. */
        for (int k = 0; k < ts->n_stop; k++) {
            size_t l = strlen(ts->stop[k]);
            for (size_t h = l - 1; h > 0; h--)
                if (h <= ts->n_text && ts->n_text - h < safe && !memcmp(ts->text + ts->n_text - h, ts->stop[k], h)) {
                    safe = ts->n_text - h;
                    break;
                }
        }
    }
    if (safe < ts->emitted) safe = ts->emitted; /* never take back what was sent */
    *len = safe - ts->emitted;
    ts->emitted = safe;
    if (ts->stopped) ts->n_text = safe;
}
