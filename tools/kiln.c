/* kiln: train, sample and inspect models. Each subcommand is a row of one table. */
#include <float.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli.h"
#include "core/env.h"        /* kiln__edit_distance */
#include "core/parse.h"      /* the one strict number parser */
#include "core/threadpool.h" /* KILN__MAX_THREADS */
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
    {"import", cmd_import, "a Hugging Face folder or a GGUF file into a kiln run folder (import hf|gguf SRC RUN_DIR)"},
    {"export", cmd_export, "a kiln model as a Hugging Face folder or a GGUF file (export hf|gguf RUN_DIR OUT)"},
    {"quantize", cmd_quantize, "a model as a quantized GGUF file (quantize MODEL OUT.gguf --type q8_0|q4_0|...)"},
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
    const char *names[sizeof commands / sizeof commands[0]];
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) names[i] = commands[i].name;
    const char *near = cli_closest(argv[1], names, (int)(sizeof commands / sizeof commands[0]));
    if (near) fprintf(stderr, "kiln: unknown command '%s'; did you mean '%s'?\n\n", argv[1], near);
    else fprintf(stderr, "kiln: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

int cli_fail(const char *cmd, const char *msg)
{
    fprintf(stderr, "kiln %s: %s\n", cmd, msg ? msg : kiln_last_error());
    return 1;
}

const char *cli_closest(const char *typo, const char *const *names, int n)
{
    const char *best = NULL, *prefixed = NULL;
    int d = 99, starts = 0;
    size_t tl = strlen(typo);
    for (int i = 0; i < n; i++) {
        if (!*names[i]) continue;
        int di = kiln__edit_distance(typo, names[i]);
        if (di < d) d = di, best = names[i];
        if (tl >= 2 && !strncmp(names[i], typo, tl)) starts++, prefixed = names[i];
    }
    /* one edit, or a few that are fewer than half the name's letters (so "x" is not
     * taken for "lr") */
    if (best && (d == 1 || (d <= 3 && (size_t)d * 2 < strlen(best)))) return best;
    return starts == 1 ? prefixed : NULL;
}

/* The option called name[0..len) (an alias resolved to its option, with a note on
 * stderr once); NULL for none. Headings are not options. */
static const cli_opt *find_opt(const char *cmd, const cli_opt *opts, const char *name, size_t len)
{
    for (const cli_opt *o = opts; o->name; o++) {
        if (o->type == OPT_GROUP || strlen(o->name) != len || strncmp(o->name, name, len)) continue;
        if (o->type != OPT_ALIAS) return o;
        static const char *noted[8]; /* (by name: a command may parse its table more than once) */
        bool said = false;
        for (int i = 0; i < 8 && noted[i]; i++) said |= !strcmp(noted[i], o->name);
        for (int i = 0; i < 8 && !said; i++)
            if (!noted[i]) {
                noted[i] = o->name;
                break;
            }
        if (!said) fprintf(stderr, "kiln %s: --%s is now --%s (the old name still works, for now)\n", cmd, o->name, o->help);
        return find_opt(cmd, opts, o->help, strlen(o->help));
    }
    return NULL;
}

/* "unknown option" with the closest option's name when there is one. */
static void unknown_option(const char *cmd, const cli_opt *opts, const char *arg, const char *what)
{
    const char *names[256] = {0}, *now[256] = {0}; /* (an old name is offered as its new one) */
    int n = 0;
    for (const cli_opt *o = opts; o->name && n < 256; o++)
        if (o->type != OPT_GROUP) now[n] = o->type == OPT_ALIAS ? o->help : o->name, names[n++] = o->name;
    char typo[128];
    const char *bare = arg + strspn(arg, "-");
    snprintf(typo, sizeof typo, "%.*s", (int)strcspn(bare, "="), bare);
    const char *near = cli_closest(typo, names, n);
    for (int i = 0; near && i < n; i++)
        if (names[i] == near) near = now[i];
    if (near) fprintf(stderr, "kiln %s: unknown %s '%s'; did you mean '%s%s'? (see kiln %s --help)\n", cmd, what, arg,
                      strcmp(what, "option") ? "" : "--", near, cmd);
    else fprintf(stderr, "kiln %s: unknown %s '%s' (see kiln %s --help)\n", cmd, what, arg, cmd);
}

/* Two or three command lines for each verb's --help: one table, by verb. */
static const struct {
    const char *cmd, *text;
} examples[] = {
    {"train", "  kiln train --data my.txt --out runs/mine --steps 2000          train on your own text\n"
              "  kiln train --out runs/mine --resume --steps 4000               continue it, to 4000 steps\n"
              "  kiln train --arch llama --tokenizer bpe:4096 --data my.txt --precision bf16\n"},
    {"sample", "  kiln sample runs/mine --prompt \"Once upon a time\" --max-tokens 100\n"
               "  kiln sample ./my-hf-model --prompt \"The capital of France is\" --temperature 0\n"},
    {"serve", "  kiln serve runs/mine                        http://127.0.0.1:8000/ (the chat page) and /v1/...\n"
              "  kiln serve ./my-hf-model --port 0 --api-key secret\n"
              "  kiln serve runs/mine --log-requests 2>>serve.log   a line a request (docs/serve.md)\n"},
    {"import", "  kiln import hf ./my-hf-model runs/imported\n  kiln import gguf model-Q8_0.gguf runs/imported\n"},
    {"quantize", "  kiln quantize runs/mine mine-q8_0.gguf\n  kiln quantize ./my-hf-model model-q4_0.gguf --type q4_0\n"},
    {"export", "  kiln export hf runs/mine ./mine-hf --dtype bf16\n"
               "  kiln export gguf runs/mine mine.gguf --dtype q8_0\n"},
    {"tokenizer", "  kiln tokenizer train --data my.txt --vocab 4096 --out tokenizer.json\n"},
    {"doctor", "  kiln doctor                 the rows, WARN and FAIL first\n"
               "  kiln doctor --json          for scripts\n"},
};

/* What each number option may hold: one row per option name, for every command that
 * has one, or "COMMAND/name" where a command's option of that name means another thing
 * (sample's --max-tokens may be 0, serve's may not). Every value goes through core's
 * strict parser (core/parse.h): the whole text, decimal, finite, in range, so that
 * --threads -5, --temperature nan, --lr -1 and 0x10 are refused with the option named
 * first. A command with a number option that no row covers refuses to run (cli_parse):
 * an option added without its range fails every test that runs the command. */
#define I(name, lo, hi) {name, false, lo, hi, 0, 0, 0}
#define R(name, lo, hi, flags) {name, true, 0, 0, lo, hi, flags}
#define BIG ((int64_t)1 << 24)
#define HUGE_COUNT ((int64_t)1000000000000) /* a trillion steps */
static const struct {
    const char *name;
    bool real;
    int64_t lo, hi;   /* a whole number's */
    double rlo, rhi;  /* a real's */
    unsigned flags;   /* KILN__PARSE_ABOVE_LO, _BELOW_HI */
} ranges[] = {
    I("threads", 0, KILN__MAX_THREADS), I("seed", INT64_MIN, INT64_MAX),
    /* the model */
    I("layers", 1, 65536), I("heads", 1, 65536), I("kv-heads", 0, 65536), I("width", 1, BIG), I("context", 1, BIG),
    I("ffn", 0, BIG), I("vocab", 1, BIG), I("tokenizer train/vocab", 256, BIG), I("experts", 0, 65536),
    I("shared-experts", 0, 65536), I("experts-per-token", 1, 65536), I("dense-layers", 0, 65536), I("groups", 1, 65536),
    I("top-groups", 1, 65536), I("mla-kv-rank", 0, BIG), I("mla-q-rank", 0, BIG), I("mla-rope-dim", 0, BIG),
    I("mla-nope-dim", 0, BIG), I("mla-v-dim", 0, BIG), I("expert-ffn", 0, BIG), R("dropout", 0, 1, KILN__PARSE_BELOW_HI),
    R("bias-speed", 0, DBL_MAX, 0), R("balance-loss", 0, DBL_MAX, 0), R("capacity", 0, DBL_MAX, 0),
    /* training */
    I("batch", 1, BIG), I("accum", 1, BIG), I("steps", 0, HUGE_COUNT), I("warmup", 0, HUGE_COUNT),
    I("eval-every", 0, HUGE_COUNT), I("eval-batches", 1, BIG), I("save-every", 0, HUGE_COUNT),
    I("log-every", 1, HUGE_COUNT), R("lr", 0, DBL_MAX, KILN__PARSE_ABOVE_LO), R("min-lr", 0, DBL_MAX, 0),
    R("wd", 0, DBL_MAX, 0), R("momentum", 0, 1, KILN__PARSE_BELOW_HI), R("clip", 0, DBL_MAX, 0),
    R("val-fraction", 0, 1, KILN__PARSE_BELOW_HI), R("loss-scale", 1, 1e30, 0), R("bucket-mb", 0, 1 << 20, 0),
    /* sampling and serving */
    I("sample/max-tokens", 0, BIG), I("top-k", 0, BIG), R("temperature", 0, DBL_MAX, 0),
    R("top-p", 0, 1, KILN__PARSE_ABOVE_LO), R("min-p", 0, 1, 0), R("presence-penalty", -2, 2, 0),
    R("frequency-penalty", -2, 2, 0), R("repetition-penalty", 0, 100, KILN__PARSE_ABOVE_LO), I("port", 0, 65535), I("max-batch", 1, 4096), I("max-queue", 0, 1 << 20),
    I("max-step-tokens", 2, 1 << 20), I("kv-memory", 1, BIG), I("block-len", 1, 1024),
    I("max-body", 1, (int64_t)1 << 32), R("timeout", 0, DBL_MAX, KILN__PARSE_ABOVE_LO), I("idle-timeout", 1, 86400),
    I("max-tokens", 1, BIG), I("http-threads", 1, 1024),
};
#undef I
#undef R

/* The index of option o's row for command cmd (its own "cmd/name" row first), -1 for none. */
static int range_of(const char *cmd, const cli_opt *o)
{
    int any = -1;
    size_t n = strlen(cmd);
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        const char *r = ranges[i].name, *slash = strrchr(r, '/');
        if (slash && (size_t)(slash - r) == n && !strncmp(r, cmd, n) && !strcmp(slash + 1, o->name)) return (int)i;
        if (!slash && !strcmp(r, o->name)) any = (int)i;
    }
    return any;
}

