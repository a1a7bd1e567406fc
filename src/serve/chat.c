/* Chat templates: the default one that kiln train stores with a checkpoint, and the
 * rendering of a conversation into a prompt (the format is in kiln/serve.h). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "kiln/serve.h"
#include "serve/openai.h"

const char *kiln_chat_template_default(void)
{
    return "{\"message\": \"{role}: {content}\\n\", \"generation\": \"assistant:\", "
           "\"stop\": [\"\\nuser:\", \"\\nsystem:\"]}";
}

/* The Hugging Face families, in kiln's format: ChatML (Qwen and many others), LLaMA-3
 * and Mistral (its assistant turns close with </s>, its user and system turns are
 * [INST] blocks). */
static const struct {
    const char *name, *marker, *json;
} families[] = {
    {"chatml", "<|im_start|>",
     "{\"message\": \"<|im_start|>{role}\\n{content}<|im_end|>\\n\", \"generation\": \"<|im_start|>assistant\\n\", "
     "\"stop\": [\"<|im_end|>\"]}"},
    {"llama3", "<|start_header_id|>",
     "{\"prefix\": \"<|begin_of_text|>\", \"message\": \"<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}"
     "<|eot_id|>\", \"generation\": \"<|start_header_id|>assistant<|end_header_id|>\\n\\n\", \"stop\": [\"<|eot_id|>\"]}"},
    {"mistral", "[INST]",
     "{\"prefix\": \"<s>\", \"message\": \"[INST] {content} [/INST]\", \"roles\": {\"assistant\": \"{content}</s>\"}, "
     "\"generation\": \"\", \"stop\": [\"</s>\"]}"},
};

const char *kiln_chat_template_named(const char *name)
{
    for (size_t i = 0; name && i < sizeof families / sizeof families[0]; i++)
        if (!strcmp(name, families[i].name)) return families[i].json;
    return NULL;
}

const char *kiln__chat_family_of(const char *jinja)
{
    for (size_t i = 0; jinja && i < sizeof families / sizeof families[0]; i++)
        if (strstr(jinja, families[i].marker)) return families[i].json;
    return NULL;
}

bool kiln__chat_template_parse(const char *text, kiln__chat_template *t, char *err, size_t n_err)
{
    memset(t, 0, sizeof *t);
    json_error_t je;
    json_t *o = json_loads(text ? text : "", 0, &je);
    json_t *m = json_object_get(o, "message"), *g = json_object_get(o, "generation"), *st = json_object_get(o, "stop");
    bool ok = json_is_object(o) && json_is_string(m) && json_is_string(g) && (!st || json_is_array(st));
    if (!ok) {
        snprintf(err, n_err, "chat template: want {\"message\": str, \"generation\": str, \"stop\": [str]}%s%s",
                 o ? "" : ": ", o ? "" : je.text);
        json_decref(o);
        return false;
    }
    json_t *pre = json_object_get(o, "prefix"), *roles = json_object_get(o, "roles");
    if ((pre && !json_is_string(pre)) || (roles && !json_is_object(roles))) {
        snprintf(err, n_err, "chat template: \"prefix\" must be a string and \"roles\" an object of strings");
        json_decref(o);
        return false;
    }
    const char *rk;
    json_t *rv;
    bool oom = false; /* a role or stop string that could not be copied: an error, not a template without it */
    json_object_foreach(roles, rk, rv)
    {
        if (!json_is_string(rv) || t->n_roles == KILN__MAX_ROLES) continue;
        t->role[t->n_roles] = strdup(rk);
        t->role_message[t->n_roles] = strdup(json_string_value(rv));
        t->n_roles++; /* (a NULL of the two fails the check below: a role is never dropped) */
        if (!t->role[t->n_roles - 1] || !t->role_message[t->n_roles - 1]) oom = true;
    }
    t->prefix = strdup(pre ? json_string_value(pre) : "");
    t->message = strdup(json_string_value(m));
    t->generation = strdup(json_string_value(g));
    size_t i;
    json_t *s;
    json_array_foreach(st, i, s)
    {
        if (!json_is_string(s) || !json_string_length(s) || t->n_stop == KILN__MAX_STOPS - 4) continue;
        if (!(t->stop[t->n_stop++] = strdup(json_string_value(s)))) oom = true;
    }
    json_decref(o);
    if (oom || !t->prefix || !t->message || !t->generation) {
        kiln__chat_template_free(t);
        snprintf(err, n_err, "chat template: out of memory");
        return false;
    }
    return true;
}

void kiln__chat_template_free(kiln__chat_template *t)
{
    free(t->prefix);
    for (int i = 0; i < t->n_roles; i++) free(t->role[i]), free(t->role_message[i]);
    free(t->message);
    free(t->generation);
    for (int i = 0; i < t->n_stop; i++) free(t->stop[i]);
    memset(t, 0, sizeof *t);
}

/* Appends s[0..n) to *out (length *len, capacity *cap). */
static bool put(char **out, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (!kiln__reserve(out, cap, *len + n + 1, 256)) return false;
    memcpy(*out + *len, s, n);
    *len += n;
    (*out)[*len] = '\0';
    return true;
}

bool kiln__chat_role_known(const char *role)
{
    static const char *const known[] = {"system", "developer", "user", "assistant", "tool", "function"};
    for (size_t i = 0; role && i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(role, known[i])) return true;
    return false;
}

char *kiln__chat_render(const kiln__chat_template *t, const kiln__chat_msg *msgs, int n)
{
    return kiln__chat_render_spans(t, msgs, n, NULL);
}

char *kiln__chat_render_spans(const kiln__chat_template *t, const kiln__chat_msg *msgs, int n, kiln_text_span *spans)
{
    char *out = NULL;
    size_t len = 0, cap = 0;
    bool ok = put(&out, &len, &cap, t->prefix ? t->prefix : "", t->prefix ? strlen(t->prefix) : 0);
    for (int i = 0; i < n && ok; i++) {
        if (spans) spans[i].begin = spans[i].end = len; /* (a form without {content}: an empty span) */
        const char *form = t->message; /* the role's own message, where the template has one */
        for (int r = 0; r < t->n_roles; r++)
            if (!strcmp(t->role[r], msgs[i].role)) form = t->role_message[r];
        for (const char *p = form; *p && ok;) {
            if (!strncmp(p, "{role}", 6)) {
                ok = put(&out, &len, &cap, msgs[i].role, strlen(msgs[i].role));
                p += 6;
            } else if (!strncmp(p, "{content}", 9)) {
                /* (a form with {content} twice: the span is its last place) */
                if (spans) spans[i].begin = len;
                ok = put(&out, &len, &cap, msgs[i].content, strlen(msgs[i].content));
                if (spans) spans[i].end = len;
                p += 9;
            } else {
                ok = put(&out, &len, &cap, p, 1);
                p++;
            }
        }
    }
    if (ok) ok = put(&out, &len, &cap, t->generation, strlen(t->generation));
    if (!ok) {
        free(out);
        return NULL;
    }
    return out;
}
