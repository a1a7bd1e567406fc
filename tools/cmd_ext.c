/* kiln ext: custom ops' sources, the languages they are written in, and their modules
 * (kiln/ext.h, kiln/op.h).
 *   kiln ext languages [--languages FILE]      the table, and where each row came from
 *   kiln ext build SRC... --out DIR [...]      each source through its language
 *   kiln ext load MODULE...                    loads them: the ops each defined */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

static int build(int argc, char **argv)
{
    const char *file = NULL, *out = NULL, *include = KILN_INCLUDE_DIR, *name = "ext";
    const cli_opt opts[] = {{"out", OPT_STRING, &out, "the folder for what is built (made if missing; default: the kernel cache's ext/NAME)"},
                            {"name", OPT_STRING, &name, "the module's name: DIR/libNAME.so (default ext)"},
                            {"languages", OPT_STRING, &file, "a languages.json (default: $XDG_CONFIG_HOME/kiln/languages.json)"},
                            {"include", OPT_STRING, &include, "kiln's header folder, at {include}"},
                            {NULL, 0, NULL, NULL}};
    const char *pos[256];
    int np = 0;
    int r = cli_parse("ext build", "SRC... [--out DIR] [--name NAME] [--languages FILE] [--include DIR]\n\n"
                      "Compiles each source with its language's command (kiln ext languages), again only\n"
                      "where the source or a file it includes changed, and links the objects into\n"
                      "DIR/libNAME.so; a source a backend builds itself (.cl) is copied. A failure names\n"
                      "the source, the command and the compiler's output.",
                      opts, argc, argv, pos, 256, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np == 0) return cli_fail("ext build", "give the sources to build");
    kiln_ext_langs_t *t;
    if (kiln_ext_langs_load(file, &t) != KILN_OK) return cli_fail("ext build", NULL);
    char *module = NULL;
    int rebuilt = 0;
    kiln_status s = kiln_ext_build(t, pos, np, out, name, include, &module, &rebuilt);
    kiln_ext_langs_free(t);
    if (s != KILN_OK) return cli_fail("ext build", NULL);
    printf("%d source(s), %d compiled (the rest up to date)%s%s\n", np, rebuilt, module ? "; module " : "",
           module ? module : "");
    free(module);
    return 0;
}

static int load(int argc, char **argv)
{
    const cli_opt opts[] = {{NULL, 0, NULL, NULL}};
    const char *pos[64];
    int np = 0;
    int r = cli_parse("ext load", "MODULE...\n\nLoads each module (kiln ext build makes one) and lists the ops it "
                      "defined, with how\neach device runs them: its own kernel (native), a generated one, or the "
                      "cpu's with\ncopies. KILN_EXT=MODULE[:MODULE...] loads modules before any kiln command.",
                      opts, argc, argv, pos, 64, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np == 0) return cli_fail("ext load", "give the modules to load");
    static const char *how[4] = {"not supported", "cpu (copies)", "native", "generated"};
    for (int m = 0; m < np; m++) {
        int first = kiln_op_count(), n = 0;
        if (kiln_ext_load(pos[m], &n) != KILN_OK) return cli_fail("ext load", NULL);
        printf("%s: %d op(s)%s\n", pos[m], n, n ? "" : " (loaded already, or it defines none)");
        for (int op = first; op < first + n; op++) {
            printf("  %-24s", kiln_op_name(op));
            for (int d = 0; d < kiln_device_count(); d++)
                printf(" %s: %s%s", kiln_device_name(d), how[kiln_device_op_support(kiln_device_name(d), op)],
                       d + 1 < kiln_device_count() ? "," : "");
            printf("\n");
        }
    }
    return 0;
}

int cmd_ext(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "load")) return load(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "languages")) return languages(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "build")) return build(argc - 1, argv + 1);
    bool help = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
    fprintf(help ? stdout : stderr,
            "usage: kiln ext languages [--languages FILE]\n"
            "       kiln ext build SRC... [--out DIR] [--name NAME] [--languages FILE] [--include DIR]\n"
            "       kiln ext load MODULE...\n\n"
            "Custom ops' sources and the languages they are written in. A language is a row of\n"
            "data (kiln/ext.h): kiln ships .c, .cpp, .cl and .cu; a languages.json under\n"
            "$XDG_CONFIG_HOME/kiln/ (or --languages) adds or replaces rows without rebuilding kiln.\n");
    return help ? 0 : 2;
}