/* Whether flag o is a negation: named no-X, with the destination of a flag X. */
static bool negates(const cli_opt *opts, const cli_opt *o)
{
    if (o->type != OPT_FLAG || strncmp(o->name, "no-", 3)) return false;
    for (const cli_opt *a = opts; a->name; a++)
        if (a->type == OPT_FLAG && a->dst == o->dst && !strcmp(a->name, o->name + 3)) return true;
    return false;
}

/* what: "--steps" from the command line, "config 'x.json': steps" from a config file. */
static int set_opt(const char *cmd, const cli_opt *opts, const cli_opt *o, const char *val, const char *what)
{
    int r = o->type == OPT_INT || o->type == OPT_DOUBLE ? range_of(cmd, o) : -1;
    switch (o->type) {
    case OPT_INT:
        if (r >= 0 && kiln__parse_i64(val, ranges[r].lo, ranges[r].hi, what, (int64_t *)o->dst) == KILN_OK) return 0;
        break;
    case OPT_DOUBLE:
        if (r >= 0 && kiln__parse_f64(val, ranges[r].rlo, ranges[r].rhi, ranges[r].flags, what, (double *)o->dst) ==
                          KILN_OK)
            return 0;
        break;
    case OPT_STRING:
        *(const char **)o->dst = val;
        return 0;
    case OPT_FLAG:
        if (!strcmp(val, "true") || !strcmp(val, "1")) *(bool *)o->dst = !negates(opts, o);
        else if (!strcmp(val, "false") || !strcmp(val, "0")) *(bool *)o->dst = negates(opts, o);
        else {
            kiln_error(KILN_ERR_ARG, "%s must be true or false, got '%s'", what, val);
            break;
        }
        return 0;
    case OPT_GROUP: /* (find_opt returns neither) */
    case OPT_ALIAS: kiln_error(KILN_ERR_INTERNAL, "%s is not an option", what); break;
    }
    fprintf(stderr, "kiln %s: %s\n", cmd, kiln_last_error());
    return 2;
}

