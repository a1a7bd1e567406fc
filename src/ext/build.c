/* kiln_ext_build (kiln/ext.h): sources through their languages' commands into objects,
 * incrementally (an object newer than its source and every file of its dependency
 * file is kept), then linked into one loadable module. The commands run through the
 * shell (popen), their output kept for the error message. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include "ext/ext_impl.h"
#include "kiln/ext.h"

/* Runs cmd through the shell; its output (both streams) in *out (malloc'd, or NULL).
 * Returns the exit status, or -1 when it could not be run. */
static int run(const char *cmd, char **out)
{
    size_t n = strlen(cmd) + 8;
    char *full = malloc(n);
    *out = NULL;
    if (!full) return -1;
    snprintf(full, n, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    free(full);
    if (!p) return -1;
    size_t len = 0, cap = 4096;
    char *b = malloc(cap);
    for (size_t got; b && (got = fread(b + len, 1, cap - len - 1, p)) > 0;) {
        len += got;
        if (cap - len < 2) {
            char *q = realloc(b, cap * 2);
            if (!q) break;
            b = q, cap *= 2;
        }
    }
    if (b) b[len] = 0;
    *out = b;
    int st = pclose(p);
    return st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static kiln_status failed(const char *what, const char *cmd, int st, const char *log)
{
    size_t l = log ? strlen(log) : 0;
    return kiln_error(KILN_ERR_IO, "%s %s\n  command: %s\n%.*s", what,
                      st < 0 ? "could not be run" : st == 127 ? "was not found (exit status 127)" : "failed", cmd,
                      (int)(l > 3000 ? 3000 : l), log ? log : "");
}

/* The modification time of path, or -1 when it is not there. */
static double mtime(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    return (double)st.st_mtim.tv_sec + 1e-9 * (double)st.st_mtim.tv_nsec;
}

/* Whether obj is newer than src and than every file its make-style dependency file dep
 * lists ("obj: a b \ c"); a dependency file that is missing or names a file that is
 * gone means no. */
static bool up_to_date(const char *obj, const char *src, const char *dep, bool has_dep)
{
    double t = mtime(obj);
    if (t < 0 || mtime(src) < 0 || mtime(src) > t) return false;
    if (!has_dep) return true;
    FILE *f = fopen(dep, "r");
    if (!f) return false;
    char word[4096];
    bool ok = true, past_colon = false;
    while (ok && fscanf(f, "%4095s", word) == 1) {
        size_t n = strlen(word);
        if (!past_colon) {
            past_colon = n && word[n - 1] == ':';
            continue;
        }
        if (!strcmp(word, "\\")) continue;
        double d = mtime(word);
        ok = d >= 0 && d <= t;
    }
    fclose(f);
    return ok && past_colon;
}

static kiln_status copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *o = in ? fopen(dst, "wb") : NULL;
    char buf[1 << 14];
    size_t n;
    bool ok = in && o;
    while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, o) == n;
    ok = ok && !ferror(in);
    if (o && fclose(o) != 0) ok = false;
    if (in) fclose(in);
    return ok ? KILN_OK : kiln_error(KILN_ERR_IO, "%s: cannot copy it to %s: %s", src, dst, strerror(errno));
}

kiln_status kiln_ext_build(const kiln_ext_langs_t *langs, const char *const *sources, int n, const char *out_dir,
                           const char *name, const char *include, char **module, int *rebuilt)
{
    if (!langs || (!sources && n) || n < 0 || !out_dir || !name || !*name || !module)
        return kiln_error(KILN_ERR_ARG, "ext_build: NULL table, sources, folder, name or module");
    *module = NULL;
    if (rebuilt) *rebuilt = 0;
    if (strchr(name, '/')) return kiln_error(KILN_ERR_ARG, "ext_build: the module's name '%s' has a '/'", name);
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        return kiln_error(KILN_ERR_IO, "ext_build: cannot make %s: %s", out_dir, strerror(errno));
    size_t mlen = strlen(out_dir) + strlen(name) + 16, link_len = 0, link_cap = 0;
    char *mod = malloc(mlen), *link = NULL; /* the link command: cc -shared -o 'module' 'object'... */
    kiln_status s = mod ? KILN_OK : kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
    if (s == KILN_OK) snprintf(mod, mlen, "%s/lib%s.so", out_dir, name);
    if (s == KILN_OK && !(kiln__ext_append(&link, &link_len, &link_cap, "cc -shared -o ", false) &&
                          kiln__ext_append(&link, &link_len, &link_cap, mod, true)))
        s = kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
    int objects = 0;
    bool any_new = false;
    double newest = 0; /* of the objects: a module older than one is linked again */
    for (int i = 0; s == KILN_OK && i < n; i++) {
        const kiln_ext_lang *l = kiln_ext_langs_find(langs, sources[i]);
        if (!l) {
            s = kiln_last_status();
            break;
        }
        const char *base = strrchr(sources[i], '/') ? strrchr(sources[i], '/') + 1 : sources[i];
        size_t stem = strlen(base) - strlen(l->suffix);
        char obj[4300], dep[4310];
        if (!*l->command) { /* its backend builds it when it is loaded */
            snprintf(obj, sizeof obj, "%s/%s", out_dir, base);
            s = copy_file(sources[i], obj);
            continue;
        }
        snprintf(obj, sizeof obj, "%s/%.*s%s", out_dir, (int)stem, base, l->object);
        snprintf(dep, sizeof dep, "%s.d", obj);
        if (!kiln__ext_append(&link, &link_len, &link_cap, " ", false) ||
            !kiln__ext_append(&link, &link_len, &link_cap, obj, true)) {
            s = kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
            break;
        }
        objects++;
        if (up_to_date(obj, sources[i], dep, *l->depfile != 0)) {
            if (mtime(obj) > newest) newest = mtime(obj);
            continue;
        }
        char *cmd = NULL, *log = NULL;
        s = kiln_ext_command(l, sources[i], obj, include, &cmd);
        int st = s == KILN_OK ? run(cmd, &log) : 0;
        if (s == KILN_OK && st != 0) {
            char what[4400];
            snprintf(what, sizeof what, "%s: the %s compiler", sources[i], l->suffix);
            s = failed(what, cmd, st, log);
        }
        if (s == KILN_OK) {
            any_new = true;
            if (rebuilt) (*rebuilt)++;
        }
        free(cmd);
        free(log);
    }
    if (s == KILN_OK && objects && (any_new || mtime(mod) < newest || mtime(mod) < 0)) {
        char *log = NULL;
        int st = run(link, &log);
        if (st != 0) s = failed("the module's link", link, st, log);
        free(log);
    }
    free(link);
    if (s == KILN_OK && objects) *module = mod;
    else free(mod);
    return s;
}
