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
    t->message = strdup(json_string_value(m));
    t->generation = strdup(json_string_value(g));
    size_t i;
    json_t *s;
    json_array_foreach(st, i, s)
    {
        if (!json_is_string(s) || !json_string_length(s) || t->n_stop == KILN__MAX_STOPS - 4) continue;
        if ((t->stop[t->n_stop] = strdup(json_string_value(s)))) t->n_stop++;
    }
    json_decref(o);
    if (!t->message || !t->generation) {
        kiln__chat_template_free(t);
        snprintf(err, n_err, "chat template: out of memory");
        return false;
    }
    return true;
}

void kiln__chat_template_free(kiln__chat_template *t)
{
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

char *kiln__chat_render(const kiln__chat_template *t, const kiln__chat_msg *msgs, int n)
{
    char *out = NULL;
    size_t len = 0, cap = 0;
    bool ok = put(&out, &len, &cap, "", 0);
    for (int i = 0; i < n && ok; i++) {
        for (const char *p = t->message; *p && ok;) {
            if (!strncmp(p, "{role}", 6)) {
                ok = put(&out, &len, &cap, msgs[i].role, strlen(msgs[i].role));
                p += 6;
            } else if (!strncmp(p, "{content}", 9)) {
                ok = put(&out, &len, &cap, msgs[i].content, strlen(msgs[i].content));
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
