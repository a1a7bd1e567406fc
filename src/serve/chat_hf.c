/* Chat templates from outside a checkpoint: the value of kiln serve --chat-template (a
 * family, a JSON template or a file), and a Hugging Face folder's tokenizer_config.json,
 * whose Jinja program is taken by its family (chat.c's table). Apart from chat.c, which
 * the fuzzer builds on its own without the rest of the library. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "core/file.h"
#include "io/json_file.h"
#include "kiln/serve.h"
#include "serve/openai.h"

kiln_status kiln__chat_template_resolve(const char *what, char **out)
{
    const char *named = kiln_chat_template_named(what);
    if (named || what[0] == '{') {
        *out = strdup(named ? named : what);
        return *out ? KILN_OK : kiln_error(KILN_ERR_OOM, "chat template: out of memory");
    }
    struct stat st;
    FILE *f = kiln__file_fopen_read(what, "--chat-template"); /* a regular file only: never a FIFO's wait */
    if (!f && stat(what, &st) == 0) return kiln_last_status();
    if (!f)
        return kiln_error(KILN_ERR_IO, "--chat-template %s: not a family (chatml, llama3, mistral), a JSON template or "
                          "a file that can be read", what);
    char *text = malloc(1 << 16);
    size_t n = text ? fread(text, 1, (1 << 16) - 1, f) : 0;
    fclose(f);
    if (!text) return kiln_error(KILN_ERR_OOM, "chat template: out of memory");
    text[n] = '\0';
    *out = text;
    return KILN_OK;
}

kiln_status kiln_chat_template_from_hf(const char *dir, char **out)
{
    *out = NULL;
    char path[4200];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    json_t *root = NULL;
    /* no tokenizer_config.json: no template; one that is there but broken is an error
     * naming what is wrong with it, not a silent fallback */
    if (!kiln__path_exists(path)) return KILN_OK;
    if (!(root = kiln__json_load(path, 0, NULL, "chat template"))) return kiln_last_status();
    json_t *t = json_object_get(root, "chat_template");
    if (json_is_array(t)) { /* named templates: the "default" one, else the first */
        json_t *pick = json_array_get(t, 0), *e;
        size_t i;
        json_array_foreach(t, i, e)
        {
            const char *nm = json_string_value(json_object_get(e, "name"));
            if (nm && !strcmp(nm, "default")) pick = e;
        }
        t = json_object_get(pick, "template");
    }
    const char *jinja = json_string_value(t);
    kiln_status s = KILN_OK;
    const char *family = kiln__chat_family_of(jinja);
    if (jinja && !family)
        s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: its chat template is none of the families kiln renders (chatml, "
                       "llama3, mistral); give kiln serve --chat-template NAME, FILE or a JSON template", path);
    else if (family && !(*out = strdup(family)))
        s = kiln_error(KILN_ERR_OOM, "chat template: out of memory");
    json_decref(root);
    return s;
}

