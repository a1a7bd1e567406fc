/* The extension languages (kiln/ext.h): a table of data, the built-ins below and the
 * user's JSON file's entries (jansson), and the expansion of a language's command
 * template for one source. Nothing here knows a compiler by name but the built-in rows:
 * a new accelerator language is a new row. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "ext/ext_impl.h"
#include "io/json_file.h"
#include "kiln/ext.h"

/* The languages kiln ships. {include} is kiln's header folder, so that a source can
 * include kiln/kiln.h. */
static const kiln_ext_lang builtins[] = {
    {".c", "cc -std=c11 -fPIC -Werror=implicit-function-declaration {flags} -I{include} -c {src} -o {out}", "-O2",
     ".o", "-MD -MF {dep}", "shared", "", "", "built-in"},
    {".cpp", "c++ -fPIC {flags} -I{include} -c {src} -o {out}", "-O2", ".o", "-MD -MF {dep}", "shared", "", "-lstdc++",
     "built-in"},
    {".cl", "", "", "", "", "backend", "opencl", "", "built-in"},
    /* the CUDA runtime from the toolkit nvcc belongs to (its lib64 beside bin) */
    {".cu", "nvcc -Xcompiler -fPIC {flags} -I{include} -c {src} -o {out}", "-O2", ".o", "-MD -MF {dep}", "shared", "",
     "-L{compiler_dir}/../lib64 -Wl,-rpath,{compiler_dir}/../lib64 -lcudart -lstdc++", "built-in"},
};
#define N_BUILTIN (int)(sizeof builtins / sizeof builtins[0])

/* The placeholders a template may hold. */
static const char *const holes[] = {"{src}", "{out}", "{flags}", "{include}", "{dep}"};
/* ...and the one a link template may hold: the folder of the compiler that its command
 * runs (found on $PATH). */
static const char *const link_holes[] = {"{compiler_dir}"};

struct kiln_ext_langs {
    kiln_ext_lang *l;
    int n;
    char **owned; /* every string the table holds */
    int n_owned, cap_owned;
};

static const char *own(kiln_ext_langs_t *t, const char *s)
{
    if (t->n_owned == t->cap_owned) {
        int cap = t->cap_owned ? 2 * t->cap_owned : 32;
        char **p = realloc(t->owned, sizeof *p * (size_t)cap);
        if (!p) return NULL;
        t->owned = p;
        t->cap_owned = cap;
    }
    char *c = strdup(s);
    if (c) t->owned[t->n_owned++] = c;
    return c;
}

void kiln_ext_langs_free(kiln_ext_langs_t *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_owned; i++) free(t->owned[i]);
    free(t->owned);
    free(t->l);
    free(t);
}

int kiln_ext_langs_count(const kiln_ext_langs_t *t) { return t ? t->n : 0; }

const kiln_ext_lang *kiln_ext_langs_at(const kiln_ext_langs_t *t, int i)
{
    return t && i >= 0 && i < t->n ? &t->l[i] : NULL;
}

/* Every "{...}" in s is one of the placeholders (the link one's, for link); else the
 * first that is not, in bad. */
static bool holes_known(const char *s, bool link, char *bad, size_t n)
{
    const char *const *set = link ? link_holes : holes;
    size_t n_set = link ? sizeof link_holes / sizeof link_holes[0] : sizeof holes / sizeof holes[0];
    for (const char *p = strchr(s, '{'); p; p = strchr(p + 1, '{')) {
        bool known = false;
        for (size_t h = 0; h < n_set && !known; h++) known = !strncmp(p, set[h], strlen(set[h]));
        if (!known) {
            const char *e = strchr(p, '}');
            snprintf(bad, n, "%.*s", e ? (int)(e - p + 1) : (int)strlen(p), p);
            return false;
        }
    }
    return true;
}

