/* kiln info, tokenizer, plot, doctor. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli.h"
#include "kiln/ext.h"
#include "kiln/data.h"
#include "kiln/dist.h"
#include "kiln/io.h"
#include "kiln/metrics.h"
#include "kiln/tokenizer.h"

int cmd_info(int argc, char **argv)
{
    const cli_opt opts[] = {{NULL, 0, NULL, NULL}};
    const char *pos[1];
    int np = 0;
    int r = cli_parse("info", "CHECKPOINT.safetensors", opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np != 1) return cli_fail("info", "give one checkpoint file (see kiln info --help)");
    kiln_safetensors_t *f;
    if (kiln_safetensors_load(pos[0], &f) != KILN_OK) return cli_fail("info", NULL);
    printf("%s: %d tensors\n", pos[0], kiln_safetensors_count(f));
    static const char *keys[] = {"format", "step", "tokenizer", "config", "optimizer", NULL};
    for (int k = 0; keys[k]; k++) {
        const char *v = kiln_safetensors_meta(f, keys[k]);
        if (v) printf("  %-10s %s\n", keys[k], v);
    }
    int64_t total = 0;
    kiln_scope_begin();
    for (int i = 0; i < kiln_safetensors_count(f); i++) {
        kiln_tensor_t *t = kiln_safetensors_get(f, kiln_safetensors_name(f, i));
        char b[96];
        if (!t) {
            kiln_scope_end();
            kiln_safetensors_free(f);
            return cli_fail("info", NULL);
        }
        total += kiln_tensor_numel(t);
        printf("  %-40s %s\n", kiln_safetensors_name(f, i), kiln_tensor_describe(t, b, sizeof b));
    }
    kiln_scope_end();
    printf("  total %lld elements (%.2fM)\n", (long long)total, (double)total / 1e6);
    kiln_safetensors_free(f);
    return 0;
}

static int tok_train(int argc, char **argv)
{
    const char *data = kiln_env_or_default("KILN_DATA"), *out = "tokenizer.json";
    int64_t vocab = 1024;
    const cli_opt opts[] = {
        {"data", OPT_STRING, &data, "text file or folder"},
        {"vocab", OPT_INT, &vocab, "vocabulary size (>= 256)"},
        {"out", OPT_STRING, &out, "where to write the HuggingFace tokenizer.json"},
        {NULL, 0, NULL, NULL},
    };
    int r = cli_parse("tokenizer train", "[options]", opts, argc, argv, NULL, 0, NULL);
    if (r) return r == 1 ? 0 : 2;
    char *text;
    size_t len;
    kiln_tokenizer_t *t;
    if (kiln_text_read(data, &text, &len) != KILN_OK || kiln_tokenizer_train_bpe(text, len, (int)vocab, &t) != KILN_OK ||
        kiln_tokenizer_save(t, out) != KILN_OK)
        return cli_fail("tokenizer train", NULL);
    printf("wrote %s: %d tokens learned from %zu bytes of %s\n", out, kiln_tokenizer_vocab_size(t), len, data);
    free(text);
    kiln_tokenizer_free(t);
    return 0;
}

static int tok_encode(int argc, char **argv)
{
    const char *path = "byte", *text = NULL, *file = NULL;
    const cli_opt opts[] = {
        {"tokenizer", OPT_STRING, &path, "tokenizer.json, or byte"},
        {"text", OPT_STRING, &text, "text to encode"},
        {"file", OPT_STRING, &file, "a file whose bytes to encode (in place of --text)"},
        {NULL, 0, NULL, NULL},
    };
    int r = cli_parse("tokenizer encode", "--text TEXT | --file FILE [--tokenizer FILE]", opts, argc, argv, NULL, 0,
                      NULL);
    if (r) return r == 1 ? 0 : 2;
    if (!text == !file) return cli_fail("tokenizer encode", "give --text or --file");
    char *read = NULL;
    size_t n = text ? strlen(text) : 0, got = 0;
    if (file && kiln_text_read(file, &read, &n) != KILN_OK) return cli_fail("tokenizer encode", NULL);
    if (file) text = read;
    kiln_tokenizer_t *t;
    kiln_status s = strcmp(path, "byte") ? kiln_tokenizer_load(path, &t) : ((t = kiln_tokenizer_byte()) ? KILN_OK : kiln_last_status());
    if (s != KILN_OK) return cli_fail("tokenizer encode", NULL);
    int32_t *ids = NULL;
    if (kiln_tokenizer_encode_new(t, text, n, 0, &ids, &got) != KILN_OK) {
        kiln_tokenizer_free(t);
        free(read);
        return cli_fail("tokenizer encode", NULL);
    }
    for (size_t i = 0; i < got; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    free(read);
    kiln_tokenizer_free(t);
    return 0;
}

static int tok_decode(int argc, char **argv)
{
    const char *path = "byte";
    const cli_opt opts[] = {{"tokenizer", OPT_STRING, &path, "tokenizer.json, or byte"}, {NULL, 0, NULL, NULL}};
    const char *pos[4096];
    int np = 0;
    int r = cli_parse("tokenizer decode", "[--tokenizer FILE] ID...", opts, argc, argv, pos, 4096, &np);
    if (r) return r == 1 ? 0 : 2;
    kiln_tokenizer_t *t;
    kiln_status s = strcmp(path, "byte") ? kiln_tokenizer_load(path, &t) : ((t = kiln_tokenizer_byte()) ? KILN_OK : kiln_last_status());
    if (s != KILN_OK) return cli_fail("tokenizer decode", NULL);
    int32_t *ids = malloc(sizeof *ids * (size_t)(np + 1));
    for (int i = 0; ids && i < np; i++) {
        char *end;
        long v = strtol(pos[i], &end, 10);
        if (*end || end == pos[i]) return cli_fail("tokenizer decode", "token ids must be integers");
        ids[i] = (int32_t)v;
    }
    char *text;
    if (!ids || kiln_tokenizer_decode(t, ids, (size_t)np, &text) != KILN_OK) return cli_fail("tokenizer decode", NULL);
    printf("%s\n", text);
    free(text);
    free(ids);
    kiln_tokenizer_free(t);
    return 0;
}

int cmd_tokenizer(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "train")) return tok_train(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "encode")) return tok_encode(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "decode")) return tok_decode(argc - 1, argv + 1);
    bool help = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
    fprintf(help ? stdout : stderr,
            "usage: kiln tokenizer train|encode|decode [options]   (each takes --help)\n"
            "  train    learn a byte-level BPE from a corpus, saved as a HuggingFace tokenizer.json\n"
            "  encode   print the ids of --text\n"
            "  decode   print the text of ids\n");
    return help ? 0 : 2;
}

int cmd_plot(int argc, char **argv)
{
    const cli_opt opts[] = {{NULL, 0, NULL, NULL}};
    const char *pos[1];
    int np = 0;
    int r = cli_parse("plot", "RUN_DIR", opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np != 1) return cli_fail("plot", "give the run folder (see kiln plot --help)");
    char mpath[4096], spath[4096], ipath[4096];
    snprintf(mpath, sizeof mpath, "%s/%s", pos[0], RUN_METRICS);
    snprintf(spath, sizeof spath, "%s/%s", pos[0], RUN_CHART);
    snprintf(ipath, sizeof ipath, "%s/%s", pos[0], RUN_INFO);
    double baseline = NAN;
    json_t *info = json_load_file(ipath, 0, NULL);
    if (info && json_is_number(json_object_get(info, "unigram_entropy")))
        baseline = json_number_value(json_object_get(info, "unigram_entropy"));
    json_decref(info);
    kiln_metrics_row *rows;
    size_t n;
    if (kiln_metrics_read(mpath, &rows, &n) != KILN_OK ||
        kiln_metrics_plot_svg(rows, n, "kiln train: loss", baseline, "unigram baseline", spath) != KILN_OK)
        return cli_fail("plot", NULL);
    printf("wrote %s (%zu steps)\n", spath, n);
    free(rows);
    return 0;
}

/* How many of kiln's environment variables are set here. */
static int env_set_count(void)
{
    kiln_env_var v;
    int n = 0;
    for (int i = 0; kiln_env_var_at(i, &v); i++) n += v.value != NULL;
    return n;
}

