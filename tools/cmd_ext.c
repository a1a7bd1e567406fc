/* kiln ext: custom ops' sources and the languages they are written in (kiln/ext.h).
 *   kiln ext languages [--languages FILE]      the table, and where each row came from
 *   kiln ext build SRC... --out DIR [...]      each source through its language
 * Loading what was built into the op table is not built yet (issue 28). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include "cli.h"
#include "kiln/ext.h"

#ifndef KILN_INCLUDE_DIR
#define KILN_INCLUDE_DIR "."
#endif

static int languages(int argc, char **argv)
{
    const char *file = NULL;
    const cli_opt opts[] = {{"languages", OPT_STRING, &file, "a languages.json (default: $XDG_CONFIG_HOME/kiln/languages.json)"},
                            {NULL, 0, NULL, NULL}};
    const char *pos[1];
    int np = 0;
    int r = cli_parse("ext languages", "[--languages FILE]\n\nThe extension languages: kiln's own, then the file's.",
                      opts, argc, argv, pos, 0, &np);
    if (r) return r == 1 ? 0 : 2;
    kiln_ext_langs_t *t;
    if (kiln_ext_langs_load(file, &t) != KILN_OK) return cli_fail("ext languages", NULL);
    printf("%-8s %-8s %-10s %s\n", "suffix", "load", "from", "command (flags)");
    for (int i = 0; i < kiln_ext_langs_count(t); i++) {
        const kiln_ext_lang *l = kiln_ext_langs_at(t, i);
        if (*l->command) printf("%-8s %-8s %-10s %s (%s)\n", l->suffix, l->load, l->origin, l->command, l->flags);
        else printf("%-8s %-8s %-10s handed to the %s backend when loaded\n", l->suffix, l->load, l->origin, l->backend);
    }
    kiln_ext_langs_free(t);
    return 0;
}

/* Runs cmd through the shell; its output (both streams) in *out (malloc'd). Returns
 * the exit status, or -1 when it could not be run. */
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

/* src copied to dst; 0, or 1 after saying why. */
static int copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *o = in ? fopen(dst, "wb") : NULL;
    char buf[1 << 14];
    size_t n;
    bool ok = in && o;
    while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, o) == n;
    ok = ok && !ferror(in);
    if (o && fclose(o) != 0) ok = false;
    if (in) fclose(in);
    if (!ok) fprintf(stderr, "kiln ext build: cannot copy %s to %s: %s\n", src, dst, strerror(errno));
    return ok ? 0 : 1;
}

static int build(int argc, char **argv)
{
    const char *file = NULL, *out = NULL, *include = KILN_INCLUDE_DIR;
    const cli_opt opts[] = {{"out", OPT_STRING, &out, "the folder for what is built (made if missing)"},
                            {"languages", OPT_STRING, &file, "a languages.json (default: $XDG_CONFIG_HOME/kiln/languages.json)"},
                            {"include", OPT_STRING, &include, "kiln's header folder, at {include}"},
                            {NULL, 0, NULL, NULL}};
    const char *pos[256];
    int np = 0;
    int r = cli_parse("ext build", "SRC... --out DIR [--languages FILE] [--include DIR]\n\n"
                      "Compiles each source with its language's command (kiln ext languages); a source\n"
                      "a backend builds itself (.cl) is copied. A failure names the source, the command\n"
                      "and the compiler's output.",
                      opts, argc, argv, pos, 256, &np);
    if (r) return r == 1 ? 0 : 2;
    if (!out || np == 0) return cli_fail("ext build", "give the sources and --out DIR");
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kiln ext build: cannot make %s: %s\n", out, strerror(errno));
        return 1;
    }
    kiln_ext_langs_t *t;
    if (kiln_ext_langs_load(file, &t) != KILN_OK) return cli_fail("ext build", NULL);
    int rc = 0;
    for (int i = 0; i < np && rc == 0; i++) {
        const kiln_ext_lang *l = kiln_ext_langs_find(t, pos[i]);
        if (!l) {
            rc = cli_fail("ext build", NULL);
            break;
        }
        const char *base = strrchr(pos[i], '/') ? strrchr(pos[i], '/') + 1 : pos[i];
        char dst[4300], *cmd = NULL, *log = NULL;
        size_t stem = strlen(base) - strlen(l->suffix);
        if (*l->command) snprintf(dst, sizeof dst, "%s/%.*s%s", out, (int)stem, base, l->object);
        else snprintf(dst, sizeof dst, "%s/%s", out, base);
        if (!*l->command) { /* the backend builds it when it is loaded: copied as it is */
            rc = copy_file(pos[i], dst);
            if (!rc) printf("%s -> %s (built by the %s backend when loaded)\n", pos[i], dst, l->backend);
        } else if (kiln_ext_command(l, pos[i], dst, include, &cmd) != KILN_OK) {
            rc = cli_fail("ext build", NULL);
        } else {
            int st = run(cmd, &log);
            if (st != 0) {
                fprintf(stderr, "kiln ext build: %s: the %s compiler %s\n  command: %s\n%s%s", pos[i], l->suffix,
                        st < 0 ? "could not be run" : st == 127 ? "was not found (exit status 127)" : "failed", cmd,
                        log ? log : "", log && *log && log[strlen(log) - 1] != '\n' ? "\n" : "");
                rc = 1;
            } else {
                printf("%s -> %s\n", pos[i], dst);
            }
        }
        free(cmd);
        free(log);
    }
    kiln_ext_langs_free(t);
    return rc;
}

int cmd_ext(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "languages")) return languages(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "build")) return build(argc - 1, argv + 1);
    bool help = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
    fprintf(help ? stdout : stderr,
            "usage: kiln ext languages [--languages FILE]\n"
            "       kiln ext build SRC... --out DIR [--languages FILE] [--include DIR]\n\n"
            "Custom ops' sources and the languages they are written in. A language is a row of\n"
            "data (kiln/ext.h): kiln ships .c, .cpp, .cl and .cu; a languages.json under\n"
            "$XDG_CONFIG_HOME/kiln/ (or --languages) adds or replaces rows without rebuilding kiln.\n");
    return help ? 0 : 2;
}
