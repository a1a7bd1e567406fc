/* kiln: train, sample and inspect models. Each subcommand is a row of one table. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli.h"
#include "io/json_file.h" /* a regular file only: a FIFO as --config must not hang */

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} commands[] = {
    {"train", cmd_train, "pretrain a GPT on a text corpus (checkpoints, metrics, chart, --resume)"},
    {"sample", cmd_sample, "generate text from a checkpoint"},
    {"serve", cmd_serve, "serve a checkpoint over an OpenAI-compatible HTTP API"},
    {"compile", cmd_compile, "capture a model's training step into a graph and write it out (--dump DIR)"},
    {"tokenizer", cmd_tokenizer, "train | encode | decode with a BPE tokenizer"},
    {"import", cmd_import, "a Hugging Face model folder into a kiln run folder (import hf HF_DIR RUN_DIR)"},
    {"export", cmd_export, "a kiln model as a Hugging Face folder or a GGUF file (export hf|gguf RUN_DIR OUT)"},
    {"info", cmd_info, "describe a checkpoint"},
    {"plot", cmd_plot, "redraw a run's loss chart (and an MoE run's router chart) from its metrics"},
    {"ext", cmd_ext, "custom ops: the extension languages, building sources into a module, loading it"},
    {"doctor", cmd_doctor, "check every layer kiln stands on: OK, WARN or FAIL rows with fixes (--json; exit 1 on a FAIL)"},
};

/* The modules KILN_EXT names (':'-separated), loaded before the command runs. One that
 * does not load stops the command, except for the commands that diagnose or rebuild it
 * (lenient: kiln ext, kiln doctor), which say so and go on. */
static int ext_load_env(bool lenient)
{
    const char *list = kiln_env("KILN_EXT");
    char path[4096];
    for (const char *p = list ? list : ""; *p;) {
        size_t n = strcspn(p, ":");
        kiln_status s = KILN_OK;
        if (n >= sizeof path) s = kiln_error(KILN_ERR_ARG, "a path of %zu characters: too long", n);
        else if (n) {
            snprintf(path, sizeof path, "%.*s", (int)n, p);
            s = kiln_ext_load(path, NULL);
        }
        if (s != KILN_OK) {
            fprintf(stderr, "kiln: KILN_EXT: %s%s\n", kiln_last_error(), lenient ? " (going on without it)" : "");
            if (!lenient) return 1;
        }
        p += n + (p[n] == ':');
    }
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "kiln %s — a deep-learning engine in C\n\nusage: kiln COMMAND [options]   (kiln COMMAND --help for more)\n\n",
            kiln_version());
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("kiln %s\n", kiln_version());
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) {
            if (ext_load_env(!strcmp(argv[1], "ext") || !strcmp(argv[1], "doctor")) != 0) return 1;
            return commands[i].run(argc - 1, argv + 1);
        }
    fprintf(stderr, "kiln: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

int cli_fail(const char *cmd, const char *msg)
{
    fprintf(stderr, "kiln %s: %s\n", cmd, msg ? msg : kiln_last_error());
    return 1;
}

static const cli_opt *find_opt(const cli_opt *opts, const char *name, size_t len)
{
    for (const cli_opt *o = opts; o->name; o++)
        if (strlen(o->name) == len && !strncmp(o->name, name, len)) return o;
    return NULL;
}

static int set_opt(const char *cmd, const cli_opt *o, const char *val)
{
    char *end;
    errno = 0;
    switch (o->type) {
    case OPT_INT: {
        long long v = strtoll(val, &end, 10);
        if (errno || *end || end == val) break;
        *(int64_t *)o->dst = v;
        return 0;
    }
    case OPT_DOUBLE: {
        double v = strtod(val, &end);
        if (errno || *end || end == val) break;
        *(double *)o->dst = v;
        return 0;
    }
    case OPT_STRING:
        *(const char **)o->dst = val;
        return 0;
    case OPT_FLAG:
        if (!strcmp(val, "true") || !strcmp(val, "1")) *(bool *)o->dst = true;
        else if (!strcmp(val, "false") || !strcmp(val, "0")) *(bool *)o->dst = false;
        else break;
        return 0;
    }
    fprintf(stderr, "kiln %s: --%s expects %s, got '%s'\n", cmd, o->name,
            o->type == OPT_INT ? "an integer" : o->type == OPT_DOUBLE ? "a number" : "true or false", val);
    return 2;
}

static void print_help(const char *cmd, const char *usage_line, const cli_opt *opts)
{
    printf("usage: kiln %s %s\n\noptions:\n", cmd, usage_line);
    for (const cli_opt *o = opts; o->name; o++) {
        char def[64] = "";
        if (o->type == OPT_INT) snprintf(def, sizeof def, " (default %lld)", (long long)*(int64_t *)o->dst);
        else if (o->type == OPT_DOUBLE) snprintf(def, sizeof def, " (default %g)", *(double *)o->dst);
        else if (o->type == OPT_STRING && *(const char **)o->dst)
            snprintf(def, sizeof def, " (default %.40s)", *(const char **)o->dst);
        printf("  --%-16s %s%s\n", o->name, o->help, def);
    }
    printf("  --%-16s %s\n", "help", "show this help");
}

int cli_parse(const char *cmd, const char *usage_line, const cli_opt *opts, int argc, char **argv, const char **pos,
              int max_pos, int *n_pos)
{
    int np = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            print_help(cmd, usage_line, opts);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            if (np >= max_pos) {
                fprintf(stderr, "kiln %s: unexpected argument '%s' (see kiln %s --help)\n", cmd, a, cmd);
                return 2;
            }
            pos[np++] = a;
            continue;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        const cli_opt *o = find_opt(opts, name, eq ? (size_t)(eq - name) : strlen(name));
        if (!o) {
            fprintf(stderr, "kiln %s: unknown option '%s' (see kiln %s --help)\n", cmd, a, cmd);
            return 2;
        }
        const char *val = eq ? eq + 1 : NULL;
        if (!val && o->type == OPT_FLAG) {
            *(bool *)o->dst = true;
            continue;
        }
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kiln %s: --%s needs a value\n", cmd, o->name);
                return 2;
            }
            val = argv[++i];
        }
        int r = set_opt(cmd, o, val);
        if (r) return r;
    }
    if (n_pos) *n_pos = np;
    return 0;
}