/* s for a Markdown table cell: < > and | escaped. */
static void md_print(const char *s)
{
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", stdout);
        else if (*s == '>') fputs("&gt;", stdout);
        else if (*s == '|') fputs("\\|", stdout);
        else putchar(*s);
    }
}

/* kiln doctor --env [--markdown]: every KILN_* variable kiln reads, from its one table
 * (src/core/env.def); the Markdown form is docs/env.md's table. */
static int doctor_env(bool markdown)
{
    kiln_env_var v;
    if (markdown) {
        printf("| variable | type | default | read by | meaning |\n|---|---|---|---|---|\n");
        for (int i = 0; kiln_env_var_at(i, &v); i++) {
            printf("| `%s` | %s | ", v.name, v.type);
            if (*v.dflt == '(') md_print(v.dflt);
            else if (*v.dflt) printf("`%s`", v.dflt);
            else printf("(none)");
            printf(" | %s | ", v.who);
            md_print(v.help);
            printf(" |\n");
        }
        return 0;
    }
    int w = 8;
    for (int i = 0; kiln_env_var_at(i, &v); i++) w = (int)strlen(v.name) > w ? (int)strlen(v.name) : w;
    printf("%-*s  %-6s  %-12s  %s\n", w, "variable", "type", "value", "meaning (default; who reads it)");
    int bad = 0;
    for (int i = 0; kiln_env_var_at(i, &v); i++) {
        printf("%-*s  %-6s  %-12s  %s (default %s; %s)\n", w, v.name, v.type, v.value ? v.value : "-", v.help,
               *v.dflt ? v.dflt : "none", v.who);
        if (v.value && kiln_env_check(v.name) != KILN_OK) printf("%-*s  ^ %s\n", w, "", kiln_last_error()), bad++;
    }
    printf("%d variables, %d set here%s\n", kiln_env_count(), env_set_count(), bad ? ", some not valid (^)" : "");
    return 0;
}