/* Entry k of the file's "languages" as a language (strings owned by t). */
static kiln_status parse_entry(kiln_ext_langs_t *t, const char *path, size_t k, json_t *e, kiln_ext_lang *out)
{
    if (!json_is_object(e)) return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu] is not an object", path, k);
    static const char *const keys[] = {"suffix", "command", "flags", "object", "depfile", "load", "backend", "link"};
    const char *v[8];
    const char *key;
    json_t *x;
    json_object_foreach(e, key, x)
    {
        size_t i = 0;
        while (i < 8 && strcmp(keys[i], key)) i++;
        if (i == 8) return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu]: unknown field '%s'", path, k, key);
        if (!json_is_string(x))
            return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu]: '%s' must be a string", path, k, key);
    }
    for (int i = 0; i < 8; i++) v[i] = json_string_value(json_object_get(e, keys[i]));
    const char *suffix = v[0], *load = v[5] ? v[5] : "shared";
    if (!suffix || suffix[0] != '.' || !suffix[1] || strchr(suffix, '/'))
        return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu]: 'suffix' must be a file suffix such as \".asc\"", path,
                          k);
    if (strcmp(load, "shared") && strcmp(load, "backend"))
        return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu] (%s): 'load' is \"%s\"; it must be \"shared\" or "
                          "\"backend\"", path, k, suffix, load);
    bool shared = !strcmp(load, "shared");
    if (shared && (!v[1] || !*v[1] || !strstr(v[1], "{src}") || !strstr(v[1], "{out}")))
        return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu] (%s): a \"shared\" language needs a 'command' with {src} "
                          "and {out}", path, k, suffix);
    if (!shared && (!v[6] || !*v[6]))
        return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu] (%s): a \"backend\" language names its 'backend'", path,
                          k, suffix);
    char bad[64];
    for (int i = 1; i < 5; i++)
        if (v[i] && !holes_known(v[i], false, bad, sizeof bad))
            return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu] (%s): '%s' has %s; the placeholders are {src}, "
                              "{out}, {flags}, {include} and {dep}", path, k, suffix, keys[i], bad);
    if (v[7] && !holes_known(v[7], true, bad, sizeof bad))
        return kiln_error(KILN_ERR_FORMAT, "%s: languages[%zu] (%s): 'link' has %s; its placeholder is {compiler_dir}",
                          path, k, suffix, bad);
    const char *s[9] = {suffix, v[1] ? v[1] : "", v[2] ? v[2] : "", v[3] ? v[3] : (shared ? ".o" : ""),
                        v[4] ? v[4] : "", load, v[6] ? v[6] : "", v[7] ? v[7] : "", path};
    const char **dst[9] = {&out->suffix, &out->command, &out->flags, &out->object, &out->depfile, &out->load,
                           &out->backend, &out->link, &out->origin};
    for (int i = 0; i < 9; i++)
        if (!(*dst[i] = own(t, s[i]))) return kiln_error(KILN_ERR_OOM, "ext: out of memory");
    return KILN_OK;
}

static kiln_status load_file(kiln_ext_langs_t *t, const char *path)
{
    json_error_t err;
    json_t *root = kiln__json_load(path, JSON_REJECT_DUPLICATES, &err, "languages");
    if (!root) {
        struct stat st;
        return stat(path, &st) ? kiln_error(KILN_ERR_IO, "%s: cannot read it: %s", path, strerror(errno))
                               : kiln_last_status(); /* not a regular file, or its line and what is wrong */
    }
    json_t *list = json_object_get(root, "languages");
    kiln_status s = json_is_array(list) ? KILN_OK
                                        : kiln_error(KILN_ERR_FORMAT, "%s: want {\"languages\": [...]}", path);
    size_t k;
    json_t *e;
    json_array_foreach(list, k, e)
    {
        if (s != KILN_OK) break;
        kiln_ext_lang l;
        s = parse_entry(t, path, k, e, &l);
        int at = 0;
        while (s == KILN_OK && at < t->n && strcmp(t->l[at].suffix, l.suffix)) at++;
        if (s == KILN_OK && at == t->n) {
            kiln_ext_lang *p = realloc(t->l, sizeof *p * (size_t)(t->n + 1));
            if (!p) s = kiln_error(KILN_ERR_OOM, "ext: out of memory");
            else t->l = p, t->n++;
        }
        if (s == KILN_OK) t->l[at] = l; /* new, or in place of the earlier one */
    }
    json_decref(root);
    return s;
}

kiln_status kiln_ext_langs_load(const char *path, kiln_ext_langs_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "ext_langs_load: out is NULL");
    *out = NULL;
    kiln_ext_langs_t *t = calloc(1, sizeof *t);
    if (!t || !(t->l = malloc(sizeof *t->l * N_BUILTIN))) {
        free(t);
        return kiln_error(KILN_ERR_OOM, "ext: out of memory");
    }
    memcpy(t->l, builtins, sizeof builtins);
    t->n = N_BUILTIN;
    char user[4096];
    const char *file = path;
    if (!file) { /* the user's, when there is one */
        const char *xdg = getenv("XDG_CONFIG_HOME"), *home = getenv("HOME");
        if (xdg && *xdg) snprintf(user, sizeof user, "%s/kiln/languages.json", xdg);
        else snprintf(user, sizeof user, "%s/.config/kiln/languages.json", home ? home : "");
        struct stat st;
        if ((xdg && *xdg) || (home && *home)) file = stat(user, &st) == 0 ? user : NULL;
    }
    kiln_status s = file ? load_file(t, file) : KILN_OK;
    if (s != KILN_OK) {
        kiln_ext_langs_free(t);
        return s;
    }
    *out = t;
    return KILN_OK;
}