/* Values from the config file live as long as the program: the JSON is kept here and
 * never freed (a global, so leak checkers see it as reachable). */
static json_t *config_roots[4];

int cli_load_config(const char *cmd, const cli_opt *opts, const char *path)
{
    json_error_t err;
    json_t *root = kiln__json_load(path, 0, &err, "config");
    for (size_t i = 0; root && i < sizeof config_roots / sizeof config_roots[0]; i++)
        if (!config_roots[i]) {
            config_roots[i] = root;
            break;
        }
    if (!root || !json_is_object(root)) {
        if (!root && err.line < 0) fprintf(stderr, "kiln %s: %s\n", cmd, err.text);
        else fprintf(stderr, "kiln %s: config '%s': %s (line %d)\n", cmd, path, root ? "not a JSON object" : err.text,
                     err.line);
        return 2;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        const cli_opt *o = find_opt(opts, key, strlen(key));
        if (!o || !strcmp(key, "config")) {
            fprintf(stderr, "kiln %s: config '%s': unknown key '%s'\n", cmd, path, key);
            return 2;
        }
        char buf[64];
        const char *val = buf;
        if (json_is_string(v)) val = json_string_value(v);
        else if (json_is_integer(v)) snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(v));
        else if (json_is_real(v)) snprintf(buf, sizeof buf, "%.17g", json_real_value(v));
        else if (json_is_boolean(v)) snprintf(buf, sizeof buf, "%s", json_is_true(v) ? "true" : "false");
        else {
            fprintf(stderr, "kiln %s: config '%s': key '%s' has an unsupported type\n", cmd, path, key);
            return 2;
        }
        int r = set_opt(cmd, o, val);
        if (r) return r;
    }
    return 0;
}