/* The extension languages (kiln/ext.h) and whether each one's compiler is there. */
static void doctor_languages(void)
{
    kiln_ext_langs_t *t;
    if (kiln_ext_langs_load(NULL, &t) != KILN_OK) {
        printf("extension languages: FAIL %s\n", kiln_last_error());
        return;
    }
    printf("extension languages (kiln ext languages; docs/ext.md):\n");
    for (int i = 0; i < kiln_ext_langs_count(t); i++) {
        const kiln_ext_lang *l = kiln_ext_langs_at(t, i);
        char found[1200];
        if (!*l->command) printf("  %-8s %-10s handed to the %s backend when loaded\n", l->suffix, l->origin, l->backend);
        else if (kiln_ext_compiler_found(l, found, sizeof found))
            printf("  %-8s %-10s OK   %s\n", l->suffix, l->origin, found);
        else
            printf("  %-8s %-10s WARN %s not found: %s sources cannot be built here\n", l->suffix, l->origin, found,
                   l->suffix);
    }
    kiln_ext_langs_free(t);
}

int cmd_doctor(int argc, char **argv)
{
    const char *ops = NULL;
    bool env = false, markdown = false;
    const cli_opt opts[] = {
        {"ops", OPT_STRING, &ops, "print which ops DEVICE runs with its own kernels and which on the cpu"},
        {"env", OPT_FLAG, &env, "print every KILN_* environment variable kiln reads: type, value here, meaning, default"},
        {"markdown", OPT_FLAG, &markdown, "with --env: as a Markdown table (docs/env.md)"},
        {NULL, 0, NULL, NULL},
    };
    int r = cli_parse("doctor", "[--ops DEVICE] [--env [--markdown]]", opts, argc, argv, NULL, 0, NULL);
    if (r) return r == 1 ? 0 : 2;
    if (markdown && !env) return cli_fail("doctor", "--markdown goes with --env");
    if (env) return doctor_env(markdown);
    if (ops) {
        if (kiln_set_device(ops) != KILN_OK) return cli_fail("doctor", NULL);
        kiln_set_device("cpu");
        int count[4] = {0, 0, 0, 0};
        static const char *how[4] = {"not supported", "on the cpu (copies)", "native", "generated kernel"};
        printf("%-26s %s\n", "op", ops);
        for (int i = 0; i < kiln_op_count(); i++) {
            kiln_op_support k = kiln_device_op_support(ops, i);
            count[k]++;
            printf("%-26s %s\n", kiln_op_name(i), how[k]);
        }
        printf("%d ops: %d native, %d generated kernels, %d on the cpu with copies, %d not supported\n", kiln_op_count(),
               count[2], count[3], count[1], count[0]);
        return 0;
    }
    printf("kiln %s\nbuild: %s\nthreads: %d\ndevices:\n", kiln_version(), kiln_build_info(), kiln_num_threads());
    for (int i = 0; i < kiln_device_count(); i++) {
        char buf[512];
        printf("  %s\n", kiln_device_describe(i, buf, sizeof buf) ? buf : kiln_device_name(i));
    }
    printf("cuda: %s\n", kiln_cuda_status());
    char nccl[160];
    kiln_dist_nccl_version(nccl, sizeof nccl);
    printf("nccl: %s (collectives on cuda tensors)\n", nccl);
    char mpi[256];
    if (kiln_dist_mpi_version(mpi, sizeof mpi))
        printf("distributed: %s (kiln train under mpirun; docs/dist.md)\n", mpi);
    else
        printf("distributed: built without MPI (one process only; apt-get install libopenmpi-dev openmpi-bin)\n");
    doctor_languages();
    printf("optimization switches (KILN_OPT_<NAME>=0|1; the compiler's stages also KILN_COMPILE_DISABLE=<stage>,...):\n");
    int w = 0;
    for (int i = 0; i < kiln_opt_count(); i++) w = (int)strlen(kiln_opt_name(i)) > w ? (int)strlen(kiln_opt_name(i)) : w;
    for (int i = 0; i < kiln_opt_count(); i++)
        printf("  %-*s %s  %s\n", w, kiln_opt_name(i), kiln_opt_enabled(i) ? "on " : "off", kiln_opt_help(i));
    printf("environment: %d KILN_* variables read (kiln doctor --env lists them), %d set here", kiln_env_count(),
           env_set_count());
    kiln_env_var v;
    for (int i = 0, k = 0; kiln_env_var_at(i, &v); i++)
        if (v.value) printf("%s%s=%s", k++ ? ", " : ": ", v.name, v.value);
    printf("\n");
    return 0;
}