/* Refuses a table with a number option that has no range row (above). */
static bool ranges_cover(const char *cmd, const cli_opt *opts)
{
    for (const cli_opt *o = opts; o->name; o++)
        if ((o->type == OPT_INT || o->type == OPT_DOUBLE) && range_of(cmd, o) < 0) {
            fprintf(stderr, "kiln %s: internal: the option --%s has no range in tools/kiln.c's table\n", cmd, o->name);
            return false;
        }
    return true;
}

static void print_help(const char *cmd, const char *usage_line, const cli_opt *opts)
{
    printf("usage: kiln %s %s\n\n%s", cmd, usage_line, opts[0].name && opts[0].type == OPT_GROUP ? "" : "options:\n");
    for (const cli_opt *o = opts; o->name; o++) {
        if (o->type == OPT_GROUP) {
            printf("%s%s:\n", o == opts ? "" : "\n", o->help);
            continue;
        }
        if (o->type == OPT_ALIAS) continue; /* (listed beside the option it names) */
        char def[128] = ""; /* (none where the help says its own default) */
        bool said = strstr(o->help, "(default") != NULL;
        int r = o->type == OPT_INT || o->type == OPT_DOUBLE ? range_of(cmd, o) : -1;
        char range[96] = "";
        if (r >= 0 && ranges[r].real) kiln__describe_f64(ranges[r].rlo, ranges[r].rhi, ranges[r].flags, range, sizeof range);
        else if (r >= 0) kiln__describe_i64(ranges[r].lo, ranges[r].hi, range, sizeof range);
        if (o->type == OPT_INT) snprintf(def, sizeof def, " (default %lld; %s)", (long long)*(int64_t *)o->dst, range);
        else if (o->type == OPT_DOUBLE) snprintf(def, sizeof def, " (default %g; %s)", *(double *)o->dst, range);
        else if (o->type == OPT_STRING && *(const char **)o->dst && !said) {
            char shown[48];
            size_t k = 0;
            for (const char *c = *(const char **)o->dst; *c && k + 3 < 41; c++) /* "\n" for a newline */
                if (*c == '\n') shown[k++] = '\\', shown[k++] = 'n';
                else if ((unsigned char)*c < 0x20) shown[k++] = '?';
                else shown[k++] = *c;
            shown[k] = '\0';
            snprintf(def, sizeof def, " (default %s)", shown);
        }
        char was[80] = "";
        for (const cli_opt *a = opts; a->name; a++)
            if (a->type == OPT_ALIAS && !strcmp(a->help, o->name)) snprintf(was, sizeof was, " (was --%s)", a->name);
        printf("  --%-18s %s%s%s\n", o->name, o->help, def, was);
    }
    printf("  --%-18s %s\n", "help", "show this help");
    for (size_t i = 0; i < sizeof examples / sizeof examples[0]; i++)
        if (!strcmp(examples[i].cmd, cmd)) printf("\nexamples:\n%s", examples[i].text);
}

int cli_parse(const char *cmd, const char *usage_line, const cli_opt *opts, int argc, char **argv, const char **pos,
              int max_pos, int *n_pos)
{
    int np = 0;
    if (!ranges_cover(cmd, opts)) return 2;
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
        const cli_opt *o = find_opt(cmd, opts, name, eq ? (size_t)(eq - name) : strlen(name));
        if (!o) {
            unknown_option(cmd, opts, a, "option");
            return 2;
        }
        const char *val = eq ? eq + 1 : NULL;
        if (!val && o->type == OPT_FLAG) {
            *(bool *)o->dst = !negates(opts, o);
            continue;
        }
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kiln %s: --%s needs a value\n", cmd, o->name);
                return 2;
            }
            val = argv[++i];
        }
        char what[64];
        snprintf(what, sizeof what, "--%s", o->name);
        int r = set_opt(cmd, opts, o, val, what);
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
    if (!ranges_cover(cmd, opts)) return 2;
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
        const cli_opt *o = find_opt(cmd, opts, key, strlen(key));
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
        char what[512];
        snprintf(what, sizeof what, "config '%s': %s", path, key);
        int r = set_opt(cmd, opts, o, val, what);
        if (r) return r;
    }
    return 0;
}
