/* The JSON shapes of an answer, the same whether it is streamed or not: a choice's
 * logprobs (in the completions or the chat shape), the usage, a streamed chunk's
 * fields, and the whole non-streamed answer. */
#include <stdio.h>
#include <string.h>
#include "kiln/tokenizer.h"
#include "serve/server_impl.h"

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

json_t *kiln__serve_logprobs_json(job *j, choice *c, int from, int to)
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

int kiln__serve_tokens_in_text(const choice *c, size_t text_len)
{
    int k = 0;
    while (k < c->n_tok && c->tok_start[k] < text_len) k++;
    return k;
}

const char *kiln__serve_finish_reason(const choice *c)
{
    return c->finish == KILN_FINISH_LENGTH ? "length" : "stop";
}

json_t *kiln__serve_chunk_json(job *j)
{
    return json_pack("{s:s,s:s,s:I,s:s}", "id", j->id, "object", j->req.chat ? "chat.completion.chunk" : "text_completion",
                     "created", (json_int_t)j->created, "model", j->srv->name);
}

json_t *kiln__serve_usage_json(job *j)
{
    int gen = 0;
    for (int i = 0; i < j->n; i++) gen += j->ch[i].n_tok;
    return json_pack("{s:i,s:i,s:i}", "prompt_tokens", j->n_prompt, "completion_tokens", gen, "total_tokens",
                     j->n_prompt + gen);
}

json_t *kiln__serve_completion_json(job *j)
{
    json_t *choices = json_array();
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        json_t *ch = json_pack("{s:i}", "index", i);
        json_t *text = json_stringn(c->ts.text ? c->ts.text : "", c->ts.n_text);
        if (j->req.chat) json_object_set_new(ch, "message", json_pack("{s:s,s:o}", "role", "assistant", "content", text));
        else json_object_set_new(ch, "text", text);
        int upto = kiln__serve_tokens_in_text(c, c->ts.n_text);
        json_object_set_new(ch, "logprobs", j->req.logprobs >= 0 ? kiln__serve_logprobs_json(j, c, 0, upto) : json_null());
        json_object_set_new(ch, "finish_reason", json_string(kiln__serve_finish_reason(c)));
        json_array_append_new(choices, ch);
    }
    json_t *o = json_pack("{s:s,s:s,s:I,s:s}", "id", j->id, "object", j->req.chat ? "chat.completion" : "text_completion",
                          "created", (json_int_t)j->created, "model", j->srv->name);
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", kiln__serve_usage_json(j));
    return o;
}