const kiln_ext_lang *kiln_ext_langs_find(const kiln_ext_langs_t *t, const char *source)
{
    if (!t || !source) return kiln_error(KILN_ERR_ARG, "ext_langs_find: NULL table or source"), NULL;
    size_t n = strlen(source), best = 0;
    const kiln_ext_lang *hit = NULL;
    for (int i = 0; i < t->n; i++) {
        size_t m = strlen(t->l[i].suffix);
        if (m <= n && m > best && !strcmp(source + n - m, t->l[i].suffix)) hit = &t->l[i], best = m;
    }
    if (hit) return hit;
    char all[512] = "";
    for (int i = 0; i < t->n; i++)
        snprintf(all + strlen(all), sizeof all - strlen(all), "%s%s", i ? ", " : "", t->l[i].suffix);
    kiln_error(KILN_ERR_UNSUPPORTED, "%s: no extension language has its suffix (there are %s; add one in "
               "languages.json, kiln/ext.h)", source, all);
    return NULL;
}

bool kiln__ext_append(char **b, size_t *n, size_t *cap, const char *s, bool q)
{
    size_t need = *n + (q ? 4 * strlen(s) + 3 : strlen(s)) + 1;
    if (need > *cap) {
        size_t c = need * 2;
        char *p = realloc(*b, c);
        if (!p) return false;
        *b = p, *cap = c;
    }
    if (!q) {
        memcpy(*b + *n, s, strlen(s));
        *n += strlen(s);
    } else { /* '...' with each ' written '\'' */
        (*b)[(*n)++] = '\'';
        for (const char *p = s; *p; p++)
            if (*p == '\'') memcpy(*b + *n, "'\\''", 4), *n += 4;
            else (*b)[(*n)++] = *p;
        (*b)[(*n)++] = '\'';
    }
    (*b)[*n] = 0;
    return true;
}

/* t with its placeholders filled (flags: as they are; the rest quoted). */
static char *expand(const char *t, const char *src, const char *out, const char *flags, const char *include,
                    const char *dep)
{
    const char *with[] = {src, out, flags, include, dep};
    char *b = NULL;
    size_t n = 0, cap = 0;
    if (!kiln__ext_append(&b, &n, &cap, "", false)) return NULL;
    for (const char *p = t; *p;) {
        size_t h = 0;
        while (h < 5 && strncmp(p, holes[h], strlen(holes[h]))) h++;
        if (h < 5) {
            if (!kiln__ext_append(&b, &n, &cap, with[h], h != 2)) break;
            p += strlen(holes[h]);
        } else {
            char one[2] = {*p++, 0};
            if (!kiln__ext_append(&b, &n, &cap, one, false)) break;
        }
    }
    return b;
}

kiln_status kiln_ext_command(const kiln_ext_lang *lang, const char *src, const char *out, const char *include,
                             char **cmd)
{
    if (!lang || !src || !out || !cmd) return kiln_error(KILN_ERR_ARG, "ext_command: NULL argument");
    *cmd = NULL;
    if (!*lang->command)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: a %s source is handed to the %s backend when loaded, not compiled",
                          src, lang->suffix, lang->backend);
    char *dep = malloc(strlen(out) + 3);
    if (!dep) return kiln_error(KILN_ERR_OOM, "ext: out of memory");
    sprintf(dep, "%s.d", out);
    /* {flags}: the language's flags, then its dependency-file flags */
    char *depflags = expand(lang->depfile, src, out, "", include ? include : ".", dep);
    size_t fl = strlen(lang->flags) + (depflags ? strlen(depflags) : 0) + 2;
    char *flags = malloc(fl);
    if (flags && depflags) snprintf(flags, fl, "%s%s%s", lang->flags, *lang->flags && *depflags ? " " : "", depflags);
    *cmd = flags && depflags ? expand(lang->command, src, out, flags, include ? include : ".", dep) : NULL;
    free(dep);
    free(depflags);
    free(flags);
    return *cmd ? KILN_OK : kiln_error(KILN_ERR_OOM, "ext: out of memory");
}

bool kiln_ext_compiler_found(const kiln_ext_lang *lang, char *buf, size_t n)
{
    if (!lang || !*lang->command || !buf || n == 0) return false;
    size_t w = strcspn(lang->command, " \t");
    char prog[1024];
    snprintf(prog, sizeof prog, "%.*s", (int)w, lang->command);
    if (strchr(prog, '/')) {
        snprintf(buf, n, "%s", prog);
        return access(prog, X_OK) == 0;
    }
    const char *path = getenv("PATH");
    for (const char *p = path ? path : "/usr/bin:/bin"; *p;) {
        size_t len = strcspn(p, ":");
        snprintf(buf, n, "%.*s/%s", (int)len, len ? p : ".", prog);
        struct stat st;
        if (stat(buf, &st) == 0 && S_ISREG(st.st_mode) && access(buf, X_OK) == 0) return true;
        p += len + (p[len] == ':');
    }
    snprintf(buf, n, "%s", prog);
    return false;
}
